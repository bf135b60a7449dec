"""OpenAI-shaped error bodies, the same shape vLLM's own server returns: {"error": {message, type, param, code}}."""

from __future__ import annotations

import functools
import json
from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, err_type: str | None = None, param: str | None = None) -> dict:
    err_type = err_type or _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, *, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param), status_code=status, headers=headers)


def openai_error_bytes(status: int, body: bytes) -> bytes:
    """Keep an OpenAI-shaped error body as it is; wrap anything else (FastAPI's {"detail": ...}, text) into one."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return body
    detail = parsed.get("detail", parsed) if isinstance(parsed, dict) else (parsed or body.decode(errors="replace"))
    message = detail if isinstance(detail, str) else json.dumps(detail)
    return json.dumps(error_body(status, message)).encode()


def sse_error_event(status: int, message: str) -> bytes:
    """An error inside an already-started SSE stream, as vLLM sends it, followed by the stream's end."""
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()


def request_problem(app, path: str, body: bytes) -> str | None:
    """Why the body type of `app`'s POST route `path` (vLLM's own request model) refuses `body`; None when it takes
    it. The front asks after vLLM's app answered a 5xx: a validator of vLLM's that crashes on an odd value instead of
    refusing it (`structured_outputs: 1.5`) makes vLLM answer 500 for what is the client's error."""
    adapter = _body_adapter(app, path)
    if adapter is None:
        return None
    try:
        adapter.validate_json(body)
    except Exception as e:  # noqa: BLE001 — a ValidationError, or whatever a crashing validator raised
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"the request body is not a valid {path} request: {first}"
    return None


@functools.lru_cache(maxsize=16)
def _body_adapter(app, path: str):
    from pydantic import TypeAdapter

    for route in getattr(app, "routes", []):
        if getattr(route, "path", None) == path and "POST" in getattr(route, "methods", ()) and route.body_field:
            return TypeAdapter(route.body_field.field_info.annotation)
    return None
