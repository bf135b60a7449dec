"""Per-key rate limits (deployments/pipeline/rate_limit.py): the buckets on a fake clock, what a request is charged,
and the front's answer with a fake limiter handle (`FakeLimiter`, standing in for the RateLimiter deployment's handle).
The real deployment is tested in tests/cpu/test_haproxy.py."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from pydantic import ValidationError

from app.config import AuthOptions
from deployments.pipeline.rate_limit import Buckets, Limits, RateLimiter, token_charge
from tests.unit.test_front import front


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_refill_continuously_and_each_key_has_its_own():
    clock = Clock()
    buckets = Buckets(requests_per_minute=3, tokens_per_minute=None, clock=clock)
    assert [buckets.take(b"a", 0)[0] for _ in range(3)] == [0, 0, 0]
    wait, why = buckets.take(b"a", 0)
    assert wait == pytest.approx(20.0) and "requests per minute (3)" in why
    assert buckets.take(b"b", 0) == (0.0, "")  # another key
    clock.now += 19.0
    assert buckets.take(b"a", 0)[0] == pytest.approx(1.0)  # refused: not charged
    clock.now += 1.0
    assert buckets.take(b"a", 0) == (0.0, "")
    clock.now += 3600
    assert [buckets.take(b"a", 0)[0] for _ in range(4)][-1] > 0  # a long idle refills a minute's worth, not more


def test_tokens_per_minute_and_a_request_that_can_never_fit():
    clock = Clock()
    buckets = Buckets(requests_per_minute=None, tokens_per_minute=600, clock=clock)
    assert buckets.take(b"a", 500) == (0.0, "")
    wait, why = buckets.take(b"a", 200)
    assert wait == pytest.approx(10.0) and "tokens per minute (600)" in why
    wait, why = buckets.take(b"a", 601)
    assert math.isinf(wait) and "601 tokens exceed" in why


def test_what_a_request_is_charged():
    assert token_charge("/v1/completions", {"prompt": "x" * 40, "max_tokens": 10}, 1024) == 20
    assert token_charge("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "n": 3}, 1024) == 9
    assert token_charge("/v1/completions", {"prompt": ["abcd", "abcdefgh"]}, 100) == 103
    chat = {
        "messages": [
            {"role": "user", "content": "abcdefgh"},
            {"role": "user", "content": [{"type": "text", "text": "abcd"}]},
        ],
        "max_completion_tokens": 5,
    }
    assert token_charge("/v1/chat/completions", chat, 1024) == 8
    assert token_charge("/v1/chat/completions", {"messages": [], "max_tokens": "x"}, 7) == 7
    assert token_charge("/tokenize", {"prompt": "abcdefgh", "max_tokens": 99}, 1024) == 2
    assert token_charge("/v1/responses", {"input": "abcdefgh", "max_output_tokens": 30}, 1024) == 32
    assert token_charge("/v1/responses", {"input": "abcd"}, 64) == 65
    assert token_charge("/v1/responses/resp_x", None, 1024) == 0  # retrieve, cancel: a request, no tokens
    assert token_charge("/v1/completions", ["not", "a", "dict"], 1024) == 0


def test_rate_limit_needs_a_limit():
    with pytest.raises(ValidationError, match="auth.rate_limit: give requests_per_minute"):
        AuthOptions(api_keys_env="K", rate_limit={})
    assert AuthOptions(api_keys_env="K", rate_limit={"requests_per_minute": 5}).rate_limit.default_max_tokens == 1024


class FakeLimiter:
    """Stands in for the RateLimiter deployment's handle: `take.remote` answers from a real RateLimiter in-process;
    `down` makes it raise, as an unreachable limiter would."""

    def __init__(self, rpm):
        self.limiter, self.down, self.owners = RateLimiter(rpm, None), False, []
        self.take = self

    async def remote(self, owner, tokens):
        if self.down:
            raise RuntimeError("limiter gone")
        self.owners.append(owner)
        return await self.limiter.take(owner, tokens)


async def post(app, key):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        return await client.post(
            "/v1/completions", json={"model": "a", "prompt": "x"}, headers={"authorization": f"Bearer {key}"}
        )


def test_the_front_answers_429_with_retry_after_per_key_and_serves_when_the_limiter_is_down():
    limiter = FakeLimiter(rpm=2)
    app, engine = front(keys=[b"k1", b"k2"], limits=Limits(limiter, 16))

    async def run():
        return [await post(app, key) for key in ("k1", "k1", "k1", "k2")]

    answers = asyncio.run(run())
    assert [r.status_code for r in answers] == [200, 200, 429, 200]
    refused = answers[2]
    assert refused.json()["error"]["type"] == "RateLimitError" and refused.json()["error"]["code"] == 429
    assert int(refused.headers["retry-after"]) == 30 and len(engine.seen) == 3
    assert all(b"k1" not in o and b"k2" not in o for o in limiter.owners)  # a hash, never the key
    limiter.down = True
    assert asyncio.run(post(app, "k1")).status_code == 200
