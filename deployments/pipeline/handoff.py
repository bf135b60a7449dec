"""Requests an entry passes on through a Serve handle, on both HTTP entries: the Batch API's routes to the BatchAPI
deployment (with the caller's owner), a model's request to one of that model's replicas."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deployments.http.asgi import read_body
from deployments.http.errors import OpenAIError
from deployments.http.protocol import (
    ARRIVAL_HEADER,
    FORWARDED_HEADER,
    OWNER_HEADER,
    TARGET_HEADER,
    HTTPRequest,
    without,
)
from deployments.http.relay import relay
from deployments.pipeline.context import RequestContext

Call = Callable[[HTTPRequest], Any]  # an HTTPRequest -> a Serve response stream (a deployment's handle_http)


async def to_batch_api(ctx: RequestContext, batch_api: Call | None) -> None:
    """/v1/files and /v1/batches: the BatchAPI deployment answers; the body goes as it came (a multipart upload keeps
    its content type), with the caller's owner."""
    if batch_api is None:
        raise OpenAIError(
            404,
            f"{ctx.path}: the Batch API is not enabled in this application; add a `batch:` block "
            "to its args (docs/features/batch.md)",
        )
    body = await read_body(ctx.receive)
    headers = without(ctx.headers, (b"authorization", OWNER_HEADER)) + [(OWNER_HEADER, ctx.owner)]
    await relay(
        batch_api(HTTPRequest(ctx.method, ctx.path, body, ctx.query_string, headers)),
        "the Batch API",
        ctx.receive,
        ctx.send,
    )


def passed_on(ctx: RequestContext, model: str, extra: list[tuple[bytes, bytes]] = ()) -> HTTPRequest:
    """The request as it goes on to `model`'s replica: without the API key, with who asks and when it arrived (first
    hop's)."""
    headers = without(ctx.headers, (b"authorization", ARRIVAL_HEADER, TARGET_HEADER, OWNER_HEADER))
    headers += [*extra, (ARRIVAL_HEADER, f"{time.time():.6f}".encode()), (OWNER_HEADER, ctx.caller)]
    return HTTPRequest(ctx.method, ctx.path, ctx.body or b"", ctx.query_string, headers, model=model)


async def to_keeper(ctx: RequestContext, replica: str, model: str | None, forward: Call | None, gone: OpenAIError):
    """A request about what one replica keeps in its memory (a stored response, a stream's journal) goes on to that
    replica (Summit's routers send it there while it lives) — once: a request passed on already, of no model here,
    or with nowhere to go, is answered `gone`."""
    if model is None or forward is None or ctx.header(FORWARDED_HEADER):
        raise gone
    extra = [(FORWARDED_HEADER, b"1"), (TARGET_HEADER, replica.encode())]
    await relay(forward(passed_on(ctx, model, extra)), model, ctx.receive, ctx.send)


async def to_model_replica(ctx: RequestContext, model: str, forward: Call | None, here: str) -> None:
    """A request for another model of the deployment (a body cut at HAProxy's buffer, a stale route, a LoRA load for
    another model) goes on to one of `model`'s replicas — once: a request handed on already is refused."""
    if forward is None or ctx.header(FORWARDED_HEADER):
        raise OpenAIError.unavailable(f"this replica serves {here!r}, not {model!r}; retry")
    await relay(forward(passed_on(ctx, model, [(FORWARDED_HEADER, b"1")])), model, ctx.receive, ctx.send)
