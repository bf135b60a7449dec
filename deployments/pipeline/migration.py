"""Stream migration: a stream whose engine dies under it goes on from another replica, as one uninterrupted stream.

The front (deployments/server/front.py) holds the client's connection: on the direct path HAProxy's connection ends in
the replica's own HTTP server, on the two-hop path the ingress holds it and this replica's `handle_http` stream carries
it. A replica's engine (vLLM's EngineCore process) can die while the replica process and its front live on; vLLM's app
then ends each of its streams with an error event. For a stream that can be resumed, the front instead:

1. asks its engine for the token ids as they are generated (`return_token_ids`, which vLLM honours on both routes)
   and gives the client the chunks as vLLM writes them without it (`"token_ids":null`: the same bytes);
2. on the error event, with its engine dead, holds the error back and sends `/v1/completions` with the prompt's token
   ids (chat: after its template) + the tokens generated so far to another replica of the model (a Serve handle to
   its own deployment; the dead one answers 503 at once, so it tries again until `RESUME_TIMEOUT_S`);
3. writes that continuation's chunks in the original stream's shape (its id, created, object; chat deltas; usage
   counted over the whole stream), then its end. If no replica takes it in time, the client gets the held error.

At temperature 0 the continuation is the stream the dead engine would have produced (tested token for token).
What can be resumed (`resumable`): a stream of one choice without logprobs, echo, suffix, tools, structured output,
presence/frequency penalties or per-chunk usage; `stream_migration: greedy` (the default) also asks temperature 0,
`all` resumes any temperature (a fresh sample from the point reached), `off` none.

A stream can also be moved off a replica whose engine lives on (`LLMServer.move_streams`: the replica is told to).
The front then ends the engine's stream where the client's is (vLLM's app is told the client left: it aborts the
engine request) and goes on as above — and with `kv_migration` on, the stream carries its KV cache instead of the
other replica computing it again (`kv_plan` decides): this engine runs prompt + tokens so far once more as a prefill
of one token with vLLM's KV-transfer protocol (`kv_transfer_params: {do_remote_decode: true}`, the protocol a
disaggregated model's prefill pool runs; every full block is a prefix-cache hit, so it computes almost nothing) and
its connector keeps that KV for the other engine; the continuation carries the answer's `kv_transfer_params`, and the
other engine's connector loads the KV instead of computing it. A hand-off that fails, or a context shorter than
`kv_migration.min_tokens`, goes on by recomputing; a KV the other engine cannot load is recomputed there (its
connector's `kv_load_failure_policy`); a continuation that fails is continued again, recomputing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.http.protocol import REQUEST_ID_HEADER, HTTPRequest
from deployments.http.relay import unless_client_leaves
from deployments.pipeline.prefill import PREFILL_PARAMS
from deployments.pipeline.resumable import CHAT, COMPLETIONS, RESUME_TIMEOUT_S, Resumable

logger = logging.getLogger("ray.serve")

POLICIES = ("greedy", "all", "off")


def resumable(path: str, payload: Any, policy: str, chat_parsers: bool = False) -> str | None:
    """None when this request's stream can be resumed on another replica; else why not (for the debug log)."""
    if policy == "off" or path not in (CHAT, COMPLETIONS) or not isinstance(payload, dict):
        return "not a generation route"
    if payload.get("stream") is not True:
        return "not streamed"
    if policy == "greedy" and payload.get("temperature") not in (0, 0.0):
        return "not temperature 0"
    if payload.get("n") not in (None, 1) or payload.get("best_of") not in (None, 1):
        return "more than one choice"
    if payload.get("stop"):
        return "stop strings (one could span the cut)"
    if any(payload.get(k) not in (None, 0, 0.0) for k in ("presence_penalty", "frequency_penalty")):
        return "presence/frequency penalties count the tokens before the cut as the prompt's"
    if any(
        payload.get(k)
        for k in (
            "logprobs",
            "top_logprobs",
            "echo",
            "suffix",
            "prompt_logprobs",
            "tools",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "structured_outputs",
            "prompt_embeds",
            "kv_transfer_params",
        )
    ):
        return "logprobs, echo, tools or structured output"
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "per-chunk usage"
    fmt = payload.get("response_format")
    if fmt not in (None, {"type": "text"}):
        return "a response format"
    if path == COMPLETIONS:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))):
            return "more than one prompt"
    elif chat_parsers:
        return "the model's reasoning or tool parser shapes chat deltas"
    return None


async def resume_or_fail(
    resume: Resumable,
    engine_dead: Callable[[], bool],
    forward: Callable[[HTTPRequest], Any],
    out: Callable[[bytes, bool], Awaitable[None]],
    receive,
) -> str | None:
    """After the engine's stream ended in an error event: resume it elsewhere if the engine died, else send the error.
    Ends the client's response either way; the outcome (resumed, failed, client_gone; None: not the engine dying)."""
    if not await _soon(engine_dead, 2.0):  # an error of this request, not a dead engine: the client gets it
        await out(b"".join(resume.held), False)
        return None
    rid = resume.request_id.decode()
    logger.warning(
        "request %s: this replica's engine died after %d tokens of its stream; resuming it on another replica",
        rid,
        len(resume.generated),
    )

    async def send(chunk: bytes) -> None:
        await out(chunk, True)

    task = await unless_client_leaves(resume.resume(forward, send), receive)
    if task is None:
        logger.info("request %s cancelled by its caller while being resumed", rid)
        return "client_gone"
    if task.exception() is None and task.result():
        await out(b"", False)
        logger.info("request %s resumed on another replica: %d tokens in all", rid, len(resume.generated))
        return "resumed"
    logger.warning(
        "request %s: no replica took its continuation within %.0f s; the client gets the error", rid, RESUME_TIMEOUT_S
    )
    await out(b"".join(resume.held), False)
    return "failed"


