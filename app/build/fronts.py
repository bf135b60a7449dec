"""How many processes serve each replica's HTTP port (`models[].front_processes`): the builder's checks, and `auto`
resolved to a count before the replicas are bound.

One Python process per replica (Serve's replica wrapper, its HTTP server, the front, vLLM's OpenAI layer and the
engine client's output handling) keeps up with a GPU engine's streams up to about a hundred; past that it saturates a
core and requests wait in it (one H200, 8B, 256 streams: 0.76-0.90x vLLM's `api_server`, TTFT p50 2-3x; with four
processes 1.12-1.24x: bench/results). So a GPU model on the direct path gets one front process per
SEQS_PER_FRONT of its engine's sequences (max_num_seqs), at most MAX_AUTO_FRONTS, and at most one per
CPUS_PER_FRONT of the cluster's CPUs per GPU (each busy front process takes about a core beside the engine's)."""

from __future__ import annotations

import os

from app.config import ModelConfig, SummitConfig
from app.config.model import DEFAULT_MAX_NUM_SEQS
from deployments.http.response_ids import STORE_ENV, store_on

SEQS_PER_FRONT = 64
MAX_AUTO_FRONTS = 4
CPUS_PER_FRONT = 4


def auto_front_processes(model: ModelConfig, direct: bool, stored: bool, cpus_per_gpu: float | None) -> int:
    """`front_processes: auto` for `model`: 1 where front processes cannot serve it (CPU engines, the two-hop path,
    LoRA, disaggregation, sleep mode, stored responses), else by its sequences and the cluster's CPUs per GPU."""
    if model.accelerator != "gpu" or not direct or stored:
        return 1
    if model.lora or model.disaggregation or model.sleep is not None:
        return 1
    seqs = int(model.engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
    count = min(MAX_AUTO_FRONTS, -(-seqs // SEQS_PER_FRONT))
    if cpus_per_gpu is not None:
        count = min(count, int(cpus_per_gpu // CPUS_PER_FRONT))
    return max(1, count)


def cluster_cpus_per_gpu() -> float | None:
    """The running cluster's CPUs per GPU (None without Ray or GPUs: no cap)."""
    import ray

    if not ray.is_initialized():
        return None
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0)
    return resources.get("CPU", 0) / gpus if gpus else None


def resolve_front_processes(config: SummitConfig, direct: bool, stored: bool) -> SummitConfig:
    """The config with every model's `front_processes: auto` replaced by its count (the runtime sees integers)."""
    if all(isinstance(m.front_processes, int) for m in config.models):
        return config
    cpus_per_gpu = cluster_cpus_per_gpu()
    models = [
        m
        if isinstance(m.front_processes, int)
        else m.model_copy(update={"front_processes": auto_front_processes(m, direct, stored, cpus_per_gpu)})
        for m in config.models
    ]
    return config.model_copy(update={"models": models})


def responses_stored() -> bool:
    """Whether vLLM keeps responses in the replicas: STORE_ENV set in the application's runtime_env (the builder runs
    in it) or in the cluster's environment, which the replicas share."""
    return store_on(os.environ.get(STORE_ENV, "0"))


def check_front_processes(config: SummitConfig, path: str, why: str) -> None:
    """Front processes asked for by a count share a replica's HTTP port, which only the direct path sends requests to;
    each keeps its own stored responses."""
    several = [m.name for m in config.models if m.front_processes_set > 1]
    if several and responses_stored():
        raise ValueError(
            f"models[{several[0]!r}].front_processes > 1 with {STORE_ENV}=1: each front process would keep its own "
            "responses and a retrieve could reach another. Fix: set front_processes: 1, or unset the variable"
        )
    if several and path != "direct":
        raise ValueError(
            f"models[{several[0]!r}].front_processes > 1 serves the replica's own HTTP port, which only the direct "
            f"path uses; this app runs the two-hop path ({why}). Fix: set front_processes: 1, or make the direct "
            "path possible (ingress.path: auto with RAY_SERVE_ENABLE_HA_PROXY=1)"
        )
