"""Summit's one error type and the one status -> OpenAI error-type table.

Anything that refuses a request raises (or returns) an `OpenAIError`; each HTTP entry turns it into the response in
one place (the replica front's pipeline, the FastAPI apps' exception handler). The body is the shape vLLM's own
server returns: {"error": {message, type, param, code}}. `summit-haproxy` writes its error files from the same table.
No web framework is imported at module level: `summit-haproxy` runs this in HAProxy's place.
"""

from __future__ import annotations

import functools
import json
import math
from http import HTTPStatus

# Seconds a client is told to wait (Retry-After) when no replica can take its request now.
RETRY_AFTER_S = 1

STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    return STATUS_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")


class OpenAIError(Exception):
    """A refusal, OpenAI-shaped: status, type (from the status unless given), message, param and Retry-After."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        err_type: str | None = None,
        retry_after: float | str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = err_type or error_type(status)
        self.headers = dict(headers or {})
        if retry_after is not None:
            seconds = retry_after if isinstance(retry_after, str) else str(max(0, math.ceil(retry_after)))
            self.headers["retry-after"] = seconds

    @classmethod
    def unavailable(cls, message: str, retry_after: float | str = RETRY_AFTER_S, status: int = 503) -> OpenAIError:
        """No replica (or engine) can take the request now: 503 (or the overload status) + Retry-After."""
        return cls(status, message, retry_after=retry_after)

    @classmethod
    def from_body(cls, status: int, body: bytes) -> OpenAIError:
        """Another server's error answer (vLLM's OpenAI-shaped one, or FastAPI's {"detail": ...}, or text) as ours."""
        error = json.loads(openai_error_bytes(status, body))["error"]
        return cls(status, str(error.get("message")), param=error.get("param"), err_type=error.get("type"))

    @property
    def retry_after(self) -> str | None:
        return self.headers.get("retry-after")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def to_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def extra_headers(self) -> list[tuple[bytes, bytes]]:
        """Its own headers (Retry-After, WWW-Authenticate), ASGI-style."""
        return [(k.encode(), v.encode()) for k, v in self.headers.items()]

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        body_len = str(len(self.to_bytes())).encode()
        return [(b"content-type", b"application/json"), (b"content-length", body_len), *self.extra_headers()]

    def response(self):
        """The answer as a Starlette response (the FastAPI entries)."""
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send_to(self, send) -> None:
        """The answer over ASGI (the replica front)."""
        await send({"type": "http.response.start", "status": self.status, "headers": self.raw_headers()})
        await send({"type": "http.response.body", "body": self.to_bytes(), "more_body": False})

    async def __call__(self, scope, receive, send) -> None:  # an ASGI app, like a Starlette response
        await self.send_to(send)


def error_body(status: int, message: str, err_type: str | None = None, param: str | None = None) -> dict:
    return OpenAIError(status, message, err_type=err_type, param=param).body()


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
    return OpenAIError(status, message).to_bytes()


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


# Request fields that constrain the output with a grammar (vLLM's structured outputs), in the order they are named.
_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tool_choice",
)


def structured_output_problem(body: bytes) -> tuple[str, str] | None:
    """(field, message) when a request whose output a structured-output constraint shapes got a 5xx from a live engine:
    vLLM compiles the constraint into a grammar only when it schedules the request, and a grammar that admits no
    output (a JSON schema that only refers to itself, `{"$ref": "#"}`) is rejected there as an internal error. The
    constraint is the client's: a 400 naming it. None for a request without one."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    for name in _STRUCTURED_FIELDS:
        value = payload.get(name)
        if name == "response_format" and (not isinstance(value, dict) or value.get("type") in (None, "text")):
            continue
        if name == "tool_choice" and value in (None, "none", "auto"):
            continue
        if value not in (None, {}, [], ""):
            return name, (
                f"`{name}`: the engine could not generate any output under this constraint (vLLM's "
                "grammar for it rejected the model's tokens; a JSON schema that only refers to itself does "
                "this). Fix the schema or pattern."
            )
    return None


@functools.lru_cache(maxsize=16)
def _body_adapter(app, path: str):
    from pydantic import TypeAdapter

    for route in getattr(app, "routes", []):
        if getattr(route, "path", None) == path and "POST" in getattr(route, "methods", ()) and route.body_field:
            return TypeAdapter(route.body_field.field_info.annotation)
    return None
