"""The replica's front (deployments/server/front.py) around a fake engine app (`EchoEngineApp`, standing in for vLLM's
OpenAI app): keys, routes, model check, request ids, error shapes, disconnect passed through. The real engine behind
it is tested in tests/cpu (test_disaggregation.py and the suite on the direct path)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import BaseModel, model_validator

from deployments.pipeline.admission import Admission
from deployments.server.front import EngineSide, FrontOptions, ReplicaFront
from deployments.server.models import ModelTable


class EchoEngineApp:
    """A fake engine app: echoes what it received; `/v1/models` lists one model; a body {"fail": N} answers N
    with a FastAPI-style error; {"wait": true} blocks until the client disconnects and records it; {"hold": true}
    answers once `gate` is set (`running` counts those held)."""

    def __init__(self):
        self.seen: list[dict] = []
        self.disconnected = asyncio.Event()
        self.gate = asyncio.Event()
        self.running = 0

    async def __call__(self, scope, receive, send):
        message = await receive()
        body = message.get("body", b"")
        self.seen.append({"path": scope["path"], "headers": dict(scope["headers"]), "body": body})
        if scope["path"] == "/v1/models":
            out = {"object": "list", "data": [{"id": "a", "object": "model", "max_model_len": 99}]}
            status = 200
        else:
            payload = json.loads(body)
            if payload.get("wait"):
                if (await receive())["type"] == "http.disconnect":
                    self.disconnected.set()
                return
            if payload.get("hold"):
                self.running += 1
                await self.gate.wait()
                self.running -= 1
            status = payload.get("fail", 200)
            out = {"detail": "engine says no"} if status >= 400 else {"echo": payload, "headers": len(scope["headers"])}
        data = json.dumps(out).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"engine-own")],
            }
        )
        await send({"type": "http.response.body", "body": data, "more_body": False})


def make_front(engine, model, models, keys, dead, replica_id, cards=None, **options) -> ReplicaFront:
    """A front as LLMServer builds one, around a fake engine app."""
    return ReplicaFront(
        EngineSide(engine, dead, replica_id), ModelTable(model, models, cards), FrontOptions(keys=keys, **options)
    )


def front(keys=None, dead=False, models=("a", "b"), **options) -> tuple[ReplicaFront, EchoEngineApp]:
    engine = EchoEngineApp()
    return make_front(
        engine,
        "a",
        list(models),
        keys,
        lambda: dead,
        "replica-1",
        {"b": {"id": "b", "object": "model", "owned_by": "summit"}},
        **options,
    ), engine


async def call(app, method, path, body=None, headers=None):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        return await client.request(method, path, json=body, headers=headers or {})


def test_model_of_this_replica_reaches_the_engine_with_ids_and_without_the_key():
    app, engine = front(keys=[b"k1"])
    r = asyncio.run(
        call(
            app,
            "POST",
            "/v1/completions",
            {"model": "a", "prompt": "x"},
            {"authorization": "Bearer k1", "x-request-id": "client-7"},
        )
    )
    assert r.status_code == 200 and r.json()["echo"]["prompt"] == "x"
    assert "x-request-id" not in r.headers and r.headers["x-summit-replica"] == "replica-1"  # Serve sets it
    sent = engine.seen[0]["headers"]
    assert b"authorization" not in sent
    assert sent[b"x-request-id"].startswith(b"client-7-") and len(sent[b"x-request-id"]) == len(b"client-7-") + 8


def test_keys_checked_on_every_route_but_health():
    app, engine = front(keys=[b"k1"])
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"model": "a"}),
        ("POST", "/tokenize", {"model": "a"}),
    ]:
        for headers in [{}, {"authorization": "Bearer nope"}]:
            r = asyncio.run(call(app, method, path, body, headers))
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError" and "nope" not in r.text
    assert asyncio.run(call(app, "GET", "/health")).status_code == 200
    assert engine.seen == []


def test_models_lists_every_model_of_the_application():
    app, _ = front()
    data = asyncio.run(call(app, "GET", "/v1/models")).json()["data"]
    assert [(m["id"], m.get("max_model_len")) for m in data] == [("a", 99), ("b", None)]


def test_bad_requests_get_openai_errors_before_the_engine():
    app, engine = front()
    cases = [
        ("POST", "/v1/completions", {"model": "zzz"}, 404),
        ("POST", "/v1/completions", {"prompt": "x"}, 400),
        ("POST", "/metrics", {"model": "a"}, 404),
        ("GET", "/v1/completions", None, 405),
        ("POST", "/v1/completions", {"model": "b"}, 503),
    ]  # b lives on another replica: a stale route
    for method, path, body, status in cases:
        r = asyncio.run(call(app, method, path, body))
        assert r.status_code == status and set(r.json()["error"]) >= {"message", "type", "code"}, (path, r.text)
    assert engine.seen == []
    assert asyncio.run(call(app, "POST", "/v1/completions", {"model": "b"})).headers["retry-after"] == "1"


def test_engine_errors_come_out_openai_shaped_and_a_dead_engine_is_503():
    app, _ = front()
    r = asyncio.run(call(app, "POST", "/v1/completions", {"model": "a", "fail": 422}))
    assert r.status_code == 422 and r.json()["error"]["message"] == "engine says no"
    assert int(r.headers["content-length"]) == len(r.content)
    dead, engine = front(dead=True)
    r = asyncio.run(call(dead, "POST", "/v1/completions", {"model": "a"}))
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and engine.seen == []
    assert r.headers["x-summit-replica"] == "replica-1"  # the replica's own refusal names it, as its answers do
    assert asyncio.run(call(dead, "GET", "/health")).status_code == 503


def test_client_disconnect_reaches_the_engine_app():
    app, engine = front()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    messages = [
        {"type": "http.request", "body": json.dumps({"model": "a", "wait": True}).encode(), "more_body": False},
        {"type": "http.disconnect"},
    ]

    async def receive():
        return messages.pop(0)

    async def send(message):
        raise AssertionError("nothing is sent to a client that left")

    asyncio.run(app(scope, receive, send))
    assert engine.disconnected.is_set()


class FakeReplicaStream:
    """Stands in for a Serve response stream from another replica's handle_http: a ResponseStart, then chunks."""

    def __init__(self, items):
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self):
        self.cancelled = True


