"""The in-process ASGI bridge, driven with a small ASGI app (no engine)."""

from __future__ import annotations

import asyncio

from deployments.http.asgi import stream_asgi
from deployments.http.errors import openai_error_bytes
from deployments.http.protocol import HTTPRequest, ResponseStart


def make_app(chunks: list[bytes], delay_s: float, events: list):
    async def app(scope, receive, send):
        request = await receive()
        events.append(("body", request["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        try:
            for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await asyncio.sleep(delay_s)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            events.append(("cancelled",))
            raise

    return app


async def collect(app, coalesce_s: float) -> list:
    return [item async for item in stream_asgi(app, HTTPRequest("POST", "/x", b"payload"), coalesce_s)]


def test_forwards_start_then_each_chunk():
    events: list = []
    items = asyncio.run(collect(make_app([b"a", b"b", b"c"], 0.02, events), 0.0))
    assert isinstance(items[0], ResponseStart) and items[0].status == 200
    assert items[1:] == [b"a", b"b", b"c"]
    assert events == [("body", b"payload")]


def test_coalesces_after_the_first_chunk():
    flushed = asyncio.Event()

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"1", b"2", b"3"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.wait_for(flushed.wait(), 60)  # until the window's timer has written 2 and 3
        for chunk in (b"4", b"5"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def run() -> list:
        items = []
        async for item in stream_asgi(app, HTTPRequest("POST", "/x", b"payload"), 0.05):
            items.append(item)
            if item == b"23":
                flushed.set()
        return items

    items = asyncio.run(run())
    # the first chunk is never held back; the window's timer writes what it gathered; the end writes the rest
    assert items[1:] == [b"1", b"23", b"45"]


def test_consumer_going_away_cancels_the_app():
    events: list = []

    async def run():
        gen = stream_asgi(make_app([b"x"] * 1000, 0.01, events), HTTPRequest("POST", "/x"))
        assert isinstance(await gen.__anext__(), ResponseStart)
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(run())
    assert ("cancelled",) in events


def test_error_bodies_become_openai_shaped():
    kept = b'{"error": {"message": "m", "type": "BadRequestError", "param": null, "code": 400}}'
    assert openai_error_bytes(400, kept) == kept
    import json

    wrapped = json.loads(openai_error_bytes(405, b'{"detail": "Method Not Allowed"}'))
    assert wrapped == {
        "error": {"message": "Method Not Allowed", "type": "MethodNotAllowed", "param": None, "code": 405}
    }
    assert json.loads(openai_error_bytes(500, b"oops"))["error"]["message"] == "oops"


def test_an_app_error_during_cancellation_is_logged_not_swallowed(caplog):
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    async def consume_one():
        stream = stream_asgi(app, HTTPRequest("POST", "/x", b""))
        assert isinstance(await stream.__anext__(), ResponseStart)
        assert await stream.__anext__() == b"first"
        await stream.aclose()  # the consumer goes away: the app is cancelled and fails while cancelling

    with caplog.at_level("ERROR", logger="ray.serve"):
        asyncio.run(consume_one())
    assert any(
        "cancelled" in r.getMessage() and "cleanup failed" in (r.exc_text or str(r.exc_info)) for r in caplog.records
    )
