"""In a router's process: what each replica's engine caches, kept current by following the replica's KV events actor
(deployments/server/kv_events.py) — one long poll per replica at a time, through Ray, so nothing new listens."""

from __future__ import annotations

import asyncio
import logging

import ray

from deployments.routing.kv_blocks import BlockView

logger = logging.getLogger("ray.serve")

NAMESPACE = "serve"
POLL_WAIT_S = 1.0  # how long one long poll waits for a change
RETRY_S = 1.0  # after a replica's actor is not there (yet) or died


def actor_name(replica_full_id: str) -> str:
    return "summit-kv::" + replica_full_id


class KVFollower:
    """The `BlockView` of each followed replica. `follow` starts a follower task per new replica (in the running
    loop: the router's); `forget` ends the gone ones' (safe from any thread: each task checks between polls). A
    replica's view exists only while its actor answers: one that restarts or whose actor died starts from a snapshot
    of its new index."""

    def __init__(self):
        self.views: dict[str, BlockView] = {}
        self._wanted: dict[str, str] = {}  # unique id -> full id
        self._tasks: dict[str, asyncio.Task] = {}

    def follow(self, replicas: dict[str, str]) -> None:
        for unique_id, full_id in replicas.items():
            self._wanted[unique_id] = full_id
            task = self._tasks.get(unique_id)
            if task is None or task.done():
                self._tasks[unique_id] = asyncio.get_running_loop().create_task(self._run(unique_id, full_id))

    def forget(self, alive: list[str]) -> None:
        for unique_id in set(self._wanted) - set(alive):
            self._wanted.pop(unique_id, None)
            self.views.pop(unique_id, None)

    def block_size(self) -> int | None:
        return next((v.block_size for v in list(self.views.values()) if v.block_size), None)

    async def _run(self, unique_id: str, full_id: str) -> None:
        actor, view = None, BlockView()
        while unique_id in self._wanted:
            try:
                if actor is None:
                    actor = await asyncio.to_thread(ray.get_actor, actor_name(full_id), NAMESPACE)
                reply = await actor.changes.remote(view.epoch, view.seq, POLL_WAIT_S)
                view.update(reply)
                if unique_id in self._wanted:
                    self.views[unique_id] = view
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 — not started yet, restarting or gone: start over
                if actor is not None:
                    logger.info("KV events of replica %s: %s; following it again", unique_id, type(e).__name__)
                actor, view = None, BlockView()
                self.views.pop(unique_id, None)
                await asyncio.sleep(RETRY_S)
        self._tasks.pop(unique_id, None)
