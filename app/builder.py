"""`app.builder:build_app` — the Serve application for a Summit YAML's `args:`."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from app.config import ModelConfig, SummitConfig
from app.placement import DEFAULT_GPUS_PER_NODE, placement_deployment_options, plan_placement
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer
from deployments.routers import request_router_options


def replica_resources(model: ModelConfig) -> dict[str, Any]:
    """One GPU (or CPUs) for a single-worker engine; a placement group (app/placement.py) for TP x PP on GPUs.

    With a placement group the replica actor takes only CPUs in bundle 0, and vLLM's Ray executor puts one
    worker on each GPU bundle of the replica's group.
    """
    d = model.deployment
    num_cpus = d.num_cpus if d.num_cpus is not None else (0.5 if model.accelerator == "cpu" else 1.0)
    if model.accelerator == "cpu" or model.tensor_parallel_size * model.pipeline_parallel_size == 1:
        gpus = {"num_gpus": 1} if model.accelerator == "gpu" else {}
        return {"ray_actor_options": {"num_cpus": num_cpus, **gpus}}
    plan = plan_placement(model.tensor_parallel_size, model.pipeline_parallel_size, "gpu",
                          model.gpus_per_node or DEFAULT_GPUS_PER_NODE, model.allow_cross_node_tp, num_cpus)
    return {"ray_actor_options": {"num_cpus": num_cpus}, **placement_deployment_options(plan)}


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


def build_app(args: dict[str, Any]) -> Application:
    """Validate the YAML args once, then bind one engine deployment per model behind one ingress."""
    config = SummitConfig.model_validate(args)
    servers = {
        m.name: serve.deployment(LLMServer).options(**llm_deployment_options(m)).bind(m, m.resolved_source())
        for m in config.models
    }
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress.num_cpus},
    )
    return ingress.bind(servers)
