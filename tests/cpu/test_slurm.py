"""The shipped sbatch script on a real SLURM cluster of two nodes (Debian's slurmctld, slurmd and munge; each node a
network and PID namespace of its own: tests/slurm_cluster.py), with the tiny CPU config: the job starts the Ray head
on n1 and a worker on n2, deploys the Serve YAML, writes its endpoint, answers the official OpenAI client; squeue
shows it; scancel stops every process it started and frees its port.

The job is `cluster_yaml/slurm/summit.sbatch` as shipped, with only sbatch options and environment on the command
line (README "Running on SLURM" shows the same commands): `--nodes=2 --gpus-per-node=0 --cpus-per-task=2`, and
GPUS_PER_NODE=0, SERVE_CONFIG, SUMMIT_VENV, RAY_AUTH_TOKEN_PATH, SUMMIT_TINY_MODEL.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import psutil
import pytest

from tests.cpu.engine_apps import REPO
from tests.slurm_cluster import SlurmCluster, slurm_available

pytestmark = [pytest.mark.skipif(not slurm_available(), reason="needs root, slurmctld/slurmd/munge and pyroute2"),
              pytest.mark.timeout(1200)]

CLIENT = """
import json, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
models = [m.id for m in client.models.list().data]
r = client.completions.create(model=models[0], prompt="Over the ridge", max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
print(json.dumps({"models": models, "tokens": r.usage.completion_tokens, "replica": None}))
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


def test_the_shipped_sbatch_serves_from_two_nodes_and_scancel_stops_it(slurm, tiny_model_dir, tmp_path):
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    logs = tmp_path / "logs"
    env = {"GPUS_PER_NODE": "0", "SERVE_CONFIG": str(REPO / "serve_configs/tiny-cpu.yaml"),
           "SUMMIT_VENV": sys.prefix, "PYTHONPATH": str(REPO), "RAY_AUTH_TOKEN_PATH": str(token), "LOG_DIR": str(logs),
           "SUMMIT_TINY_MODEL": str(tiny_model_dir), "NODES_WAIT_S": "180", "READY_WAIT_S": "600",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in env.items() if k != "PATH")])
    # the job's environment is this one (--export=ALL) without the single-node switch the loopback tests set
    submit_env = {k: v for k, v in {**slurm.env, **env}.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    submitted = subprocess.run([*slurm.head.net_prefix, "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0",
                                "--cpus-per-task=2", "--time=30", f"--export={exports}", f"--chdir={REPO}",
                                f"--output={tmp_path}/job-%j.out", str(REPO / "cluster_yaml/slurm/summit.sbatch")],
                               capture_output=True, text=True, env=submit_env, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    started = time.monotonic()
    endpoint = logs / "endpoint.json"
    state = None
    while time.monotonic() - started < 900:
        if endpoint.exists():
            state = json.loads(endpoint.read_text())
            if state["state"] in ("ready", "failed", "stopped"):
                break
        assert job_id in " ".join(slurm.jobs()), (slurm.jobs(), _tail(tmp_path, job_id))
        time.sleep(3)
    ready_s = time.monotonic() - started
    assert state is not None and state["state"] == "ready", (state, _tail(tmp_path, job_id))
    print(f"job {job_id}: submitted -> ready in {ready_s:.0f} s; {state['ssh_tunnel']}")

    (line,) = [j for j in slurm.jobs() if j.split()[0] == job_id]
    assert line.split()[1] == "RUNNING" and line.split()[2] == "n[1-2]", line  # squeue: both nodes
    base_url = f"http://127.0.0.1:{state['port']}/v1"
    answer = subprocess.run([*slurm.head.net_prefix, sys.executable, "-c", CLIENT, base_url], capture_output=True,
                            text=True, timeout=180)
    assert answer.returncode == 0, answer.stderr[-3000:]
    reply = json.loads(answer.stdout.strip().splitlines()[-1])
    assert reply["tokens"] == 8 and reply["models"] == ["tiny-llama"], reply
    ray_nodes = {log.name for log in logs.glob("ray-*.log")}
    assert ray_nodes == {"ray-head.log", "ray-worker-n2.log"}, ray_nodes
    assert job_processes(job_id), "the job's processes carry SLURM_JOB_ID"

    slurm.run("scancel", job_id)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (job_id in " ".join(slurm.jobs()) or job_processes(job_id)):
        time.sleep(2)
    assert job_id not in " ".join(slurm.jobs())
    left = [(p.pid, p.name()) for p in job_processes(job_id) if p.is_running()]
    assert not left, f"processes of job {job_id} left after scancel: {left}"
    probe = subprocess.run([*slurm.head.net_prefix, sys.executable, "-c",
                            # as a server binds it (SO_REUSEADDR: the client's closed connections may sit in TIME_WAIT)
                            "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                            f"s.bind(('127.0.0.1', {state['port']})); s.listen()"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, f"port {state['port']} still taken: {probe.stderr}"


def _tail(tmp_path, job_id: str) -> str:
    out = tmp_path / f"job-{job_id}.out"
    return out.read_text()[-3000:] if out.exists() else "(no job output yet)"
