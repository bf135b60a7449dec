"""The throughput roofline (`summit plan --throughput`): its ranking against a two-GPU run measured after its
coefficients were fixed, and properties that follow from its terms (no figure it was fitted to is checked here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.plan.planner import load_shape
from app.plan.throughput import Workload, compare_layouts, estimate, ranking


def test_the_measured_two_gpu_ranking_of_replicas_over_tensor_parallel():
    """bench/results/h200x2-2026-11-24.md, measured after the coefficients were fixed from one-GPU runs: an 8B at 256
    streams on 2 x H200, 2 replicas x TP 1 20,668 tok/s against 1 x TP 2 10,589."""
    shape = load_shape("8b")
    layouts = compare_layouts(shape, "h200-141gb", 2, Workload(256, 130, 256))
    assert ranking(layouts)[0] == "2x1"


def test_tensor_parallel_splits_the_weight_reads_and_adds_all_reduces():
    shape = load_shape("8b")
    one, two = (estimate(shape, "h200-141gb", 1, tp, Workload(1, 128, 256)) for tp in (1, 2))
    assert two.allreduce_s > 0 == one.allreduce_s and two.memory_s == pytest.approx(one.memory_s / 2)


def test_a_layout_whose_weights_do_not_fit_is_left_out():
    shape = load_shape("70b")  # 70.55 B parameters x 2 B = 141 GB of bf16 weights: more than one 80 GB GPU
    assert estimate(shape, "h100-80gb", 1, 1, Workload()) is None
    assert set(ranking(compare_layouts(shape, "h100-80gb", 8, Workload()))) == {"2x4", "1x8", "4x2"}  # no 8x1


def test_summit_plan_throughput_prints_the_comparison():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "plan",
            "--model",
            "8b",
            "--gpu",
            "h200-141gb",
            "--throughput",
            "--gpus",
            "2",
            "--concurrency",
            "256",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "2 × TP 1" in out.stdout and "1 × TP 2" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("best: 2 × TP 1 (")


def test_prompts_found_in_the_prefix_cache_are_not_prefilled_again():
    """A 70B at TP 4 on 4 x H200, ~1k-token prompts of which 94 % were in the prefix cache (16 distinct prompt texts
    over 256 streams): measured 8,465-8,536 tok/s, Summit and vLLM alike (bench/results/h200x4-70b-2026-11-28.md);
    with every prompt token prefilled the estimate was 2,407. The share only removes prefill compute: one stream's
    weight-bound step stays as it was."""
    shape = load_shape("70b")
    cold, cached = (estimate(shape, "h200-141gb", 1, 4, Workload(256, 1016, 256, hit)) for hit in (0.0, 0.94))
    assert cached.compute_s < cold.compute_s / 3 and cached.memory_s == cold.memory_s
    assert 8465 * 0.8 < cached.tokens_per_s < 8536 * 1.2 and not 8465 * 0.8 < cold.tokens_per_s
    one = [estimate(shape, "h200-141gb", 1, 4, Workload(1, 1016, 256, hit)).step_s for hit in (0.0, 0.94)]
    assert one[0] == pytest.approx(one[1], rel=0.05)
    with pytest.raises(ValueError, match="prefix-hit"):
        Workload(256, 1016, 256, 1.0)
