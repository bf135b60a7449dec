"""`deployments/routing/kv_follow.KVFollower`, the router's side of kv_cache routing, against fake KV events actors
(the real actor beside a real engine: tests/cpu/test_kv_events.py; both through Ray: tests/cpu/test_engine_features.py):
it waits for a replica's actor to appear, mirrors its index, drops the view when the actor dies and starts over from a
snapshot of the next one, and stops following a replica that is gone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deployments.routing import kv_follow
from deployments.routing.kv_blocks import ReplicaBlocks, chain


def index(tokens: list[int]) -> ReplicaBlocks:
    blocks = ReplicaBlocks()
    blocks.apply({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": tokens,
                  "block_size": 4})  # fmt: skip
    return blocks


class FakeActor:
    def __init__(self, blocks: ReplicaBlocks):
        self.blocks, self.dead = blocks, False
        self.changes = SimpleNamespace(remote=self._changes)

    async def _changes(self, epoch, since, wait_s):
        await asyncio.sleep(0.01)
        if self.dead:
            raise RuntimeError("the actor died")
        return self.blocks.changes(epoch, since)


def test_a_follower_mirrors_restarts_from_a_snapshot_and_stops(monkeypatch):
    actors: dict[str, FakeActor] = {}

    def get_actor(name, namespace):
        assert namespace == kv_follow.NAMESPACE
        if name not in actors:
            raise ValueError(f"no actor {name}")
        return actors[name]

    monkeypatch.setattr(kv_follow.ray, "get_actor", get_actor)
    monkeypatch.setattr(kv_follow, "RETRY_S", 0.02)
    first, second = chain([1, 2, 3, 4], 4), chain([5, 6, 7, 8], 4)

    async def until(check, what: str) -> None:
        for _ in range(300):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(what)

    async def scenario():
        follower = kv_follow.KVFollower()
        follower.follow({"r1": "SERVE_REPLICA::app#d#r1"})
        await asyncio.sleep(0.1)
        assert "r1" not in follower.views  # no actor yet: nothing known
        name = kv_follow.actor_name("SERVE_REPLICA::app#d#r1")
        actors[name] = FakeActor(index([1, 2, 3, 4]))
        await until(lambda: "r1" in follower.views and follower.views["r1"].held(first) == 1, "never mirrored")
        assert follower.block_size() == 4
        actors[name].dead = True
        await until(lambda: "r1" not in follower.views, "a dead actor's view stayed")
        actors[name] = FakeActor(index([5, 6, 7, 8]))  # the index starts over (another epoch)
        await until(lambda: "r1" in follower.views, "never followed the new actor")
        view = follower.views["r1"]
        assert view.held(second) == 1 and view.held(first) == 0
        follower.forget(["r2"])
        assert "r1" not in follower.views
        await until(lambda: not follower._tasks, "the follower task kept running")

    asyncio.run(scenario())
