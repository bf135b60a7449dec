"""Which `/v1/responses` input item the installed vLLM cannot take, found with vLLM's own conversion of items to chat
messages: vLLM raises an internal error (a 500) for some item shapes its request model accepts (vLLM 0.32: an
assistant message whose content is a refusal part, or empty). The front asks after vLLM answered a 5xx, and answers
a 400 naming the item instead."""

from __future__ import annotations


def responses_input_problem(body: bytes) -> tuple[str, str] | None:
    """(param, message) for the first input item vLLM's conversion refuses, or None (the body is not a Responses
    request vLLM's model takes, its input is text, or every item converts)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_chat_messages_with_tool_call

    try:
        request = ResponsesRequest.model_validate_json(body)
    except Exception:  # noqa: BLE001 — not ours to judge here: vLLM's own validation answers it
        return None
    if not isinstance(request.input, list):
        return None
    for i, item in enumerate(request.input):
        try:
            construct_chat_messages_with_tool_call([item])
        except Exception as e:  # noqa: BLE001 — whatever vLLM's converter raised on this item
            kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
            what = f"an item of type {kind!r}" if kind else "an item"
            return (
                f"input[{i}]",
                f"input[{i}]: {what} that the installed vLLM's Responses API cannot take "
                f"({type(e).__name__}: {str(e) or 'no message'}); send its content as text parts",
            )
    return None


def responses_request_schema() -> dict:
    """The JSON schema of the installed vLLM's Responses request model (tests generate input items from it)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return ResponsesRequest.model_json_schema()
