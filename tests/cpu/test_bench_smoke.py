"""The serving and batch benchmarks (bench/serve_overhead.py, bench/batch.py) at toy size on the tiny model, as a user
runs them: each brings up its peers, runs its loads to the end and writes the JSON rows the results pages are made
from. Figures are not judged here (benchmarks are commands, and no test asserts a timing): the rows must be there,
whole, with every request answered.

Not in the CI run (6+ minutes of its 30 on two cores: two Summit clusters and two `vllm serve`s): reported skipped
there; after changing bench/, run `SUMMIT_BENCH_SMOKE=1 .venv/bin/python -m pytest tests/cpu/test_bench_smoke.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cpu.engine_apps import REPO
from tests.local_cluster import loopback_env

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        os.environ.get("SUMMIT_BENCH_SMOKE") != "1",
        reason="opt-in: SUMMIT_BENCH_SMOKE=1 .venv/bin/python -m pytest tests/cpu/test_bench_smoke.py",
    ),
]

PAIRS = [("summit", 1), ("summit", 4), ("vllm", 1), ("vllm", 4)]
ROW_KEYS = {"peer", "concurrency", "out_tok_s", "ttft_p50_ms", "ttft_p99_ms"}


def run_bench(args: list[str], timeout_s: float = 600) -> None:
    run = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=loopback_env({"RAY_AUTH_MODE": "disabled"}),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_serve_overhead_compares_summit_and_vllm(tmp_path):
    out = tmp_path / "serving.json"
    run_bench(
        ["bench/serve_overhead.py", "--concurrency", "1", "4", "--requests", "8", "--max-tokens", "4"]
        + ["--json", str(out)]
    )
    rows = json.loads(out.read_text())
    assert sorted((r["peer"], r["concurrency"]) for r in rows) == PAIRS
    for r in rows:
        assert ROW_KEYS | {"serving_cpu_s_per_1k_tok", "rounds", "medians"} <= r.keys(), r
        assert r["errors"] == 0 and r["requests"] == 8 and r["out_tok_s"] > 0 and r["serving_cpu_s_per_1k_tok"] > 0
        assert len(r["rounds"]) == 1 and r["medians"]["out_tok_s"] == r["out_tok_s"]


def test_batch_bench_runs_the_batch_api_and_vllms_generate(tmp_path):
    out = tmp_path / "batch.json"
    run_bench(
        [
            "bench/batch.py",
            "--lines",
            "24",
            "--max-tokens",
            "4",
            "--online-requests",
            "16",
            "--online-max-tokens",
            "4",
            "--only",
            "api",
            "generate",
            "--json",
            str(out),
        ]
    )
    rows = {r["peer"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"summit-batch-api", "summit-batch-api+online", "online-16", "online-16+batch", "vllm-generate"}
    for peer in ("summit-batch-api", "summit-batch-api+online"):
        assert rows[peer]["completed"] == 24 and rows[peer]["failed"] == 0 and rows[peer]["output_tokens"] == 96
    assert rows["vllm-generate"]["output_tokens"] == 96
    for peer in ("online-16", "online-16+batch"):
        assert ROW_KEYS <= rows[peer].keys() and rows[peer]["errors"] == 0 and rows[peer]["ttft_p50_ms"] > 0
