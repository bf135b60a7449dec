"""A model replica's answer, as the ingress receives it through a Serve handle: its ResponseStart, then the body.

Serve and replica failures become `ModelUnavailable` (503, or the deployment's overload status on backpressure,
with Retry-After); a stream is cancelled in the replica however the HTTP response ends (client gone included),
which aborts the engine request.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from deployments.errors import sse_error_event
from deployments.protocol import ResponseStart

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = "1"


class ModelUnavailable(Exception):
    """The chosen model's replicas cannot take the request now (overloaded, dead or restarting)."""

    def __init__(self, message: str, status: int = 503, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = RETRY_AFTER_S if retry_after_s is None else str(math.ceil(retry_after_s))


@contextlib.contextmanager
def replica_failures():
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


async def first_response(stream) -> ResponseStart:
    """The replica's ResponseStart."""
    with replica_failures():
        try:
            start = await stream.__anext__()
        except StopAsyncIteration:
            raise ModelUnavailable("The model replica ended the request without a response; retry.") from None
    if not isinstance(start, ResponseStart):
        raise ModelUnavailable("The model replica answered out of protocol.", 500)
    return start


async def rest_of_body(stream) -> bytes:
    """The rest of a non-streamed response body."""
    with replica_failures():
        return b"".join([chunk async for chunk in stream])


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
