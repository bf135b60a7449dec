"""Models made locally: a tiny random-weight Llama with a trained tokenizer, LoRA adapters for it, and real-shape
configs.

Nothing here downloads anything. The tiny model is saved exactly like a Hugging Face checkpoint
(config.json, safetensors weights, tokenizer.json, tokenizer_config.json with a chat template), so
vLLM loads it through the same code path as a real Llama checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.config.presets import FP8_QUANTIZATION_CONFIG, fbgemm_quantization_config, get_preset

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
PYTHON_TAG, EOM = (
    "<|python_tag|>",
    "<|eom_id|>",
)  # Llama 3.1's tool-call tokens (vLLM's llama3_json parser needs the first)
SPECIAL_TOKENS = [BOS, EOS, HEADER_START, HEADER_END, EOT, PYTHON_TAG, EOM]

# Llama-3 style template: bos, then one header + body + <|eot_id|> per message.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

_WORDS = (
    "the a of to and in is for on with as by at from that this it be are was were model models large "
    "language inference server request requests token tokens prompt prompts cache memory gpu gpus node "
    "nodes tensor pipeline parallel parallelism batch batches stream streaming latency throughput serve "
    "ray cluster replica replicas engine weights layer layers attention key value head heads summit "
    "mountain climb route weather north south east west river city question answer what where when "
    "why how who which one two three four five six seven eight nine ten hundred thousand million "
    "billion fast slow big small high low good new old first last long short time day year people"
).split()


def _corpus(lines: int = 4000) -> list[str]:
    """A fixed pseudo-random English-like corpus (a linear congruential generator: no RNG state)."""
    state, out = 12345, []
    for _ in range(lines):
        words = []
        for _ in range(12):
            state = (1103515245 * state + 12345) % (1 << 31)
            words.append(_WORDS[state % len(_WORDS)])
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + ". What is 42? San Francisco, 2024!")
    return out


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on the fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Like Llama 3: plain encodes start with <|begin_of_text|>; the chat template writes its own.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _pad_vocab(tokenizer_json: dict, vocab_size: int) -> None:
    """Grow a BPE vocabulary to `vocab_size` with reserved entries that no merge produces."""
    vocab = tokenizer_json["model"]["vocab"]
    i = 0
    while len(vocab) < vocab_size:
        vocab[f"<|reserved_{i}|>"] = len(vocab)
        i += 1


def save_tokenizer(tok, out: Path, model_max_length: int, vocab_size: int | None = None) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; return the special token ids."""
    data = json.loads(tok.to_str())
    if vocab_size is not None:
        _pad_vocab(data, vocab_size)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": EOS,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOT, "pad_token": EOS}, indent=2)
    )
    return {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}


# The architectures `summit make-tiny-model --arch` writes: the tiny Llama's shapes under each family's config
# (Qwen2: biased q/k/v; Mixtral: a mixture of 4 experts, 2 a token, in place of the MLP).
ARCHS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
}


def eos_ids(ids: dict[str, int]) -> list[int]:
    """Llama 3.1's stop tokens: end of text, end of message (after a tool call), end of turn."""
    return [ids[EOS], ids[EOM], ids[EOT]]


def tiny_llama_config(
    vocab_size: int, ids: dict[str, int], max_len: int, hidden_size: int = 128, arch: str = "llama"
) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "bos_token_id": ids[BOS],
        "eos_token_id": eos_ids(ids),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **ARCHS[arch],
    }


def _random_weights(cfg: dict, seed: int) -> dict:
    """Llama weights with the names and shapes of a Hugging Face checkpoint."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": rand(vocab, h, scale=1.0),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(vocab, h, scale=0.5),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": rand(q, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, q),
            }
        )
        if cfg["model_type"] == "qwen2":
            weights.update(
                {
                    p + "self_attn.q_proj.bias": rand(q),
                    p + "self_attn.k_proj.bias": rand(kv),
                    p + "self_attn.v_proj.bias": rand(kv),
                }
            )
        if cfg["model_type"] == "mixtral":
            weights[p + "block_sparse_moe.gate.weight"] = rand(cfg["num_local_experts"], h, scale=0.5)
            for e in range(cfg["num_local_experts"]):
                x = f"{p}block_sparse_moe.experts.{e}."
                weights.update(
                    {x + "w1.weight": rand(inter, h), x + "w2.weight": rand(h, inter), x + "w3.weight": rand(inter, h)}
                )
        else:
            weights.update(
                {
                    p + "mlp.gate_proj.weight": rand(inter, h),
                    p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter),
                }
            )
    return weights


def make_tiny_model(
    out_dir: str | Path, seed: int = 0, max_len: int = 2048, hidden_size: int = 128, arch: str = "llama"
) -> Path:
    """Write the tiny model to `out_dir` (deterministic for a given seed) and return the path.

    `hidden_size` 256 gives head_dim 64, which GPU attention kernels (FlashAttention 3) support; 128 is the CPU default.
    """
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    ids = save_tokenizer(tok, out, model_max_length=max_len)
    cfg = tiny_llama_config(tok.get_vocab_size(), ids, max_len, hidden_size, arch)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids[BOS], "eos_token_id": eos_ids(ids)}, indent=2)
    )
    save_file(_random_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_model_config(preset: str, out_dir: str | Path, fp8: str | None = None, layers: int | None = None) -> Path:
    """Write a real-shape config.json and a tokenizer whose vocabulary has the model's `vocab_size`. `fp8`: with the
    quantization_config of an FP8 checkpoint, so that vLLM allocates FP8 weights directly: "fp8" (every linear layer,
    as vLLM's fp8 method writes it) or "fbgemm" (Meta's own FP8 checkpoints, exactly: attention and the first and
    last layer's feed-forward stay bf16). `layers`: fewer layers at full width (a depth-reduced model: what one GPU
    holds of a 405B), the quantization_config following the same pattern over them.

    For vLLM's `load_format: dummy`: no weights are written.
    """
    cfg = get_preset(preset)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if fp8 == "fbgemm" or (fp8 is None and "quantization_config" in cfg):
        cfg["quantization_config"] = fbgemm_quantization_config(cfg["num_hidden_layers"])
    elif fp8 == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    elif fp8 is not None:
        raise ValueError(f"--fp8 {fp8!r}: use fp8 or fbgemm")
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    ids = save_tokenizer(tok, out, model_max_length=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"])
    cfg.update(bos_token_id=ids[BOS], eos_token_id=eos_ids(ids))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_tiny_lora(base_dir: str | Path, out_dir: str | Path, seed: int = 1, rank: int = 8) -> Path:
    """A real PEFT LoRA adapter for the tiny model under `base_dir` (q/k/v/o projections of every layer), random
    A and B (PEFT starts B at zero, which would leave the base model's output unchanged), deterministic per seed."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(base_dir).expanduser() / "config.json").read_text())
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    outs = {
        "q_proj": cfg["num_attention_heads"] * hd,
        "k_proj": cfg["num_key_value_heads"] * hd,
        "v_proj": cfg["num_key_value_heads"] * hd,
        "o_proj": h,
    }
    ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": cfg["num_attention_heads"] * hd}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(cfg["num_hidden_layers"]):
        for module, out_features in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, ins[module], generator=gen) * 0.3
            weights[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.3
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(Path(base_dir).expanduser()),
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "target_modules": sorted(outs),
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            },
            indent=2,
        )
    )
    return out
