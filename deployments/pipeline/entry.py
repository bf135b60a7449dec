"""The steps every request meets where it enters Summit, on both HTTP entries: API key, body, model, rate limit.

A request that came through a Serve handle (`ctx.internal`: the ingress, another replica or the batch runner passed it
on) was let in where it entered: its key and rate limit are not checked again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from deployments.http.asgi import read_body
from deployments.http.errors import OpenAIError
from deployments.http.routes import POST_ROUTES
from deployments.pipeline.auth import authorized, owner_of, unauthorized
from deployments.pipeline.context import RequestContext, Step
from deployments.pipeline.model_names import model_and_payload
from deployments.pipeline.rate_limit import Limits

# The largest body an OpenAI route takes (a 128k-token prompt as token ids is ~1 MiB; images inline in a chat are
# the big ones): a larger one is answered 413 before it is read.
MAX_REQUEST_BYTES = 32 << 20


def route_not_served(model: str, path: str, served: frozenset[str]) -> OpenAIError:
    """404 for a route the model's task does not have (vLLM decides which: its runner and convert)."""
    listed = ", ".join(sorted(served & POST_ROUTES)) or "none"
    return OpenAIError(
        404,
        f"model {model!r} does not serve POST {path} (not a route of its task); it serves POST {listed}",
        param="model",
    )


def authenticate(keys: list[bytes] | None) -> Step:
    """401 without one of `keys` (None: keys are off); records the caller's owner id (a hash of its key)."""

    async def step(ctx: RequestContext) -> OpenAIError | None:
        if keys is None or ctx.internal:
            return None
        authorization = ctx.header(b"authorization")
        if not authorized(authorization and authorization.decode(), keys):
            return unauthorized(authorization and authorization.decode())
        ctx.owner = owner_of(authorization)
        return None

    return step


def bounded_body(limit: int | None = MAX_REQUEST_BYTES) -> Step:
    """The whole body into `ctx.body`; 413 past `limit` bytes (the rest is left unread)."""

    async def step(ctx: RequestContext) -> OpenAIError | None:
        ctx.body = await read_body(ctx.receive, limit)
        if ctx.body is None:
            return OpenAIError(413, f"the request body is larger than {limit >> 20} MiB")
        return None

    return step


def resolve_model(
    names: Callable[[], Sequence[str]], refresh: Callable[[], Awaitable[Sequence[str]]] | None = None
) -> Step:
    """The model (or adapter) the JSON body names, among `names()`: 400 for a body that is not a JSON object, 404 for
    an unknown name. `refresh()`: the names again from their source, asked once before a 404 (adapters loaded at run
    time since the entry last looked)."""

    async def step(ctx: RequestContext) -> OpenAIError | None:
        try:
            ctx.model, ctx.payload = model_and_payload(ctx.body, names())
        except OpenAIError as e:
            if e.status != 404 or refresh is None:
                return e
            try:
                ctx.model, ctx.payload = model_and_payload(ctx.body, await refresh())
            except OpenAIError as again:
                return again
        return None

    return step


def rate_limit(limits: Limits | None) -> Step:
    """429 + Retry-After once the caller's key is over its requests or tokens per minute (auth.rate_limit)."""

    async def step(ctx: RequestContext) -> OpenAIError | None:
        if limits is None or ctx.internal:
            return None
        return await limits.refusal(owner_of(ctx.header(b"authorization")), ctx.path, ctx.payload)

    return step


def not_served(ctx: RequestContext) -> OpenAIError:
    status = 405 if ctx.path in POST_ROUTES else 404
    return OpenAIError(
        status,
        f"{ctx.method} {ctx.path} is not served; OpenAI routes: GET /v1/models, /v1/files, "
        f"/v1/batches, /v1/responses/{{id}}, POST {', '.join(sorted(POST_ROUTES))}, /v1/responses/{{id}}/cancel",
    )
