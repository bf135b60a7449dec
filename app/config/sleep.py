"""Sleep mode in the YAML: a replica's engine put to sleep when idle (`deployment.sleep`), and models that share one
GPU by time (`models[].share_with`), one awake at a time (the runtime: deployments/server/sleep.py).

vLLM's sleep levels: 1 moves the weights to CPU memory and frees the KV cache (wake: weights copied back); 2 frees
both (wake: weights loaded again from the checkpoint). Either way the prefix cache is lost."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.config.model import ModelConfig


def share_groups(models: list[ModelConfig]) -> dict[str, list[ModelConfig]]:
    """Each GPU-sharing group (`share_with`), by the name of the model the others name, its members in YAML order
    (that model first). Raises naming the key when a group cannot share."""
    by_name = {m.name: m for m in models}
    groups: dict[str, list[ModelConfig]] = {}
    for m in models:
        if m.share_with is None:
            continue
        target = by_name.get(m.share_with)
        where = f"models[{m.name!r}].share_with"
        if target is None or target is m:
            raise ValueError(f"{where}: {m.share_with!r} is not another model of this YAML; name one of them")
        if target.share_with is not None:
            raise ValueError(
                f"{where}: {target.name!r} shares with {target.share_with!r} itself; name the model the group "
                f"shares with ({target.share_with!r})"
            )
        groups.setdefault(target.name, [target]).append(m)
    for members in groups.values():
        for m in members:
            _check_member(m, members[0])
    return groups


def _check_member(m: ModelConfig, root: ModelConfig) -> None:
    where, group = f"models[{m.name!r}]", root.name
    if m.accelerator != root.accelerator:
        raise ValueError(f"{where}.accelerator: {m.accelerator!r}, but {group!r} runs on {root.accelerator!r}")
    if m.tensor_parallel_size * m.pipeline_parallel_size != 1:
        raise ValueError(
            f"{where}: models sharing a GPU (share_with: {group}) run on one GPU each (tensor_parallel_size and "
            "pipeline_parallel_size 1): Ray gives a fraction of one GPU only. Fix: set both to 1 or drop share_with"
        )
    if m.deployment.autoscaling_config is not None:
        raise ValueError(
            f"{where}.deployment.autoscaling_config: models sharing a GPU (share_with: {group}) keep a fixed "
            "num_replicas (their replicas are paired on GPUs); remove autoscaling_config"
        )
    for key, on in (("disaggregation", m.disaggregation is not None), ("front_processes", m.front_processes_set > 1)):
        if on:
            raise ValueError(f"{where}.{key}: not supported with share_with (sleep mode); remove one of them")


def sleep_problem(m: ModelConfig) -> str | None:
    """Why the model's `deployment.sleep` cannot work, or None."""
    if m.sleep is None:
        return None
    if m.disaggregation is not None:
        return (
            f"models[{m.name!r}].deployment.sleep: not supported with disaggregation (the other pool's engine "
            "would not know); remove one of them"
        )
    if m.sleep.level == 2 and m.engine_kwargs.get("load_format") == "dummy":
        return (
            f"models[{m.name!r}].deployment.sleep.level: 2 discards the weights and reloads them on wake, which vLLM "
            "refuses for engine_kwargs.load_format: dummy ('Model reloading with `dummy` format'); use level 1"
        )
    if m.front_processes_set > 1:
        return (
            f"models[{m.name!r}].deployment.sleep: not supported with front_processes > 1 (requests of the other "
            "front processes would not wake the engine); set front_processes: 1 or remove sleep"
        )
    return None
