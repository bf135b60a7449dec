"""Which model a request body names (deployments/pipeline/model_names.py, pure)."""

from __future__ import annotations

import pytest

from deployments.http.errors import OpenAIError
from deployments.pipeline.model_names import model_for

KNOWN = ["tiny-a", "tiny-b"]


def test_the_body_model_picks_the_model():
    assert model_for(b'{"model": "tiny-b", "prompt": "x"}', KNOWN) == "tiny-b"


def test_one_model_serves_requests_without_a_model():
    assert model_for(b'{"prompt": "x"}', ["only"]) == "only"


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b'{"model": "nope"}', 404, ["`nope` does not exist", "tiny-a, tiny-b"]),
        (b'{"prompt": "x"}', 400, ["`model` is required", "tiny-a"]),
        (b'{"model": 7}', 400, ["`model` is required"]),
        (b"not json", 400, ["not valid JSON"]),
        (b"[1, 2]", 400, ["must be a JSON object"]),
    ],
)
def test_bad_bodies_name_the_problem(body, status, words):
    with pytest.raises(OpenAIError) as e:
        model_for(body, KNOWN)
    assert e.value.status == status and all(w in str(e.value) for w in words), str(e.value)
