"""Prefill/decode disaggregation over NIXL on two GPUs: the tiny model disaggregated (its prefill replica on one GPU,
its decode replica on the other, vLLM's NixlConnector between them, KV buffers in GPU memory) answers the CPU suite's
OpenAI checks, and the decode engine's own counters show each prompt's KV loaded from the prefill engine, not computed.

The module deploys its own app (as tests/gpu/test_parallel.py's tests do), named as the session app's model so that
the imported checks address it; it sorts after the modules that use the session app."""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch

from tests.cpu.conftest import MODEL
from tests.cpu.test_errors import (  # noqa: F401 - collected here with this module's `summit`
    test_invalid_parameters_are_400,
    test_malformed_body_is_400,
    test_unknown_model_is_404_listing_known,
)
from tests.cpu.test_openai_api import (  # noqa: F401
    test_32_concurrent_streams_complete,
    test_chat_completion,
    test_chat_stream_with_usage,
    test_completion_max_tokens_in_usage,
    test_completion_stream,
    test_n_choices,
    test_request_id_returned,
    test_seed_reproducible,
    test_stop_string_ends_the_output,
)
from tests.engine_checks import assert_multicast_off, replica_actors
from tests.gpu.conftest import app_config, tiny_gpu_model
from tests.replica_probe import probe

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a prefill GPU and a decode GPU")

GPU_KV_BLOCK = 16  # vLLM's default KV block on CUDA


@pytest.fixture(scope="module")
def summit(gpu_cluster, model_dirs):
    """The tiny model disaggregated over NIXL: one prefill and one decode replica, a GPU each."""
    model = tiny_gpu_model(model_dirs, disaggregation={"connector": "nixl", "kv_buffer_device": "cuda"})
    gpu_cluster.serve_deploy(app_config([model]), timeout_s=900)
    return gpu_cluster


def decode_counters(cluster) -> dict:
    """The decode replica's own counts, read in its process (as tests/cpu/test_disaggregation.py reads them): vLLM's
    counters of what its engine took from its KV connector and computed, and Summit's count of disaggregated requests
    that reached their first token there; current as each request was answered, with no metrics export between."""
    answers = probe(cluster.address, "each", "summit", f"LLMServer:{MODEL}", "stats", "--replicas", "1")
    ((replica, stats),) = answers.items()
    recorded, by_source = stats["recorded"], stats["prompt_tokens_by_source"]
    return {
        "replica": replica,
        "phases": recorded.get("summit:pd_phase_seconds_count:first_token", 0),
        "external_hits": recorded.get("vllm:external_prefix_cache_hits", 0),
        "prompt_local_compute": by_source.get("local_compute", 0),
        "prompt_external": by_source.get("external_kv_transfer", 0),
    }


def test_the_decode_engine_loads_each_prompts_kv_over_nixl(summit, client):
    client.completions.create(model=MODEL, prompt="warm", max_tokens=2)  # the decode replica's metrics exist
    before = decode_counters(summit)
    assert before["replica"], before
    prompt = " ".join(f"valley{i} ridge{i % 7}" for i in range(90))  # ~1,000 tokens, no block shared with others
    tokens = httpx.post(summit.base_url + "/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=60)
    n = len(tokens.json()["tokens"])
    assert n > 10 * GPU_KV_BLOCK
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": f"nixl-{uuid.uuid4().hex[:8]}"},
    )
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 16
    after = decode_counters(summit)
    assert after["replica"] == before["replica"] and after["phases"] - before["phases"] == 1, (before, after)
    loaded = after["external_hits"] - before["external_hits"]
    computed = after["prompt_local_compute"] - before["prompt_local_compute"]
    # all of the prompt but at most its last block came from the prefill engine over NIXL
    assert loaded >= n - GPU_KV_BLOCK and computed <= GPU_KV_BLOCK, (n, loaded, computed, before, after)
    assert after["prompt_external"] - before["prompt_external"] == loaded, (before, after)


def test_nvlink_multicast_stays_off_in_both_engines(summit):
    replicas = replica_actors(summit, MODEL) + replica_actors(summit, f"{MODEL}:prefill")
    assert len(replicas) == 2, replicas  # the decode replica and the prefill replica
    for replica in replicas:
        assert_multicast_off(summit, replica)
