"""The OpenAI HTTP ingress: thin routes that pick a model's deployment handle and pass the response through.

vLLM's own OpenAI app (in the model replica) parses and validates requests; the ingress only reads
`model` from the body, forwards the request unchanged, streams SSE through unbuffered and makes every
error OpenAI-shaped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.protocol import HTTPRequest, ResponseStart
from deployments.errors import error_response, openai_error_bytes, sse_error_event

logger = logging.getLogger("ray.serve")

REQUEST_ID_HEADER = "x-request-id"
RETRY_AFTER_S = "1"
# Headers the ingress sets itself or that describe the hop, not the payload.
_DROP_REQUEST_HEADERS = {b"host", b"content-length", b"content-type", b"x-request-id", b"transfer-encoding", b"connection"}
_DROP_RESPONSE_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"date", b"server", b"x-request-id"}

api = FastAPI(title="Summit", docs_url=None, redoc_url=None)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(400, str(exc.errors()))


class ModelUnavailable(Exception):
    """The chosen model's replicas cannot take the request now (overloaded, dead or restarting)."""

    def __init__(self, message: str, status: int = 503, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = RETRY_AFTER_S if retry_after_s is None else str(math.ceil(retry_after_s))


@contextlib.contextmanager
def _replica_failures():
    """Serve and replica failures while talking to a model become ModelUnavailable (503, or 429 on overload, + Retry-After)."""
    try:
        yield
    except BackPressureError as e:  # status and Retry-After from the model deployment's backpressure_config
        raise ModelUnavailable("The model is overloaded: too many queued requests. Retry later.",
                               e.status_code, e.retry_after_s) from None
    except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
        logger.warning("model replica unavailable: %s", type(e).__name__)
        raise ModelUnavailable("The model replica serving this request is unavailable; retry.") from None
    except RayTaskError as e:
        logger.warning("model replica failed: %s", getattr(e, "cause", e))
        raise ModelUnavailable("The model engine failed while serving this request; retry.") from None


async def _first(stream) -> ResponseStart:
    """The replica's ResponseStart."""
    with _replica_failures():
        try:
            start = await stream.__anext__()
        except StopAsyncIteration:
            raise ModelUnavailable("The model replica ended the request without a response; retry.") from None
    if not isinstance(start, ResponseStart):
        raise ModelUnavailable("The model replica answered out of protocol.", 500)
    return start


async def _rest(stream) -> bytes:
    """The rest of a non-streamed response body."""
    with _replica_failures():
        return b"".join([chunk async for chunk in stream])


def _response_headers(start: ResponseStart) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in start.headers if k.lower() not in _DROP_RESPONSE_HEADERS}


async def _sse(stream) -> AsyncIterator[bytes]:
    """Pass SSE chunks through as they come; a replica lost mid-stream ends it with an error event."""
    try:
        async for chunk in stream:
            yield chunk
    except (ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError) as e:
        logger.warning("stream ended by replica failure: %s", type(e).__name__)
        yield sse_error_event(503, "The model replica failed during this stream; retry.")


class ReplicaStream(StreamingResponse):
    """A model replica's SSE stream; however the response ends, the replica's stream is cancelled then.

    Starlette does not close the body iterator when the response is cancelled (client gone): a generator
    left suspended at a `yield` would run its `finally` only when garbage-collected, and the engine
    would go on generating for nobody. Cancelling here, when the response itself ends, is deterministic.
    """

    def __init__(self, stream, request_id: str, status_code: int, headers: dict[str, str]):
        super().__init__(_sse(stream), status_code=status_code, headers=headers)
        self._stream = stream
        self._request_id = request_id
        self._finished = False

    async def stream_response(self, send) -> None:
        await super().stream_response(send)
        self._finished = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._finished:
                logger.info("client left stream %s before its end: cancelling the engine request", self._request_id)
            self._stream.cancel()  # aborts the engine request if it is still running; a no-op after the end


# Defined after the helpers: serve.ingress serializes the class when it is decorated.
class BadModel(Exception):
    """The request does not name a model this application serves (or is not a JSON object)."""

    def __init__(self, message: str, status: int, param: str | None = "model"):
        super().__init__(message)
        self.status = status
        self.param = param


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, servers: dict[str, DeploymentHandle]):
        self._servers = servers

    @api.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        """Every model's own /v1/models answer (vLLM's, with max_model_len), merged into one list."""
        data = []
        for name in self._servers:
            try:
                start, body = await self._call(name, HTTPRequest("GET", "/v1/models"))
            except ModelUnavailable:  # restarting replicas: still list the model, without engine details
                start, body = None, b""
            if start is not None and start.status == 200:
                data.extend(json.loads(body)["data"])
            else:
                data.append({"id": name, "object": "model", "owned_by": "summit"})
        return JSONResponse({"object": "list", "data": data})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._forward(request)

    async def _forward(self, request: Request) -> Response:
        # Serve's proxy answers with the client's x-request-id (or its own); the engine gets it plus a
        # unique suffix, so a client that reuses an id cannot collide inside vLLM.
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        body = await request.body()
        try:
            name = self._model_name(body)
        except BadModel as e:
            return error_response(e.status, str(e), param=e.param)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _DROP_REQUEST_HEADERS]
        headers += [(b"content-type", b"application/json"), (b"x-request-id", f"{request_id}-{uuid.uuid4().hex[:8]}".encode())]
        forwarded = HTTPRequest("POST", request.url.path, body, request.url.query.encode(), headers)
        try:
            stream = self._servers[name].options(stream=True).handle_http.remote(forwarded)
            start = await _first(stream)
            reply_headers = _response_headers(start)
            if start.header(b"content-type", b"").startswith(b"text/event-stream"):
                return ReplicaStream(stream, request_id, start.status, reply_headers)
            payload = await _rest(stream)
        except ModelUnavailable as e:
            return error_response(e.status, str(e), headers={"retry-after": e.retry_after})
        if start.status >= 400:
            payload = openai_error_bytes(start.status, payload)
        return Response(payload, status_code=start.status, headers=reply_headers)

    def _model_name(self, body: bytes) -> str:
        try:
            payload = json.loads(body)
        except ValueError as e:
            raise BadModel(f"request body is not valid JSON: {e}", 400, param=None) from None
        if not isinstance(payload, dict):
            raise BadModel("request body must be a JSON object", 400, param=None)
        name = payload.get("model")
        if name is None and len(self._servers) == 1:
            return next(iter(self._servers))
        if not isinstance(name, str):
            raise BadModel(f"`model` is required; known models: {', '.join(self._servers)}", 400)
        if name not in self._servers:
            raise BadModel(f"The model `{name}` does not exist. Known models: {', '.join(self._servers)}", 404)
        return name

    async def _call(self, name: str, request: HTTPRequest) -> tuple[ResponseStart, bytes]:
        stream = self._servers[name].options(stream=True).handle_http.remote(request)
        start = await _first(stream)
        return start, await _rest(stream)
