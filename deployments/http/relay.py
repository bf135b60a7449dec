"""A Serve response stream (a replica's `handle_http`: a ResponseStart, then body chunks) as an HTTP answer.

Used wherever a request goes on through a Serve handle: the two-hop ingress to a model's replica, a replica to another
model's replica or to the Batch API, the decode side to its prefill pool, a resumed stream to its new replica.
Serve and replica failures become `OpenAIError` (503, or the deployment's overload status on backpressure, with
Retry-After); a stream is cancelled in the replica however the client's answer ends, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from deployments.http.errors import OpenAIError, sse_error_event
from deployments.http.protocol import ResponseStart, header

logger = logging.getLogger("ray.serve")


@contextlib.contextmanager
def replica_failures():
    """Serve and replica failures while talking to a replica become OpenAIError (503, or 429 on overload)."""
    try:
        yield
    except BackPressureError as e:  # status and Retry-After from the model deployment's backpressure_config
        raise OpenAIError.unavailable(
            "The model is overloaded: too many queued requests. Retry later.", e.retry_after_s, e.status_code
        ) from None
    except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
        logger.warning("model replica unavailable: %s", type(e).__name__)
        raise OpenAIError.unavailable("The model replica serving this request is unavailable; retry.") from None
    except RayTaskError as e:
        logger.warning("model replica failed: %s", getattr(e, "cause", e))
        raise OpenAIError.unavailable("The model engine failed while serving this request; retry.") from None


async def first_response(stream) -> ResponseStart:
    """The replica's ResponseStart."""
    with replica_failures():
        try:
            start = await stream.__anext__()
        except StopAsyncIteration:
            raise OpenAIError.unavailable("The model replica ended the request without a response; retry.") from None
    if not isinstance(start, ResponseStart):
        raise OpenAIError(500, "The model replica answered out of protocol.")
    return start


async def rest_of_body(stream) -> bytes:
    """The rest of a non-streamed response body."""
    with replica_failures():
        return b"".join([chunk async for chunk in stream])


async def until_disconnect(receive) -> None:
    """Return once the ASGI client has gone (`http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(work: Awaitable, receive) -> asyncio.Future | None:
    """`work` run to its end (its task, done), or cancelled when the ASGI client leaves first (None); cancelled with
    the caller."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    return task if task.done() and not task.cancelled() else None


async def relay(stream, name: str, receive, send) -> None:
    """Pass a Serve response stream on to the ASGI client; a client that leaves cancels it. A replica lost before it
    answered is an OpenAIError (raised: the entry answers it); one lost mid-stream ends an SSE stream with an error
    event."""

    async def cancel_on_disconnect() -> None:
        await until_disconnect(receive)
        stream.cancel()  # the client left: abort the request there

    watcher = asyncio.create_task(cancel_on_disconnect())
    try:
        start = await first_response(stream)
        await send({"type": "http.response.start", "status": start.status, "headers": start.headers})
        try:
            with replica_failures():
                async for chunk in stream:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OpenAIError as e:
            logger.warning("request handed to %s ended early: %s", name, e)
            if (header(start.headers, b"content-type") or b"").startswith(b"text/event-stream"):
                await send({"type": "http.response.body", "body": sse_error_event(503, str(e)), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watcher.cancel()
        stream.cancel()  # a no-op after the end
