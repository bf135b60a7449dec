"""What each engine holds in its KV cache, from vLLM's own KV events, and the `kv_cache` routing decision. Pure: no
Ray, no vLLM, no sockets.

vLLM names a cached block by its own hash (seeded per process unless PYTHONHASHSEED is pinned, and spelled differently
across vLLM lines). Summit names it by content instead: a chain of 64-bit hashes over the block's tokens, rooted in the
LoRA adapter that computed it (an adapter's blocks are its own), so that the router, which tokenizes the request with
the model's tokenizer, computes the same names without knowing any engine's seed. vLLM's `BlockStored` event carries
the tokens and the parent block, which is all the chain needs.

Three parts:
- `ReplicaBlocks` (beside one engine: `deployments/server/kv_events.py` feeds it the engine's events): engine hash →
  content hash, where each block is held (`GPU`, `CPU` for vLLM's offload tiers), a bounded change log with sequence
  numbers that routers follow (`changes`).
- `BlockView` (in a router, one per replica): the mirror that the change log keeps current, and how many leading blocks
  of a request it holds.
- `choose` (the decision): the replica holding the longest cached prefix, less a load cost for each request it has
  ongoing above the least-loaded replica, never one `imbalance` requests busier than that.
"""

from __future__ import annotations

import functools
import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

GPU, CPU = "GPU", "CPU"
DEFAULT_CPU_CREDIT = 0.5
# What one ongoing request costs a replica's claim, in tokens of cached prefix (routing.load_cost_tokens): 3 GPU blocks.
# The routing replay (bench/routing_loads.py, bench/results/routing-replay-2026-11-29.md), 5 draws of each load, 2
# replicas, 8 in flight: 0 (the replica holding the most within imbalance) hit 68.0 % of multi-turn chats' blocks and
# 82.4 % of preambles sharing a head; 48 hit 75.2 % and 90.6 % for -0.4 points on shared prompts; 96 lost 3.6 there.
DEFAULT_LOAD_COST_TOKENS = 48
DEFAULT_MAX_BLOCKS = 1_000_000  # per replica: an H100's 8B KV cache is ~30k blocks of 16 tokens
LOG_ENTRIES = 200_000  # changes kept for routers that fell behind; older cursors get a snapshot


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root(lora: str | None) -> int:
    """The chain's root: the LoRA adapter whose weights computed the blocks (None: the base model)."""
    return _digest(b"summit-kv-root\0" + (lora or "").encode())


def link(parent: int, tokens: Sequence[int]) -> int:
    """A block's content hash: its parent's and its own tokens'. Remembered for the blocks seen last (a shared system
    prompt's blocks are named once, not for every request and every engine that stores them)."""
    return _link(parent, tuple(tokens))


@functools.lru_cache(maxsize=1 << 16)
def _link(parent: int, tokens: tuple[int, ...]) -> int:
    return _digest(parent.to_bytes(8, "little") + array("q", tokens).tobytes())


