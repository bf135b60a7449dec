"""Routing policies on real engines, on the direct path: two models in one app, each with 2 replicas of the tiny
model (4 engines in one engine deployment; HAProxy asks the route picker, whose router applies each model's policy).

- `tiny-prefix` (prefix_affinity): distinct prefixes spread, a prefix's repeats stay on one replica, and that
  replica's vLLM prefix cache really hits (read from vLLM's own counters); a hot prefix spills to the other replica.
- `tiny-session` (session_affinity): a session sticks; a killed replica's sessions move, the others stay.
- Both: /v1/models lists the two models; an unknown model is a 404 naming them.

The replica that answered is the `x-summit-replica` header. Engine counters are read through Serve handles by
`tests.replica_probe` in a subprocess (this process may already be the Ray driver of the suite's session cluster).
"""

from __future__ import annotations

import random
import threading

import httpx
import psutil
import pytest

from app.clusters.tiny_model import make_tiny_model
from deployments.routing.policies import prefix_key
from tests.cpu.engine_apps import APP, deployed, document, running_replicas, tiny_model, wait_for
from tests.engine_checks import held_streams, model_engine_cores, paused
from tests.replica_probe import probe
from tests.routing_keys import same_hash_home

PREFIX, SESSION = "tiny-prefix", "tiny-session"
POOL = f"LLMServer:{PREFIX}+{SESSION}"
KV_BLOCK = 128  # vLLM's CPU KV block (tokens); the prefix cache reuses whole blocks only
HOT_IMBALANCE = 2
PREFIX_MAX_LEN = 32768  # room for streams that outlast routing the others even on a loaded CI machine


@pytest.fixture(scope="module")
def summit2(tiny_model_dir, tmp_path_factory):
    # The prefix model takes long contexts, so the hot-prefix test's streams can outlast routing on a loaded box.
    long_dir = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-32k", max_len=PREFIX_MAX_LEN)
    models = [
        tiny_model(
            PREFIX,
            {"enable_prefix_caching": True, "max_model_len": PREFIX_MAX_LEN, "kv_cache_memory_bytes": 256 << 20},
            {"num_replicas": 2},
            routing={"policy": "prefix_affinity", "imbalance": HOT_IMBALANCE},
            source=str(long_dir),
        ),
        tiny_model(
            SESSION, {"enable_prefix_caching": True}, {"num_replicas": 2}, routing={"policy": "session_affinity"}
        ),
    ]
    with deployed(models, tiny_model_dir, haproxy=True, fast_metrics=True) as cluster:
        assert wait_for(lambda: len(running_replicas(cluster, POOL)) == 4, 300)
        assert wait_for(lambda: router_knows_every_replica(cluster), 300, 2), "the router never used both replicas"
        yield cluster


def router_knows_every_replica(cluster) -> bool:
    """Readiness: the router places each model's requests on both of its replicas. Until a replica's model has
    reached the router (`record_routing_stats`, every second; later on a loaded box) it gets none of that model's
    requests: a run of the suite on 4 workers beside 2 busy loops sent every prefix and every session to one
    replica. The requests carry no affinity key (a prompt shorter than a prefix block, a chat without a session),
    so they go by load whatever the affinity does: readiness never depends on the feature the tests check (a
    mutation that breaks the affinity fails the tests' assertions, not this wait)."""
    seen: dict[str, set[str]] = {PREFIX: set(), SESSION: set()}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as http:
        for i in range(6):
            seen[PREFIX].add(replica_of(complete(http, PREFIX, f"Ready {i}?")))
            chat = {"model": SESSION, "messages": [{"role": "user", "content": f"Ready {i}?"}], "max_tokens": 4}
            seen[SESSION].add(replica_of(http.post("/v1/chat/completions", json=chat)))
    return all(len(replicas) == 2 for replicas in seen.values())


@pytest.fixture(scope="module")
def http(summit2):
    with httpx.Client(base_url=summit2.base_url, timeout=120) as client:
        yield client


def complete(
    http: httpx.Client, model: str, prompt: str, max_tokens: int = 4, headers: dict | None = None
) -> httpx.Response:
    return http.post(
        "/v1/completions",
        headers=headers,
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
    )


