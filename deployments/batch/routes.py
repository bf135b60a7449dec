"""The Batch API's HTTP routes: OpenAI's `/v1/files` and `/v1/batches`, as a module-level router (`attach_router`).

A handler reaches the replica's store, options and runner through `request.app.state` (set by `build_app` in
deployments/batch/api.py) and refuses by raising `OpenAIError`; the app's one exception handler answers it.
The store's NotFound and Conflict are answered there too.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.config.batch import BatchOptions
from deployments.batch.lines import URLS, window_seconds
from deployments.batch.store import BatchStore, Page
from deployments.http.errors import OpenAIError
from deployments.http.protocol import OWNER_HEADER as OWNER

_CHUNK = 1 << 20
# Who owns a file or batch (a hash of the caller's API key), as the HTTP entry in front tells this app.
OWNER_HEADER = OWNER.decode()

router = APIRouter()


def attach_router(app: FastAPI) -> None:
    app.include_router(router)


# ---- what a handler reaches through its request ----------------------------------------------------------------
def store(request: Request) -> BatchStore:
    return request.app.state.store


def options(request: Request) -> BatchOptions:
    return request.app.state.options


def wake_runner(request: Request) -> None:
    """A batch was created or cancelled: the runner looks at the store now rather than at its next poll."""
    request.app.state.wake_runner()


def owner(request: Request) -> str:
    return request.headers.get(OWNER_HEADER, "")


# ---- /v1/files -------------------------------------------------------------------------------------------------
@router.post("/v1/files")
async def upload(request: Request) -> Response:
    limit = options(request).max_file_bytes
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise OpenAIError(400, "upload a file as multipart/form-data with fields `file` and `purpose`")
    if int(request.headers.get("content-length") or 0) > limit + 65536:
        raise _too_large(limit)
    try:
        form = await request.form(max_part_size=limit + 1)
    except Exception as e:  # noqa: BLE001 — a malformed multipart body is the client's
        raise OpenAIError(400, f"could not read the multipart upload: {e}") from e
    purpose, file = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise OpenAIError(
            400, f"purpose {purpose!r} is not served; Summit keeps files for purpose 'batch'", param="purpose"
        )
    if file is None or isinstance(file, str):
        raise OpenAIError(400, "the `file` field is missing from the upload", param="file")
    if file.size is not None and file.size > limit:
        raise _too_large(limit)
    await file.seek(0)
    data = await file.read()
    if len(data) > limit:
        raise _too_large(limit)
    return JSONResponse(store(request).add_file([data], file.filename or "upload.jsonl", purpose, owner(request)))


@router.get("/v1/files")
async def list_files(
    request: Request, after: str | None = None, limit: int = 10000, purpose: str | None = None, order: str = "desc"
) -> Response:
    if not 1 <= limit <= 10000 or order not in ("asc", "desc"):
        raise OpenAIError(400, "limit must be 1..10000 and order asc or desc")
    return JSONResponse(_page(store(request).list_files(owner(request), after, limit, purpose, order)))


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> Response:
    return JSONResponse(store(request).get_file(file_id, owner(request)))


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    return JSONResponse(store(request).delete_file(file_id, owner(request)))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    store(request).get_file(file_id, owner(request))  # NotFound (404) before the stream starts
    path = store(request).file_path(file_id)

    async def chunks():
        with open(path, "rb") as f:
            while chunk := await asyncio.to_thread(f.read, _CHUNK):
                yield chunk

    return StreamingResponse(chunks(), media_type="application/octet-stream")


# ---- /v1/batches -----------------------------------------------------------------------------------------------
@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    try:
        body = await request.json()
    except ValueError:
        body = None
    window_s, metadata = _batch_request(body)
    file = store(request).get_file(body["input_file_id"], owner(request))
    if file["purpose"] != "batch":
        raise OpenAIError(
            400,
            f"file {file['id']} has purpose {file['purpose']!r}; a batch's input needs purpose 'batch'",
            param="input_file_id",
        )
    batch = store(request).add_batch(
        owner(request), file["id"], body["endpoint"], window_s, body["completion_window"], metadata
    )
    wake_runner(request)
    return JSONResponse(batch)


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
    if not 1 <= limit <= 100:
        raise OpenAIError(400, "limit must be 1..100", param="limit")
    return JSONResponse(_page(store(request).list_batches(owner(request), after, limit)))


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> Response:
    return JSONResponse(store(request).get_batch(batch_id, owner(request)))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    batch = store(request).cancel(batch_id, owner(request))
    wake_runner(request)
    return JSONResponse(batch)


# the last route: anything else under /v1 is OpenAI-shaped 404, not FastAPI's {"detail": ...}
@router.api_route("/v1/{rest:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
async def unknown(request: Request, rest: str) -> Response:
    raise OpenAIError(404, f"{request.method} {request.url.path} is not a Batch API route")


# ---- helpers ---------------------------------------------------------------------------------------------------
def _batch_request(body) -> tuple[float, dict | None]:
    """A create-batch body's completion window in seconds and its metadata; OpenAIError (400) naming the field
    that is wrong."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for key in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(key), str):
            raise OpenAIError(400, f"`{key}` is required (a string)", param=key)
    if body["endpoint"] not in URLS:
        raise OpenAIError(
            400, f"endpoint {body['endpoint']!r} is not served; use one of {', '.join(URLS)}", param="endpoint"
        )
    try:
        window_s = window_seconds(body["completion_window"])
    except ValueError as e:
        raise OpenAIError(400, str(e), param="completion_window") from None
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16):
        raise OpenAIError(400, "`metadata` must be an object of at most 16 keys", param="metadata")
    return window_s, metadata


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the file is larger than {limit} bytes (the app's batch.max_file_bytes)", param="file")


def _page(page: Page) -> dict:
    return {
        "object": "list",
        "data": page.data,
        "has_more": page.has_more,
        "first_id": page.data[0]["id"] if page.data else None,
        "last_id": page.data[-1]["id"] if page.data else None,
    }
