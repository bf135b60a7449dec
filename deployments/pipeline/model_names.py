"""Which of the application's models a request names: read from the JSON body's `model` (pure, no Ray).

Refusals are OpenAIError. An unknown name is a 404 listing the known models, as vLLM's own server answers;
a body that is not a JSON object is a 400. With one model, a request without `model` goes to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from deployments.http.errors import OpenAIError


def model_for(body: bytes, known: Sequence[str]) -> str:
    return model_and_payload(body, known)[0]


def model_and_payload(body: bytes, known: Sequence[str]) -> tuple[str, dict]:
    """The model a request body names (the only one when it names none) and the parsed body."""
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    name = payload.get("model")
    if name is None and len(known) == 1:
        return known[0], payload
    if not isinstance(name, str):
        raise OpenAIError(400, f"`model` is required; known models: {', '.join(known)}", param="model")
    if name not in known:
        raise OpenAIError(404, f"The model `{name}` does not exist. Known models: {', '.join(known)}", param="model")
    return name, payload
