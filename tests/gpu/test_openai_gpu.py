"""The CPU suite's OpenAI-client checks, against the same app on a GPU (tiny model), plus 8B shapes."""

from __future__ import annotations

import pytest
import torch

from tests.cpu.test_errors import (  # noqa: F401 - collected here with this directory's fixtures
    test_invalid_parameters_are_400,
    test_malformed_body_is_400,
    test_prompt_longer_than_max_model_len_is_400,
    test_unknown_model_is_404_listing_known,
)
from tests.cpu.test_openai_api import (  # noqa: F401
    test_32_concurrent_streams_complete,
    test_chat_completion,
    test_chat_stream_with_usage,
    test_completion_logprobs_with_echo,
    test_completion_max_tokens_in_usage,
    test_completion_stream,
    test_min_tokens_holds_back_a_stop_token,
    test_n_choices,
    test_penalties_change_what_is_repeated,
    test_prompt_logprobs_and_top_logprobs,
    test_request_id_returned,
    test_seed_reproducible,
    test_stop_string_ends_the_output,
    test_tokenize_detokenize_round_trip,
    test_top_k_and_min_p_narrow_the_sampling,
)

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
