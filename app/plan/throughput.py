"""Throughput planning (pure): for a number of GPUs, which replicas × TP layout serves more tokens/s.

A decode step of one replica (TP t, batch b; prompts of P tokens, O tokens out, so a sequence holds P + O/2 tokens
of KV on average and each output token carries P(1 − h)/O prompt tokens of prefill, h the share of prompt tokens found
in the prefix cache: 0 by default, near 1 where prompts share long prefixes, as chat turns and system prompts do):

    step = max(memory, compute) + all-reduce + host
    memory    = (weights + b × (P + O/2) × KV bytes per token) / t / (HBM bandwidth × BW_EFFICIENCY)
    compute   = 2 × active parameters × b × (1 + P(1 − h)/O) / t / (bf16 FLOP/s × FLOP_EFFICIENCY)
    all-reduce (t > 1) = 2 per layer × (ALLREDUCE_LATENCY + 2 (t−1)/t × b (1 + P(1 − h)/O) × hidden × 2 B / NVLink
                         bandwidth)
    host      = STEP_OVERHEAD + SEQ_OVERHEAD × b      (scheduling, sampling, detokenizing: one process per replica)

b = min(concurrency / replicas, max_num_seqs, sequences the replica's KV cache holds); tokens/s = replicas × b / step.
Replicas of a small TP run their host work side by side and keep KV per GPU; a larger TP splits the weight reads
and adds all-reduces. So TP wins where a step is weight-bound (few streams), replicas where the batch is large.

The coefficients are fixed from one-GPU measurements on this project's GPU host before any layout is compared
(`bench/results/h100-features-2026-11-24.md`, FACTS.md's H200 runs), except ALLREDUCE_LATENCY, taken from one
two-GPU figure (TP 2 at one stream); the other two-GPU figures check it (`bench/throughput_check.py`,
`bench/results/h100x2-2026-11-26.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.plan.planner import Budget, ModelShape, per_gpu, valid_tp_sizes, weight_bytes

# Datasheet figures per GPU: HBM bytes/s, dense bf16 FLOP/s, NVLink bytes/s one way.
GPU_SPECS = {
    "a100-40gb": (1.555e12, 312e12, 300e9),
    "a100-80gb": (2.039e12, 312e12, 300e9),
    "h100-80gb": (3.35e12, 989e12, 450e9),
    "h200-141gb": (4.8e12, 989e12, 450e9),
}
BW_EFFICIENCY = (
    0.8  # an 8B at one stream reads its weights at 73 % (H100) / 72 % (H200) of the datasheet, with host time
)
FLOP_EFFICIENCY = 0.5  # what large GEMMs reach in vLLM's steps on Hopper
# one small all-reduce over NVLink (vLLM's custom all-reduce, CUDA graphs), per-rank coordination included: what an 8B
# at TP 2, one stream, left beyond its weight reads and host time on 2 x H200 (286 tok/s, vLLM's mp executor)
ALLREDUCE_LATENCY = 6e-6
STEP_OVERHEAD = 1.0e-3  # H100/H200, 8B, one stream: ~1 ms per step beyond the weight reads
SEQ_OVERHEAD = (
    10e-6  # per sequence in a step; with the above, 8B at 256 streams on an H100: 15.9k predicted, 16.6k measured
)


@dataclass(frozen=True)
class Workload:
    concurrency: int = 256
    prompt_tokens: int = 128
    output_tokens: int = 256
    # share of prompt tokens the prefix cache already holds (not prefilled again): 70B TP 4 on 4 x H200 with prompts
    # that share their text (bench/results/h200x4-70b-2026-11-28.md) ran 3.5x what h = 0 predicts at 256 streams
    prefix_hit: float = 0.0

    def __post_init__(self):
        if not 0 <= self.prefix_hit < 1:
            raise ValueError(f"--prefix-hit {self.prefix_hit}: a share from 0 (no prompt token cached) up to below 1")


@dataclass(frozen=True)
class LayoutEstimate:
    replicas: int
    tp: int
    batch: float  # sequences one replica runs at once
    kv_sequences: int  # sequences its KV cache holds
    step_s: float
    memory_s: float
    compute_s: float
    allreduce_s: float
    host_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.replicas * self.batch / self.step_s

    @property
    def stream_tokens_per_s(self) -> float:
        return 1 / self.step_s

    @property
    def bound(self) -> str:
        parts = {"memory": self.memory_s, "compute": self.compute_s}
        return max(parts, key=parts.get)


def estimate(
    shape: ModelShape,
    gpu: str,
    replicas: int,
    tp: int,
    work: Workload,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    budget: Budget | None = None,
) -> LayoutEstimate | None:
    """One layout's step and tokens/s; None where one replica's weights do not fit its GPUs."""
    if gpu not in GPU_SPECS:
        raise ValueError(f"gpu {gpu!r}: use one of {', '.join(GPU_SPECS)}")
    hbm, flops, link = GPU_SPECS[gpu]
    budget = budget or Budget(gpu=gpu)
    one_token = per_gpu(shape, dtype, kv_dtype, 1, tp, 1, budget)
    kv_room = one_token.room - one_token.weights
    per_seq_tokens = work.prompt_tokens + work.output_tokens / 2
    if kv_room <= one_token.kv * per_seq_tokens:
        return None
    kv_sequences = int(kv_room // (one_token.kv * per_seq_tokens))
    batch = min(work.concurrency / replicas, budget.max_num_seqs, kv_sequences)
    prefill = 1 + work.prompt_tokens * (1 - work.prefix_hit) / work.output_tokens
    memory = (weight_bytes(shape, dtype) + batch * per_seq_tokens * shape.kv_bytes_per_token(kv_dtype)) / tp
    memory_s = memory / (hbm * BW_EFFICIENCY)
    compute_s = 2 * shape.active_params * batch * prefill / tp / (flops * FLOP_EFFICIENCY)
    allreduce_s = 0.0
    if tp > 1:
        payload = 2 * (tp - 1) / tp * batch * prefill * shape.hidden_size * 2
        allreduce_s = 2 * shape.num_layers * (ALLREDUCE_LATENCY + payload / link)
    host_s = STEP_OVERHEAD + SEQ_OVERHEAD * batch
    step = max(memory_s, compute_s) + allreduce_s + host_s
    return LayoutEstimate(replicas, tp, batch, kv_sequences, step, memory_s, compute_s, allreduce_s, host_s)


def compare_layouts(
    shape: ModelShape,
    gpu: str,
    gpus: int,
    work: Workload,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    gpus_per_node: int = 8,
    budget: Budget | None = None,
) -> list[LayoutEstimate]:
    """Every replicas × TP that uses `gpus` GPUs (TP inside a node), best tokens/s first."""
    options = []
    for tp in valid_tp_sizes(shape, min(gpus, gpus_per_node)):
        if gpus % tp:
            continue
        found = estimate(shape, gpu, gpus // tp, tp, work, dtype, kv_dtype, budget)
        if found is not None:
            options.append(found)
    return sorted(options, key=lambda e: -e.tokens_per_s)


def format_comparison(shape: ModelShape, gpu: str, gpus: int, work: Workload, options: list[LayoutEstimate]) -> str:
    head = (
        f"{shape.name} on {gpus} × {gpu}: {work.concurrency} streams, {work.prompt_tokens}-token prompts, "
        f"{work.output_tokens} tokens out"
        + (f", {work.prefix_hit:.0%} of prompt tokens in the prefix cache" if work.prefix_hit else "")
        + " (roofline estimate: app/plan/throughput.py)"
    )
    if not options:
        return head + "\nno layout fits: see `summit plan` for the GPUs this model needs"
    rows = [("layout", "tok/s", "per stream", "batch", "step ms", "bound")]
    for e in options:
        rows.append(
            (
                f"{e.replicas} × TP {e.tp}",
                f"{e.tokens_per_s:,.0f}",
                f"{e.stream_tokens_per_s:,.1f}",
                f"{e.batch:g}",
                f"{e.step_s * 1e3:.1f}",
                f"{e.bound}" + (f" + all-reduce {e.allreduce_s * 1e3:.1f} ms" if e.allreduce_s else ""),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    best, second = options[0], options[1] if len(options) > 1 else None
    verdict = f"best: {best.replicas} × TP {best.tp}"
    if second:
        verdict += f" ({best.tokens_per_s / second.tokens_per_s:.2f}× the next, {second.replicas} × TP {second.tp})"
    return f"{head}\n{table}\n{verdict}"


def ranking(options: list[LayoutEstimate]) -> list[str]:
    return [f"{e.replicas}x{e.tp}" for e in options]
