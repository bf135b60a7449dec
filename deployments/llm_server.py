"""The engine deployment: each replica owns one vLLM AsyncLLM and runs vLLM's own OpenAI app on it, in-process.

On the direct path the deployment is the application's HTTP ingress (`serve.ingress()` with the app built here,
`__serve_build_asgi_app__`): HAProxy sends each request to the replica's own port. A deployment may then host
several models of one shape, one per replica (`models`, the replica's rank picks which); the replica reports its
model in `record_routing_stats` for the routers. On the two-hop path the OpenAIIngress calls `handle_http`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import logging.handlers
import os
import threading
import time
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import AuthOptions, ModelConfig, expand_env
from app.monitoring import MonitoringOptions
from app.deployment_options import pool_model_index
from deployments import metrics, vllm_adapter
from deployments.adapters import Adapters
from deployments.lora_runtime import SYNC_PERIOD_S, RuntimeAdapters
from deployments.asgi_bridge import stream_asgi
from deployments.auth import load_api_keys
from deployments.flow import Admission
from deployments.front import INTERNAL_SCOPE_KEY, ReplicaFront
from deployments.handoff import can_route
from deployments.pd import Disaggregated
from deployments.rate_limit import Limits
from deployments.protocol import HTTPRequest, ResponseStart
from deployments.tracing import Tracing

logger = logging.getLogger("ray.serve")
# How long a replica whose engine died stays up (healthy to Serve) while it relays resumed streams.
RELAY_GRACE_S = 300.0


class LLMServer:
    """One replica = one AsyncLLM + vLLM's OpenAI FastAPI app bound to it (no subprocess, no extra port)."""

    async def __init__(self, models: list[tuple[ModelConfig, str]], auth: AuthOptions | None = None,
                       prefill: dict[str, DeploymentHandle] | None = None, batch_api: DeploymentHandle | None = None,
                       monitoring: MonitoringOptions | None = None, limiter: DeploymentHandle | None = None,
                       adapter_registry: DeploymentHandle | None = None):
        """`models`: (config, resolved source) of each model this deployment hosts, one per replica; `auth`: the API
        keys when this deployment is the HTTP entry (direct path); `prefill`: the prefill pool of each disaggregated
        model among them (this deployment is then that model's decode pool); `batch_api`: the Batch API's store, which
        the HTTP entry hands /v1/files and /v1/batches to (direct path, batch on); `monitoring`: metrics, traces and
        the warm-up (app/monitoring.py); `limiter`: the per-key RateLimiter (direct path, `auth.rate_limit`);
        `adapter_registry`: the adapters loaded at run time (deployments/lora_runtime.py; lora.runtime_loading)."""
        monitoring = monitoring or MonitoringOptions()
        self._replica_id = _replica_id()
        model, source = models[pool_model_index(_replica_rank(), [m.deployment.num_replicas for m, _ in models])]
        self.model = model.name
        metrics.enable(monitoring.metrics)
        self._metrics = metrics.ReplicaMetrics(model.name, self._replica_id)
        with _serve_log_file_kept(), _LoadProgress(self._metrics, model.name):
            args = vllm_adapter.serve_namespace(source, model.name, model.engine_args(), model.frontend_kwargs)
            logger.info("Starting vLLM %s for %s from %s", vllm_adapter.vllm_version(), model.name, source)
            self._metrics.load_stage("engine")
            self._engine_app = await vllm_adapter.start_engine_app(args, metrics=monitoring.metrics)
            if monitoring.warmup:
                self._metrics.load_stage("warmup")
                await _warm_up(self._engine_app.app, model.name)
        self._metrics.load_stage("ready")
        logger.info("Replica of %s ready: its engine answered%s", model.name, " a warm-up request" if monitoring.warmup else "")
        self._coalesce_s = model.stream_coalesce_ms / 1000.0
        keys = load_api_keys(auth.api_keys_env, auth.api_keys_file) if auth else None
        self._front = ReplicaFront(
            self._engine_app.app, model.name, [m.name for m, _ in models], keys,
            lambda: vllm_adapter.engine_is_dead(self._engine_app.engine), self._replica_id,
            {card["id"]: card for m, src in models for card in _model_cards(m, src)},
            self._forward if len(models) > 1 else None,
            coalesce_s=self._coalesce_s,
            batch_api=(lambda request, h=batch_api.options(stream=True): h.handle_http.remote(request))
            if batch_api is not None else None, model_ready=self._model_ready if len(models) > 1 else None)
        self._front.metrics = self._metrics if monitoring.metrics else None
        self._front.base_of = {a: m.name for m, _ in models for a in m.adapter_names}
        if model.lora:
            engine_app = self._engine_app
            self._front.adapters = Adapters(
                {a.name: expand_env(a.path) for a in model.lora.adapters}, model.lora.max_loras,
                lambda name, path: vllm_adapter.load_adapter(engine_app, name, path, model.name),
                lambda name: vllm_adapter.unload_adapter(engine_app, name))
        if adapter_registry is not None:  # knows the adapters loaded at run time before it takes traffic
            self._front.runtime_lora = RuntimeAdapters(
                adapter_registry, [m.name for m, _ in models if m.lora and m.lora.runtime_loading],
                {a for m, _ in models for a in m.adapter_names})
            await self._sync_adapters_once()
            self._adapter_sync = asyncio.get_running_loop().create_task(self._keep_adapters_in_sync())
        if limiter is not None:
            self._front.limits = Limits(limiter, auth.rate_limit.default_max_tokens)
        self._metrics.start_counters()
        if monitoring.metrics:
            self._engine_metrics = metrics.EngineMetricsBridge(vllm_adapter.engine_metric_samples, self._replica_id).start()
        self._tracing = Tracing(monitoring.tracing)
        self._front.tracing = self._tracing if self._tracing.enabled else None
        self._own_handle = None
        self._dead_since: float | None = None
        self._front.migration, self._front.resume_to = model.stream_migration, self._forward
        self._front.detokenizer = lambda *point: vllm_adapter.output_detokenizer(self._engine_app.engine, *point)
        self._front.chat_parsers = bool(model.frontend_kwargs.get("reasoning_parser") or model.frontend_kwargs.get("tool_call_parser"))
        if prefill and model.name in prefill:
            handle = prefill[model.name].options(stream=True)
            self._front.disaggregated = Disaggregated(lambda request: handle.handle_http.remote(request),
                                                      model.disaggregation_fallback)
        self._deployment = model.deployment
        self._max_ongoing = model.max_ongoing_requests

    async def _sync_adapters_once(self) -> None:
        try:
            await self._front.runtime_lora.refresh(self._front)
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
        """The direct path's HTTP app (Serve calls this after __init__ when the deployment is the ingress). A bounded
        queue is the front's here, so that an overload is answered OpenAI-shaped (Serve's answer would be plain text)."""
        d = self._deployment
        if d.max_queued_requests >= 0:
            self._front.admission = Admission(self._max_ongoing, d.max_queued_requests, d.overload_status_code,
                                              d.retry_after_s)
        return self._front

    def record_routing_stats(self) -> dict:
        """What Summit's routers read per replica: the model it serves (a deployment may host several), its LoRA
        adapters and which of them it has loaded."""
        adapters = self._front.adapters
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

    async def _internal_front(self, scope, receive, send) -> None:
        """The front for a request that came through a Serve handle: it was let in (API key) where it entered."""
        await self._front({**scope, INTERNAL_SCOPE_KEY: True}, receive, send)

    async def check_health(self) -> None:
        """Serve calls this periodically: a dead engine marks the replica unhealthy and Serve replaces it, but not while
        the front relays streams it resumed on other replicas (it holds their clients' connections; its own port
        answers new requests 503 meanwhile), for at most RELAY_GRACE_S after the engine died."""
        if vllm_adapter.engine_is_dead(self._engine_app.engine) and self._front.relaying:
            self._dead_since = self._dead_since or time.monotonic()
            if time.monotonic() - self._dead_since < RELAY_GRACE_S:
                logger.info("engine dead; replica kept for %d resumed streams it relays", self._front.relaying)
                return
        await vllm_adapter.check_engine_health(self._engine_app.engine)

    def stats(self) -> dict:
        """This replica's process and the requests its engine holds right now. Kept beside the metrics (which the
        tests read through Ray's metrics endpoint) for two reasons: the pid (tests stop or kill the engine's
        process), and live values (a metric is only as fresh as Ray's last report, seconds old, and Ray drops a gauge
        that stops changing: an idle engine's KV usage would be gone)."""
        return {
            "replica_id": self._replica_id,
            "model": self.model,
            "pid": os.getpid(),
            "num_unfinished_requests": vllm_adapter.num_unfinished_requests(self._engine_app.engine),
            "kv_cache_usage": vllm_adapter.kv_cache_usage(),
            "generation_tokens": vllm_adapter.generation_tokens(),
        }

    def recent_spans(self, trace_id: str | None = None) -> dict:
        """The spans this replica recorded (of one trace), with `monitoring.tracing.exporter: memory` (tests)."""
        return {"replica_id": self._replica_id, "model": self.model, "spans": self._tracing.recent_spans(trace_id)}

    def __del__(self):
        # Without this each replica leaks its engine's shared-memory segments and sockets.
        engine_app = getattr(self, "_engine_app", None)
        if engine_app is not None:
            vllm_adapter.shutdown_engine(engine_app.engine)
            self._engine_app = None


