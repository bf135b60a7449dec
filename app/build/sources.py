"""Each model's weights checked before any replica starts: where a replica would load them, the `source` must be a
checkpoint directory (with its config.json), a GGUF file, or a Hugging Face id (`org/name`, handed to vLLM as it
takes it); otherwise the deploy fails naming the model, the key and the path (a replica would fail minutes later, on
every node, with vLLM's own error)."""

from __future__ import annotations

import os
import re

from app.config.model import ModelConfig

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def source_problem(path: str) -> str | None:
    """Why `path` (as seen on this machine) is no checkpoint vLLM can load, or None."""
    if os.path.isdir(path):
        return None if os.path.isfile(os.path.join(path, "config.json")) else "is a directory without config.json"
    if os.path.isfile(path):
        return None if path.endswith(".gguf") else "is a file, not a checkpoint directory (or a .gguf file)"
    return "does not exist"


def is_hub_id(source: str) -> bool:
    """A Hugging Face id (`meta-llama/Llama-3.1-8B-Instruct`): `org/name`, not a path (no leading /, ~ or .)."""
    return not source.startswith(("/", "~", ".")) and _HUB_ID.fullmatch(source) is not None


def _where(model: ModelConfig) -> str:
    return f"source_env {model.source_env}" if model.source_env else "source"


def check_sources(models: list[ModelConfig]) -> None:
    """Raise, naming each model, key and path, for sources that cannot be loaded where the replicas would run: on a
    node with a GPU for GPU models (the first alive one; weights are usually on every GPU node or a shared file
    system), here for CPU models. A Hugging Face id, or a path absent here that exists nowhere yet, passes as vLLM
    takes it only in the first case."""
    problems = []
    for model in models:
        source = model.resolved_source()  # raises, naming the model, for an unset variable
        if is_hub_id(source) and not os.path.exists(source):
            continue
        where, problem = _check_on_replica_node(model.accelerator, source)
        if problem:
            problems.append(f"model {model.name!r}: {_where(model)} {source!r} {problem}{where}")
    if problems:
        raise ValueError(
            "; ".join(problems) + ". Fix: point the key at a checkpoint directory (with config.json) that exists on "
            "the nodes that run the model (a path is read where the app is built: set variables in the application's "
            "runtime_env.env_vars, not the shell that runs `serve deploy`), or give a Hugging Face id (org/name)"
        )


def _check_on_replica_node(accelerator: str, source: str) -> tuple[str, str | None]:
    """(" on node IP" or "", problem) for `source` as a node that could run the replica sees it."""
    import ray

    if accelerator != "gpu" or not ray.is_initialized():
        return "", source_problem(source)
    gpu_nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]
    if not gpu_nodes:
        return "", None  # no GPU node yet (placement_wait_s -1): the replicas will say
    node = gpu_nodes[0]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    check = ray.remote(num_cpus=0, scheduling_strategy=strategy)(source_problem)
    return f" on node {node['NodeManagerAddress']}", ray.get(check.remote(source), timeout=120)