@dataclasses.dataclass
class KVMigration:
    """`kv_migration` as a replica's front runs it: streams of at least `min_tokens` of context carry their KV;
    `tokens(ids)`: what the engine runs to hand off the KV of a stream that goes on from `ids` (the connector's)."""

    min_tokens: int
    tokens: Callable[[list[int]], list[int]] = list


def kv_plan(resume: Resumable, kv: KVMigration | None, engine_alive: bool) -> str | None:
    """None when a stream that moves now carries its KV cache; else why the other replica recomputes it."""
    if kv is None:
        return "kv_migration is off"
    if not engine_alive:
        return "its engine died (the KV went with it)"
    if resume.prompt_ids is None:
        return "no output yet (its prompt's token ids are not known)"
    context = len(resume.prompt_ids) + len(resume.generated)
    if context < kv.min_tokens:
        return f"{context} tokens of context, under kv_migration.min_tokens {kv.min_tokens}"
    return None


class HandOffFailed(Exception):
    """This engine did not keep the stream's KV for another (the message says why)."""


async def hand_off(app, scope: dict, model: str, ids: list[int], request_id: bytes) -> dict:
    """Run `ids` on this replica's engine (vLLM's OpenAI app `app`; `scope`: the stream's own request's) as a one-token
    prefill whose KV its connector keeps for another engine; the answer's `kv_transfer_params` for that engine ({}
    when the connector needs none: it finds the KV by the tokens). Raises HandOffFailed."""
    body = json.dumps(
        {
            "model": model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": dict(PREFILL_PARAMS),
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (REQUEST_ID_HEADER, request_id + b"-kv-" + uuid.uuid4().hex[:8].encode()),
    ]
    scope = {
        **scope,
        "method": "POST",
        "path": COMPLETIONS,
        "raw_path": COMPLETIONS.encode(),
        "query_string": b"",
        "headers": headers,
    }
    given, answer = False, {"status": None, "body": []}
    never = asyncio.Event()

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # nobody leaves this request
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"].append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception as e:  # noqa: BLE001 — whatever stopped it, the stream recomputes
        raise HandOffFailed(f"vLLM's app raised {type(e).__name__}: {e}") from None
    raw = b"".join(answer["body"])
    if answer["status"] != 200:
        raise HandOffFailed(f"the engine answered {answer['status']}: {raw[:200]!r}")
    try:
        params = json.loads(raw).get("kv_transfer_params")
    except (ValueError, AttributeError):
        raise HandOffFailed("the engine's answer is not JSON") from None
    return params or {}


async def move_or_fail(
    resume: Resumable,
    carry: Callable[[], Awaitable[tuple[str, str | None]]],
    forward: Callable[[HTTPRequest], Any],
    out: Callable[[bytes, bool], Awaitable[None]],
    receive,
) -> str:
    """A stream cut on a live engine to move: its KV handed off (`carry`: the outcome's kv part and why not),
    then resumed elsewhere; the client's response ends either way. The outcome: moved_kv / moved_recompute, failed
    (no replica took it: the client gets an error event), client_gone."""
    rid = resume.request_id.decode()

    async def send(chunk: bytes) -> None:
        await out(chunk, True)

    async def go_on() -> tuple[str, bool]:
        kv, why = await carry()
        logger.info(
            "request %s: moving its stream after %d tokens (%s)",
            rid,
            len(resume.generated),
            "its KV carried" if kv == "kv" else f"recomputed: {why}",
        )
        return kv, await resume.resume(forward, send)

    task = await unless_client_leaves(go_on(), receive)
    if task is None:
        logger.info("request %s cancelled by its caller while being moved", rid)
        return "client_gone"
    if task.exception() is None and task.result()[1]:
        await out(b"", False)
        kv = task.result()[0]
        logger.info("request %s moved to another replica: %d tokens in all", rid, len(resume.generated))
        return "moved_kv" if kv == "kv" else "moved_recompute"
    logger.warning("request %s: no replica took the moved stream within %.0f s", rid, RESUME_TIMEOUT_S)
    await out(resume.error_event(), False)
    return "failed"


async def _soon(predicate: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def resumable_stream(
    policy: str,
    resume_to: Callable[[HTTPRequest], Any] | None,
    chat_parsers: bool,
    detokenizer: Callable | None,
    replica_id: str,
):
    """The pipeline step that marks a stream to resume elsewhere if this replica's engine dies (`ctx.resume`; the
    engine then also reports the token ids)."""

    async def step(ctx) -> None:
        if policy == "off" or ctx.payload is None or resume_to is None:
            return None
        if resumable(ctx.path, ctx.payload, policy, chat_parsers) is not None:
            return None
        ctx.resume = Resumable(
            ctx.path,
            ctx.payload,
            ctx.payload.get("model") or ctx.model,
            ctx.client_request_id,
            detokenizer,
            replica_id.encode(),
        )
        ctx.body = ctx.resume.engine_body()
        return None

    return step
