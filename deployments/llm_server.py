"""The engine deployment: each replica owns one vLLM AsyncLLM and runs vLLM's own OpenAI app on it, in-process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import os
from collections.abc import AsyncIterator

from ray import serve

from app.config import ModelConfig
from deployments import vllm_adapter
from deployments.asgi_bridge import stream_asgi
from deployments.protocol import HTTPRequest, ResponseStart

logger = logging.getLogger("ray.serve")

REPLICA_HEADER = b"x-summit-replica"


class EngineUnavailable(RuntimeError):
    """The replica's engine has died; the replica is about to be replaced."""


class LLMServer:
    """One replica = one AsyncLLM + vLLM's OpenAI FastAPI app bound to it (no subprocess, no extra port)."""

    async def __init__(self, model: ModelConfig, source: str):
        self._replica_id = _replica_id()
        with _serve_log_file_kept():
            args = vllm_adapter.serve_namespace(source, model.name, model.engine_args(), model.frontend_kwargs)
            logger.info("Starting vLLM %s for %s from %s", vllm_adapter.vllm_version(), model.name, source)
            self._engine_app = await vllm_adapter.start_engine_app(args)
        self._coalesce_s = model.stream_coalesce_ms / 1000.0

    async def handle_http(self, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run one HTTP request through vLLM's app; yields a ResponseStart, then body chunks."""
        if vllm_adapter.engine_is_dead(self._engine_app.engine):
            # Serve's health check will replace this replica; the ingress turns this into a 503.
            raise EngineUnavailable(f"the vLLM engine of replica {self._replica_id} is dead")
        try:
            async for item in stream_asgi(self._engine_app.app, request, self._coalesce_s):
                if isinstance(item, ResponseStart):
                    if item.status >= 500 and vllm_adapter.engine_is_dead(self._engine_app.engine):
                        raise EngineUnavailable(f"the vLLM engine of replica {self._replica_id} died during the request")
                    item.headers.append((REPLICA_HEADER, self._replica_id.encode()))
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            # stream_asgi cancels vLLM's app for this request, which aborts the engine request
            logger.info("request %s cancelled by its caller: aborting it in the engine", request.header(b"x-request-id", b"").decode())
            raise

    async def check_health(self) -> None:
        """Serve calls this periodically: a dead engine marks the replica unhealthy and Serve replaces it."""
        await vllm_adapter.check_engine_health(self._engine_app.engine)

    def stats(self) -> dict:
        """What the engine itself reports, for tests and operators."""
        return {
            "replica_id": self._replica_id,
            "pid": os.getpid(),
            "num_unfinished_requests": vllm_adapter.num_unfinished_requests(self._engine_app.engine),
        }

    def token_counters(self) -> dict:
        """vLLM's own count of tokens this replica's engine has generated (not in `stats()`, which tests poll
        often: reading vLLM's metrics registry takes far longer than the request count)."""
        return {"replica_id": self._replica_id, "generation_tokens": vllm_adapter.generated_tokens()}

    def prefix_cache_stats(self) -> dict:
        """vLLM's own prefix-cache counters for this replica's engine: prompt tokens queried and found cached."""
        return {"replica_id": self._replica_id, **vllm_adapter.prefix_cache_counters()}

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


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit tests)
        return f"local-{os.getpid()}"
