"""The `kv_cache` routing policy of Summit's Serve routers (deployments/routing/routers.py): the replica whose
engine holds the longest cached prefix of a request's tokens, from the engines' KV events (`kv_blocks.py`,
`kv_follow.py`), the request tokenized as vLLM does (`kv_tokens.py`)."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

from ray.serve.request_router import RunningReplica

from deployments.http.protocol import HTTPRequest
from deployments.observability import metrics
from deployments.routing import policies as routing
from deployments.routing.kv_blocks import DEFAULT_CPU_CREDIT, DEFAULT_LOAD_COST_TOKENS, BlockView, chain, choose
from deployments.routing.kv_follow import KVFollower
from deployments.routing.kv_tokens import PromptTokens

# How long a replica chosen for a request counts as holding its blocks before its engine's events say so
# (routing.claim_s)
KV_CLAIM_S = 10.0


class KVCachePolicy:
    """To the replica whose engine holds the longest cached prefix of the request's tokens (in GPU memory; a block
    only in an offload tier counts `cpu_block_credit`), less `load_cost_tokens` of prefix for each request it has
    ongoing above the least-loaded replica, and never one `imbalance` requests busier than that (kv_blocks.choose).
    What each engine holds comes from its KV events (`kv_follow.KVFollower`); between a decision and the
    engine's events for it (the prefill), the chosen replica is taken to hold the request's blocks for `claim_s`, so
    a burst of one new prefix is not spread before its first prefill ends (0: no claims)."""

    name = "kv_cache"
    strict = False
    clock = staticmethod(time.monotonic)  # claims' clock (the simulator's own time in app/simulate)

    def __init__(
        self,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        imbalance: int = routing.DEFAULT_IMBALANCE,
        cpu_block_credit: float = DEFAULT_CPU_CREDIT,
        max_tracked: int = routing.DEFAULT_MAX_TRACKED,
        load_cost_tokens: int = DEFAULT_LOAD_COST_TOKENS,
        claim_s: float = KV_CLAIM_S,
    ):
        self.tokens = PromptTokens(tokenizer, chat_template)
        self.follower = KVFollower()
        self.imbalance, self.cpu_credit, self.max_tracked = imbalance, cpu_block_credit, max_tracked
        self.load_cost_tokens, self.claim_s = load_cost_tokens, claim_s
        self._claims: dict[int, tuple[str, float]] = {}  # content hash -> (replica, until)
        self._mean_blocks = 0.0  # a request's blocks (its prompt's full ones + 1), running mean over decisions

    async def route(
        self,
        request: HTTPRequest | None,
        loads: routing.Loads,
        rng: random.Random,
        replicas: list[RunningReplica],
        lora: str | None = None,
        model: str | None = None,
    ) -> tuple[str, str, list[int]] | None:
        """(replica, outcome, the request's block hashes) by cached prefix; None when the request has no prompt to
        route on or no replica's blocks are known yet (then: by load). The caller claims the blocks for the replica
        it finally sends the request to (`claim`). Blocks of the chosen replica's credited prefix that it holds only
        in an offload tier are counted (`summit_routing_offload_blocks`, by `model`)."""
        self.follower.follow({r.replica_id.unique_id: r.replica_id.to_full_id_str() for r in replicas})
        block_size = self.follower.block_size()
        if request is None or block_size is None:
            return None
        found = await self.tokens.of(routing.request_body(request.body))
        if found is None:
            return None
        tokens, cut = found
        hashes = chain(tokens, block_size, lora)
        if cut and hashes:
            hashes.pop()  # its tokens were cut at the character limit
        if not hashes:
            return None
        capacities = {r.replica_id.unique_id: r.routing_stats.get("kv_blocks") for r in replicas}
        chosen, outcome = self.decide(hashes, loads, rng, self.follower.views, block_size, model, capacities)
        return chosen, outcome, hashes

    def decide(
        self,
        hashes: list[int],
        loads: routing.Loads,
        rng: random.Random,
        views: Mapping[str, BlockView],
        block_size: int,
        model: str | None = None,
        capacities: Mapping[str, int | None] | None = None,
    ) -> tuple[str, str]:
        """(replica, outcome) for a request whose prompt's blocks are `hashes`, given each replica's cached blocks
        (`views`, from its engine's KV events) and claims: the decision `route` makes once it has the tokens, and what
        `summit simulate` calls with its simulated engines' views (app/simulate). `capacities`: each replica's
        engine's KV-cache blocks (its routing stats) — a replica whose ongoing requests and this one would not fit
        there, at this router's running mean of a request's blocks, gets no credit for its cached prefix (it would
        preempt: the request goes by load)."""
        now = self.clock()
        self._mean_blocks += 0.1 * (len(hashes) + 1 - self._mean_blocks) if self._mean_blocks else len(hashes) + 1
        held = {}
        for rid in loads:
            view = views.get(rid)
            credit = view.held(hashes, self.cpu_credit) if view is not None else 0.0
            held[rid] = max(credit, self._claimed(hashes, rid, now))
            capacity = (capacities or {}).get(rid)
            if capacity and (loads[rid] + 1) * self._mean_blocks > capacity:
                held[rid] = 0.0
        cost = self.load_cost_tokens / block_size  # in blocks of this engine
        chosen, outcome, _ = choose(held, loads, self.imbalance, rng, tie=hashes[0], load_cost=cost)
        view = views.get(chosen)
        offloaded = view.offloaded(hashes) if view is not None and view.cpu else 0
        if offloaded:
            metrics.routing_offload_blocks(model, offloaded)
        return chosen, outcome

    def forget_replicas(self, alive: list[str]) -> None:
        self.follower.forget(alive)

    def _claimed(self, hashes: list[int], replica: str, now: float) -> float:
        n = 0
        for h in hashes:
            owner = self._claims.get(h)
            if owner is None or owner[0] != replica or owner[1] < now:
                break
            n += 1
        return float(n)

    def claim(self, hashes: list[int], replica: str) -> None:
        if not self.claim_s:
            return
        now = self.clock()
        if len(self._claims) + len(hashes) > self.max_tracked:
            self._claims = {h: c for h, c in self._claims.items() if c[1] >= now}
            if len(self._claims) + len(hashes) > self.max_tracked:
                self._claims.clear()
        until = now + self.claim_s
        for h in hashes:
            self._claims[h] = (replica, until)
