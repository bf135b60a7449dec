"""`summit simulate` past these machines: the predictions docs/configuration/simulate.md publishes.

    python bench/simulate_scale.py --json bench/results/simulate-scale-2026-12-02.json

- **routing**: 64 replicas of Llama 3.1 8B (serve_configs/llama8b.yaml, one H200 each: 8 nodes of 8) and 16 of 70B at
  TP 4 (serve_configs/llama70b.yaml, four H200s each), under least_load, prefix_affinity and kv_cache, on a multi-turn
  load (one shared 1,000-token system prompt, chats of 3 turns of ~4,000 new tokens and 256 out) whose chats' histories
  add up to 2x and 6x the replicas' KV caches together, arriving over 10 minutes.
- **spike**: 8B, traffic at 20 requests/s that goes 10x for 2 minutes: Serve's autoscaling (Summit's target of
  ongoing requests, 2 to 24 replicas) with the measured cold start of 121.8 s, against 24 replicas that sleep when
  idle (`deployment.sleep.after_idle_s: 60`) and wake in the measured 0.68 s
  (bench/results/h200-sleep-swap-2026-11-27.md).
  Time to recover: from the spike's start until every 10-s window's TTFT p90 stays under `--ttft-target-ms`.

The 8B step times are the H200 profile measured by bench/engine_profile.py (profile-h200-8b-graphs-2026-12-02.json).
No four-GPU host was lent to profile 70B at TP 4: `--derive-70b` writes its profile from the served 70B run of
2026-11-28 (h200x4-70b-2026-11-28.json: the decode step from TPOT p50 at 1/32/256 streams, the prefill cost from the
cold against the warm first token at one stream), marked as derived.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.simulate.config import sim_model  # noqa: E402
from app.simulate.engine import SimRequest  # noqa: E402
from app.simulate.load import LoadSpec, requests  # noqa: E402
from app.simulate.profile import StepProfile  # noqa: E402
from app.simulate.run import summary  # noqa: E402
from app.simulate.sim import Simulation  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PROFILE_8B = RESULTS / "profile-h200-8b-graphs-2026-12-02.json"
PROFILE_70B = RESULTS / "profile-h200x4-70b-derived-2026-12-02.json"
POLICIES = ("least_load", "prefix_affinity", "kv_cache")
COLD_START_S, WAKE_S = 121.8, 0.68  # 8B on an H200: serve deploy to first token; a sleeping engine's first token


def derive_70b(out: Path) -> StepProfile:
    """The 70B TP 4 step model from its served run: decode = base + decode_seq_s x requests (TPOT p50 at 1/32/256,
    medians over the run's rounds of both peers: the same engine), prefill per token = (cold - warm first token at
    one stream) / the prompt's tokens (1,016, all but the last block cached when warm)."""
    import numpy as np

    runs = json.loads((RESULTS / "h200x4-70b-2026-11-28.json").read_text())["runs"]
    loads = [(load, run) for run in runs for load in run.get("loads", []) if run.get("round") != 1]
    tpot = {c: statistics.median(x["tpot_p50_ms"] for x, _ in loads if x["concurrency"] == c) for c in (1, 32, 256)}
    coef = np.polyfit(list(tpot), [v / 1000 for v in tpot.values()], 1)
    one = [x["ttft_p50_ms"] for x, _ in loads if x["concurrency"] == 1]
    prefill_token_s = (max(one) - min(one)) / 1000 / 1000
    profile = StepProfile(
        name="h200x4-llama-3.1-70b-tp4-derived",
        base_s=float(coef[1]),
        prefill_token_s=prefill_token_s,
        decode_seq_s=float(coef[0]),
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        start_s=186.0,
        wake_s=WAKE_S,
        async_scheduling=False,  # served figures: async scheduling's gain is in them already
        about="DERIVED, not profiled: from the served 70B TP 4 run on four H200s (h200x4-70b-2026-11-28.json), "
        f"decode = base + decode_seq_s x requests fitted to TPOT p50 {tpot} ms at 1/32/256 streams; prefill per token "
        f"= (cold {max(one):.1f} - warm {min(one):.1f} ms first token at one stream) / 1,000 tokens; start_s the "
        "run's 186 s ready time (warm torch.compile cache). No step profile of 70B exists: no four-GPU host was lent.",
    )
    profile.save(out)
    return profile


