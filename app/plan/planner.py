"""Capacity planning (pure): weights + KV cache → GPUs, TP / PP / nodes for a Llama/Mistral/Qwen-style model.

Units: weights in decimal GB (as model cards and the seed workshop's table quote them), KV cache and GPU memory in
GiB (as `nvidia-smi` and vLLM's logs do). Budget of one GPU, the same way vLLM sizes it:

    total × gpu_memory_utilization (0.9)  −  headroom  =  room for this GPU's weights + its KV cache

headroom = 1.5 GiB fixed (CUDA context, cuBLAS workspace, NCCL buffers, CUDA graphs) + the activations of one
prefill chunk (max_num_batched_tokens × (hidden + 2 × intermediate / TP) × 2 B) + the sampler's fp32 logits
(max_num_seqs × vocab × 4 B). A layout fits when the heaviest pipeline stage's weights / TP plus the KV of one
full-context sequence on that GPU fit the room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from app.config.presets import ALIASES, PRESETS, get_preset
from app.plan.quantized import checkpoint_dtype, kept_16bit

GB = 10**9
GiB = 1 << 30
WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int4": 0.5, "fp32": 4.0}
KV_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
# Total memory as nvidia-smi reports it (MiB).
GPUS_MIB = {"h100-80gb": 81559, "h200-141gb": 143771, "a100-40gb": 40960, "a100-80gb": 81920}
NOMINAL_PARAMS = {"llama-3.1-8b": 8e9, "llama-3.1-70b": 70e9, "llama-3.1-405b": 405e9, "llama-3.1-405b-fp8": 405e9}
DEFAULT_GPU_UTIL = 0.9
FIXED_OVERHEAD = int(1.5 * GiB)
MAX_PIPELINE = 64


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs from a config.json."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int | None = None
    nominal_params: float | None = None
    num_experts: int = 0  # a mixture of experts (Mixtral): experts per layer in place of the MLP; 0 = dense
    experts_per_token: int = 0
    # a quantized checkpoint's linear layers kept in 16 bits ((layer, parameters), from its quantization_config:
    # Meta's FP8 405B keeps every layer's attention and the first and last layer's feed-forward in bf16)
    kept_16bit: tuple[tuple[int, int], ...] = ()
    checkpoint_dtype: str | None = None  # what the checkpoint's quantization_config stores its weights in (fp8, int4)

    @classmethod
    def from_config(cls, cfg: dict, name: str = "custom", nominal_params: float | None = None) -> ModelShape:
        """From a Hugging Face config.json dict (Llama, Mistral, Qwen2 style; Mixtral's mixture of experts)."""
        outer, cfg = cfg, cfg.get("text_config", cfg)
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
            if cfg.get(k) is None
        ]
        if missing:
            raise ValueError(f"config.json of {name} lacks {', '.join(missing)}: not a Llama/Mistral/Qwen-style model")
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            name=name,
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or cfg.get("model_type") == "qwen2",  # Qwen2 always has q/k/v biases
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            nominal_params=nominal_params,
            num_experts=cfg.get("num_local_experts") or 0,
            experts_per_token=cfg.get("num_experts_per_tok") or 0,
            kept_16bit=kept_16bit(cfg, outer),
            checkpoint_dtype=checkpoint_dtype(outer) or checkpoint_dtype(cfg),
        )

    @property
    def layer_params(self) -> int:
        return self._layer_params(self.num_experts)

    def _layer_params(self, experts: int) -> int:
        """A layer's parameters with `experts` experts' MLPs (0: the dense MLP) and, for an MoE, its router."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * inter + (2 * inter + h if self.mlp_bias else 0)
        if self.num_experts:
            mlp = experts * mlp + self.num_experts * h
        return attention + mlp + 2 * h  # + input and post-attention RMSNorm

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all of them for a dense model, `experts_per_token` experts of an MoE
        (what a decode step reads per token at small batch; memory holds `params`)."""
        matrices = 1 if self.tie_word_embeddings else 2
        layer = self._layer_params(self.experts_per_token) if self.num_experts else self.layer_params
        return self.num_layers * layer + matrices * self.vocab_params + self.hidden_size

    @property
    def vocab_params(self) -> int:
        """One vocab × hidden matrix (the embedding; the lm_head is another unless tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        matrices = 1 if self.tie_word_embeddings else 2
        return self.num_layers * self.layer_params + matrices * self.vocab_params + self.hidden_size

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """K and V of every layer: layers × 2 × kv_heads × head_dim × bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * KV_BYTES[kv_dtype]


