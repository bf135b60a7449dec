"""vLLM's incremental detokenizer, brought to where a dead engine's stream stopped (stream migration)."""

from __future__ import annotations

import logging

logger = logging.getLogger("ray.serve")


def output_detokenizer(
    engine,
    prompt_ids: list[int],
    generated: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
):
    """vLLM's own incremental detokenizer for a request's output, brought to where `generated` left it (stream
    migration: the text of the continuation's tokens as the dead engine would have streamed it, partial characters
    at the cut included). A function (token ids, ended) -> text; None when the engine's tokenizer is not reachable."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    try:
        tokenizer = engine.tokenizer
        params = SamplingParams(
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )
        request = SimpleNamespace(
            request_id="summit-resumed",
            sampling_params=params,
            prompt_token_ids=prompt_ids,
            prompt_embeds=None,
            lora_request=None,
        )
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        if generated:
            detokenizer.update(list(generated), False)
        detokenizer.get_next_output_text(False, True)
    except Exception as e:  # noqa: BLE001 — another vLLM's detokenizer: the continuation's own text is used
        logger.warning("stream migration: vLLM's detokenizer is not usable here (%s: %s)", type(e).__name__, e)
        return None

    def text(token_ids: list[int], stop_terminated: bool) -> str:
        detokenizer.update(list(token_ids), stop_terminated)
        return detokenizer.get_next_output_text(stop_terminated, True)

    return text
