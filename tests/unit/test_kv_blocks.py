"""`deployments/routing/kv_blocks.py`: the content index built from vLLM-shaped KV events (plain dicts, as the replica's
feed decodes them), the change log a router follows, and the kv_cache decision. The same index on a real engine's
events: tests/cpu/test_kv_events.py."""

from __future__ import annotations

import random

from deployments.routing.kv_blocks import CPU, GPU, BlockView, ReplicaBlocks, chain, choose

BS = 4


def stored(tokens, engine_hashes, parent=None, lora=None, medium=None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": engine_hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_name": lora,
        "medium": medium,
    }


def test_stored_blocks_are_named_by_content_whatever_the_engines_hashes():
    tokens = list(range(10))  # two full blocks and a partial one
    one, other = ReplicaBlocks(), ReplicaBlocks()
    one.apply(stored(tokens[:8], [b"a1", b"a2"]))
    other.apply(stored(tokens[:4], [11]))  # another engine's hashes (its own seed), the blocks in two steps
    other.apply(stored(tokens[4:8], [12], parent=11))
    view_one, view_other = BlockView(), BlockView()
    view_one.update(one.changes(None, 0))
    view_other.update(other.changes(None, 0))
    names = chain(tokens, BS)
    assert len(names) == 2
    assert view_one.held(names) == view_other.held(names) == 2
    assert view_one.held(chain([0, 1, 2, 99, 4, 5, 6, 7], BS)) == 0  # a different first block: nothing reused
    assert view_one.held(chain(tokens, BS, lora="sql")) == 0  # an adapter's blocks are its own


def test_removed_and_cleared_blocks_leave_the_followers_view():
    blocks, view = ReplicaBlocks(), BlockView()
    blocks.apply(stored(list(range(12)), [1, 2, 3]))
    view.update(blocks.changes(None, 0))
    names = chain(list(range(12)), BS)
    assert view.held(names) == 3
    blocks.apply({"type": "BlockRemoved", "block_hashes": [2], "medium": GPU})
    view.update(blocks.changes(view.epoch, view.seq))
    assert view.held(names) == 1  # the run stops at the removed block
    blocks.apply({"type": "AllBlocksCleared"})
    reply = blocks.changes(view.epoch, view.seq)
    assert not reply["reset"]  # the clearing reaches a current follower as changes
    view.update(reply)
    assert len(view) == 0 and len(blocks) == 0


def test_a_block_offloaded_to_cpu_counts_part_until_it_leaves_both_tiers():
    blocks, view = ReplicaBlocks(), BlockView()
    names = chain(list(range(8)), BS)
    blocks.apply(stored(list(range(8)), [1, 2]))
    blocks.apply(stored(list(range(8)), [1, 2], medium=CPU))
    blocks.apply({"type": "BlockRemoved", "block_hashes": [2], "medium": GPU})
    view.update(blocks.changes(None, 0))
    assert view.held(names, cpu_credit=0.5) == 1.5
    assert view.offloaded(names) == 1  # what summit_routing_offload_blocks counts for a decision on it
    blocks.apply({"type": "BlockRemoved", "block_hashes": [2], "medium": CPU})
    view.update(blocks.changes(view.epoch, view.seq))
    assert view.held(names) == 1.0 and view.offloaded(names) == 0


def test_a_block_whose_parent_was_missed_is_not_indexed():
    blocks = ReplicaBlocks()
    blocks.apply(stored(list(range(4, 8)), [12], parent=11))
    assert len(blocks) == 0 and blocks.unchained == 1


def test_the_index_is_bounded_and_a_follower_behind_the_log_gets_a_snapshot():
    blocks = ReplicaBlocks(max_blocks=5, log_entries=8)
    view = BlockView()
    view.update(blocks.changes(None, 0))
    for i in range(10):  # ten unrelated one-block prompts
        blocks.apply(stored([i, i, i, i], [100 + i]))
    assert len(blocks) == 5
    reply = blocks.changes(view.epoch, view.seq)
    assert reply["reset"]  # the log no longer reaches back to the follower's cursor
    view.update(reply)
    newest = [chain([i] * 4, BS) for i in range(10)]
    assert [view.held(n) for n in newest] == [0] * 5 + [1] * 5
    other = ReplicaBlocks()
    assert other.changes(view.epoch, view.seq)["reset"]  # a restarted replica's index: another epoch


