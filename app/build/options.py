"""Every Serve option of Summit's deployments, computed from the config by pure functions (no Ray calls).

The builder binds deployments with these; `summit validate` and the builder's cluster-fit check read the same
placement from here.
"""

from __future__ import annotations

from typing import Any

from app.build.disaggregation import kv_migrating, pd_side
from app.build.placement import (
    PlacementPlan,
    placement_deployment_options,
    plan_placement,
)
from app.config import IngressOptions, ModelConfig
from deployments.engine import NO_NVLINK_MULTICAST_ENV
from deployments.routing.router_options import pool_router_options, request_router_options
from deployments.server.config import ServerConfig

# Where Ray starts (every node: Serve reads these in its controller, HAProxy manager and replicas), for the direct path.
DIRECT_PATH_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # HAProxy sends the request body to the route picker, which reads `model` (and the prompt, for prefix affinity)
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    # ... up to this size (HAProxy's buffer per stream; Serve's default, 8 MiB, costs 16 MiB a connection). A longer
    # body reaches the route picker cut: any replica takes it and hands it to its model's replica (one Ray hop).
    "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(256 * 1024),
    # vLLM's app runs on the replica's own event loop, not a second one with a thread hop per streamed chunk
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # Serve kills a proxy (here its HAProxy manager) not ready within 5 s, and a deploy meeting that fails with a 500;
    # a node busy loading engines can take longer to start HAProxy (seen in CI: two jobs' heads on one loaded node)
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    # Ray's idle cost on a serving node. Ray starts a Python worker per CPU for the first driver and keeps idle ones
    # ready; a Summit node needs a few actors, started once (one H200 host, 64 CPUs: idle workers starting used
    # 3.8-4.9 CPU-s during a 3-s load, more than vLLM's whole server). Actors start their worker when created.
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    # Serve's control loop every 0.5 s instead of 0.1 s: the controller was the largest of Ray's daemons at one
    # stream (bench/results); Serve's health checks, autoscaling and deploys act in seconds either way
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


# Serve's max_ongoing_requests where the replica's front bounds running + queued requests itself (no limit, in effect).
FRONT_BOUNDS_ONGOING = 1_000_000


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
    """The placement plan of one replica (app/build/placement.py) on nodes of `gpus_per_node` (default: the model's);
    the executor is chosen for the same node size."""
    return plan_placement(
        model.tensor_parallel_size,
        model.pipeline_parallel_size,
        model.accelerator,
        model.node_gpus(gpus_per_node),
        model.allow_cross_node_tp,
        replica_num_cpus(model),
        model.distributed_executor(gpus_per_node),
    )


def replica_resources(model: ModelConfig) -> dict[str, Any]:
    """One GPU (or CPUs) for a single-worker engine; for TP x PP on GPUs (app/build/placement.py) every GPU of the
    replica when its workers fit one node (vLLM's `mp` executor: the worker processes see exactly the actor's GPUs),
    else a placement group whose bundle 0 holds the actor's CPUs and each GPU bundle one worker of vLLM's Ray executor.
    """
    num_cpus = replica_num_cpus(model)
    if model.accelerator == "cpu":
        return {"ray_actor_options": {"num_cpus": num_cpus}}
    # The builder adds the application's runtime_env (with_app_runtime_env); the engine's processes inherit them.
    actor = {"num_cpus": num_cpus, "runtime_env": {"env_vars": dict(NO_NVLINK_MULTICAST_ENV)}}
    if model.tensor_parallel_size * model.pipeline_parallel_size == 1:
        # models sharing GPUs by turns (share_with): each replica takes its fraction of one GPU
        share = model.share_group
        return {"ray_actor_options": {**actor, "num_gpus": round(1 / share[1], 4) if share else 1}}
    plan = replica_placement(model)
    if model.distributed_executor() == "mp":
        (bundle,) = plan.bundles
        return {"ray_actor_options": {**actor, "num_cpus": bundle["CPU"], "num_gpus": int(bundle["GPU"])}}
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
        "max_constructor_retry_count": d.max_start_attempts,
        **replica_resources(model),
    }
    autoscaling = model.serve_autoscaling_config()
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = d.num_replicas
    # least_load adds nothing (Serve's default router); the other policies name a Summit router and its kwargs. A model
    # with LoRA adapters or sleep mode always has Summit's router, which reads the adapters each replica has loaded
    # and which replicas sleep; so does one with kv_migration: a moved stream's continuation must not go back to the
    # replica it left (Summit's routers skip the one it names; Serve's sent it to the idlest, often that one).
    if model.lora or model.sleep is not None or model.kv_migration is not None:
        options.update(pool_router_options({model.name: routing_kwargs(model)}))
    else:
        options.update(request_router_options(**routing_kwargs(model)))
    return options


