"""Stream migration's continuation on the installed vLLM, in-process (no Ray): a stream cut at any chunk and continued
on the same engine gives the rest of the uncut stream, text and token ids. And a client-resumable stream
(`stream_resume`) on the two-hop path's replica side: dropped, resumed with `Last-Event-ID`, missed events then the
live rest. The module's tests share one engine.

The migration itself (real engines killed under temperature-0 streams on the direct path) is
`test_faults.py::test_streams_resume_on_another_replica_token_for_token`: it shares the fault cases' app, one cluster
and two engines fewer for CI."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.timeout(900)

_TEXT = re.compile(rb'"(text|content)":"(?:[^"\\]|\\.)*"')  # a JSON string's value, escapes and all


class InProcessEngine:
    """One engine of the installed vLLM in this process, on an event loop of its own (a thread): the module's tests
    share it (one engine start for CI). `run(coro)` runs a coroutine there."""

    def __init__(self, model_dir):
        import asyncio
        import threading

        from deployments import engine as vllm_adapter

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        kwargs = {"max_model_len": 1024, "enforce_eager": True, "dtype": "bfloat16", "kv_cache_memory_bytes": 64 << 20}
        args = vllm_adapter.serve_namespace(str(model_dir), "m", kwargs, {})
        self.app = self.run(vllm_adapter.start_engine_app(args, metrics=False))

    def run(self, coro, timeout_s: float = 600):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        from deployments import engine as vllm_adapter

        vllm_adapter.shutdown_engine(self.app.engine)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from app.clusters.tiny_model import make_tiny_model

    started = InProcessEngine(make_tiny_model(tmp_path_factory.mktemp("migration") / "m"))
    try:
        yield started
    finally:
        started.stop()


def test_a_continuation_from_any_cut_writes_the_uncut_stream(engine):
    """The installed vLLM in-process, without Ray: a temperature-0 stream's chunks through
    `Resumable.outgoing` are vLLM's own bytes without token ids; cut after k chunks, the continuation request run on
    the same engine and rewritten gives the rest of the uncut stream, text and ids, for completions and chat. At
    least three cuts a route are checked (after the first chunk, mid-stream, near the end): a stream that vLLM merged
    into too few chunks is asked again, and fails the test rather than leave nothing to check. Fails if a
    continuation repeats, skips or re-numbers a token."""
    from deployments import engine as vllm_adapter
    from deployments.http.asgi import stream_asgi
    from deployments.http.protocol import HTTPRequest, ResponseStart
    from deployments.pipeline.resumable import Resumable

    async def events(app, path: str, body: dict) -> list[bytes]:
        out = b""
        async for item in stream_asgi(
            app, HTTPRequest("POST", path, json.dumps(body).encode(), headers=[(b"content-type", b"application/json")])
        ):
            if not isinstance(item, ResponseStart):
                out += item
        return [e for e in out.split(b"\n\n") if e]

    def same_but_id(event: bytes) -> bytes:  # vLLM's own bytes, but for the request's own id and time
        chunk = json.loads(event.strip()[6:])
        return event.strip().replace(chunk["id"].encode(), b"ID").replace(b'"created":%d' % chunk["created"], b"")

    def texts(chunks: list[bytes]) -> tuple[str, list[int]]:
        text, ids = "", []
        for e in chunks:
            if e.startswith(b"data: {"):
                for choice in json.loads(e[6:])["choices"]:
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    ids += choice.get("token_ids") or []
        return text, ids

    def skeleton(event: bytes) -> bytes:
        """An event as vLLM writes it, but for its request's id and time and its text: vLLM merges the tokens of a
        consumer that falls behind into one chunk (a loaded CI box merged up to 32), so two runs of one request can be
        cut into different chunks; their chunks' bytes must still be vLLM's own around the text."""
        return _TEXT.sub(rb'"\1":"T"', same_but_id(event)) if event.startswith(b"data: {") else event

    async def uncut(app, path: str, body: dict, chunks: int) -> list[bytes]:
        """vLLM's own stream in at least `chunks` chunks before its last: a loaded box can merge a lagging consumer's
        tokens (one CI run got the whole answer in its final chunk), which leaves too few places to cut; the stream is
        the same at temperature 0, so ask again, and fail rather than check fewer cuts."""
        for _ in range(8):
            stream = await events(app, path, body)
            if sum(b'"finish_reason":null' in e for e in stream) >= chunks:
                return stream
        raise AssertionError(f"{path}: vLLM merged the stream into fewer than {chunks} chunks in 8 tries: {stream[:3]}")

    async def run() -> None:
        engine_app = engine.app
        for path, extra in (
            ("/v1/completions", {"prompt": "The ridge at dawn"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}]}),
        ):
            payload = {
                "model": "m",
                "max_tokens": 60,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }
            plain = await uncut(engine_app.app, path, payload, 2)
            with_ids = await uncut(engine_app.app, path, {**payload, "return_token_ids": True}, 10)
            uncut_text, uncut_ids = texts(with_ids)
            assert uncut_text == texts(plain)[0] and len(uncut_ids) == payload["max_tokens"], path
            assert any(b'"token_ids":null' in e for e in plain), plain[:2]  # vLLM writes it so without ids
            vllms_own = {skeleton(e) for e in plain}
            n = len(with_ids)  # ... the last token's chunk, the usage chunk, [DONE]
            cuts = sorted({c for c in (1, 7, n // 2, n - 3) if 1 <= c <= n - 3})
            assert len(cuts) >= 3, (path, n)  # at least 10 chunks: the first, one mid-stream, one near the end
            for cut in cuts:
                resume = Resumable(
                    path,
                    payload,
                    "m",
                    b"r",
                    lambda *point: vllm_adapter.output_detokenizer(engine_app.engine, *point),
                )
                sent = [resume.outgoing(e + b"\n\n") for e in with_ids[:cut]]
                assert all(b'"token_ids":[' not in e for e in sent), (path, cut)
                assert {skeleton(e) for e in sent} <= vllms_own, (path, cut, sent[:2], plain[:2])
                resume.outgoing(b'data: {"error": {"message": "engine died"}}\n\n')
                assert resume.failed and len(resume.generated) == len(texts(with_ids[:cut])[1])
                request = resume.continuation()
                rest = await events(engine_app.app, request.path, json.loads(request.body))
                written = [resume.rewrite(e) for e in rest]
                assert texts(sent)[0] + texts(written)[0] == texts(plain)[0], (path, cut)
                assert resume.generated == uncut_ids, (path, cut)
                usage = [json.loads(e[6:])["usage"] for e in written if b'"usage"' in e]
                assert usage == [json.loads(plain[-2][6:])["usage"]], (path, cut)
                assert written[-1] == b"data: [DONE]"

    engine.run(run())


def test_a_stream_dropped_on_the_two_hop_path_resumes_with_the_missed_events_then_the_live_rest(engine):
    """The two-hop path's replica side on the installed vLLM, in-process: Summit's front with stream_resume on, driven
    through the bridge `LLMServer.handle_http` runs (`stream_asgi`, the request marked internal as from the ingress).
    A temperature-0 chat stream read for 3 events, its engine core then paused (SIGSTOP: the stream cannot end), the
    bridge closed as Serve closes it when the ingress's client leaves; a resume (`Last-Event-ID`, no body) gets the
    events written so far, and — once the engine runs again — the live rest: with the dropped part, one stream (ids
    1..N) with the text of an uncut run. Fails if the client's leaving aborts the engine request (the resume is 410),
    or the journal repeats or loses events."""
    import psutil

    from deployments.http.asgi import stream_asgi
    from deployments.http.protocol import INTERNAL_SCOPE_KEY, HTTPRequest, ResponseStart
    from deployments.server.front import EngineSide, FrontOptions, ReplicaFront
    from deployments.server.models import ModelTable
    from deployments.server.stream_journal import StreamJournals
    from tests.engine_checks import titled
    from tests.resume_checks import text_of

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    json_headers = [(b"content-type", b"application/json")]

    def events(data: bytes) -> list[tuple[str | None, str]]:
        out = []
        for event in (e for e in data.split(b"\n\n") if e.strip()):
            fields = dict(line.split(": ", 1) for line in event.decode().splitlines())
            out.append((fields.get("id"), fields["data"]))
        return out

    async def run() -> None:
        engine_app = engine.app
        journals = StreamJournals(window_s=120, max_bytes=1 << 24)
        front = ReplicaFront(
            EngineSide(engine_app.app, lambda: False, "r1"), ModelTable("m", ["m"]), FrontOptions(journals=journals)
        )

        async def internal(scope, receive, send):  # as LLMServer._internal_front: the ingress let it in
            await front({**scope, INTERNAL_SCOPE_KEY: True}, receive, send)

        (core,) = titled(psutil.Process().children(recursive=True), "EngineCore")
        try:
            uncut = b""
            plain = HTTPRequest("POST", "/v1/chat/completions", json.dumps(body).encode(), headers=json_headers)
            async for item in stream_asgi(internal, plain):
                uncut += b"" if isinstance(item, ResponseStart) else item
            whole = events(uncut)
            for _ in range(5):  # caught mid-stream: a starved test process can find the tiny model's stream done
                bridge = stream_asgi(
                    internal,
                    HTTPRequest("POST", "/v1/chat/completions", json.dumps(body).encode(), headers=json_headers),
                )
                start, first = await bridge.__anext__(), b""
                while len(events(first)) < 3:
                    first += await bridge.__anext__()
                core.suspend()  # the engine stops mid-stream: nothing more until it runs again
                journal = list(journals.streams.values())[-1]
                if not journal.ended:
                    break
                core.resume()
                await bridge.aclose()
            await bridge.aclose()  # the ingress's client left: Serve closes the replica's generator
            assert not journal.ended and not journal.abort.is_set(), "the request ended with its client"
            got = events(first)
            resume = stream_asgi(
                internal,
                HTTPRequest("POST", "/v1/chat/completions", b"", headers=[(b"last-event-id", got[-1][0].encode())]),
            )
            again_start, rest = await resume.__anext__(), b""
            assert again_start.status == 200, again_start
            while len(got) + len(events(rest)) < journal.count:  # what the engine wrote before it stopped
                rest += await resume.__anext__()
            assert not journal.ended  # the rest is still to come: live
            core.resume()
            async for item in resume:
                rest += item
            both = got + events(rest)
            numbers = [int(i.rsplit(":", 1)[1]) for i, _ in both]
            assert numbers == list(range(1, len(both) + 1)) and both[-1][1] == "[DONE]", numbers
            assert dict(start.headers)[b"x-summit-stream-id"] == dict(again_start.headers)[b"x-summit-stream-id"]
            assert text_of(both) == text_of(whole) and text_of(whole), (text_of(both), text_of(whole))
        finally:
            if core.status() == psutil.STATUS_STOPPED:
                core.resume()

    engine.run(run())
