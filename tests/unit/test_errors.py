"""The one error type (deployments/http/errors.py): its OpenAI shape, Retry-After, another server's error answers as
ours, and which field a structured-output request's 5xx is the client's fault of."""

from __future__ import annotations

import json

import pytest

from deployments.http.errors import OpenAIError, structured_output_problem


def test_an_error_is_openai_shaped_with_its_type_from_the_status_and_retry_after_in_whole_seconds():
    e = OpenAIError(503, "busy", retry_after=1.2)
    assert json.loads(e.to_bytes()) == {
        "error": {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}
    }
    headers = dict(e.raw_headers())
    assert headers[b"retry-after"] == b"2" and int(headers[b"content-length"]) == len(e.to_bytes())
    assert OpenAIError(502, "x").type == "BadGateway"  # not in the table: the status phrase


def test_another_servers_error_answer_keeps_its_message_type_and_param():
    vllm = json.dumps({"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}).encode()
    e = OpenAIError.from_body(400, vllm)
    assert (e.status, e.message, e.type, e.param) == (400, "bad n", "BadRequestError", "n")
    assert OpenAIError.from_body(405, b'{"detail": "Method Not Allowed"}').message == "Method Not Allowed"


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}}, "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"tool_choice": "required", "tools": [{"type": "function"}]}, "tool_choice"),
        ({"response_format": {"type": "text"}}, None),
        ({"tool_choice": "auto", "tools": [{"type": "function"}]}, None),
        ({"prompt": "x"}, None),
    ],
)
def test_a_5xx_is_the_clients_fault_only_where_a_structured_output_shapes_the_answer(payload, field):
    found = structured_output_problem(json.dumps(payload).encode())
    assert (found and found[0]) == field
    if found:
        assert f"`{field}`" in found[1]
