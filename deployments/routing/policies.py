"""Pure routing decisions for one model's replicas: request keys, least-load, prefix and session affinity.

No Ray and no vLLM here: `deployments/routing/routers.py` turns Serve's replicas and queue lengths into the plain
values these functions take (replica ids as strings, `loads` = ongoing requests per replica) and turns
the answer back into Serve's ranked replica lists.

Prefix keys are computed on characters, not tokens: the router runs in the ingress process and has no
tokenizer. A block of `prefix_chars` characters stands in for its tokens (roughly 4 characters per token
in English BPE vocabularies). vLLM caches whole KV blocks only — 16 tokens per block on GPU, 128 on CPU —
so the block must cover at least one KV block (≥ 128 tokens ≈ 512 characters on CPU) for affinity to
pay; the default 1024 characters (≈ 256 tokens) covers two CPU blocks or sixteen GPU blocks. Requests
shorter than one block get no prefix key and are routed by load alone.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

SESSION_HEADER = "x-session-id"  # the header Serve's own ConsistentHashRouter reads by default
DEFAULT_PREFIX_CHARS = 1024
DEFAULT_IMBALANCE = 8
DEFAULT_MAX_TRACKED = 100_000
# Token-id prompts are already tokens: take as many ids as the character block stands for.
CHARS_PER_TOKEN = 4

Loads = Mapping[str, int]  # replica id → ongoing requests (Serve's queue length)


def request_body(raw: bytes) -> dict[str, Any] | None:
    """The request's JSON object, or None when the body is empty, not JSON or not an object."""
    if not raw:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def session_key(
    body: Mapping[str, Any] | None,
    headers: Iterable[tuple[bytes, bytes]],
    session_id: str = "",
    header: str = SESSION_HEADER,
) -> str | None:
    """The `x-session-id` header, else a session id the caller gave Serve (`handle.options(session_id=...)`),
    else the body's OpenAI `user` field; None when none is given."""
    wanted = header.lower().encode()
    for name, value in headers:
        if name.lower() == wanted and value.strip():
            return "session:" + value.decode("latin-1").strip()
    if session_id:
        return "session:" + session_id
    user = body.get("user") if body else None
    if isinstance(user, str) and user.strip():
        return "user:" + user.strip()
    return None


def prefix_key(body: Mapping[str, Any] | None, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """A hash of the prompt's leading block, or None when the prompt is shorter than one block."""
    if not body:
        return None
    if "messages" in body:
        block = _leading(_chat_pieces(body["messages"]), prefix_chars)
        kind = "chat"  # the chat template makes a chat prompt's tokens differ from the same raw text
    else:
        block, kind = _completion_block(body.get("prompt"), prefix_chars), "completion"
    if block is None:
        return None
    return kind + ":" + hashlib.blake2b(block.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def _completion_block(prompt: Any, prefix_chars: int) -> str | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: they run on one replica, the first one decides
    if isinstance(prompt, str):
        return _leading([prompt], prefix_chars)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        n = max(1, prefix_chars // CHARS_PER_TOKEN)
        return "ids:" + ",".join(map(str, prompt[:n])) if len(prompt) >= n else None
    return None


def _chat_pieces(messages: Any) -> Iterator[str]:
    """Role and content of each message, in order (text parts as text, other parts as their JSON)."""
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, dict):
            continue
        yield f"<{message.get('role')}>"
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                yield text if isinstance(text, str) else json.dumps(part, sort_keys=True)


def _leading(pieces: Iterable[str], n: int) -> str | None:
    """The first n characters of the concatenated pieces; None if there are fewer (read lazily: bodies can be large)."""
    out, size = [], 0
    for piece in pieces:
        out.append(piece)
        size += len(piece)
        if size >= n:
            return "".join(out)[:n]
    return None


def _rendezvous(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


def least_loaded(loads: Loads, owned: Mapping[str, int] | None = None, key: str | None = None) -> str:
    """The replica with the fewest ongoing requests.

    Ties go to the replica owning the fewest affinity keys (so distinct prefixes or sessions spread even
    when sequential traffic leaves every load at 0), then to a hash of the key (so every ingress replica
    makes the same pick for the same key).
    """
    if not loads:
        raise ValueError("no replicas to choose from")
    owned = owned or {}
    return min(sorted(loads), key=lambda r: (loads[r], owned.get(r, 0), _rendezvous(key or "", r)))


def power_of_two(loads: Loads, rng: random.Random) -> str:
    """Serve's default policy as a pure function: sample two replicas, keep the less loaded (first on a tie)."""
    if not loads:
        raise ValueError("no replicas to choose from")
    if len(loads) == 1:
        return next(iter(loads))
    a, b = rng.sample(sorted(loads), 2)
    return b if loads[b] < loads[a] else a


class AffinityTable:
    """Key → replica, least recently used dropped beyond `max_keys`; counts keys per replica for spreading."""

    def __init__(self, max_keys: int = DEFAULT_MAX_TRACKED):
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self._max_keys = max_keys
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._owned: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, key: str) -> str | None:
        replica = self._owner.get(key)
        if replica is not None:
            self._owner.move_to_end(key)
        return replica

    def peek(self, key: str) -> str | None:
        """The key's owner, without marking it recently used."""
        return self._owner.get(key)

    def owned(self) -> Mapping[str, int]:
        return self._owned

    def assign(self, key: str, replica: str) -> None:
        previous = self._owner.pop(key, None)
        if previous is not None:
            self._owned[previous] -= 1
        self._owner[key] = replica
        self._owned[replica] += 1
        while len(self._owner) > self._max_keys:
            _, dropped = self._owner.popitem(last=False)
            self._owned[dropped] -= 1

    def forget_replicas(self, present: Iterable[str]) -> None:
        """Drop the keys of replicas that are gone, so spreading counts only live replicas."""
        present = set(present)
        for key in [k for k, r in self._owner.items() if r not in present]:
            del self._owner[key]
        for replica in [r for r in self._owned if r not in present]:
            del self._owned[replica]


def prefix_affinity(table: AffinityTable, key: str, loads: Loads, imbalance: int = DEFAULT_IMBALANCE) -> str:
    """The replica that served this prefix, unless it has more than `imbalance` ongoing requests above the
    least-loaded one (or is gone); then the least-loaded replica, which becomes the prefix's owner."""
    owner = table.owner(key)
    best = least_loaded(loads, table.owned(), key)
    if owner in loads and loads[owner] - loads[best] <= imbalance:
        return owner
    table.assign(key, best)
    return best


def session_affinity(table: AffinityTable, key: str, loads: Loads) -> str:
    """The session's replica while it is present; a new session, or one whose replica is gone, goes to the
    least-loaded replica and stays there."""
    owner = table.owner(key)
    if owner in loads:
        return owner
    best = least_loaded(loads, table.owned(), key)
    table.assign(key, best)
    return best


def adapter_affinity(
    adapter: str, loads: Loads, holders: set[str], imbalance: int = DEFAULT_IMBALANCE
) -> tuple[str, str]:
    """(replica, outcome) for a LoRA adapter's request: the least-loaded replica that has the adapter loaded (`hit`),
    unless it has more than `imbalance` ongoing requests above the least-loaded replica (`spill`: that one loads it
    too); when none has it, the least-loaded replica (`new`; ties by a hash of the adapter, so that routers agree)."""
    best = least_loaded(loads, key=adapter)
    holding = {r: n for r, n in loads.items() if r in holders}
    if not holding:
        return best, "new"
    owner = least_loaded(holding, key=adapter)
    if holding[owner] - loads[best] <= imbalance:
        return owner, "hit"
    return best, "spill"
