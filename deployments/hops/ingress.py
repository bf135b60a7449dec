"""The two-hop path's HTTP entry (models of different shapes, or Ray without HAProxy): Serve's proxy -> this ingress ->
the model's engine deployment -> the same replica front and pipeline as on the direct path.

The ingress runs the entry's steps (pipeline/entry.py: API key, body, model, rate limit), chooses the model's
deployment and relays its answer (SSE passed through as it comes); everything else — vLLM's validation, the engine,
the OpenAI-shaped errors — is the replica front's (server/front.py), which does not check the key again.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import AuthOptions
from deployments.http import response_ids
from deployments.http.asgi import read_body, send_json, send_plain
from deployments.http.errors import OpenAIError
from deployments.http.protocol import (
    ARRIVAL_HEADER,
    HOP_HEADERS,
    OWNER_HEADER,
    PATH_HEADER,
    REQUEST_ID_HEADER,
    TARGET_HEADER,
    HTTPRequest,
    ResponseStart,
    without,
)
from deployments.http.relay import first_response, relay, rest_of_body
from deployments.http.routes import Route, route_of
from deployments.http.stream_ids import LAST_EVENT_HEADER, StreamPoint, resume_point
from deployments.lora.runtime import LOAD, MAX_BODY_BYTES, parse_load, parse_unload
from deployments.pipeline.auth import load_api_keys
from deployments.pipeline.context import Entry, RequestContext, run_steps
from deployments.pipeline.entry import authenticate, bounded_body, not_served, rate_limit, resolve_model
from deployments.pipeline.handoff import to_batch_api
from deployments.pipeline.rate_limit import Limits
from deployments.routing.choose import can_route

logger = logging.getLogger("ray.serve")

_RUNTIME_READ_S = 0.5  # how long the registry's list of adapters loaded at run time is trusted


@serve.ingress()
class OpenAIIngress:
    def __init__(
        self,
        servers: dict[str, DeploymentHandle],
        auth: AuthOptions | None = None,
        batch_api: DeploymentHandle | None = None,
        limiter: DeploymentHandle | None = None,
        adapters: dict[str, str] | None = None,
        adapter_registry: DeploymentHandle | None = None,
        runtime_lora_models: list[str] | None = None,
        why_hops: str = "",
    ):
        """`servers`: each model's engine deployment; `adapters`: each LoRA adapter's model (its replicas serve it);
        `adapter_registry`: the adapters loaded at run time into `runtime_lora_models` (deployments/lora/runtime.py);
        `why_hops`: why the app is on this path, told in /v1/models' `x-summit-request-path` (`summit wait-ready`
        warns when it is a Ray started without the direct path's settings)."""
        self._path_header = [(PATH_HEADER, f"hops; {why_hops}".encode())]
        self._servers = servers
        self._adapters = adapters or {}
        self._registry = adapter_registry
        self._runtime_models = runtime_lora_models or []
        self._runtime: dict[str, str] = {}  # adapter loaded at run time -> its model, as the registry last said
        self._runtime_read = 0.0
        self._batch_api = batch_api
        keys = load_api_keys(auth.api_keys_env, auth.api_keys_file) if auth else None
        limits = Limits(limiter, auth.rate_limit.default_max_tokens) if limiter is not None else None
        self._authenticate = authenticate(keys)
        names = lambda: [*self._servers, *self._adapters, *self._runtime]  # noqa: E731
        self._rate_limit = rate_limit(limits)
        self._request_steps = [bounded_body(), resolve_model(names, self._names_again), self._rate_limit]
        self._handlers = self._route_handlers()

    def __serve_build_asgi_app__(self):
        return Entry(self._route)

    async def _route(self, ctx: RequestContext) -> None:
        """Dispatch by the route table both entries share (http/routes.py)."""
        route = route_of(ctx.method, ctx.path)
        if route is None or not route.public:
            await run_steps([self._authenticate], ctx)
        if route is None:
            raise not_served(ctx)
        await self._handlers[route.handler](ctx, route)

    def _route_handlers(self) -> dict[str, Callable[[RequestContext, Route], Awaitable[None]]]:
        """This entry's handler of each route of the table (the names http/routes.route_of gives)."""

        async def models(ctx: RequestContext, _) -> None:
            await send_json(ctx.send, 200, {"object": "list", "data": await self._models()}, self._path_header)

        def batch_api():
            return self._batch_api and self._batch_api.options(stream=True).handle_http.remote

        return {
            "health": lambda ctx, _: send_plain(ctx.send, 200),
            "openapi": lambda ctx, _: self._openapi(ctx),
            "models": models,
            "runtime_lora": lambda ctx, _: self._runtime_lora(ctx),
            "batch": lambda ctx, _: to_batch_api(ctx, batch_api()),
            "generate": lambda ctx, _: self._generate(ctx),
            "stored_response": lambda ctx, route: self._stored_response(ctx, route.match["id"]),
        }

    def _headers(
        self, ctx: RequestContext, keeper: response_ids.Owner | StreamPoint | None
    ) -> list[tuple[bytes, bytes]]:
        """The request's headers as they go on. Serve's proxy answers with the client's x-request-id (or its own);
        the replica's front gives the engine that id plus a unique suffix. `keeper`: the replica keeping the stored
        response or the stream the request names (Summit's router sends it there)."""
        return without(ctx.headers, HOP_HEADERS | {b"content-type"}) + [
            (b"content-type", b"application/json"),
            (REQUEST_ID_HEADER, ctx.client_request_id),
            (ARRIVAL_HEADER, f"{time.time():.6f}".encode()),
            (OWNER_HEADER, ctx.owner),  # whose stream it is (a resumable stream is its key's alone)
            *([(TARGET_HEADER, keeper.replica.encode())] if keeper else []),
        ]

    async def _generate(self, ctx: RequestContext) -> None:
        if (point := resume_point(ctx.header(LAST_EVENT_HEADER))) is not None:  # a client resuming its stream
            await self._resume(ctx, point)
            return
        await run_steps(self._request_steps, ctx)
        keeper = response_ids.owner_of(ctx.payload.get("previous_response_id"))  # a response continued
        model = self._adapters.get(ctx.model) or self._runtime.get(ctx.model) or ctx.model
        request = HTTPRequest("POST", ctx.path, ctx.body, ctx.query_string, self._headers(ctx, keeper), model=ctx.model)
        await relay(self._servers[model].options(stream=True).handle_http.remote(request), model, ctx.receive, ctx.send)

    async def _resume(self, ctx: RequestContext, point: StreamPoint) -> None:
        """A stream resumed (`Last-Event-ID`): to the replica keeping it, whose front answers from its journal (the
        body is not needed: the id names the model and the replica)."""
        model = point.model(self._servers)
        if model is None:
            raise OpenAIError(404, f"stream {point.stream!r} not found", param="Last-Event-ID")
        request = HTTPRequest("POST", ctx.path, b"", ctx.query_string, self._headers(ctx, point), model=model)
        await relay(self._servers[model].options(stream=True).handle_http.remote(request), model, ctx.receive, ctx.send)

    async def _stored_response(self, ctx: RequestContext, response_id: str) -> None:
        """Retrieve or cancel a stored response: to the model whose replica made it (its id names both), or the one
        model; its replica's front answers (and checks the method)."""
        await run_steps([self._rate_limit], ctx)
        keeper = response_ids.owner_of(response_id)
        only = next(iter(self._servers)) if len(self._servers) == 1 else None  # an id a client set: the one model's
        model = keeper.model(self._servers) if keeper else only
        if model is None:
            raise OpenAIError(404, f"Response with id {response_id!r} not found.", param="response_id")
        request = HTTPRequest(ctx.method, ctx.path, b"", ctx.query_string, self._headers(ctx, keeper), model=model)
        await relay(self._servers[model].options(stream=True).handle_http.remote(request), model, ctx.receive, ctx.send)

    async def _names_again(self) -> list[str]:
        """The names once more, with the registry read now (an adapter loaded at run time since the last read)."""
        await self._runtime_adapters()
        return [*self._servers, *self._adapters, *self._runtime]

    async def _runtime_adapters(self, fresh: bool = False) -> dict[str, str]:
        """Adapters loaded at run time -> their model (read from the registry at most every half second)."""
        if self._registry is not None and (fresh or time.monotonic() - self._runtime_read > _RUNTIME_READ_S):
            _, entries = await self._registry.snapshot.remote()
            self._runtime = {name: base for name, (base, _) in entries.items()}
            self._runtime_read = time.monotonic()
        return self._runtime

    async def _call(self, name: str, request: HTTPRequest) -> tuple[ResponseStart, bytes]:
        stream = self._servers[name].options(stream=True).handle_http.remote(request)
        start = await first_response(stream)
        return start, await rest_of_body(stream)

    async def _openapi(self, ctx: RequestContext) -> None:
        """Summit's OpenAPI document, as a replica's front builds it (deployments/http/openapi.py)."""
        for name in self._servers:
            try:
                start, body = await self._call(name, HTTPRequest("GET", "/openapi.json"))
            except OpenAIError:
                continue
            await ctx.send(
                {
                    "type": "http.response.start",
                    "status": start.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await ctx.send({"type": "http.response.body", "body": body, "more_body": False})
            return
        raise OpenAIError.unavailable("no model has a running replica yet; retry", retry_after=5)

    async def _models(self) -> list[dict]:
        """Every model's own /v1/models answer (vLLM's, with max_model_len), merged into one list: a model is listed
        once one of its replicas has started and answered its warm-up, not before."""
        data = []
        for name in self._servers:
            if not await can_route(self._servers[name], HTTPRequest("GET", "/v1/models")):
                continue
            try:
                start, body = await self._call(name, HTTPRequest("GET", "/v1/models"))
            except OpenAIError:  # its replica went away meanwhile
                continue
            if start.status == 200:
                data.extend(json.loads(body)["data"])
        return data

    async def _runtime_lora(self, ctx: RequestContext) -> None:
        """vLLM's adapter routes: a replica of the adapter's model answers (it checks the request and loads the
        adapter); an unload goes to a replica of the model the registry names."""
        if self._registry is None:
            raise OpenAIError(
                404,
                f"POST {ctx.path} is not served: no model has `lora.runtime_loading: true` "
                "(docs/features/engine-features.md)",
            )
        if ctx.method != "POST":
            raise OpenAIError(405, f"{ctx.method} {ctx.path} is not served; use POST")
        ctx.body = await read_body(ctx.receive, MAX_BODY_BYTES) or b""
        base = await self._lora_base(ctx)
        request = HTTPRequest(
            "POST",
            ctx.path,
            ctx.body,
            b"",
            [(b"content-type", b"application/json"), (REQUEST_ID_HEADER, uuid.uuid4().hex.encode())],
            model=base,
        )
        await relay(self._servers[base].options(stream=True).handle_http.remote(request), base, ctx.receive, ctx.send)

    async def _lora_base(self, ctx: RequestContext) -> str:
        """The model whose replica takes a load or unload request (checked here with the names of the whole
        application, which one model's replica does not know)."""
        try:
            payload = json.loads(ctx.body)
        except (ValueError, RecursionError):
            payload = None
        runtime = await self._runtime_adapters(fresh=True)
        if ctx.path == LOAD:
            return parse_load(payload, self._runtime_models, {*self._servers, *self._adapters, *runtime})[2]
        name = parse_unload(payload, set(self._adapters))
        if name not in runtime:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        return runtime[name]
