"""The Serve request routers (deployments/routing/routers.py), driven through Serve's own selection path without Ray.

The routers are built the way Serve builds them (constructor, `initialize_state`, `update_replicas`) with
fake replicas that answer queue-length probes; requests go through `_choose_replica_for_request`, the
method Serve's handle awaits, so Serve's ranking, probing and queue-length cache are real.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from ray import serve
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.http.protocol import HTTPRequest
from deployments.routing.router_options import request_router_options
from deployments.routing.routers import (
    ModelPolicyRouter,
    PrefixAffinityRouter,
    SessionAffinityRouter,
)

DEPLOYMENT = DeploymentID(name="LLMServer:fake", app_name="summit")


class FakeReplica:
    """What a router reads from Serve's RunningReplica, with a settable queue length."""

    def __init__(self, unique_id: str, queue_len: int = 0, misses: int = 0):
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)
        self.queue_len = queue_len
        self.misses = misses  # probes it lets pass their deadline before it answers one (at once)
        self.probes = 0
        self.max_ongoing_requests = 100
        self.routing_stats: dict = {}  # what the replica reported (record_routing_stats)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        if self.probes <= self.misses:
            await asyncio.sleep(3600)  # the router's deadline cancels this probe
        return self.queue_len


def make_router(cls, replicas, **kwargs):
    router = cls(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True
    )
    router.initialize_state(**kwargs)
    router.update_replicas(replicas)
    return router


def pending(body: dict | None = None, headers: list | None = None) -> PendingRequest:
    raw = json.dumps(body).encode() if body is not None else b""
    request = HTTPRequest("POST", "/v1/chat/completions", raw, headers=headers or [])
    rid = uuid.uuid4().hex
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid))


async def route(router, request: PendingRequest) -> str:
    replica = await asyncio.wait_for(router._choose_replica_for_request(request), 5)
    return replica.replica_id.unique_id


def set_load(router, replica: FakeReplica, queue_len: int) -> None:
    replica.queue_len = queue_len
    router.on_new_queue_len_info(replica.replica_id, queue_len)