@contextlib.contextmanager
def _serve_log_file_kept():
    """Keep Serve's replica log file attached while vLLM starts.

    vLLM's start-up applies a logging dictConfig, which closes every handler in the process: Serve's
    buffering handler loses its file, and the replica's later lines (requests, cancellations) would reach
    only the worker's stderr, not the replica log the Ray dashboard shows. Re-attach the file afterwards.
    """
    kept = [(h, h.target) for h in logging.getLogger("ray.serve").handlers
            if isinstance(h, logging.handlers.MemoryHandler) and h.target is not None]
    try:
        yield
    finally:
        for handler, target in kept:
            if handler.target is None:
                handler.setTarget(target)


class _LoadProgress:
    """While the engine starts (vLLM loads the weights, profiles the KV cache and compiles, blocking this replica's
    event loop), a thread logs every `every_s` how long the current stage has taken and updates its gauge, so a
    start of many minutes shows where it is (vLLM's own lines on each step go to the replica's stderr)."""

    def __init__(self, replica_metrics: metrics.ReplicaMetrics, model: str, every_s: float = 30.0):
        self._metrics, self._model, self._every_s = replica_metrics, model, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="summit-load-progress", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            stage, seconds = self._metrics.stage_elapsed()
            if stage is not None:
                self._metrics.stage_seconds(stage, seconds)
                logger.info("%s: replica start, stage %s for %.0f s so far", self._model,
                            {"engine": "engine start (weights, KV-cache profiling, compilation)",
                             "warmup": "warm-up request"}.get(stage, stage), seconds)


