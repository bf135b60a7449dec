"""One vLLM engine as `summit simulate` models it: continuous batching over a paged KV cache with prefix caching.

A step runs every running request's next token (decode), then admits waiting requests first come first served while
the step's token budget (`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and free KV blocks allow; the
leading blocks of a prompt found in the prefix cache are not computed, and a long prompt is computed in chunks over
several steps (chunked prefill). A step that completes a prompt samples its first token. A request that needs a block
when none is free preempts the newest running request, which later computes its prompt and output again (vLLM's
recompute preemption). A finished request's full blocks stay cached, named by content, until evicted least recently
used first. What the cache holds is announced as vLLM's KV events (`BlockStored` / `BlockRemoved`, the dicts the
replica's feed decodes), so the simulator can feed the runtime's own index (deployments/routing/kv_blocks.py).

Pure: no clock of its own. `plan()` says what the next step computes, `apply(step, end)` applies it at its end time;
the step's duration is the profile's (app/simulate/profile.py). A run of decode-only steps can be applied at once
(`decode_run`), which keeps 64 replicas × minutes of traffic fast.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deployments.routing.kv_blocks import chain


@dataclass(eq=False)
class SimRequest:
    """A request's tokens and what happened to it (times in simulated seconds)."""

    rid: int
    tokens: list[int]
    output_len: int
    arrival: float
    text: str = ""  # what prefix_affinity keys on (its first characters)
    session: str | None = None
    hashes: list[int] = field(default_factory=list)  # the prompt's full blocks, named by content
    computed: int = 0  # tokens with KV (cached or computed) of the ones to compute before the next token
    generated: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    first_token_at: float | None = None
    finished_at: float | None = None
    replica: str | None = None
    engine_arrival: float | None = None  # when its replica's engine got it (after Serve's handle queue)
    preempted: int = 0
    named: list[int] = field(default_factory=list)  # the named blocks it holds a reference to
    anonymous: int = 0  # the blocks it holds that are not named (a partial last block, its output)

    @property
    def prompt_text(self) -> str:
        """What prefix_affinity keys on: the prompt's text, or its tokens as words (a simulated load's prompts)."""
        return self.text or " ".join(map(str, self.tokens[:400]))

    @property
    def target(self) -> int:
        """Tokens that must have KV before the next token can be sampled: the prompt, plus any output already
        streamed when a preemption made it start again."""
        return len(self.tokens) + max(0, self.generated - 1) if self.generated else len(self.tokens)


@dataclass
class Step:
    decodes: list[SimRequest]
    prefills: list[tuple[SimRequest, int]]  # (request, tokens computed this step)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)


class KVCache:
    """Blocks: named ones (a full prompt block, by content hash; reference-counted, the unreferenced kept in LRU order
    for reuse) and anonymous ones (a request's partial or output blocks)."""

    def __init__(self, capacity_blocks: int, block_size: int, on_events: Callable[[list[dict]], None] | None = None):
        self.capacity, self.block_size = capacity_blocks, block_size
        self.refs: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # named blocks no request references, oldest first
        self.anonymous = 0
        self.on_events = on_events

    def free(self) -> int:
        """Blocks a request can take now (unreferenced named blocks are evicted for it)."""
        return self.capacity - len(self.refs) - self.anonymous + len(self.idle)

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.refs:
                break
            n += 1
        return n

    def _make_room(self, blocks: int) -> bool:
        if self.free() < blocks:
            return False
        removed = []
        while self.capacity - len(self.refs) - self.anonymous < blocks:
            h, _ = self.idle.popitem(last=False)
            del self.refs[h]
            removed.append(h)
        if removed and self.on_events:
            self.on_events([{"type": "BlockRemoved", "block_hashes": removed, "medium": None}])
        return True

    def ref(self, h: int) -> None:
        self.refs[h] = self.refs.get(h, 0) + 1
        self.idle.pop(h, None)

    def unref(self, h: int) -> None:
        self.refs[h] -= 1
        if self.refs[h] == 0:
            self.idle[h] = None

    def take_named(self, h: int) -> bool | None:
        """A newly computed full block, named at once: True if it is new (its caller announces it), False if another
        request computed it meanwhile (shared), None if no block is free."""
        if h in self.refs:
            self.ref(h)
            return False
        if not self._make_room(1):
            return None
        self.refs[h] = 1
        return True

    def announce(self, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        """vLLM's BlockStored for consecutive new blocks."""
        if self.on_events:
            self.on_events(
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "parent_block_hash": parent,
                        "token_ids": tokens,
                        "block_size": self.block_size,
                        "lora_name": None,
                        "medium": None,
                    }
                ]
            )

    def take_anonymous(self, blocks: int) -> bool:
        if blocks <= 0:
            return True
        if not self._make_room(blocks):
            return False
        self.anonymous += blocks
        return True


