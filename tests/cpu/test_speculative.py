"""Speculative decoding on the installed vLLM, in-process (no Ray: two engines one after the other are cheaper than
another app): an `ngram` (prompt lookup) `speculative_config` from the YAML's engine_kwargs drafts tokens, and the
greedy output is the same as without it, token for token. The acceptance rate comes from vLLM's own counters."""

from __future__ import annotations

import asyncio

import pytest

from app.build.engine_checks import load_config
from app.clusters.tiny_model import make_tiny_model
from deployments import engine as vllm_adapter

pytestmark = pytest.mark.timeout(600)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# prompts that repeat themselves, so that prompt lookup finds drafts, and one that does not
PROMPTS = [
    "north south east west " * 12,
    "The summit ridge in winter, the summit ridge in spring, the summit",
    "What is 42?",
]


def engine_args(source: str, speculative: bool) -> dict:
    """The model entry as a YAML gives it, validated as the app validates it."""
    engine = {"max_model_len": 1024, "enforce_eager": True, "dtype": "bfloat16", "kv_cache_memory_bytes": 64 << 20}
    if speculative:
        engine["speculative_config"] = NGRAM
    config = load_config({"models": [{"name": "m", "source": source, "accelerator": "cpu", "engine_kwargs": engine}]})
    return vllm_adapter.engine_args(config.models[0])


def test_ngram_speculation_drafts_and_keeps_the_greedy_output(tmp_path):
    from vllm import SamplingParams

    model = str(make_tiny_model(tmp_path / "m", max_len=1024))

    async def run(speculative: bool) -> tuple[list[list[int]], dict[str, float]]:
        args = vllm_adapter.serve_namespace(model, "m", engine_args(model, speculative), {})
        engine_app = await vllm_adapter.start_engine_app(args, metrics=True)
        try:
            outputs, generated_before = [], vllm_adapter.generation_tokens() or 0
            for i, prompt in enumerate(PROMPTS):
                final = None
                params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
                async for final in engine_app.engine.generate(prompt, params, f"{speculative}-{i}"):
                    pass
                outputs.append(list(final.outputs[0].token_ids))
            # vLLM records a step's stats just after its outputs: the last step's are in once the generated tokens
            # counted are all of the outputs' (the drafting counters are recorded in the same step)
            made = sum(len(tokens) for tokens in outputs)
            for _ in range(1000):
                if (vllm_adapter.generation_tokens() or 0) - generated_before >= made:
                    break
                await asyncio.sleep(0.01)
            assert (vllm_adapter.generation_tokens() or 0) - generated_before == made
            counters = {
                name: value
                for kind, name, labels, value in vllm_adapter.engine_metric_samples()
                if name.startswith("vllm_spec_decode_num_") and kind == "counter"
            }
            return outputs, counters
        finally:
            vllm_adapter.shutdown_engine(engine_app.engine)

    plain, _ = asyncio.run(run(False))
    drafted, counters = asyncio.run(run(True))
    assert drafted == plain  # speculation never changes a greedy answer
    draft, accepted = (
        counters.get("vllm_spec_decode_num_draft_tokens", 0),
        counters.get("vllm_spec_decode_num_accepted_tokens", 0),
    )
    assert draft > 0, counters
    assert 0 < accepted <= draft, counters
    print(f"ngram speculation: {accepted:.0f} of {draft:.0f} drafted tokens accepted ({accepted / draft:.0%})")