def replica_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-summit-replica"]


def of_model(model: str, method: str, cluster) -> dict[str, dict]:
    """`method`'s answer from each replica of the pool that serves `model`."""
    answers = probe(cluster.address, "each", APP, POOL, method, "--replicas", "4")
    return {replica: a for replica, a in answers.items() if a["model"] == model}


def cache_counters(cluster) -> dict[str, dict]:
    """{replica: prompt tokens its engine took in / found in vLLM's prefix cache} for the prefix model's replicas:
    vLLM's `prompt_tokens_by_source` counter as each replica reads it now (every request answered before is in).
    Read on the replica, not through Ray's metrics endpoint: Ray exports counters as deltas, and a loaded box lost
    reports for good (a fresh-clone run: 768 cached tokens where the engines had hit 1,536 or more)."""
    return {
        replica: {
            "queries": sum(s["prompt_tokens_by_source"].values()),
            "hits": s["prompt_tokens_by_source"].get("local_cache_hit", 0),
        }
        for replica, s in of_model(PREFIX, "stats", cluster).items()
    }


def test_the_models_share_one_direct_engine_deployment(summit2):
    deployments = summit2.dashboard_get("/api/serve/applications/")["applications"][APP]["deployments"]
    assert set(deployments) == {POOL, "RoutePicker"}  # no OpenAIIngress: HAProxy -> engine replica
    router = deployments[POOL]["deployment_config"]["request_router_config"]
    assert router["request_router_class"] == "deployments.routing.routers.ModelPolicyRouter"
    assert {m: p["policy"] for m, p in router["request_router_kwargs"]["policies"].items()} == {
        PREFIX: "prefix_affinity",
        SESSION: "session_affinity",
    }
    assert len(cache_counters(summit2)) == 2 and len(of_model(SESSION, "stats", summit2)) == 2


def test_two_models_listed_served_and_unknown_named(http):
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert {PREFIX, SESSION} <= set(listed)
    assert listed[PREFIX].get("max_model_len") == PREFIX_MAX_LEN and listed[SESSION].get("max_model_len") == 2048
    for name in (PREFIX, SESSION):
        r = complete(http, name, "Hello there")
        assert r.status_code == 200 and r.json()["model"] == name
    r = complete(http, "tiny-nope", "Hello")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert PREFIX in error["message"] and SESSION in error["message"]


