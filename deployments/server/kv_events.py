"""A replica's KV events: what its engine caches, for the `kv_cache` routers (deployments/routing/kv_follow.py).

With `routing.policy: kv_cache` the replica starts a `KVEvents` actor on its node before its engine, and the engine
publishes vLLM's KV events (`kv_events_config`, ZMQ) on a Unix socket the actor subscribes to (nothing listens on
the network). The actor indexes them by content (`deployments/routing/kv_blocks.ReplicaBlocks`) and answers routers'
long polls for the changes since their cursor. A gap in vLLM's sequence numbers (events sent before the actor's
socket connected, or dropped) is filled from vLLM's replay socket. The actor is named after the replica
(`kv_follow.actor_name`) and goes with it (it is the replica's child).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from typing import Any

import msgspec
import ray
import zmq
import zmq.asyncio
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deployments.routing.kv_blocks import DEFAULT_MAX_BLOCKS, ReplicaBlocks
from deployments.routing.kv_follow import NAMESPACE, actor_name

logger = logging.getLogger("ray.serve")

_END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay socket: the end of a replay
REPLAY_WAIT_S = 2.0


def event_sockets() -> tuple[str, str]:
    """Two fresh Unix-socket endpoints (events, replay) for one engine; vLLM binds them."""
    stem = os.path.join(tempfile.gettempdir(), f"summit-kv-{uuid.uuid4().hex[:12]}")
    return f"ipc://{stem}.sock", f"ipc://{stem}-replay.sock"


def _events(payload: bytes) -> list[dict[str, Any]]:
    """vLLM's KVEventBatch (msgpack: [ts, events, dp_rank]) as plain dicts with `type`."""
    batch = msgspec.msgpack.decode(payload)
    events = batch[1] if isinstance(batch, list) and len(batch) > 1 else []
    return [e for e in events if isinstance(e, dict)]


class KVEvents:
    """One engine's KV events, indexed; answers `changes` (routers' long polls)."""

    def __init__(self, endpoint: str, replay_endpoint: str, block_size: int | None, max_blocks: int):
        self.blocks = ReplicaBlocks(max_blocks)
        self.blocks.block_size = block_size
        self._endpoint, self._replay_endpoint = endpoint, replay_endpoint
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._next_seq = 0  # vLLM's sequence number expected next
        self.batches = self.gaps = 0

    async def start(self) -> None:
        """Subscribe (the engine binds its sockets as it starts; ZMQ connects once they exist)."""
        if self._task is None:
            self._changed = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._receive())

    def set_block_size(self, block_size: int) -> None:
        self.blocks.block_size = block_size

    async def _receive(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._endpoint)
        try:
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self._next_seq:
                    await self._replay(self._next_seq, seq)
                if seq >= self._next_seq:
                    self._apply(seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV events of %s stopped", self._endpoint)
        finally:
            sub.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        for event in _events(payload):
            self.blocks.apply(event)
        self._next_seq, self.batches = seq + 1, self.batches + 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def _replay(self, start: int, end: int) -> None:
        """Batches [start, end) from vLLM's replay buffer; what it no longer holds stays missed (counted)."""
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.connect(self._replay_endpoint)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_WAIT_S)
                _, _topic, seq_bytes, payload = frames[-4:]
                if seq_bytes == _END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if self._next_seq <= seq < end:
                    if seq > self._next_seq:
                        self.gaps += 1
                    self._apply(seq, payload)
        except (TimeoutError, asyncio.TimeoutError, ValueError):
            pass
        finally:
            dealer.close(linger=0)
        if self._next_seq < end:
            self.gaps += 1
            logger.warning("KV events %d..%d missed (not in vLLM's replay buffer)", self._next_seq, end - 1)
            self._next_seq = end

    async def changes(self, epoch: int | None, since: int, wait_s: float = 1.0) -> dict[str, Any]:
        """The changes after a follower's cursor; a follower that is current waits up to `wait_s` for one."""
        if epoch == self.blocks.epoch and since == self.blocks.seq and self._changed is not None:
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except (TimeoutError, asyncio.TimeoutError):
                pass
        return self.blocks.changes(epoch, since)

    def stats(self) -> dict[str, Any]:
        b = self.blocks
        return {"blocks": len(b), "seq": b.seq, "batches": self.batches, "gaps": self.gaps, "unchained": b.unchained}


async def start_kv_events(replica_full_id: str, max_blocks: int = DEFAULT_MAX_BLOCKS) -> tuple[Any, tuple[str, str]]:
    """The replica's KVEvents actor (on this node, named after the replica, subscribed) and the two endpoints its
    engine publishes on."""
    endpoint, replay = event_sockets()
    actor = (
        ray.remote(KVEvents)
        .options(
            name=actor_name(replica_full_id),
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        )
        .remote(endpoint, replay, None, max_blocks)
    )
    await actor.start.remote()
    return actor, (endpoint, replay)
