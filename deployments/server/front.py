"""What every OpenAI request meets in the replica that owns the engine: an ASGI app around vLLM's own OpenAI app.

On the direct path Serve serves it on the replica's own HTTP port, behind HAProxy: it is the HTTP entry. On the
two-hop path the ingress (hops/ingress.py) ran the entry's steps and `LLMServer.handle_http` runs this same app for
the request it passed on (`ctx.internal`: key and rate limit are not checked again). A generation request runs one
pipeline: the entry's steps (pipeline/entry.py: key, body, model, rate limit), then — when this replica's engine
serves the model — the replica's (engine alive, measured, admitted, its engine awake, its LoRA adapter loaded, the
prefill pool first for a disaggregated model, marked to resume elsewhere), then the engine call
(server/engine_call.py). A request for another model of the deployment goes on to one of that model's replicas.
Refusals are answered in one place (pipeline/context.answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from deployments.batch.share import BatchShare
from deployments.http import response_ids
from deployments.http.asgi import post_paths, read_body, send_json, send_plain
from deployments.http.errors import OpenAIError
from deployments.http.openapi import build as build_openapi
from deployments.http.protocol import (
    BATCH_LINE_SCOPE_KEY,
    REPLICA_HEADER,
)
from deployments.http.routes import POST_ROUTES, Route, route_of
from deployments.http.stream_ids import LAST_EVENT_HEADER, resume_point
from deployments.lora.adapters import AdapterLoadError
from deployments.lora.runtime import MAX_BODY_BYTES, RuntimeAdapters
from deployments.observability.metrics import ReplicaMetrics
from deployments.observability.tracing import Tracing
from deployments.observability.watch import RequestWatch
from deployments.pipeline.admission import Admission
from deployments.pipeline.context import Entry, RequestContext, run_steps
from deployments.pipeline.entry import (
    authenticate,
    bounded_body,
    not_served,
    rate_limit,
    resolve_model,
    route_not_served,
)
from deployments.pipeline.handoff import Call, to_batch_api, to_keeper, to_model_replica
from deployments.pipeline.migration import KVMigration, resumable_stream
from deployments.pipeline.prefill import Disaggregated, prefill_first
from deployments.pipeline.rate_limit import Limits
from deployments.server.engine_call import EngineCall
from deployments.server.models import ModelTable
from deployments.server.sleep import Sleeper
from deployments.server.stream_journal import StreamJournals
from deployments.server.stream_resume import resume_stream

logger = logging.getLogger("ray.serve")


@dataclass
class EngineSide:
    """This replica's engine as the front sees it."""

    app: Any  # vLLM's OpenAI ASGI app on the replica's AsyncLLM
    dead: Callable[[], bool]
    replica_id: str
    detokenizer: Callable | None = None  # vLLM's, for a resumed stream's text (pipeline/migration.Resumable)
    stores_responses: Callable[[], bool] = lambda: False  # vLLM keeps responses here (VLLM_ENABLE_RESPONSES_API_STORE)
    background: Callable[[str], Any] = lambda response_id: None  # the task running a background response, if any

    @cached_property
    def routes(self) -> frozenset[str] | None:
        """The POST routes vLLM's app serves for this model's task (None: an app without a route table)."""
        return post_paths(self.app) if hasattr(self.app, "routes") else None


@dataclass
class FrontOptions:
    """What the front does besides passing requests to its engine (each off by default)."""

    keys: list[bytes] | None = None  # API keys, where this front is the HTTP entry (direct path)
    forward: Call | None = None  # a request -> one of the deployment's replicas of its model (several models)
    batch_api: Call | None = None  # /v1/files and /v1/batches -> the BatchAPI deployment (batch on)
    coalesce_s: float = 0.0  # a stream's chunks after its first gathered this long (stream_coalesce_ms)
    admission: Admission | None = None  # the direct path's bound on running + waiting requests
    limits: Limits | None = None  # per-key rate limits (auth.rate_limit)
    disaggregated: Disaggregated | None = None  # a disaggregated model's decode side: its prefill pool
    migration: str = "off"  # stream_migration: greedy | all | off
    resume_to: Call | None = None  # where a resumed stream's continuation goes (one of the model's replicas)
    kv_migration: KVMigration | None = None  # a moved stream's KV goes with it (kv_migration)
    chat_parsers: bool = False  # a reasoning or tool parser shapes chat deltas (those streams are not resumed)
    runtime_lora: RuntimeAdapters | None = None  # adapters loaded at run time (lora.runtime_loading)
    metrics: ReplicaMetrics | None = None  # serving metrics (monitoring.metrics)
    tracing: Tracing | None = None  # traces (monitoring.tracing)
    batch_share: BatchShare | None = None  # told of online requests: batch lines make room for them
    sleeper: Sleeper | None = None  # the engine's sleep mode (deployment.sleep, share_with): a request wakes it
    to_keeper: Call | None = None  # a request about a stored response or a stream -> the replica keeping it
    journals: StreamJournals | None = None  # streams a client can resume (stream_resume)
    front_index: int = 0  # this process among the replica's (0: the replica itself; 1..: its front processes)
    siblings: Callable[..., Any] | None = None  # the replica's: (front, point, caller) -> that front process's resume