def test_choose_prefers_the_longest_cached_prefix_within_the_imbalance():
    rng = random.Random(0)
    loads = {"a": 0, "b": 0, "c": 0}
    assert choose({"a": 3, "b": 5}, loads, 8, rng)[:2] == ("b", "hit")
    busy = {"a": 0, "b": 9, "c": 0}
    assert choose({"a": 3, "b": 5}, busy, 8, rng)[:2] == ("a", "spill")  # b is 9 > 8 above the least loaded
    assert choose({"b": 5}, busy, 8, rng)[:2] in {("a", "spill"), ("c", "spill")}
    assert choose({}, {"a": 2, "b": 1, "c": 1}, 8, rng)[1] == "new"
    assert {choose({}, {"a": 2, "b": 1, "c": 1}, 8, rng)[0] for _ in range(20)} == {"b", "c"}  # least loaded
    assert choose({"a": 2, "b": 2}, {"a": 3, "b": 1, "c": 0}, 8, rng)[:2] == ("b", "hit")  # a tie: less loaded


def test_choose_weighs_a_replicas_extra_blocks_against_its_extra_load():
    """With a load cost (blocks per ongoing request above the least loaded), a replica holding only a little more
    (a chat's last turn beyond the shared system prompt both hold) loses the request to an idle one; a replica holding
    a whole document more keeps it; the imbalance stays the bound. Without the cost (0) the most-holding replica
    within the imbalance wins each time."""
    rng = random.Random(0)
    a_busy = {"a": 3, "b": 0}
    assert choose({"a": 22, "b": 20}, a_busy, 8, rng, load_cost=1.0)[:2] == ("b", "spill")  # 22 - 3 < 20
    assert choose({"a": 22, "b": 20}, a_busy, 8, rng, load_cost=0.0)[:2] == ("a", "hit")
    assert choose({"a": 40, "b": 0}, {"a": 5, "b": 0}, 8, rng, load_cost=1.0)[:2] == ("a", "hit")  # 40 - 5 > 0
    assert choose({"a": 40, "b": 0}, {"a": 9, "b": 0}, 8, rng, load_cost=1.0)[:2] == ("b", "spill")  # past 8
    assert choose({"a": 23, "b": 20}, {"a": 2, "b": 0}, 8, rng, load_cost=1.0)[:2] == ("a", "hit")  # 23 - 2 > 20


def test_an_offload_tiers_repeated_announcements_are_counted():
    """vLLM's offloading connector announces a block once per chunk holding it and removes it as often."""
    blocks, view = ReplicaBlocks(), BlockView()
    names = chain(list(range(4)), BS)
    blocks.apply(stored(list(range(4)), [1], medium=CPU))
    blocks.apply(stored(list(range(4)), [1], medium=CPU))
    blocks.apply({"type": "BlockRemoved", "block_hashes": [1], "medium": CPU})
    view.update(blocks.changes(None, 0))
    assert view.held(names, cpu_credit=0.5) == 0.5  # one announcement left
    blocks.apply({"type": "BlockRemoved", "block_hashes": [1], "medium": CPU})
    view.update(blocks.changes(view.epoch, view.seq))
    assert view.held(names) == 0


def test_a_kv_claim_holds_within_its_window_and_lapses_after_it():
    """Between a decision and its engine's KV events, the chosen replica counts as holding the request's blocks for
    `claim_s` (a burst of one new prefix is not spread), and not after: observed inside and past the window on the
    policy's own clock. The case where claim and fallback disagree: the claimed replica is the one the first block's
    hash does not pick between two idle replicas."""
    import random

    from deployments.routing.kv_policy import KVCachePolicy

    now = [100.0]
    policy = KVCachePolicy()
    policy.clock = lambda: now[0]
    hashes, loads = [11, 12, 13], {"r1": 0, "r2": 0}
    by_hash, _ = policy.decide(hashes, loads, random.Random(0), {}, 16)
    other = "r2" if by_hash == "r1" else "r1"
    policy.claim(hashes, other)
    now[0] += policy.claim_s - 0.5
    assert policy.decide(hashes, loads, random.Random(0), {}, 16)[0] == other  # inside the window: the claim
    now[0] += 1.0
    assert policy.decide(hashes, loads, random.Random(0), {}, 16)[0] == by_hash  # past it: the hash again
