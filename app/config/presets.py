"""Real architecture shapes of the models Summit ships configs for (from their published config.json)."""

from __future__ import annotations

_LLAMA31_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {
        **_LLAMA31_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
    },
    "llama-3.1-70b": {
        **_LLAMA31_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
    },
    "llama-3.1-405b": {
        **_LLAMA31_COMMON,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_hidden_layers": 126,
    },
    # Meta's own FP8 405B (Meta-Llama-3.1-405B-Instruct-FP8): its config.json declares fbgemm_fp8 (FP8 row-wise) for
    # the feed-forward layers of all but the first and last layer; attention and those two layers stay bf16. vLLM
    # allocates the FP8 weights as it builds the model (a bf16 checkpoint with `quantization: fp8` is allocated in
    # bf16 first, then quantized).
    "llama-3.1-405b-fp8": {
        **_LLAMA31_COMMON,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_hidden_layers": 126,
    },
    # a draft model for the 8B/70B/405B (same tokenizer and vocabulary): speculative decoding's `draft_model`
    "llama-3.2-1b": {
        **_LLAMA31_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {**_LLAMA31_COMMON["rope_scaling"], "factor": 32.0},
    },
    # the seeds' throughput note (Llama 2 7B on 1, 2 and 4 A100s): checks `summit plan --throughput`
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "vocab_size": 32000,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    },
}

ALIASES = {"8b": "llama-3.1-8b", "70b": "llama-3.1-70b", "405b": "llama-3.1-405b"}
# what `summit make-model-config --fp8` adds to a preset: an FP8 checkpoint's own declaration, as vLLM's `fp8` method
# writes it (every linear layer in FP8, dynamic activation scales)
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}
FBGEMM_PRESETS = {"llama-3.1-405b-fp8"}  # presets of Meta's FP8 checkpoints: fbgemm_fp8


def fbgemm_quantization_config(num_layers: int) -> dict:
    """The quantization_config of Meta's FP8 Llama 3.1 checkpoints (fbgemm_fp8): every layer's attention projections,
    the first and last layer's feed-forward projections and the lm_head are not converted (Llama 3 paper, section
    6.2: attention and the first and last Transformer layers stay in bf16; dynamic scales capped at 1200)."""
    kept = []
    for i in range(num_layers):
        if i in (0, num_layers - 1):
            kept += [f"model.layers.{i}.mlp.{p}_proj" for p in ("down", "gate", "up")]
        kept += [f"model.layers.{i}.self_attn.{p}_proj" for p in ("k", "o", "q", "v")]
    return {"activation_scale_ub": 1200.0, "modules_to_not_convert": [*kept, "lm_head"], "quant_method": "fbgemm_fp8"}


def get_preset(name: str) -> dict:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        known = ", ".join(sorted(PRESETS) + sorted(ALIASES))
        raise KeyError(f"unknown model preset {name!r}; known presets: {known}")
    preset = dict(PRESETS[key])
    if key in FBGEMM_PRESETS:
        preset["quantization_config"] = fbgemm_quantization_config(preset["num_hidden_layers"])
    return preset
