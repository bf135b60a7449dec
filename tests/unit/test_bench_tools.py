"""The serving benchmark's own arithmetic (bench/loadgen.py, bench/pyspy.py), checked against hand counts."""

from __future__ import annotations

from bench.loadgen import LoadResult, cpu_used_s
from bench.pyspy import summarize


def test_serving_cpu_leaves_out_the_engines_processes():
    # (pid, start time, role) -> CPU seconds, before and after a load; pid 4 started during the load
    before = {
        (1, 0.0, "python vllm.entrypoints.openai.api_server"): 10.0,
        (2, 0.0, "VLLM::EngineCore"): 20.0,
        (3, 0.0, "VLLM::Worker"): 30.0,
    }
    after = {
        (1, 0.0, "python vllm.entrypoints.openai.api_server"): 11.5,
        (2, 0.0, "VLLM::EngineCore"): 24.0,
        (3, 0.0, "VLLM::Worker"): 38.0,
        (4, 5.0, "haproxy"): 0.25,
    }
    assert cpu_used_s(before, after) == 1.5 + 4.0 + 8.0 + 0.25
    assert cpu_used_s(before, after, serving_only=True) == 1.5 + 0.25
    result = LoadResult(16, 96, 2000, 4.0, [0.1], 0, cpu_s=13.75, serving_cpu_s=1.75)
    row = result.row()
    assert row["serving_cpu_s_per_1k_tok"] == 0.875 and row["cpu_s_per_1k_tok"] == 6.875


def test_a_py_spy_summary_counts_busy_samples_by_function(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "main (app.py:1);loop (app.py:5);select (selectors.py:468) 50\n"  # waiting: not busy
        "main (app.py:1);loop (app.py:5);handle (app.py:9);parse (json/decoder.py:10) 30\n"
        "main (app.py:1);loop (app.py:5);handle (app.py:9) 15\n"
        "main (app.py:1);tick (app.py:20) 5\n"
    )
    text = summarize(raw, seconds=2.0)
    head, *rows = text.splitlines()
    assert "50 busy of 100 samples" in head and "50% of a core" in head  # 50 samples at 50 Hz in 2 s
    by_name = {row.split("%  ", 1)[1]: row for row in rows}
    assert by_name["handle (app.py)"].split()[0] == "45"  # 30 in parse below it + 15 of its own
    assert "self  30.0%" in by_name["handle (app.py)"] and by_name["main (app.py)"].split()[0] == "50"
