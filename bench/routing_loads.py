"""The routing benchmark's loads (bench/routing.py), and their replay through Summit's own routing decisions with each
replica's prefix cache modelled as blocks in LRU order (no engine, no timing: tests/unit/test_routing_loads.py runs
it in CI, `python bench/routing_loads.py` prints it).

A load is its prompts in arrival order. Sizes are in words: the tiny model's tokenizer makes about 1.5 tokens of one
of its words, and the replay counts a word as a token. The loads are made so that the first `prefix_chars` characters
(what `prefix_affinity` keys on) cannot tell the requests apart where their caches differ:
- `shared`: distinct system prompts, each followed by short questions (the first block names the prompt);
- `multi_turn`: chats under one system prompt, each turn the whole conversation so far plus a new question; turns of
  different chats interleave;
- `preambles`: system prompts that share a long common head (an organisation's rules), then a part of their own of
  different lengths, each followed by questions;
- `hot_cold`: a few hot documents asked about again and again among many cold ones asked about once;
- `overflow`: distinct documents, each asked about a few times, `factor` times what all replicas' caches hold.
"""

from __future__ import annotations

import random
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.clusters.tiny_model import _WORDS  # noqa: E402
from deployments.routing import policies as routing  # noqa: E402
from deployments.routing.kv_blocks import (  # noqa: E402
    DEFAULT_LOAD_COST_TOKENS,
    BlockView,
    ReplicaBlocks,
    chain,
    choose,
)

LOADS = ("shared", "multi_turn", "preambles", "hot_cold", "overflow2x", "overflow6x")
POLICIES = ("least_load", "prefix_affinity", "kv_cache")


@dataclass
class Load:
    name: str
    prompts: list[str]
    about: str


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _document(i: int, words: int, seed: int, title: str = "Document") -> str:
    """Distinct from its first characters on (the router's prefix key is its first block)."""
    return f"{title} {i}. " + _text(random.Random(seed * 100_003 + i), words) + "\n"


def shared(systems: int = 8, questions: int = 16, words: int = 330, seed: int = 1000) -> Load:
    prompts = [
        f"{_document(i, words, seed, 'System prompt')}Question {q}: what does rule {q} say?"
        for i in range(systems)
        for q in range(questions)
    ]
    random.Random(seed).shuffle(prompts)
    return Load("shared", prompts, f"{systems} system prompts of {words} words x {questions} questions")


def multi_turn(
    chats: int = 16, turns: int = 6, system_words: int = 330, turn_words: int = 60, seed: int = 2000
) -> Load:
    """Each chat's turn t is its turn t-1 prompt, an answer and a new question; chats take turns at random."""
    rng = random.Random(seed)
    system = _document(0, system_words, seed, "You are the assistant of the valley")
    history = [system + f"Chat {c} asks: " + _text(rng, turn_words) for c in range(chats)]
    left = {c: turns for c in range(chats)}
    prompts = []
    while left:
        c = rng.choice(sorted(left))
        prompts.append(history[c])
        history[c] += f"\nAnswer: {_text(rng, turn_words)}\nChat {c} asks: {_text(rng, turn_words // 2)}"
        left[c] -= 1
        if not left[c]:
            del left[c]
    return Load("multi_turn", prompts, f"{chats} chats x {turns} turns under one {system_words}-word system prompt")


def preambles(
    lengths: tuple[int, ...] = (40, 160, 480),
    per_length: int = 3,
    questions: int = 8,
    head_words: int = 300,
    seed: int = 3000,
) -> Load:
    rng = random.Random(seed)
    head = _document(0, head_words, seed, "Rules of the organisation")
    systems = [
        head + f"Team {len(lengths) * k + j}: " + _text(rng, n)
        for j, n in enumerate(lengths)
        for k in range(per_length)
    ]
    prompts = [f"{s}\nQuestion {q}: what applies here?" for s in systems for q in range(questions)]
    rng.shuffle(prompts)
    return Load(
        "preambles",
        prompts,
        f"{len(systems)} system prompts: a {head_words}-word common head, then "
        f"{'/'.join(map(str, lengths))} words of their own, x {questions} questions",
    )