async def _warm_up(engine_app, model: str) -> None:
    """One short completion through vLLM's app before the replica takes traffic: the replica is ready (Serve marks
    it running, /v1/models lists it) only once its engine has answered."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    request = HTTPRequest("POST", "/v1/completions", body, headers=[(b"content-type", b"application/json"),
                                                                     (b"x-request-id", b"summit-warmup")])
    status, answer = None, b""
    async for item in stream_asgi(engine_app, request):
        if isinstance(item, ResponseStart):
            status = item.status
        else:
            answer += item
    if status != 200:
        raise RuntimeError(f"the warm-up request to {model}'s engine failed ({status}): {answer[:500]!r}; set "
                           "monitoring.warmup: false to start without it")


def _model_cards(model: ModelConfig, source: str) -> list[dict]:
    """A model's /v1/models entries as far as the config tells it (its own replica answers with vLLM's), its LoRA
    adapters' after it (`parent`: the model, as vLLM lists an adapter)."""
    card = {"id": model.name, "object": "model", "owned_by": "summit", "root": source}
    if model.engine_kwargs.get("max_model_len"):
        card["max_model_len"] = model.engine_kwargs["max_model_len"]
    adapters = [{**card, "id": a.name, "root": a.path, "parent": model.name} for a in (model.lora.adapters if model.lora else [])]
    return [card, *adapters]


def _replica_rank() -> int:
    try:
        rank = serve.get_replica_context().rank
    except Exception:  # outside a Serve replica (unit tests)
        return 0
    return getattr(rank, "rank", rank) or 0


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit tests)
        return f"local-{os.getpid()}"