_MOVES_KEPT = 256  # moves remembered (move_streams answers a request id asked again)

# The routes a request's metrics and trace are kept for: the model's work (not the tokenizer's)
MEASURED_ROUTES = POST_ROUTES - {"/tokenize", "/detokenize"}


class ReplicaFront(Entry):
    """The replica's ASGI app (vLLM's app was started with its engine: nothing to start at lifespan)."""

    def __init__(self, engine: EngineSide, table: ModelTable, options: FrontOptions | None = None):
        super().__init__(self._route)
        self.engine, self.table, self.options = engine, table, options or FrontOptions()
        self.relaying = 0  # streams this replica is resuming elsewhere and relaying to their clients
        self.streams: set = set()  # engine calls of streams that can go on elsewhere (server/engine_call.EngineCall)
        self._moves: dict[str, asyncio.Future] = {}  # the latest streams moved: what each move did, by request id
        self.detached: set[asyncio.Task] = set()  # resumable streams going on while their clients are away
        self._openapi: dict | None = None
        o = self.options
        self._authenticate = authenticate(o.keys)
        self._handlers = self._route_handlers()
        self._rate_limit = rate_limit(o.limits)
        self._request_steps = [bounded_body(), resolve_model(table.names), self._rate_limit]
        self._replica_steps = [
            self._engine_alive,
            self._measured,
            self._admitted,
            self._awake,
            self._adapter_loaded,
            *([prefill_first(o.disaggregated)] if o.disaggregated is not None else []),
            resumable_stream(o.migration, o.resume_to, o.chat_parsers, engine.detokenizer, engine.replica_id),
        ]

    async def _route(self, ctx: RequestContext) -> None:
        """Dispatch by the route table both entries share (http/routes.py)."""
        route = route_of(ctx.method, ctx.path)
        if route is None or not route.public:
            await run_steps([self._authenticate], ctx)
        if route is None or (route.handler == "runtime_lora" and self.options.runtime_lora is None):
            raise not_served(ctx)
        await self._handlers[route.handler](ctx, route)

    def _route_handlers(self) -> dict[str, Callable[[RequestContext, Route], Awaitable[None]]]:
        """This entry's handler of each route of the table (the names http/routes.route_of gives)."""

        async def health(ctx: RequestContext, _) -> None:
            await send_plain(ctx.send, 503 if self.engine.dead() else 200)

        async def models(ctx: RequestContext, _) -> None:
            await send_json(ctx.send, 200, await self.table.listing(await self._vllm_models(ctx)))

        return {
            "health": health,
            "openapi": lambda ctx, _: send_json(ctx.send, 200, self.openapi()),  # public, as vLLM's own
            "models": models,
            "runtime_lora": lambda ctx, _: self._runtime_lora(ctx),
            "batch": lambda ctx, _: to_batch_api(ctx, self.options.batch_api),
            "generate": lambda ctx, _: self._generate(ctx),
            "stored_response": lambda ctx, route: self._stored_response(
                ctx, route.match["id"], "POST" if route.match["cancel"] else "GET"
            ),
        }

    async def _generate(self, ctx: RequestContext) -> None:
        if (point := resume_point(ctx.header(LAST_EVENT_HEADER))) is not None:  # a client resuming its stream
            await resume_stream(self, ctx, point)
            return
        await run_steps(self._request_steps, ctx)
        if not self.table.serves(ctx.model):  # a body cut at HAProxy's buffer, or a stale route
            await to_model_replica(ctx, ctx.model, self.options.forward, self.table.model)
            return
        stored = ctx.path == response_ids.CREATE and self.engine.stores_responses()
        if stored:
            previous = ctx.payload.get("previous_response_id")
            keeper = response_ids.owner_of(previous)
            made_by = keeper.model(self.table.names()) if keeper is not None else None
            if made_by not in (None, self.table.model):
                raise OpenAIError(
                    400,
                    f"previous_response_id {previous!r} is a response of model {made_by!r}; continue it with that "
                    "model",
                    param="previous_response_id",
                )
            if keeper is not None and keeper.replica != self.engine.replica_id:  # the conversation is kept there
                await self._to_keeper(ctx, keeper, previous)
                return
        routes = self.engine.routes
        if (
            routes is not None and ctx.path not in routes
        ):  # a route of another task (embeddings from a generative model)
            raise route_not_served(ctx.model, ctx.path, routes)
        share = self.options.batch_share
        if share is not None and not ctx.scope.get(BATCH_LINE_SCOPE_KEY):  # online: batch lines make room from now
            share.online_started()
            ctx.exits.callback(share.online_ended)
        try:
            await run_steps(self._replica_steps, ctx)
        except OpenAIError as e:  # this replica's refusal (its engine, admission, the prefill pool's answer) names it
            e.headers.setdefault(REPLICA_HEADER.decode(), self.engine.replica_id)
            raise
        response_id = self._name_response(ctx) if stored else None
        await EngineCall(self, ctx).run()
        if response_id is not None and ctx.payload.get("background"):
            # answered at once ("queued"); the engine works on in vLLM's task: the request holds its place (admission,
            # an awake engine, Serve's count of ongoing requests) until that ends (done or cancelled)
            task = self.engine.background(response_id)
            if task is not None:
                await asyncio.wait({task})

    async def move_streams(
        self, request_ids: set[str] | None = None, timeout_s: float = 30.0, recompute: bool = False
    ) -> list[dict]:
        """Move every stream of this front that can go on elsewhere (of those client request ids, if given) to other
        replicas of the model, now: what each move did once it is decided (its KV carried or recomputed, and why),
        within `timeout_s`. A request id given again later is answered with what its move did."""
        calls = [c for c in list(self.streams) if request_ids is None or c.client_id in request_ids]
        moves = {call.client_id: m for call in calls if (m := call.move(recompute)) is not None}
        for request_id, move in moves.items():
            self._moves[request_id] = move
            while len(self._moves) > _MOVES_KEPT:
                self._moves.pop(next(iter(self._moves)))
        asked = {**{r: self._moves[r] for r in request_ids or () if r in self._moves}, **moves}
        if not asked:
            return []
        await asyncio.wait(asked.values(), timeout=timeout_s)
        late = {"kv": "undecided", "why": f"not decided within {timeout_s:.0f} s"}
        return [m.result() if m.done() else {"request_id": r, **late} for r, m in asked.items()]

    # the replica's steps

    async def _engine_alive(self, ctx: RequestContext) -> OpenAIError | None:
        if self.engine.dead():
            return OpenAIError.unavailable("The model engine of this replica has died; it is being replaced. Retry.")
        return None

    async def _measured(self, ctx: RequestContext) -> None:
        """A model request's metrics and trace (monitoring:), ended with the request."""
        o = self.options
        if ctx.path in MEASURED_ROUTES and (o.metrics is not None or o.tracing is not None):
            ctx.watch = RequestWatch(
                o.metrics, o.tracing, ctx.scope, ctx.headers, self.engine.replica_id, self.table.model, ctx.internal
            )
            ctx.exits.callback(ctx.watch.end)

    async def _admitted(self, ctx: RequestContext) -> OpenAIError | None:
        """Waits for a place among the replica's running requests (direct path), or refuses when the queue is full."""
        admission = self.options.admission
        if admission is None:
            return None
        if admission.full():
            if self.options.metrics is not None:
                self.options.metrics.overload_rejection()
            return admission.reject(self.table.model)
        queued_ns = time.time_ns()
        await ctx.exits.enter_async_context(admission.slot())
        if ctx.watch is not None:
            ctx.watch.span("summit.queue", queued_ns, time.time_ns())
        return None

    async def _awake(self, ctx: RequestContext) -> None:
        """A sleeping engine is woken (the request waits; where models share the GPU, for this model's turn); it
        stays awake while the request runs. Tokenizing needs no engine."""
        sleeper = self.options.sleeper
        if sleeper is not None and ctx.path in MEASURED_ROUTES:
            woke_ns = time.time_ns()
            await ctx.exits.enter_async_context(sleeper.use())
            if ctx.watch is not None and time.time_ns() - woke_ns > 1_000_000:
                ctx.watch.span("summit.wake", woke_ns, time.time_ns())

    async def _adapter_loaded(self, ctx: RequestContext) -> OpenAIError | None:
        """One of this model's LoRA adapters: loaded into the engine (held while the request runs)."""
        adapters, name = self.table.adapters, ctx.payload.get("model")
        if adapters is None or name not in adapters.paths:
            return None
        try:
            await ctx.exits.enter_async_context(adapters.use(name))
        except AdapterLoadError as e:  # the YAML's adapter, not the request, is at fault
            logger.error("%s", e)
            return OpenAIError(500, str(e))
        return None

    # stored responses (vLLM's store; deployments/http/response_ids.py)

    def _name_response(self, ctx: RequestContext) -> str:
        """The new response's id, naming this replica (vLLM's `request_id`), unless the client set one."""
        given = ctx.payload.get("request_id")
        if isinstance(given, str) and given:
            return given
        ctx.payload["request_id"] = response_ids.new_id(self.table.model, self.engine.replica_id)
        ctx.body = json.dumps(ctx.payload).encode()
        return ctx.payload["request_id"]

    async def _stored_response(self, ctx: RequestContext, response_id: str, method: str) -> None:
        """GET /v1/responses/{id} (retrieve) and POST /v1/responses/{id}/cancel: vLLM answers in the replica that keeps
        the response; a request that reached another replica goes on to it."""
        if ctx.method != method:
            raise OpenAIError(405, f"{ctx.method} {ctx.path} is not served; use {method}")
        await run_steps([self._rate_limit], ctx)  # the caller's rate limit (a request, no tokens)
        keeper = response_ids.owner_of(response_id)
        if keeper is not None and keeper.replica != self.engine.replica_id:
            await self._to_keeper(ctx, keeper, response_id)
            return
        if not self.engine.stores_responses():
            raise OpenAIError(
                404,
                f"Response with id {response_id!r} not found: responses are not stored (set "
                f"{response_ids.STORE_ENV}: '1' in the application's runtime_env.env_vars)",
                param="response_id",
            )
        scope = {**ctx.scope, "headers": [(k, v) for k, v in ctx.headers if k != b"authorization"]}
        await self.engine.app(scope, ctx.receive, ctx.send)

    async def _to_keeper(self, ctx: RequestContext, keeper: response_ids.Owner, response_id: str) -> None:
        gone = OpenAIError(
            404,
            f"Response with id {response_id!r} not found: the replica that kept it ({keeper.replica}) no longer "
            "runs (stored responses live in their replica's memory)",
            param="response_id",
        )
        await to_keeper(ctx, keeper.replica, keeper.model(self.table.names()), self.options.to_keeper, gone)

    # other routes

    def openapi(self) -> dict:
        if self._openapi is None:
            self._openapi = build_openapi(
                self.engine.app.openapi(),
                POST_ROUTES,
                self.options.batch_api is not None,
                self.options.keys is not None,
                runtime_lora=self.options.runtime_lora is not None,
            )
        return self._openapi

    async def _vllm_models(self, ctx: RequestContext) -> tuple[int, bytes] | None:
        """vLLM's own /v1/models answer on this replica (status, body)."""
        captured: dict = {"status": None, "body": []}

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
            elif message["type"] == "http.response.body":
                captured["body"].append(message.get("body", b""))

        scope = {**ctx.scope, "headers": [(k, v) for k, v in ctx.headers if k != b"authorization"]}
        await self.engine.app(scope, ctx.receive, capture)
        return captured["status"], b"".join(captured["body"])

    async def _runtime_lora(self, ctx: RequestContext) -> None:
        """vLLM's adapter routes (lora.runtime_loading): loaded here, or by a replica of the adapter's model."""
        if ctx.method != "POST":
            raise OpenAIError(405, f"{ctx.method} {ctx.path} is not served; use POST")
        ctx.body = await read_body(ctx.receive, MAX_BODY_BYTES)
        try:
            payload = json.loads(ctx.body) if ctx.body else None
        except (ValueError, RecursionError):
            payload = None

        async def forward(base: str) -> None:
            await to_model_replica(ctx, base, self.options.forward, self.table.model)

        answered = await self.options.runtime_lora.handle(self.table, ctx.path, payload, forward)
        if answered is not None:  # vLLM's server answers these routes with plain text
            status, text = answered
            data = text.encode()
            await ctx.send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(data)).encode()),
                    ],
                }
            )
            await ctx.send({"type": "http.response.body", "body": data, "more_body": False})
