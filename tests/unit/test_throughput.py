"""The throughput roofline (`summit plan --throughput`): its coefficients reproduce the one-GPU runs they were fixed
from, and its layout choices follow from the terms it has."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.planner import load_shape
from app.throughput import Workload, compare_layouts, estimate, ranking


@pytest.mark.parametrize("gpu, streams, measured", [
    ("h100-80gb", 1, 152.7), ("h100-80gb", 256, 16584),  # bench/results/h100-features-2026-11-24.md (bf16)
    ("h200-141gb", 1, 204), ("h200-141gb", 256, 17900),  # FACTS.md: offline engine, 128 in / 256 out
])
def test_the_coefficients_reproduce_the_one_gpu_runs_they_came_from(gpu, streams, measured):
    predicted = estimate(load_shape("8b"), gpu, 1, 1, Workload(streams, 128, 256)).tokens_per_s
    assert 0.85 < predicted / measured < 1.15, (predicted, measured)


def test_few_streams_favour_tensor_parallel_and_many_favour_replicas():
    shape = load_shape("8b")
    assert ranking(compare_layouts(shape, "h200-141gb", 2, Workload(1, 128, 256)))[0] == "1x2"  # weight-bound
    assert ranking(compare_layouts(shape, "h200-141gb", 2, Workload(256, 128, 256)))[0] == "2x1"  # batch-bound
    one, two = (estimate(shape, "h200-141gb", 1, tp, Workload(1, 128, 256)) for tp in (1, 2))
    assert two.allreduce_s > 0 == one.allreduce_s and two.memory_s == pytest.approx(one.memory_s / 2)


def test_a_layout_whose_weights_do_not_fit_is_left_out():
    shape = load_shape("70b")
    assert estimate(shape, "h100-80gb", 1, 1, Workload()) is None
    assert ranking(compare_layouts(shape, "h100-80gb", 8, Workload())) == ["2x4", "1x8", "4x2"]


def test_summit_plan_throughput_prints_the_comparison():
    out = subprocess.run([sys.executable, "-m", "app.cli", "plan", "--model", "8b", "--gpu", "h200-141gb",
                          "--throughput", "--gpus", "2", "--concurrency", "256"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "2 × TP 1" in out.stdout and "1 × TP 2" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("best: 2 × TP 1 (")