def routing_kwargs(model: ModelConfig) -> dict[str, Any]:
    """The model's routing options as its router takes them; `kv_cache` also gets the model's tokenizer (the router
    tokenizes each request as vLLM will) and its chat template."""
    kwargs = model.routing.model_dump()
    if model.routing.policy == "kv_cache":
        source = model.source if model.source is not None else "${" + str(model.source_env) + "}"
        kwargs["tokenizer"] = model.engine_kwargs.get("tokenizer") or source
        kwargs["chat_template"] = model.frontend_kwargs.get("chat_template")
    return kwargs


def serving_models(models: list[ModelConfig]) -> list[ModelConfig]:
    """The configs the engine deployments that answer requests run: a disaggregated model's decode side, else the
    model itself (with its KV connector when its moving streams carry their KV)."""
    return [pd_side(m, "decode") if m.disaggregation else kv_migrating(m) for m in models]


def engine_pools(model: ModelConfig) -> list[tuple[str, ModelConfig]]:
    """(label, config) of each engine pool a model runs: itself, or its prefill and decode pools."""
    if model.disaggregation is None:
        return [(model.name, kv_migrating(model))]
    return [(f"{model.name} prefill", pd_side(model, "prefill")), (f"{model.name} decode", pd_side(model, "decode"))]


def prefill_deployment_options(model: ModelConfig) -> dict[str, Any]:
    """Serve options of a disaggregated model's prefill pool (`LLMServer:<name>:prefill`; not an HTTP entry)."""
    return {**llm_deployment_options(pd_side(model, "prefill")), "name": f"LLMServer:{model.name}:prefill"}


def server_options(server: ServerConfig) -> dict[str, Any]:
    """Serve options of an engine deployment, from the one config it is bound with: the direct path's entry (every
    model, one a replica), one model's engine behind the two-hop ingress, or a disaggregated model's prefill pool."""
    models = [m for m, _ in server.models]
    if server.role == "entry":
        return engine_pool_options(models)
    options = llm_deployment_options(models[0])
    if server.role == "prefill":  # not an HTTP entry: the decode side's replicas call it
        options["name"] += ":prefill"
    return options


def keeping_responses(options: dict[str, Any], models: list[ModelConfig]) -> dict[str, Any]:
    """Options of an engine deployment whose replicas keep responses (vLLM's store, VLLM_ENABLE_RESPONSES_API_STORE):
    Summit's router, which sends a request about a stored response to the replica keeping it
    (deployments/http/response_ids.py); Serve's default router cannot."""
    if "request_router_config" in options:
        return options
    return {**options, **pool_router_options({m.name: routing_kwargs(m) for m in models})}


# Options a model's own choice may set differently from another model's in one engine deployment (the deployment's
# router applies each model's own routing policy).
_PER_MODEL_OPTIONS = {"name", "num_replicas", "request_router_config"}


def pool_problem(models: list[ModelConfig]) -> str | None:
    """Why these models cannot share one engine deployment (one model a replica), or None when they can.

    Serve gives every replica of a deployment the same resources, placement, router and autoscaling, so the models
    must agree on all of them; autoscaling would scale the models together, so a shared deployment has none."""
    if len(models) == 1:
        return None
    if any(m.deployment.autoscaling_config is not None for m in models):
        return "autoscaling_config is set (replicas of one deployment scale together, not per model)"
    first = _shape(models[0])
    for m in models[1:]:
        differ = sorted(k for k in set(first) | set(_shape(m)) if first.get(k) != _shape(m).get(k))
        if differ:
            return (
                f"models {models[0].name!r} and {m.name!r} differ in {', '.join(differ)} (one deployment gives "
                "every replica the same)"
            )
    return None


def _shape(model: ModelConfig) -> dict[str, Any]:
    return {k: v for k, v in llm_deployment_options(model).items() if k not in _PER_MODEL_OPTIONS}


def engine_pool_options(models: list[ModelConfig]) -> dict[str, Any]:
    """Serve options of the engine deployment hosting `models` (one model a replica; `pool_problem` must be None):
    the direct path's. A bounded queue (max_queued_requests >= 0) is kept by the replica's front, which answers an
    overload OpenAI-shaped (deployments/pipeline/admission.Admission): Serve passes every request on to it (a
    request Serve held back would wait unseen; one Serve refused would get its plain-text answer)."""
    options = llm_deployment_options(models[0])
    if options["max_queued_requests"] >= 0:
        options["max_ongoing_requests"] = FRONT_BOUNDS_ONGOING
        options["max_queued_requests"] = -1
    if len(models) > 1:
        options["name"] = "LLMServer:" + "+".join(m.name for m in models)
        options["num_replicas"] = sum(m.deployment.num_replicas for m in models)
        options.update(pool_router_options({m.name: routing_kwargs(m) for m in models}))
    return options


