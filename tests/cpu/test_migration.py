"""Stream migration's continuation on the installed vLLM, in-process (no Ray): a stream cut at any chunk and continued
on the same engine gives the rest of the uncut stream, text and token ids.

The migration itself (real engines killed under temperature-0 streams on the direct path) is
`test_faults.py::test_streams_resume_on_another_replica_token_for_token`: it shares the fault cases' app, one cluster
and two engines fewer for CI."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.timeout(900)

_TEXT = re.compile(rb'"(text|content)":"(?:[^"\\]|\\.)*"')  # a JSON string's value, escapes and all


def test_a_continuation_from_any_cut_writes_the_uncut_stream(tmp_path):
    """The installed vLLM in-process, without Ray: a temperature-0 stream's chunks through
    `Resumable.outgoing` are vLLM's own bytes without token ids; cut after k chunks, the continuation request run on
    the same engine and rewritten gives the rest of the uncut stream, text and ids, for completions and chat. At
    least three cuts a route are checked (after the first chunk, mid-stream, near the end): a stream that vLLM merged
    into too few chunks is asked again, and fails the test rather than leave nothing to check. Fails if a
    continuation repeats, skips or re-numbers a token."""
    import asyncio

    from app.clusters.tiny_model import make_tiny_model
    from deployments import engine as vllm_adapter
    from deployments.http.asgi import stream_asgi
    from deployments.http.protocol import HTTPRequest, ResponseStart
    from deployments.pipeline.resumable import Resumable

    model = make_tiny_model(tmp_path / "m")
    kwargs = {"max_model_len": 1024, "enforce_eager": True, "dtype": "bfloat16", "kv_cache_memory_bytes": 64 << 20}

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
        args = vllm_adapter.serve_namespace(str(model), "m", kwargs, {})
        engine_app = await vllm_adapter.start_engine_app(args, metrics=False)
        try:
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
        finally:
            vllm_adapter.shutdown_engine(engine_app.engine)

    asyncio.run(run())
