"""`summit simulate CONFIG.yaml --load LOAD.yaml --profile PROFILE.json`: one simulated run and its figures."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path

from app.simulate.config import sim_model
from app.simulate.engine import SimRequest
from app.simulate.load import LoadSpec, requests
from app.simulate.profile import StepProfile
from app.simulate.sim import SimModel, Simulation


def simulate(model: SimModel, profile: StepProfile, spec: LoadSpec, seed: int = 0) -> dict:
    """Run `spec` through `model`'s replicas; the figures a benchmark of the same load reports."""
    reqs, clients = requests(spec, model.block_size)
    t0 = time.perf_counter()
    sim = Simulation(model, profile, seed)
    done = sim.run(reqs, clients)
    return summary(sim, done, reqs, time.perf_counter() - t0)


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(sim: Simulation, done: list[SimRequest], asked: list[SimRequest], wall_s: float) -> dict:
    ttft = [(r.first_token_at - r.arrival) * 1000 for r in done if r.first_token_at is not None]
    tpot = [(r.finished_at - r.first_token_at) * 1000 / (r.output_len - 1) for r in done if r.output_len > 1]
    start = min((r.arrival for r in done), default=0.0)
    end = max((r.finished_at for r in done), default=0.0)
    engines = [r.engine for r in sim.replicas.values()]
    queries = sum(e.prefix_queries for e in engines)
    return {
        "requests": len(asked),
        "finished": len(done),
        "rejected": len(sim.rejected),
        "ttft_p50_ms": _q(ttft, 0.5),
        "ttft_p90_ms": _q(ttft, 0.9),
        "ttft_p99_ms": _q(ttft, 0.99),
        "tpot_p50_ms": statistics.median(tpot) if tpot else None,
        "out_tok_s": sum(r.output_len for r in done) / (end - start) if end > start else None,
        "hit_rate": sum(e.prefix_hits for e in engines) / queries if queries else None,
        "preemptions": sum(r.preempted for r in done),
        "routing_outcomes": dict(sim.router.outcomes),
        "requests_per_replica": sorted(Counter(r.replica for r in done).values(), reverse=True),
        "replicas_max": max((sum(s["replicas"].values()) for s in sim.timeline), default=len(sim.replicas)),
        "timeline": sim.timeline,
        "simulated_s": round(sim.env.now, 1),
        "wall_s": round(wall_s, 2),
    }


def command(ns) -> dict:
    """The CLI's run: the YAML's model with the profile, the load from its file."""
    profile = StepProfile.load(ns.profile)
    model = sim_model(ns.file, profile, ns.model, ns.gpu, ns.policy, ns.replicas)
    spec = LoadSpec.load(ns.load)
    out = simulate(model, profile, spec, ns.seed)
    out["model"] = {k: v for k, v in vars(model).items() if k != "routing"} | {"routing": model.routing}
    out["profile"] = str(Path(ns.profile))
    return out


def format_summary(out: dict) -> str:
    m = out["model"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"{m['name']}: {m['replicas']} replica(s){' (autoscaled)' if m['autoscaling'] else ''}, "
        f"routing {m['policy']}, KV {m['kv_tokens']:,} tokens / replica, max_num_seqs {m['max_num_seqs']}",
        f"requests {out['finished']}/{out['requests']} answered, {out['rejected']} refused (over max_model_len), in "
        f"{out['simulated_s']:,} simulated s ({out['wall_s']} s here)",
        f"TTFT p50 {f(out['ttft_p50_ms'], ',.0f')} ms, p90 {f(out['ttft_p90_ms'], ',.0f')} ms, "
        f"p99 {f(out['ttft_p99_ms'], ',.0f')} ms; TPOT p50 {f(out['tpot_p50_ms'], '.1f')} ms; "
        f"output {f(out['out_tok_s'], ',.0f')} tok/s",
        f"prefix-cache hit rate {f(out['hit_rate'], '.1%')}; preemptions {out['preemptions']}; "
        f"routing {out['routing_outcomes']}; requests per replica {out['requests_per_replica'][:8]}"
        f"{' ...' if len(out['requests_per_replica']) > 8 else ''}; most replicas at once {out['replicas_max']}",
    ]
    return "\n".join(lines)


def cli_main(ns) -> int:
    """`summit simulate`: the summary printed, the figures in `--json`; a bad YAML, load or profile named (exit 1)."""
    import json
    import sys

    from pydantic import ValidationError

    try:
        out = command(ns)
    except (ValidationError, ValueError, OSError) as e:
        print(f"summit simulate: {e}", file=sys.stderr)
        return 1
    print(format_summary(out))
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2))
    return 0
