"""Drive an in-process ASGI app (vLLM's OpenAI app) from a Serve replica, one request at a time.

`httpx.ASGITransport` buffers a whole response; this bridge instead forwards the response as it is
sent: first a `ResponseStart`, then body chunks. While a chunk waits to be taken, later chunks of the
same response are coalesced into it (up to `coalesce_s` after the first), so a loaded replica sends
fewer, larger messages through Ray instead of one per token. When the consumer goes away (the
generator is closed or cancelled), the app sees `http.disconnect` and is cancelled, which makes vLLM
abort the engine request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from deployments.http.protocol import HTTPRequest, ResponseStart

_DONE = object()
logger = logging.getLogger("ray.serve")


async def stream_asgi(app, request: HTTPRequest, coalesce_s: float = 0.0) -> AsyncIterator[ResponseStart | bytes]:
    """Run `app` on `request`; yield the ResponseStart, then the body in chunks."""
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        queue.put_nowait(message)

    task = asyncio.create_task(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(_DONE))
    try:
        async for item in _responses(queue, coalesce_s):
            yield item
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    finally:
        disconnected.set()
        if not task.done():
            await end_after_disconnect(task)


# How long an app whose client went may take to end by itself before it is cancelled from outside
DISCONNECT_GRACE_S = 5.0


async def end_after_disconnect(task: asyncio.Task, grace_s: float = DISCONNECT_GRACE_S) -> None:
    """Let an ASGI app whose `receive()` now says `http.disconnect` end by itself; cancel it after `grace_s`.
    vLLM's non-stream routes watch for the disconnect in a task of their own, which then cancels their handler and so
    aborts the engine request (vLLM's `with_cancellation`). Cancelling the app from outside first interrupts that
    watcher's caller and leaves the handler running: the request generated its whole max_tokens for nobody."""
    done, _ = await asyncio.wait({task}, timeout=grace_s)
    if not done:
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled() and task.exception() is not None:  # nobody is left to answer; the error must not vanish
        logger.error("the ASGI app failed while its request was being cancelled", exc_info=task.exception())


async def _responses(queue: asyncio.Queue, coalesce_s: float) -> AsyncIterator[ResponseStart | bytes]:
    first_body = True
    while True:
        message = await queue.get()
        if message is _DONE:
            return
        if message["type"] == "http.response.start":
            yield ResponseStart(message["status"], list(message.get("headers", [])))
            continue
        if message["type"] != "http.response.body":
            continue
        chunks = [message.get("body", b"")]
        ended = not message.get("more_body", False)
        if not first_body:  # the first chunk goes at once: it carries the time to first token
            ended = await _coalesce(queue, chunks, ended, coalesce_s)
        first_body = False
        if data := b"".join(chunks):
            yield data
        if ended:
            return


async def _coalesce(queue: asyncio.Queue, chunks: list[bytes], ended: bool, coalesce_s: float) -> bool:
    """Append what is already queued (and what arrives within `coalesce_s`) to `chunks`."""
    deadline = time.monotonic() + coalesce_s
    while not ended:
        if queue.empty():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                message = await asyncio.wait_for(queue.get(), remaining)
            except asyncio.TimeoutError:
                break
        else:
            message = queue.get_nowait()
        if message is _DONE:
            queue.put_nowait(_DONE)
            break
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            ended = not message.get("more_body", False)
    return ended


# ASGI plumbing shared by the HTTP entries


def post_paths(app) -> frozenset[str]:
    """The POST paths an ASGI app built on Starlette/FastAPI routes (vLLM's OpenAI app registers the routes of the
    tasks its model supports: generation, embeddings, pooling, scoring, ...)."""
    return frozenset(
        r.path
        for r in getattr(app, "routes", ())
        if "POST" in (getattr(r, "methods", None) or ()) and "{" not in r.path
    )


async def read_body(receive, limit: int | None = None) -> bytes | None:
    """The whole request body; None once it grows past `limit` bytes (the rest is left unread)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if limit is not None and size > limit:
            return None
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def send_json(send, status: int, payload: dict, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_plain(send, status: int) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