def hot_cold(
    hot: int = 4, cold: int = 48, requests: int = 160, hot_share: float = 0.8, words: int = 330, seed: int = 4000
) -> Load:
    rng = random.Random(seed)
    cold_left = list(range(hot, hot + cold))
    prompts = []
    for n in range(requests):
        if rng.random() < hot_share or not cold_left:
            i = rng.randrange(hot)
        else:
            i = cold_left.pop(rng.randrange(len(cold_left)))
        prompts.append(f"{_document(i, words, seed)}Question {n}: summarise it.")
    return Load("hot_cold", prompts, f"{hot} hot documents ({hot_share:.0%} of {requests} requests) among {cold} cold")


def overflow(
    factor: float, cache_words: int, replicas: int = 2, asks: int = 4, words: int = 330, seed: int = 5000
) -> Load:
    """Distinct documents whose words are `factor` x what the replicas' caches hold together, each asked `asks` times
    (spread over the run)."""
    docs = max(2, round(factor * cache_words * replicas / words))
    prompts = [f"{_document(i, words, seed)}Question {q}: and then?" for i in range(docs) for q in range(asks)]
    random.Random(seed).shuffle(prompts)
    return Load(
        f"overflow{factor:g}x",
        prompts,
        f"{docs} documents of {words} words x {asks} asks = {factor:g}x the {replicas} replicas' caches",
    )


def make(name: str, cache_words: int = 1900, replicas: int = 2, seed: int = 0) -> Load:
    """A load by name, sized for `replicas` caches of `cache_words` each (bench/routing.py's CPU default: 2,816
    tokens ≈ 1,900 words); `seed` draws another load of the same shape."""
    if name.startswith("overflow"):
        factor = float(name.removeprefix("overflow").removesuffix("x"))
        return overflow(factor, cache_words, replicas, seed=5000 + 100 * factor + 7 * seed)
    makers = {"shared": shared, "multi_turn": multi_turn, "preambles": preambles, "hot_cold": hot_cold}
    base = {"shared": 1000, "multi_turn": 2000, "preambles": 3000, "hot_cold": 4000}
    return makers[name](seed=base[name] + 7 * seed)


# --- the replay ---------------------------------------------------------------------------------------------------


def words_as_tokens(prompt: str) -> list[int]:
    """A stand-in tokenizer: a word is a token (its id from a stable hash of the word)."""
    return [int.from_bytes(w.encode()[:7].ljust(7, b"\0"), "little") for w in prompt.split()]


@dataclass
class Replica:
    """One engine's prefix cache as blocks in LRU order, and the index its KV events feed (kv_blocks.ReplicaBlocks)."""

    capacity: int
    blocks: OrderedDict = field(default_factory=OrderedDict)  # content hash -> engine hash
    index: ReplicaBlocks = field(default_factory=ReplicaBlocks)
    view: BlockView = field(default_factory=BlockView)

    def serve(self, tokens: list[int], hashes: list[int], block_size: int) -> int:
        """Run a prompt: the leading blocks it finds cached (vLLM reuses a prefix only), then all of its blocks
        cached, the least recently used ones evicted past `capacity` (a request's tail before its head, as vLLM's
        free queue orders them); the KV events reach the index."""
        hit = 0
        for h in hashes:
            if h not in self.blocks:
                break
            hit += 1
        for i, h in enumerate(hashes):
            if h in self.blocks:
                continue
            self.blocks[h] = h  # a block vLLM computed: announced with its parent (the engine hash is its content's)
            self.index.apply(
                {
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": hashes[i - 1] if i else None,
                    "token_ids": tokens[i * block_size : (i + 1) * block_size],
                    "block_size": block_size,
                }
            )
        # vLLM frees a request's blocks tail first: its leading blocks are the last to be evicted
        for h in reversed(hashes):
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            self.index.apply({"type": "BlockRemoved", "block_hashes": evicted})
        self.view.update(self.index.changes(self.view.epoch, self.view.seq))
        return hit


