"""The routers inside a real Ray Serve, with fake model deployments (no vLLM): each fake replica answers with
its own replica id, as `LLMServer` reports it in `x-summit-replica`.

A private Ray cluster (tests/local_cluster.py: own temp dir and ports, no HTTP proxy, 2 CPUs) is started for this
module and stopped after it. The handle lives in the test process, so the routers run here exactly as they run in
the ingress.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.http.protocol import HTTPRequest
from deployments.routing.policies import prefix_key
from deployments.routing.router_options import request_router_options
from tests.cpu.engine_apps import wait_for
from tests.local_cluster import LocalCluster
from tests.routing_keys import same_hash_home

REPO = Path(__file__).resolve().parents[2]


class FakeLLMServer:
    """Stands in for LLMServer: same call shape (`handle_http(HTTPRequest)`), answers with its replica id."""

    def handle_http(self, request: HTTPRequest) -> str:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id


@pytest.fixture(scope="module")
def serve_fakes():
    import ray
    from ray import serve

    # The node is started by `ray start` in processes of its own, as every other module's cluster is (an in-process
    # `ray.init(address="local")` once timed out on its raylet's registration in CI); this process is its driver.
    # The only module whose test process is a Ray driver (the others ask through tests/replica_probe.py's subprocess).
    if ray.is_initialized():
        pytest.fail(f"an earlier module left this process a Ray driver ({ray.get_runtime_context().gcs_address})")
    cluster = LocalCluster(num_cpus=2, env={"PYTHONPATH": str(REPO)})
    handles = {}
    try:
        cluster.start()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        serve.start(proxy_location="Disabled")
        for policy in ("session_affinity", "prefix_affinity"):
            options = request_router_options(policy, prefix_chars=64, imbalance=8, max_tracked=100)
            fake = serve.deployment(FakeLLMServer).options(
                name=f"FakeLLMServer:{policy}", num_replicas=2, ray_actor_options={"num_cpus": 0}, **options
            )
            handles[policy] = serve.run(fake.bind(), name=f"fake-{policy}", route_prefix=None)
        yield handles
    finally:
        # the handles' routers first: one left running calls its controller after `ray.shutdown()`, and Ray then
        # starts a local instance of its own in this process (an actor call auto-initializes Ray)
        for handle in handles.values():
            handle.shutdown()
        ray.shutdown()
        cluster.stop()


def call(handle, body: dict, headers: list[tuple[bytes, bytes]] | None = None) -> str:
    request = HTTPRequest("POST", "/v1/chat/completions", json.dumps(body).encode(), headers=headers or [])
    return handle.handle_http.remote(request).result(timeout_s=30)


def replica_ids(handle) -> list[str]:
    """The deployment's two replicas, asked with requests that have no key (routed by load: either replica)."""
    seen: set[str] = set()
    for _ in range(64):
        seen.add(call(handle, {"messages": []}))
        if len(seen) == 2:
            return sorted(seen)
    raise AssertionError(f"64 keyless requests all went to {seen}")


def test_a_session_sticks_and_sessions_spread(serve_fakes):
    """Sessions whose hash tie-break all names one replica: they spread over both only by the affinity table's
    counts of sessions per replica, and each sticks. With the table ignored
    (tests/mutations/session-table-ignored.patch) all four go to that one replica, and this fails."""
    handle = serve_fakes["session_affinity"]
    names = [f"s{i}" for i in range(64)]
    picked = [names[i] for i in same_hash_home([f"session:{n}" for n in names], replica_ids(handle), 4)]
    homes = {}
    for session in picked:
        replicas = {call(handle, {"messages": []}, [(b"x-session-id", session.encode())]) for _ in range(4)}
        assert len(replicas) == 1, f"session {session} answered by {replicas}"
        homes[session] = replicas.pop()
    assert len(set(homes.values())) == 2, f"sessions did not spread: {homes}"


def test_prefix_repeats_stay_and_distinct_prefixes_spread(serve_fakes):
    """Prefixes whose hash tie-break all names one replica: they spread only by the affinity table's counts; each
    prefix's repeats stay. With the table ignored (tests/mutations/prefix-table-ignored.patch) all four go to one
    replica, and this fails."""
    handle = serve_fakes["prefix_affinity"]
    candidates = [f"System prompt {i}: answer briefly and cite sources. " * 3 for i in range(64)]

    def body(system: str, question: str) -> dict:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}

    keys = [prefix_key(body(c, "q"), 64) for c in candidates]
    systems = [candidates[i] for i in same_hash_home(keys, replica_ids(handle), 4)]
    owners = [
        {
            call(handle, {"messages": [{"role": "system", "content": s}, {"role": "user", "content": f"q{q}"}]})
            for q in range(3)
        }
        for s in systems
    ]
    assert all(len(o) == 1 for o in owners), owners
    assert len({o.pop() for o in owners}) == 2


def test_a_removed_replicas_sessions_move(serve_fakes):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    handle = serve_fakes["session_affinity"]  # the same handle: its router remembers the sessions' homes
    sessions = [[(b"x-session-id", f"moving-{i}".encode())] for i in range(4)]
    homes = [call(handle, {}, s) for s in sessions]
    assert len(set(homes)) == 2
    victim = homes[0]
    deployment = DeploymentID(name="FakeLLMServer:session_affinity", app_name="fake-session_affinity")
    name = ReplicaID(victim, deployment).to_full_id_str()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def gone() -> bool:  # ray.kill returns before the actor is dead (a loaded full run's call still reached it)
        try:
            ray.get_actor(name, namespace="serve")
        except ValueError:
            return True
        return False

    assert wait_for(gone, 30, 0.1)

    # Serve removes the dead replica (and starts a replacement): its sessions move, the others stay. A call sent to
    # the dead replica before the router heard of its death fails once (ActorDiedError, as any Serve caller sees it)
    # and the router drops the replica: asked again, the session goes elsewhere.
    def call_again_if_dead(session) -> str:
        for _ in range(4):
            try:
                return call(handle, {}, session)
            except ray.exceptions.ActorDiedError:
                continue
        raise AssertionError(f"session {session} still sent to a dead replica after 4 calls")

    now = [call_again_if_dead(s) for s in sessions]
    assert victim not in now
    assert [n for n, h in zip(now, homes) if h != victim] == [h for h in homes if h != victim]
    assert [call(handle, {}, s) for s in sessions] == now  # remembered on their new replica
