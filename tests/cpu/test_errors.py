"""Bad input gets an OpenAI-shaped 4xx (never a 500 or a hang), and the server keeps serving after each."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.cpu.conftest import MAX_MODEL_LEN, MODEL


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


def assert_still_serving(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def post(summit, path: str, **kwargs) -> httpx.Response:
    return httpx.post(summit.base_url + path, timeout=60, **kwargs)


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe\x00", b"[1, 2]", b""])
def test_malformed_body_is_400(summit, client, body):
    assert_openai_error(
        post(summit, "/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400
    )
    assert_still_serving(client)


def test_unknown_model_is_404_listing_known(summit, client):
    error = assert_openai_error(post(summit, "/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert MODEL in error["message"] and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-unknown", prompt="x", max_tokens=1)
    assert_still_serving(client)


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": -1},
        {"temperature": -2},
        {"top_p": 7},
        {"n": 0},
        {"logprobs": "many"},
    ],
)
def test_invalid_parameters_are_400(summit, client, params):
    assert_openai_error(post(summit, "/v1/completions", json={"model": MODEL, "prompt": "x", **params}), 400)
    assert_still_serving(client)


def test_max_tokens_beyond_the_context_is_400(summit, client):
    """max_tokens past the served context (read when the test runs: tests/served names the served model's)."""
    too_many = {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}
    assert_openai_error(post(summit, "/v1/completions", json=too_many), 400)
    assert_still_serving(client)


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}},
            },
        ),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"$ref": "#"}}}),
    ],
)
def test_a_structured_output_no_output_can_meet_is_400_naming_the_field(summit, client, path, body):
    """vLLM's own server answers these 500 ("Internal server error"): its grammar for a schema that only refers to
    itself rejects every token once the request is scheduled. The schema is the client's."""
    error = assert_openai_error(post(summit, path, json={"model": MODEL, "max_tokens": 3, **body}), 400)
    assert error["param"] == next(k for k in ("response_format", "structured_outputs") if k in body)
    assert error["param"] in error["message"]
    assert_still_serving(client)


def test_invalid_chat_messages_are_400(summit, client):
    for messages in (None, False, 0, [{"content": "no role"}]):
        r = post(summit, "/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert_openai_error(r, 400)
    # a non-JSON content type with a JSON body is still read as JSON, not a 500
    r = post(
        summit,
        "/v1/chat/completions",
        content=b'{"model": "tiny-llama", "messages": null}',
        headers={"content-type": "text/plain"},
    )
    assert_openai_error(r, 400)
    assert_still_serving(client)


def test_prompt_longer_than_max_model_len_is_400(summit, client):
    prompt = "mountain " * (MAX_MODEL_LEN + 500)  # one token per word, plus BOS
    error = assert_openai_error(
        post(summit, "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}), 400
    )
    assert str(MAX_MODEL_LEN) in error["message"] or "context" in error["message"].lower()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    assert_still_serving(client)


def test_unknown_route_and_wrong_method_are_openai_shaped(summit, client):
    assert_openai_error(httpx.get(summit.base_url + "/v1/completions", timeout=30), 405)
    assert_openai_error(httpx.get(summit.base_url + "/v1/nothing-here", timeout=30), 404)
    assert_still_serving(client)