def chain(tokens: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """The content hashes of the full blocks of `tokens` (a partial last block is never cached)."""
    out, parent = [], root(lora)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = link(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


class ReplicaBlocks:
    """One engine's cached blocks by content hash, built from vLLM's KV events (decoded to plain dicts: `type`
    BlockStored / BlockRemoved / AllBlocksCleared), and the change log routers follow. Bounded: past `max_blocks` the
    oldest stored block is dropped (the engine would have evicted it long before on any real cache)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, log_entries: int = LOG_ENTRIES):
        self.max_blocks, self.log_entries = max_blocks, log_entries
        self.epoch = random.getrandbits(62)  # a new index: followers start from a snapshot
        self.block_size: int | None = None
        self._names: dict[Any, int] = {}  # engine hash -> content hash
        self._held: OrderedDict[int, dict[str, int]] = OrderedDict()  # content hash -> {medium: announcements}
        self._engine_hash: dict[int, Any] = {}  # content hash -> engine hash (to drop a bounded-out block's name)
        self._log: list[tuple[int, int, str]] = []  # (+1 | -1, content hash, medium)
        self._log_start = 0  # sequence number of _log[0]
        self.unchained = 0  # stored blocks whose parent was never seen (missed events): not indexed

    @property
    def seq(self) -> int:
        return self._log_start + len(self._log)

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            for engine_hash in event.get("block_hashes") or ():
                self._removed(engine_hash, event.get("medium") or GPU)
        elif kind == "AllBlocksCleared":
            self.clear()

    def clear(self) -> None:
        for content, media in list(self._held.items()):
            for medium in media:
                self._record(-1, content, medium)
        self._names.clear()
        self._held.clear()
        self._engine_hash.clear()

    def _stored(self, event: Mapping[str, Any]) -> None:
        size = event.get("block_size") or self.block_size
        hashes, tokens = event.get("block_hashes") or [], event.get("token_ids") or []
        if not size or len(tokens) < len(hashes) * size:
            return
        self.block_size = size
        medium = event.get("medium") or GPU
        parent_hash = event.get("parent_block_hash")
        parent = root(event.get("lora_name")) if parent_hash is None else self._names.get(_key(parent_hash))
        if parent is None:
            self.unchained += len(hashes)
            return
        for i, engine_hash in enumerate(hashes):
            parent = link(parent, tokens[i * size : (i + 1) * size])
            self._names[_key(engine_hash)] = parent
            self._engine_hash[parent] = _key(engine_hash)
            media = self._held.get(parent)
            if media is None:
                media = self._held[parent] = {}
            else:
                self._held.move_to_end(parent)
            # counted: vLLM's offload tiers announce a block once per chunk that holds it, and remove it as often
            media[medium] = media.get(medium, 0) + 1
            if media[medium] == 1:
                self._record(+1, parent, medium)
        while len(self._held) > self.max_blocks:
            oldest, media = self._held.popitem(last=False)
            self._names.pop(self._engine_hash.pop(oldest, None), None)
            for m in media:
                self._record(-1, oldest, m)

    def _removed(self, engine_hash: Any, medium: str) -> None:
        content = self._names.get(_key(engine_hash))
        media = self._held.get(content) if content is not None else None
        if media is None or medium not in media:
            return
        media[medium] -= 1
        if media[medium] > 0:
            return
        del media[medium]
        self._record(-1, content, medium)
        if not media:
            del self._held[content]
            self._names.pop(self._engine_hash.pop(content, None), None)

    def _record(self, op: int, content: int, medium: str) -> None:
        self._log.append((op, content, medium))
        if len(self._log) > self.log_entries:
            drop = len(self._log) - self.log_entries // 2
            del self._log[:drop]
            self._log_start += drop

    def changes(self, epoch: int | None, since: int) -> dict[str, Any]:
        """What a follower at (`epoch`, `since`) lacks: the changes after `since`, or, for a follower of another
        index or one that fell behind the log, a snapshot (`reset`)."""
        head = {"epoch": self.epoch, "seq": self.seq, "block_size": self.block_size}
        if epoch != self.epoch or since < self._log_start or since > self.seq:
            blocks = [(content, medium) for content, media in self._held.items() for medium in media]
            return {**head, "reset": True, "blocks": blocks}
        return {**head, "reset": False, "changes": self._log[since - self._log_start :]}


def _key(engine_hash: Any) -> Any:
    return tuple(engine_hash) if isinstance(engine_hash, list) else engine_hash


class BlockView:
    """A router's mirror of one replica's `ReplicaBlocks`, kept current by its change log."""

    def __init__(self):
        self.epoch: int | None = None
        self.seq = 0
        self.block_size: int | None = None
        self.gpu: set[int] = set()
        self.cpu: set[int] = set()

    def update(self, reply: Mapping[str, Any]) -> None:
        if reply["reset"]:
            self.gpu, self.cpu = set(), set()
            for content, medium in reply["blocks"]:
                self._tier(medium).add(content)
        else:
            for op, content, medium in reply["changes"]:
                tier = self._tier(medium)
                if op > 0:
                    tier.add(content)
                else:
                    tier.discard(content)
        self.epoch, self.seq, self.block_size = reply["epoch"], reply["seq"], reply["block_size"] or self.block_size

    def _tier(self, medium: str) -> set[int]:
        return self.gpu if medium == GPU else self.cpu

    def __len__(self) -> int:
        return len(self.gpu | self.cpu)

    def held(self, hashes: Sequence[int], cpu_credit: float = DEFAULT_CPU_CREDIT) -> float:
        """Credit for the request's leading blocks this replica holds: 1 a block in GPU memory, `cpu_credit` one only
        in an offload tier; the run stops at the first block it holds nowhere (vLLM reuses a prefix only)."""
        credit = 0.0
        for h in hashes:
            if h in self.gpu:
                credit += 1.0
            elif h in self.cpu:
                credit += cpu_credit
            else:
                break
        return credit

    def offloaded(self, hashes: Sequence[int]) -> int:
        """Of the request's leading blocks this replica holds (the run `held` credits), how many only in an offload
        tier."""
        n = 0
        for h in hashes:
            if h in self.gpu:
                continue
            if h not in self.cpu:
                break
            n += 1
        return n


def choose(
    held: Mapping[str, float],
    loads: Mapping[str, int],
    imbalance: int,
    rng: random.Random,
    tie: int | None = None,
    load_cost: float = 0.0,
) -> tuple[str, str, float]:
    """(replica, outcome, credit) for a request whose leading blocks each replica in `loads` holds `held[replica]`
    of: among the replicas within `imbalance` requests of the least-loaded one, the best by its blocks less
    `load_cost` blocks for each request it has ongoing above the least-loaded replica — a replica holding a few more
    blocks (a shared system prompt, one turn of a chat) does not draw every request while another idles; one holding
    a whole document does. Outcomes: `hit` (a replica holding the most blocks anywhere), `spill` (a replica holding
    more lost the request to load), `new` (no replica within reach holds any block: the least loaded). Ties go to the
    less loaded, then by `tie` (the request's first block: routers of several ingress replicas agree and a new prefix
    lands on the same replica from each), else at random."""
    least = min(loads.values())
    within = [r for r in loads if loads[r] - least <= imbalance]
    best_anywhere = max((held.get(r, 0.0) for r in loads), default=0.0)
    if max((held.get(r, 0.0) for r in within), default=0.0) > 0:
        score = {r: held.get(r, 0.0) - load_cost * (loads[r] - least) for r in within}
        top_score = max(score.values())
        top = [r for r in within if score[r] == top_score]
        fewest = min(loads[r] for r in top)
        chosen = _pick([r for r in top if loads[r] == fewest], rng, tie)
        credit = held.get(chosen, 0.0)
        return chosen, "hit" if credit == best_anywhere else "spill", credit
    idle = [r for r in loads if loads[r] == least]
    return _pick(idle, rng, tie), "spill" if best_anywhere > 0 else "new", 0.0


def _pick(replicas: list[str], rng: random.Random, tie: int | None) -> str:
    if tie is None or len(replicas) == 1:
        return rng.choice(replicas)
    return max(replicas, key=lambda r: _digest(tie.to_bytes(8, "little") + r.encode()))  # rendezvous hashing
