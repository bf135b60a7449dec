"""What a process that runs a replica's front is given: the replica itself (server/llm_server.py), or one of its extra
front processes (server/front_process.py, `models[].front_processes`). Both call `build_front` with the
deployment's ServerConfig, their model and their own client of the engine, and get the same ReplicaFront: the model
table, the front's options (API keys, forwarding to the deployment's other models, the Batch API, rate limits, LoRA at
run time, the prefill pool, metrics, traces, admission); `start_adapter_sync` keeps its adapters in sync with the
registry."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import ModelConfig, expand_env
from deployments import engine
from deployments.batch.share import BatchShare, OnlineBoard
from deployments.engine import EngineApp
from deployments.http.protocol import HTTPRequest
from deployments.lora.adapters import Adapters
from deployments.lora.runtime import SYNC_PERIOD_S, RuntimeAdapters
from deployments.observability import metrics
from deployments.observability.tracing import Tracing
from deployments.pipeline.admission import Admission
from deployments.pipeline.auth import load_api_keys
from deployments.pipeline.migration import KVMigration
from deployments.pipeline.prefill import Disaggregated
from deployments.pipeline.rate_limit import Limits
from deployments.routing.choose import can_route
from deployments.server.config import ServerConfig
from deployments.server.front import EngineSide, FrontOptions, ReplicaFront
from deployments.server.models import ModelTable
from deployments.server.sleep import Sleeper
from deployments.server.startup import model_cards
from deployments.server.stream_journal import StreamJournals

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class FrontSite:
    """Where a front runs: what differs between the replica's process and its front processes."""

    replica_id: str  # the replica whose engine the front runs on (its answers name it)
    metrics: metrics.ReplicaMetrics
    tracing: Tracing
    fronts: int = 1  # the replica's front processes, which share its bound on running + queued requests
    sleeper: Sleeper | None = None  # the engine's sleep mode (the replica process only)
    deployment: tuple[str, str] | None = None  # (deployment, app) where not in a Serve replica
    board: OnlineBoard | None = None  # the replica's processes' online requests, where it has front processes
    board_slot: int = 0  # this process's slot on it (its engine client's index)


