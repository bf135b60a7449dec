"""How much of one replica's engine batch lines may take: all of it while the replica has no online traffic, a
share of it while online requests run there (and for `quiet_s` after the last one ended), so that online first
tokens do not wait behind a full batch. Pure asyncio: the replica's front reports its online requests, the replica's
batch lines take a slot each."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable


class BatchShare:
    def __init__(self, quiet_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.quiet_s, self._clock = quiet_s, clock
        self.online = 0  # online requests running on this replica
        self.running = 0  # batch lines running on this replica
        self.busy_lines = 1  # batch lines allowed while online requests run (the last caller's share)
        self._online_ended = -math.inf
        self._changed = asyncio.Event()

    # the front's side

    def online_started(self) -> None:
        self.online += 1

    def online_ended(self) -> None:
        self.online -= 1
        self._online_ended = self._clock()
        if self.online == 0:
            self._wake()  # the waiters look again once the quiet time has passed

    # the batch side

    def allowed(self) -> float:
        """Batch lines that may run now."""
        if self.online > 0 or self._clock() - self._online_ended < self.quiet_s:
            return self.busy_lines
        return math.inf

    @contextlib.asynccontextmanager
    async def slot(self):
        """Held while one batch line runs in the engine; waits while the share is taken."""
        while self.running >= self.allowed():
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), self._until_idle())
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._wake()

    def _until_idle(self) -> float | None:
        """Seconds until online traffic counts as gone (None: online requests run; a change wakes the waiters)."""
        if self.online > 0:
            return None
        return max(0.01, self.quiet_s - (self._clock() - self._online_ended))

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
