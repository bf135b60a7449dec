"""Batch lines on the replica that owns the engine: a group of lines per Serve call (the Batch API's runner, `summit
batch`), each run in this process through vLLM's own serving objects, as vLLM's `run_batch` does: vLLM's request model
checks the body, its `OpenAIServingCompletion` / `OpenAIServingChat` answers, no HTTP round per line. A line the
in-process call does not answer with a 200 (a body vLLM refuses, an error, an adapter's or another model's line, a
disaggregated model) runs through the replica's front and vLLM's HTTP app instead, answered exactly as online.

Lines take a slot of the replica's BatchShare (deployments/batch/share.py): all the engine's sequences while no online
request runs here, `busy_share` of them while one does; the rest wait here."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from deployments import engine
from deployments.batch.share import BatchShare
from deployments.http.asgi import stream_asgi
from deployments.http.protocol import BATCH_LINE_SCOPE_KEY, INTERNAL_SCOPE_KEY, HTTPRequest, ResponseStart

logger = logging.getLogger("ray.serve")


@dataclass
class LineAnswer:
    """One line's answer: its index in the group, the HTTP status and the response body (None if none)."""

    index: int
    status: int
    body: dict | None


class BatchLines:
    def __init__(
        self,
        engine_app,
        front,
        max_num_seqs: int,
        in_process: Callable[[str], bool],
        share: BatchShare,
    ):
        """`in_process(model)`: whether a line for `model` may skip the front (this replica's own base model, not
        disaggregated)."""
        self._engine_app, self._front_app, self._max_num_seqs = engine_app, _as_batch_line(front), max_num_seqs
        self._in_process, self.share = in_process, share
        share.idle_lines = max_num_seqs  # lines beyond the engine's sequences wait here, not in vLLM's queue

    async def run(self, lines: list[dict], busy_share: float | None) -> AsyncIterator[LineAnswer]:
        """`lines`: [{"url", "body", "request_id"}]; each line's answer as it finishes (a caller that goes away
        cancels the lines still running)."""
        if busy_share is not None:
            self.share.busy_lines = max(1, round(busy_share * self._max_num_seqs))
        answers: asyncio.Queue[LineAnswer | BaseException] = asyncio.Queue()

        async def one(index: int, line: dict) -> None:
            try:
                async with self.share.slot():
                    status, body = await self._line(line)
                answers.put_nowait(LineAnswer(index, status, body))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 — handed to the caller, which retries the line
                answers.put_nowait(e)

        tasks = [asyncio.create_task(one(i, line)) for i, line in enumerate(lines)]
        try:
            for _ in tasks:
                answer = await answers.get()
                if isinstance(answer, BaseException):
                    raise answer
                yield answer
        finally:
            for task in tasks:
                task.cancel()

    async def _line(self, line: dict) -> tuple[int, dict | None]:
        return await answer_line(
            self._engine_app.app, self._front_app, line, self._in_process(line["body"].get("model"))
        )


async def answer_line(vllm_app, http_app, line: dict, in_process: bool = True) -> tuple[int, dict | None]:
    """One batch line ({"url", "body", "request_id"}): (status, response body). vLLM's serving objects in this
    process answer it where `in_process` allows and they answer with a 200; else `http_app` does (the replica's front,
    or vLLM's own app), exactly as it answers the same request online."""
    url, body = line["url"], line["body"]
    if in_process:
        answer = await engine.answer_in_process(vllm_app, url, body)
        if answer is not None:
            return 200, answer
    request = HTTPRequest(
        "POST",
        url,
        json.dumps(body).encode(),
        b"",
        [(b"content-type", b"application/json"), (b"x-request-id", line["request_id"].encode())],
        model=body.get("model"),
    )
    status, payload = 500, b""
    async for item in stream_asgi(http_app, request):
        if isinstance(item, ResponseStart):
            status = item.status
        else:
            payload += item
    try:
        return status, (json.loads(payload) if payload else None)
    except ValueError:
        return status, {"error": {"message": payload.decode(errors="replace")[:2000], "code": status}}


def _as_batch_line(front) -> Callable[..., Awaitable[None]]:
    """The replica's front for a batch line: let in where it entered, and not online traffic (BatchShare)."""

    async def app(scope, receive, send) -> None:
        await front({**scope, INTERNAL_SCOPE_KEY: True, BATCH_LINE_SCOPE_KEY: True}, receive, send)

    return app
