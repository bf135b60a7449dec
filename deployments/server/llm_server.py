"""The engine deployment: each replica owns one vLLM AsyncLLM and runs vLLM's own OpenAI app on it, in-process.

On the direct path the deployment is the application's HTTP ingress (`serve.ingress()` with the app built here,
`__serve_build_asgi_app__`): HAProxy sends each request to the replica's own port. A deployment may then host
several models of one shape, one per replica (`models`, the replica's rank picks which); the replica reports its
model in `record_routing_stats` for the routers. On the two-hop path the OpenAIIngress calls `handle_http`.
Every request runs through the replica's front (server/front.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import ModelConfig, expand_env
from deployments import engine
from deployments.batch.share import BatchShare
from deployments.http.asgi import stream_asgi
from deployments.http.protocol import INTERNAL_SCOPE_KEY, HTTPRequest, ResponseStart
from deployments.lora.adapters import Adapters
from deployments.lora.runtime import SYNC_PERIOD_S, RuntimeAdapters
from deployments.observability import metrics
from deployments.observability.tracing import Tracing
from deployments.pipeline.admission import Admission
from deployments.pipeline.auth import load_api_keys
from deployments.pipeline.prefill import Disaggregated
from deployments.pipeline.rate_limit import Limits
from deployments.routing.choose import can_route
from deployments.server.batch_lines import BatchLines, LineAnswer
from deployments.server.config import ServerConfig
from deployments.server.front import EngineSide, FrontOptions, ReplicaFront
from deployments.server.models import ModelTable
from deployments.server.pool import pool_model_index
from deployments.server.startup import LoadProgress, model_cards, replica_id, replica_rank, serve_log_file_kept, warm_up

logger = logging.getLogger("ray.serve")
# How long a replica whose engine died stays up (healthy to Serve) while it relays resumed streams.
RELAY_GRACE_S = 300.0


class LLMServer:
    """One replica = one AsyncLLM + vLLM's OpenAI FastAPI app bound to it (no subprocess, no extra port)."""

    async def __init__(self, config: ServerConfig):
        self._replica_id = replica_id()
        model, source = config.models[
            pool_model_index(replica_rank(), [m.deployment.num_replicas for m, _ in config.models])
        ]
        self.model, self._model, self._config = model.name, model, config
        self._own_handle = None
        self._dead_since: float | None = None
        monitoring = config.monitoring
        metrics.enable(monitoring.metrics)
        self._metrics = metrics.ReplicaMetrics(model.name, self._replica_id)
        self._engine_app = await self._start_engine(model, source)
        self._tracing = Tracing(monitoring.tracing)
        table = self._model_table(model)
        self._adapters = table.adapters
        options = self._front_options(model)
        self._front = ReplicaFront(
            EngineSide(
                self._engine_app.app,
                lambda: engine.engine_is_dead(self._engine_app.engine),
                self._replica_id,
                lambda *point: engine.output_detokenizer(self._engine_app.engine, *point),
            ),
            table,
            options,
        )
        self._batch = BatchLines(
            self._engine_app,
            self._front,
            model.engine_kwargs.get("max_num_seqs") or engine.DEFAULT_MAX_NUM_SEQS,
            lambda name: name == self.model and options.disaggregated is None,
            options.batch_share,
        )
        if options.runtime_lora is not None:  # knows the adapters loaded at run time before it takes traffic
            await self._sync_adapters_once()
            self._adapter_sync = asyncio.get_running_loop().create_task(self._keep_adapters_in_sync())
        self._metrics.start_counters()
        if monitoring.metrics:
            self._engine_metrics = metrics.EngineMetricsBridge(engine.engine_metric_samples, self._replica_id).start()

    async def _start_engine(self, model: ModelConfig, source: str):
        """vLLM's engine and OpenAI app for `model`, warmed up: the replica is ready once its engine answered."""
        warmup = self._config.monitoring.warmup
        with serve_log_file_kept(), LoadProgress(self._metrics, model.name):
            args = engine.serve_namespace(source, model.name, engine.engine_args(model), model.frontend_kwargs)
            logger.info("Starting vLLM %s for %s from %s", engine.vllm_version(), model.name, source)
            self._metrics.load_stage("engine")
            engine_app = await engine.start_engine_app(args, metrics=self._config.monitoring.metrics)
            if warmup:
                self._metrics.load_stage("warmup")
                await warm_up(engine_app.app, model.name)
        self._metrics.load_stage("ready")
        logger.info("Replica of %s ready: its engine answered%s", model.name, " a warm-up request" if warmup else "")
        return engine_app

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
            context = serve.get_replica_context()
            self._own_handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._own_handle

    async def _model_ready(self, name: str) -> bool:
        """Whether another model of this deployment has a running replica (it is listed in /v1/models only then)."""
        return await can_route(self._pool_handle(), HTTPRequest("POST", "", model=name))

    async def __serve_build_asgi_app__(self):
        """The direct path's HTTP app (Serve calls this after __init__ when the deployment is the ingress).
        A bounded queue is the front's here, so that an overload is answered OpenAI-shaped (Serve's answer would be
        plain text)."""
        d = self._model.deployment
        if d.max_queued_requests >= 0:
            self._front.options.admission = Admission(
                self._model.max_ongoing_requests, d.max_queued_requests, d.overload_status_code, d.retry_after_s
            )
        return self._front

    def record_routing_stats(self) -> dict:
        """What Summit's routers read per replica: the model it serves (a deployment may host several), its LoRA
        adapters and which of them it has loaded."""
        adapters = self._front.table.adapters
        if adapters is None:
            return {"model": self.model}
        return {"model": self.model, "adapters": sorted(adapters.paths), "loaded": adapters.loaded()}

    async def handle_http(self, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run one HTTP request through the front and vLLM's app; yields a ResponseStart, then body chunks. (A dead
        engine is the front's to answer: 503 + Retry-After, OpenAI-shaped, as on the direct path.)"""
        # A caller that goes away cancels this generator: stream_asgi tells vLLM's app (http.disconnect, then
        # cancellation), which aborts the engine request; the front logs it.
        # the front coalesces a stream's chunks; the bridge only merges what is already queued behind a slow caller
        async for item in stream_asgi(self._internal_front, request):
            yield item

    async def run_lines(
        self, route: HTTPRequest, lines: list[dict], busy_share: float | None = None
    ) -> AsyncIterator[LineAnswer]:
        """A group of batch lines ([{"url", "body", "request_id"}], one model's) run on this replica's engine; each
        line's answer as it finishes (server/batch_lines.py). `route`: what the routers read (the lines' model, the
        first line's body); `busy_share`: the fraction of the engine's sequences batch lines may hold while online
        requests run on this replica (None: the last one given)."""
        async for answer in self._batch.run(lines, busy_share):
            yield answer

    async def _internal_front(self, scope, receive, send) -> None:
        """The front for a request that came through a Serve handle: it was let in (API key) where it entered."""
        await self._front({**scope, INTERNAL_SCOPE_KEY: True}, receive, send)

    async def check_health(self) -> None:
        """Serve calls this periodically: a dead engine marks the replica unhealthy and Serve replaces it, but not while
        the front relays streams it resumed on other replicas (it holds their clients' connections; its own port
        answers new requests 503 meanwhile), for at most RELAY_GRACE_S after the engine died."""
        if engine.engine_is_dead(self._engine_app.engine) and self._front.relaying:
            self._dead_since = self._dead_since or time.monotonic()
            if time.monotonic() - self._dead_since < RELAY_GRACE_S:
                logger.info("engine dead; replica kept for %d resumed streams it relays", self._front.relaying)
                return
        await engine.check_engine_health(self._engine_app.engine)

    def stats(self) -> dict:
        """This replica's process and the requests its engine holds right now. Kept beside the metrics (which the
        tests read through Ray's metrics endpoint) for two reasons: the pid (tests stop or kill the engine's
        process), and live values (a metric is only as fresh as Ray's last report, seconds old, and Ray drops a gauge
        that stops changing: an idle engine's KV usage would be gone)."""
        return {
            "replica_id": self._replica_id,
            "model": self.model,
            "pid": os.getpid(),
            "num_unfinished_requests": engine.num_unfinished_requests(self._engine_app.engine),
            "kv_cache_usage": engine.kv_cache_usage(),
            "generation_tokens": engine.generation_tokens(),
        }

    async def adapters(self) -> dict:
        """This replica's LoRA adapters: `loaded`, what Summit holds loaded (and reports to the routers), beside the
        engine's own view (deployments/engine/lora.adapters_in_engine)."""
        if self._adapters is None:  # a model without `lora:`: its engine runs no LoRA
            return {"replica_id": self._replica_id, "loaded": [], "registered": [], "in_engine": []}
        loaded = self._adapters.loaded()
        return {"replica_id": self._replica_id, "loaded": loaded, **await engine.adapters_in_engine(self._engine_app)}

    def recent_spans(self, trace_id: str | None = None) -> dict:
        """The spans this replica recorded (of one trace), with `monitoring.tracing.exporter: memory` (tests)."""
        return {"replica_id": self._replica_id, "model": self.model, "spans": self._tracing.recent_spans(trace_id)}

    def __del__(self):
        # Without this each replica leaks its engine's shared-memory segments and sockets.
        engine_app = getattr(self, "_engine_app", None)
        if engine_app is not None:
            engine.shutdown_engine(engine_app.engine)
            self._engine_app = None
