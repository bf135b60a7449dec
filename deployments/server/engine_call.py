"""The pipeline's last step on an engine replica: one request through vLLM's own OpenAI app on this replica's engine.

The engine gets the client's `x-request-id` plus a unique suffix (a reused id cannot collide inside vLLM; Serve answers
with the client's id). An error that is not a stream comes out OpenAI-shaped; a 5xx that the request itself caused
(a body vLLM's validators crash on) becomes the 400 naming the field; a 5xx from an engine that died is a 503 +
Retry-After. A stream's chunks are coalesced (stream_coalesce_ms). A stream that can be resumed goes on from another
replica when this engine dies under it, or when the replica is told to move its streams (`move`; pipeline/migration.py
says how, and when the KV goes along). A client that leaves makes vLLM abort the request,
unless the stream is resumable by its client (`stream_resume`): then its events go into the stream's journal
(server/stream_journal.py) and the engine goes on until the client comes back or the window passes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from deployments.engine import responses_input_problem
from deployments.http.asgi import end_after_disconnect
from deployments.http.errors import OpenAIError, openai_error_bytes, request_problem, structured_output_problem
from deployments.http.protocol import AVOID_HEADER, HOP_HEADERS, REPLICA_HEADER, REQUEST_ID_HEADER, header, without
from deployments.http.stream_ids import STREAM_HEADER, new_stream_id
from deployments.pipeline.context import RequestContext
from deployments.pipeline.migration import HandOffFailed, hand_off, kv_plan, move_or_fail, resume_or_fail
from deployments.server.coalesce import Coalescer
from deployments.server.stream_journal import Journal

logger = logging.getLogger("ray.serve")

_DROP_RESPONSE_HEADERS = frozenset({b"x-request-id", b"date", b"server"})
_DIED = "The model engine of this replica died; it is being replaced. Retry."


class EngineCall:
    def __init__(self, front, ctx: RequestContext):
        self.front, self.ctx = front, ctx
        self.engine, self.options = front.engine, front.options
        self.resume = ctx.resume  # a stream that goes on elsewhere if this engine dies
        self.body_given = self.answered = self.gone = False
        self.error: dict | None = None  # a non-stream error response, buffered to reshape it
        self.stream: Coalescer | None = None  # a streamed (SSE) answer
        self.journal: Journal | None = None  # a stream its client can resume (stream_resume)
        self.sink = self._to_connection  # this connection, as the journal's reader (one bound method: its identity)
        self.client_id = ctx.client_request_id.decode()
        self._moved = asyncio.Event()  # told to move: vLLM's app is told its client left (it aborts the engine request)
        self.moving: asyncio.Future | None = None  # what the move did (move_streams reports it)
        self._recompute = False  # the move was asked not to carry the KV
        self.away = False  # its client left a stream it may resume (stream_resume): the engine goes on meanwhile
        self._client_message: asyncio.Future | None = None  # the client's next ASGI message, asked once at a time

    async def run(self) -> None:
        ctx = self.ctx
        headers = without(ctx.headers, HOP_HEADERS) + [
            (REQUEST_ID_HEADER, ctx.client_request_id + b"-" + uuid.uuid4().hex[:8].encode()),
            (b"content-length", str(len(ctx.body)).encode()),
        ]
        # vLLM's app in a task of its own: when the caller goes, Serve cancels this one (direct path; the two-hop path
        # cancels the bridge's), and the app ends by itself once `receive` says http.disconnect, aborting the engine
        # request (asgi.end_after_disconnect says why a cancellation must not reach it first)
        app = asyncio.ensure_future(self.engine.app({**ctx.scope, "headers": headers}, self.receive, self.send))
        detached = False
        if self.resume is not None:
            self.front.streams.add(self)  # one the replica can be told to move
        try:
            await asyncio.shield(app)
            await self._after_app()
        except asyncio.CancelledError:
            if self.journal is not None and self.journal.lost is None and not app.done():
                detached = True  # its client may come back: the engine goes on, holding what the request holds
                self._go_on_detached(app)
                raise
            self._cancelled()
            if not app.done():
                await end_after_disconnect(app)
            raise
        except Exception as e:
            if not self.answered:
                raise
            # Starlette re-raises what its error handler answered (a 500): the client has its answer; one line
            # here, not a traceback per bad request
            logger.warning(
                "request %s: vLLM's app raised %s after answering: %s", self.client_id, type(e).__name__, str(e)[:200]
            )
        finally:
            self.front.streams.discard(self)
            if self.moving is not None and not self.moving.done():
                self.moving.set_result(self._moved_as("ended", "it ended before it was cut"))
            if self.stream is not None:
                self.stream.close()
            if self.journal is not None and not detached:
                self.journal.close()

    async def _after_app(self) -> None:
        resume = self.resume
        if resume is None:
            return
        if resume.failed:  # vLLM ended the stream with an error event
            await self._resume_elsewhere()
        elif resume.moving and not self.gone and not self.answered:  # vLLM's app ended where it was told to
            if resume.ended:  # its last tokens were out before the cut: its end (vLLM's own [DONE] if it came)
                await self.to_client(b"" if resume.done else b"data: [DONE]\n\n", False)
                self.answered = True
            else:
                await self._move_elsewhere()

    def move(self, recompute: bool = False) -> asyncio.Future | None:
        """Move this stream to another replica now (its future: what the move did; `recompute`: without its KV);
        None when it cannot move (not resumable, ended, failed, its client gone or away, or moving already)."""
        resume = self.resume
        if resume is None or resume.failed or resume.moving or resume.ended or self.answered or self.gone or self.away:
            return None
        resume.moving = True
        self._recompute = recompute
        self.moving = asyncio.get_running_loop().create_future()
        self._moved.set()
        return self.moving

    def _moved_as(self, kv: str, why: str | None) -> dict:
        resume = self.resume
        context = len(resume.prompt_ids or []) + len(resume.generated)
        return {"request_id": self.client_id, "context_tokens": context, "kv": kv, "why": why}

    def _go_on_detached(self, app: asyncio.Task) -> None:
        """The caller's task was cancelled (its client left) under a resumable stream: the request goes on in a task of
        its own, with what it holds (admission slot, awake engine, adapter: `ctx.exits`), until it ends or is aborted
        (the journal's window)."""
        self.journal.leave(self.sink)
        exits = self.ctx.exits.pop_all()

        async def finish() -> None:
            try:
                await app
                await self._after_app()
            except Exception as e:  # noqa: BLE001 — nobody to answer: say it once
                logger.warning("request %s (its client away) ended with %s: %s", self.client_id, type(e).__name__, e)
            finally:
                self.journal.close()
                await exits.aclose()

        task = asyncio.ensure_future(finish())
        self.front.detached.add(task)
        task.add_done_callback(self.front.detached.discard)

    async def receive(self) -> dict:
        if not self.body_given:
            self.body_given = True
            if self.ctx.watch is not None:
                self.ctx.watch.engine_received()
            return {"type": "http.request", "body": self.ctx.body, "more_body": False}
        if self.resume is None:
            message = await self.ctx.receive()  # http.disconnect when the client goes: vLLM aborts the engine request
        else:  # or when the stream is told to move (vLLM's app is not told why)
            client = asyncio.ensure_future(self._client_receive())
            moved = asyncio.ensure_future(self._moved.wait())
            try:
                await asyncio.wait({client, moved}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (client, moved):
                    if not t.done():
                        t.cancel()
            if not client.done() or client.cancelled():
                return {"type": "http.disconnect"}
            message = client.result()
        if message["type"] == "http.disconnect":
            if self.journal is not None:  # unless the client may resume the stream: then once the window passed
                self.journal.leave(self.sink)
                self.away = True  # not moved meanwhile: the cut would wait for this
                await self.journal.abort.wait()
            self._cancelled()
        return message

    async def _client_receive(self) -> dict:
        """The client's next ASGI message; a caller cancelled meanwhile leaves it asked for the next caller."""
        if self._client_message is None:
            self._client_message = asyncio.ensure_future(self.ctx.receive())
        message = await asyncio.shield(self._client_message)
        self._client_message = None
        return message

    def _cancelled(self) -> None:
        self.gone = True  # what the app sends from now on has no one to reach
        if not self.answered:
            self.answered = True  # once
            logger.info("request %s cancelled by its caller: aborting it in the engine", self.client_id)
            if self.ctx.watch is not None:
                self.ctx.watch.end(aborted=True)

    async def send(self, message: dict) -> None:
        if self.gone and self.journal is None:
            return
        if message["type"] == "http.response.start":
            await self._start(message)
        elif message["type"] == "http.response.body":
            await self._body(message)
        else:
            await self.ctx.send(message)

    async def _start(self, message: dict) -> None:
        out = without(message.get("headers", []), _DROP_RESPONSE_HEADERS)
        out.append((REPLICA_HEADER, self.engine.replica_id.encode()))  # Serve adds the x-request-id it was given
        status = message["status"]
        if self.ctx.watch is not None:
            self.ctx.watch.status = status
            self.ctx.watch.response_headers(out)
        message = {**message, "headers": out}
        is_sse = (header(out, b"content-type") or b"").startswith(b"text/event-stream")
        if not is_sse or status != 200:
            self.resume = None
        if status >= 500 and self.engine.dead():  # the engine died under this request
            self.error = {"start": message, "body": [], "refusal": OpenAIError.unavailable(_DIED)}
        elif status >= 400 and not is_sse:
            self.error = {"start": message, "body": []}
            if status >= 500:  # the request's own fault, where vLLM calls it internal: a 400 naming the field
                self.error["refusal"] = self._request_fault()
        elif is_sse and self.options.coalesce_s > 0:
            self.stream = Coalescer(self.ctx.send, self.options.coalesce_s)
        journals = self.options.journals
        if journals is not None and is_sse and status == 200 and not self.ctx.header(AVOID_HEADER):
            stream_id = new_stream_id(self.front.table.model, self.options.front_index, self.engine.replica_id)
            self.journal = journals.open(stream_id, self.ctx.caller)
            await self.journal.read(self.sink)
            out.append((STREAM_HEADER, stream_id.encode()))
        if self.error is None:
            await self.ctx.send(message)

    def _request_fault(self) -> OpenAIError | None:
        if problem := request_problem(self.engine.app, self.ctx.path, self.ctx.body):
            return OpenAIError(400, problem)
        if structured := structured_output_problem(self.ctx.body):
            field, message = structured
            return OpenAIError(400, message, param=field)
        if self.ctx.path == "/v1/responses" and (item := responses_input_problem(self.ctx.body)):
            field, message = item
            return OpenAIError(400, message, param=field)
        return None

    async def _body(self, message: dict) -> None:
        chunk, more = message.get("body", b""), message.get("more_body", False)
        if self.resume is not None:
            chunk = self.resume.outgoing(chunk)
            if self.resume.failed:  # the rest is held back: resumed elsewhere (after the app returns) or sent then
                if chunk:
                    await self.to_client(chunk, True)
                return
        if not more:
            self.answered = True
        if self.ctx.watch is not None:
            if not more:
                self.ctx.watch.end()
            elif chunk:
                self.ctx.watch.first_output()
        if self.error is not None:
            await self._error_body(chunk, more)
            return
        await self.to_client(chunk, more)

    async def _error_body(self, chunk: bytes, more: bool) -> None:
        """A non-stream error: gathered, then answered in OpenAI's shape (vLLM's own when it has that shape)."""
        self.error["body"].append(chunk)
        if more:
            return
        start, refusal = self.error["start"], self.error.get("refusal")
        if refusal is not None:  # Summit's own answer in its place
            status, body, extra = refusal.status, refusal.to_bytes(), refusal.extra_headers()
        else:  # vLLM's own, in OpenAI's shape (as it is when it has that shape)
            status, body, extra = start["status"], openai_error_bytes(start["status"], b"".join(self.error["body"])), []
        headers = (
            without(start["headers"], (b"content-length", b"content-type"))
            + extra
            + [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        )
        await self.ctx.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.ctx.send({"type": "http.response.body", "body": body, "more_body": False})

    async def to_client(self, chunk: bytes, more_body: bool) -> None:
        if self.journal is not None:  # numbered, kept, and passed to whichever connection reads the stream now
            await self.journal.write(chunk, more_body)
        else:
            await self._to_connection(chunk, more_body)

    async def _to_connection(self, chunk: bytes, more_body: bool) -> None:
        if self.stream is not None:
            await self.stream.body(chunk, more_body)
        else:
            await self.ctx.send({"type": "http.response.body", "body": chunk, "more_body": more_body})

    async def _resume_elsewhere(self) -> None:
        front = self.front
        front.relaying += 1  # this replica must live on while it relays (LLMServer.check_health)
        try:
            outcome = await resume_or_fail(
                self.resume, self.engine.dead, self.options.resume_to, self.to_client, self._client_receive
            )
        finally:
            front.relaying -= 1
        if self.options.metrics is not None and outcome:
            self.options.metrics.stream_migration(outcome)
        self.answered = True

    async def _move_elsewhere(self) -> None:
        """Told to move: the stream's KV handed off where kv_migration says so (else recomputed there), then it goes on
        from another replica."""
        resume, kv = self.resume, self.options.kv_migration

        async def carry() -> tuple[str, str | None]:
            why = "asked to recompute" if self._recompute else kv_plan(resume, kv, not self.engine.dead())
            if why is None:
                ids = kv.tokens(resume.prompt_ids + resume.generated)
                try:
                    resume.kv_params = await hand_off(
                        self.engine.app, self.ctx.scope, resume.model, ids, self.ctx.client_request_id
                    )
                except HandOffFailed as e:
                    why = f"the hand-off failed: {e}"
            decided = ("kv", None) if why is None else ("recompute", why)
            if self.moving is not None and not self.moving.done():
                self.moving.set_result(self._moved_as(*decided))
            return decided

        front = self.front
        front.relaying += 1
        try:
            outcome = await move_or_fail(resume, carry, self.options.resume_to, self.to_client, self._client_receive)
        finally:
            front.relaying -= 1
        if self.options.metrics is not None:
            self.options.metrics.stream_migration(outcome)
        self.answered = True
