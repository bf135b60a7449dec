"""The two-hop path's OpenAI HTTP ingress: thin routes that pick a model's deployment handle and pass the response
through (the direct path has none: see deployments/front.py and route_picker.py).

vLLM's own OpenAI app (in the model replica) parses and validates requests; the ingress only reads
`model` from the body, forwards the request unchanged, streams SSE through unbuffered and makes every
error OpenAI-shaped.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.config import AuthOptions
from deployments.auth import authorized, load_api_keys, unauthorized
from deployments.errors import error_response, openai_error_bytes
from deployments.handoff import OWNER_HEADER, can_route, owner_of
from deployments.lora_runtime import LOAD, LoraRequestError, parse_load, parse_unload
from deployments.model_names import BadModel, model_and_payload
from deployments.observe import ARRIVAL_HEADER
from deployments.protocol import HTTPRequest, ResponseStart
from deployments.rate_limit import Limits
from deployments.replica_stream import ModelUnavailable, ReplicaStream, first_response, rest_of_body

REQUEST_ID_HEADER = "x-request-id"
# Headers the ingress sets itself or that describe the hop, not the payload; the API key stays at the ingress.
_DROP_REQUEST_HEADERS = {b"authorization", b"host", b"content-length", b"content-type", b"x-request-id",
                         b"transfer-encoding", b"connection"}
_DROP_RESPONSE_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"date", b"server", b"x-request-id"}


def _response_headers(start: ResponseStart) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in start.headers if k.lower() not in _DROP_RESPONSE_HEADERS}


api = FastAPI(title="Summit", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(400, str(exc.errors()))


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, servers: dict[str, DeploymentHandle], auth: AuthOptions | None = None,
                 batch_api: DeploymentHandle | None = None, limiter: DeploymentHandle | None = None,
                 adapters: dict[str, str] | None = None, adapter_registry: DeploymentHandle | None = None,
                 runtime_lora_models: list[str] | None = None):
        """`servers`: each model's engine deployment; `adapters`: each LoRA adapter's model (its replicas serve it);
        `adapter_registry`: the adapters loaded at run time into `runtime_lora_models` (deployments/lora_runtime.py)."""
        self._servers = servers
        self._adapters = adapters or {}
        self._registry = adapter_registry
        self._runtime_models = runtime_lora_models or []
        self._runtime: dict[str, str] = {}  # adapter loaded at run time -> its model, as the registry last said
        self._runtime_read = 0.0
        self._batch_api = batch_api
        self._keys = load_api_keys(auth.api_keys_env, auth.api_keys_file) if auth else None
        self._limits = Limits(limiter, auth.rate_limit.default_max_tokens) if limiter is not None else None

    def _denied(self, request: Request) -> Response | None:
        """The 401 for a request without a valid API key, when keys are configured."""
        if self._keys is None or authorized(request.headers.get("authorization"), self._keys):
            return None
        return unauthorized(request.headers.get("authorization"))

    @api.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @api.get("/openapi.json")
    async def openapi(self) -> Response:
        """Summit's OpenAPI document, as a replica's front builds it (deployments/openapi.py)."""
        for name in self._servers:
            try:
                start, body = await self._call(name, HTTPRequest("GET", "/openapi.json"))
            except ModelUnavailable:
                continue
            return Response(body, status_code=start.status, media_type="application/json")
        return error_response(503, "no model has a running replica yet; retry", headers={"retry-after": "5"})

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        """Every model's own /v1/models answer (vLLM's, with max_model_len), merged into one list: a model is listed
        once one of its replicas has started and answered its warm-up, not before."""
        if denied := self._denied(request):
            return denied
        data = []
        for name in self._servers:
            if not await can_route(self._servers[name], HTTPRequest("GET", "/v1/models")):
                continue
            try:
                start, body = await self._call(name, HTTPRequest("GET", "/v1/models"))
            except ModelUnavailable:  # its replica went away meanwhile
                continue
            if start.status == 200:
                data.extend(json.loads(body)["data"])
        return JSONResponse({"object": "list", "data": data})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        return await self._runtime_lora(request)

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self._runtime_lora(request)

    async def _runtime_adapters(self, fresh: bool = False) -> dict[str, str]:
        """Adapters loaded at run time -> their model (read from the registry at most every half second)."""
        if self._registry is not None and (fresh or time.monotonic() - self._runtime_read > 0.5):
            _, entries = await self._registry.snapshot.remote()
            self._runtime = {name: base for name, (base, _) in entries.items()}
            self._runtime_read = time.monotonic()
        return self._runtime

    async def _runtime_lora(self, request: Request) -> Response:
        """vLLM's adapter routes: checked here, answered by a replica of the adapter's model (it loads the adapter)."""
        if denied := self._denied(request):
            return denied
        if self._registry is None:
            return error_response(404, f"POST {request.url.path} is not served: no model has `lora.runtime_loading: "
                                  "true` (README: LoRA adapters)")
        body = await request.body()
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            payload = None
        runtime = await self._runtime_adapters(fresh=True)
        try:
            if request.url.path == LOAD:
                _, _, base = parse_load(payload, self._runtime_models, {*self._servers, *self._adapters, *runtime})
            else:
                name = parse_unload(payload, set(self._adapters))
                if name not in runtime:
                    raise LoraRequestError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
                base = runtime[name]
        except LoraRequestError as e:
            return error_response(e.status, str(e), param=e.param)
        try:
            start, reply = await self._call(base, HTTPRequest("POST", request.url.path, body, b"",
                                                              [(b"content-type", b"application/json")], model=base))
        except ModelUnavailable as e:
            return error_response(e.status, str(e), headers={"retry-after": e.retry_after})
        return Response(reply, status_code=start.status, headers=_response_headers(start))

    @api.api_route("/v1/files{rest:path}", methods=["GET", "POST", "DELETE"])
    async def files(self, request: Request, rest: str) -> Response:
        return await self._to_batch_api(request)

    @api.api_route("/v1/batches{rest:path}", methods=["GET", "POST", "DELETE"])
    async def batches(self, request: Request, rest: str) -> Response:
        return await self._to_batch_api(request)

    async def _to_batch_api(self, request: Request) -> Response:
        """The Batch API's store answers (deployments/batch_api.py); the body goes as it came (a multipart upload
        keeps its content type), with the caller's owner."""
        if denied := self._denied(request):
            return denied
        if self._batch_api is None:
            return error_response(404, f"{request.url.path}: the Batch API is not enabled in this application; add a "
                                  "`batch:` block to its args (README: Batch)")
        owner = owner_of(request.headers.get("authorization", "").encode()) if self._keys is not None else b""
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in (b"authorization", OWNER_HEADER)]
        forwarded = HTTPRequest(request.method, request.url.path, await request.body(), request.url.query.encode(),
                                headers + [(OWNER_HEADER, owner)])
        try:
            stream = self._batch_api.options(stream=True).handle_http.remote(forwarded)
            start = await first_response(stream)
            payload = await rest_of_body(stream)
        except ModelUnavailable as e:
            return error_response(e.status, str(e), headers={"retry-after": e.retry_after})
        return Response(payload, status_code=start.status, headers=_response_headers(start))

    async def _forward(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        # Serve's proxy answers with the client's x-request-id (or its own); the replica's front gives the engine
        # that id plus a unique suffix.
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        arrival = time.time()
        body = await request.body()
        try:
            name, payload = model_and_payload(body, [*self._servers, *self._adapters, *self._runtime])
        except BadModel as e:
            if e.status != 404 or self._registry is None:
                return error_response(e.status, str(e), param=e.param)
            try:  # perhaps an adapter loaded at run time since the registry was last read
                name, payload = model_and_payload(body, [*self._servers, *self._adapters, *await self._runtime_adapters()])
            except BadModel as again:
                return error_response(again.status, str(again), param=again.param)
        if self._limits is not None:
            owner = owner_of(request.headers.get("authorization", "").encode())
            if refusal := await self._limits.refusal(owner, request.url.path, payload):
                return refusal
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _DROP_REQUEST_HEADERS]
        headers = [(k, v) for k, v in headers if k.lower() != ARRIVAL_HEADER]
        headers += [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode()),
                    (ARRIVAL_HEADER, f"{arrival:.6f}".encode())]
        forwarded = HTTPRequest("POST", request.url.path, body, request.url.query.encode(), headers, model=name)
        try:
            model = self._adapters.get(name) or self._runtime.get(name) or name
            stream = self._servers[model].options(stream=True).handle_http.remote(forwarded)
            start = await first_response(stream)
            reply_headers = _response_headers(start)
            if start.header(b"content-type", b"").startswith(b"text/event-stream"):
                return ReplicaStream(stream, request_id, start.status, reply_headers)
            payload = await rest_of_body(stream)
        except ModelUnavailable as e:
            return error_response(e.status, str(e), headers={"retry-after": e.retry_after})
        if start.status >= 400:
            payload = openai_error_bytes(start.status, payload)
        return Response(payload, status_code=start.status, headers=reply_headers)

    async def _call(self, name: str, request: HTTPRequest) -> tuple[ResponseStart, bytes]:
        stream = self._servers[name].options(stream=True).handle_http.remote(request)
        start = await first_response(stream)
        return start, await rest_of_body(stream)