def multi_turn(pressure: float, cache_tokens: int, turn_tokens: int = 4000, out_tokens: int = 256) -> LoadSpec:
    """Chats whose histories (3 turns of `turn_tokens` + `out_tokens`) add up to `pressure` x the KV caches."""
    turns = 3
    chats = round(pressure * cache_tokens / (turns * (turn_tokens + out_tokens)))
    return LoadSpec(
        shape="multi_turn",
        rate_per_s=chats * turns / 600,
        requests=chats * turns,
        prompt_tokens=turn_tokens,
        output_tokens=out_tokens,
        prefix_tokens=1000,
        chats=chats,
        turns=turns,
        sigma=0.3,
    )


def fresh(reqs: list[SimRequest]) -> list[SimRequest]:
    """The same requests, unrun (their token and block lists shared: the simulation does not change them)."""
    return [SimRequest(r.rid, r.tokens, r.output_len, r.arrival, r.text, r.session, hashes=r.hashes) for r in reqs]


def run(model, profile: StepProfile, spec: LoadSpec, made: tuple | None = None) -> dict:
    """One simulated run; `made`: the load's (requests, clients) drawn already (the same draw for every policy)."""
    reqs, clients = made or requests(spec, model.block_size)
    reqs = fresh(reqs)
    t0 = time.perf_counter()
    sim = Simulation(model, profile, 0)
    done = sim.run(reqs, clients)
    out = summary(sim, done, reqs, time.perf_counter() - t0)
    out["wakes"] = sum(r.wakes for r in sim.replicas.values())
    out["ttft_p90_by_10s"] = windows(done)
    return out


