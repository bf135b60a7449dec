"""Which of the application's models a request names: read from the JSON body's `model` (pure, no Ray).

An unknown name is a 404 listing the known models, as vLLM's own server answers; a body that is not a JSON object
is a 400. With one model, a request without `model` goes to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


class BadModel(Exception):
    """The request does not name a model this application serves (or is not a JSON object)."""

    def __init__(self, message: str, status: int, param: str | None = "model"):
        super().__init__(message)
        self.status = status
        self.param = param


def model_for(body: bytes, known: Sequence[str]) -> str:
    return model_and_payload(body, known)[0]


def model_and_payload(body: bytes, known: Sequence[str]) -> tuple[str, dict]:
    """The model a request body names (the only one when it names none) and the parsed body."""
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise BadModel(f"request body is not valid JSON: {e}", 400, param=None) from None
    except RecursionError:
        raise BadModel("request body is nested too deeply", 400, param=None) from None
    if not isinstance(payload, dict):
        raise BadModel("request body must be a JSON object", 400, param=None)
    name = payload.get("model")
    if name is None and len(known) == 1:
        return known[0], payload
    if not isinstance(name, str):
        raise BadModel(f"`model` is required; known models: {', '.join(known)}", 400)
    if name not in known:
        raise BadModel(f"The model `{name}` does not exist. Known models: {', '.join(known)}", 404)
    return name, payload
