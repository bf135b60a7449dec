"""Routing decisions (deployments/routing/policies.py), driven without Ray: keys, least-load, prefix and session
affinity."""

from __future__ import annotations

import random

import pytest

from deployments.routing.policies import (
    AffinityTable,
    least_loaded,
    power_of_two,
    prefix_affinity,
    prefix_key,
    request_body,
    session_affinity,
    session_key,
)

BLOCK = 64


def chat(system: str, question: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def system_prompt(i: int) -> str:
    return f"You are assistant number {i}. " * 10  # longer than BLOCK


# --- request keys ---------------------------------------------------------------------------------


def test_session_key_prefers_header_then_serve_session_id_then_user_field():
    body = {"user": "alice"}
    assert session_key(body, [(b"X-Session-Id", b"s1")], "s2") == session_key(None, [(b"x-session-id", b"s1")])
    assert session_key(body, [], "s1") == session_key(None, [(b"x-session-id", b"s1")])
    assert session_key(body, []) == "user:alice"
    assert session_key({"user": ""}, [(b"x-session-id", b"  ")]) is None
    assert session_key(None, []) is None


def test_prefix_key_shared_by_requests_with_the_same_leading_block():
    a, b = prefix_key(chat(system_prompt(1), "q1"), BLOCK), prefix_key(chat(system_prompt(1), "q2"), BLOCK)
    assert a is not None and a == b
    assert prefix_key(chat(system_prompt(2), "q1"), BLOCK) != a


def test_prefix_key_for_completion_prompts():
    text = "x" * BLOCK
    assert prefix_key({"prompt": text + "tail"}, BLOCK) == prefix_key({"prompt": [text + "other"]}, BLOCK)
    ids = list(range(BLOCK // 4))
    assert prefix_key({"prompt": ids + [1]}, BLOCK) == prefix_key({"prompt": [ids + [2, 3]]}, BLOCK) is not None
    # The same characters as a chat message are a different prompt once the chat template is applied.
    assert prefix_key({"messages": [{"role": "user", "content": text}]}, BLOCK) != prefix_key({"prompt": text}, BLOCK)


def test_short_or_missing_prompt_has_no_prefix_key():
    assert prefix_key({"prompt": "short"}, BLOCK) is None
    assert prefix_key({"prompt": [1, 2, 3]}, BLOCK) is None
    assert prefix_key(chat("hi", "there"), BLOCK) is None
    assert prefix_key({"model": "m"}, BLOCK) is None
    assert prefix_key(None, BLOCK) is None


def test_chat_content_parts_count_as_text():
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * BLOCK}]}]}
    plain = {"messages": [{"role": "user", "content": "y" * BLOCK}]}
    assert prefix_key(parts, BLOCK) == prefix_key(plain, BLOCK) is not None


def test_request_body_accepts_only_json_objects():
    assert request_body(b'{"a": 1}') == {"a": 1}
    assert request_body(b"") is None and request_body(b"[1]") is None and request_body(b"{nope") is None


# --- load -----------------------------------------------------------------------------------------


def test_power_of_two_picks_the_less_loaded_of_two():
    assert power_of_two({"a": 5, "b": 1}, random.Random(0)) == "b"
    assert power_of_two({"a": 0, "b": 9}, random.Random(1)) == "a"
    assert power_of_two({"only": 3}, random.Random(0)) == "only"


def test_power_of_two_is_deterministic_with_an_rng_and_never_picks_the_most_loaded_of_three():
    loads = {"a": 0, "b": 4, "c": 9}
    picks = [power_of_two(loads, random.Random(seed)) for seed in range(50)]
    assert picks == [power_of_two(loads, random.Random(seed)) for seed in range(50)]
    assert "c" not in picks and {"a", "b"} <= set(picks)


def test_least_loaded_breaks_ties_by_fewest_owned_keys():
    assert least_loaded({"a": 3, "b": 1}) == "b"
    assert least_loaded({"a": 0, "b": 0}, owned={"a": 2, "b": 1}) == "b"
    with pytest.raises(ValueError):
        least_loaded({})


# --- prefix affinity --------------------------------------------------------------------------------


def test_distinct_prefixes_spread_and_each_prefix_repeats_on_one_replica():
    table, loads = AffinityTable(), {"r1": 0, "r2": 0}
    keys = [prefix_key(chat(system_prompt(i), "q"), BLOCK) for i in range(8)]
    served: dict[str, set[str]] = {k: set() for k in keys}
    for question in range(5):
        for key in keys:
            served[key].add(prefix_affinity(table, key, loads))
    assert all(len(replicas) == 1 for replicas in served.values())
    owners = [next(iter(r)) for r in served.values()]
    assert owners.count("r1") == owners.count("r2") == 4


def test_prefix_moves_only_when_its_replica_is_overloaded_past_the_imbalance():
    table = AffinityTable()
    assert prefix_affinity(table, "p", {"r1": 0, "r2": 0}, imbalance=8) == "r1"
    assert prefix_affinity(table, "p", {"r1": 8, "r2": 0}, imbalance=8) == "r1"  # at the threshold: stays
    assert prefix_affinity(table, "p", {"r1": 9, "r2": 0}, imbalance=8) == "r2"  # past it: moves
    assert prefix_affinity(table, "p", {"r1": 0, "r2": 3}, imbalance=8) == "r2"  # and is remembered there


def test_prefix_of_a_removed_replica_is_repicked():
    table = AffinityTable()
    first = prefix_affinity(table, "p", {"r1": 0, "r2": 0})
    other = {"r1": "r2", "r2": "r1"}[first]
    assert prefix_affinity(table, "p", {other: 5, "r3": 0}) == "r3"
    assert table.owner("p") == "r3"


def test_affinity_table_is_bounded_lru():
    table = AffinityTable(max_keys=2)
    table.assign("a", "r1")
    table.assign("b", "r2")
    table.owner("a")  # touch: b is now the oldest
    table.assign("c", "r1")
    assert table.owner("b") is None and table.owner("a") == "r1" and len(table) == 2
    assert table.owned() == {"r1": 2, "r2": 0}


# --- session affinity -------------------------------------------------------------------------------


def test_session_sticks_whatever_the_load():
    table = AffinityTable()
    first = session_affinity(table, "s", {"r1": 0, "r2": 0})
    assert all(session_affinity(table, "s", {"r1": 50, "r2": 50, first: 90}) == first for _ in range(5))


def test_sessions_of_a_removed_replica_move_and_stay_on_the_new_one():
    table, loads = AffinityTable(), {"r1": 0, "r2": 0, "r3": 0}
    homes = {s: session_affinity(table, s, loads) for s in (f"s{i}" for i in range(9))}
    assert set(homes.values()) == {"r1", "r2", "r3"}
    gone = "r2"
    table.forget_replicas(["r1", "r3"])
    after = {"r1": 4, "r3": 1}
    for s, home in homes.items():
        moved = session_affinity(table, s, after)
        assert moved == home if home != gone else moved in after
        assert session_affinity(table, s, after) == moved  # remembered where it moved
    assert all(session_affinity(table, s, after) == h for s, h in homes.items() if h != gone)


def test_new_sessions_go_to_the_least_loaded_replica():
    assert session_affinity(AffinityTable(), "s", {"r1": 7, "r2": 2}) == "r2"
