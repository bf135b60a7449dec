"""`summit simulate` against a measured run: the same requests, the same engine settings, the same policies.

    python bench/simulate_accuracy.py bench/results/cpu-routing-overflow-2026-11-29.json \\
        --profile bench/results/profile-cpu-tiny-2026-11-29.json --json out.json
    python bench/simulate_accuracy.py bench/results/h200-default-2026-11-28.json \\
        --profile bench/results/profile-h200-8b-graphs-2026-12-02.json --peer summit

A bench/serve_overhead.py result file (a list of rows: one replica, 1/32/256 streams): each level's prompts rebuilt
(bench/loadgen.make_prompts, tokenized by the tiny tokenizer the 8B config carries), the levels run in order on the
same simulated replica as the benchmark ran them (its prefix cache warm from the earlier ones), closed loop at the
level's streams; prints simulated / measured TTFT p50, p99, TPOT p50 and output tok/s (the run's medians of rounds).

A bench/routing.py result file: rebuilds each round's prompts (bench/routing_loads.py, tokenized by the tiny
model's tokenizer as the engines did), runs them through the simulation with the run's settings (2 replicas per
policy, its KV cache, `max_num_seqs`, concurrency and output length; the profile's block size and step times) and
prints simulated / measured for the prefix-cache hit rate, TTFT p50 and p99, and output tok/s (medians of the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.clusters.tiny_model import train_tokenizer  # noqa: E402
from app.simulate.engine import SimRequest  # noqa: E402
from app.simulate.profile import StepProfile  # noqa: E402
from app.simulate.run import summary  # noqa: E402
from app.simulate.sim import SimModel, Simulation  # noqa: E402
from bench import routing_loads  # noqa: E402
from bench.loadgen import make_prompts  # noqa: E402

TOKENS_PER_WORD = 1.5


def simulate_round(
    args: dict, profile: StepProfile, load: str, policy: str, seed: int, tok, path_ms: float = 0.0
) -> dict:
    cache_words = round(args["kv_cache_tokens"] / TOKENS_PER_WORD)
    prompts = routing_loads.make(load, cache_words, args["replicas"], seed=seed).prompts
    reqs = [SimRequest(i, tok.encode(p).ids, args["max_tokens"], 0.0, p) for i, p in enumerate(prompts)]
    model = SimModel(
        name=policy,
        policy=policy,
        replicas=args["replicas"],
        kv_tokens=args["kv_cache_tokens"],
        block_size=profile.block_size,
        max_num_seqs=args["max_num_seqs"],
        max_num_batched_tokens=profile.max_num_batched_tokens,
        max_model_len=args["max_model_len"],
        path_s=path_ms / 1000,
    )
    sim = Simulation(model, profile, seed)
    done = sim.run(reqs, args["concurrency"])
    return summary(sim, done, reqs, 0.0)


STREAM_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "out_tok_s")


def simulate_streams(rows: list[dict], profile: StepProfile, ns: argparse.Namespace, tok) -> list[dict]:
    """A serve_overhead run's levels, in order, on one simulated replica."""
    rows = sorted(
        (r for r in rows if r["peer"] == ns.peer and r["run"].startswith("pair")), key=lambda r: r["concurrency"]
    )
    model = SimModel(
        name=ns.peer,
        replicas=1,
        kv_tokens=ns.kv_tokens or profile.kv_tokens,
        block_size=profile.block_size,
        max_num_seqs=profile.max_num_seqs,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        max_model_len=ns.max_model_len,
        path_s=ns.path_ms / 1000,
    )
    sim = Simulation(model, profile, 0)
    rid = 0

    def reqs(prompts: list[str]) -> list[SimRequest]:
        nonlocal rid
        out = []
        for text in prompts:
            out.append(SimRequest(rid, tok.encode(text).ids, ns.max_tokens, 0.0, text))
            rid += 1
        return out

    sim.run(reqs(make_prompts(4, ns.prompt_words, seed=1)), 4)  # the benchmark's warm-up: 4 prompts, 4 streams
    out = []
    for row in rows:
        c = row["concurrency"]
        level = reqs(make_prompts(max(8, c * ns.requests_per_stream), ns.prompt_words))
        done = sim.run(level, c)
        got = summary(sim, done, level, 0.0)
        m = row.get("medians") or row
        measured = {k: m.get(k, row.get(k)) for k in STREAM_FIGURES}
        simulated = {k: got[k] for k in STREAM_FIGURES}
        out.append(
            {
                "peer": ns.peer,
                "concurrency": c,
                "simulated": simulated,
                "measured": measured,
                "ratio": {k: simulated[k] / measured[k] if measured[k] else None for k in STREAM_FIGURES},
            }
        )
    return out


