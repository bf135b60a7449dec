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
    # the 405B as an FP8 checkpoint declares itself (a quantization_config: vLLM allocates FP8 weights as it builds the
    # model, 95.5 GiB a GPU at TP 4; a bf16 checkpoint with `quantization: fp8` is allocated in bf16 first)
    "llama-3.1-405b-fp8": {
        **_LLAMA31_COMMON,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_hidden_layers": 126,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"},
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
# what `summit make-model-config --fp8` adds to a preset: an FP8 checkpoint's own declaration
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def get_preset(name: str) -> dict:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        known = ", ".join(sorted(PRESETS) + sorted(ALIASES))
        raise KeyError(f"unknown model preset {name!r}; known presets: {known}")
    return dict(PRESETS[key])
