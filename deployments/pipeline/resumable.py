"""One stream that can go on from another replica (pipeline/migration.py says which streams, and when): the token ids
its engine generated so far, the continuation request, and the continuation's events in the original stream's shape."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.http.errors import OpenAIError
from deployments.http.protocol import AVOID_HEADER, HTTPRequest
from deployments.http.relay import first_response

logger = logging.getLogger("ray.serve")

RESUME_TIMEOUT_S = 60.0  # how long a stream waits for a replica to take its continuation
_RETRY_S = 0.5
# vLLM's chunks are compact JSON: a key can only match here outside a string (inside one, its quotes are escaped)
_IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\[([0-9,]*)\]')
_ERROR_EVENT = b'data: {"error"'
_FINISHED = re.compile(rb'"finish_reason":"')  # a choice that ended (vLLM writes null until then)
_DONE = b"data: [DONE]"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# sampling fields a chat request carries over to its /v1/completions continuation
_CHAT_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "priority",
    "stream_options",
    "user",
)


class Resumable:
    """One stream that can go on elsewhere: what its engine has generated so far, and the continuation."""

    def __init__(
        self,
        path: str,
        payload: dict,
        model: str,
        request_id: bytes,
        detokenizer: Callable | None = None,
        avoid_replica: bytes = b"",
    ):
        self.path, self.payload, self.model, self.request_id = path, payload, model, request_id
        self.avoid_replica = (
            avoid_replica  # the replica whose engine died: Summit's routers send the continuation elsewhere
        )
        # (prompt ids, generated ids, skip_special_tokens, spaces_between_special_tokens) -> vLLM's detokenizer at that
        # point, (ids, ended) -> text (deployments/engine: output_detokenizer): the continuation's text as the dead
        # engine would have written it, a character split at the cut included; None: the continuation's own text
        self._detokenizer = detokenizer
        self._text: Callable[[list[int], bool], str] | None = None
        self.client_wants_ids = payload.get("return_token_ids") is True
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.head: dict | None = None  # id, object, created, model of the stream's chunks
        self.held: list[bytes] = []  # the dead engine's error event (and anything after it), sent if resuming fails
        self.failed = False  # the engine's stream ended in an error event
        self.moving = False  # told to move: its engine's stream ends where the client's is, then goes on elsewhere
        self.ended = False  # its choice finished (or [DONE] went out): nothing left to go on with
        self.done = False  # its [DONE] went out
        self.kv_params: dict | None = None  # the next continuation's kv_transfer_params (its KV was handed off)
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
        self.done = self.done or _DONE in body
        if self.done or _FINISHED.search(body):
            self.ended = True
        return _IDS.sub(self._record, body)

    def error_event(self) -> bytes:
        """The end of a stream that could not go on: an OpenAI-shaped error event, then [DONE]."""
        error = OpenAIError.unavailable("This stream was moved off its replica and no other replica took it; retry.")
        return b"data: " + error.to_bytes() + b"\n\n" + _DONE + b"\n\n"

    def _record(self, match: re.Match) -> bytes:
        ids = [int(t) for t in match.group(2).split(b",") if t]
        if match.group(1) == b"prompt_token_ids":
            if self.prompt_ids is None:
                self.prompt_ids = ids
        else:
            self.generated.extend(ids)
        return match.group(0) if self.client_wants_ids else b'"' + match.group(1) + b'":null'

    def continuation(self) -> HTTPRequest | None:
        """The /v1/completions request that goes on from the tokens so far; None if there is nothing to go on from.
        A completion whose engine died before its first output (its prompt's token ids not known yet) starts over from
        its own prompt elsewhere: nothing of it reached the client but the response's start."""
        p = self.payload
        if self.prompt_ids is None and (self.path != COMPLETIONS or self.generated):
            return None
        prompt = p.get("prompt") if self.prompt_ids is None else self.prompt_ids + self.generated
        if self.path == COMPLETIONS:
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
        body.update(model=self.model, prompt=prompt, stream=True, return_token_ids=True)
        if self.kv_params:  # its KV waits on the replica it left: loaded there instead of computed
            body["kv_transfer_params"] = self.kv_params
        self.migrations += 1
        self._resumed_at = len(self.generated)
        if self._detokenizer is not None and self.prompt_ids is not None:
            self._text = self._detokenizer(
                self.prompt_ids,
                self.generated,
                p.get("skip_special_tokens", True),
                p.get("spaces_between_special_tokens", True),
            )
        request_id = self.request_id + f"-m{self.migrations}-{uuid.uuid4().hex[:8]}".encode()
        headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id)]
        if self.avoid_replica:
            headers.append((AVOID_HEADER, self.avoid_replica))
        return HTTPRequest("POST", COMPLETIONS, json.dumps(body).encode(), b"", headers, model=self.model)

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
            if self.path == CHAT:
                text = choice.pop("text", "")
                for key in ("prompt_token_ids", "prompt_logprobs"):
                    choice.pop(key, None)
                if choice.get("finish_reason") is None:
                    choice.pop("stop_reason", None)
                chunk_choice = {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": None,
                    "finish_reason": choice.get("finish_reason"),
                }
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

    async def resume(
        self,
        forward: Callable[[HTTPRequest], Any],
        out: Callable[[bytes], Awaitable[None]],
        timeout_s: float = RESUME_TIMEOUT_S,
    ) -> bool:
        """Go on from another replica, writing its events through `out` until the stream's end ([DONE] included);
        False when no replica took it within `timeout_s` (the caller then sends what it held: the error)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            request = self.continuation()
            if request is None:
                logger.warning(
                    "request %s: nothing to go on from (a chat stream before its first token, or none left to make)",
                    self.request_id.decode(),
                )
                return False
            try:
                stream = forward(request)
                start = await first_response(stream)
            except OpenAIError as e:
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
            # the continuation's engine died too: go on from there, recomputing (the handed-off KV was for that one)
            self.kv_params = None
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
                        logger.warning(
                            "request %s: its continuation failed too; resuming again", self.request_id.decode()
                        )
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
        except OpenAIError:
            return False
        except Exception as e:  # noqa: BLE001 — the continuation's replica died: another try
            logger.warning(
                "request %s: its continuation's replica failed (%s)", self.request_id.decode(), type(e).__name__
            )
            return False
        return False


async def _drain(stream) -> None:
    try:
        async for _ in stream:
            pass
    except Exception:  # noqa: BLE001 — a refusal's body is of no use here
        pass
