"""A replica's start: its engine's load progress, Serve's log file kept through vLLM's start, the warm-up request,
and what the replica knows of itself (its id, its rank, its models' /v1/models cards)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import logging.handlers
import os
import threading
import time

from ray import serve

from app.config import ModelConfig
from deployments.http.asgi import post_paths, stream_asgi
from deployments.http.protocol import HTTPRequest, ResponseStart
from deployments.observability import metrics

logger = logging.getLogger("ray.serve")


@contextlib.contextmanager
def said_why(model: str, output):
    """An engine start that fails raises EngineStartFailed, its message the root cause in the engine's own words (read
    from `output`, an `engine.OutputMark`) and the fix: Serve's status carries it to `serve status`, the dashboard and
    Summit's control plane (`summit wait-ready`, `serve-local`, the SLURM job), which stop at once on a failure that
    another attempt would repeat."""
    from deployments import engine

    began = time.time()
    try:
        yield
    except Exception as e:  # noqa: BLE001 — any start failure is reported, in the engine's words
        where = f"{_node_ip()}:{output.where}" if output.where else None
        failure = dataclasses.replace(engine.start_failure(model, e, output.lines, where), began=began)
        logger.error("%s", failure.message())
        raise engine.EngineStartFailed(failure) from e


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests)
        return "localhost"


@contextlib.contextmanager
def serve_log_file_kept():
    """Keep Serve's replica log file attached while vLLM starts.

    vLLM's start-up applies a logging dictConfig, which closes every handler in the process: Serve's
    buffering handler loses its file, and the replica's later lines (requests, cancellations) would reach
    only the worker's stderr, not the replica log the Ray dashboard shows. Re-attach the file afterwards.
    """
    kept = [
        (h, h.target)
        for h in logging.getLogger("ray.serve").handlers
        if isinstance(h, logging.handlers.MemoryHandler) and h.target is not None
    ]
    try:
        yield
    finally:
        for handler, target in kept:
            if handler.target is None:
                handler.setTarget(target)


class LoadProgress:
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
                logger.info(
                    "%s: replica start, stage %s for %.0f s so far",
                    self._model,
                    {
                        "engine": "engine start (weights, KV-cache profiling, compilation)",
                        "warmup": "warm-up request",
                    }.get(stage, stage),
                    seconds,
                )


# The warm-up request by the model's task: the first of these routes vLLM's app serves for it
_WARMUP = (
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 1, "temperature": 0}),
    ("/v1/embeddings", {"input": "Hello"}),
    ("/classify", {"input": "Hello"}),
    ("/pooling", {"input": "Hello"}),
)


async def warm_up(engine_app, model: str) -> None:
    """One short request through vLLM's app before the replica takes traffic (a completion; for a pooling model an
    embedding, classification or pooling): the replica is ready (Serve marks it running, /v1/models lists it) only
    once its engine has answered."""
    routes = post_paths(engine_app)
    path, payload = next(
        ((p, b) for p, b in _WARMUP if p in routes), ("/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    )
    body = json.dumps({"model": model, **payload}).encode()
    request = HTTPRequest(
        "POST",
        path,
        body,
        headers=[(b"content-type", b"application/json"), (b"x-request-id", b"summit-warmup")],
    )
    status, answer = None, b""
    async for item in stream_asgi(engine_app, request):
        if isinstance(item, ResponseStart):
            status = item.status
        else:
            answer += item
    if status != 200:
        raise RuntimeError(
            f"the warm-up request to {model}'s engine failed ({status}): {answer[:500]!r}; set "
            "monitoring.warmup: false to start without it"
        )


def model_cards(model: ModelConfig, source: str) -> list[dict]:
    """A model's /v1/models entries as far as the config tells it (its own replica answers with vLLM's), its LoRA
    adapters' after it (`parent`: the model, as vLLM lists an adapter)."""
    card = {"id": model.name, "object": "model", "owned_by": "summit", "root": source}
    if model.engine_kwargs.get("max_model_len"):
        card["max_model_len"] = model.engine_kwargs["max_model_len"]
    adapters = [
        {**card, "id": a.name, "root": a.path, "parent": model.name}
        for a in (model.lora.adapters if model.lora else [])
    ]
    return [card, *adapters]


def replica_rank() -> int:
    try:
        rank = serve.get_replica_context().rank
    except Exception:  # outside a Serve replica (unit tests)
        return 0
    return getattr(rank, "rank", rank) or 0


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit tests)
        return f"local-{os.getpid()}"


def replica_full_id() -> str:
    """The replica's full id (`SERVE_REPLICA::<app>#<deployment>#<id>`), as routers name it."""
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # outside a Serve replica (unit tests)
        return f"local-{os.getpid()}"
