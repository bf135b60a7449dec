"""How much of one replica's engine batch lines may take: all of it while the replica has no online traffic, a
share of it while online requests run there (and for `quiet_s` after the last one ended), so that online first
tokens do not wait behind a full batch. "All of it" is the engine's sequences (`idle_lines`): lines beyond wait here,
not in vLLM's own queue, where an online request arriving would wait behind them (vLLM schedules first come, first
served). The replica's front reports its online requests, the replica's batch lines take a slot each; a replica with
front processes (`models[].front_processes`) shares an OnlineBoard with them, where each process writes its online
count, so that online requests on any of them make room. Pure asyncio and a memory-mapped file."""

from __future__ import annotations

import asyncio
import contextlib
import math
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable

# how often a batch line waiting for room looks at the board again while another process has online requests (that
# process's online requests ending wakes nothing here)
BOARD_POLL_S = 0.05
_SLOT = struct.Struct("<qd")  # online requests, when the last one ended (time.monotonic: one clock per host)


class OnlineBoard:
    """One replica's processes' online requests, in a small memory-mapped file (slot 0: the replica, 1..: its front
    processes): each process writes its own slot, the replica reads them all."""

    def __init__(self, path: str, slots: int):
        self.path, self.slots = path, slots
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _SLOT.size * slots)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, slots: int) -> OnlineBoard:
        """A new board (in /dev/shm where there is one); the creator removes it (`remove`)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="summit-online-", dir=folder)
        try:
            os.write(fd, bytes(_SLOT.size * slots))
        finally:
            os.close(fd)
        return cls(path, slots)

    def write(self, slot: int, online: int, ended: float) -> None:
        _SLOT.pack_into(self._map, slot * _SLOT.size, online, ended)

    def read(self) -> tuple[int, float]:
        """(online requests in every process, when the last one ended anywhere)."""
        online, ended = 0, -math.inf
        for slot in range(self.slots):
            n, t = _SLOT.unpack_from(self._map, slot * _SLOT.size)
            online, ended = online + n, max(ended, t)
        return online, ended

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class BatchShare:
    def __init__(
        self,
        quiet_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        idle_lines: float = math.inf,
        board: OnlineBoard | None = None,
        slot: int = 0,
    ):
        self.quiet_s, self._clock = quiet_s, clock
        self.idle_lines = idle_lines  # batch lines allowed while no online request runs (the engine's sequences)
        self._board, self._slot = board, slot  # the replica's processes' online requests (front processes)
        self._watcher: asyncio.Task | None = None
        self.online = 0  # online requests running on this replica
        self.running = 0  # batch lines running on this replica
        self.busy_lines = 1  # batch lines allowed while online requests run (the last caller's share)
        self._online_ended = -math.inf
        self._changed = asyncio.Event()

    # the front's side

    def online_started(self) -> None:
        self.online += 1
        if self._board is not None:
            self._board.write(self._slot, self.online, self._online_ended)

    def online_ended(self) -> None:
        self.online -= 1
        self._online_ended = self._clock()
        if self._board is not None:
            self._board.write(self._slot, self.online, self._online_ended)
        if self.online == 0:
            self._wake()  # the waiters look again once the quiet time has passed

    # the batch side

    def _online(self) -> tuple[int, float]:
        """(online requests running, when the last one ended): this process's, or every process's on the board."""
        return self._board.read() if self._board is not None else (self.online, self._online_ended)

    def allowed(self) -> float:
        """Batch lines that may run now."""
        online, ended = self._online()
        if online > 0 or self._clock() - ended < self.quiet_s:
            return self.busy_lines
        return self.idle_lines

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
        """How long a waiting line waits before it looks again unwoken: until the quiet time after the last online
        request has passed; None (until woken) otherwise: a line or an online request of this process ending wakes
        the waiters, and while another process's online requests run, one watcher of the board does."""
        online, ended = self._online()
        if online > self.online:
            self._watch_board()
            return None
        if online > 0:
            return None
        quiet_left = self.quiet_s - (self._clock() - ended)
        return max(0.01, quiet_left) if quiet_left > 0 else None

    def _watch_board(self) -> None:
        """Wake the waiters once the other processes' online requests have ended (polled every BOARD_POLL_S by one
        task, not by each waiting line)."""
        if self._watcher is not None and not self._watcher.done():
            return

        async def watch() -> None:
            while self._online()[0] > self.online:
                await asyncio.sleep(BOARD_POLL_S)
            self._wake()

        self._watcher = asyncio.get_running_loop().create_task(watch())

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
