"""Stored responses (vLLM's Responses API store) across replicas: the ids naming their replica
(deployments/http/response_ids.py), the front that answers or passes a retrieve, cancel or continued response on to the
replica keeping it (around a fake of vLLM's store, `FakeStore`), Summit's routers pinning such a request, the two-hop
ingress choosing the model by the id, and the builder giving such deployments Summit's router. The real engine's store
behind it is tested in tests/cpu/test_engine_features.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.http import response_ids
from deployments.http.protocol import TARGET_HEADER, HTTPRequest, ResponseStart
from deployments.routing.routers import ModelPolicyRouter
from deployments.server.front import EngineSide, FrontOptions, ReplicaFront
from deployments.server.models import ModelTable
from tests.unit.test_front import FakeReplicaStream, call
from tests.unit.test_routers import FakeReplica, make_router, route, set_load


class FakeStore:
    """A fake of vLLM's Responses API with its store on: POST /v1/responses keeps the response under the body's
    `request_id` (a background one stays "queued" and its task runs until `finish` is set); GET answers a kept one or
    404; cancel marks it cancelled."""

    def __init__(self):
        self.kept: dict[str, dict] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.finish = asyncio.Event()
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send):
        body = (await receive()).get("body", b"")
        self.paths.append(scope["path"])
        found = response_ids.ROUTE.match(scope["path"])
        if found is None:  # create
            payload = json.loads(body)
            answer = {"id": payload["request_id"], "status": "queued" if payload.get("background") else "completed"}
            self.kept[answer["id"]] = answer
            if payload.get("background"):
                self.tasks[answer["id"]] = asyncio.get_running_loop().create_task(self.finish.wait())
            status = 200
        elif found["id"] not in self.kept:
            status, answer = 404, {"error": {"message": "not found", "type": "invalid_request_error", "code": 404}}
        else:
            status, answer = 200, self.kept[found["id"]]
            if found["cancel"]:
                answer["status"] = "cancelled"
        data = json.dumps(answer).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": data, "more_body": False})


def store_front(replica="r1", stores=True, **options) -> tuple[ReplicaFront, FakeStore, list[HTTPRequest]]:
    store, sent = FakeStore(), []

    def to_keeper(request):
        sent.append(request)
        return FakeReplicaStream([ResponseStart(200, [(b"content-type", b"application/json")]), b'{"from": "keeper"}'])

    side = EngineSide(store, lambda: False, replica, None, lambda: stores, lambda rid: store.tasks.get(rid))
    front = ReplicaFront(side, ModelTable("a", ["a", "b"]), FrontOptions(to_keeper=to_keeper, **options))
    return front, store, sent


def test_an_id_names_its_model_and_replica_and_others_name_none():
    made = response_ids.new_id("llama-8b", "abc123xy")
    keeper = response_ids.owner_of(made)
    assert made.startswith("resp_") and keeper.replica == "abc123xy"
    assert keeper.model(["other", "llama-8b"]) == "llama-8b" and keeper.model(["other"]) is None
    assert response_ids.new_id("llama-8b", "abc123xy") != made
    for foreign in ("resp_1234", "my-own-id", 7, None, made + "/x", f"resp_{'0' * 32}-zz-r"):
        assert response_ids.owner_of(foreign) is None
    assert response_ids.ROUTE.match(f"/v1/responses/{made}")["cancel"] is None
    assert response_ids.ROUTE.match(f"/v1/responses/{made}/cancel")["id"] == made
    assert response_ids.ROUTE.match("/v1/responses") is None
    assert [response_ids.store_on(v) for v in ("1", "0", "", "yes", 1)] == [True, False, False, False, True]


def test_a_new_response_is_named_for_its_replica_and_retrieved_there():
    front, store, sent = store_front("r1")
    created = asyncio.run(call(front, "POST", "/v1/responses", {"model": "a", "input": "hi"})).json()
    assert response_ids.owner_of(created["id"]) == (response_ids.model_tag("a"), "r1")
    got = asyncio.run(call(front, "GET", f"/v1/responses/{created['id']}"))
    assert got.status_code == 200 and got.json() == created and sent == []
    # a client's own request_id is kept (found only where it was made)
    own = asyncio.run(call(front, "POST", "/v1/responses", {"model": "a", "input": "hi", "request_id": "mine"}))
    assert own.json()["id"] == "mine" and asyncio.run(call(front, "GET", "/v1/responses/mine")).status_code == 200
    missing = asyncio.run(call(front, "GET", "/v1/responses/nope"))
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "not found"  # vLLM's answer


def test_a_request_about_another_replicas_response_goes_on_to_it_once():
    front, store, sent = store_front("r1")
    theirs, same_model = response_ids.new_id("b", "r2"), response_ids.new_id("a", "r2")
    for method, path, body, model in [
        ("GET", f"/v1/responses/{theirs}", None, "b"),  # another model's replica
        ("POST", f"/v1/responses/{theirs}/cancel", None, "b"),
        ("POST", "/v1/responses", {"model": "a", "input": "more", "previous_response_id": same_model}, "a"),
    ]:
        r = asyncio.run(call(front, method, path, body))
        assert r.status_code == 200 and r.json() == {"from": "keeper"}
        request = sent[-1]
        assert (request.method, request.path, request.model) == (method, path, model)
        assert request.header(TARGET_HEADER) == b"r2" and request.header(b"x-summit-forwarded") == b"1"
    assert store.paths == [] and json.loads(sent[-1].body)["previous_response_id"] == same_model
    # passed on once: a replica that still is not the keeper says it is gone
    r = asyncio.run(call(front, "GET", f"/v1/responses/{theirs}", headers={"x-summit-forwarded": "1"}))
    assert r.status_code == 404 and "r2" in r.json()["error"]["message"] and len(sent) == 3
    other_models = {"model": "a", "input": "x", "previous_response_id": response_ids.new_id("b", "r1")}
    r = asyncio.run(call(front, "POST", "/v1/responses", other_models))  # b's response continued by model a
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id" and len(sent) == 3
    gone = response_ids.new_id("not-in-this-app", "r3")
    assert asyncio.run(call(front, "GET", f"/v1/responses/{gone}")).status_code == 404 and len(sent) == 3


def test_wrong_method_405_and_store_off_404_naming_the_variable():
    front, store, _ = store_front("r1")
    mine = response_ids.new_id("a", "r1")
    assert asyncio.run(call(front, "POST", f"/v1/responses/{mine}")).status_code == 405
    assert asyncio.run(call(front, "GET", f"/v1/responses/{mine}/cancel")).status_code == 405
    off, store, _ = store_front("r1", stores=False)
    r = asyncio.run(call(off, "GET", f"/v1/responses/{mine}"))
    assert r.status_code == 404 and response_ids.STORE_ENV in r.json()["error"]["message"] and store.paths == []
    created = asyncio.run(call(off, "POST", "/v1/responses", {"model": "a", "input": "x", "request_id": "r"})).json()
    assert created["id"] == "r"  # nothing renamed where nothing is kept


def test_a_background_response_holds_its_place_until_its_task_ends():
    async def scenario():
        from deployments.pipeline.admission import Admission

        admission = Admission(1, 0, 429, 1)
        front, store, _ = store_front("r1", admission=admission)
        create = asyncio.create_task(
            call(front, "POST", "/v1/responses", {"model": "a", "input": "x", "background": 1})
        )
        while not store.tasks:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not create.done() and admission.full()  # answered "queued", still running: its place is held
        (rid,) = store.tasks
        assert (await call(front, "POST", f"/v1/responses/{rid}/cancel")).json()["status"] == "cancelled"
        store.finish.set()
        created = await asyncio.wait_for(create, 5)
        assert created.json()["status"] == "queued" and not admission.full()

    asyncio.run(scenario())


def test_summit_routers_send_a_pinned_request_to_its_replica_while_it_lives():
    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = make_router(ModelPolicyRouter, [a, b])
        set_load(router, b, 40)
        pinned = [(TARGET_HEADER, b"b")]
        from tests.unit.test_routers import pending

        assert {await route(router, pending({"input": "x"}, pinned)) for _ in range(5)} == {"b"}
        assert {await route(router, pending({"input": "x"})) for _ in range(5)} == {"a"}  # by load otherwise
        router.update_replicas([a])
        assert await route(router, pending({"input": "x"}, pinned)) == "a"  # gone: any (its front answers 404)

    asyncio.run(scenario())


@pytest.mark.parametrize("stored", [False, True])
def test_deployments_keeping_responses_get_summits_router(stored, monkeypatch):
    from app.build.builder import check_front_processes, engine_deployment
    from app.config import SummitConfig
    from deployments.server.config import ServerConfig

    if stored:
        monkeypatch.setenv(response_ids.STORE_ENV, "1")
    else:
        monkeypatch.delenv(response_ids.STORE_ENV, raising=False)
    config = SummitConfig.model_validate({"models": [{"name": "a", "source": "/m", "accelerator": "cpu"}]})
    app = engine_deployment(ServerConfig([(config.models[0], "/m")], config.monitoring))
    router = app._bound_deployment._deployment_config.request_router_config.request_router_class
    assert router.endswith("ModelPolicyRouter") == stored
    several = SummitConfig.model_validate(
        {"models": [{"name": "a", "source": "/m", "accelerator": "cpu", "front_processes": 2}]}
    )
    if stored:
        with pytest.raises(ValueError, match=r"models\['a'\].front_processes > 1 with VLLM_ENABLE_RESPONSES_API_STORE"):
            check_front_processes(several, "direct", "")
    else:
        check_front_processes(several, "direct", "")


def test_the_two_hop_ingress_sends_a_stored_response_request_to_its_model_pinned():
    from tests.unit.test_ingress import ingress

    entry, servers = ingress()
    theirs = response_ids.new_id("b", "rb")
    assert asyncio.run(call(entry, "GET", f"/v1/responses/{theirs}?stream=true")).status_code == 200
    (request,) = servers["b"].seen
    assert request.method == "GET" and request.query_string == b"stream=true" and request.header(TARGET_HEADER) == b"rb"
    continued = {"model": "a", "input": "x", "previous_response_id": theirs}
    assert asyncio.run(call(entry, "POST", "/v1/responses", continued)).status_code == 200
    assert servers["a"].seen[0].header(TARGET_HEADER) == b"rb"  # to its model a, pinned (a's front passes it to b's)
    r = asyncio.run(call(entry, "GET", "/v1/responses/my-own-id"))  # two models: no way to know whose
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
