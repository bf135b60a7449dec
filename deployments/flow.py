"""Flow on an engine replica: how many requests run and wait (`Admission`, the direct path's bound) and how a
stream's chunks are gathered into fewer writes (`Coalescer`, stream_coalesce_ms)."""

from __future__ import annotations

import asyncio
import contextlib
import math

from deployments.errors import error_response


class Admission:
    """A replica's bound on the direct path: `ongoing` requests run in the engine at once, up to `queued` more wait
    here in arrival order, and one more is answered `status` (429 or 503, the deployment's overload_status_code) with
    Retry-After, OpenAI-shaped. Serve's replica would bound them too, but it answers in plain text; so on this path
    Serve passes every request on and this bounds them (app/deployment_options.engine_pool_options)."""

    def __init__(self, ongoing: int, queued: int, status: int, retry_after_s: float):
        self.ongoing, self.queued, self.status = ongoing, queued, status
        self.retry_after = str(math.ceil(retry_after_s))
        self._running = 0
        self._waiting = 0
        self._free = asyncio.Semaphore(ongoing)

    def full(self) -> bool:
        return self._running >= self.ongoing and self._waiting >= self.queued

    @contextlib.asynccontextmanager
    async def slot(self):
        self._waiting += 1
        try:
            await self._free.acquire()  # a client that leaves while waiting is cancelled here
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._free.release()

    def reject(self, model: str):
        return error_response(
            self.status, f"Model {model!r} is overloaded: {self.ongoing} requests running and {self.queued} queued on "
            f"this replica. Retry after {self.retry_after} s.", headers={"retry-after": self.retry_after})


class Coalescer:
    """A stream's body chunks: the first goes at once (it carries the time to first token); later ones are gathered
    for up to `window_s` after the first of them and sent as one message, so a busy replica makes fewer, larger
    writes (fewer wake-ups of its HTTP server, HAProxy and the client) at the cost of that much smoothness."""

    def __init__(self, send, window_s: float):
        self._send = send
        self._window_s = window_s
        self._chunks: list[bytes] = []
        self._timer: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # sends in order, one at a time
        self._first = True

    async def body(self, chunk: bytes, more_body: bool) -> None:
        if more_body and not self._first:
            self._chunks.append(chunk)
            if self._timer is None:
                self._timer = asyncio.create_task(self._flush_later())
            return
        self._first = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self._flush(chunk, more_body)

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._window_s)
        self._timer = None  # from here on a later chunk starts a new window; this flush is no longer cancelled
        try:
            await self._flush(b"", True)
        except Exception:  # noqa: BLE001 — the client left; the app's own send sees it too
            pass

    async def _flush(self, tail: bytes, more_body: bool) -> None:
        async with self._lock:
            data = b"".join(self._chunks) + tail
            self._chunks.clear()
            if data or not more_body:
                await self._send({"type": "http.response.body", "body": data, "more_body": more_body})

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
