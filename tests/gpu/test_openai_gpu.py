"""The CPU suite's OpenAI-client checks, against the same app on a GPU (tiny model), plus 8B shapes."""

from __future__ import annotations

import pytest
import torch

from tests.openai_checks import *  # noqa: F403 - the OpenAI checks, collected here with this directory's fixtures

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="8B shapes run on the second GPU")


@needs_two_gpus
def test_llama8b_shapes_chat_stream_and_logprobs(client):
    models = {m.id: m for m in client.models.list().data}
    assert models["llama-8b"].model_extra["max_model_len"] == 4096
    chat = client.chat.completions.create(
        model="llama-8b",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=16,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 16 and len(chat.choices[0].logprobs.content) == 16
    stream = client.completions.create(
        model="llama-8b",
        prompt="The summit",
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert list(stream)[-1].usage.completion_tokens == 32
    r = client.completions.create(
        model="llama-8b", prompt="The summit is high", max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    assert len(r.choices[0].model_extra["prompt_logprobs"]) == r.usage.prompt_tokens


def test_the_default_serves_a_gpu_model_from_several_front_processes(summit):
    """front_processes is left at auto: a GPU model of 128 sequences on a cluster of 8 CPUs per GPU gets 2 processes
    (app/build/fronts.py), so some of 32 concurrent requests are answered by the front process (`x-summit-front`),
    the others by the replica's own; with one process none would carry the header."""
    import concurrent.futures

    import httpx

    from tests.cpu.test_openai_api import MODEL

    def front(_) -> str | None:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        with httpx.Client(timeout=60) as c:  # a connection each: the kernel spreads connections over the processes
            r = c.post(summit.base_url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.headers.get("x-summit-front")

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answered = list(pool.map(front, range(32)))
    assert {a for a in answered if a is not None} == {"1"} and None in answered, answered
