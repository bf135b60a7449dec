"""A client's resume of its stream (`Last-Event-ID` on a generation route; http/stream_ids.py), as a replica's front
answers it: from the stream's journal in this process, or passed on to the process that keeps it — another replica
(through a Serve handle pinned to it, as a stored response's request goes), or another process of this replica (the
replica asks its front process; a front process asks the replica, which asks the one that keeps it)."""

from __future__ import annotations

import logging

from deployments.http.errors import OpenAIError
from deployments.http.protocol import REPLICA_HEADER
from deployments.http.relay import relay, until_disconnect
from deployments.http.stream_ids import STREAM_HEADER, StreamPoint
from deployments.pipeline.context import RequestContext
from deployments.pipeline.handoff import to_keeper
from deployments.server.stream_journal import follow

logger = logging.getLogger("ray.serve")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def resume_stream(front, ctx: RequestContext, point: StreamPoint) -> None:
    """Answer a resume: the events after `point.seen`, then the live rest, in one SSE response."""
    options, here = front.options, front.engine.replica_id
    model = point.model(front.table.names())
    if model is None:
        raise OpenAIError(404, f"stream {point.stream!r} not found: not a stream of this app", param="Last-Event-ID")
    if point.replica != here or (point.front != options.front_index and options.siblings is None):
        await _to_replica(front, ctx, point, model)  # another replica, or (from a front process) the replica's own
        return
    if options.journals is None:
        raise OpenAIError(
            404,
            f"stream {point.stream!r} not found: {front.table.model!r} keeps no streams to resume "
            "(models[].stream_resume is off)",
            param="Last-Event-ID",
        )
    if point.front != options.front_index:  # the replica itself, for one of its front processes
        await relay(
            options.siblings(point.front, point, ctx.caller), "the replica's front process", ctx.receive, ctx.send
        )
        return
    journal = options.journals.find(point, ctx.caller)
    headers = [*SSE_HEADERS, (STREAM_HEADER, point.stream.encode()), (REPLICA_HEADER, here.encode())]
    await ctx.send({"type": "http.response.start", "status": 200, "headers": headers})

    async def sink(data: bytes, more: bool) -> None:
        await ctx.send({"type": "http.response.body", "body": data, "more_body": more})

    outcome = await follow(journal, point.seen, sink, until_disconnect(ctx.receive))
    logger.info("stream %s resumed after event %d: %s", point.stream, point.seen, outcome)


async def _to_replica(front, ctx: RequestContext, point: StreamPoint, model: str) -> None:
    gone = OpenAIError(
        410,
        f"stream {point.stream!r} can no longer be resumed: the replica that kept it ({point.replica}) no longer "
        "runs (streams are kept in their replica's memory)",
        param="Last-Event-ID",
    )
    await to_keeper(ctx, point.replica, model, front.options.to_keeper, gone)
