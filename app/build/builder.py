"""`app.build:build_app` — the Serve application for a Summit YAML's `args:`."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from app.build.disaggregation import disaggregation_problem, pd_side
from app.build.engine_checks import load_config
from app.build.fronts import check_front_processes, resolve_front_processes, responses_stored
from app.build.options import (
    ADAPTER_REGISTRY_OPTIONS,
    BATCH_API_OPTIONS,
    RATE_LIMITER_OPTIONS,
    batch_runner_options,
    engine_pool_options,
    ingress_deployment_options,
    keeping_responses,
    llm_deployment_options,
    pool_problem,
    prefill_deployment_options,
    replica_bundles,
    replica_placement,
    route_picker_options,
    server_options,
    serving_models,
    with_app_runtime_env,
)
from app.build.placement import PlacementPlan, parts_unplaceable, unplaceable
from app.build.sources import check_sources
from app.config import SummitConfig
from app.config.env import ENGINE_OVERRIDES_ENV
from deployments.batch.api import BatchAPI
from deployments.batch.runner import BatchRunner
from deployments.hops.ingress import OpenAIIngress
from deployments.lora.runtime import AdapterRegistry
from deployments.pipeline.auth import load_api_keys
from deployments.pipeline.rate_limit import RateLimiter
from deployments.routing.picker import RoutePicker
from deployments.server.config import ServerConfig
from deployments.server.llm_server import LLMServer

logger = logging.getLogger("ray.serve")
NO_HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY is not 1 where Serve runs"


def wait_until_placeable(
    options: dict[str, dict[str, Any]],
    wait_s: float,
    poll_s: float = 5.0,
    plans: dict[str, PlacementPlan] | None = None,
) -> None:
    """Wait (up to `wait_s`) until the cluster's alive nodes could hold one replica of each model, else raise naming
    the model and the missing resource. Serve itself would leave such a replica pending without end. `plans`: the
    GPU models' placement plans, whose node parts (the GPUs that must share a node) must each find a node, as
    `summit validate` checks them (app/plan/validate.py)."""
    import ray

    if not ray.is_initialized() or wait_s < 0:
        return
    deadline, next_log = time.monotonic() + wait_s, time.monotonic()
    while True:
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        problems = [
            f"model {name!r}: one replica {why}"
            for name, opts in options.items()
            if (why := part_problem((plans or {}).get(name), nodes) or unplaceable(*replica_bundles(opts), nodes))
        ]
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise ValueError(
                f"the Ray cluster cannot place {'; '.join(problems)} (waited {wait_s:g} s for nodes). Fix: add nodes "
                "with those resources, or lower the model's tensor_parallel_size / pipeline_parallel_size / "
                "deployment.num_cpus; or raise `placement_wait_s` (-1: wait without end) if nodes are still to join."
            )
        if time.monotonic() >= next_log:
            logger.warning(
                "Waiting up to %.0f s more for Ray nodes: %s", deadline - time.monotonic(), "; ".join(problems)
            )
            next_log = time.monotonic() + 30
        time.sleep(min(poll_s, max(0.05, deadline - time.monotonic())))


def request_path(config: SummitConfig, haproxy: bool) -> tuple[str, str]:
    """("direct" | "hops", why): the path the YAML's `ingress.path` and the cluster allow; raises for a `direct` that
    cannot be."""
    if config.ingress.path == "hops":
        return "hops", "ingress.path is hops"
    problem = None if haproxy else NO_HAPROXY
    problem = problem or pool_problem(serving_models(config.models))
    if problem is None:
        return "direct", "HAProxy -> engine replica"
    if config.ingress.path == "direct":
        raise ValueError(
            f"ingress.path: direct is not possible: {problem}. Fix: set ingress.path: auto (or hops), or "
            "remove the difference (start Ray with RAY_SERVE_ENABLE_HA_PROXY=1; give the models the same "
            "deployment/parallel settings and no autoscaling)"
        )
    return "hops", problem


def build_app(args: dict[str, Any]) -> Application:
    """Validate the YAML args once, check the cluster can hold the models, then bind the request path:
    direct (the engine deployment is the HTTP ingress behind HAProxy, a route picker chooses each request's replica)
    where it can be, else one engine deployment per model behind the OpenAIIngress (two hops)."""
    config = load_config(args)
    if os.environ.get(ENGINE_OVERRIDES_ENV):
        logger.info("engine_kwargs of every model from %s: %s", ENGINE_OVERRIDES_ENV, os.environ[ENGINE_OVERRIDES_ENV])
    check_before_deploy(config)
    path, why = request_path(config, haproxy_enabled())
    logger.info("Summit request path: %s (%s)", path, why)
    check_front_processes(config, path, why)
    config = resolve_front_processes(config, path == "direct", responses_stored())
    shared = Shared(
        # each disaggregated model's prefill pool, handed to the deployment of its decode side
        prefill={
            m.name: engine_deployment(
                ServerConfig([(pd_side(m, "prefill"), m.resolved_source())], config.monitoring, role="prefill")
            )
            for m in config.models
            if m.disaggregation
        },
        batch_api=batch_app(config, engine_deployment_names(config, path)),
        limiter=rate_limiter(config),
        registry=(
            serve.deployment(AdapterRegistry).options(**ADAPTER_REGISTRY_OPTIONS).bind()
            if config.runtime_lora_models
            else None
        ),
    )
    return direct_app(config, shared) if path == "direct" else two_hop_app(config, shared, why)


@dataclass
class Shared:
    """The application's deployments besides the engines, which the engines (or the ingress) are bound with."""

    prefill: dict[str, Application]
    batch_api: Application | None
    limiter: Application | None
    registry: Application | None


def part_problem(plan: PlacementPlan | None, nodes: list[dict]) -> str | None:
    if plan is None:
        return None
    return parts_unplaceable(plan, [n.get("GPU", 0.0) for n in nodes])


def check_before_deploy(config: SummitConfig) -> None:
    """What would fail every replica's start, failed now instead, naming the key: a KV connector this machine's vLLM
    cannot run, API keys that cannot be read, a cluster that cannot place one replica of every model, weights that
    are not where a replica would load them."""
    problems = [p for m in config.models if (p := disaggregation_problem(m))]
    if problems:
        raise ValueError("; ".join(problems))
    options = {m.name: llm_deployment_options(m) for m in serving_models(config.models)}
    options.update({f"{m.name} (prefill)": prefill_deployment_options(m) for m in config.models if m.disaggregation})
    plans = {m.name: replica_placement(m) for m in serving_models(config.models) if m.accelerator == "gpu"}
    wait_until_placeable(options, config.placement_wait_s, plans=plans)
    check_sources(config.models)
    if config.auth is not None:
        load_api_keys(config.auth.api_keys_env, config.auth.api_keys_file)


def direct_app(config: SummitConfig, shared: Shared) -> Application:
    """The engine deployment is the HTTP entry (HAProxy -> replica); a route picker where the choice needs one."""
    serving = serving_models(config.models)  # a disaggregated model answers from its decode pool
    engines = engine_deployment(
        ServerConfig(
            [(m, m.resolved_source()) for m in serving],
            config.monitoring,
            config.auth,
            shared.prefill,
            shared.batch_api,
            shared.limiter,
            shared.registry,
            role="entry",
        )
    )
    only = config.models[0]
    summit_router = only.lora or only.sleep is not None or only.kv_migration is not None  # options.py says why
    if len(serving) == 1 and only.routing.policy == "least_load" and not summit_router:
        if not responses_stored():  # else a continued response (previous_response_id) goes to its replica
            return engines  # HAProxy's own choice (leastconn) is least-load: no routing call per request
    picker = serve.deployment(RoutePicker).options(**own_env(route_picker_options(config.ingress))).bind(engines)
    return engines._with_ingress_request_router(picker)


def two_hop_app(config: SummitConfig, shared: Shared, why: str = "") -> Application:
    """Serve's proxy -> the OpenAIIngress -> one engine deployment per model."""
    serving = serving_models(config.models)
    servers = {
        m.name: engine_deployment(
            ServerConfig(
                [(m, m.resolved_source())],
                config.monitoring,
                prefill={m.name: shared.prefill[m.name]} if m.name in shared.prefill else None,
                adapter_registry=shared.registry,
            )
        )
        for m in serving
    }
    ingress = serve.deployment(OpenAIIngress).options(**ingress_deployment_options(config.ingress))
    return ingress.bind(
        servers,
        config.auth,
        shared.batch_api,
        shared.limiter,
        {a: m.name for m in serving for a in m.adapter_names},
        shared.registry,
        config.runtime_lora_models,
        why,
    )


def own_env(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the application's runtime_env kept (app/build/options.py: with_app_runtime_env); the builder
    runs in the application's runtime_env."""
    app_env = dict(ray.get_runtime_context().runtime_env or {}) if ray.is_initialized() else {}
    return with_app_runtime_env(options, app_env)


def engine_deployment(server: ServerConfig) -> Application:
    """An engine deployment, bound with its one config and given the Serve options that config implies."""
    deployment = serve.ingress()(LLMServer) if server.role == "entry" else LLMServer
    options = server_options(server)
    if responses_stored() and server.role != "prefill":  # a prefill pool never answers a client
        options = keeping_responses(options, [m for m, _ in server.models])
    return serve.deployment(deployment).options(**own_env(options)).bind(server)


def engine_deployment_names(config: SummitConfig, path: str) -> dict[str, str]:
    """Each served model's engine deployment (the decode pool of a disaggregated one) on a request path."""
    serving = serving_models(config.models)
    if path == "direct":
        names = {m.name: engine_pool_options(serving)["name"] for m in serving}
    else:
        names = {m.name: llm_deployment_options(m)["name"] for m in serving}
    return {**names, **{a: names[m.name] for m in serving for a in m.adapter_names}}  # an adapter: its model's


def batch_app(config: SummitConfig, engine_names: dict[str, str]) -> Application | None:
    """The Batch API's store (which the HTTP entry hands /v1/files and /v1/batches to) and its runner (which the store
    wakes, and which finds the store and each model's engine deployment by name): None when `batch` is off."""
    if config.batch is None:
        return None
    options = config.batch.model_dump()
    priority = [
        n
        for m in config.models
        if m.engine_kwargs.get("scheduling_policy") == "priority"
        for n in [m.name, *m.adapter_names]
    ]
    runner = (
        serve.deployment(BatchRunner)
        .options(**batch_runner_options())
        .bind(options, engine_names, priority, BATCH_API_OPTIONS["name"])
    )
    return serve.deployment(BatchAPI).options(**BATCH_API_OPTIONS).bind(options, runner)


def rate_limiter(config: SummitConfig) -> Application | None:
    """The application's one RateLimiter (per-key limits across every HTTP entry), when `auth.rate_limit` is set."""
    limit = config.auth.rate_limit if config.auth is not None else None
    if limit is None:
        return None
    return (
        serve.deployment(RateLimiter)
        .options(**RATE_LIMITER_OPTIONS)
        .bind(limit.requests_per_minute, limit.tokens_per_minute)
    )


def haproxy_enabled() -> bool:
    """Whether Serve runs HAProxy in front (read as Serve reads it, in this process's environment)."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0") == "1"
