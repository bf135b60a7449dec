"""Helpers for CPU test modules that deploy their own Summit app (several tiny-model deployments) on a private
cluster."""

from __future__ import annotations

import copy
import random
import time
from contextlib import contextmanager
from pathlib import Path

from app.clusters.tiny_model import _WORDS
from tests.local_cluster import LocalCluster, load_serve_config

REPO = Path(__file__).resolve().parents[2]
APP = "summit"


def tiny_model(name: str, engine_kwargs: dict | None = None, deployment: dict | None = None, **fields) -> dict:
    """The shipped tiny-model entry (serve_configs/tiny-cpu.yaml) renamed, with small engine settings merged in."""
    base = copy.deepcopy(
        load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")["applications"][0]["args"]["models"][0]
    )
    base["name"] = name
    base["engine_kwargs"].update({"max_num_seqs": 8, "kv_cache_memory_bytes": 64 << 20, **(engine_kwargs or {})})
    base["deployment"].update(
        {
            "health_check_period_s": 2,
            "health_check_timeout_s": 10,
            "graceful_shutdown_timeout_s": 5,
            **(deployment or {}),
        }
    )
    base.update(fields)
    return base


@contextmanager
def deployed(
    models: list[dict],
    tiny_model_dir: Path,
    num_cpus: float = 4,
    env: dict[str, str] | None = None,
    haproxy: bool = False,
    batch: bool = False,
    args: dict | None = None,
    while_waiting=None,
    ready_path: str = "/v1/models",
    fast_metrics: bool = False,
):
    """A private loopback cluster with one app serving `models` (shipped YAML otherwise); stopped by PID after.
    `haproxy`: Serve's HAProxy in front, which puts the app on the direct path; `batch`: keep the YAML's Batch API;
    `args`: more of the app's args (e.g. `monitoring`); `while_waiting(cluster)`: called about once a second until
    the app is ready; `ready_path`: what answers 200 once it is (`/health` when API keys are on); `fast_metrics`:
    Ray's metrics every 2 s (LocalCluster.fast_metrics), for a module that reads them."""
    cluster = LocalCluster(
        num_cpus=num_cpus,
        env={"SUMMIT_TINY_MODEL": str(tiny_model_dir), **(env or {})},
        haproxy=haproxy,
        fast_metrics=fast_metrics,
    )
    config = app_config(models, batch, args)
    cluster.serve_config = config  # for a test's redeploy with a change
    try:
        cluster.start()
        cluster.serve_deploy(
            config, while_waiting=while_waiting and (lambda: while_waiting(cluster)), ready_path=ready_path
        )
        yield cluster
    finally:
        cluster.stop()


def app_config(models: list[dict], batch: bool = False, args: dict | None = None) -> dict:
    """The shipped YAML (serve_configs/tiny-cpu.yaml) serving `models`; `batch`: keep its Batch API; `args`: more of
    the app's args."""
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    # vLLM's CPU platform lets this legacy variable (1 GiB in the shipped YAML) override kv_cache_memory_bytes.
    config["applications"][0]["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    config["applications"][0]["args"]["models"] = models
    if not batch:
        config["applications"][0]["args"].pop("batch", None)
    config["applications"][0]["args"].update(args or {})
    return config


def deployment_details(cluster: LocalCluster, deployment: str) -> dict:
    """Serve's view of one deployment (status, config, replicas with their states), from the dashboard's REST API."""
    return cluster.dashboard_get("/api/serve/applications/")["applications"][APP]["deployments"][deployment]


def running_replicas(cluster: LocalCluster, deployment: str) -> list[str]:
    return sorted(
        r["replica_id"] for r in deployment_details(cluster, deployment)["replicas"] if r["state"] == "RUNNING"
    )


def _haproxy_servers(cluster: LocalCluster) -> list[tuple[str, str, int]]:
    """(name, host, port) of each engine replica server in HAProxy's config; the name holds the replica's id."""
    import re

    config = next((cluster.temp_dir / "h").rglob("haproxy.cfg")).read_text()
    return [(n, h, int(p)) for n, h, p in re.findall(r"server (SERVE_REPLICA\S+) (\S+):(\d+) check", config)]


def replica_ports(cluster: LocalCluster) -> list[tuple[str, int]]:
    """The engine replicas' own HTTP ports (direct path), as HAProxy's config names them."""
    return sorted({(h, p) for _, h, p in _haproxy_servers(cluster)})


def haproxy_servers(cluster: LocalCluster) -> set[str]:
    """The names of the replica servers in HAProxy's config (a new replica, a new name, even where it got the old
    one's port)."""
    return {n for n, _, _ in _haproxy_servers(cluster)}


def serve_log_matches(cluster: LocalCluster, needle: str) -> list[str]:
    """Every line of the cluster's Serve logs (proxy, controller, replicas) that holds `needle`, after its file's
    name."""
    lines = []
    for path in sorted((cluster.temp_dir / "session_latest/logs/serve").rglob("*.log")):
        lines += [f"{path.name}: {line}" for line in path.read_text(errors="replace").splitlines() if needle in line]
    return lines


def serve_log_lines(cluster: LocalCluster, needle: str) -> str:
    """The last 40 of those lines, for a failure's story."""
    return "\n".join(serve_log_matches(cluster, needle)[-40:])


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def document(i: int, words: int = 220, title: str = "Document", seed_offset: int = 0) -> str:
    """A distinct ~340-token text for the tiny model (≥ 2 CPU KV blocks), distinct from its first characters on; the
    same `i`, `title` and `seed_offset` give the same text."""
    rng = random.Random(seed_offset + i)
    return f"{title} {i}. " + " ".join(rng.choice(_WORDS) for _ in range(words)) + "\n"
