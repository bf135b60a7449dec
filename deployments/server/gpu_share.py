"""Turns on one GPU: the replicas of a `share_with` group that landed on the same GPU (each took a fraction of it)
pass one token between them; only its holder's engine is awake (deployments/server/sleep.py).

`GpuTurns` is the logic (pure asyncio): one holder, the others waiting in arrival order; a holder learns through a
long poll (`wanted`) that another waits. A member whose process is gone loses its turn or its place: members are named
`<replica>@<pid>` and the group's actor runs on their node, where it sees their processes. (Not a heartbeat: a
replica's event loop stops for a minute while vLLM starts its engine, and a turn that lapsed then would let a second
engine wake on the GPU.) `ShareGroup` is the Ray actor around it, named after the application, the group and the
GPU (so exactly the replicas on that GPU meet there), created by the first of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger("ray.serve")
NAMESPACE = "serve"
POLL_S = 5.0  # how often a waiter looks whether the holder's process is gone


class GpuTurns:
    def __init__(self, alive: Callable[[str], bool] = lambda member: True):
        self.holder: str | None = None
        self.waiting: list[str] = []  # in arrival order
        self._alive = alive
        self._changed = asyncio.Condition()

    async def acquire(self, member: str, poll_s: float = POLL_S) -> bool:
        """Returns True once `member` holds the token (at once if it does); False if its process is gone."""
        async with self._changed:
            if member not in self.waiting and self.holder != member:
                self.waiting.append(member)
            self._changed.notify_all()  # the holder's `wanted` learns someone waits
            while True:
                self._drop_the_gone()
                if member != self.holder and member not in self.waiting:
                    return False  # its caller died; Ray still ran this call
                if self.holder == member or (self.holder is None and self.waiting[0] == member):
                    if member in self.waiting:
                        self.waiting.remove(member)
                    self.holder = member
                    self._changed.notify_all()
                    return True
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), poll_s)

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
            return self._others_wait(member)

    def _others_wait(self, member: str) -> bool:
        return self.holder != member or any(m != member for m in self.waiting)

    def _drop_the_gone(self) -> None:
        if self.holder is not None and not self._alive(self.holder):
            logger.warning("GPU turn holder %s is gone: its turn passes on", self.holder)
            self.holder = None
        self.waiting = [m for m in self.waiting if self._alive(m)]

    def state(self) -> dict[str, Any]:
        return {"holder": self.holder, "waiting": list(self.waiting)}


def process_alive(member: str) -> bool:
    """Whether the process of `member` (`<replica>@<pid>`, on this node) still runs."""
    try:
        os.kill(int(member.rsplit("@", 1)[1]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, IndexError):
        return True
    return True


class ShareGroup:
    """The Ray actor holding one GPU's turns (on the members' node: it sees their processes)."""

    def __init__(self):
        self._turns = GpuTurns(process_alive)

    async def acquire(self, member: str) -> bool:
        return await self._turns.acquire(member)

    async def release(self, member: str) -> None:
        await self._turns.release(member)

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

    def __init__(self, name: str, replica_id: str):
        self.name, self.member = name, f"{replica_id}@{os.getpid()}"
        self._actor = None

    def _handle(self):
        if self._actor is None:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self._actor = (
                ray.remote(ShareGroup)
                .options(
                    name=self.name,
                    namespace=NAMESPACE,
                    get_if_exists=True,
                    num_cpus=0,
                    max_concurrency=1000,
                    scheduling_strategy=here,
                )
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

    async def wanted(self, timeout_s: float = POLL_S) -> bool:
        return bool(await self._call("wanted", timeout_s))

    async def state(self) -> dict[str, Any]:
        return await self._handle().state.remote()
