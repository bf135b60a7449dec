"""Stream migration (deployments/pipeline/migration.py) on chunks as vLLM 0.32 writes them (captured from the tiny
model), and through the replica front with a fake engine app that dies mid-stream (`DyingEngineApp`) and a fake Serve
stream for the continuation. The real engines are in tests/cpu/test_migration.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deployments.http.protocol import ResponseStart
from deployments.pipeline.migration import KVMigration, kv_plan, resumable
from deployments.pipeline.resumable import Resumable
from deployments.server.front import ReplicaFront
from tests.unit.test_front import FakeReplicaStream, make_front

HEAD = '{"id":"cmpl-1","object":"text_completion","created":17,"model":"m","choices":[{"index":0,'
ERROR = (
    b'data: {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}}\n\n'
)


def completion_chunk(
    text: str,
    token: int,
    prompt: list[int] | None = None,
    with_ids: bool = True,
    head: str = HEAD,
    finish: str | None = None,
) -> bytes:
    prompt_ids = json.dumps(prompt, separators=(",", ":")) if (prompt and with_ids) else "null"
    ids = f"[{token}]" if with_ids else "null"
    fin = json.dumps(finish)
    return (
        f'data: {head}"text":{json.dumps(text)},"logprobs":null,"finish_reason":{fin},"stop_reason":null,'
        f'"prompt_token_ids":{prompt_ids},"token_ids":{ids}}}]}}\n\n'
    ).encode()


def usage_chunk(
    prompt: int, completion: int, head: str = '{"id":"cmpl-9","object":"text_completion","created":99,"model":"m",'
) -> bytes:
    return (
        f'data: {head}"choices":[],"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
        f'"completion_tokens":{completion}}},"system_fingerprint":"vllm"}}\n\n'
    ).encode()


def test_what_can_be_resumed():
    ok = {"stream": True, "temperature": 0, "prompt": "x"}
    assert resumable("/v1/completions", ok, "greedy") is None
    assert resumable("/v1/completions", {**ok, "prompt": [1, 2, 3]}, "greedy") is None
    assert resumable("/v1/chat/completions", {**ok, "messages": []}, "greedy") is None
    assert resumable("/v1/completions", {**ok, "temperature": 0.7}, "greedy") == "not temperature 0"
    assert resumable("/v1/completions", {**ok, "temperature": 0.7}, "all") is None
    assert resumable("/v1/completions", ok, "off")
    for change in (
        {"stream": False},
        {"n": 2},
        {"logprobs": 1},
        {"echo": True},
        {"prompt": ["a", "b"]},
        {"presence_penalty": 0.5},
        {"stream_options": {"continuous_usage_stats": True}},
        {"response_format": {"type": "json_object"}},
        {"kv_transfer_params": {"x": 1}},
    ):
        assert resumable("/v1/completions", {**ok, **change}, "greedy"), change
    assert resumable("/v1/chat/completions", {**ok, "tools": [{"type": "function"}]}, "greedy")
    assert resumable("/v1/chat/completions", ok, "greedy", chat_parsers=True)
    assert resumable("/tokenize", ok, "all")


def test_the_client_gets_vllms_own_bytes_and_the_ids_are_recorded():
    r = Resumable("/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": True}, "m", b"req-1")
    assert json.loads(r.engine_body())["return_token_ids"] is True
    with_ids = [completion_chunk(" a", 5, prompt=[1, 2, 3]), completion_chunk("b", 6)]
    without = [completion_chunk(" a", 5, prompt=[1, 2, 3], with_ids=False), completion_chunk("b", 6, with_ids=False)]
    assert [r.outgoing(c) for c in with_ids] == without
    assert r.prompt_ids == [1, 2, 3] and r.generated == [5, 6] and not r.failed
    assert r.head == {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": "m"}
    # a client that asked for the ids gets them
    asked = Resumable("/v1/completions", {"prompt": "x", "return_token_ids": True}, "m", b"req-2")
    assert [asked.outgoing(c) for c in with_ids] == with_ids


def test_an_error_event_and_what_follows_are_held_back():
    r = Resumable("/v1/completions", {"prompt": "x", "max_tokens": 10}, "m", b"req-1")
    r.outgoing(completion_chunk(" a", 5, prompt=[1, 2, 3]))
    assert r.outgoing(completion_chunk("b", 6) + ERROR) == completion_chunk("b", 6, with_ids=False)
    assert r.failed and r.outgoing(b"data: [DONE]\n\n") == b""
    assert b"".join(r.held) == ERROR + b"data: [DONE]\n\n"
    request = r.continuation()
    body = json.loads(request.body)
    assert request.path == "/v1/completions" and request.model == "m"
    assert body["prompt"] == [1, 2, 3, 5, 6] and body["max_tokens"] == 8 and body["stream"] is True
    assert (
        request.header(b"x-request-id").startswith(b"req-1-m1-") and request.header(b"x-summit-avoid-replica") is None
    )
    away = Resumable("/v1/completions", {"prompt": "x", "max_tokens": 10}, "m", b"req-2", avoid_replica=b"rep-dead")
    away.outgoing(completion_chunk(" a", 5, prompt=[1]))
    assert away.continuation().header(b"x-summit-avoid-replica") == b"rep-dead"  # Summit's routers skip it


def test_a_chat_stream_goes_on_as_chat_chunks_with_usage_over_the_whole_stream():
    payload = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_k": 3,
    }
    r = Resumable("/v1/chat/completions", payload, "m", b"req-1")
    first = (
        b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
        b'"prompt_token_ids":[9,9,9,9],"prompt_text":null}\n\n'
    )
    token = (
        b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":" in"},"logprobs":null,"finish_reason":null,"token_ids":[%d]}]}\n\n'
    )
    assert r.outgoing(first) == first.replace(b"[9,9,9,9]", b"null")
    assert r.outgoing(token % 4) == token.replace(b"[%d]", b"null")
    assert r.outgoing(ERROR) == b"" and r.failed
    body = json.loads(r.continuation().body)
    assert body == {
        "temperature": 0,
        "top_k": 3,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
        "model": "m",
        "prompt": [9, 9, 9, 9, 4],
        "stream": True,
        "return_token_ids": True,
    }
    cont = completion_chunk(
        "ch",
        8,
        prompt=[9, 9, 9, 9, 4],
        head='{"id":"cmpl-x","object":"text_completion","created":99,"model":"m","choices":[{"index":0,',
    )
    chat = json.loads(r.rewrite(cont.rstrip(b"\n"))[6:])
    assert chat == {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"content": "ch"}, "logprobs": None, "finish_reason": None, "token_ids": None}
        ],
    }
    last = completion_chunk(
        "!",
        3,
        head='{"id":"cmpl-x","object":"text_completion","created":99,"model":"m","choices":[{"index":0,',
        finish="length",
    )
    assert json.loads(r.rewrite(last.rstrip(b"\n"))[6:])["choices"][0]["finish_reason"] == "length"
    usage = json.loads(r.rewrite(usage_chunk(5, 2).rstrip(b"\n"))[6:])
    assert usage["id"] == "chatcmpl-7" and usage["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 7,
        "completion_tokens": 3,
    }
    assert r.generated == [4, 8, 3]


def test_nothing_to_go_on_from():
    chat = Resumable("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "m", b"req-0")
    assert chat.continuation() is None  # a chat stream before its first output: its templated prompt is not known
    r = Resumable("/v1/completions", {"prompt": "x", "max_tokens": 1}, "m", b"req-1")
    r.outgoing(completion_chunk(" a", 5, prompt=[1]))
    assert r.continuation() is None  # all of max_tokens generated


def test_a_completion_whose_engine_died_before_its_first_output_starts_over_from_its_prompt():
    payload = {"prompt": "Down the valley", "max_tokens": 8, "temperature": 0, "stream": True}
    r = Resumable("/v1/completions", payload, "m", b"req-2")
    body = json.loads(r.continuation().body)
    assert body["prompt"] == "Down the valley" and body["max_tokens"] == 8 and body["return_token_ids"] is True
    assert body["temperature"] == 0 and body["model"] == "m"


class DyingEngineApp:
    """A fake engine app: streams `tokens` completion chunks with their ids, then (`dies`) the error event vLLM writes
    when its engine died, and [DONE]; `dead` is what the front asks."""

    def __init__(self, tokens: int, dies: bool = True):
        self.tokens, self.dies, self.dead, self.bodies = tokens, dies, False, []

    async def __call__(self, scope, receive, send):
        self.bodies.append(json.loads((await receive())["body"]))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        for i in range(self.tokens):
            await send(
                {
                    "type": "http.response.body",
                    "body": completion_chunk(f" t{i}", 100 + i, prompt=[1, 2] if i == 0 else None),
                    "more_body": True,
                }
            )
        if self.dies:
            self.dead = True
            await send({"type": "http.response.body", "body": ERROR, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def dying_front(engine: DyingEngineApp, continuations: list) -> tuple[ReplicaFront, list]:
    sent = []

    def resume_to(request):
        sent.append(json.loads(request.body))
        return continuations.pop(0)

    app = make_front(
        engine, "m", ["m"], None, lambda: engine.dead, "replica-1", migration="greedy", resume_to=resume_to
    )
    return app, sent


async def post(app, body):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        return await client.post("/v1/completions", json=body)


def test_the_front_resumes_a_stream_whose_engine_died_on_another_replica():
    engine = DyingEngineApp(tokens=3)
    other = '{"id":"cmpl-other","object":"text_completion","created":99,"model":"m","choices":[{"index":0,'
    refused = FakeReplicaStream([ResponseStart(503, []), b'{"error": {"message": "dead engine"}}'])
    taken = FakeReplicaStream(
        [
            ResponseStart(200, []),
            completion_chunk(" t3", 103, prompt=[1, 2, 100, 101, 102], head=other),
            completion_chunk(" t4", 104, head=other, finish="length") + b"data: [DONE]\n\n",
        ]
    )
    app, sent = dying_front(engine, [refused, taken])
    r = asyncio.run(post(app, {"model": "m", "prompt": "x", "max_tokens": 5, "temperature": 0, "stream": True}))
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert r.text.endswith("data: [DONE]\n\n") and r.text.count("[DONE]") == 1 and '"error"' not in r.text
    assert "".join(e["choices"][0]["text"] for e in events) == " t0 t1 t2 t3 t4"
    assert {e["id"] for e in events} == {"cmpl-1"} and {e["created"] for e in events} == {17}
    assert all(e["choices"][0]["token_ids"] is None and e["choices"][0]["prompt_token_ids"] is None for e in events)
    assert engine.bodies[0]["return_token_ids"] is True
    assert [s["prompt"] for s in sent] == [[1, 2, 100, 101, 102]] * 2 and sent[0]["max_tokens"] == 2


@pytest.mark.parametrize("body", [{"temperature": 0.5}, {"temperature": 0, "stream": False}])
def test_streams_not_resumed_are_left_as_vllm_answers_them(body):
    engine = DyingEngineApp(tokens=2)
    app, sent = dying_front(engine, [])
    r = asyncio.run(post(app, {"model": "m", "prompt": "x", "max_tokens": 5, "stream": True, **body}))
    assert '"error"' in r.text and not sent and "return_token_ids" not in engine.bodies[0]


def test_an_error_event_from_a_live_engine_reaches_the_client():
    engine = DyingEngineApp(tokens=2)
    engine.dies = False
    app, sent = dying_front(engine, [])

    async def run():
        engine.tokens = 1
        original = engine.__call__

        async def erroring(scope, receive, send):  # an error event while the engine lives: a request's own error
            async def send_with_error(message):
                if message.get("body") == b"data: [DONE]\n\n":
                    await send({"type": "http.response.body", "body": ERROR, "more_body": True})
                await send(message)

            await original(scope, receive, send_with_error)

        app.engine.app = erroring
        return await post(app, {"model": "m", "prompt": "x", "max_tokens": 5, "temperature": 0, "stream": True})

    r = asyncio.run(run())
    assert r.text.endswith(ERROR.decode() + "data: [DONE]\n\n") and not sent


def test_vllms_detokenizer_brought_to_the_cut_writes_what_the_whole_stream_would(tmp_path):
    """The installed vLLM's detokenizer over the tiny model's tokenizer (byte tokens: characters split across tokens):
    text up to a cut + text from the cut (primed with the tokens before it) == the uncut stream's text, for every
    cut."""
    import random
    from types import SimpleNamespace

    from vllm.tokenizers import get_tokenizer

    from app.clusters.tiny_model import make_tiny_model
    from deployments.engine import output_detokenizer

    engine = SimpleNamespace(tokenizer=get_tokenizer(str(make_tiny_model(tmp_path / "m"))))
    rng = random.Random(3)
    prompt = [rng.randrange(4, 500) for _ in range(12)]
    output = [rng.randrange(4, 500) for _ in range(60)]
    whole = output_detokenizer(engine, prompt, [])
    expected = [whole([t], False) for t in output]
    assert sum(1 for t in expected if not t) > 0, "the sample should hold characters split across tokens"
    for cut in range(1, len(output)):
        resumed = output_detokenizer(engine, prompt, output[:cut])
        assert "".join(resumed([t], False) for t in output[cut:]) == "".join(expected[cut:]), cut


# Streams moved off a live engine (ReplicaFront.move_streams), KV carried or recomputed (kv_migration)


class MovableEngineApp:
    """A fake engine app that lives on: a stream request gets `tokens` completion chunks, one per step, and stops
    where its client leaves (as Starlette's streaming response does: no last message); `stepped` is set once
    `at` chunks went out and the stream then waits to be cut. A one-token request with kv_transfer_params (a
    hand-off) is answered with `params`, or `hand_off_status` as an error."""

    def __init__(self, tokens: int, at: int, params: dict | None = None, hand_off_status: int = 200):
        self.tokens, self.at, self.params, self.hand_off_status = tokens, at, params, hand_off_status
        self.bodies: list[dict] = []
        self.stepped = asyncio.Event()
        self.finish_at_cut = False  # the stream's last chunk and [DONE] go out before the cut is seen

    async def __call__(self, scope, receive, send):
        body = json.loads((await receive())["body"])
        self.bodies.append(body)
        if not body.get("stream"):
            status = self.hand_off_status
            answer = {"choices": [{"text": "x"}], "kv_transfer_params": self.params} if status == 200 else {}
            data = json.dumps(answer).encode()
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"json")]})
            await send({"type": "http.response.body", "body": data, "more_body": False})
            return
        left = asyncio.ensure_future(receive())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(self.tokens):
            if left.done():
                return  # the client left (or so the front says): the engine request is aborted
            last = i == self.tokens - 1
            chunk = completion_chunk(f" t{i}", 100 + i, prompt=[1, 2] if i == 0 else None, finish=None)
            if i == self.at - 1 and self.finish_at_cut:
                chunk = completion_chunk(f" t{i}", 100 + i, finish="length") + b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if i == self.at - 1:
                self.stepped.set()
                await asyncio.wait({left})
            elif last:
                break
            await asyncio.sleep(0)
        if not left.done():
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        left.cancel()


def continuation_from(start: int, end: int) -> FakeReplicaStream:
    other = '{"id":"cmpl-other","object":"text_completion","created":99,"model":"m","choices":[{"index":0,'
    chunks = [completion_chunk(f" t{i}", 100 + i, head=other) for i in range(start, end)]
    chunks[-1] = completion_chunk(f" t{end - 1}", 100 + end - 1, head=other, finish="length")
    return FakeReplicaStream([ResponseStart(200, []), *chunks, b"data: [DONE]\n\n"])


def moving_front(engine, continuations: list, min_tokens: int | None):
    sent = []

    def resume_to(request):
        sent.append(json.loads(request.body))
        return continuations.pop(0)

    kv = KVMigration(min_tokens) if min_tokens is not None else None
    app = make_front(
        engine, "m", ["m"], None, lambda: False, "replica-1", migration="greedy", resume_to=resume_to, kv_migration=kv
    )
    return app, sent


def move_after_step(app, engine, tokens: int = 6) -> tuple[httpx.Response, list[dict]]:
    async def run():
        request = asyncio.ensure_future(
            post(app, {"model": "m", "prompt": "x", "max_tokens": tokens, "temperature": 0, "stream": True})
        )
        await engine.stepped.wait()
        moved = await app.move_streams()
        return await request, moved

    return asyncio.run(run())


def texts(r: httpx.Response) -> str:
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert {e["id"] for e in events} == {"cmpl-1"}, r.text
    return "".join(e["choices"][0]["text"] for e in events)


def test_a_moved_stream_hands_its_kv_off_and_goes_on_from_it_elsewhere():
    params = {"do_remote_prefill": True, "remote_block_ids": [7, 8], "remote_engine_id": "e1"}
    engine = MovableEngineApp(tokens=6, at=3, params=params)
    app, sent = moving_front(engine, [continuation_from(3, 6)], min_tokens=4)
    r, moved = move_after_step(app, engine)
    assert texts(r) == " t0 t1 t2 t3 t4 t5" and r.text.count("[DONE]") == 1 and '"error"' not in r.text
    # the hand-off: prompt + tokens so far, one token, the KV kept for a remote decode (vLLM's protocol)
    assert len(engine.bodies) == 2, f"no hand-off request reached the engine: {engine.bodies}"
    hand_off = engine.bodies[1]
    assert hand_off["prompt"] == [1, 2, 100, 101, 102] and hand_off["max_tokens"] == 1 and not hand_off["stream"]
    assert hand_off["kv_transfer_params"]["do_remote_decode"] is True
    # the continuation carries the hand-off's answer: the other engine loads that KV instead of computing it
    assert sent[0]["prompt"] == [1, 2, 100, 101, 102] and sent[0]["kv_transfer_params"] == params
    assert sent[0]["max_tokens"] == 3
    assert moved == [{"request_id": moved[0]["request_id"], "context_tokens": 5, "kv": "kv", "why": None}]


@pytest.mark.parametrize(
    ("min_tokens", "hand_off_status", "why"),
    [(6, 200, "under kv_migration.min_tokens 6"), (4, 500, "the hand-off failed"), (None, 200, "kv_migration is off")],
)
def test_a_moved_stream_that_cannot_carry_its_kv_is_recomputed_elsewhere(min_tokens, hand_off_status, why):
    engine = MovableEngineApp(tokens=6, at=3, params={"remote_block_ids": [7]}, hand_off_status=hand_off_status)
    app, sent = moving_front(engine, [continuation_from(3, 6)], min_tokens=min_tokens)
    r, moved = move_after_step(app, engine)
    assert texts(r) == " t0 t1 t2 t3 t4 t5" and r.text.count("[DONE]") == 1
    assert "kv_transfer_params" not in sent[0] and sent[0]["prompt"] == [1, 2, 100, 101, 102]
    assert moved[0]["kv"] == "recompute" and why in moved[0]["why"], moved
    assert len(engine.bodies) == (2 if hand_off_status != 200 else 1)  # a hand-off only where it was tried


def test_a_carried_continuation_that_fails_goes_on_recomputing():
    engine = MovableEngineApp(tokens=6, at=3, params={"remote_block_ids": [7]})
    other = '{"id":"cmpl-other","object":"text_completion","created":99,"model":"m","choices":[{"index":0,'
    failing = FakeReplicaStream([ResponseStart(200, []), completion_chunk(" t3", 103, head=other), ERROR])
    app, sent = moving_front(engine, [failing, continuation_from(4, 6)], min_tokens=4)
    r, _ = move_after_step(app, engine)
    assert texts(r) == " t0 t1 t2 t3 t4 t5" and '"error"' not in r.text
    assert sent[0]["kv_transfer_params"] == {"remote_block_ids": [7]}
    assert "kv_transfer_params" not in sent[1] and sent[1]["prompt"] == [1, 2, 100, 101, 102, 103]


def test_a_stream_whose_end_went_out_is_not_moved():
    engine = MovableEngineApp(tokens=6, at=3)
    engine.finish_at_cut = True
    app, sent = moving_front(engine, [], min_tokens=1)

    async def run():
        request = asyncio.ensure_future(
            post(app, {"model": "m", "prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True})
        )
        await engine.stepped.wait()
        moved = await app.move_streams()
        request.cancel()  # the fake engine waits for a client that would leave now
        return moved

    assert asyncio.run(run()) == [] and not sent


def test_kv_plan_says_why_a_stream_recomputes():
    r = Resumable("/v1/completions", {"prompt": "x", "stream": True}, "m", b"r")
    kv = KVMigration(4)
    assert kv_plan(r, kv, True) == "no output yet (its prompt's token ids are not known)"
    r.prompt_ids, r.generated = [1, 2], [3]
    assert "3 tokens of context" in kv_plan(r, kv, True)
    r.generated.append(4)
    assert kv_plan(r, kv, True) is None
    assert kv_plan(r, kv, False) == "its engine died (the KV went with it)"
    assert kv_plan(r, None, True) == "kv_migration is off"


def test_a_continuation_counts_min_and_max_tokens_from_the_original_start():
    """A stream moved after 2 tokens goes on with what is left of its own bounds: max_tokens 10 → 8, min_tokens 5 → 3
    (counted from the original request's start, not from the move: the client gets 10 at most and 5 at least in all);
    past min_tokens, none is asked. Completions and chat alike."""
    for path, limit in (("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens")):
        r = Resumable(path, {"prompt": "x", "messages": [], limit: 10, "min_tokens": 5}, "m", b"req-1")
        r.prompt_ids, r.generated = [1, 2, 3], [5, 6]
        body = json.loads(r.continuation().body)
        assert (body["max_tokens"], body["min_tokens"]) == (8, 3), (path, body)
        r.generated = [5, 6, 7, 8, 9, 10]
        assert json.loads(r.continuation().body)["min_tokens"] == 0, path
