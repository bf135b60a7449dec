"""Tensor parallel 2 through Summit's GPU path, on CPU: one replica on vLLM's `mp` executor, two workers on the GPUs
the replica itself holds.

The model is written for GPUs (`accelerator: gpu`, TP 2, `gpus_per_node: 2`) and served on a one-node loopback
cluster that declares two Ray "GPU" slots; Summit's vLLM platform plugin (SUMMIT_VLLM_CPU_RAY=1,
`deployments/engine/platform.py`) lets vLLM's CPU platform stand in for CUDA. So the path the GPU host takes for TP
inside a node — the replica actor holding both GPUs (Ray sets its CUDA_VISIBLE_DEVICES), vLLM's worker processes
inheriting exactly those, the all-reduce between the two ranks (gloo/shm here, NCCL there), the multicast-off
environment and engine config of every GPU engine — fails CI when it regresses, not only the GPU host. (The Ray
executor, for replicas that span nodes: tests/cpu/test_multinode.py.)
"""

from __future__ import annotations

import openai
import pytest

from tests.cpu.engine_apps import REPO
from tests.engine_checks import (
    assert_multicast_off,
    assert_workers_forked_by_the_core,
    engine_core_processes,
    engine_processes,
    mp_workers,
    replica_actors,
    vllm_workers,
)
from tests.local_cluster import LocalCluster, load_serve_config

MODEL = "tiny-tp2"
PLATFORM = {"SUMMIT_VLLM_CPU_RAY": "1"}


@pytest.fixture(scope="module")
def tp2_app(tiny_model_dir):
    cluster = LocalCluster(num_cpus=4, num_gpus=2, env=PLATFORM, haproxy=True)  # one model: the direct path
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    application = config["applications"][0]
    application["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    application["runtime_env"]["env_vars"].update(PLATFORM, OMP_NUM_THREADS="1")
    application["args"] = {
        "placement_wait_s": 60,
        "models": [
            {
                "name": MODEL,
                "source": str(tiny_model_dir),
                "accelerator": "gpu",
                "tensor_parallel_size": 2,
                "gpus_per_node": 2,
                "engine_kwargs": {
                    "dtype": "bfloat16",
                    "max_model_len": 1024,
                    "max_num_seqs": 8,
                    "enforce_eager": True,
                    "kv_cache_memory_bytes": 64 << 20,
                },
                "deployment": {"num_cpus": 0.5},
            }
        ],
    }
    try:
        cluster.start()
        cluster.serve_deploy(config, timeout_s=900)
        yield cluster
    finally:
        cluster.stop()


def test_a_tp2_replica_answers_from_two_mp_workers_on_its_own_gpus(tp2_app):
    client = openai.OpenAI(base_url=tp2_app.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.completions.create(
        model=MODEL, prompt="Split across workers", max_tokens=8, logprobs=2, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8 and len(r.choices[0].logprobs.top_logprobs) == 8
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 8

    (replica,) = replica_actors(tp2_app, MODEL)
    assert replica["placement_group_id"] is None and not vllm_workers(tp2_app)  # no group, no Ray workers
    assert replica["required_resources"].get("GPU") == 2  # the actor itself holds both GPUs
    workers = mp_workers(replica)
    assert len(workers) == 2, [w.cmdline() for w in workers]
    # Ray sets the actor's CUDA_VISIBLE_DEVICES once it runs (after its process started): read it where the engine
    # core, started by the replica, inherited it
    (core,) = engine_core_processes(replica["pid"])
    visible = core.environ()["CUDA_VISIBLE_DEVICES"]
    assert len(visible.split(",")) == 2, visible  # Ray's two GPU ids for the actor ...
    assert {w.environ().get("CUDA_VISIBLE_DEVICES") for w in workers} == {visible}  # ... exactly what the workers see
    # the YAML's runtime_env.env_vars reached them too (Serve alone drops them for a deployment with its own env)
    assert {w.environ().get("VLLM_CPU_OMP_THREADS_BIND") for w in workers} == {"nobind"}
    # both ranks forked by the core (deployments/engine/platform.py), as vLLM's own server starts them
    assert {w.pid for w in assert_workers_forked_by_the_core(replica["pid"])} == {w.pid for w in workers}


def test_every_engine_process_runs_with_nvlink_multicast_off(tp2_app):
    """The replica, its engine core and both workers (one per rank) see the multicast-off environment, and
    the engine's own config has FlashInfer's all-reduce fusion off."""
    (replica,) = replica_actors(tp2_app, MODEL)
    assert len(engine_processes(tp2_app, replica)) >= 4  # replica, engine core, two workers
    assert_multicast_off(tp2_app, replica)
