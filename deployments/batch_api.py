"""The Batch API's one store replica: OpenAI's `/v1/files` and `/v1/batches` over HTTP, and the store's methods for the
runner (deployments/batch_runner.py), on the one SQLite writer (app/batch/store.py).

Requests reach it from the front of an engine replica (direct path) or the OpenAIIngress (two hops), through a Serve
handle (`handle_http`), with the caller's owner (a hash of its API key) in `x-summit-owner`. Uploads are multipart as
OpenAI's client sends them; the body is passed through unchanged, content type included.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.batch.lines import URLS, window_seconds
from app.batch.store import BatchStore, Conflict, NotFound
from app.batch.options import BatchOptions
from app.config import expand_env
from deployments.asgi_bridge import stream_asgi
from deployments.errors import error_response
from deployments.handoff import OWNER_HEADER as OWNER
from deployments.protocol import HTTPRequest, ResponseStart

logger = logging.getLogger("ray.serve")

OWNER_HEADER = OWNER.decode()
_CHUNK = 1 << 20


class BatchAPI:
    def __init__(self, options: dict, runner: DeploymentHandle | None = None):
        self.options = BatchOptions.model_validate(options)
        self.store = BatchStore(expand_env(self.options.db_path), expand_env(self.options.files_path),
                                self.options.retention_days * 86400)
        self._runner = runner
        self._app = self._build_app()
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

    # ---- HTTP ----------------------------------------------------------------------------------------------------
    def _wake_runner(self) -> None:
        if self._runner is not None:
            self._runner.wake.remote()

    def _build_app(self) -> FastAPI:
        api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        store, options = self.store, self.options

        def owner(request: Request) -> str:
            return request.headers.get(OWNER_HEADER, "")

        @api.exception_handler(NotFound)
        async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
            return error_response(404, str(exc))

        @api.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            return error_response(400, f"{'.'.join(map(str, first.get('loc', [])))}: {first.get('msg', 'invalid')}",
                                  param=str((first.get("loc") or [None])[-1]))

        @api.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            return error_response(exc.status_code, str(exc.detail))

        @api.exception_handler(Conflict)
        async def _conflict(request: Request, exc: Conflict) -> JSONResponse:
            return error_response(409, str(exc))

        @api.post("/v1/files")
        async def upload(request: Request) -> Response:
            if not request.headers.get("content-type", "").startswith("multipart/form-data"):
                return error_response(400, "upload a file as multipart/form-data with fields `file` and `purpose`")
            if int(request.headers.get("content-length") or 0) > options.max_file_bytes + 65536:
                return _too_large(options.max_file_bytes)
            try:
                form = await request.form(max_part_size=options.max_file_bytes + 1)
            except Exception as e:  # noqa: BLE001 — a malformed multipart body is the client's
                return error_response(400, f"could not read the multipart upload: {e}")
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                return error_response(400, f"purpose {purpose!r} is not served; Summit keeps files for purpose "
                                      "'batch'", param="purpose")
            if upload is None or isinstance(upload, str):
                return error_response(400, "the `file` field is missing from the upload", param="file")
            if upload.size is not None and upload.size > options.max_file_bytes:
                return _too_large(options.max_file_bytes)
            await upload.seek(0)
            data = await upload.read()
            if len(data) > options.max_file_bytes:
                return _too_large(options.max_file_bytes)
            return JSONResponse(store.add_file([data], upload.filename or "upload.jsonl", purpose, owner(request)))

        @api.get("/v1/files")
        async def list_files(request: Request, after: str | None = None, limit: int = 10000,
                             purpose: str | None = None, order: str = "desc") -> Response:
            if not 1 <= limit <= 10000 or order not in ("asc", "desc"):
                return error_response(400, "limit must be 1..10000 and order asc or desc")
            return JSONResponse(_page(store.list_files(owner(request), after, limit, purpose, order)))

        @api.get("/v1/files/{file_id}")
        async def get_file(request: Request, file_id: str) -> Response:
            return JSONResponse(store.get_file(file_id, owner(request)))

        @api.delete("/v1/files/{file_id}")
        async def delete_file(request: Request, file_id: str) -> Response:
            return JSONResponse(store.delete_file(file_id, owner(request)))

        @api.get("/v1/files/{file_id}/content")
        async def file_content(request: Request, file_id: str) -> Response:
            store.get_file(file_id, owner(request))
            path = store.file_path(file_id)

            async def chunks():
                with open(path, "rb") as f:
                    while chunk := await asyncio.to_thread(f.read, _CHUNK):
                        yield chunk

            return StreamingResponse(chunks(), media_type="application/octet-stream")

        @api.post("/v1/batches")
        async def create_batch(request: Request) -> Response:
            try:
                body = await request.json()
            except ValueError:
                return error_response(400, "the request body must be a JSON object")
            if not isinstance(body, dict):
                return error_response(400, "the request body must be a JSON object")
            for key in ("input_file_id", "endpoint", "completion_window"):
                if not isinstance(body.get(key), str):
                    return error_response(400, f"`{key}` is required (a string)", param=key)
            if body["endpoint"] not in URLS:
                return error_response(400, f"endpoint {body['endpoint']!r} is not served; use one of "
                                      f"{', '.join(URLS)}", param="endpoint")
            try:
                window_s = window_seconds(body["completion_window"])
            except ValueError as e:
                return error_response(400, str(e), param="completion_window")
            metadata = body.get("metadata")
            if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16):
                return error_response(400, "`metadata` must be an object of at most 16 keys", param="metadata")
            file = store.get_file(body["input_file_id"], owner(request))
            if file["purpose"] != "batch":
                return error_response(400, f"file {file['id']} has purpose {file['purpose']!r}; a batch's input "
                                      "needs purpose 'batch'", param="input_file_id")
            batch = store.add_batch(owner(request), file["id"], body["endpoint"], window_s, body["completion_window"],
                                    metadata)
            self._wake_runner()
            return JSONResponse(batch)

        @api.get("/v1/batches")
        async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
            if not 1 <= limit <= 100:
                return error_response(400, "limit must be 1..100", param="limit")
            return JSONResponse(_page(store.list_batches(owner(request), after, limit)))

        @api.get("/v1/batches/{batch_id}")
        async def get_batch(request: Request, batch_id: str) -> Response:
            return JSONResponse(store.get_batch(batch_id, owner(request)))

        @api.post("/v1/batches/{batch_id}/cancel")
        async def cancel_batch(request: Request, batch_id: str) -> Response:
            batch = store.cancel(batch_id, owner(request))
            self._wake_runner()
            return JSONResponse(batch)

        @api.api_route("/v1/{rest:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
        async def unknown(request: Request, rest: str) -> Response:
            return error_response(404, f"{request.method} {request.url.path} is not a Batch API route")

        return api


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the file is larger than {limit} bytes (the app's batch.max_file_bytes)", param="file")


def _page(page) -> dict:
    return {"object": "list", "data": page.data, "has_more": page.has_more,
            "first_id": page.data[0]["id"] if page.data else None,
            "last_id": page.data[-1]["id"] if page.data else None}
