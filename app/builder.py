"""`app.builder:build_app` — the Serve application for a Summit YAML's `args:`."""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import serve
from ray.serve import Application

from app.config import ModelConfig, SummitConfig
from app.placement import DEFAULT_GPUS_PER_NODE, placement_deployment_options, plan_placement, unplaceable
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer
from deployments.routers import request_router_options
from deployments.vllm_adapter import NO_NVLINK_MULTICAST_ENV

logger = logging.getLogger("ray.serve")


def replica_resources(model: ModelConfig) -> dict[str, Any]:
    """One GPU (or CPUs) for a single-worker engine; a placement group (app/placement.py) for TP x PP on GPUs.

    With a placement group the replica actor takes only CPUs in bundle 0, and vLLM's Ray executor puts one
    worker on each GPU bundle of the replica's group.
    """
    d = model.deployment
    num_cpus = d.num_cpus if d.num_cpus is not None else (0.5 if model.accelerator == "cpu" else 1.0)
    if model.accelerator == "cpu":
        return {"ray_actor_options": {"num_cpus": num_cpus}}
    # Serve merges these env_vars into the application's; the engine's processes inherit them.
    actor = {"num_cpus": num_cpus, "runtime_env": {"env_vars": dict(NO_NVLINK_MULTICAST_ENV)}}
    if model.tensor_parallel_size * model.pipeline_parallel_size == 1:
        return {"ray_actor_options": {**actor, "num_gpus": 1}}
    plan = plan_placement(model.tensor_parallel_size, model.pipeline_parallel_size, "gpu",
                          model.gpus_per_node or DEFAULT_GPUS_PER_NODE, model.allow_cross_node_tp, num_cpus)
    return {"ray_actor_options": actor, **placement_deployment_options(plan)}


def llm_deployment_options(model: ModelConfig) -> dict[str, Any]:
    """Serve options of one model's engine deployment (pure: no Ray calls)."""
    d = model.deployment
    options: dict[str, Any] = {
        "name": f"LLMServer:{model.name}",
        "max_ongoing_requests": model.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
        # The ingress's handle raises BackPressureError carrying these; the ingress answers with them.
        "backpressure_config": {"status_code": d.overload_status_code, "retry_after_s": d.retry_after_s},
        "health_check_period_s": d.health_check_period_s,
        "health_check_timeout_s": d.health_check_timeout_s,
        "graceful_shutdown_timeout_s": d.graceful_shutdown_timeout_s,
        **replica_resources(model),
    }
    autoscaling = model.serve_autoscaling_config()
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = d.num_replicas
    # least_load adds nothing (Serve's default router); the affinity policies name their router and its kwargs.
    options.update(request_router_options(model.routing.policy, **model.routing.model_dump(exclude={"policy"})))
    return options


def replica_bundles(options: dict[str, Any]) -> tuple[list[dict[str, float]], str]:
    """What one replica of a deployment asks Ray for: its placement group, or its actor as one bundle."""
    if "placement_group_bundles" in options:
        return options["placement_group_bundles"], options["placement_group_strategy"]
    actor = options["ray_actor_options"]
    return [{"CPU": actor.get("num_cpus", 1.0), "GPU": actor.get("num_gpus", 0.0)}], "STRICT_PACK"


def wait_until_placeable(options: dict[str, dict[str, Any]], wait_s: float, poll_s: float = 5.0) -> None:
    """Wait (up to `wait_s`) until the cluster's alive nodes could hold one replica of each model, else raise naming
    the model and the missing resource. Serve itself would leave such a replica pending without end."""
    import ray

    if not ray.is_initialized() or wait_s < 0:
        return
    deadline, next_log = time.monotonic() + wait_s, time.monotonic()
    while True:
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        problems = [f"model {name!r}: one replica {why}" for name, opts in options.items()
                    if (why := unplaceable(*replica_bundles(opts), nodes))]
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise ValueError(
                f"the Ray cluster cannot place {'; '.join(problems)} (waited {wait_s:g} s for nodes). Fix: add nodes with "
                "those resources, or lower the model's tensor_parallel_size / pipeline_parallel_size / deployment.num_cpus; "
                "or raise `placement_wait_s` (-1: wait without end) if nodes are still to join.")
        if time.monotonic() >= next_log:
            logger.warning("Waiting up to %.0f s more for Ray nodes: %s", deadline - time.monotonic(), "; ".join(problems))
            next_log = time.monotonic() + 30
        time.sleep(min(poll_s, max(0.05, deadline - time.monotonic())))


def build_app(args: dict[str, Any]) -> Application:
    """Validate the YAML args once, check the cluster can hold the models, then bind one engine deployment per model
    behind one ingress."""
    config = SummitConfig.model_validate(args)
    options = {m.name: llm_deployment_options(m) for m in config.models}
    wait_until_placeable(options, config.placement_wait_s)
    servers = {
        m.name: serve.deployment(LLMServer).options(**options[m.name]).bind(m, m.resolved_source())
        for m in config.models
    }
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress.num_cpus},
    )
    return ingress.bind(servers)
