"""The simulator's routing: Summit's own policy objects (deployments/routing: the ones its Serve routers decide
with, built by `router_options.make_policy` from the model's `routing:` options), fed the simulated replicas' loads and,
for kv_cache, their engines' KV events through the runtime's own index (`ReplicaBlocks` → `BlockView`)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from app.simulate.engine import SimRequest
from deployments.routing import policies as routing
from deployments.routing.kv_blocks import BlockView, ReplicaBlocks, chain
from deployments.routing.router_options import make_policy


class ReplicaIndex:
    """A simulated replica's KV index as the runtime keeps it: its engine's events into `ReplicaBlocks`, the router's
    `BlockView` following its change log (kept current at each decision: the runtime's follower polls)."""

    def __init__(self, capacity_blocks: int | None = None):
        self.blocks, self.view = ReplicaBlocks(), BlockView()
        self.capacity_blocks = capacity_blocks  # what the replica reports in its routing stats (`kv_blocks`)

    def events(self, batch: list[dict]) -> None:
        for event in batch:
            self.blocks.apply(event)

    def current(self) -> BlockView:
        if self.view.epoch != self.blocks.epoch or self.view.seq != self.blocks.seq:  # else nothing changed
            self.view.update(self.blocks.changes(self.view.epoch, self.view.seq))
        return self.view


class SimRouter:
    """One model's routing decision for a simulated request among the replicas that can take it."""

    def __init__(
        self,
        policy: str,
        options: Mapping[str, Any],
        block_size: int,
        clock: Callable[[], float],
        seed: int = 0,
    ):
        self.name, self.block_size = policy, block_size
        self.policy = make_policy(policy, **options)
        if policy == "kv_cache":
            self.policy.clock = clock  # claims lapse in simulated time
        self.rng = random.Random(seed)
        self.outcomes: Counter = Counter()

    def choose(self, req: SimRequest, loads: Mapping[str, int], indexes: Mapping[str, ReplicaIndex]) -> str:
        if self.name == "kv_cache":
            if not req.hashes:
                req.hashes = chain(req.tokens, self.block_size)  # the engine names its blocks by the same
            hashes = req.hashes
            if hashes:
                views = {rid: indexes[rid].current() for rid in loads if rid in indexes}
                capacities = {rid: indexes[rid].capacity_blocks for rid in loads if rid in indexes}
                chosen, outcome = self.policy.decide(hashes, loads, self.rng, views, self.block_size, None, capacities)
                self.policy.claim(hashes, chosen)
            else:
                chosen, outcome = routing.power_of_two(loads, self.rng), "least_load"
        else:
            key = None
            if self.name == "prefix_affinity":
                key = routing.prefix_key({"prompt": req.prompt_text}, self.policy.prefix_chars)
            elif self.name == "session_affinity" and req.session:
                key = "session:" + req.session
            chosen, outcome = self.policy.decide_why(key, loads, self.rng)
        self.outcomes[outcome] += 1
        return chosen

    def forget(self, alive: list[str]) -> None:
        self.policy.forget_replicas(alive)
