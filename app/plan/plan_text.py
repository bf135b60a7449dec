"""The `summit plan` table: what a SizingPlan (app/plan/planner.py) says, row by row."""

from __future__ import annotations

from app.plan.planner import GB, MAX_PIPELINE, GiB, SizingPlan, gpu_bytes, kv_capacity_tokens


def throughput_hint(p: SizingPlan) -> str:
    lay = p.layout
    if lay is None:
        return "-"
    if lay.nodes > 1:
        return f"1 replica per {lay.nodes} nodes; add replicas in steps of {lay.nodes} nodes"
    replicas = p.gpus_per_node // lay.gpus
    pp = f" × PP {lay.pp}" if lay.pp > 1 else ""
    hint = f"{_plural(replicas, 'replica')} × TP {lay.tp}{pp} per {p.gpus_per_node}-GPU node"
    if lay.gpus == 1:
        hint += " (fits one GPU: replicas of TP 1 out-serve one TP 2/4/8 engine)"
    return hint


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n > 1 else ''}"


def _sizing_rows(p: SizingPlan) -> list[tuple[str, str]]:
    s, b = p.shape, p.budget
    nominal = f" (nominal {s.nominal_params / 1e9:g} B)" if s.nominal_params else ""
    total, util = gpu_bytes(b.gpu) / GiB, b.gpu_memory_utilization
    tp = p.layout.tp if p.layout else 1
    return [
        (
            "model",
            f"{s.name}: {s.num_layers} layers, hidden {s.hidden_size}, "
            f"{s.num_heads} heads / {s.num_kv_heads} KV heads × {s.head_dim}",
        ),
        (
            "parameters",
            f"{s.params / 1e9:.2f} B{nominal}"
            + (
                f", {s.active_params / 1e9:.2f} B active ({s.experts_per_token} of {s.num_experts} experts a token)"
                if s.num_experts
                else ""
            ),
        ),
        (f"weights ({p.dtype})", f"{p.weights / GB:.1f} GB = {p.weights / GiB:.1f} GiB"),
        (f"KV per token ({p.kv_dtype})", f"{p.kv_per_token / 1024:g} KiB"),
        (f"KV for {p.tokens:,} tokens", f"{p.kv_context / GiB:.2f} GiB"),
        ("GPU", f"{b.gpu}: {total:.1f} GiB × gpu_memory_utilization {util:g} = {total * util:.1f} GiB"),
        ("headroom per GPU", f"{b.headroom(s, tp) / GiB:.1f} GiB (1.5 fixed + activations + logits, at TP {tp})"),
        ("room per GPU", f"{b.room(s, tp) / GiB:.1f} GiB for weights + KV"),
        ("GPUs needed", f"{p.gpus_needed} (weights + KV of one {p.tokens:,}-token sequence)"),
    ]


def _layout_rows(p: SizingPlan) -> list[tuple[str, str]]:
    if p.layout is None or p.layout_usage is None:
        return [("suggested", f"none: does not fit {MAX_PIPELINE} pipeline stages of {p.budget.gpu}")]
    lay, u, capacity = p.layout, p.layout_usage, kv_capacity_tokens(p)
    return [
        (
            "suggested",
            f"TP {lay.tp} × PP {lay.pp} = {_plural(lay.gpus, 'GPU')} on {_plural(lay.nodes, 'node')} "
            f"({p.gpus_per_node} GPUs per node)",
        ),
        ("per GPU", f"{u.weights / GiB:.1f} GiB weights + {u.kv / GiB:.1f} GiB KV of {u.room / GiB:.1f} GiB room"),
        ("KV cache per replica", f"{capacity:,} tokens ({capacity / p.tokens:.1f} full-context sequences)"),
        ("throughput", throughput_hint(p)),
    ]


def format_plan(p: SizingPlan) -> str:
    """The `summit plan` table."""
    rows = _sizing_rows(p) + _layout_rows(p)
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)
