"""Per-API-key rate limits (`auth.rate_limit`): requests and tokens per minute, each key its own.

Enforced across the application's replicas by one `RateLimiter` deployment (one replica, on the head node): every
HTTP entry (each engine replica's front on the direct path, the ingress on the two-hop path) asks it before a
request of an OpenAI POST route goes to an engine, with the key's owner id (a hash: keys never leave the entry) and
the request's token charge. One actor call per request (≈ 1 ms on loopback); it keeps a token bucket per key for
requests and one for tokens, each holding a minute's worth and refilled continuously. Tokens are charged when the
request arrives, as OpenAI counts them: the prompt (≈ 4 characters a token; token ids counted as given) plus
`max_tokens` (`max_completion_tokens`), or `rate_limit.default_max_tokens` when the request sets none.

A refused request gets an OpenAI-shaped 429 (RateLimitError) with `Retry-After` (when the buckets will hold it). If
the limiter cannot be reached within a second the request goes on (availability first) and the entry logs it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from deployments.http.errors import OpenAIError

logger = logging.getLogger("ray.serve")

ASK_TIMEOUT_S = 1.0


def token_charge(path: str, payload: Any, default_max_tokens: int) -> int:
    """What a request counts against its key's tokens per minute: its prompt's estimate plus its output bound."""
    if not isinstance(payload, dict):
        return 0
    prompt = 0
    if path == "/v1/chat/completions":
        for message in payload.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                prompt += _estimate(content)
            elif isinstance(content, list):
                prompt += sum(_estimate(p.get("text", "")) for p in content if isinstance(p, dict))
    else:
        given = payload.get("prompt", payload.get("input", payload.get("messages", "")))
        for part in given if isinstance(given, list) and given and not isinstance(given[0], int) else [given]:
            prompt += len(part) if isinstance(part, list) else _estimate(part if isinstance(part, str) else "")
    if path not in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        return prompt
    bound = payload.get("max_completion_tokens", payload.get("max_tokens", payload.get("max_output_tokens")))
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        bound = default_max_tokens
    return prompt + bound * (payload.get("n") if isinstance(payload.get("n"), int) and payload["n"] > 0 else 1)


def _estimate(text: str) -> int:
    return math.ceil(len(text) / 4)


class Buckets:
    """Token buckets per key: `requests_per_minute` and `tokens_per_minute` (None: no limit), each holding a minute's
    worth and refilled continuously. `take` charges a request or says how long until it would fit."""

    def __init__(
        self,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._limits = (requests_per_minute, tokens_per_minute)
        self._clock = clock
        self._levels: dict[bytes, list[float]] = {}  # owner -> [requests left, tokens left, when]

    def take(self, owner: bytes, tokens: int) -> tuple[float, str]:
        """(0, "") when charged; else (seconds until it would fit, or math.inf if it never can, and why)."""
        now = self._clock()
        rpm, tpm = self._limits
        level = self._levels.setdefault(owner, [float(rpm or 0), float(tpm or 0), now])
        elapsed, level[2] = now - level[2], now
        waits = []
        for i, (limit, cost, what) in enumerate(((rpm, 1, "requests"), (tpm, tokens, "tokens"))):
            if limit is None:
                continue
            level[i] = min(float(limit), level[i] + elapsed * limit / 60.0)
            if cost > limit:
                return math.inf, f"this request's {cost} {what} exceed the key's {limit} {what} per minute"
            if level[i] < cost:
                waits.append(((cost - level[i]) * 60.0 / limit, f"{what} per minute ({limit})"))
        if waits:
            wait, what = max(waits)
            return wait, f"Rate limit reached for this API key: {what}. Retry after {math.ceil(wait)} s."
        if rpm is not None:
            level[0] -= 1
        if tpm is not None:
            level[1] -= tokens
        return 0.0, ""


class RateLimiter:
    """The application's one limiter (a Serve deployment): every HTTP entry asks it before a request runs."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None):
        self._buckets = Buckets(requests_per_minute, tokens_per_minute)

    async def take(self, owner: bytes, tokens: int) -> tuple[float, str]:
        # async: on the replica's event loop, one call at a time (a sync method runs in Serve's thread pool)
        return self._buckets.take(owner, tokens)


class Limits:
    """An HTTP entry's side: asks the limiter (a Serve handle to RateLimiter) and answers a refusal."""

    def __init__(self, handle, default_max_tokens: int):
        self._handle, self.default_max_tokens = handle, default_max_tokens
        self._unreachable_logged = 0.0

    async def refusal(self, owner: bytes, path: str, payload: Any) -> OpenAIError | None:
        """None when the request may go on; else the 429 to answer."""
        try:
            wait, why = await asyncio.wait_for(
                self._handle.take.remote(owner, token_charge(path, payload, self.default_max_tokens)), ASK_TIMEOUT_S
            )
        except Exception as e:  # noqa: BLE001 — the limiter restarting or slow: serve rather than refuse everyone
            if time.monotonic() - self._unreachable_logged > 60:
                self._unreachable_logged = time.monotonic()
                logger.warning("rate limiter not reachable (%s): requests go on unlimited meanwhile", type(e).__name__)
            return None
        if not wait:
            return None
        retry = "60" if math.isinf(wait) else str(max(1, math.ceil(wait)))
        return OpenAIError(429, why, retry_after=retry)