class SimEngine:
    """One engine's scheduler and KV cache. `max_num_batched_tokens`: the step's token budget (decodes count one)."""

    def __init__(
        self,
        kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_events: Callable[[list[dict]], None] | None = None,
    ):
        self.cache = KVCache(kv_blocks, block_size, on_events)
        self.block_size, self.max_num_seqs, self.budget = block_size, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # admitted, in admission order
        self.finished: list[SimRequest] = []
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found (vLLM's counters)

    def add(self, req: SimRequest) -> None:
        if not req.hashes:
            req.hashes = chain(req.tokens, self.block_size)
        self.waiting.append(req)

    @property
    def ongoing(self) -> int:
        return len(self.waiting) + len(self.running)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def plan(self) -> Step:
        """The next step's batch: decodes of the running requests whose prompt is done, prefill chunks of the others,
        then new admissions while budget, sequences and blocks allow."""
        budget = self.budget
        decodes = [r for r in self.running if r.computed >= r.target]
        budget -= len(decodes)
        prefills: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if r.computed < r.target and budget > 0:
                n = min(budget, r.target - r.computed)
                prefills.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self._admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            n = min(budget, r.target - r.computed)
            if n > 0:
                prefills.append((r, n))
                budget -= n
        return Step(decodes, prefills)

    def _admit(self, r: SimRequest) -> bool:
        """Reference the prompt's cached leading blocks; the rest is computed as the prefill goes."""
        hit = self.cache.match(r.hashes)
        if r.preempted == 0 or not r.named:
            self.prefix_queries += len(r.tokens)
            self.prefix_hits += hit * self.block_size
            if r.generated == 0:
                r.cached_tokens = hit * self.block_size
        if self.cache.free() < 1:  # room for at least the next block, else wait
            return False
        for h in r.hashes[:hit]:
            self.cache.ref(h)
        r.named = list(r.hashes[:hit])
        r.computed = hit * self.block_size
        if r.computed >= r.target:  # the whole prompt cached: vLLM recomputes its last token
            r.computed = r.target - 1
        return True

    def _grow(self, r: SimRequest, tokens: int) -> bool:
        """Give `r` the blocks for `tokens` tokens of KV: its full prompt blocks named (announced), the rest
        anonymous."""
        cache, bs = self.cache, self.block_size
        full = min(tokens // bs, len(r.hashes))
        if len(r.named) >= full and (len(r.named) + r.anonymous) * bs >= tokens:
            return True  # it has them already (most decode steps)
        cache.anonymous -= r.anonymous
        r.anonymous = 0
        run: list[int] = []  # consecutive new blocks, announced in one event as vLLM does

        def announce() -> None:
            if run:
                first = run[0]
                cache.announce(
                    r.hashes[first : run[-1] + 1],
                    r.hashes[first - 1] if first else None,
                    r.tokens[first * bs : (run[-1] + 1) * bs],
                )
                run.clear()

        for i in range(len(r.named), full):
            new = cache.take_named(r.hashes[i])
            if new is None:
                announce()
                return False
            r.named.append(r.hashes[i])
            if new:
                run.append(i)
            else:
                announce()
        announce()
        need = math.ceil(tokens / bs) - len(r.named)
        if not cache.take_anonymous(need):
            return False
        r.anonymous = need
        return True

    def _release(self, r: SimRequest) -> None:
        for h in r.named:
            self.cache.unref(h)
        self.cache.anonymous -= r.anonymous
        r.named, r.anonymous = [], 0

    def _preempt(self, r: SimRequest) -> None:
        self._release(r)
        r.computed = 0
        r.preempted += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    def _reserve(self, r: SimRequest, tokens: int) -> bool:
        """Blocks for `r`, preempting the newest running requests while there are none (False: `r` itself went)."""
        while not self._grow(r, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def allocate(self, step: Step) -> Step:
        """The blocks `step` writes, as vLLM's scheduler allocates them; requests preempted meanwhile drop out."""
        decodes = [r for r in step.decodes if r in self.running and self._reserve(r, len(r.tokens) + r.generated)]
        prefills = [(r, n) for r, n in step.prefills if r in self.running and self._reserve(r, r.computed + n)]
        return Step([r for r in decodes if r in self.running], [(r, n) for r, n in prefills if r in self.running])

    def apply(self, step: Step, end: float) -> list[SimRequest]:
        """The step's tokens, at its end time `end`; returns the requests it finished."""
        for r, n in step.prefills:
            r.computed += n
            if r.computed >= r.target:
                if r.generated == 0:
                    r.first_token_at = end
                r.generated += 1
        for r in step.decodes:  # the last sampled token's KV, and the next token
            r.computed += 1
            r.generated += 1
        return self._finish(end)

    def _finish(self, end: float) -> list[SimRequest]:
        done = [r for r in self.running if r.generated >= r.output_len]
        for r in done:
            r.finished_at = end
            self._release(r)
            self.running.remove(r)
            self.finished.append(r)
        return done

    def decode_run_length(self) -> int:
        """How many decode-only steps can be applied at once: every running request decoding, none waiting that could
        be admitted, and blocks for all of them (0: take the next step alone)."""
        if not self.running or any(r.computed < r.target for r in self.running):
            return 0
        if self.waiting and len(self.running) < self.max_num_seqs:
            return 0
        k = min(r.output_len - r.generated for r in self.running)
        bs = self.block_size
        need = sum(
            math.ceil((len(r.tokens) + r.generated + k) / bs) - math.ceil((len(r.tokens) + r.generated) / bs)
            for r in self.running
        )
        return k if k > 1 and need <= self.cache.free() else 0

    def decode_run(self, k: int, start: float, step_s: float) -> list[SimRequest]:
        """`k` decode-only steps of `step_s` each from `start` (k from `decode_run_length`, or fewer)."""
        for r in list(self.running):
            r.computed += k
            r.generated += k
            self._grow(r, len(r.tokens) + r.generated - 1)
        return self._finish(start + k * step_s)

    def context_tokens(self) -> int:
        return sum(len(r.tokens) + r.generated for r in self.running)
