"""The two-hop ingress (deployments/hops/ingress.py) in-process, its engine deployments faked (`FakeDeployment`
answers through `handle_http` as an LLMServer replica would): the same entry steps as the replica front (key, body,
model), the request relayed to its model's deployment without the key, a stream passed through. The real path is
tested in tests/cpu/test_disaggregation.py (models of different shapes)."""

from __future__ import annotations

import asyncio
import inspect
import json

import httpx

from app.config import AuthOptions
from deployments.hops.ingress import OpenAIIngress
from deployments.http.protocol import ResponseStart
from tests.unit.test_front import FakeReplicaStream


class FakeDeployment:
    """A model's engine deployment: records each request and answers with an SSE stream naming the model."""

    def __init__(self, name: str):
        self.name, self.seen = name, []

    def options(self, **_):
        return self

    @property
    def handle_http(self):
        return self

    def remote(self, request):
        self.seen.append(request)
        start = ResponseStart(200, [(b"content-type", b"text/event-stream")])
        return FakeReplicaStream([start, f"data: {self.name}\n\n".encode(), b"data: [DONE]\n\n"])


def ingress(keys: bool = False):
    """The ingress's ASGI app as Serve builds it (`__serve_build_asgi_app__`), and its fake deployments."""
    servers = {"a": FakeDeployment("a"), "b": FakeDeployment("b")}
    ingress_class = OpenAIIngress.__mro__[1]  # the class itself, under Serve's replica wrapper
    auth = AuthOptions(api_keys_env="TEST_INGRESS_KEYS") if keys else None
    return ingress_class(servers, auth, adapters={"sql": "b"}).__serve_build_asgi_app__(), servers


async def post(app, body, headers=None):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        return await client.post("/v1/completions", json=body, headers=headers or {})


def test_the_app_is_an_asgi3_callable_object():
    app, _ = ingress()
    assert inspect.iscoroutinefunction(type(app).__call__)  # what uvicorn (Serve's HTTP server) checks for ASGI 3


def test_a_request_goes_to_its_models_deployment_without_the_key_and_streams_back():
    app, servers = ingress()
    r = asyncio.run(post(app, {"model": "sql", "prompt": "x"}, {"authorization": "Bearer k", "x-request-id": "c-1"}))
    assert r.status_code == 200 and r.text == "data: b\n\ndata: [DONE]\n\n"  # an adapter: its model's deployment
    (sent,) = servers["b"].seen
    assert sent.model == "sql" and sent.header(b"authorization") is None and sent.header(b"x-request-id") == b"c-1"
    assert not servers["a"].seen


def test_the_entry_steps_refuse_as_the_replica_front_does(monkeypatch):
    monkeypatch.setenv("TEST_INGRESS_KEYS", "k")
    app, servers = ingress(keys=True)
    assert asyncio.run(post(app, {"model": "a"})).status_code == 401
    unknown = asyncio.run(post(app, {"model": "nope"}, {"authorization": "Bearer k"}))
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert json.loads(asyncio.run(post(app, [1], {"authorization": "Bearer k"})).text)["error"]["code"] == 400
    assert not servers["a"].seen and not servers["b"].seen


def test_a_resume_goes_to_the_replica_keeping_the_stream_with_its_callers_owner(monkeypatch):
    """`Last-Event-ID` naming a Summit stream: the ingress sends the request (no body needed) to the stream's model's
    deployment pinned to the replica that keeps it (x-summit-target-replica) with the caller's owner (a hash of its
    key; a client's own x-summit-owner is dropped); an id of an unknown model is a 404 naming the header. Fails if a
    resume starts a new generation elsewhere, or another caller's owner reaches the replica."""
    from deployments.http.stream_ids import new_stream_id
    from deployments.pipeline.auth import owner_of

    monkeypatch.setenv("TEST_INGRESS_KEYS", "k1,k2")
    app, servers = ingress(keys=True)
    stream = new_stream_id("b", 0, "replica-7")
    headers = {"authorization": "Bearer k2", "last-event-id": f"{stream}:5", "x-summit-owner": "forged"}
    transport = httpx.ASGITransport(app=app)

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            resumed = await client.post("/v1/chat/completions", content=b"", headers=headers)
            unknown = await client.post(
                "/v1/completions", content=b"", headers={**headers, "last-event-id": f"{new_stream_id('z', 0, 'r')}:0"}
            )
            return resumed, unknown

    resumed, unknown = asyncio.run(run())
    assert resumed.status_code == 200 and "data: b" in resumed.text
    (sent,) = servers["b"].seen
    assert not servers["a"].seen and sent.path == "/v1/chat/completions" and sent.body == b""
    assert sent.header(b"x-summit-target-replica") == b"replica-7"
    assert [v for k, v in sent.headers if k == b"x-summit-owner"] == [owner_of(b"Bearer k2")]
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "Last-Event-ID"
