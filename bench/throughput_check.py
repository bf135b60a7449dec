"""`summit plan --throughput`'s roofline against measured figures it was not fitted to.

    python bench/throughput_check.py [--json OUT]

1. The seeds' note (004): Llama 2 7B through vLLM (August 2023) on 1, 2 and 4 A100-40GB, one engine with
   tensor_parallel_size = GPUs, 59 prompts to `llm.generate`: 842.9 / 699.1 / 650.7 tok/s.
2. This project's own TP=2 × 1 vs TP=1 × 2 on 2 × H200 (`bash scripts/gpu_host.sh bench`), where bench/results has
   them (not yet: the two-GPU kinds were not lent since TP=2 first failed there).
The coefficients in app/plan/throughput.py come from one-GPU runs only; this prints each prediction beside the figure
and whether the ranking agrees.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.plan.planner import load_shape
from app.plan.throughput import Workload, estimate

SEED_7B_A100 = {1: 842.9, 2: 699.1, 4: 650.7}  # tok/s of one engine with TP = GPUs (seeds/004)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shape = load_shape("llama-2-7b")
    rows = []
    # the note's 59 prompts: lengths not given; two guesses bracket them
    for prompt, out in ((128, 256), (32, 512)):
        work = Workload(59, prompt, out)
        predicted = {tp: estimate(shape, "a100-40gb", 1, tp, work).tokens_per_s for tp in SEED_7B_A100}
        rank_pred = sorted(predicted, key=lambda tp: -predicted[tp])
        rank_seed = sorted(SEED_7B_A100, key=lambda tp: -SEED_7B_A100[tp])
        print(f"7B, 1 engine, TP = GPUs, 59 streams, {prompt} in / {out} out:")
        for tp in SEED_7B_A100:
            print(
                f"  TP {tp}: predicted {predicted[tp]:7,.0f} tok/s   seed {SEED_7B_A100[tp]:6,.1f}   "
                f"seed/predicted {SEED_7B_A100[tp] / predicted[tp]:.2f}"
            )
            rows.append(
                {
                    "peer": f"roofline-7b-a100-tp{tp}-p{prompt}-o{out}",
                    "concurrency": 59,
                    "out_tok_s": round(predicted[tp], 1),
                    "ttft_p50_ms": None,
                    "ttft_p99_ms": None,
                }
            )
        print(f"  ranking predicted {rank_pred}, seed {rank_seed}: {'agree' if rank_pred == rank_seed else 'DISAGREE'}")
        # the planner's own question for 2 and 4 GPUs: replicas of TP 1 (the seed's 1-GPU engine, side by side)
        for gpus in (2, 4):
            replicas = estimate(shape, "a100-40gb", gpus, 1, work).tokens_per_s
            one = predicted[gpus]
            seed_replicas = gpus * SEED_7B_A100[1]  # if replicas scale linearly (not measured in the note)
            print(
                f"  {gpus} GPUs: {gpus} x TP 1 predicted {replicas:,.0f} vs 1 x TP {gpus} {one:,.0f}; "
                f"seed (linear) {seed_replicas:,.0f} vs {SEED_7B_A100[gpus]:,.1f}"
            )
    for prompt, out in ((128, 256),):
        shape8 = load_shape("llama-3.1-8b")
        for c in (1, 32, 256):
            work = Workload(c, prompt, out)
            for replicas, tp in ((2, 1), (1, 2)):
                e = estimate(shape8, "h200-141gb", replicas, tp, work)
                rows.append(
                    {
                        "peer": f"roofline-8b-h200-{replicas}x{tp}",
                        "concurrency": c,
                        "out_tok_s": round(e.tokens_per_s, 1),
                        "ttft_p50_ms": None,
                        "ttft_p99_ms": None,
                    }
                )
                print(
                    f"8B on 2 x H200, {c} streams: {replicas} x TP {tp} predicted {e.tokens_per_s:,.0f} tok/s "
                    "(measured: none yet)"
                )
    for rows_for_seed in SEED_7B_A100.items():
        tp, value = rows_for_seed
        rows.append(
            {
                "peer": f"seed-004-7b-a100-tp{tp}",
                "concurrency": 59,
                "out_tok_s": value,
                "ttft_p50_ms": None,
                "ttft_p99_ms": None,
            }
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