def windows(done: list, width: float = 10.0) -> list[tuple[float, float]]:
    """(window start, TTFT p90 ms) by arrival time."""
    by: dict[int, list[float]] = {}
    for r in done:
        by.setdefault(int(r.arrival // width), []).append((r.first_token_at - r.arrival) * 1000)
    out = []
    for k in sorted(by):
        v = sorted(by[k])
        out.append((k * width, round(v[min(len(v) - 1, int(0.9 * len(v)))], 1)))
    return out


def recovery_s(p90s: list[tuple[float, float]], at: float, target_ms: float) -> float | None:
    """Seconds from `at` until every later window's p90 is under the target (None: never)."""
    after = [(t, v) for t, v in p90s if t >= at]
    for i, (t, _) in enumerate(after):
        if all(v <= target_ms for _, v in after[i:]):
            return t - at
    return None


def routing_rows(ns: argparse.Namespace) -> list[dict]:
    rows = []
    cases = [
        ("llama-3.1-8b", REPO / "serve_configs/llama8b.yaml", PROFILE_8B, 64),
        ("llama-3.1-70b TP 4", REPO / "serve_configs/llama70b.yaml", PROFILE_70B, 16),
    ]
    for label, yaml_path, profile_path, replicas in cases:
        if ns.only and label.split()[0] not in ns.only:
            continue
        profile = StepProfile.load(profile_path)
        for pressure in ns.pressures:
            made = None
            for policy in POLICIES:
                model = sim_model(yaml_path, profile, None, "h200-141gb", policy, replicas)
                spec = multi_turn(pressure, model.kv_tokens * replicas)
                t0 = time.perf_counter()
                made = made or requests(spec, model.block_size)
                drawn_s = time.perf_counter() - t0
                out = run(model, profile, spec, made)
                row = {
                    "case": "routing",
                    "model": label,
                    "replicas": replicas,
                    "pressure": pressure,
                    "policy": policy,
                    "requests": out["requests"],
                    "rate_per_s": round(spec.rate_per_s, 1),
                    "kv_tokens_per_replica": model.kv_tokens,
                    **{k: out[k] for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "out_tok_s")},
                    "hit_rate": out["hit_rate"],
                    "preemptions": out["preemptions"],
                    "routing_outcomes": out["routing_outcomes"],
                    "wall_s": out["wall_s"],
                    "load_drawn_s": round(drawn_s, 1),
                }
                rows.append(row)
                print(
                    f"{label:<20}{replicas:>4} x {pressure:g}x {policy:<16} {out['requests']:>7} req "
                    f"TTFT p50/p90 {out['ttft_p50_ms']:>8.0f}/{out['ttft_p90_ms']:>8.0f} ms"
                    f"  TPOT {out['tpot_p50_ms']:.1f}"
                    f"  hit {out['hit_rate']:.1%}  {out['out_tok_s']:,.0f} tok/s  ({out['wall_s']} s)",
                    flush=True,
                )
    return rows


def spike_rows(ns: argparse.Namespace) -> list[dict]:
    profile = StepProfile.load(PROFILE_8B)
    spec = LoadSpec(
        shape="shared_prefix",
        rate_per_s=20,
        duration_s=600,
        spike={"at_s": 120, "factor": 10, "for_s": 120},
        prompt_tokens=1000,
        output_tokens=256,
        prefixes=8,
        prefix_tokens=1000,
        sigma=0.3,
    )
    base = sim_model(REPO / "serve_configs/llama8b.yaml", profile, None, "h200-141gb", "kv_cache", 2)
    auto = {
        "min_replicas": 2,
        "max_replicas": 24,
        "initial_replicas": 2,
        "target_ongoing_requests": 192,  # Summit's default: ceil(0.75 x max_num_seqs 256)
        "upscale_delay_s": 30,
        "downscale_delay_s": 600,
        "metrics_interval_s": 1,
        "look_back_period_s": 10,
    }
    latency = dict(auto, policy={"policy_function": "slo", "policy_kwargs": {"ttft_p90_ms": ns.ttft_target_ms}})
    variants = [
        ("autoscaling, cold start", dataclasses.replace(base, autoscaling=auto), COLD_START_S),
        ("latency-target autoscaling, cold start", dataclasses.replace(base, autoscaling=latency), COLD_START_S),
        ("24 replicas asleep when idle", dataclasses.replace(base, replicas=24, sleep_after_idle_s=60.0), COLD_START_S),
    ]
    rows = []
    for label, model, start_s in variants:
        p = dataclasses.replace(profile, start_s=start_s, wake_s=WAKE_S)
        out = run(model, p, spec)
        rec = recovery_s(out["ttft_p90_by_10s"], 120, ns.ttft_target_ms)
        peak = max(v for t, v in out["ttft_p90_by_10s"] if t >= 120)
        timeline = [
            (
                s["t_s"],
                s["replicas"].get("running", 0),
                s["replicas"].get("starting", 0),
                s["replicas"].get("asleep", 0),
            )
            for s in out["timeline"]
            if int(s["t_s"]) % 10 == 0
        ]
        rows.append(
            {
                "case": "spike",
                "variant": label,
                "requests": out["requests"],
                "recover_s": rec,
                "peak_ttft_p90_ms": peak,
                "ttft_p90_ms": out["ttft_p90_ms"],
                "wakes": out["wakes"],
                "replicas_max": out["replicas_max"],
                "timeline_every_10s": timeline,
                "ttft_p90_by_10s": out["ttft_p90_by_10s"],
                "wall_s": out["wall_s"],
            }
        )
        print(
            f"{label:<42} recovers in {rec if rec is not None else 'never'} s; peak TTFT p90 {peak:,.0f} ms; "
            f"replicas at most {out['replicas_max']}; wakes {out['wakes']} ({out['wall_s']} s)",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--cases", nargs="+", default=["routing", "spike"], choices=["routing", "spike"])
    p.add_argument("--pressures", nargs="+", type=float, default=[2.0, 6.0])
    p.add_argument("--only", nargs="+", default=None, help="routing: models whose name starts so (llama-3.1-8b)")
    p.add_argument("--ttft-target-ms", type=float, default=1000.0)
    p.add_argument("--derive-70b", action="store_true", help="(re)write the derived 70B TP 4 profile first")
    ns = p.parse_args()
    if ns.derive_70b or not PROFILE_70B.exists():
        print(derive_70b(PROFILE_70B).about)
    rows = []
    if "routing" in ns.cases:
        rows += routing_rows(ns)
    if "spike" in ns.cases:
        rows += spike_rows(ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
