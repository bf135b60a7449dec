"""Stream migration on real engines (direct path, 2 replicas): the engine under four temperature-0 streams
(completions and chat, with and without token ids) is killed mid-stream; each client sees one uninterrupted stream
equal, token for token, to the same request run without a fault, and no error.

The references go through HAProxy; the four struck streams go straight to one replica's own HTTP port (where HAProxy
would forward them), so that one kill strikes all four: through HAProxy the route picker places each new stream only
once the busy replica answers its load probe, seconds later on 2 cores, when the first streams are near their end.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.cpu.engine_apps import deployed, replica_ports, running_replicas, serve_log_matches, tiny_model, wait_for
from tests.engine_checks import Throttle, engine_core_processes
from tests.ray_metrics import scrape, total

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny-migrate"
POOL = f"LLMServer:{MODEL}"
TOKENS = 1500  # the victim engine crawls until the strike (Throttle): no stream can end before it
CASES = {
    "completion+ids": ("/v1/completions", {"prompt": "The summit ridge in winter", "return_token_ids": True}),
    "completion": ("/v1/completions", {"prompt": "A long descent from the col"}),
    "chat+ids": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Tell me of the ridge"}], "return_token_ids": True},
    ),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "And of the glacier"}]}),
}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    # KV for every stream at once (≈ 2 KiB a token): with less, vLLM queues the later streams behind the first
    model = tiny_model(
        MODEL,
        {"max_model_len": 8192, "max_num_seqs": 32, "kv_cache_memory_bytes": 256 << 20},
        {"num_replicas": 2, "graceful_shutdown_timeout_s": 60},
    )
    with deployed([model], tiny_model_dir, haproxy=True) as cluster:
        assert wait_for(lambda: len(running_replicas(cluster, POOL)) == 2, 240, 1)
        yield cluster


async def run_streams(base_url: str, strike=None, request_ids: dict[str, str] | None = None) -> dict[str, dict]:
    """The four temperature-0 streams of CASES at once, each read to its end: text, token ids (when asked), usage,
    ids, errors, replica. One event loop reads them all (fair: with a thread each, on 2 cores, CI saw one stream's
    reader 2,500 events ahead of another's); lines are parsed after the end. `strike(progress)`, when given, runs
    beside the streams with each stream's lines so far."""
    progress: dict[str, list[str]] = {name: [] for name in CASES}
    replicas: dict[str, str | None] = {}

    async def one(client: httpx.AsyncClient, name: str, path: str, extra: dict) -> None:
        body = {
            "model": MODEL,
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        headers = {"x-request-id": request_ids[name]} if request_ids else {}
        async with client.stream("POST", path, json=body, headers=headers) as r:
            replicas[name] = r.headers.get("x-summit-replica")
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    progress[name].append(line)

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120, connect=10)) as client:
        streams = [asyncio.create_task(one(client, name, path, extra)) for name, (path, extra) in CASES.items()]
        if strike is not None:
            await strike(progress)
        await asyncio.gather(*streams)
    return {name: {**parsed(progress[name]), "replica": replicas[name]} for name in CASES}


