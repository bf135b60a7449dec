"""The Batch API's one store replica: OpenAI's `/v1/files` and `/v1/batches` over HTTP, and the store's methods for the
runner (deployments/batch/runner.py), on the one SQLite writer (deployments/batch/store.py).

Requests reach it from the front of an engine replica (direct path) or the OpenAIIngress (two hops), through a Serve
handle (`handle_http`), with the caller's owner (a hash of its API key) in `x-summit-owner`. Uploads are multipart as
OpenAI's client sends them; the body is passed through unchanged, content type included.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.config import expand_env
from app.config.batch import BatchOptions
from deployments.batch.routes import attach_router
from deployments.batch.store import BatchStore, Conflict, NotFound
from deployments.http.asgi import stream_asgi
from deployments.http.errors import OpenAIError
from deployments.http.protocol import HTTPRequest, ResponseStart

logger = logging.getLogger("ray.serve")


class BatchAPI:
    def __init__(self, options: dict, runner: DeploymentHandle | None = None):
        self.options = BatchOptions.model_validate(options)
        self.store = BatchStore(
            expand_env(self.options.db_path), expand_env(self.options.files_path), self.options.retention_days * 86400
        )
        self._runner = runner
        self._app = build_app(self.store, self.options, self._wake_runner)
        logger.info("Batch store: metadata %s, files %s", self.options.db_path, self.options.files_path)

    async def handle_http(self, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in stream_asgi(self._app, request):
            yield item

    # ---- for the runner (through its handle) -------------------------------------------------------------------
    # `async`, so that Serve runs them on the replica's event loop like the HTTP routes: a sync method runs in Serve's
    # thread pool, and two threads on the one SQLite connection collide ("cannot start a transaction within a
    # transaction", seen in CI while a 1,000-line batch recorded results as its cancel came in).
    async def active_batches(self) -> list[dict]:
        return self.store.active_batches()

    async def get_batch(self, batch_id: str) -> dict:
        return self.store.get_batch(batch_id, None)

    async def update_batch(self, batch_id: str, expect: tuple[str, ...] | None = None, **fields) -> dict:
        return self.store.update_batch(batch_id, expect, **fields)

    async def record(self, batch_id: str, results: list) -> dict:
        return self.store.record(batch_id, results)

    async def finished_ids(self, batch_id: str) -> set[str]:
        return self.store.finished_ids(batch_id)

    async def finalize(self, batch_id: str, status: str, unfinished: list) -> dict:
        return self.store.finalize(batch_id, status, unfinished)

    async def file_bytes(self, file_id: str) -> bytes:
        return self.store.file_path(file_id).read_bytes()

    async def expire_files(self) -> int:
        return self.store.expire_files()

    # ---- for the HTTP routes (app.state.wake_runner: a batch was created or cancelled) ---------------------------
    def _wake_runner(self) -> None:
        if self._runner is not None:
            self._runner.wake.remote()


def build_app(store: BatchStore, options: BatchOptions, wake_runner: Callable[[], None]) -> FastAPI:
    """The Batch API's FastAPI app over `store`: the routes of deployments/batch/routes.py, and one exception
    handler that answers every refusal in OpenAI's shape."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store, app.state.options, app.state.wake_runner = store, options, wake_runner
    attach_router(app)
    for exc_type in (OpenAIError, NotFound, Conflict, StarletteHTTPException, RequestValidationError):
        app.add_exception_handler(exc_type, _answer)
    return app


async def _answer(request: Request, exc: Exception) -> JSONResponse:
    return as_openai_error(exc).response()


def as_openai_error(exc: Exception) -> OpenAIError:
    """A refusal as an OpenAIError: the store's NotFound (404) and Conflict (409), FastAPI's HTTPException and
    request validation errors (400, naming the first wrong field)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, NotFound):
        return OpenAIError(404, str(exc))
    if isinstance(exc, Conflict):
        return OpenAIError(409, str(exc))
    if isinstance(exc, StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail))
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        return OpenAIError(
            400,
            f"{'.'.join(map(str, first.get('loc', [])))}: {first.get('msg', 'invalid')}",
            param=str((first.get("loc") or [None])[-1]),
        )
    raise TypeError(f"no OpenAI error for {type(exc).__name__}") from exc
