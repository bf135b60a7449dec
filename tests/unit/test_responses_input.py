"""The /v1/responses input items the installed vLLM's own conversion cannot take (it raises an internal error, which
its server answers 500): found item by item with that conversion, so the front answers a 400 naming `input[i]`.
Every generated item shape (tests/responses_cases.py, from vLLM's request model) is either converted or named; the
real-engine twin (no 500 for any of them): tests/cpu/test_fuzz.py::test_every_responses_input_item_shape_is_answered."""

from __future__ import annotations

import json

from deployments.engine import responses_input_problem, responses_request_schema
from tests.responses_cases import input_item_cases


def request(items: list) -> bytes:
    return json.dumps({"model": "m", "input": items, "max_output_tokens": 1}).encode()


def test_an_item_vllm_cannot_convert_is_named_and_the_others_pass():
    refusal = {"type": "message", "role": "assistant", "id": "m1", "status": "completed", "content": []}
    refusal["content"] = [{"type": "refusal", "refusal": "no"}]
    said = responses_input_problem(request([{"role": "user", "content": "hi"}, refusal]))
    assert said is not None and said[0] == "input[1]" and "'message'" in said[1], said
    assert responses_input_problem(request([{"role": "user", "content": "hi"}])) is None
    assert responses_input_problem(json.dumps({"model": "m", "input": "text"}).encode()) is None


def test_every_generated_item_shape_converts_or_is_named():
    cases = input_item_cases(responses_request_schema())
    assert len(cases) > 50, len(cases)  # every item branch and part branch of the installed vLLM's model
    named = {name: responses_input_problem(request(items)) for name, items in cases}
    assert all(said is None or said[0] == "input[0]" for said in named.values()), named
