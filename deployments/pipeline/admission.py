"""How many requests run and wait on an engine replica (`Admission`, the direct path's bound)."""

from __future__ import annotations

import asyncio
import contextlib
import math

from deployments.http.errors import OpenAIError


class Admission:
    """A replica's bound on the direct path: `ongoing` requests run in the engine at once, up to `queued` more wait
    here in arrival order, and one more is answered `status` (429 or 503, the deployment's overload_status_code) with
    Retry-After, OpenAI-shaped. Serve's replica would bound them too, but it answers in plain text; so on this path
    Serve passes every request on and this bounds them (app/build/options.engine_pool_options)."""

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

    def reject(self, model: str) -> OpenAIError:
        return OpenAIError(
            self.status,
            f"Model {model!r} is overloaded: {self.ongoing} requests running and {self.queued} queued on "
            f"this replica. Retry after {self.retry_after} s.",
            retry_after=self.retry_after,
        )