def streams_main(ns: argparse.Namespace, rows: list[dict], profile: StepProfile) -> list[dict]:
    out = simulate_streams(rows, profile, ns, train_tokenizer())
    print(f"{'streams':>8}" + "".join(f"{k + ' sim/meas':>28}" for k in STREAM_FIGURES))
    for r in out:
        cells = "".join(
            f"{r['simulated'][k]:>12.1f} / {r['measured'][k]:<8.1f} ({r['ratio'][k]:.2f})" for k in STREAM_FIGURES
        )
        print(f"{r['concurrency']:>8}{cells}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measured", help="a bench/routing.py or bench/serve_overhead.py --json file")
    p.add_argument("--profile", required=True)
    p.add_argument("--json", help="also write the table here")
    g = p.add_argument_group("a serve_overhead run (its command's settings)")
    g.add_argument("--peer", default="summit")
    g.add_argument("--prompt-words", type=int, default=100)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--requests-per-stream", type=int, default=2)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--kv-tokens", type=int, default=None, help="the replica's KV cache (default: the profile's)")
    p.add_argument(
        "--path-ms",
        type=float,
        default=0.0,
        help="the serving path's own time a request before its engine sees it (SimModel.path_s; 0: engines only)",
    )
    ns = p.parse_args()
    measured = json.loads(Path(ns.measured).read_text())
    profile = StepProfile.load(ns.profile)
    if isinstance(measured, list):
        rows = streams_main(ns, measured, profile)
        if ns.json:
            Path(ns.json).write_text(
                json.dumps({"measured": ns.measured, "profile": ns.profile, "rows": rows}, indent=2)
            )
        return
    args, tok = measured["args"], train_tokenizer()
    rows = []
    print(
        f"{'load':<12}{'policy':<17}{'hit rate sim/meas':>20}{'TTFT p50 sim/meas':>22}{'TTFT p99 sim/meas':>22}"
        f"{'tok/s sim/meas':>20}"
    )
    for row in measured["rows"]:
        runs = [
            simulate_round(args, profile, row["load"], row["policy"], seed, tok, ns.path_ms)
            for seed in range(row["rounds"])
        ]
        sim = {
            k: statistics.median(r[k] for r in runs) for k in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "out_tok_s")
        }
        out = {
            "load": row["load"],
            "policy": row["policy"],
            "simulated": sim,
            "measured": {k: row[k] for k in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "out_tok_s")},
        }
        out["ratio"] = {k: sim[k] / out["measured"][k] if out["measured"][k] else None for k in sim}
        rows.append(out)
        m = out["measured"]
        print(
            f"{row['load']:<12}{row['policy']:<17}"
            f"{sim['hit_rate']:>9.1%} / {m['hit_rate']:<8.1%}"
            f"{sim['ttft_p50_ms']:>11.0f} / {m['ttft_p50_ms']:<8.0f}"
            f"{sim['ttft_p99_ms']:>11.0f} / {m['ttft_p99_ms']:<8.0f}"
            f"{sim['out_tok_s']:>9.0f} / {m['out_tok_s']:<8.0f}"
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps({"measured": ns.measured, "profile": ns.profile, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
