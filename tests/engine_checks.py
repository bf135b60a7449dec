"""Checks on a running engine's processes, shared by the CPU and GPU suites (read from the OS and Ray's state API)."""

from __future__ import annotations

import psutil

from tests.local_cluster import LocalCluster
from deployments.vllm_adapter import NO_NVLINK_MULTICAST_ENV

RAY_WORKERS = {"RayWorkerProc", "RayWorkerWrapper"}  # vLLM's Ray worker actor: 0.32 (RayExecutorV2) / 0.26


def replica_actors(cluster: LocalCluster, model: str) -> list[dict]:
    return [a for a in cluster.alive_actors() if a["class_name"] == f"ServeReplica:summit:LLMServer:{model}"]


def vllm_workers(cluster: LocalCluster) -> list[dict]:
    return [a for a in cluster.alive_actors() if a["class_name"] in RAY_WORKERS]


def engine_processes(cluster: LocalCluster, replica: dict) -> list[psutil.Process]:
    """The replica's process, its children (engine core, mp workers) and vLLM's Ray workers in its placement group."""
    proc = psutil.Process(replica["pid"])
    workers = [psutil.Process(w["pid"]) for w in vllm_workers(cluster)
               if replica["placement_group_id"] and w["placement_group_id"] == replica["placement_group_id"]]
    return [proc, *proc.children(recursive=True), *workers]


def assert_multicast_off(cluster: LocalCluster, replica: dict) -> None:
    """Every engine process sees the multicast-off environment; the engine's logged config has FlashInfer's all-reduce
    fusion off; no log of the replica mentions FlashInfer's multicast backend ("mnnvl")."""
    for proc in engine_processes(cluster, replica):
        env = proc.environ()
        wrong = {k: env.get(k) for k, v in NO_NVLINK_MULTICAST_ENV.items() if env.get(k) != v}
        assert not wrong, f"pid {proc.pid} {proc.cmdline()[:3]}: {wrong}"
    logs = sorted((cluster.temp_dir / "session_latest" / "logs").glob(f"worker-*-{replica['pid']}.*"))
    text = [f.read_text(errors="replace") for f in logs]
    config = [line for t in text for line in t.splitlines() if "Initializing a V1 LLM engine" in line]
    assert config, f"no engine config line in {[f.name for f in logs]}"
    assert "'fuse_allreduce_rms': False" in config[0], config[0][-2000:]
    assert not any("mnnvl" in t for t in text)


def engine_core_processes(replica_pid: int) -> list[psutil.Process]:
    children = psutil.Process(replica_pid).children(recursive=True)
    return [p for p in children if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]


def kill_engine_and_wait_for_answers(base_url: str, model: str, replica_pid: int, timeout_s: float = 300) -> list:
    """SIGKILL the replica's vLLM engine core, then ask `model` once a second until it answers 200 (Serve replaced the
    replica); returns the failed answers meanwhile. Each must be a clean OpenAI-shaped 503 + Retry-After."""
    import time

    import httpx

    cores = engine_core_processes(replica_pid)
    assert cores, "the replica should own a vLLM EngineCore process"
    for proc in cores:
        proc.kill()
    body = {"model": model, "prompt": "after the crash", "max_tokens": 4, "ignore_eos": True}
    errors, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 4
            break
        errors.append(r)
        time.sleep(1)
    else:
        raise AssertionError(f"no successful request within {timeout_s:.0f} s; last: {errors[-1].status_code} {errors[-1].text}")
    assert errors, "requests right after the crash should fail cleanly, not succeed on a dead engine"
    for failed in errors:
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["type"] == "ServiceUnavailableError"
        assert failed.headers["retry-after"] and "Traceback" not in failed.text
    return errors