def test_prefixes_spread_repeats_stick_and_hit_vllms_cache(summit2, http):
    """Six documents whose hash tie-break names one replica: spread over both only by the affinity table (with it
    ignored, tests/mutations/prefix-table-ignored.patch, all six stay on that replica and this fails); each
    document's repeats stay on its replica, whose vLLM prefix cache hits."""
    candidates = [document(i) for i in range(48)]
    keys = [prefix_key({"model": PREFIX, "prompt": d + "Question 0: what is it about?"}) for d in candidates]
    docs = [candidates[i] for i in same_hash_home(keys, list(cache_counters(summit2)), 6)]
    prefix_tokens = [len(http.post("/tokenize", json={"model": PREFIX, "prompt": d}).json()["tokens"]) for d in docs]
    assert min(prefix_tokens) >= 2 * KV_BLOCK + 1, prefix_tokens
    before = cache_counters(summit2)

    owners = []
    for doc in docs:  # one at a time: every load is 0, so only affinity decides
        owners.append({replica_of(complete(http, PREFIX, doc + f"Question {q}: what is it about?")) for q in range(3)})
    assert all(len(o) == 1 for o in owners), f"a prefix's repeats moved: {owners}"
    homes = [o.pop() for o in owners]
    assert set(homes) == set(before), f"prefixes did not spread over both replicas: {homes}"

    after = cache_counters(summit2)
    for replica in before:
        hits = after[replica]["hits"] - before[replica]["hits"]
        queries = after[replica]["queries"] - before[replica]["queries"]
        # every repeat (2 per prefix) reuses the prefix's whole blocks; the prefix's last token may merge with the
        # question
        expected = sum(2 * KV_BLOCK * ((n - 1) // KV_BLOCK) for n, home in zip(prefix_tokens, homes) if home == replica)
        assert hits >= expected > 0, f"{replica}: {hits} cached tokens of {queries} queried, expected >= {expected}"
        assert hits < queries  # each prefix's first request missed


def test_a_hot_prefix_spills_to_the_other_replica(summit2, http):
    """Concurrent streams of one prefix, sent one at a time, each once the one before has its answer's start: the
    engines are paused (SIGSTOP) meanwhile, so every stream stays ongoing (none ends, however slow the box) and the
    box spends nothing on generating them; request HOT_IMBALANCE + 1 finds its replica more than `imbalance` above the
    other and must spill."""
    hot = document(100)
    home = replica_of(complete(http, PREFIX, hot + "Warm-up question."))
    n = 2 * HOT_IMBALANCE + 2
    replicas: dict[int, str] = {}
    routed = [threading.Event() for _ in range(n)]
    finished_early: list[tuple[int, int, str]] = []  # stream, status, its last line
    stop = threading.Event()

    def stream(i: int) -> None:
        # the engines are paused: it cannot end before the test closes it (an abort) once every stream was routed
        body = {
            "model": PREFIX,
            "prompt": hot + f"Long question {i}.",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with http.stream("POST", "/v1/completions", json=body) as r:
                replicas[i] = replica_of(r)  # the answer has started: its replica counts it as ongoing
                routed[i].set()
                last = ""
                for line in r.iter_lines():
                    if stop.is_set():
                        return
                    last = line or last
                if not stop.is_set():
                    finished_early.append((i, r.status_code, last[:300]))
        finally:
            routed[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(n)]
    try:
        with paused(model_engine_cores(summit2, f"{PREFIX}+{SESSION}")):
            for i, t in enumerate(threads):  # one at a time: each request is routed seeing the load of those before
                t.start()
                assert routed[i].wait(120), f"stream {i} got no answer in 120 s"
            stop.set()
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert len(replicas) == n, f"streams without an answer: {set(range(n)) - set(replicas)}"
    assert not finished_early, f"streams {finished_early} ended before every stream was routed: the test proves nothing"
    assert replicas[0] == home, "an unloaded prefix's first request should go to its replica"
    # Request HOT_IMBALANCE + 1 finds its replica more than `imbalance` above the other and must spill.
    assert len(set(replicas.values())) == 2, f"all concurrent requests of a hot prefix stayed on {home}: {replicas}"


def session_home(http: httpx.Client, session: str, question: str = "Where are we?") -> str:
    r = http.post(
        "/v1/chat/completions",
        headers={"x-session-id": session},
        json={"model": SESSION, "messages": [{"role": "user", "content": question}], "max_tokens": 4},
    )
    return replica_of(r)


def test_a_session_sticks_and_sessions_spread(summit2, http):
    """Four sessions whose hash tie-break names one replica: spread over both only by the affinity table's counts
    (with the table ignored, tests/mutations/session-table-ignored.patch, all four go to that replica and this
    fails); each sticks."""
    names = [f"traveller-{i}" for i in range(48)]
    replicas = list(of_model(SESSION, "stats", summit2))
    homes = {}
    for session in [names[i] for i in same_hash_home([f"session:{n}" for n in names], replicas, 4)]:
        replicas = {session_home(http, session, f"Turn {turn}") for turn in range(3)}
        assert len(replicas) == 1, f"session {session} moved: {replicas}"
        homes[session] = replicas.pop()
    assert len(set(homes.values())) == 2, f"sessions did not spread: {homes}"


def chat_body(question: str) -> dict:
    return {"model": SESSION, "messages": [{"role": "user", "content": question}], "max_tokens": 500}


def test_a_session_stays_on_its_busy_replica_where_load_would_send_it_away(summit2, http):
    """The case where session affinity and load disagree: the session's replica has one of the session's streams
    ongoing and the other replica none. The session's next request must still go to its replica; a request without a
    session, routed by load at that moment (the control), goes to the idle one. With the session table ignored
    (tests/mutations/session-table-ignored.patch) the follow-up goes by load too, and this fails; so it does if the
    router did not see the load (then the control fails)."""
    session = f"busy-{random.random()}"
    home = session_home(http, session)
    with held_streams(http, pause=model_engine_cores(summit2, f"{PREFIX}+{SESSION}")) as held:
        headers = {"x-session-id": session}
        assert held.open("/v1/chat/completions", chat_body("A long answer, please."), headers) == home
        follow_up = held.open("/v1/chat/completions", chat_body("And another."), headers)
        control = held.open("/v1/chat/completions", chat_body("Anyone there?"))
    assert control != home, "a request without a session should go to the idle replica: the router saw no load"
    assert follow_up == home, f"the session left its busy replica {home} for the idle {follow_up}"


def test_a_prefix_stays_on_its_busy_replica_within_the_imbalance(summit2, http):
    """The case where prefix affinity and load disagree: the prefix's replica has one of its streams ongoing (within
    the imbalance of 2), the other replica none. The prefix's next request must go to its replica; a prompt shorter
    than one block (no prefix key: routed by load), sent at that moment, goes to the idle one (the control). With the
    prefix table ignored (tests/mutations/prefix-table-ignored.patch) the repeat goes by load and this fails."""
    doc = document(200, title=f"Busy {random.random()}")
    home = replica_of(complete(http, PREFIX, doc + "First question."))
    with held_streams(http, pause=model_engine_cores(summit2, f"{PREFIX}+{SESSION}")) as held:
        body = {"model": PREFIX, "max_tokens": 500, "ignore_eos": True}
        assert held.open("/v1/completions", {**body, "prompt": doc + "A long question."}) == home
        repeat = held.open("/v1/completions", {**body, "prompt": doc + "Another question."})
        control = held.open("/v1/completions", {**body, "prompt": "Short, no prefix key."})
    assert control != home, "a prompt without a prefix key should go to the idle replica: the router saw no load"
    assert repeat == home, f"the prefix left its replica {home} (1 ongoing, imbalance 2) for the idle {repeat}"


def test_a_killed_replicas_sessions_move_the_others_stay(summit2, http):
    sessions = [f"moving-{i}" for i in range(4)]
    homes = {s: session_home(http, s) for s in sessions}
    assert len(set(homes.values())) == 2
    victim = homes[sessions[0]]
    stats = of_model(SESSION, "stats", summit2)
    engine_procs = psutil.Process(stats[victim]["pid"]).children(recursive=True)

    probe(summit2.address, "kill", APP, POOL, victim)
    moved: dict[str, str] = {}

    def all_answered() -> bool:  # the first requests after the kill may get 503 until Serve drops the replica
        for s in sessions:
            if s not in moved:
                # a new connection each: HAProxy reloads when the replica set changes, and the old HAProxy closes the
                # idle keep-alive connections it held (a pooled one, reused then, ended without an answer on CI)
                r = httpx.post(
                    summit2.base_url + "/v1/chat/completions",
                    timeout=120,
                    headers={"x-session-id": s},
                    json={"model": SESSION, "messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 4},
                )
                if r.status_code == 200:
                    moved[s] = r.headers["x-summit-replica"]
                else:
                    assert r.status_code == 503 and r.headers["retry-after"], r.text
        return len(moved) == len(sessions)

    assert wait_for(all_answered, 120, interval_s=1), (
        f"sessions unanswered after the kill: {set(sessions) - set(moved)}"
    )
    assert victim not in moved.values()
    assert {s: moved[s] for s in sessions if homes[s] != victim} == {s: h for s, h in homes.items() if h != victim}
    assert {s: session_home(http, s) for s in sessions} == moved, "moved sessions should stay on their new replica"
    # the killed replica's engine must not outlive it (it would hold its memory until the cluster stops)
    _, alive = psutil.wait_procs(engine_procs, timeout=30)
    for proc in alive:
        proc.kill()
    assert not alive, f"engine processes outlived their killed replica: {[p.pid for p in alive]}"
    # Serve gives the replacement the killed replica's rank, so it serves the same model: two engines a model again
    assert wait_for(lambda: len(running_replicas(summit2, POOL)) == 4, 300)

    def two_a_model() -> bool:  # the new replica answers probes once its engine has warmed up
        try:
            return len(of_model(SESSION, "stats", summit2)) == 2 and len(cache_counters(summit2)) == 2
        except RuntimeError:
            return False

    assert wait_for(two_a_model, 180, interval_s=5)
