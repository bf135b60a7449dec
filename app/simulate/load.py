"""The traffic `summit simulate --load LOAD.yaml` runs: who asks what, and when.

```yaml
shape: multi_turn          # independent | shared_prefix | multi_turn | documents
rate_per_s: 20             # Poisson arrivals (open loop) ...
# concurrency: 8           # ... or N clients, each sending its next request when its last one ended (closed loop)
duration_s: 600            # arrivals stop then (open loop)
requests: 2000             # or a fixed number of requests
spike: {at_s: 120, factor: 10, for_s: 60}   # the rate x factor for a while (open loop)
prompt_tokens: 512         # the part of each prompt of its own (mean; lognormal, sigma 0.4)
output_tokens: 128         # (mean; lognormal, sigma 0.4)
prefixes: 8                # shared_prefix: system prompts of prefix_tokens each
prefix_tokens: 1000
chats: 64                  # multi_turn: chats of `turns` turns under one system prompt of prefix_tokens
turns: 6
documents: 200             # documents: `hot` of them asked hot_share of the time, the rest once each
hot: 4
hot_share: 0.8
seed: 0
```
Tokens are integers (a word each in the prompt's text, which prefix_affinity keys on: SimRequest.prompt_text).
bench/simulate_accuracy.py builds requests from bench/routing.py's prompts instead, tokenized as the engines did.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.simulate.engine import SimRequest
from deployments.routing import kv_blocks


class Spike(BaseModel):
    model_config = ConfigDict(extra="forbid")
    at_s: float = Field(ge=0)
    factor: float = Field(gt=0)
    for_s: float = Field(gt=0)


class LoadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shape: str = "independent"
    rate_per_s: float | None = Field(None, gt=0)
    concurrency: int | None = Field(None, ge=1)
    duration_s: float | None = Field(None, gt=0)
    requests: int | None = Field(None, ge=1)
    spike: Spike | None = None
    prompt_tokens: int = Field(512, ge=1)
    output_tokens: int = Field(128, ge=1)
    sigma: float = Field(0.4, ge=0)
    prefixes: int = Field(8, ge=1)
    prefix_tokens: int = Field(1000, ge=0)
    chats: int = Field(64, ge=1)
    turns: int = Field(6, ge=1)
    documents: int = Field(200, ge=1)
    hot: int = Field(4, ge=0)
    hot_share: float = Field(0.8, ge=0, le=1)
    seed: int = 0

    @model_validator(mode="after")
    def _one_mode(self) -> LoadSpec:
        if (self.rate_per_s is None) == (self.concurrency is None):
            raise ValueError("give exactly one of `rate_per_s` (open loop) or `concurrency` (closed loop)")
        if self.rate_per_s is not None and self.duration_s is None and self.requests is None:
            raise ValueError("an open-loop load needs `duration_s` or `requests`")
        kinds = ("independent", "shared_prefix", "multi_turn", "documents")
        if self.shape not in kinds:
            raise ValueError(f"shape {self.shape!r}: one of {', '.join(kinds)}")
        return self

    @classmethod
    def load(cls, path: str | Path) -> LoadSpec:
        try:
            return cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _length(rng: random.Random, mean: int, sigma: float) -> int:
    if sigma == 0:
        return mean
    mu = math.log(mean) - sigma**2 / 2
    return max(1, round(rng.lognormvariate(mu, sigma)))


_VOCAB = list(range(1_000_000))  # one int object a word, shared by every prompt that has it (8 bytes a token)


def _words(rng: random.Random, n: int) -> list[int]:
    return rng.choices(_VOCAB, k=n)


def prompts(spec: LoadSpec, count: int, block_size: int | None = None) -> list[tuple]:
    """`count` prompts of the load's shape, in arrival order: (tokens, session, block chain or None)."""
    rng = random.Random(spec.seed)
    own = lambda: _words(rng, _length(rng, spec.prompt_tokens, spec.sigma))  # noqa: E731
    if spec.shape == "independent":
        return [(own(), None, None) for _ in range(count)]
    if spec.shape == "shared_prefix":
        heads = [_words(random.Random(spec.seed * 7919 + i), spec.prefix_tokens) for i in range(spec.prefixes)]
        return [(heads[rng.randrange(spec.prefixes)] + own(), None, None) for _ in range(count)]
    if spec.shape == "multi_turn":
        return _multi_turn(spec, rng, count, block_size)
    hot = [
        _words(random.Random(spec.seed * 104729 + i), spec.prefix_tokens or spec.prompt_tokens) for i in range(spec.hot)
    ]
    out = []
    for n in range(count):
        if hot and rng.random() < spec.hot_share:
            doc = hot[rng.randrange(len(hot))]
        else:
            doc = _words(random.Random(spec.seed * 15485863 + n), spec.prefix_tokens or spec.prompt_tokens)
        out.append((doc + _words(rng, 16), None, None))
    return out


