"""The routing benchmark's loads replayed through Summit's own decisions (bench/routing_loads.py: kv_blocks.choose on
indexes fed by modelled KV events, policies.prefix_affinity, power-of-two), each replica's prefix cache an LRU of
blocks. Decisions and cache hits only: no engine, no timing. The figures are the mean of 3 draws of each load."""

from __future__ import annotations

import pytest

from bench import routing_loads as rl
from deployments.routing import policies as routing
from deployments.routing.kv_blocks import BlockView

DRAWS = 3


def rate(load: str, policy: str, **kwargs) -> float:
    return rl.replayed(load, policy, DRAWS, **kwargs)


def test_each_load_is_what_it_says():
    """Character keys cannot tell multi-turn chats or shared-head preambles apart (one prefix key for the whole load);
    each chat's next turn extends its last; the overflow loads hold 2x and 6x what the caches hold."""
    for name in ("multi_turn", "preambles"):
        keys = {routing.prefix_key({"prompt": p}) for p in rl.make(name).prompts}
        assert len(keys) == 1 and None not in keys, name
    turns = rl.make("multi_turn").prompts
    chat0 = [p for p in turns if "Chat 0 asks" in p]
    assert all(later.startswith(earlier) for earlier, later in zip(chat0, chat0[1:])) and len(chat0) == 6
    for factor in (2, 6):
        words = sum(len(p.split()) for p in set(p.split("Question")[0] for p in rl.make(f"overflow{factor}x").prompts))
        assert factor * 2 * 1900 * 0.9 <= words <= factor * 2 * 1900 * 1.1, (factor, words)


@pytest.mark.parametrize("load", ["multi_turn", "preambles"])
def test_kv_cache_beats_character_keys_where_they_cannot_follow(load):
    """kv_cache's load cost lets a chat or a team's prompt leave the replica that holds only the shared head for an
    idle one, and come back by its own blocks: more of the prompts' blocks hit than under prefix_affinity, which sends
    the whole load to the head's replica. With the load cost off (`load_cost_tokens: 0`, the old decision) kv_cache
    does no better than prefix_affinity: the gain is the load cost's."""
    affinity, kv = rate(load, "prefix_affinity"), rate(load, "kv_cache")
    assert kv >= affinity + 0.04, (load, kv, affinity)
    assert rate(load, "kv_cache", load_cost_tokens=0) <= affinity + 0.01


@pytest.mark.parametrize("load", ["shared", "hot_cold", "overflow2x", "overflow6x"])
def test_kv_cache_keeps_prefix_affinitys_hits_on_the_other_loads(load):
    """Where the first block names the prompt, kv_cache is within a point of prefix_affinity, and both at least 5
    points above power-of-two (which ignores the caches: the control that the load rewards routing at all)."""
    affinity, kv, p2c = rate(load, "prefix_affinity"), rate(load, "kv_cache"), rate(load, "least_load")
    assert kv >= affinity - 0.01, (load, kv, affinity)
    assert min(kv, affinity) > p2c + 0.05, (load, kv, affinity, p2c)


def test_kv_cache_decides_by_the_engines_blocks():
    """With its index switched off (an empty view of every replica) kv_cache falls back to load and the first block's
    hash, and loses most of its hits on shared system prompts."""
    kv = rate("shared", "kv_cache")
    blind = rate("shared", "kv_cache", index=lambda replica: BlockView())
    assert blind < kv - 0.15, (kv, blind)
