"""Summit's sbatch scripts on a real SLURM cluster of two nodes (Debian's slurmctld, slurmd and munge; each node a
network and PID namespace of its own: tests/slurm_cluster.py), with the tiny CPU config: the job starts the Ray head
on n1 and a worker on n2, deploys the Serve YAML, writes its endpoint, answers the official OpenAI client; squeue
shows it; scancel stops every process it started and frees its port. Two jobs on one node get their own ports and
stop alone; a node lost mid-job is reported in endpoint.json while the job keeps serving; SLURM's signal before the
time limit drains the job: a running stream ends complete, then the job stops. A job whose engine cannot start
says why in endpoint.json (the engine's own line, its log) and ends by itself. The cookbook's one-node recipes
(docs/deployment/slurm-cookbook.md): a server job written by `summit sbatch` shares its node without `--exclusive`,
and when its engine is killed, the traceback is in the logs the job keeps (LOG_DIR/ray-logs) after scancel removed
its node-local state; a batch job written by `summit sbatch --batch` answers every line of its JSONL file and ends.

Job `lost` is `cluster_yaml/slurm/summit.sbatch` as shipped, with only sbatch options and environment on the command
line (docs/deployment/slurm.md shows the same commands): `--nodes=2 --gpus-per-node=0 --cpus-per-task=1
--exclusive=user`, and GPUS_PER_NODE=0, SERVE_CONFIG, SUMMIT_VENV, RAY_AUTH_TOKEN_PATH, SUMMIT_TINY_MODEL; the other
jobs' scripts are written by `summit sbatch` in the test (`--cpus-per-task=1` on the command line: 2-CPU nodes).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from tests.cpu.engine_apps import REPO
from tests.engine_checks import Throttle, titled
from tests.netns_hosts import OPENAI_CHECK, hosts_problem
from tests.slurm_cluster import DAEMONS, SlurmCluster

# A hang guard, not a time bound: the test takes ~10 min on a quiet 2-core box; on one at half speed a worker node's
# `ray start` missed Ray's fixed 30 s to register five times in a row (each try ~90 s; START_TRIES below) and the test
# ran past 1,200 s while every step was making progress.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module", autouse=True)
def _hosts_possible():
    """A tool the README's set-up installs that is missing fails the module (a skip would hide a broken CI)."""
    problem = hosts_problem(*DAEMONS)
    assert problem is None, problem


STREAM = """
import json, os, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=os.environ["OPENAI_API_KEY"], max_retries=0, timeout=300)
finish, usage = None, None
for i, chunk in enumerate(client.completions.create(model="tiny-llama", prompt="Down the valley", stream=True,
                                                   max_tokens=int(sys.argv[2]), temperature=0,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})):
    if i == 0:
        print("FIRST", flush=True)
    for c in chunk.choices:
        finish = c.finish_reason or finish
    usage = chunk.usage or usage
print(json.dumps({"finish": finish, "tokens": usage.completion_tokens if usage else None}), flush=True)
"""

# One new request's answer: "<status> <error type or ok>" (urllib: a refusal is an answer here, not a retry).
NEW_REQUEST = """
import json, os, sys, urllib.error, urllib.request
body = json.dumps({"model": "tiny-llama", "prompt": "Late", "max_tokens": 2}).encode()
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
request = urllib.request.Request(sys.argv[1] + "/completions", body, headers)
try:
    with urllib.request.urlopen(request, timeout=30) as reply:
        print(reply.status, "ok")
except urllib.error.HTTPError as e:
    body = e.read()
    try:
        print(e.code, json.loads(body)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        print(e.code, "not-OpenAI-shaped:", body[:80])
"""


def job_processes(job_id: str) -> list[psutil.Process]:
    """Processes on this machine (any node's namespace) that a SLURM step of the job started."""
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@dataclass
class Job:
    id: str
    logs: Path
    out: Path

    def endpoint(self) -> dict | None:
        path = self.logs / "endpoint.json"
        return json.loads(path.read_text()) if path.exists() else None

    def tail(self) -> str:
        return self.out.read_text()[-3000:] if self.out.exists() else "(no job output yet)"