# How old a replica's load may be when the route picker decides. Serve's cache (10 s by default) is refreshed by the
# replies to requests sent through the router; the picker sends none, so any age lets finished requests or missed
# new ones decide (seen: a hot prefix that never spilled at 10 s, a prefix moved by stale counts at 0.25 s). 0: each
# decision asks the model's replicas for their counts (one small actor call per replica, in parallel).
PICKER_LOAD_MAX_AGE_S = 0


def route_picker_options(ingress: IngressOptions) -> dict[str, Any]:
    """The direct path's ingress request router (HAProxy asks it which replica takes each POST)."""
    env = {"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": str(PICKER_LOAD_MAX_AGE_S)}
    return {
        "name": "RoutePicker",
        "num_replicas": ingress.num_replicas,
        "max_ongoing_requests": ingress.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": ingress.num_cpus, "runtime_env": {"env_vars": env}},
    }


def with_app_runtime_env(options: dict[str, Any], app_runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """Deployment options whose actor keeps the application's runtime_env. Ray Serve gives a deployment that sets its
    own `ray_actor_options.runtime_env` nothing of the application's but its working_dir, so the YAML's
    `runtime_env.env_vars` (HF_TOKEN, the models' path variables, VLLM_* settings) would not reach an engine replica;
    merged as Serve merges a YAML deployment override: the application's runtime_env, its env_vars updated with the
    deployment's own (which win: the multicast-off settings of GPU engines)."""
    actor = options.get("ray_actor_options") or {}
    own = actor.get("runtime_env")
    if not own or not app_runtime_env:
        return options
    env_vars = {**(app_runtime_env.get("env_vars") or {}), **(own.get("env_vars") or {})}
    merged = {**app_runtime_env, **{k: v for k, v in own.items() if k != "env_vars"}, "env_vars": env_vars}
    return {**options, "ray_actor_options": {**actor, "runtime_env": merged}}


def replica_bundles(options: dict[str, Any]) -> tuple[list[dict[str, float]], str]:
    """What one replica of a deployment asks Ray for: its placement group, or its actor as one bundle."""
    if "placement_group_bundles" in options:
        return options["placement_group_bundles"], options["placement_group_strategy"]
    actor = options["ray_actor_options"]
    return [{"CPU": actor.get("num_cpus", 1.0), "GPU": actor.get("num_gpus", 0.0)}], "STRICT_PACK"


def ingress_deployment_options(ingress: IngressOptions) -> dict[str, Any]:
    return {
        "name": "OpenAIIngress",
        "num_replicas": ingress.num_replicas,
        "max_ongoing_requests": ingress.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": ingress.num_cpus},
    }


# The Batch API's store: one replica (the one SQLite writer), on the head node, whose local disk holds the database.
BATCH_API_OPTIONS: dict[str, Any] = {
    "name": "BatchAPI",
    "num_replicas": 1,
    "max_ongoing_requests": 1000,
    # the runner's calls (several a second during a batch) would fill the replica log and `serve run`'s terminal
    "logging_config": {"enable_access_log": False},
    "ray_actor_options": {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
}


# The per-key rate limiter: one replica on the head node; every HTTP entry asks it once per request.
RATE_LIMITER_OPTIONS: dict[str, Any] = {
    "name": "RateLimiter",
    "num_replicas": 1,
    "max_ongoing_requests": 10_000,
    "logging_config": {"enable_access_log": False},
    "ray_actor_options": {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
}


# The adapters loaded at run time (lora.runtime_loading): one replica on the head node; each engine replica reads it
# every second.
ADAPTER_REGISTRY_OPTIONS: dict[str, Any] = {
    "name": "AdapterRegistry",
    "num_replicas": 1,
    "max_ongoing_requests": 10_000,
    "logging_config": {"enable_access_log": False},
    "ray_actor_options": {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
}


def batch_runner_options() -> dict[str, Any]:
    """The batch runner: one replica; it holds no state (the store does), so Serve may restart it anywhere."""
    return {
        "name": "BatchRunner",
        "num_replicas": 1,
        "max_ongoing_requests": 100,
        "ray_actor_options": {"num_cpus": 0},
        "health_check_period_s": 5,
        "logging_config": {"enable_access_log": False},
    }