def chat(system: str, question: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_session_sticks_and_moves_when_its_replica_is_removed():
    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = make_router(SessionAffinityRouter, [a, b])
        session = [(b"x-session-id", b"conversation-1")]
        home = await route(router, pending({"messages": []}, session))
        for load in (0, 30, 60):
            set_load(router, {"a": a, "b": b}[home], load)
            assert await route(router, pending({"messages": []}, session)) == home
        survivor = b if home == "a" else a
        router.update_replicas([survivor])
        assert await route(router, pending({"messages": []}, session)) == survivor.replica_id.unique_id
        router.update_replicas([a, b])  # the old replica (or a new one) comes back: the session stays put
        assert await route(router, pending({"messages": []}, session)) == survivor.replica_id.unique_id

    asyncio.run(scenario())


def test_session_from_user_field_and_keyless_requests_use_load():
    async def scenario():
        a, b = FakeReplica("a", 0), FakeReplica("b", 50)
        router = make_router(SessionAffinityRouter, [a, b])
        assert {await route(router, pending({"user": "alice"})) for _ in range(4)} == {"a"}
        # Without a session every request goes to the less loaded replica (power of two over 2 replicas).
        assert {await route(router, pending({"messages": []})) for _ in range(6)} == {"a"}

    asyncio.run(scenario())


def test_prefixes_spread_repeat_on_one_replica_and_move_when_hot():
    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        replicas = {"a": a, "b": b}
        router = make_router(PrefixAffinityRouter, [a, b], prefix_chars=64, imbalance=8)
        systems = [f"System prompt {i}: be brief. " * 4 for i in range(6)]
        owners = [await route(router, pending(chat(s, "q0"))) for s in systems]
        assert owners.count("a") == owners.count("b") == 3
        for question in ("q1", "q2"):
            assert [await route(router, pending(chat(s, question))) for s in systems] == owners
        hot, cold = owners[0], "b" if owners[0] == "a" else "a"
        set_load(router, replicas[hot], 9)  # 9 - 0 > imbalance 8: the prefix moves, and stays moved
        assert await route(router, pending(chat(systems[0], "q3"))) == cold
        set_load(router, replicas[hot], 0)
        assert await route(router, pending(chat(systems[0], "q4"))) == cold

    asyncio.run(scenario())


def test_choose_replicas_ranks_the_choice_first():
    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        prefix = make_router(PrefixAffinityRouter, [a, b], prefix_chars=8)
        ranks = await prefix.choose_replicas(prefix._replicas_list, pending({"prompt": "a long enough prompt"}))
        assert [len(rank) for rank in ranks] == [1, 1]  # the owner, then the others if the owner is full
        session = make_router(SessionAffinityRouter, [a, b])
        ranks = await session.choose_replicas(session._replicas_list, pending({"user": "u"}))
        assert [len(rank) for rank in ranks] == [1]  # a session waits for its own replica

    asyncio.run(scenario())


def test_request_router_options_are_accepted_by_serve():
    assert request_router_options("least_load", prefix_chars=64) == {}
    options = request_router_options("session_affinity", prefix_chars=64, imbalance=2, max_tracked=10)
    assert options["request_router_config"]["request_router_kwargs"] == {"max_tracked": 10}

    class Fake:
        pass

    options = request_router_options("prefix_affinity", prefix_chars=64, imbalance=2)
    config = serve.deployment(Fake).options(**options)._deployment_config.request_router_config
    assert config.request_router_class == "deployments.routing.routers.PrefixAffinityRouter"
    assert config.request_router_kwargs == {"prefix_chars": 64, "imbalance": 2}
    assert config.get_request_router_class().__name__ == "PrefixAffinityRouter"


def test_request_router_options_reject_unknown_names():
    with pytest.raises(ValueError, match="nearest"):
        request_router_options("nearest")
    with pytest.raises(ValueError, match="prefix_tokens"):
        request_router_options("prefix_affinity", prefix_tokens=4)


def test_a_replica_slow_to_answer_the_probe_counts_by_its_load_not_as_full():
    async def scenario():
        busy, slow = FakeReplica("busy", 5), FakeReplica("slow", 0, misses=1)  # misses the first probe's deadline
        router = make_router(PrefixAffinityRouter, [busy, slow], prefix_chars=8, imbalance=2)
        assert await router._loads([busy, slow]) == {"busy": 5, "slow": 0}
        assert slow.probes >= 2  # it missed a deadline, then answered a retry
        slow.misses = 1000  # never answers within the retries: counted full
        router._replica_queue_len_cache.invalidate_key(slow.replica_id)
        assert (await router._loads([slow]))["slow"] == slow.max_ongoing_requests

    asyncio.run(scenario())


def test_several_models_in_one_deployment_get_the_model_policy_router_and_model_stats():
    from deployments.routing.router_options import MODEL_STATS_PERIOD_S, pool_router_options

    options = pool_router_options(
        {"a": {"policy": "least_load", "prefix_chars": 8}, "b": {"policy": "prefix_affinity", "prefix_chars": 8}}
    )
    config = RequestRouterConfig(**options["request_router_config"])
    assert config.get_request_router_class().__name__ == "ModelPolicyRouter"
    assert config.request_router_kwargs == {
        "policies": {"a": {"policy": "least_load"}, "b": {"policy": "prefix_affinity", "prefix_chars": 8}}
    }
    assert config.request_routing_stats_period_s == MODEL_STATS_PERIOD_S
    with pytest.raises(ValueError, match="nearest"):
        pool_router_options({"a": {"policy": "nearest"}})


def test_each_model_of_a_shared_deployment_is_routed_by_its_own_policy():
    """`s` sticks sessions to a replica of its own; `l` (least load) ignores the session; neither leaves its model."""

    async def scenario():
        s1, s2, l1, l2 = (FakeReplica(n) for n in ("s1", "s2", "l1", "l2"))
        for r, model in ((s1, "s"), (s2, "s"), (l1, "l"), (l2, "l")):
            r.routing_stats = {"model": model}
        router = make_router(
            ModelPolicyRouter,
            [s1, s2, l1, l2],
            policies={"s": {"policy": "session_affinity"}, "l": {"policy": "least_load"}},
        )

        def req(model: str, session: str) -> PendingRequest:
            p = pending({"model": model, "prompt": "x"}, headers=[(b"x-session-id", session.encode())])
            p.args[0].model = model
            return p

        sessions = {k: {await route(router, req("s", k)) for _ in range(4)} for k in ("u1", "u2", "u3", "u4")}
        set_load(router, l1, 9)
        least = {await route(router, req("l", "u1")) for _ in range(4)}
        return sessions, least

    sessions, least = asyncio.run(scenario())
    assert all(len(chosen) == 1 and chosen <= {"s1", "s2"} for chosen in sessions.values()), sessions
    assert least == {"l2"}  # the session key means nothing to `l`: by load, among its own replicas


def test_a_sleeping_replica_takes_requests_only_when_the_awake_ones_are_asleep_load_busier():
    """deployment.sleep: a replica that reports its engine asleep counts ASLEEP_LOAD more ongoing requests, so an
    awake one of its model is chosen until that one is that much busier; a call without a request (a probe of every
    replica) goes by load alone."""
    from deployments.routing.routers import ASLEEP_LOAD

    async def scenario():
        awake, asleep = FakeReplica("awake"), FakeReplica("asleep")
        awake.routing_stats, asleep.routing_stats = {"model": "m"}, {"model": "m", "asleep": True}
        router = make_router(ModelPolicyRouter, [awake, asleep], policies={"m": {"policy": "least_load"}})

        def req() -> PendingRequest:
            p = pending({"model": "m", "prompt": "x"})
            p.args[0].model = "m"
            return p

        chosen = {await route(router, req()) for _ in range(6)}
        set_load(router, awake, ASLEEP_LOAD + 1)
        busier = {await route(router, req()) for _ in range(6)}
        set_load(router, awake, 1)
        probes = {
            (await router.choose_replicas(router._replicas_list, None))[0][0].replica_id.unique_id for _ in range(6)
        }
        return chosen, busier, probes

    chosen, busier, probes = asyncio.run(scenario())
    assert chosen == {"awake"} and busier == {"asleep"} and probes == {"asleep"}


def test_a_model_no_replica_serves_goes_to_any_replica_at_once_its_own_models_wait():
    """A name that is none of the deployment's models goes to any replica at once (its front answers the 404);
    a model of the deployment whose replicas are not there waits; with LoRA adapters, an unknown name waits too (an
    adapter loaded at run time reaches the stats later)."""

    async def scenario():
        a1, b1 = FakeReplica("a1"), FakeReplica("b1")
        a1.routing_stats, b1.routing_stats = {"model": "a"}, {"model": "b"}
        policies = {"a": {"policy": "least_load"}, "b": {"policy": "least_load"}, "c": {"policy": "least_load"}}
        router = make_router(ModelPolicyRouter, [a1, b1], policies=policies)

        def req(model: str) -> PendingRequest:
            p = pending({"model": model, "prompt": "x"})
            p.args[0].model = model
            return p

        unknown = await router.choose_replicas([a1, b1], req("nope"))
        starting = await router.choose_replicas([a1, b1], req("c"))
        a1.routing_stats = {"model": "a", "adapters": ["a-sql"], "loaded": []}
        with_lora = await router.choose_replicas([a1, b1], req("nope"))
        return unknown, starting, with_lora

    unknown, starting, with_lora = asyncio.run(scenario())
    assert {r.replica_id.unique_id for rank in unknown for r in rank} == {"a1", "b1"}
    assert starting == [] and with_lora == []


def test_same_model_keeps_a_request_to_its_models_replicas():
    from types import SimpleNamespace

    from deployments.routing.routers import same_model

    a, b, unknown = (SimpleNamespace(routing_stats=s) for s in ({"model": "a"}, {"model": "b"}, {}))
    assert same_model([a, b, unknown], "b") == [b]
    assert same_model([a, b], None) == [a, b]
    assert same_model([a, b], "c") == []
    assert same_model([unknown], "b") == [unknown]  # a one-model deployment reports nothing: every replica


def test_a_lora_adapters_requests_go_to_a_replica_that_has_it_loaded():
    """Three replicas of model `m` with adapters `x` and `y`: `x`'s requests go where `x` is loaded, and keep going
    there once a first one chose a replica (before any stats tell); a busy holder spills to the least-loaded one; an
    adapter nobody holds goes by load; base-model requests ignore adapters; all stay with model `m`'s replicas."""

    async def scenario():
        r1, r2, r3, other = (FakeReplica(n) for n in ("r1", "r2", "r3", "other"))
        for r in (r1, r2, r3):
            r.routing_stats = {"model": "m", "adapters": ["x", "y"], "loaded": []}
        other.routing_stats = {"model": "n"}
        r2.routing_stats = {**r2.routing_stats, "loaded": ["x"]}
        router = make_router(ModelPolicyRouter, [r1, r2, r3, other], policies={"m": {"policy": "least_load"}})

        def req(model: str) -> PendingRequest:
            p = pending({"model": model, "prompt": "x"})
            p.args[0].model = model
            return p

        loaded_x = {await route(router, req("x")) for _ in range(6)}
        first_y = await route(router, req("y"))  # nobody has y: by load (all idle)
        sticky_y = {await route(router, req("y")) for _ in range(6)}  # chosen once: held there meanwhile
        set_load(router, r2, 20)
        spilled = await route(router, req("x"))
        base = {await route(router, req("m")) for _ in range(12)}
        return loaded_x, first_y, sticky_y, spilled, base

    loaded_x, first_y, sticky_y, spilled, base = asyncio.run(scenario())
    assert loaded_x == {"r2"}
    assert sticky_y == {first_y} and first_y in {"r1", "r2", "r3"}
    assert spilled in {"r1", "r3"}
    assert base <= {"r1", "r2", "r3"} and len(base) > 1


def test_adapter_affinity_outcomes():
    from deployments.routing.policies import adapter_affinity

    assert adapter_affinity("x", {"a": 0, "b": 0}, set()) in (("a", "new"), ("b", "new"))
    assert adapter_affinity("x", {"a": 0, "b": 3}, {"b"}) == ("b", "hit")
    assert adapter_affinity("x", {"a": 0, "b": 9}, {"b"}, imbalance=8) == ("a", "spill")
    assert adapter_affinity("x", {"a": 5, "b": 2, "c": 0}, {"a", "b"}) == ("b", "hit")  # the least loaded holder
    # ties go by a hash of the adapter: every router makes the same first choice
    assert len({adapter_affinity("x", {"a": 0, "b": 0, "c": 0}, set())[0] for _ in range(5)}) == 1


def test_same_model_knows_a_models_adapters():
    from types import SimpleNamespace

    from deployments.routing.routers import same_model

    a, b = (SimpleNamespace(routing_stats=s) for s in ({"model": "a", "adapters": ["a-sql"]}, {"model": "b"}))
    assert same_model([a, b], "a-sql") == [a]


def kv_router(tmp_path, replicas, policies=None, **kwargs):
    """A kv_cache router (ModelPolicyRouter when `policies` is given) whose replicas' cached blocks the test sets
    (`views`) instead of their KV events actors (which need Ray: tests/cpu/test_engine_features.py)."""
    from app.clusters.tiny_model import make_tiny_model
    from deployments.routing.kv_blocks import BlockView

    model = make_tiny_model(tmp_path / "tok")
    if policies is not None:
        for options in policies.values():
            if options["policy"] == "kv_cache":
                options["tokenizer"] = str(model)
        router = make_router(ModelPolicyRouter, replicas, policies=policies)
    else:
        from deployments.routing.routers import KVCacheRouter

        router = make_router(KVCacheRouter, replicas, tokenizer=str(model), **kwargs)
    kv = next(p for p in router._policies.values() if p.name == "kv_cache")
    kv.follower.follow = lambda replicas: None
    kv.claim_s = 0.0  # decisions by the engines' blocks alone

    from transformers import AutoTokenizer

    from deployments.routing.kv_blocks import chain

    tokenizer = AutoTokenizer.from_pretrained(str(model))

    def hold(replica: FakeReplica, prompt: str, lora: str | None = None) -> None:
        view = kv.follower.views.setdefault(replica.replica_id.unique_id, BlockView())
        view.block_size = 16
        view.gpu |= set(chain(tokenizer(prompt)["input_ids"], 16, lora))

    return router, hold


DOC = " ".join(f"Line {i}: the north ridge holds its snow until June." for i in range(30))


def completion(prompt: str, model: str | None = None) -> PendingRequest:
    p = pending({"model": model, "prompt": prompt} if model else {"prompt": prompt})
    p.args[0].model = model
    return p


def test_kv_cache_sends_a_prompt_to_the_replica_holding_its_longest_prefix(tmp_path):
    async def scenario():
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        router, hold = kv_router(tmp_path, [a, b, c], imbalance=4)
        hold(a, DOC[: len(DOC) // 3])
        hold(b, DOC)  # b holds the longer prefix
        first = [await route(router, completion(DOC + f" Question {q}?")) for q in range(4)]
        set_load(router, b, 5)  # 5 above the least loaded: past the imbalance, b loses its claim to a
        spilled = await route(router, completion(DOC + " Another?"))
        set_load(router, b, 0)
        new = {await route(router, completion(f"Unrelated {i} " * 40)) for i in range(30)}
        return first, spilled, new

    first, spilled, new = asyncio.run(scenario())
    assert first == ["b"] * 4
    assert spilled == "a"
    assert new == {"a", "b", "c"}  # nothing cached anywhere: by load (all idle: any)


def test_kv_cache_weighs_the_blocks_a_replica_holds_more_against_its_load(tmp_path):
    """`routing.load_cost_tokens` (tokens of cached prefix one ongoing request costs), counted in the engine's blocks
    (16 tokens here): a holds the whole document, b a tenth less of it (some blocks, well under 3 x 48 tokens). Idle,
    a takes the next question; 3 requests busier than b, a's extra blocks are worth less than its load and b takes it
    (a spill); with the cost off (0, the most-holding replica within the imbalance) a keeps it, however busy."""

    async def scenario(cost: int) -> list[str]:
        a, b = FakeReplica("a"), FakeReplica("b")
        router, hold = kv_router(tmp_path / str(cost), [a, b], imbalance=8, load_cost_tokens=cost)
        hold(a, DOC)
        hold(b, DOC[: len(DOC) * 9 // 10])
        idle = await route(router, completion(DOC + " Why?"))
        set_load(router, a, 3)
        return [idle, await route(router, completion(DOC + " And then?"))]

    assert asyncio.run(scenario(48)) == ["a", "b"]
    assert asyncio.run(scenario(0)) == ["a", "a"]


def test_kv_cache_sends_a_request_by_load_where_the_holders_cache_would_overflow(tmp_path):
    """a holds the whole document (~1,070 tokens: 68 blocks of 16) and reports an engine of 100 KV blocks (its routing
    stats' `kv_blocks`). Idle, a takes a question on it; with one request ongoing on a, a second would not fit beside
    it (2 x 68 > 100: it would preempt), and the follow-up goes by load to b, an idle replica holding nothing. Without
    the capacity (a replica that reports none), a keeps it. Fails if the router ignores a full engine's cache."""

    async def scenario(blocks) -> tuple[str, str]:
        a, b = FakeReplica("a"), FakeReplica("b")
        if blocks:
            a.routing_stats = {"kv_blocks": blocks}
        router, hold = kv_router(tmp_path / str(blocks), [a, b], imbalance=8)
        hold(a, DOC)
        first = await route(router, completion(DOC + " First?"))  # the router learns a request's size
        set_load(router, a, 1)
        return first, await route(router, completion(DOC + " Why?"))

    assert asyncio.run(scenario(100)) == ("a", "b")
    assert asyncio.run(scenario(None)) == ("a", "a")


def test_kv_cache_keeps_a_lora_adapters_blocks_its_own(tmp_path):
    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        for r in (a, b):
            r.routing_stats = {"model": "m", "adapters": ["m-sql"], "loaded": ["m-sql"]}
        router, hold = kv_router(tmp_path, [a, b], policies={"m": {"policy": "kv_cache"}})
        hold(a, DOC)  # the base model's blocks of DOC
        hold(b, DOC, lora="m-sql")  # the adapter's
        base = [await route(router, completion(DOC + f" Q{q}", "m")) for q in range(3)]
        adapter = [await route(router, completion(DOC + f" Q{q}", "m-sql")) for q in range(3)]
        return base, adapter

    base, adapter = asyncio.run(scenario())
    assert base == ["a"] * 3 and adapter == ["b"] * 3


def test_concurrent_calls_made_inside_one_serve_request_are_each_routed():
    """Handle calls made inside one Serve request share its internal request id (a batch group's calls to a prefill
    pool); Serve's base router fulfils pending requests by that id and left all but one pending for ever."""

    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = make_router(ModelPolicyRouter, [a, b])
        shared = [pending({"prompt": f"p{i}"}) for i in range(3)]
        for request in shared[1:]:
            request.metadata.internal_request_id = shared[0].metadata.internal_request_id
        chosen = await asyncio.wait_for(asyncio.gather(*(router._choose_replica_for_request(r) for r in shared)), 10)
        assert len(chosen) == 3 and all(r.future.done() for r in shared)

    asyncio.run(scenario())


def test_a_replica_chosen_for_an_adapter_holds_it_until_its_report_for_hold_s(monkeypatch):
    """Between the router sending an adapter's first request to a replica and that replica's next routing-stats
    report (every MODEL_STATS_PERIOD_S), the replica counts as holding the adapter for HOLD_S: the follow-up stays there
    though the other replica is less loaded (one ongoing is within the imbalance), and after HOLD_S without a report
    it goes by load. Observed inside and past the window on a patched clock. `Replica` is a fake of Serve's
    RunningReplica (its id and routing stats)."""
    from types import SimpleNamespace

    from deployments.routing import routers

    class Replica(SimpleNamespace):
        pass

    now = [500.0]
    monkeypatch.setattr(routers.time, "monotonic", lambda: now[0])
    replicas = [Replica(replica_id=SimpleNamespace(unique_id=r), routing_stats={}) for r in ("r1", "r2")]
    policy = routers._AdapterAffinity()
    first, outcome = policy.decide("tiny-sql", {"r1": 0, "r2": 0}, replicas)
    other = "r2" if first == "r1" else "r1"
    loads = {first: 1, other: 0}  # the first request still runs there
    now[0] += policy.HOLD_S - 1
    assert (outcome, policy.decide("tiny-sql", loads, replicas)) == ("new", (first, "hit"))
    now[0] += policy.HOLD_S + 1
    assert policy.decide("tiny-sql", loads, replicas) == (other, "new")  # no report came: by load


def test_an_adapter_loaded_at_run_time_goes_to_its_home_before_the_homes_own_report_tells():
    """Right after a load at run time, the router may hear of the adapter first from a replica that only learnt it
    from the registry (its report lists the adapter, loaded nowhere) while the home's last report predates the load.
    That report names the home (`homes`), and the adapter's requests go there, in the case where the fallback
    disagrees: an adapter name whose hash tie-break picks the other, idle replica. With the homes ignored
    (tests/mutations/adapter-home-ignored.patch) they all go by the hash to the other replica."""
    from deployments.routing.policies import least_loaded

    name = next(f"rt-{i}" for i in range(100) if least_loaded({"home": 0, "other": 0}, key=f"rt-{i}") == "other")

    async def scenario():
        home, other = FakeReplica("home"), FakeReplica("other")
        home.routing_stats = {"model": "m", "adapters": ["x"], "loaded": []}  # its report from before the load
        other.routing_stats = {"model": "m", "adapters": ["x", name], "loaded": [], "homes": {name: "home"}}
        router = make_router(ModelPolicyRouter, [home, other], policies={"m": {"policy": "least_load"}})
        chosen = []
        for _ in range(3):
            p = pending({"model": name, "prompt": "x"})
            p.args[0].model = name
            chosen.append(await route(router, p))
        return chosen

    assert asyncio.run(scenario()) == ["home"] * 3


def test_a_resumed_streams_dead_replica_is_in_no_rank_though_its_session_points_there():
    """A continuation after its engine died carries the dead replica's id (AVOID_HEADER): the router leaves that
    replica out of every rank, though the session's own replica is that one (the case where the hint and affinity
    disagree). Ranked anywhere, Serve could send it there and only a retry would hide it: the ranks are asserted."""
    from deployments.http.protocol import AVOID_HEADER

    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = make_router(SessionAffinityRouter, [a, b])
        session = [(b"x-session-id", b"conversation-avoid")]
        home = await route(router, pending({"messages": []}, session))
        resumed = pending({"messages": []}, [*session, (AVOID_HEADER, home.encode())])
        ranks = await router.choose_replicas([a, b], resumed)
        ranked = [r.replica_id.unique_id for rank in ranks for r in rank]
        assert ranked and home not in ranked, ranked

    asyncio.run(scenario())
