"""`summit plan --throughput`'s roofline against measured figures it was not fitted to.

    python bench/throughput_check.py [--json OUT]

1. The seeds' note (004): Llama 2 7B through vLLM (August 2023) on 1, 2 and 4 A100-40GB, one engine with
   tensor_parallel_size = GPUs, 59 prompts to `llm.generate`: 842.9 / 699.1 / 650.7 tok/s.
2. Summit's 8B on two GPUs (`bash scripts/gpu_host.sh bench 2x1|1x2`): 1 x TP 2 on 2 x H200 and 2 x TP 1 on 2 x H100.
The coefficients in app/plan/throughput.py come from one-GPU runs, except the all-reduce latency, taken from one
two-GPU figure (TP 2, one stream, marked "fit"); this prints each prediction beside its figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.plan.planner import load_shape
from app.plan.throughput import Workload, estimate

SEED_7B_A100 = {1: 842.9, 2: 699.1, 4: 650.7}  # tok/s of one engine with TP = GPUs (seeds/004)
# (gpu, replicas, tp, streams, Summit tok/s, source): bench/results/h200x2-2026-11-26.md (1 x TP 2, vLLM's mp
# executor) and bench/results/h100x2-2026-11-26.md (2 x TP 1); "fit": ALLREDUCE_LATENCY was taken from that figure
MEASURED_8B_2GPU = [
    ("h200-141gb", 1, 2, 1, 286.3, "fit"),
    ("h200-141gb", 1, 2, 32, 7134.0, "h200x2-2026-11-26"),
    ("h200-141gb", 1, 2, 256, 20308.0, "h200x2-2026-11-26"),
    ("h100-80gb", 2, 1, 1, 153.9, "h100x2-2026-11-26"),
    ("h100-80gb", 2, 1, 32, 3656.4, "h100x2-2026-11-26"),
    ("h100-80gb", 2, 1, 256, 22951.1, "h100x2-2026-11-26"),
]


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
    # Summit's 8B (dummy weights, ~130-token prompts, 256 out) on two GPUs: the one point the all-reduce latency was
    # taken from is marked (fit); every other figure is a check
    shape8 = load_shape("llama-3.1-8b")
    worst = 0.0
    for gpu, replicas, tp, c, value, source in MEASURED_8B_2GPU:
        e = estimate(shape8, gpu, replicas, tp, Workload(c, 130, 256))
        ratio = value / e.tokens_per_s
        if source != "fit":
            worst = max(worst, abs(1 - ratio))
        print(
            f"8B on 2 x {gpu}, {c:>3} streams, {replicas} x TP {tp}: predicted {e.tokens_per_s:7,.0f} tok/s, "
            f"measured {value:7,.1f} ({source}), measured/predicted {ratio:.2f}"
        )
        rows += [
            {"peer": f"roofline-8b-{gpu}-{replicas}x{tp}", "concurrency": c, "out_tok_s": round(e.tokens_per_s, 1)},
            {"peer": f"summit-8b-{gpu}-{replicas}x{tp}", "concurrency": c, "out_tok_s": value, "source": source},
        ]
    print(f"largest miss among the checks: {worst:.0%}")
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
