"""`summit batch`: a batch file offline on the YAML's models (real engines, a private local Ray): through Ray Data over
two engine actors, and through Serve handles (resuming a run that was cut off mid-line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.cpu.conftest import MODEL
from tests.cpu.engine_apps import REPO
from tests.local_cluster import loopback_env

# the long tier (SUMMIT_TEST_LONG=1: two private Ray clusters and three engines; tests/README.md). Every CI run still
# runs `summit batch` on a real engine: the SLURM batch job of tests/cpu/test_slurm.py.
pytestmark = [pytest.mark.timeout(900), pytest.mark.long]


def lines(n: int) -> list[dict]:
    return [
        {
            "custom_id": f"o-{i}",
            "method": "POST",
            "url": "/v1/chat/completions" if i % 5 == 0 else "/v1/completions",
            "body": {
                "model": MODEL,
                **(
                    {"messages": [{"role": "user", "content": f"line {i}"}]}
                    if i % 5 == 0
                    else {"prompt": f"Offline line {i}: ridge"}
                ),
                "max_tokens": 6,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


def summit_batch(infile, out, config, *flags) -> dict:
    """The command as a user runs it (its own private Ray); its summary line."""
    path, env = config
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "batch",
        str(infile),
        "-o",
        str(out),
        "--config",
        str(path),
        "--num-cpus",
        "4",
        "--no-progress",
        *flags,
    ]
    run = subprocess.run(
        cmd,
        cwd=REPO,
        env=loopback_env({"RAY_AUTH_MODE": "disabled", **env}),
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture
def config(tmp_path, tiny_model_dir) -> tuple:
    doc = yaml.safe_load((REPO / "serve_configs/tiny-cpu.yaml").read_text())
    doc["applications"][0]["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    model = doc["applications"][0]["args"]["models"][0]
    model["engine_kwargs"].update(max_num_seqs=16, kv_cache_memory_bytes=64 << 20)
    path = tmp_path / "offline.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, {"SUMMIT_TINY_MODEL": str(tiny_model_dir)}


def read(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_ray_data_over_two_engine_actors_then_a_cut_run_resumes_on_serve_exactly_once(tmp_path, config):
    """One file through both paths (each run starts its own Ray and engines, so one test for both claims): Ray Data
    over two engine actors answers every line (vLLM's own 400 to the error file); then the output is cut as a killed
    run leaves it and the rerun, through Serve handles, runs only the lines left, the torn one whole again."""
    path, env = config
    doc = yaml.safe_load(path.read_text())
    doc["applications"][0]["args"]["models"][0]["deployment"]["num_replicas"] = 2
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump(doc))
    data = lines(48)
    data[3]["body"]["max_tokens"] = -1  # vLLM's own 400, to the error file
    infile = tmp_path / "in.jsonl"
    infile.write_text("".join(json.dumps(x) + "\n" for x in data))
    out, err = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    summary = summit_batch(infile, out, (two, env), "--ray-data")
    assert summary["ran"] == 48 and summary["completed"] == 47 and summary["failed"] == 1
    assert len(summary["workers"]) == 2 and all(n > 0 for n in summary["workers"].values()), summary["workers"]
    errors = read(err)
    assert [x["custom_id"] for x in errors] == ["o-3"] and errors[0]["response"]["status_code"] == 400
    answers = {x["custom_id"]: x for x in read(out)}
    assert sorted([*answers, "o-3"]) == sorted(x["custom_id"] for x in data)
    chat = answers["o-0"]["response"]["body"]
    assert chat["object"] == "chat.completion" and answers["o-1"]["response"]["body"]["object"] == "text_completion"

    # a run cut off after 12 lines, the 13th half written (its custom_id and id there, its response not): the rerun
    # runs the 35 others, the torn one among them, whole again. Fails if a torn line counts as finished (its id would
    # be skipped: 34 ran) or stays in the file beside its redone copy
    written = out.read_text().splitlines(keepends=True)
    kept, torn = written[:12], written[12]
    torn_id = json.loads(torn)["custom_id"]
    out.write_text("".join(kept) + torn[: torn.index('"response"')])
    again = summit_batch(infile, out, config)
    assert again["skipped"] == 13 and again["ran"] == 35, again  # 12 answers and the error line are finished
    redone = read(out)
    assert [x["custom_id"] for x in redone].count(torn_id) == 1
    assert sorted(x["custom_id"] for x in redone + read(err)) == sorted(x["custom_id"] for x in data)
    assert len(redone) == 47 and len(read(err)) == 1  # each line once

    def text(b):
        return b["choices"][0].get("text") or b["choices"][0]["message"]["content"]

    for x in redone:  # temperature 0: the same answers as the first run
        assert text(x["response"]["body"]) == text(answers[x["custom_id"]]["response"]["body"]), x["custom_id"]
    # nothing left: a third run starts nothing
    assert summit_batch(infile, out, config)["ran"] == 0
