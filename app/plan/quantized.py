"""What a quantized checkpoint's config.json says of its weights' size: the dtype its quantization_config stores
(fp8, int4) and the linear modules it keeps in 16 bits (Meta's FP8 405B: every layer's attention and the first and
last layer's feed-forward), as vLLM reads them (`modules_to_not_convert` for fbgemm_fp8, `ignored_layers` for fp8)."""

from __future__ import annotations

import re

# quantization methods (engine_kwargs.quantization, a checkpoint's quant_method) by the size of the weights they store
FP8_METHODS = {"fp8", "fbgemm_fp8", "modelopt", "ptpc_fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_channel"}
INT4_METHODS = {"awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "bitsandbytes", "marlin"}
_KEPT_MODULE = re.compile(r"(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")


def kept_16bit(text: dict, cfg: dict) -> tuple[tuple[int, int], ...]:
    """(layer, parameters) of the linear modules a quantized checkpoint does not convert: `modules_to_not_convert`
    (fbgemm_fp8) or `ignored_layers` (fp8), as vLLM skips them."""
    quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
    names = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or []
    h, inter = text.get("hidden_size") or 0, text.get("intermediate_size") or 0
    heads = text.get("num_attention_heads") or 1
    head_dim = text.get("head_dim") or h // heads
    q, kv = heads * head_dim, (text.get("num_key_value_heads") or heads) * head_dim
    size = {"q": h * q, "k": h * kv, "v": h * kv, "o": q * h, "gate": h * inter, "up": h * inter, "down": inter * h}
    kept: dict[int, int] = {}
    for name in names:
        if match := _KEPT_MODULE.search(name):
            kept[int(match.group(1))] = kept.get(int(match.group(1)), 0) + size[match.group(3)]
    return tuple(sorted(kept.items()))


def checkpoint_dtype(cfg: dict) -> str | None:
    """The weights' dtype a checkpoint's own quantization_config declares (fp8, int4), or None."""
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") in FP8_METHODS:
        return "fp8"
    if quant.get("quant_method") in INT4_METHODS or quant.get("bits") == 4:
        return "int4"
    return None
