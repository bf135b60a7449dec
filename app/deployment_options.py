"""Every Serve option of Summit's deployments, computed from the config by pure functions (no Ray calls).

The builder binds deployments with these; `summit validate` and the builder's cluster-fit check read the same
placement from here.
"""

from __future__ import annotations

from typing import Any

from app.config import IngressOptions, ModelConfig
from app.placement import DEFAULT_GPUS_PER_NODE, PlacementPlan, placement_deployment_options, plan_placement
from deployments.routers import request_router_options
from deployments.vllm_adapter import NO_NVLINK_MULTICAST_ENV


def replica_num_cpus(model: ModelConfig) -> float:
    """CPUs of the replica actor: the YAML's, else 0.5 beside a CPU engine and 1 beside a GPU engine."""
    d = model.deployment
    return d.num_cpus if d.num_cpus is not None else (0.5 if model.accelerator == "cpu" else 1.0)


def initial_replicas(model: ModelConfig) -> int:
    """Replicas the model starts with: num_replicas, or the autoscaling config's initial / minimum (at least 1)."""
    auto = model.deployment.autoscaling_config
    if auto is None:
        return model.deployment.num_replicas
    return max(1, int(auto.get("initial_replicas") or auto.get("min_replicas") or 1))


def replica_placement(model: ModelConfig, gpus_per_node: int | None = None) -> PlacementPlan:
    """The placement plan of one replica (app/placement.py) on nodes of `gpus_per_node` (default: the model's)."""
    return plan_placement(model.tensor_parallel_size, model.pipeline_parallel_size, model.accelerator,
                          gpus_per_node or model.gpus_per_node or DEFAULT_GPUS_PER_NODE, model.allow_cross_node_tp,
                          replica_num_cpus(model))


def replica_resources(model: ModelConfig) -> dict[str, Any]:
    """One GPU (or CPUs) for a single-worker engine; a placement group (app/placement.py) for TP x PP on GPUs.

    With a placement group the replica actor takes only CPUs in bundle 0, and vLLM's Ray executor puts one
    worker on each GPU bundle of the replica's group.
    """
    num_cpus = replica_num_cpus(model)
    if model.accelerator == "cpu":
        return {"ray_actor_options": {"num_cpus": num_cpus}}
    # Serve merges these env_vars into the application's; the engine's processes inherit them.
    actor = {"num_cpus": num_cpus, "runtime_env": {"env_vars": dict(NO_NVLINK_MULTICAST_ENV)}}
    if model.tensor_parallel_size * model.pipeline_parallel_size == 1:
        return {"ray_actor_options": {**actor, "num_gpus": 1}}
    return {"ray_actor_options": actor, **placement_deployment_options(replica_placement(model))}


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


def ingress_deployment_options(ingress: IngressOptions) -> dict[str, Any]:
    return {"name": "OpenAIIngress", "num_replicas": ingress.num_replicas,
            "max_ongoing_requests": ingress.max_ongoing_requests, "ray_actor_options": {"num_cpus": ingress.num_cpus}}
