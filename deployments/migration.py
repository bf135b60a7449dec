"""Stream migration: a stream whose engine dies under it goes on from another replica, as one uninterrupted stream.

The front (deployments/front.py) holds the client's connection: on the direct path HAProxy's connection ends in the
replica's own HTTP server, on the two-hop path the ingress holds it and this replica's `handle_http` stream carries
it. A replica's engine (vLLM's EngineCore process) can die while the replica process and its front live on; vLLM's
app then ends each of its streams with an error event. For a stream that can be resumed, the front instead:

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
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.protocol import AVOID_HEADER, HTTPRequest
from deployments.replica_stream import ModelUnavailable, first_response

logger = logging.getLogger("ray.serve")

POLICIES = ("greedy", "all", "off")
RESUME_TIMEOUT_S = 60.0  # how long a stream waits for a replica to take its continuation
_RETRY_S = 0.5
# vLLM's chunks are compact JSON: a key can only match here outside a string (inside one, its quotes are escaped)
_IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\[([0-9,]*)\]')
_ERROR_EVENT = b'data: {"error"'
_DONE = b"data: [DONE]"
_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
# sampling fields a chat request carries over to its /v1/completions continuation
_CHAT_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop", "stop_token_ids",
                  "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                  "priority", "stream_options", "user")


def resumable(path: str, payload: Any, policy: str, chat_parsers: bool = False) -> str | None:
    """None when this request's stream can be resumed on another replica; else why not (for the debug log)."""
    if policy == "off" or path not in (_CHAT, _COMPLETIONS) or not isinstance(payload, dict):
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
    if any(payload.get(k) for k in ("logprobs", "top_logprobs", "echo", "suffix", "prompt_logprobs", "tools",
                                     "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                     "structured_outputs", "prompt_embeds", "kv_transfer_params")):
        return "logprobs, echo, tools or structured output"
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "per-chunk usage"
    fmt = payload.get("response_format")
    if fmt not in (None, {"type": "text"}):
        return "a response format"
    if path == _COMPLETIONS:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))):
            return "more than one prompt"
    elif chat_parsers:
        return "the model's reasoning or tool parser shapes chat deltas"
    return None


