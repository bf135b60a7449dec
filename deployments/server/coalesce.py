"""A stream's chunks gathered into fewer writes on the replica (stream_coalesce_ms)."""

from __future__ import annotations

import asyncio


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
