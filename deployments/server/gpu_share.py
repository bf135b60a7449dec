"""Turns on one GPU: the replicas of a `share_with` group that landed on the same GPU (each took a fraction of it)
pass one token between them; only its holder's engine is awake (deployments/server/sleep.py).

`GpuTurns` is the logic (pure asyncio): one holder, the others waiting in arrival order; a holder learns through a
long poll (`wanted`) that another waits, and its polls are its heartbeat: one silent for LEASE_S (its process died)
loses the token, as does a waiter that stopped asking. `ShareGroup` is the Ray actor around it, named after the
application, the group and the GPU (so exactly the replicas on that GPU meet there), created by the first of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import ray
from ray.exceptions import RayActorError

logger = logging.getLogger("ray.serve")
NAMESPACE = "serve"
LEASE_S = 30.0  # a holder or waiter not heard of for this long is gone
POLL_S = 5.0  # how often a waiter says it still waits (and the holder, through `wanted`, that it lives)


class GpuTurns:
    def __init__(self, clock: Callable[[], float] = time.monotonic, lease_s: float = LEASE_S):
        self.holder: str | None = None
        self.waiting: dict[str, float] = {}  # member -> when last heard of, in arrival order
        self._clock, self._lease_s = clock, lease_s
        self._beat = 0.0  # when the holder was last heard of
        self._changed = asyncio.Condition()

    async def acquire(self, member: str, poll_s: float = POLL_S) -> None:
        """Returns once `member` holds the token (at once if it does)."""
        async with self._changed:
            self.waiting.setdefault(member, self._clock())
            self._changed.notify_all()  # the holder's `wanted` learns someone waits
            while True:
                self._expire()
                self.waiting[member] = self._clock()
                if self.holder == member or (self.holder is None and next(iter(self.waiting)) == member):
                    del self.waiting[member]
                    self.holder, self._beat = member, self._clock()
                    self._changed.notify_all()
                    return
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), poll_s)

    def beat(self, member: str) -> None:
        """The holder says it lives (while it starts, wakes or drains its engine: no `wanted` poll then)."""
        if self.holder == member:
            self._beat = self._clock()

    async def release(self, member: str) -> None:
        async with self._changed:
            if self.holder == member:
                self.holder = None
                self._changed.notify_all()

    async def wanted(self, member: str, timeout_s: float = POLL_S) -> bool:
        """Whether `member` should give its turn: another member waits, or it no longer holds the token (returns as
        soon as that is so, else False after `timeout_s`)."""
        async with self._changed:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self._others_wait(member)), timeout_s)
            if self.holder == member:
                self._beat = self._clock()
            return self._others_wait(member)

    def _others_wait(self, member: str) -> bool:
        return self.holder != member or any(m != member for m in self.waiting)

    def _expire(self) -> None:
        now = self._clock()
        if self.holder is not None and now - self._beat > self._lease_s:
            logger.warning("GPU turn of %s expired (not heard of for %.0f s): passed on", self.holder, self._lease_s)
            self.holder = None
        for m, seen in list(self.waiting.items()):
            if now - seen > self._lease_s:
                del self.waiting[m]

    def state(self) -> dict[str, Any]:
        return {"holder": self.holder, "waiting": list(self.waiting)}


class ShareGroup:
    """The Ray actor holding one GPU's turns."""

    def __init__(self):
        self._turns = GpuTurns()

    async def acquire(self, member: str) -> None:
        await self._turns.acquire(member)

    async def release(self, member: str) -> None:
        await self._turns.release(member)

    def beat(self, member: str) -> None:
        self._turns.beat(member)

    async def wanted(self, member: str, timeout_s: float = POLL_S) -> bool:
        return await self._turns.wanted(member, timeout_s)

    def state(self) -> dict[str, Any]:
        return self._turns.state()


def group_name(app: str, group: str, node_id: str, gpu_ids: list) -> str:
    """Replicas of one group on one GPU (or, on CPU, one node) meet under this name."""
    gpus = ",".join(str(g) for g in sorted(gpu_ids, key=str)) or "cpu"
    return f"summit-gpu::{app}::{group}::{node_id}::{gpus}"


class ShareGroupClient:
    """A replica's side: the group's actor, got or created on first use and again if it died (its first member's
    process went); the member then asks again."""

    def __init__(self, name: str, member: str):
        self.name, self.member = name, member
        self._actor = None

    def _handle(self):
        if self._actor is None:
            self._actor = (
                ray.remote(ShareGroup)
                .options(name=self.name, namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_concurrency=1000)
                .remote()
            )
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        for attempt in range(3):
            try:
                return await getattr(self._handle(), method).remote(self.member, *args)
            except RayActorError:
                if attempt == 2:
                    raise
                logger.warning("GPU share group %s is gone: asking a new one", self.name)
                self._actor = None
        return None

    async def acquire(self) -> None:
        await self._call("acquire")

    async def release(self) -> None:
        await self._call("release")

    async def beat(self) -> None:
        await self._call("beat")

    async def wanted(self, timeout_s: float = POLL_S) -> bool:
        return bool(await self._call("wanted", timeout_s))

    async def state(self) -> dict[str, Any]:
        return await self._handle().state.remote()