class Resumable:
    """One stream that can go on elsewhere: what its engine has generated so far, and the continuation."""

    def __init__(self, path: str, payload: dict, model: str, request_id: bytes, detokenizer: Callable | None = None,
                 avoid_replica: bytes = b""):
        self.path, self.payload, self.model, self.request_id = path, payload, model, request_id
        self.avoid_replica = avoid_replica  # the replica whose engine died: Summit's routers send the continuation elsewhere
        # (prompt ids, generated ids, skip_special_tokens, spaces_between_special_tokens) -> vLLM's detokenizer at that
        # point, (ids, ended) -> text (vllm_adapter.output_detokenizer): the continuation's text as the dead engine
        # would have written it, a character split at the cut included; None: the continuation's own text
        self._detokenizer = detokenizer
        self._text: Callable[[list[int], bool], str] | None = None
        self.client_wants_ids = payload.get("return_token_ids") is True
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.head: dict | None = None  # id, object, created, model of the stream's chunks
        self.held: list[bytes] = []  # the dead engine's error event (and anything after it), sent if resuming fails
        self.failed = False  # the engine's stream ended in an error event
        self.migrations = 0
        self._resumed_at = 0  # tokens generated before the running continuation

    def engine_body(self) -> bytes:
        return json.dumps({**self.payload, "return_token_ids": True}).encode()

    def outgoing(self, body: bytes) -> bytes:
        """A body chunk of the engine's stream -> what the client gets now (token ids recorded and, unless it asked for
        them, written as vLLM writes them without it); an error event and all after it are held back."""
        if self.failed:
            self.held.append(body)
            return b""
        if self.head is None and body.startswith(b"data: {"):
            event = body.split(b"\n\n", 1)[0]
            try:
                chunk = json.loads(event[6:])
                self.head = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
            except ValueError:
                pass
        error_at = body.find(_ERROR_EVENT)
        if error_at >= 0:
            self.failed = True
            self.held.append(body[error_at:])
            body = body[:error_at]
        return _IDS.sub(self._record, body)

    def _record(self, match: re.Match) -> bytes:
        ids = [int(t) for t in match.group(2).split(b",") if t]
        if match.group(1) == b"prompt_token_ids":
            if self.prompt_ids is None:
                self.prompt_ids = ids
        else:
            self.generated.extend(ids)
        return match.group(0) if self.client_wants_ids else b'"' + match.group(1) + b'":null'

    def continuation(self) -> HTTPRequest | None:
        """The /v1/completions request that goes on from the tokens so far; None if there is nothing to go on from."""
        if self.prompt_ids is None:
            return None
        p = self.payload
        if self.path == _COMPLETIONS:
            body = {k: v for k, v in p.items() if k not in ("prompt", "max_tokens", "min_tokens")}
            limit = p.get("max_tokens", 16)
        else:
            body = {k: p[k] for k in _CHAT_SAMPLING if k in p}
            limit = p.get("max_completion_tokens", p.get("max_tokens"))
        if limit is not None:
            if limit - len(self.generated) <= 0:
                return None
            body["max_tokens"] = limit - len(self.generated)
        else:
            body["max_tokens"] = None  # vLLM: the rest of the context
        if p.get("min_tokens"):
            body["min_tokens"] = max(0, p["min_tokens"] - len(self.generated))
        body.update(model=self.model, prompt=self.prompt_ids + self.generated, stream=True, return_token_ids=True)
        self.migrations += 1
        self._resumed_at = len(self.generated)
        if self._detokenizer is not None:
            self._text = self._detokenizer(self.prompt_ids, self.generated, p.get("skip_special_tokens", True),
                                           p.get("spaces_between_special_tokens", True))
        request_id = self.request_id + f"-m{self.migrations}-{uuid.uuid4().hex[:8]}".encode()
        headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id)]
        if self.avoid_replica:
            headers.append((AVOID_HEADER, self.avoid_replica))
        return HTTPRequest("POST", _COMPLETIONS, json.dumps(body).encode(), b"", headers, model=self.model)

    def rewrite(self, event: bytes) -> bytes:
        """One event of the continuation (a /v1/completions stream) in the original stream's shape."""
        if not event.startswith(b"data: {") or event.startswith(_ERROR_EVENT):
            return event
        chunk = json.loads(event[6:])
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids") or []
            self.generated.extend(ids)
            if self._text is not None:
                choice["text"] = self._text(ids, choice.get("finish_reason") == "stop")
            if not self.client_wants_ids:
                choice["token_ids"] = None
            if "prompt_token_ids" in choice:  # the stream's first chunk had the prompt's
                choice["prompt_token_ids"] = None
            if self.path == _CHAT:
                text = choice.pop("text", "")
                for key in ("prompt_token_ids", "prompt_logprobs"):
                    choice.pop(key, None)
                if choice.get("finish_reason") is None:
                    choice.pop("stop_reason", None)
                chunk_choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                "finish_reason": choice.get("finish_reason")}
                if "stop_reason" in choice:
                    chunk_choice["stop_reason"] = choice["stop_reason"]
                chunk_choice["token_ids"] = choice.get("token_ids")
                choice.clear()
                choice.update(chunk_choice)
        if usage := chunk.get("usage"):
            prompt = len(self.prompt_ids or [])
            completion = self._resumed_at + usage.get("completion_tokens", 0)
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            usage.pop("prompt_tokens_details", None)
        chunk.update(self.head or {})
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()

    async def resume(self, forward: Callable[[HTTPRequest], Any], out: Callable[[bytes], Awaitable[None]],
                     timeout_s: float = RESUME_TIMEOUT_S) -> bool:
        """Go on from another replica, writing its events through `out` until the stream's end ([DONE] included);
        False when no replica took it within `timeout_s` (the caller then sends what it held: the error)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            request = self.continuation()
            if request is None:
                return False
            try:
                stream = forward(request)
                start = await first_response(stream)
            except ModelUnavailable as e:
                logger.info("request %s: no replica took its continuation yet (%s)", self.request_id.decode(), e)
                await asyncio.sleep(_RETRY_S)
                continue
            if start.status != 200:  # the dead replica itself (503), or one at its bound (429): another try
                await _drain(stream)
                await asyncio.sleep(_RETRY_S)
                continue
            ended = await self._relay(stream, out)
            if ended:
                return True
            # the continuation's engine died too: go on from there
        return False

    async def _relay(self, stream, out) -> bool:
        """The continuation's events to the client; True once its [DONE] went out, False if it ended in an error."""
        pending = b""
        try:
            async for chunk in stream:
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                text = []
                for event in events:
                    if event.startswith(_ERROR_EVENT):
                        if text:
                            await out(b"".join(text))
                        logger.warning("request %s: its continuation failed too; resuming again",
                                       self.request_id.decode())
                        stream.cancel()
                        return False
                    text.append(self.rewrite(event) + b"\n\n")
                    if event == _DONE:
                        await out(b"".join(text))
                        return True
                if text:
                    await out(b"".join(text))
        except asyncio.CancelledError:
            stream.cancel()  # the client left: the continuation's engine request is aborted
            raise
        except ModelUnavailable:
            return False
        except Exception as e:  # noqa: BLE001 — the continuation's replica died: another try
            logger.warning("request %s: its continuation's replica failed (%s)", self.request_id.decode(),
                           type(e).__name__)
            return False
        return False


async def _drain(stream) -> None:
    try:
        async for _ in stream:
            pass
    except Exception:  # noqa: BLE001 — a refusal's body is of no use here
        pass


async def resume_or_fail(resume: Resumable, engine_dead: Callable[[], bool], forward: Callable[[HTTPRequest], Any],
                         out: Callable[[bytes, bool], Awaitable[None]], receive) -> str | None:
    """After the engine's stream ended in an error event: resume it elsewhere if the engine died, else send the error.
    Ends the client's response either way; the outcome (resumed, failed, client_gone; None: not the engine dying)."""
    if not await _soon(engine_dead, 2.0):  # an error of this request, not a dead engine: the client gets it
        await out(b"".join(resume.held), False)
        return None
    rid = resume.request_id.decode()
    logger.warning("request %s: this replica's engine died after %d tokens of its stream; resuming it on another "
                   "replica", rid, len(resume.generated))

    async def send(chunk: bytes) -> None:
        await out(chunk, True)

    task = asyncio.ensure_future(resume.resume(forward, send))
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    if not task.done() or task.cancelled():
        logger.info("request %s cancelled by its caller while being resumed", rid)
        return "client_gone"
    if task.exception() is None and task.result():
        await out(b"", False)
        logger.info("request %s resumed on another replica: %d tokens in all", rid, len(resume.generated))
        return "resumed"
    logger.warning("request %s: no replica took its continuation within %.0f s; the client gets the error",
                   rid, RESUME_TIMEOUT_S)
    await out(b"".join(resume.held), False)
    return "failed"


async def _soon(predicate: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
