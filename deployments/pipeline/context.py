"""One request as the pipeline sees it, and how its steps run.

Both HTTP entries (the replica front on the direct path, the two-hop ingress) build a `RequestContext` from the ASGI
call and run ordered steps over it. A step is one small unit with one job: `async step(ctx)` returns None (go on) or
an `OpenAIError` (stop: the entry answers it, in one place). A step that answered the client itself, or found nobody
left to answer, raises `Answered`. What a step holds for the rest of the request (an admission slot, a loaded LoRA
adapter) goes on `ctx.exits`, released when the request ends.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from deployments.http.asgi import lifespan
from deployments.http.errors import OpenAIError
from deployments.http.protocol import INTERNAL_SCOPE_KEY, OWNER_HEADER, REQUEST_ID_HEADER, header


class Answered(Exception):  # noqa: N818 — a signal, not an error
    """The request is over: a step answered the client itself (or the client left)."""


@dataclass
class RequestContext:
    scope: dict
    receive: Callable[[], Awaitable[dict]]
    send: Callable[[dict], Awaitable[None]]
    body: bytes | None = None  # read by the body step (bounded)
    payload: dict | None = None  # the parsed body of a generation route (None: not parsed, or not to be resumed)
    model: str | None = None  # the model (or LoRA adapter) the body names
    owner: bytes = b""  # a hash of the caller's API key: owner of its files and batches, its rate-limit bucket
    watch: Any = None  # the request's metrics and trace on its engine replica (observability/watch.RequestWatch)
    resume: Any = None  # a stream that goes on elsewhere if this engine dies (pipeline/migration.Resumable)
    exits: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    @property
    def method(self) -> str:
        return self.scope["method"]

    @property
    def path(self) -> str:
        return self.scope["path"]

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return self.scope.get("headers") or []

    @property
    def query_string(self) -> bytes:
        return self.scope.get("query_string", b"")

    @property
    def internal(self) -> bool:
        """Came through a Serve handle (another replica, the ingress, the batch runner): let in where it entered."""
        return bool(self.scope.get(INTERNAL_SCOPE_KEY))

    def header(self, name: bytes) -> bytes | None:
        return header(self.headers, name)

    @property
    def caller(self) -> bytes:
        """Who is asking (a hash of its API key; empty with keys off): checked here, or told by the Summit hop that
        checked it (`x-summit-owner`, trusted only on a request that came through a Serve handle)."""
        return (self.header(OWNER_HEADER) or b"") if self.internal else self.owner

    @property
    def client_request_id(self) -> bytes:
        """The client's `x-request-id`, or a new one (kept once made)."""
        if "_request_id" not in self.__dict__:
            self.__dict__["_request_id"] = self.header(REQUEST_ID_HEADER) or uuid.uuid4().hex.encode()
        return self.__dict__["_request_id"]


Step = Callable[[RequestContext], Awaitable[OpenAIError | None]]


async def run_steps(steps: Iterable[Step], ctx: RequestContext) -> None:
    """Run `steps` in order; the first refusal is raised (the entry answers it)."""
    for step in steps:
        if (refusal := await step(ctx)) is not None:
            raise refusal


async def answer(ctx: RequestContext, handler: Callable[[RequestContext], Awaitable[None]]) -> None:
    """Run one request's handler: a refusal raised anywhere in it is answered here, what its steps held is released."""
    try:
        async with ctx.exits:
            await handler(ctx)
    except OpenAIError as e:
        await e.send_to(ctx.send)
    except Answered:
        pass


class Entry:
    """An HTTP entry as an ASGI app: each request answered by `handler` (through `answer`); nothing to start or stop
    at lifespan. An object with an async `__call__`, which servers take for ASGI 3 (a bound method they would not)."""

    def __init__(self, handler: Callable[[RequestContext], Awaitable[None]]):
        self._handler = handler

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
        elif scope["type"] == "http":
            await answer(RequestContext(scope, receive, send), self._handler)