def build_front(config: ServerConfig, model: ModelConfig, engine_app: EngineApp, site: FrontSite) -> ReplicaFront:
    """The front of `model` (one of `config.models`) on this process's client of its engine."""
    pool = OwnDeployment(site.deployment)
    options = front_options(config, model, site, pool)
    d = model.deployment
    if config.role == "entry" and d.max_queued_requests >= 0:  # the direct path's HTTP entry
        options.admission = Admission(
            -(-model.max_ongoing_requests // site.fronts),
            -(-d.max_queued_requests // site.fronts),
            d.overload_status_code,
            d.retry_after_s,
        )
    return ReplicaFront(
        EngineSide(
            engine_app.app,
            lambda: engine.engine_is_dead(engine_app.engine),
            site.replica_id,
            lambda *point: engine.output_detokenizer(engine_app.engine, *point),
            lambda: engine.stores_responses(engine_app.app),
            lambda response_id: engine.background_response(engine_app.app, response_id),
        ),
        model_table(config, model, engine_app, pool),
        options,
    )


def model_table(config: ServerConfig, model: ModelConfig, engine_app: EngineApp, pool: OwnDeployment) -> ModelTable:
    adapters = None
    if model.lora:
        adapters = Adapters(
            {a.name: expand_env(a.path) for a in model.lora.adapters},
            model.lora.max_loras,
            lambda name, path: engine.load_adapter(engine_app, name, path, model.name),
            lambda name: engine.unload_adapter(engine_app, name),
        )
    models = config.models
    return ModelTable(
        model.name,
        config.names,
        {card["id"]: card for m, src in models for card in model_cards(m, src)},
        {a: m.name for m, _ in models for a in m.adapter_names},
        adapters,
        pool.model_ready if len(models) > 1 else None,
    )


def front_options(config: ServerConfig, model: ModelConfig, site: FrontSite, pool: OwnDeployment) -> FrontOptions:
    c, several = config, len(config.models) > 1
    parsers = model.frontend_kwargs.get("reasoning_parser") or model.frontend_kwargs.get("tool_call_parser")
    options = FrontOptions(
        keys=load_api_keys(c.auth.api_keys_env, c.auth.api_keys_file) if c.auth else None,
        forward=pool.forward if several else None,
        coalesce_s=model.stream_coalesce_ms / 1000.0,
        migration=model.stream_migration,
        resume_to=pool.forward,
        kv_migration=kv_migration(model),
        chat_parsers=bool(parsers),
        metrics=site.metrics if c.monitoring.metrics else None,
        tracing=site.tracing if site.tracing.enabled else None,
        batch_share=BatchShare(board=site.board, slot=site.board_slot),
        sleeper=site.sleeper,
        to_keeper=pool.forward,
        front_index=site.board_slot,
    )
    if model.stream_resume is not None:
        options.journals = StreamJournals(model.stream_resume.window_s, model.stream_resume.max_bytes)
    if c.batch_api is not None:
        options.batch_api = lambda request, h=c.batch_api.options(stream=True): h.handle_http.remote(request)
    if c.limiter is not None:
        options.limits = Limits(c.limiter, c.auth.rate_limit.default_max_tokens)
    if c.adapter_registry is not None:
        options.runtime_lora = RuntimeAdapters(
            c.adapter_registry,
            [m.name for m, _ in c.models if m.lora and m.lora.runtime_loading],
            {a for m, _ in c.models for a in m.adapter_names},
            site.replica_id,
        )
    if c.prefill and model.name in c.prefill:
        prefill = c.prefill[model.name].options(stream=True)
        options.disaggregated = Disaggregated(
            lambda request: prefill.handle_http.remote(request), model.disaggregation_fallback
        )
    return options


def kv_migration(model: ModelConfig) -> KVMigration | None:
    kv = model.kv_migration
    if kv is None:
        return None
    return KVMigration(kv.min_tokens, lambda ids, connector=kv.connector: engine.hand_off_tokens(connector, ids))


async def start_adapter_sync(front: ReplicaFront) -> asyncio.Task | None:
    """Knows the adapters loaded at run time before the front takes traffic, then keeps in sync (the task; None
    without LoRA at run time)."""
    runtime = front.options.runtime_lora
    if runtime is None:
        return None

    async def sync_once() -> None:
        try:
            await runtime.refresh(front.table)
        except Exception as e:  # noqa: BLE001 — the registry restarting: the next round catches up
            logger.warning("LoRA adapter registry not reachable (%s: %s); retrying", type(e).__name__, e)

    async def keep_in_sync() -> None:
        while True:
            await asyncio.sleep(SYNC_PERIOD_S)
            await sync_once()

    await sync_once()
    return asyncio.get_running_loop().create_task(keep_in_sync())


class OwnDeployment:
    """The replica's own deployment, through a handle (its router keeps each request to its model's replicas):
    where another model's request, a resumed stream's continuation or a stored response's follow-up goes."""

    def __init__(self, deployment: tuple[str, str] | None):
        self._deployment = deployment  # None: this Serve replica's own, asked of Serve at first use
        self._handle: DeploymentHandle | None = None

    def handle(self) -> DeploymentHandle:
        if self._handle is None:
            if self._deployment is None:
                context = serve.get_replica_context()
                self._deployment = (context.deployment, context.app_name)
            self._handle = serve.get_deployment_handle(*self._deployment)
        return self._handle

    def forward(self, request: HTTPRequest):
        """A Serve response stream for `request` from one of its model's replicas."""
        return self.handle().options(stream=True).handle_http.remote(request)

    async def model_ready(self, name: str) -> bool:
        """Whether another model of this deployment has a running replica (it is listed in /v1/models only then)."""
        return await can_route(self.handle(), HTTPRequest("POST", "", model=name))