def load_shape(model: str, config: dict | None = None) -> ModelShape:
    """A preset name (`llama-3.1-70b`, `70b`) or, with `config`, that config.json dict named `model`."""
    if config is not None:
        return ModelShape.from_config(config, name=model)
    key = ALIASES.get(model.lower(), model.lower())
    if key not in PRESETS:
        get_preset(model)  # raises KeyError naming the known presets
    return ModelShape.from_config(get_preset(key), name=key, nominal_params=NOMINAL_PARAMS.get(key))


def weight_bytes(shape: ModelShape, dtype: str) -> float:
    """Bytes of the weights as vLLM loads them: quantized (fp8, int4) linear layers, but those the checkpoint keeps
    in 16 bits (`kept_16bit`); embeddings, lm_head and norms stay 16-bit."""
    per = _dtype_bytes(dtype)
    return layers_bytes(shape, dtype, range(shape.num_layers)) + _outside_layers(shape) * max(per, 2.0)


def _outside_layers(shape: ModelShape) -> int:
    """Parameters outside the transformer layers' linear modules: embeddings, lm_head, norms."""
    return shape.params - shape.num_layers * (shape.layer_params - 2 * shape.hidden_size)


def layers_bytes(shape: ModelShape, dtype: str, layers) -> float:
    """Bytes of the linear modules of `layers` (indices) in `dtype`, those the checkpoint keeps at 16 bits so."""
    per = _dtype_bytes(dtype)
    linear = shape.layer_params - 2 * shape.hidden_size
    kept = dict(shape.kept_16bit) if per < 2.0 else {}
    return sum(linear * per + kept.get(i, 0) * (2.0 - per) for i in layers)


def nominal_weight_bytes(params: float, dtype: str) -> float:
    """The model card's (and the seed workshop's) figure: nominal parameters × bytes per parameter."""
    return params * _dtype_bytes(dtype)


def _dtype_bytes(dtype: str) -> float:
    if dtype not in WEIGHT_BYTES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(WEIGHT_BYTES)}")
    return WEIGHT_BYTES[dtype]


def kv_bytes(shape: ModelShape, tokens: int, kv_dtype: str = "bf16") -> int:
    return shape.kv_bytes_per_token(kv_dtype) * tokens


def gpu_bytes(gpu: str) -> int:
    if gpu not in GPUS_MIB:
        raise ValueError(f"gpu {gpu!r}: use one of {', '.join(GPUS_MIB)}")
    return GPUS_MIB[gpu] << 20


@dataclass(frozen=True)
class Budget:
    """One GPU's memory budget and the serving settings that shape it."""

    gpu: str = "h100-80gb"
    gpu_memory_utilization: float = DEFAULT_GPU_UTIL
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def headroom(self, shape: ModelShape, tp: int) -> int:
        activations = self.max_num_batched_tokens * (shape.hidden_size + 2 * shape.intermediate_size // tp) * 2
        logits = self.max_num_seqs * shape.vocab_size * 4
        return FIXED_OVERHEAD + activations + logits

    def room(self, shape: ModelShape, tp: int) -> int:
        """Bytes left on one GPU for its weights and KV cache."""
        return int(gpu_bytes(self.gpu) * self.gpu_memory_utilization) - self.headroom(shape, tp)


@dataclass(frozen=True)
class PerGpu:
    weights: float
    kv: float
    room: int

    @property
    def shortfall(self) -> float:
        return max(0.0, self.weights + self.kv - self.room)


def per_gpu(shape: ModelShape, dtype: str, kv_dtype: str, tokens: int, tp: int, pp: int, budget: Budget) -> PerGpu:
    """Weights and KV (one `tokens`-long sequence) on the busiest GPU of a TP × PP layout."""
    layers = math.ceil(shape.num_layers / pp)
    if pp == 1:
        stage_weights = weight_bytes(shape, dtype)
    else:  # heaviest stage: its layers plus one vocab matrix (embedding on the first, lm_head on the last)
        per = _dtype_bytes(dtype)
        stages = [range(s * layers, min((s + 1) * layers, shape.num_layers)) for s in range(pp)]
        norms = layers * 2 * shape.hidden_size * max(per, 2.0)
        stage_weights = max(layers_bytes(shape, dtype, r) for r in stages) + norms + shape.vocab_params * max(per, 2.0)
    kv_heads = math.ceil(shape.num_kv_heads / tp)  # TP > kv_heads replicates heads: each rank keeps one
    kv = layers * 2 * kv_heads * shape.head_dim * KV_BYTES[kv_dtype] * tokens
    return PerGpu(stage_weights / tp, kv, budget.room(shape, tp))


def valid_tp_sizes(shape: ModelShape, gpus_per_node: int) -> list[int]:
    """Powers of two up to a node that split the attention heads evenly (and the KV heads, or replicate them)."""
    sizes = [1 << i for i in range(gpus_per_node.bit_length()) if 1 << i <= gpus_per_node]
    return [
        t for t in sizes if shape.num_heads % t == 0 and (shape.num_kv_heads % t == 0 or t % shape.num_kv_heads == 0)
    ]


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)


