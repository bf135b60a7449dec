"""One OpenAI request through vLLM's own serving objects in this process, without an HTTP round: what vLLM's
`run_batch` does per line. The request body is checked by vLLM's own request model and answered by the same
`OpenAIServingCompletion` / `OpenAIServingChat` the replica's OpenAI app uses (its `app.state`)."""

from __future__ import annotations

import functools
from typing import Any

# url -> (the app.state attribute holding vLLM's serving object, its method, the request model's module and name
# on vLLM >= 0.27, on vLLM 0.26)
_ROUTES = {
    "/v1/completions": (
        "openai_serving_completion",
        "create_completion",
        ("vllm.entrypoints.openai.completion.protocol", "vllm.entrypoints.openai.protocol"),
        "CompletionRequest",
    ),
    "/v1/chat/completions": (
        "openai_serving_chat",
        "create_chat_completion",
        ("vllm.entrypoints.openai.chat_completion.protocol", "vllm.entrypoints.openai.protocol"),
        "ChatCompletionRequest",
    ),
}
_ANSWERS = frozenset({"CompletionResponse", "ChatCompletionResponse"})


@functools.cache
def _request_model(url: str):
    import importlib

    _, _, modules, name = _ROUTES[url]
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


async def answer_in_process(app: Any, url: str, body: dict) -> dict | None:
    """vLLM's answer (the response body, as its HTTP route would send it with status 200) to a non-stream request
    run in this process; None where the request should take the HTTP route instead, which answers it exactly as
    online: a body vLLM's request model refuses, an error answer (an engine that died, a prompt too long), a url
    or a vLLM without the serving object."""
    import pydantic

    route = _ROUTES.get(url)
    request_model = _request_model(url) if route is not None else None
    serving = getattr(app.state, route[0], None) if route is not None else None
    if request_model is None or serving is None or body.get("stream"):
        return None
    try:
        request = request_model.model_validate(body)
    except (pydantic.ValidationError, ValueError, TypeError):
        return None
    try:
        answer = await getattr(serving, route[1])(request, None)
    except Exception:  # noqa: BLE001 — the HTTP route turns it into vLLM's own error answer
        return None
    if type(answer).__name__ not in _ANSWERS:
        return None
    return answer.model_dump()


def stores_responses(app: Any) -> bool:
    """Whether vLLM's Responses API in this process keeps responses (VLLM_ENABLE_RESPONSES_API_STORE=1)."""
    return bool(getattr(getattr(app.state, "openai_serving_responses", None), "enable_store", False))


def background_response(app: Any, response_id: str):
    """The task running background response `response_id` in this process (None: none, or done)."""
    serving = getattr(app.state, "openai_serving_responses", None)
    return (getattr(serving, "background_tasks", None) or {}).get(response_id)