def test_another_models_request_goes_on_to_its_replica_once():
    from deployments.http.protocol import ResponseStart

    sent = []

    def forward(request):
        sent.append(request)
        return FakeReplicaStream(
            [
                ResponseStart(200, [(b"content-type", b"text/event-stream"), (b"x-summit-replica", b"replica-b")]),
                b"data: 1\n\n",
                b"data: 2\n\n",
            ]
        )

    engine = EchoEngineApp()
    app = make_front(engine, "a", ["a", "b"], [b"k"], lambda: False, "replica-a", forward=forward)
    r = asyncio.run(
        call(
            app, "POST", "/v1/completions", {"model": "b", "prompt": "x", "stream": True}, {"authorization": "Bearer k"}
        )
    )
    assert r.status_code == 200 and r.text == "data: 1\n\ndata: 2\n\n" and r.headers["x-summit-replica"] == "replica-b"
    (request,) = sent
    assert request.model == "b" and json.loads(request.body)["prompt"] == "x" and engine.seen == []
    assert request.header(b"authorization") is None and request.header(b"x-summit-forwarded") == b"1"
    # a request forwarded once that still meets the wrong model is not sent on again
    r = asyncio.run(
        call(app, "POST", "/v1/completions", {"model": "b"}, {"authorization": "Bearer k", "x-summit-forwarded": "1"})
    )
    assert r.status_code == 503 and len(sent) == 1