def _multi_turn(spec: LoadSpec, rng: random.Random, count: int, block_size: int | None = None) -> list[tuple]:
    """Chats under one system prompt: each turn's prompt is the chat so far. With `block_size`, each prompt's block
    chain (deployments/routing/kv_blocks.chain) is kept per chat and extended by the turn's new blocks, as the
    router would compute it for the whole prompt (a chat's history is hashed once, not again every turn)."""
    system = _words(random.Random(spec.seed * 31), spec.prefix_tokens)
    history: dict[int, list[int]] = {}
    hashes: dict[int, list[int]] = {}
    turns: dict[int, int] = {}
    open_chats: list[int] = []
    next_chat, out = 0, []
    while len(out) < count:
        if not open_chats or (next_chat < spec.chats and rng.random() < 0.3):
            history[next_chat], hashes[next_chat], turns[next_chat] = list(system), [], 0
            open_chats.append(next_chat)
            next_chat += 1  # past `chats` only when every chat has had its turns and more requests are asked
        i = rng.randrange(len(open_chats))
        c = open_chats[i]
        history[c] += _words(rng, _length(rng, spec.prompt_tokens, spec.sigma))
        if block_size:
            _extend_chain(hashes[c], history[c], block_size)
        out.append((list(history[c]), f"chat-{c}", list(hashes[c]) if block_size else None))
        history[c] += _words(rng, _length(rng, spec.output_tokens, spec.sigma))  # the answer, in the next turn
        turns[c] += 1
        if turns[c] >= spec.turns:
            open_chats[i] = open_chats[-1]
            open_chats.pop()
            del history[c], hashes[c]
    return out


def _extend_chain(hashes: list[int], tokens: list[int], block_size: int) -> None:
    parent = hashes[-1] if hashes else kv_blocks.root(None)
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = kv_blocks.link(parent, tokens[start : start + block_size])
        hashes.append(parent)


def requests(spec: LoadSpec, block_size: int | None = None) -> tuple[list[SimRequest], int | None]:
    """The load's requests with their arrival times (open loop), or arrivals at 0 and the clients' count (closed
    loop: the simulation sends each client's next request when its last one ended). `block_size`: the engines'
    (multi_turn prompts then carry their block chain)."""
    rng = random.Random(spec.seed + 1)
    count = spec.requests or _open_loop_count(spec)
    made = prompts(spec, count, block_size)
    out = []
    t = 0.0
    for i, (tokens, session, chain) in enumerate(made):
        if spec.rate_per_s is not None:
            t += rng.expovariate(_rate(spec, t))
            if spec.duration_s is not None and t > spec.duration_s:
                break
        out.append(
            SimRequest(
                i,
                tokens,
                _length(rng, spec.output_tokens, spec.sigma),
                t if spec.rate_per_s else 0.0,
                "",
                session,
                hashes=chain or [],
            )
        )
    return out, spec.concurrency


def _rate(spec: LoadSpec, t: float) -> float:
    s = spec.spike
    if s is not None and s.at_s <= t < s.at_s + s.for_s:
        return spec.rate_per_s * s.factor
    return spec.rate_per_s


def _open_loop_count(spec: LoadSpec) -> int:
    peak = spec.rate_per_s * (spec.spike.factor if spec.spike else 1)
    return int(peak * spec.duration_s * 1.2) + 16
