"""`summit simulate` against a measured run: the same requests, the same engine settings, the same policies.

    python bench/simulate_accuracy.py bench/results/cpu-routing-overflow-2026-11-29.json \\
        --profile bench/results/profile-cpu-tiny-2026-11-29.json --json out.json

Takes a bench/routing.py result file, rebuilds each round's prompts (bench/routing_loads.py, tokenized by the tiny
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

TOKENS_PER_WORD = 1.5


def simulate_round(args: dict, profile: StepProfile, load: str, policy: str, seed: int, tok) -> dict:
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
    )
    sim = Simulation(model, profile, seed)
    done = sim.run(reqs, args["concurrency"])
    return summary(sim, done, reqs, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measured", help="a bench/routing.py --json file")
    p.add_argument("--profile", required=True)
    p.add_argument("--json", help="also write the table here")
    ns = p.parse_args()
    measured = json.loads(Path(ns.measured).read_text())
    args, profile, tok = measured["args"], StepProfile.load(ns.profile), train_tokenizer()
    rows = []
    print(
        f"{'load':<12}{'policy':<17}{'hit rate sim/meas':>20}{'TTFT p50 sim/meas':>22}{'TTFT p99 sim/meas':>22}"
        f"{'tok/s sim/meas':>20}"
    )
    for row in measured["rows"]:
        runs = [simulate_round(args, profile, row["load"], row["policy"], seed, tok) for seed in range(row["rounds"])]
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