class StreamingEngineApp:
    """A fake engine app streaming SSE: `n` chunks back to back, except that after chunk `hold_at` it waits until the
    front has written two bodies (the first chunk, then what its coalescing window gathered)."""

    def __init__(self, n: int, hold_at: int | None = None):
        self.n, self.hold_at = n, hold_at
        self.flushed = asyncio.Event()

    async def __call__(self, scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(self.n):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            if i == self.hold_at:
                await asyncio.wait_for(self.flushed.wait(), 60)  # the window's timer wrote what it held
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


@pytest.mark.parametrize("coalesce_s", [0.0, 0.05])
def test_stream_chunks_after_the_first_are_coalesced_in_order(coalesce_s):
    engine = StreamingEngineApp(40, hold_at=19 if coalesce_s else None)
    app = make_front(engine, "a", ["a"], None, lambda: False, "r", coalesce_s=coalesce_s)
    messages = []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    request = [{"type": "http.request", "body": b'{"model": "a", "stream": true}', "more_body": False}]

    async def receive():
        return request.pop(0) if request else await asyncio.sleep(3600)

    async def send(message):
        messages.append(message)
        if sum(m["type"] == "http.response.body" for m in messages) == 2:
            engine.flushed.set()

    asyncio.run(app(scope, receive, send))
    bodies = [m["body"] for m in messages if m["type"] == "http.response.body"]
    chunks = [f"data: {i}\n\n".encode() for i in range(40)] + [b"data: [DONE]\n\n"]
    more = [m["more_body"] for m in messages if m["type"] == "http.response.body"]
    assert more == [True] * (len(more) - 1) + [False]
    if coalesce_s:
        # the first chunk alone; chunks 1-19 in the window the engine waited out; 20-39 and the end in one write
        assert bodies == [chunks[0], b"".join(chunks[1:20]), b"".join(chunks[20:])]
    else:
        assert bodies == chunks  # no window: one write per chunk


def test_an_engine_that_dies_under_a_request_answers_503():
    dead = {"now": False}

    class DyingEngineApp(EchoEngineApp):
        async def __call__(self, scope, receive, send):
            await receive()
            dead["now"] = True  # vLLM answers 500 "EngineCore encountered an issue" once its core is gone
            await send(
                {"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]}
            )
            await send(
                {"type": "http.response.body", "body": b'{"error": {"message": "EngineCore encountered an issue"}}'}
            )

    app = make_front(DyingEngineApp(), "a", ["a"], None, lambda: dead["now"], "r")
    r = asyncio.run(call(app, "POST", "/v1/completions", {"model": "a"}))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "ServiceUnavailableError" and "replaced" in r.json()["error"]["message"]


def test_admission_runs_ongoing_queues_queued_and_rejects_the_rest_openai_shaped():
    """The direct path's bound (Serve's own rejection there is plain text): 2 run, 1 waits, the 4th and 5th are
    answered 429 + Retry-After at once; when the engine answers, the waiting one runs and all admitted complete."""

    async def scenario():
        app, engine = front()
        app.options.admission = Admission(ongoing=2, queued=1, status=429, retry_after_s=1.5)
        body = {"model": "a", "prompt": "x", "hold": True}
        admitted = [asyncio.create_task(call(app, "POST", "/v1/completions", body)) for _ in range(3)]
        admission = app.options.admission
        while not (engine.running == 2 and admission._waiting == 1):  # two in the engine, the third queued
            await asyncio.sleep(0.01)
        for _ in range(50):  # every task runs until it waits (no clock)
            await asyncio.sleep(0)
        assert engine.running == 2  # the third waits in the front, not in the engine
        extra = [asyncio.create_task(call(app, "POST", "/v1/completions", body)) for _ in range(2)]
        while not all(t.done() for t in extra) and admission._waiting == 1:  # answered, or queued behind the third
            await asyncio.sleep(0.01)
        assert all(t.done() for t in extra), f"the 4th and 5th were queued ({admission._waiting} waiting), not refused"
        rejected = [t.result() for t in extra]
        engine.gate.set()
        done = await asyncio.gather(*admitted)
        after = await call(app, "POST", "/v1/completions", {"model": "a", "prompt": "y"})
        return rejected, done, after, len(engine.seen)

    rejected, done, after, reached_engine = asyncio.run(scenario())
    for r in rejected:
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        error = r.json()["error"]
        assert error["type"] == "RateLimitError" and error["code"] == 429 and "overloaded" in error["message"]
    assert [r.status_code for r in done] == [200, 200, 200] and after.status_code == 200
    assert reached_engine == 4  # the rejected two never reached the engine


def test_a_client_that_leaves_while_queued_frees_its_place():
    async def scenario():
        app, engine = front()
        app.options.admission = Admission(ongoing=1, queued=1, status=503, retry_after_s=1)
        body = {"model": "a", "prompt": "x", "hold": True}
        first = asyncio.create_task(call(app, "POST", "/v1/completions", body))
        admission = app.options.admission
        while engine.running < 1:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(call(app, "POST", "/v1/completions", body))
        while admission._waiting < 1:  # queued behind the first
            await asyncio.sleep(0.01)
        full = await call(app, "POST", "/v1/completions", body)
        waiting.cancel()  # the queued client goes
        await asyncio.gather(waiting, return_exceptions=True)
        assert admission._waiting == 0, "the client that left still holds its place in the queue"
        queued_again = asyncio.create_task(call(app, "POST", "/v1/completions", body))
        while admission._waiting < 1:
            await asyncio.sleep(0.01)
        engine.gate.set()
        return full, await first, await queued_again

    full, first, queued_again = asyncio.run(scenario())
    assert full.status_code == 503 and full.json()["error"]["type"] == "ServiceUnavailableError"
    assert first.status_code == 200 and queued_again.status_code == 200


class _Completion(BaseModel):
    model: str
    prompt: str
    structured_outputs: object = None
    fail: bool = False

    @model_validator(mode="before")
    @classmethod
    def check(cls, data):
        if isinstance(data, dict) and data.get("structured_outputs") is not None:
            data["structured_outputs"].get("json")  # AttributeError on a float
        return data


def _validating_engine_app():
    """A fake engine app made like vLLM's (FastAPI, a pydantic request model per route) whose validator crashes on an
    odd value instead of refusing it, as vLLM 0.32's does on `structured_outputs: 1.5`; {"fail": true} is an engine
    error (500) on a valid body."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.exception_handler(Exception)
    async def _crash(request, exc):
        return JSONResponse({"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}, 500)

    @app.post("/v1/completions")
    async def completions(request: _Completion):
        if request.fail:
            return JSONResponse({"error": {"message": "engine broke", "type": "InternalServerError", "code": 500}}, 500)
        return {"ok": request.prompt}

    return app


def test_a_body_that_crashes_vllms_validator_is_400_not_500():
    engine = _validating_engine_app()
    app = make_front(engine, "a", ["a"], None, lambda: False, "replica-1", {})
    bad = asyncio.run(call(app, "POST", "/v1/completions", {"model": "a", "prompt": "x", "structured_outputs": 1.5}))
    assert bad.status_code == 400 and "not a valid /v1/completions request" in bad.json()["error"]["message"], bad.text
    broken = asyncio.run(call(app, "POST", "/v1/completions", {"model": "a", "prompt": "x", "fail": True}))
    assert broken.status_code == 500 and broken.json()["error"]["message"] == "engine broke"  # a valid body: honest
    assert asyncio.run(call(app, "POST", "/v1/completions", {"model": "a", "prompt": "x"})).json() == {"ok": "x"}


def test_a_body_over_the_limit_is_413_unread_and_openapi_json_is_served():
    from deployments.pipeline.entry import MAX_REQUEST_BYTES

    engine = _validating_engine_app()
    app = make_front(engine, "a", ["a"], None, lambda: False, "replica-1", {})
    r = asyncio.run(call(app, "POST", "/v1/completions", {"model": "a", "prompt": "x" * MAX_REQUEST_BYTES}))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    doc = asyncio.run(call(app, "GET", "/openapi.json")).json()
    assert doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/_Completion"
    }
    assert "/v1/files" not in doc["paths"] and "/health" in doc["paths"]


def test_a_route_of_another_task_is_a_404_naming_the_models_routes():
    """vLLM's app registers the routes of its model's task; the front answers any other OpenAI route with a 404 that
    names the model and the routes it serves (an embedding model's app here: a fake with a route table)."""

    class EmbeddingApp(EchoEngineApp):
        routes = [
            type("Route", (), {"path": p, "methods": {"POST"}})() for p in ("/v1/embeddings", "/pooling", "/tokenize")
        ]

    engine = EmbeddingApp()
    app = make_front(engine, "a", ["a"], None, lambda: False, "replica-1")
    served = asyncio.run(call(app, "POST", "/v1/embeddings", {"model": "a", "input": "x"}))
    assert served.status_code == 200 and served.json()["echo"]["input"] == "x"
    refused = asyncio.run(call(app, "POST", "/v1/completions", {"model": "a", "prompt": "x"}))
    error = refused.json()["error"]
    assert refused.status_code == 404 and error["param"] == "model" and error["type"] == "NotFoundError"
    assert "'a' does not serve POST /v1/completions" in error["message"]
    assert error["message"].endswith("it serves POST /pooling, /tokenize, /v1/embeddings")
    assert [s["path"] for s in engine.seen] == ["/v1/embeddings"]  # the refused request never reached the engine