def replay(
    load: Load,
    policy: str,
    replicas: int = 2,
    cache_words: int = 1900,
    block_size: int = 16,
    concurrency: int = 8,
    seed: int = 0,
    prefix_chars: int = routing.DEFAULT_PREFIX_CHARS,
    index: Callable[[Replica], BlockView] | None = None,
    load_cost_tokens: int = DEFAULT_LOAD_COST_TOKENS,
) -> dict:
    """`load` through `policy`'s decision: each request stays ongoing on its replica until `concurrency` later ones
    arrived (Serve's queue lengths are the loads). Returns the prefix-cache hit rate (blocks found / blocks asked)
    and the requests per replica. `index` swaps what kv_cache reads (a check switches it off); `load_cost_tokens` as
    the YAML's `routing.load_cost_tokens`."""
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(replicas)]
    caches = {r: Replica(cache_words // block_size) for r in names}
    table = routing.AffinityTable()
    ongoing: list[str] = []
    asked = hit = 0
    per_replica = dict.fromkeys(names, 0)
    for prompt in load.prompts:
        loads = {r: ongoing.count(r) for r in names}
        tokens = words_as_tokens(prompt)
        hashes = chain(tokens, block_size)
        if policy == "least_load":
            chosen = routing.power_of_two(loads, rng)
        elif policy == "prefix_affinity":
            key = routing.prefix_key({"prompt": prompt}, prefix_chars)
            chosen = routing.prefix_affinity(table, key, loads) if key else routing.power_of_two(loads, rng)
        else:
            held = {r: (index or (lambda c: c.view))(caches[r]).held(hashes) for r in names}
            tie = hashes[0] if hashes else None
            cost = load_cost_tokens / block_size
            chosen, _, _ = choose(held, loads, routing.DEFAULT_IMBALANCE, rng, tie=tie, load_cost=cost)
        hit += caches[chosen].serve(tokens, hashes, block_size)
        asked += len(hashes)
        per_replica[chosen] += 1
        ongoing = (ongoing + [chosen])[-concurrency:]
    return {"hit_rate": hit / asked if asked else 0.0, "requests_per_replica": sorted(per_replica.values())}


def replayed(name: str, policy: str, seeds: int = 5, **kwargs) -> float:
    """The mean replayed hit rate of `seeds` draws of load `name` through `policy`."""
    return sum(replay(make(name, seed=seed), policy, **kwargs)["hit_rate"] for seed in range(seeds)) / seeds


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5, help="draws of each load (the mean is printed)")
    p.add_argument("--load-cost-tokens", type=int, default=DEFAULT_LOAD_COST_TOKENS, help="kv_cache's (YAML key)")
    p.add_argument("--block-size", type=int, default=16, help="tokens (words) per KV block: vLLM's 16 on GPU")
    p.add_argument("--json", help="also write the rows here (peer = policy, load, hit_rate)")
    ns = p.parse_args()
    print(f"{'load':<12}{''.join(f'{p:>17}' for p in POLICIES)}   (replayed prefix-cache hit rate, {ns.seeds} draws)")
    rows = []
    for name in LOADS:
        rates = [
            replayed(name, policy, ns.seeds, block_size=ns.block_size, load_cost_tokens=ns.load_cost_tokens)
            for policy in POLICIES
        ]
        print(f"{name:<12}" + "".join(f"{r:>17.1%}" for r in rates) + f"   {make(name).about}")
        rows += [{"peer": p, "policy": p, "load": name, "hit_rate": round(r, 4)} for p, r in zip(POLICIES, rates)]
    if ns.json:
        args = {**vars(ns), "replicas": 2, "cache_words": 1900, "concurrency": 8}
        Path(ns.json).write_text(json.dumps({"args": args, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
