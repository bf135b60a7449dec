"""The engine deployment: each replica owns one vLLM AsyncLLM and runs vLLM's own OpenAI app on it, in-process.

On the direct path the deployment is the application's HTTP ingress (`serve.ingress()` with the app built here,
`__serve_build_asgi_app__`): HAProxy sends each request to the replica's own port. A deployment may then host
several models of one shape, one per replica (`models`, the replica's rank picks which); the replica reports its
model in `record_routing_stats` for the routers. On the two-hop path the OpenAIIngress calls `handle_http`.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import AuthOptions, ModelConfig
from app.deployment_options import pool_model_index
from deployments import vllm_adapter
from deployments.asgi_bridge import stream_asgi
from deployments.auth import load_api_keys
from deployments.front import INTERNAL_SCOPE_KEY, Admission, ReplicaFront
from deployments.pd import Disaggregated
from deployments.protocol import HTTPRequest, ResponseStart

logger = logging.getLogger("ray.serve")


class LLMServer:
    """One replica = one AsyncLLM + vLLM's OpenAI FastAPI app bound to it (no subprocess, no extra port)."""

    async def __init__(self, models: list[tuple[ModelConfig, str]], auth: AuthOptions | None = None,
                       prefill: dict[str, DeploymentHandle] | None = None, batch_api: DeploymentHandle | None = None):
        """`models`: (config, resolved source) of each model this deployment hosts, one per replica; `auth`: the API
        keys when this deployment is the HTTP entry (direct path); `prefill`: the prefill pool of each disaggregated
        model among them (this deployment is then that model's decode pool); `batch_api`: the Batch API's store, which
        the HTTP entry hands /v1/files and /v1/batches to (direct path, batch on)."""
        self._replica_id = _replica_id()
        model, source = models[pool_model_index(_replica_rank(), [m.deployment.num_replicas for m, _ in models])]
        self.model = model.name
        with _serve_log_file_kept():
            args = vllm_adapter.serve_namespace(source, model.name, model.engine_args(), model.frontend_kwargs)
            logger.info("Starting vLLM %s for %s from %s", vllm_adapter.vllm_version(), model.name, source)
            self._engine_app = await vllm_adapter.start_engine_app(args)
        self._coalesce_s = model.stream_coalesce_ms / 1000.0
        keys = load_api_keys(auth.api_keys_env, auth.api_keys_file) if auth else None
        self._front = ReplicaFront(
            self._engine_app.app, model.name, [m.name for m, _ in models], keys,
            lambda: vllm_adapter.engine_is_dead(self._engine_app.engine), self._replica_id,
            {m.name: _model_card(m, src) for m, src in models}, self._forward if len(models) > 1 else None,
            coalesce_s=self._coalesce_s,
            batch_api=(lambda request, h=batch_api.options(stream=True): h.handle_http.remote(request))
            if batch_api is not None else None)
        self._own_handle = None
        if prefill and model.name in prefill:
            handle = prefill[model.name].options(stream=True)
            self._front.disaggregated = Disaggregated(lambda request: handle.handle_http.remote(request),
                                                      model.disaggregation_fallback)
        self._deployment = model.deployment
        self._max_ongoing = model.max_ongoing_requests

    def _forward(self, request: HTTPRequest):
        """A Serve response stream for another model's request, from one of that model's replicas (same deployment:
        its router keeps to `request.model`)."""
        if self._own_handle is None:
            context = serve.get_replica_context()
            self._own_handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._own_handle.options(stream=True).handle_http.remote(request)

    async def __serve_build_asgi_app__(self):
        """The direct path's HTTP app (Serve calls this after __init__ when the deployment is the ingress). A bounded
        queue is the front's here, so that an overload is answered OpenAI-shaped (Serve's answer would be plain text)."""
        d = self._deployment
        if d.max_queued_requests >= 0:
            self._front.admission = Admission(self._max_ongoing, d.max_queued_requests, d.overload_status_code,
                                              d.retry_after_s)
        return self._front

    def record_routing_stats(self) -> dict:
        """What Summit's routers read per replica: the model it serves (a deployment may host several)."""
        return {"model": self.model}

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
        """Serve calls this periodically: a dead engine marks the replica unhealthy and Serve replaces it."""
        await vllm_adapter.check_engine_health(self._engine_app.engine)

    def stats(self) -> dict:
        """What the engine itself reports, for tests and operators."""
        return {
            "replica_id": self._replica_id,
            "model": self.model,
            "pid": os.getpid(),
            "num_unfinished_requests": vllm_adapter.num_unfinished_requests(self._engine_app.engine),
            "kv_cache_usage": vllm_adapter.kv_cache_usage(),
        }

    def token_counters(self) -> dict:
        """vLLM's own count of tokens this replica's engine has generated (not in `stats()`, which tests poll
        often: reading vLLM's metrics registry takes far longer than the request count)."""
        return {"replica_id": self._replica_id, "model": self.model, "generation_tokens": vllm_adapter.generated_tokens()}

    def prefix_cache_stats(self) -> dict:
        """vLLM's own prefix-cache counters for this replica's engine: prompt tokens queried and found cached."""
        return {"replica_id": self._replica_id, "model": self.model, **vllm_adapter.prefix_cache_counters()}

    def kv_transfer_stats(self) -> dict:
        """What this replica's engine took from its KV connector (a disaggregated model's decode side)."""
        return {"replica_id": self._replica_id, "model": self.model, **vllm_adapter.kv_transfer_counters()}

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


def _model_card(model: ModelConfig, source: str) -> dict:
    """A model's /v1/models entry as far as the config tells it (its own replica answers with vLLM's)."""
    card = {"id": model.name, "object": "model", "owned_by": "summit", "root": source}
    if model.engine_kwargs.get("max_model_len"):
        card["max_model_len"] = model.engine_kwargs["max_model_len"]
    return card


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
