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
