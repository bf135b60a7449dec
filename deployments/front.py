"""What every OpenAI request meets in the replica that owns the engine, on both request paths (one module, no drift).

`ReplicaFront` is an ASGI app wrapped around vLLM's own OpenAI app (which parses, validates and answers):
- on the direct path Serve serves it on the replica's own HTTP port, behind HAProxy, and it is the HTTP entry:
  API keys, the routes Summit exposes, `/health`, `/v1/models` for every model of the application;
- on the two-hop path the `OpenAIIngress` did those, and `LLMServer.handle_http` runs this same app per request.
On both: a request for another of the application's models goes on to one of that model's replicas (through a
Serve handle: a body cut at HAProxy's buffer size reaches the route picker without its model), the engine gets the client's `x-request-id` plus a unique
suffix (a reused id cannot collide inside vLLM; Serve answers with the client's id), an error that is not a
stream comes out OpenAI-shaped, and a dead engine answers 503 + Retry-After. The Batch API's routes (`/v1/files`,
`/v1/batches`) go on to the BatchAPI deployment with the caller's owner (a hash of its API key).
On the direct path the front also bounds the replica's load (`Admission`): Serve's own rejection there is plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from deployments.adapters import AdapterLoadError, Adapters
from deployments.asgi_bridge import header, lifespan, read_body, send_json, send_plain
from deployments.auth import authorized, unauthorized
from deployments.errors import error_body, error_response, openai_error_bytes, request_problem
from deployments.flow import Admission, Coalescer
from deployments.handoff import BATCH_PREFIXES, OWNER_HEADER, owner_of, relay
from deployments.metrics import ReplicaMetrics
from deployments.migration import Resumable, resumable, resume_or_fail
from deployments.model_names import BadModel, model_and_payload
from deployments.lora_runtime import RUNTIME_LORA_ROUTES, RuntimeAdapters
from deployments.observe import ARRIVAL_HEADER, RequestWatch
from deployments.openapi import build as build_openapi
from deployments.pd import PD_ROUTES, ClientGone, Disaggregated, PrefillFailed, decode_body
from deployments.rate_limit import Limits
from deployments.protocol import HTTPRequest
from deployments.tracing import Tracing

logger = logging.getLogger("ray.serve")

REQUEST_ID_HEADER = b"x-request-id"
# Set in the ASGI scope of a request that came through a Serve handle, not from a client (no API key to check).
INTERNAL_SCOPE_KEY = "summit.internal"
REPLICA_HEADER = b"x-summit-replica"
FORWARDED_HEADER = b"x-summit-forwarded"
RETRY_AFTER_S = "1"
# The largest body an OpenAI route takes (a 128k-token prompt as token ids is ~1 MiB; images inline in a chat are
# the big ones): a larger one is answered 413 before it is read.
MAX_REQUEST_BYTES = 32 << 20
# The OpenAI routes Summit serves; vLLM's app has more (metrics, admin) that stay unreachable from outside.
POST_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
# The API key stops here; hop headers are the server's business.
_DROP_REQUEST_HEADERS = frozenset({b"authorization", b"x-request-id", b"content-length", b"transfer-encoding",
                                   FORWARDED_HEADER, OWNER_HEADER})
_DROP_RESPONSE_HEADERS = frozenset({b"x-request-id", b"date", b"server"})


class ReplicaFront:
    def __init__(self, engine_app, model: str, models: Sequence[str], keys: list[bytes] | None,
                 engine_dead: Callable[[], bool], replica_id: str, model_cards: dict[str, dict] | None = None,
                 forward: Callable[[HTTPRequest], Any] | None = None, coalesce_s: float = 0.0,
                 batch_api: Callable[[HTTPRequest], Any] | None = None,
                 model_ready: Callable[[str], Awaitable[bool]] | None = None):
        self._app = engine_app
        # a stream's chunks after its first are gathered for up to this long and sent as one (stream_coalesce_ms)
        self._coalesce_s = coalesce_s
        # another model's request -> a Serve response stream from one of that model's replicas (its handle_http)
        self._forward = forward
        # a Batch API request -> a Serve response stream from the BatchAPI deployment (None: batch is off)
        self._batch_api = batch_api
        self.model = model
        self._models = list(models)
        # LoRA adapters (app/lora.py): each adapter of the application's models -> its base model, and this replica's
        # own adapters, loaded on first use (deployments/adapters.py); set by LLMServer
        self.base_of: dict[str, str] = {}
        self.adapters: Adapters | None = None
        # adapters added and removed at run time (models[].lora.runtime_loading; deployments/lora_runtime.py)
        self.runtime_lora: RuntimeAdapters | None = None
        self._keys = keys
        self._openapi: dict | None = None
        self._engine_dead = engine_dead
        self._replica_id = replica_id.encode()
        # /v1/models entries of the application's other models (this replica's own comes from vLLM)
        self.cards = model_cards or {}
        # whether another model of the application has a replica that can answer now (None: all are listed)
        self._model_ready = model_ready
        # the direct path's bound on running + waiting requests (None: Serve bounds them, as on the two-hop path)
        self.admission: Admission | None = None
        # a disaggregated model's decode side: its prompts are prefilled by its prefill pool first (deployments/pd.py)
        self.disaggregated: Disaggregated | None = None
        # stream migration (deployments/migration.py): which streams resume on another replica when this engine dies
        # (stream_migration: greedy | all | off), where the continuation goes (a Serve stream from one of the model's
        # replicas), and whether a reasoning or tool parser shapes chat deltas (those are not resumed)
        self.migration = "off"
        self.limits: Limits | None = None  # per-key rate limits (auth.rate_limit; deployments/rate_limit.py)
        self.resume_to: Callable[[HTTPRequest], Any] | None = None
        self.chat_parsers = False
        self.relaying = 0  # streams this replica is resuming elsewhere and relaying to their clients
        self.detokenizer: Callable | None = None  # vLLM's, for a continuation's text (Resumable)
        # what generation requests record (monitoring:): serving metrics and traces; None = off
        self.metrics: ReplicaMetrics | None = None
        self.tracing: Tracing | None = None

    @property
    def models(self) -> list[str]:
        return self._models

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # vLLM's app was started with its engine; nothing to start or stop here
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            status = 503 if self._engine_dead() else 200
            await send_plain(send, status)
            return
        if path == "/openapi.json" and method == "GET":  # what a client may send (public, as vLLM's own)
            if self._openapi is None:
                self._openapi = build_openapi(self._app.openapi(), POST_ROUTES, self._batch_api is not None,
                                              self._keys is not None, runtime_lora=self.runtime_lora is not None)
            await send_json(send, 200, self._openapi)
            return
        headers = scope.get("headers") or []
        authorization = header(headers, b"authorization")
        # a request through a Serve handle (from another replica, the batch runner) was let in where it entered
        if (self._keys is not None and not scope.get(INTERNAL_SCOPE_KEY)
                and not authorized(authorization and authorization.decode(), self._keys)):
            await unauthorized(authorization and authorization.decode())(scope, receive, send)
            return
        if method == "GET" and path == "/v1/models":
            await self._list_models(scope, receive, send)
            return
        if path in RUNTIME_LORA_ROUTES and self.runtime_lora is not None:
            await self.runtime_lora.answer(self, scope, headers, receive, send)
            return
        if path.startswith(BATCH_PREFIXES):
            await self._to_batch_api(scope, headers, authorization, receive, send)
            return
        if method != "POST" or path not in POST_ROUTES:
            status = 405 if path in POST_ROUTES else 404
            await error_response(status, f"{method} {path} is not served; OpenAI routes: GET /v1/models, /v1/files, /v1/batches, "
                                 f"POST {', '.join(sorted(POST_ROUTES))}")(scope, receive, send)
            return
        body = await read_body(receive, MAX_REQUEST_BYTES)
        if body is None:
            await error_response(413, f"the request body is larger than {MAX_REQUEST_BYTES >> 20} MiB")(scope, receive, send)
            return
        try:
            name, payload = model_and_payload(body, self._models + list(self.base_of))
        except BadModel as e:
            await error_response(e.status, str(e), param=e.param)(scope, receive, send)
            return
        if self.limits is not None and not scope.get(INTERNAL_SCOPE_KEY):  # per-key limits, where the request entered
            if refusal := await self.limits.refusal(owner_of(authorization), path, payload):
                await refusal(scope, receive, send)
                return
        if self.base_of.get(name, name) != self.model:  # a body cut at HAProxy's buffer, or a stale route: hand it to
            # its model's replica
            await self._to_other_replica(name, scope, headers, body, receive, send)
            return
        if self._engine_dead():
            await error_response(503, "The model engine of this replica has died; it is being replaced. Retry.",
                                 headers={"retry-after": RETRY_AFTER_S})(scope, receive, send)
            return
        watch = None
        if path in PD_ROUTES and (self.metrics is not None or self.tracing is not None):  # generation: measured
            watch = RequestWatch(self.metrics, self.tracing, scope, headers, self._replica_id.decode(), self.model,
                                 bool(scope.get(INTERNAL_SCOPE_KEY)))
        if self.admission is None:
            await self._serve(scope, headers, body, receive, send, watch, payload)
            return
        if self.admission.full():
            if self.metrics is not None:
                self.metrics.overload_rejection()
            await self.admission.reject(self.model)(scope, receive, send)
            return
        queued_ns = time.time_ns()
        async with self.admission.slot():
            if watch is not None:
                watch.span("summit.queue", queued_ns, time.time_ns())
            await self._serve(scope, headers, body, receive, send, watch, payload)

    async def _serve(self, scope, headers, body: bytes, receive, send, watch: RequestWatch | None = None,
                     payload: dict | None = None) -> None:
        adapter = (payload or {}).get("model")
        if self.adapters is None or adapter not in self.adapters.paths:
            await self._serve_model(scope, headers, body, receive, send, watch, payload)
            return
        try:  # one of this model's LoRA adapters: loaded into the engine while the request runs
            async with self.adapters.use(adapter):
                await self._serve_model(scope, headers, body, receive, send, watch, payload)
        except AdapterLoadError as e:  # the YAML's adapter, not the request, is at fault
            logger.error("%s", e)
            await error_response(500, str(e))(scope, receive, send)
            if watch is not None:
                watch.end()

    async def _serve_model(self, scope, headers, body: bytes, receive, send, watch: RequestWatch | None = None,
                           payload: dict | None = None) -> None:
        if self.disaggregated is not None and scope["path"] in PD_ROUTES:
            payload = None  # the decode engine runs another body (not resumed elsewhere)
            started_ns = time.time_ns()
            body = await self._prefill_first(scope, headers, body, receive, send)
            if watch is not None:
                watch.span("summit.prefill_pool", started_ns, time.time_ns())
            if body is None:  # answered (or the client left)
                if watch is not None:
                    watch.end()
                return
        await self._to_engine(scope, headers, body, receive, send, watch, payload)
        if watch is not None:
            watch.end()

    async def _prefill_first(self, scope, headers, body: bytes, receive, send) -> bytes | None:
        """A disaggregated model's prompt runs on its prefill pool first (deployments/pd.py); the body the decode
        engine then runs, or None when this answered already."""
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return body  # vLLM answers the 400
        pd = self.disaggregated
        if limit := pd.limit(scope["path"], payload):
            await error_response(400, limit)(scope, receive, send)
            return None
        client_id = header(headers, REQUEST_ID_HEADER) or uuid.uuid4().hex.encode()
        prefill_headers = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST_HEADERS]
        prefill_headers.append((REQUEST_ID_HEADER, client_id))
        try:
            answer = await pd.prefill(scope["path"], payload, prefill_headers, receive)
        except ClientGone:
            logger.info("request %s cancelled by its caller during its prefill: aborted there", client_id.decode())
            return None
        except PrefillFailed as e:
            if pd.fallback == "aggregated":
                logger.warning("request %s: prefill failed (%s); the decode engine computes the prompt",
                               client_id.decode(), e)
                return decode_body(payload, None)
            await error_response(503, f"The model's prefill pool could not serve this request ({e}); retry.",
                                 headers={"retry-after": RETRY_AFTER_S})(scope, receive, send)
            return None
        if "error" in answer:
            status, error = answer["error"]
            await _send_error(send, {"status": status, "headers": []}, error)
            return None
        return decode_body(payload, answer["kv_transfer_params"])

    async def _to_engine(self, scope, headers, body: bytes, receive, send, watch: RequestWatch | None = None,
                         payload: dict | None = None) -> None:
        client_id = header(headers, REQUEST_ID_HEADER) or uuid.uuid4().hex.encode()
        resume: Resumable | None = None  # a stream that goes on elsewhere if this engine dies (deployments/migration.py)
        if self.migration != "off" and payload is not None and self.resume_to is not None and not resumable(
                scope["path"], payload, self.migration, self.chat_parsers):
            resume = Resumable(scope["path"], payload, payload.get("model") or self.model, client_id, self.detokenizer,
                               self._replica_id)
            body = resume.engine_body()
        engine_headers = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST_HEADERS]
        engine_headers += [(REQUEST_ID_HEADER, client_id + b"-" + uuid.uuid4().hex[:8].encode()),
                           (b"content-length", str(len(body)).encode())]
        body_given = answered = False

        async def engine_receive() -> dict:
            nonlocal body_given
            if not body_given:
                body_given = True
                if watch is not None:
                    watch.engine_received()
                return {"type": "http.request", "body": body, "more_body": False}
            message = await receive()  # http.disconnect when the client goes: vLLM aborts the engine request
            if message["type"] == "http.disconnect":
                log_cancel()
            return message

        def log_cancel() -> None:
            nonlocal answered
            if not answered:
                answered = True  # once
                logger.info("request %s cancelled by its caller: aborting it in the engine", client_id.decode())
                if watch is not None:
                    watch.end(aborted=True)

        error: dict | None = None  # a non-stream error response, buffered to reshape it
        stream: Coalescer | None = None  # a streamed (SSE) answer

        async def engine_send(message: dict) -> None:
            nonlocal error, answered, stream, resume
            if resume is not None and message["type"] == "http.response.body":
                message = {**message, "body": resume.outgoing(message.get("body", b""))}
                if resume.failed:  # the rest is held back: resumed elsewhere (after the app returns) or sent then
                    if message["body"]:
                        await to_client(message["body"], True)
                    return
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            if message["type"] == "http.response.start":
                out = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _DROP_RESPONSE_HEADERS]
                out.append((REPLICA_HEADER, self._replica_id))  # Serve adds the x-request-id it was given
                if watch is not None:
                    watch.status = message["status"]
                    watch.response_headers(out)
                message = {**message, "headers": out}
                is_sse = (header(out, b"content-type") or b"").startswith(b"text/event-stream")
                if not is_sse or message["status"] != 200:
                    resume = None
                if message["status"] >= 500 and self._engine_dead():  # the engine died under this request
                    error = {"start": {**message, "status": 503, "headers": out + [(b"retry-after", RETRY_AFTER_S.encode())]},
                             "body": [], "message": "The model engine of this replica died; it is being replaced. Retry."}
                    return
                if message["status"] >= 400 and not is_sse:
                    error = {"start": message, "body": []}
                    if message["status"] >= 500 and (problem := request_problem(self._app, scope["path"], body)):
                        error = {"start": {**message, "status": 400}, "body": [], "message": problem}
                    return
                if is_sse and self._coalesce_s > 0:
                    stream = Coalescer(send, self._coalesce_s)
            elif watch is not None and message["type"] == "http.response.body":
                if not message.get("more_body", False):
                    watch.end()
                elif message.get("body"):
                    watch.first_output()
            if message["type"] == "http.response.body" and error is not None:
                error["body"].append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                answer = b"".join(error["body"])
                if "message" in error:
                    answer = json.dumps(error_body(error["start"]["status"], error["message"])).encode()
                await _send_error(send, error["start"], answer)
                return
            elif message["type"] == "http.response.body" and stream is not None:
                await stream.body(message.get("body", b""), message.get("more_body", False))
                return
            await send(message)

        async def to_client(chunk: bytes, more_body: bool) -> None:
            if stream is not None:
                await stream.body(chunk, more_body)
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": more_body})

        try:
            await self._app({**scope, "headers": engine_headers}, engine_receive, engine_send)
            if resume is not None and resume.failed:  # vLLM ended the stream with an error event
                self.relaying += 1  # this replica must live on while it relays (LLMServer.check_health)
                try:
                    outcome = await resume_or_fail(resume, self._engine_dead, self.resume_to, to_client, receive)
                finally:
                    self.relaying -= 1
                if self.metrics is not None and outcome:
                    self.metrics.stream_migration(outcome)
                answered = True
        except asyncio.CancelledError:  # the two-hop path cancels the app when its caller goes
            log_cancel()
            raise
        except Exception as e:
            if not answered:
                raise
            # Starlette re-raises what its error handler answered (a 500): the client has its answer; one line
            # here, not a traceback per bad request
            logger.warning("request %s: vLLM's app raised %s after answering: %s", client_id.decode(),
                           type(e).__name__, str(e)[:200])
        finally:
            if stream is not None:
                stream.close()

    async def _to_other_replica(self, name: str, scope, headers, body: bytes, receive, send) -> None:
        if self._forward is None or header(headers, FORWARDED_HEADER):  # forwarded once already: no loops
            await error_response(503, f"this replica serves {self.model!r}, not {name!r}; retry",
                                 headers={"retry-after": RETRY_AFTER_S})(scope, receive, send)
            return
        forwarded = HTTPRequest(scope["method"], scope["path"], body, scope.get("query_string", b""),
                                [(k, v) for k, v in headers if k.lower() not in (b"authorization", ARRIVAL_HEADER)]
                                + [(FORWARDED_HEADER, b"1"), (ARRIVAL_HEADER, f"{time.time():.6f}".encode())],
                                model=name)
        await relay(self._forward(forwarded), name, scope, receive, send)

    async def _to_batch_api(self, scope, headers, authorization: bytes | None, receive, send) -> None:
        if self._batch_api is None:
            await error_response(404, f"{scope['path']}: the Batch API is not enabled in this application; add a "
                                 "`batch:` block to its args (README: Batch)")(scope, receive, send)
            return
        body = await read_body(receive)
        owner = owner_of(authorization) if self._keys is not None else b""
        forwarded = HTTPRequest(scope["method"], scope["path"], body, scope.get("query_string", b""),
                                [(k, v) for k, v in headers if k.lower() not in (b"authorization", OWNER_HEADER)]
                                + [(OWNER_HEADER, owner)])
        await relay(self._batch_api(forwarded), "the Batch API", scope, receive, send)

    async def _list_models(self, scope, receive, send) -> None:
        """vLLM's own entry for this replica's model (max_model_len, root), then the application's other models."""
        own: list[dict] = []
        captured: dict = {"body": []}

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
            elif message["type"] == "http.response.body":
                captured["body"].append(message.get("body", b""))

        await self._app({**scope, "headers": [(k, v) for k, v in scope.get("headers") or [] if k != b"authorization"]},
                        receive, capture)
        if captured.get("status") == 200:  # vLLM's lists the adapters this replica has loaded: Summit's lists them all
            own = [m for m in json.loads(b"".join(captured["body"]))["data"] if m.get("id") == self.model]
        others = [m for m in self._models if m != self.model]
        if self._model_ready is not None:  # a model is listed once one of its replicas has started (and warmed up)
            ready = await asyncio.gather(*(self._model_ready(m) for m in others))
            others = [m for m, ok in zip(others, ready) if ok]
        listed = {self.model, *others}
        others += [a for a, base in self.base_of.items() if base in listed]
        data = own + [self.cards.get(m, {"id": m, "object": "model", "owned_by": "summit"}) for m in others]
        await send_json(send, 200, {"object": "list", "data": data})


async def _send_error(send, start: dict, body: bytes) -> None:
    body = openai_error_bytes(start["status"], body)
    headers = [(k, v) for k, v in start["headers"] if k.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": start["status"], "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
