"""What a process that runs a replica's front is: the replica itself (server/llm_server.py), or one of its extra
front processes (server/front_process.py, `models[].front_processes`). Both build the same ReplicaFront from the
deployment's ServerConfig around their own client of the engine: the model table, the front's options (API keys,
forwarding to the deployment's other models, the Batch API, rate limits, LoRA at run time, the prefill pool,
metrics, traces, admission) and the adapters' sync with the registry."""

from __future__ import annotations

import asyncio
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import ModelConfig, expand_env
from deployments import engine
from deployments.batch.share import BatchShare
from deployments.engine import EngineApp
from deployments.http.protocol import HTTPRequest
from deployments.lora.adapters import Adapters
from deployments.lora.runtime import SYNC_PERIOD_S, RuntimeAdapters
from deployments.observability import metrics
from deployments.observability.tracing import Tracing
from deployments.pipeline.admission import Admission
from deployments.pipeline.auth import load_api_keys
from deployments.pipeline.prefill import Disaggregated
from deployments.pipeline.rate_limit import Limits
from deployments.routing.choose import can_route
from deployments.server.config import ServerConfig
from deployments.server.front import EngineSide, FrontOptions, ReplicaFront
from deployments.server.models import ModelTable
from deployments.server.sleep import Sleeper
from deployments.server.startup import model_cards

logger = logging.getLogger("ray.serve")


class FrontHost:
    """The parts of a front process; a subclass sets `_config`, `_model`, `model`, `_metrics`, `_tracing` and
    `_engine_app`, then calls `_build_front`."""

    _config: ServerConfig
    _model: ModelConfig
    model: str
    _metrics: metrics.ReplicaMetrics
    _tracing: Tracing
    _engine_app: EngineApp
    _own_handle: DeploymentHandle | None = None
    _sleeper: Sleeper | None = None  # the engine's sleep mode (the replica process only)
    _deployment: tuple[str, str] | None = None  # (deployment, app) where not in a Serve replica

    def _build_front(self, replica_id: str, fronts: int = 1) -> None:
        """The front on this process's engine client (`fronts`: the replica's front processes, which share its bound
        on running + queued requests)."""
        model = self._model
        table = self._model_table(model)
        self._adapters = table.adapters
        options = self._front_options(model)
        d = model.deployment
        if self._config.role == "entry" and d.max_queued_requests >= 0:  # the direct path's HTTP entry
            options.admission = Admission(
                -(-model.max_ongoing_requests // fronts),
                -(-d.max_queued_requests // fronts),
                d.overload_status_code,
                d.retry_after_s,
            )
        engine_app = self._engine_app
        self._front = ReplicaFront(
            EngineSide(
                engine_app.app,
                lambda: engine.engine_is_dead(engine_app.engine),
                replica_id,
                lambda *point: engine.output_detokenizer(engine_app.engine, *point),
                lambda: engine.stores_responses(engine_app.app),
                lambda response_id: engine.background_response(engine_app.app, response_id),
            ),
            table,
            options,
        )

    async def _start_adapter_sync(self) -> None:
        """Knows the adapters loaded at run time before it takes traffic, then keeps in sync."""
        if self._front.options.runtime_lora is not None:
            await self._sync_adapters_once()
            self._adapter_sync = asyncio.get_running_loop().create_task(self._keep_adapters_in_sync())

    def _model_table(self, model: ModelConfig) -> ModelTable:
        models = self._config.models
        adapters = None
        if model.lora:
            engine_app = self._engine_app
            adapters = Adapters(
                {a.name: expand_env(a.path) for a in model.lora.adapters},
                model.lora.max_loras,
                lambda name, path: engine.load_adapter(engine_app, name, path, model.name),
                lambda name: engine.unload_adapter(engine_app, name),
            )
        return ModelTable(
            model.name,
            self._config.names,
            {card["id"]: card for m, src in models for card in model_cards(m, src)},
            {a: m.name for m, _ in models for a in m.adapter_names},
            adapters,
            self._model_ready if len(models) > 1 else None,
        )

    def _front_options(self, model: ModelConfig) -> FrontOptions:
        c, several = self._config, len(self._config.models) > 1
        parsers = model.frontend_kwargs.get("reasoning_parser") or model.frontend_kwargs.get("tool_call_parser")
        options = FrontOptions(
            keys=load_api_keys(c.auth.api_keys_env, c.auth.api_keys_file) if c.auth else None,
            forward=self._forward if several else None,
            coalesce_s=model.stream_coalesce_ms / 1000.0,
            migration=model.stream_migration,
            resume_to=self._forward,
            chat_parsers=bool(parsers),
            metrics=self._metrics if c.monitoring.metrics else None,
            tracing=self._tracing if self._tracing.enabled else None,
            batch_share=BatchShare(),
            sleeper=self._sleeper,
            to_keeper=self._forward,
        )
        if c.batch_api is not None:
            options.batch_api = lambda request, h=c.batch_api.options(stream=True): h.handle_http.remote(request)
        if c.limiter is not None:
            options.limits = Limits(c.limiter, c.auth.rate_limit.default_max_tokens)
        if c.adapter_registry is not None:
            options.runtime_lora = RuntimeAdapters(
                c.adapter_registry,
                [m.name for m, _ in c.models if m.lora and m.lora.runtime_loading],
                {a for m, _ in c.models for a in m.adapter_names},
            )
        if c.prefill and model.name in c.prefill:
            prefill = c.prefill[model.name].options(stream=True)
            options.disaggregated = Disaggregated(
                lambda request: prefill.handle_http.remote(request), model.disaggregation_fallback
            )
        return options

    async def _sync_adapters_once(self) -> None:
        try:
            await self._front.options.runtime_lora.refresh(self._front.table)
        except Exception as e:  # noqa: BLE001 — the registry restarting: the next round catches up
            logger.warning("LoRA adapter registry not reachable (%s: %s); retrying", type(e).__name__, e)

    async def _keep_adapters_in_sync(self) -> None:
        while True:
            await asyncio.sleep(SYNC_PERIOD_S)
            await self._sync_adapters_once()

    def _forward(self, request: HTTPRequest):
        """A Serve response stream for another model's request (or a resumed stream's continuation), from one of that
        model's replicas (same deployment: its router keeps to `request.model`)."""
        return self._pool_handle().options(stream=True).handle_http.remote(request)

    def _pool_handle(self) -> DeploymentHandle:
        """A handle to this replica's own deployment (its router keeps each request to its model's replicas)."""
        if self._own_handle is None:
            if self._deployment is None:
                context = serve.get_replica_context()
                self._deployment = (context.deployment, context.app_name)
            self._own_handle = serve.get_deployment_handle(*self._deployment)
        return self._own_handle

    async def _model_ready(self, name: str) -> bool:
        """Whether another model of this deployment has a running replica (it is listed in /v1/models only then)."""
        return await can_route(self._pool_handle(), HTTPRequest("POST", "", model=name))