def suggest_layout(
    shape: ModelShape, dtype: str, kv_dtype: str, tokens: int, budget: Budget, gpus_per_node: int = 8
) -> Layout | None:
    """Smallest TP inside one node that fits; else full-node TP × as many PP stages (nodes) as needed."""
    sizes = valid_tp_sizes(shape, gpus_per_node)
    for tp in sizes:
        if per_gpu(shape, dtype, kv_dtype, tokens, tp, 1, budget).shortfall == 0:
            return Layout(tp, 1, gpus_per_node)
    tiling = [t for t in sizes if gpus_per_node % t == 0]
    if not tiling:
        return None
    tp = max(tiling)
    for pp in range(2, MAX_PIPELINE + 1):
        if per_gpu(shape, dtype, kv_dtype, tokens, tp, pp, budget).shortfall == 0:
            return Layout(tp, pp, gpus_per_node)
    return None


@dataclass(frozen=True)
class SizingPlan:
    shape: ModelShape
    dtype: str
    kv_dtype: str
    tokens: int
    budget: Budget
    gpus_per_node: int
    weights: float
    kv_per_token: int
    kv_context: int
    gpus_needed: int
    layout: Layout | None
    layout_usage: PerGpu | None = field(default=None)


def plan(
    shape: ModelShape,
    gpu: str = "h100-80gb",
    tokens: int = 131072,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    gpus_per_node: int = 8,
    budget: Budget | None = None,
) -> SizingPlan:
    budget = budget or Budget(gpu=gpu)
    weights, kv = weight_bytes(shape, dtype), kv_bytes(shape, tokens, kv_dtype)
    gpus_needed = _gpus_needed(shape, weights + kv, budget, gpus_per_node)
    layout = suggest_layout(shape, dtype, kv_dtype, tokens, budget, gpus_per_node)
    usage = per_gpu(shape, dtype, kv_dtype, tokens, layout.tp, layout.pp, budget) if layout else None
    return SizingPlan(
        shape,
        dtype,
        kv_dtype,
        tokens,
        budget,
        gpus_per_node,
        weights,
        shape.kv_bytes_per_token(kv_dtype),
        kv,
        gpus_needed,
        layout,
        usage,
    )


def _gpus_needed(shape: ModelShape, total: float, budget: Budget, gpus_per_node: int) -> int:
    """Fewest GPUs whose room holds weights + KV (memory only; a layout may round up to a power of two)."""
    n = 1
    while n * budget.room(shape, min(n, gpus_per_node)) < total and n < gpus_per_node * MAX_PIPELINE:
        n += 1
    return n


def parse_tokens(text: str | int) -> int:
    """`131072`, `128k` (= 128,000, as the workshop counts) or `128Ki` (= 131,072)."""
    s = str(text).strip().replace("_", "").replace(",", "")
    for suffix, factor in (("ki", 1024), ("k", 1000)):
        if s.lower().endswith(suffix):
            return int(float(s[: -len(suffix)]) * factor)
    return int(s)


def kv_capacity_tokens(p: SizingPlan) -> int:
    """Tokens of KV cache one replica of the suggested layout holds (all sequences together)."""
    if p.layout is None or p.layout_usage is None:
        return 0
    per_token = per_gpu(p.shape, p.dtype, p.kv_dtype, 1, p.layout.tp, p.layout.pp, p.budget).kv
    return int((p.layout_usage.room - p.layout_usage.weights) // per_token)


def workshop_weight_table(dtypes: tuple[str, ...] = ("fp16", "fp8", "int4")) -> dict[str, dict[str, float]]:
    """The seed workshop's 'memory for model weights' table: nominal parameters × bytes, in GB."""
    return {name: {d: nominal_weight_bytes(n, d) / GB for d in dtypes} for name, n in NOMINAL_PARAMS.items()}