def submit(
    slurm: SlurmCluster,
    tmp_path: Path,
    tiny_model_dir,
    name: str,
    *options: str,
    config: Path = REPO / "serve_configs/tiny-cpu.yaml",
    script: Path = REPO / "cluster_yaml/slurm/summit.sbatch",
    env: dict[str, str] | None = None,
) -> Job:
    """`sbatch` of a job script (the shipped one unless given) with only sbatch options and environment on the
    command line."""
    token = tmp_path / "ray_token"  # one cluster token for the test's jobs (each job's Ray uses it)
    if not token.exists():
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
    logs = tmp_path / f"logs-{name}"
    env = {
        "GPUS_PER_NODE": "0",
        "SERVE_CONFIG": str(config),
        "SUMMIT_VENV": sys.prefix,
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_TOKEN_PATH": str(token),
        "LOG_DIR": str(logs),
        "SUMMIT_TINY_MODEL": str(tiny_model_dir),
        # a loaded box (3 pytest workers) has made a node's `ray start` miss Ray's fixed 30 s to register 5 times
        "NODES_WAIT_S": "600",
        "START_TRIES": "8",
        "READY_WAIT_S": "600",
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        **(env or {}),
    }
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in env.items() if k != "PATH")])
    # the job's environment is this one (--export=ALL) without the single-node switch the loopback tests set
    submit_env = {k: v for k, v in {**slurm.env, **env}.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = tmp_path / f"job-{name}.out"
    submitted = subprocess.run(
        [
            *slurm.head.net_prefix,
            "sbatch",
            "--parsable",
            *options,
            "--gpus-per-node=0",
            "--time=30",
            f"--export={exports}",
            f"--chdir={REPO}",
            f"--output={out}",
            str(script),
        ],
        capture_output=True,
        text=True,
        env=submit_env,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    return Job(submitted.stdout.strip().split(";")[0], logs, out)


@pytest.fixture(autouse=True)
def no_job_left(slurm):
    """A failed test's jobs are cancelled before the next test starts: the next one's job would wait for their
    nodes (a CI run's two-node job pended 15 minutes behind a failed test's job)."""
    yield
    slurm.run("scancel", "--full", "--partition=ci", check=False, timeout=20)


def wait_ready(slurm: SlurmCluster, job: Job, timeout_s: float = 900, want: str = "ready") -> dict:
    started = time.monotonic()
    state = None
    while time.monotonic() - started < timeout_s:
        state = job.endpoint()
        if state and state["state"] in ("ready", "failed", "stopped", "finished"):
            break
        assert job.id in job_ids(slurm), (slurm.jobs(), job.tail())
        time.sleep(3)
    assert state is not None and state["state"] == want, (state, job.tail())
    print(f"job {job.id}: {want} in {time.monotonic() - started:.0f} s; {state.get('tunnel')}")
    return state


def with_key(state: dict) -> dict[str, str]:
    """The environment of a client of the job: its API key (the job writes one, 0600, and names it in endpoint.json)."""
    assert state.get("api_key_file"), f"the job wrote no API key (its endpoint.json names none): {state}"
    key_file = Path(state["api_key_file"])
    assert key_file.stat().st_mode & 0o777 == 0o600, oct(key_file.stat().st_mode)
    return {**os.environ, "OPENAI_API_KEY": key_file.read_text().strip()}


def ask(slurm: SlurmCluster, state: dict, timeout: float = 180) -> dict:
    """The official client against a job (its endpoint.json `state`), with the job's API key."""
    answer = subprocess.run(
        [*slurm.head.net_prefix, sys.executable, "-c", OPENAI_CHECK, f"http://127.0.0.1:{state['port']}/v1"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=with_key(state),
    )
    assert answer.returncode == 0, answer.stderr[-3000:]
    return json.loads(answer.stdout.strip().splitlines()[-1])


def job_ids(slurm: SlurmCluster) -> set[str]:
    """The ids of the jobs in squeue (a line's first field: an id such as 2 is also in a node list like n[1-2])."""
    return {line.split()[0] for line in slurm.jobs() if line.strip()}


def squeue_line(slurm: SlurmCluster, job: Job) -> str:
    (line,) = [j for j in slurm.jobs() if j.split()[0] == job.id]
    return line


def wait_gone(slurm: SlurmCluster, job: Job, timeout_s: float = 90) -> None:
    """The job has left squeue and no process of it is left on any node."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (job.id in job_ids(slurm) or job_processes(job.id)):
        time.sleep(2)
    assert job.id not in job_ids(slurm), job.tail()
    left = [(p.pid, p.info["name"]) for p in job_processes(job.id) if p.is_running()]
    assert not left, f"processes of job {job.id} left: {left}"


def written_script(tmp_path: Path, name: str, *args: str) -> Path:
    """`summit sbatch ARGS -o tmp_path/name`, run from the repository root as the cookbook says."""
    out = tmp_path / name
    made = subprocess.run(
        [sys.executable, "-m", "app.cli", "sbatch", *args, "-o", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    return out


def engine_failure(logs: Path) -> list[str]:
    """The Ray log files under `logs` (a session's `logs` folder) that hold a traceback ending in vLLM's
    EngineDeadError: the replica process's output (`worker-*.out`: vLLM's AsyncLLM output handler) and the
    controller's failed health checks (`serve/controller_*.log`); relative paths, sorted."""
    found = []
    for path in sorted(logs.rglob("*")):
        if path.is_file() and path.suffix in (".out", ".err", ".log"):
            text = path.read_text(errors="replace")
            if "EngineDeadError" in text and ("Traceback" in text or 'File "' in text):
                found.append(str(path.relative_to(logs)))
    return found


def port_binds(slurm: SlurmCluster, port: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *slurm.head.net_prefix,
            sys.executable,
            "-c",
            # as a server binds it (SO_REUSEADDR: the client's closed connections may sit in TIME_WAIT)
            "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('127.0.0.1', {port})); s.listen()",
        ],
        capture_output=True,
        text=True,
    )


def test_jobs_serve_on_their_own_ports_stop_alone_survive_a_lost_node_and_drain_at_the_time_limit(
    slurm, tiny_model_dir, tmp_path
):
    """Two jobs of the shipped script at once (each job costs CI a Ray cluster and an engine, so one test for every
    claim): job `lost` on two nodes, job `b` on one, both on n1 with one CPU a node (the script asks for whole nodes,
    `--exclusive`; `--exclusive=user` on the command line lets one user's jobs share). Each has its own Ray, ports,
    temp dir and endpoint; `lost` serves from both nodes. `scancel` of `b` stops it alone and frees its port. Kill
    `lost`'s worker node's step (as when a node dies): endpoint.json names it, the job keeps serving. Then SLURM's
    signal ahead of the time limit (`--signal=B:USR1@300` in the script; sent here with `scancel --batch`) while a
    stream runs: new requests get a 503, the stream ends complete, the endpoint says stopped, nothing is left."""
    config = yaml.safe_load((REPO / "serve_configs/tiny-cpu.yaml").read_text())
    # long enough for the test's stream on a loaded 2-core machine (the default is 20 s)
    config["applications"][0]["args"]["models"][0]["deployment"]["graceful_shutdown_timeout_s"] = 120
    config_path = tmp_path / "tiny-cpu-drain.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    # job b: the cookbook's one-node recipe (`summit sbatch` of a config that takes part of a node): no --exclusive
    one_node = written_script(tmp_path, "b.sbatch", "serve_configs/tiny-cpu.yaml", "--gpus-per-node", "0")
    assert "#SBATCH --exclusive" not in one_node.read_text()
    shared = ("--cpus-per-task=1", "--exclusive=user")  # the shipped two-node script asks for whole nodes
    job = submit(slurm, tmp_path, tiny_model_dir, "lost", "--nodes=2", *shared, config=config_path)
    other = submit(slurm, tmp_path, tiny_model_dir, "b", "--nodelist=n1", "--cpus-per-task=1", script=one_node)
    # job bad: its engine cannot start (an architecture vLLM does not serve): endpoint.json says why, the job ends
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text((broken / "config.json").read_text().replace("LlamaForCausalLM", "NoSuchLM"))
    bad_env = {"SUMMIT_TINY_MODEL": str(broken)}
    bad = submit(slurm, tmp_path, tiny_model_dir, "bad", "--nodes=1", "--nodelist=n2", *shared, env=bad_env)
    failed = wait_ready(slurm, bad, want="failed")
    assert "Model architectures ['NoSuchLM'] are not supported" in failed["reason"], failed
    assert failed["kind"] == "architecture" and failed["log"] and failed["log_kept"], failed
    wait_gone(slurm, bad, timeout_s=120)  # the job ended by itself: SLURM has its CPUs (and GPUs) back
    assert any(Path(kept).is_file() for kept in failed["log_kept"]), failed["log_kept"]  # copied as the job ended
    state, b = wait_ready(slurm, job), wait_ready(slurm, other)
    print(f"jobs {job.id}, {other.id}: submitted -> ready in {time.monotonic() - started:.0f} s")
    assert squeue_line(slurm, job).split()[1:3] == ["RUNNING", "n[1-2]"], slurm.jobs()  # squeue: both nodes
    assert squeue_line(slurm, other).split()[1:3] == ["RUNNING", "n1"], slurm.jobs()
    ports = {key: (state[key], b[key]) for key in ("port", "dashboard_port")}
    assert state["port"] != b["port"] and state["dashboard_port"] != b["dashboard_port"], ports
    assert (b["url"], b["host"]) == (f"http://127.0.0.1:{b['port']}/v1", "n1"), b
    assert b["tunnel"] == f"ssh -N -L {b['port']}:127.0.0.1:{b['port']} n1", b
    reply = ask(slurm, state)
    assert reply["tokens"] == 8 and reply["models"] == ["tiny-llama"], reply
    # auth is on by default (the YAML has no `auth:`): another user of the node, without the job's key, is refused
    keyless = subprocess.run(
        [*slurm.head.net_prefix, sys.executable, "-c", OPENAI_CHECK, f"http://127.0.0.1:{state['port']}/v1"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OPENAI_API_KEY": ""},
    )
    assert keyless.returncode != 0 and "401" in keyless.stderr, keyless.stderr[-2000:]
    assert ask(slurm, b)["tokens"] == 8
    ray_nodes = {log.name for log in job.logs.glob("ray-*.log")}
    assert ray_nodes == {"ray-head.log", "ray-worker-n2.log"}, ray_nodes
    assert job_processes(job.id) and job_processes(other.id), "each job's processes carry its SLURM_JOB_ID"

    # b's engine dies (SIGKILL, as the kernel's OOM killer does): its replica logs the traceback; scancel; the job
    # must have copied those logs to its LOG_DIR before SLURM's KillWait ran out (its node-local Ray temp dir goes)
    live_logs = Path(f"/tmp/summit-{other.id}/ray/session_latest/logs")
    (core,) = titled(job_processes(other.id), "EngineCore")
    core.kill()
    deadline, failure = time.monotonic() + 120, []
    while time.monotonic() < deadline and not any(f.startswith("worker-") for f in failure):
        failure = engine_failure(live_logs)
        time.sleep(1)
    assert any(f.startswith("worker-") for f in failure), f"no EngineDeadError traceback in {live_logs}: {failure}"
    slurm.run("scancel", other.id)
    wait_gone(slurm, other)
    kept = other.logs / "ray-logs" / "n1"
    assert set(failure) <= set(engine_failure(kept)), f"the kept logs ({kept}) miss the engine's traceback: {failure}"
    batch_in, batch_out = tmp_path / "batch.jsonl", tmp_path / "batch.out.jsonl"
    batch_in.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "tiny-llama", "prompt": f"Line {i}", "max_tokens": 4},
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    # the cookbook's batch recipe, on n1 while job lost runs on
    batch_script = written_script(
        tmp_path, "batch.sbatch", "serve_configs/tiny-cpu.yaml", "--gpus-per-node", "0", "--batch", str(batch_in)
    )
    batch = submit(slurm, tmp_path, tiny_model_dir, "batch", "--nodelist=n1", "--cpus-per-task=1", script=batch_script)
    assert ask(slurm, state)["tokens"] == 8, "job lost answers after job b on the same node stopped"
    assert port_binds(slurm, b["port"]).returncode == 0, f"job b's port {b['port']} still taken"

    steps = slurm.run("squeue", "-h", "-s", "-j", job.id, "-o", "%i %N").stdout.split("\n")
    (worker_step,) = [line.split()[0] for line in steps if line.strip().endswith(" n2")]
    slurm.run("scancel", worker_step)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (job.endpoint() or {}).get("lost_nodes") != ["n2"]:
        time.sleep(2)
    lost = job.endpoint()
    assert lost["lost_nodes"] == ["n2"] and lost["state"] == "ready" and "n2" in lost["detail"], (lost, job.tail())
    assert "node n2 left the job" in job.out.read_text(), job.tail()
    assert squeue_line(slurm, job).split()[1] == "RUNNING"
    deadline, reply = time.monotonic() + 300, None  # a replica that was on n2 restarts on n1
    while time.monotonic() < deadline:
        try:
            reply = ask(slurm, state, timeout=60)
            break
        except (AssertionError, subprocess.TimeoutExpired):
            time.sleep(5)
    assert reply and reply["tokens"] == 8, job.tail()

    # The stream is held in flight across the signal: its engine crawls (paused but 2 ms of every 250) from before
    # the stream starts until the job has begun draining, so the stream can only end complete if the drain waited for
    # it (at full speed the tiny model can finish it before a loaded box delivers the signal).
    cores = titled(job_processes(job.id), "EngineCore")
    assert cores, "the job's replica should own a vLLM EngineCore process"
    with Throttle(cores):
        stream = subprocess.Popen(
            [*slurm.head.net_prefix, sys.executable, "-c", STREAM, f"http://127.0.0.1:{state['port']}/v1", "1500"],
            stdout=subprocess.PIPE,
            text=True,
            env=with_key(state),
        )
        try:
            assert stream.stdout.readline().strip() == "FIRST"
            slurm.run("scancel", "--batch", "--signal=USR1", job.id)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and (job.endpoint() or {}).get("state") != "draining":
                time.sleep(0.5)
            assert (job.endpoint() or {}).get("state") == "draining", (job.endpoint(), job.tail())
            assert stream.poll() is None, "the stream ended before the drain began"
            # a new request is refused (OpenAI-shaped) while the running stream goes on
            deadline, answer = time.monotonic() + 90, ""
            while time.monotonic() < deadline and stream.poll() is None:
                answer = subprocess.run(
                    [*slurm.head.net_prefix, sys.executable, "-c", NEW_REQUEST, f"http://127.0.0.1:{state['port']}/v1"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    env=with_key(state),
                ).stdout.strip()
                if answer and not answer.endswith(" ok"):
                    break
                time.sleep(1)
            assert answer.split()[:1] == ["503"] and "not-OpenAI" not in answer, (answer, job.tail())
            assert stream.poll() is None, "the stream ended while the drain was refusing new requests"
        except BaseException:
            stream.kill()
            raise
    try:
        result = json.loads(stream.stdout.readline())
        stream.wait(timeout=60)
    finally:
        if stream.poll() is None:
            stream.kill()
    assert result == {"finish": "length", "tokens": 1500}, (result, job.tail())
    wait_gone(slurm, job, timeout_s=240)
    probe = port_binds(slurm, state["port"])
    assert probe.returncode == 0, f"port {state['port']} still taken: {probe.stderr}"
    final = job.endpoint()
    assert final["state"] == "stopped" and final["detail"].startswith("drained"), final
    assert "draining" in job.out.read_text(), job.tail()

    done = wait_ready(slurm, batch, want="finished")
    answers = [json.loads(line) for line in batch_out.read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == [f"line-{i}" for i in range(6)], batch.tail()
    assert all(a["response"]["status_code"] == 200 for a in answers), answers[:2]
    assert done["batch_output"] == str(batch_out)
    wait_gone(slurm, batch)