def parsed(lines: list[str]) -> dict:
    seen = {"text": "", "ids": [], "usage": None, "errors": [], "chunk_ids": set(), "done": False, "events": 0}
    for line in lines:
        if line == "data: [DONE]":
            seen["done"] = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            seen["errors"].append(chunk["error"])
            continue
        seen["chunk_ids"].add(chunk["id"])
        seen["usage"] = chunk.get("usage") or seen["usage"]
        for choice in chunk["choices"]:
            seen["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            seen["ids"] += choice.get("token_ids") or []
        seen["events"] += 1
    return seen


def strike_once(app, reference: dict[str, dict]) -> set[str]:
    """The four streams to one replica, whose engine is killed once each has its first events; every stream must
    still equal its reference. The streams resumed elsewhere (the replica's log and Ray's counter agree)."""
    # the victim's engine processes are found before the streams start: Ray's state API takes seconds on 2 cores
    answered: dict = {}

    def a_replica_answers() -> bool:  # after an earlier strike HAProxy's config may still name the dead replica
        for host, port in replica_ports(app):
            try:
                r = httpx.post(
                    f"http://{host}:{port}/v1/completions",
                    timeout=60,
                    json={"model": MODEL, "prompt": "Which replica?", "max_tokens": 1},
                )
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                answered.update(host=host, port=port, victim=r.headers["x-summit-replica"])
                return True
        return False

    assert wait_for(a_replica_answers, 120, 1), replica_ports(app)
    host, port, victim = answered["host"], answered["port"], answered["victim"]
    actor = next(a for a in app.alive_actors() if a["class_name"].endswith(POOL) and a["name"].endswith(victim))
    cores = engine_core_processes(actor["pid"])
    assert cores
    migrations_before = migrations(app)
    request_ids = {name: f"migrate-{i}-{time.time_ns()}" for i, name in enumerate(CASES)}

    async def strike(progress: dict[str, list]) -> None:  # as soon as every stream is under way
        deadline = time.monotonic() + 120
        while not all(progress.values()):
            assert time.monotonic() < deadline, {name: len(p) for name, p in progress.items()}
            await asyncio.sleep(0.01)
        for proc in cores:
            proc.kill()

    # the victim's engine crawls (2 ms of every 250) until the kill: every stream is provably mid-generation when
    # its engine dies, however far behind a starved client reads
    with Throttle(cores):
        migrated = asyncio.run(run_streams(f"http://{host}:{port}", strike, request_ids))

    for name, seen in migrated.items():
        ref = reference[name]
        assert seen["replica"] == victim, (name, seen["replica"], victim)  # one replica's own port
        assert not seen["errors"] and seen["done"], (name, seen["errors"])
        assert len(seen["chunk_ids"]) == 1, f"{name}: one stream id throughout, got {seen['chunk_ids']}"
        assert seen["usage"] == ref["usage"], name
        if ref["ids"]:
            assert len(seen["ids"]) == TOKENS and seen["ids"] == ref["ids"], name
        assert seen["text"] == ref["text"], name
    resumed = {
        name for name, rid in request_ids.items() if serve_log_matches(app, f"request {rid} resumed on another replica")
    }
    # Ray exports metrics every few seconds; a loaded CI box took over 30 s once
    assert wait_for(lambda: migrations(app) - migrations_before == len(resumed), 120, 1), (migrations(app), resumed)
    return resumed


def test_streams_resume_on_another_replica_token_for_token(app):
    reference = asyncio.run(run_streams(app.base_url))
    assert all(r["usage"]["completion_tokens"] == TOKENS and not r["errors"] for r in reference.values())
    resumed = strike_once(app, reference)
    print(f"streams resumed: {sorted(resumed)}")
    # each stream went on from another replica (not merely ended before the strike)
    assert resumed == set(CASES), resumed


def migrations(cluster) -> float:
    return total(scrape(cluster), "ray_summit_stream_migrations_total", model=MODEL, outcome="resumed")


def test_a_continuation_from_any_cut_writes_the_uncut_stream(tmp_path):
    """The installed vLLM in-process, without Ray: a temperature-0 stream's chunks through
    `Resumable.outgoing` are vLLM's own bytes without token ids; cut after k chunks, the continuation request run on
    the same engine and rewritten gives the rest of the uncut stream, text and ids, for completions and chat."""
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

    async def one_token_a_chunk(app, path: str, payload: dict) -> tuple[list[bytes], list[bytes]]:
        """The stream without and with token ids, each chunk one token: vLLM merges the tokens of a consumer that
        falls behind into one chunk (CI: a cold first request got all 60 tokens in its first chunk), and the
        comparison chunk by chunk needs both streams cut alike."""
        for _ in range(5):
            plain = await events(app, path, payload)
            with_ids = await events(app, path, {**payload, "return_token_ids": True})
            per_chunk = [n for n in (len(texts([e])[1]) for e in with_ids) if n]
            if len(plain) == len(with_ids) and per_chunk == [1] * payload["max_tokens"]:
                return plain, with_ids
        raise AssertionError(f"no stream of one token a chunk in 5 tries: {len(plain)}, {len(with_ids)}, {per_chunk}")

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
                plain, with_ids = await one_token_a_chunk(engine_app.app, path, payload)
                _, uncut_ids = texts(with_ids)
                n = len(with_ids)  # ... the last token's chunk, the usage chunk, [DONE]
                for cut in (1, 7, n // 2, n - 3):
                    resume = Resumable(
                        path,
                        payload,
                        "m",
                        b"r",
                        lambda *point: vllm_adapter.output_detokenizer(engine_app.engine, *point),
                    )
                    sent = [resume.outgoing(e + b"\n\n") for e in with_ids[:cut]]
                    assert [same_but_id(e) for e in sent] == [same_but_id(e) for e in plain[:cut]], (path, cut)
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
