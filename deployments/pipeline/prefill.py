"""Prefill/decode disaggregation, as the decode replica's front runs it (deployments/server/front.py).

A request for a disaggregated model reaches one of its decode replicas (HAProxy or the ingress, as any request).
There the front asks the model's prefill pool, through a Serve handle (its router: prefix affinity picks the
replica that may hold the prefix), to compute the prompt with vLLM's KV-transfer protocol — the same body with
`max_tokens: 1`, no stream, and `kv_transfer_params: {do_remote_decode: true}` — which makes the prefill engine's
KV connector keep the prompt's KV for a decode engine; its answer's `kv_transfer_params` tell the decode engine where
to load it from. Then the request itself runs on the local (decode) engine with those params: vLLM loads the
prompt's KV through its connector instead of computing it, and streams the answer as usual.

If the prefill pool cannot answer (replica dead or restarting, overloaded, engine failed), `fallback: aggregated`
runs the request on the decode engine without params (it computes the prompt itself) and `fallback: error` answers
503 + Retry-After. A KV that cannot be loaded is the decode engine's `kv_load_failure_policy` (recompute, or fail).
A client that leaves during the prefill cancels it (the prefill engine aborts the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from deployments.http.errors import OpenAIError
from deployments.http.protocol import HOP_HEADERS, REQUEST_ID_HEADER, HTTPRequest, without
from deployments.http.relay import first_response, rest_of_body, unless_client_leaves
from deployments.pipeline.context import Answered, RequestContext

logger = logging.getLogger("ray.serve")

PD_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
# What the prefill engine is asked for: one token, no stream, and the KV kept for a remote decode.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Options the prefill request must not carry (they shape the streamed answer, which the decode side gives).
_PREFILL_DROP = (
    "stream",
    "stream_options",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "min_tokens",
    "echo",
    "prompt_logprobs",
)


class PrefillFailed(Exception):
    """The prefill pool gave no KV for this request (the message says why)."""


class Disaggregated:
    """A decode replica's side of its model's disaggregation: `call_prefill(HTTPRequest)` returns a Serve response
    stream from a prefill replica (its `handle_http`); `fallback`: "aggregated" or "error"."""

    def __init__(self, call_prefill: Callable[[HTTPRequest], Any], fallback: str):
        self._call_prefill = call_prefill
        self.fallback = fallback

    @staticmethod
    def limit(path: str, payload: dict) -> str | None:
        """A request option a decode that loads the prompt's KV cannot honour, named (answered 400), or None."""
        if payload.get("echo"):
            return "`echo` is not available for a disaggregated model (the decode engine does not compute the prompt)"
        if payload.get("prompt_logprobs") is not None:
            return (
                "`prompt_logprobs` is not available for a disaggregated model (the decode engine does not compute "
                "the prompt)"
            )
        return None

    def prefill_request(self, path: str, payload: dict, headers: list[tuple[bytes, bytes]]) -> HTTPRequest:
        body = {k: v for k, v in payload.items() if k not in _PREFILL_DROP}
        body.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
        return HTTPRequest("POST", path, json.dumps(body).encode(), b"", headers, model=payload.get("model"))

    async def prefill(self, path: str, payload: dict, headers: list[tuple[bytes, bytes]], receive) -> dict | None:
        """Run the prompt on a prefill replica; its `kv_transfer_params` for the decode engine (None: the connector
        needs none). Raises PrefillFailed when the pool gave no KV, ClientGone when the client left meanwhile, and
        returns the prefill's own 4xx answer as `{"error": (status, body)}` (a bad request is bad on both sides)."""
        stream = self._call_prefill(self.prefill_request(path, payload, headers))

        async def call() -> tuple[int, bytes]:
            start = await first_response(stream)
            return start.status, await rest_of_body(stream)

        try:
            task = await unless_client_leaves(call(), receive)
        except asyncio.CancelledError:  # the server cancelled this request (the client's connection closed)
            stream.cancel()  # the prefill engine aborts the request
            logger.info("request cancelled by its caller during its prefill: aborted there")
            raise
        if task is None:
            stream.cancel()  # the prefill engine aborts the request
            raise ClientGone()
        try:
            status, body = task.result()
        except OpenAIError as e:
            raise PrefillFailed(str(e)) from None
        if 400 <= status < 500:
            return {"error": (status, body)}
        if status != 200:
            raise PrefillFailed(f"the prefill replica answered {status}")
        try:
            params = json.loads(body).get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise PrefillFailed("the prefill replica's answer is not JSON") from None
        return {"kv_transfer_params": params}


class ClientGone(Exception):
    """The client left while its prompt was being prefilled."""


def decode_body(payload: dict, kv_transfer_params: dict | None) -> bytes:
    """The request as the decode engine runs it: as sent, plus the prefill's KV-transfer params when there are any."""
    if kv_transfer_params is None:
        return json.dumps(payload).encode()
    return json.dumps({**payload, "kv_transfer_params": kv_transfer_params}).encode()


def prefill_first(pd: Disaggregated):
    """The pipeline step of a disaggregated model's decode replica: the prompt runs on its prefill pool first, and the
    decode engine then runs the request with the prefill's KV-transfer params (`ctx.body`). Such a stream is not
    resumed elsewhere (`ctx.payload` is dropped)."""

    async def step(ctx: RequestContext) -> OpenAIError | None:
        if ctx.path not in PD_ROUTES:
            return None
        payload, ctx.payload = ctx.payload, None
        if limit := pd.limit(ctx.path, payload):
            return OpenAIError(400, limit)
        started_ns = time.time_ns()
        prefilled = False
        try:
            ctx.body, prefilled = await _prefilled_body(pd, ctx, payload)
        finally:
            if ctx.watch is not None:
                ctx.watch.prefilled(started_ns, time.time_ns(), phases=prefilled)
        return None

    return step


async def _prefilled_body(pd: Disaggregated, ctx: RequestContext, payload: dict) -> tuple[bytes, bool]:
    """The body the decode engine runs, and whether the prefill pool ran the prompt (False: the decode engine
    computes it, `fallback: aggregated`); raises the refusal (or Answered when the client left)."""
    client_id = ctx.client_request_id
    headers = without(ctx.headers, HOP_HEADERS) + [(REQUEST_ID_HEADER, client_id)]
    try:
        answer = await pd.prefill(ctx.path, payload, headers, ctx.receive)
    except ClientGone:
        logger.info("request %s cancelled by its caller during its prefill: aborted there", client_id.decode())
        raise Answered() from None
    except PrefillFailed as e:
        if pd.fallback != "aggregated":
            raise OpenAIError.unavailable(
                f"The model's prefill pool could not serve this request ({e}); retry."
            ) from None
        logger.warning("request %s: prefill failed (%s); the decode engine computes the prompt", client_id.decode(), e)
        return decode_body(payload, None), False
    if "error" in answer:
        status, error = answer["error"]
        raise OpenAIError.from_body(status, error)
    return decode_body(payload, answer["kv_transfer_params"]), True
