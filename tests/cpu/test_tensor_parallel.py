"""Tensor parallel 2 through Summit's GPU path, on CPU: one replica, two vLLM workers in its placement group.

The model is written for GPUs (`accelerator: gpu`, TP 2, `gpus_per_node: 2`) and served on a one-node loopback
cluster that declares two Ray "GPU" worker slots; Summit's vLLM platform plugin (SUMMIT_VLLM_CPU_RAY=1,
`deployments/vllm_adapter.py`) runs vLLM's Ray executor on the CPU. So the path the GPU host takes — the placement
plan, the replica's placement group handed to vLLM, one Ray worker per bundle, the all-reduce between the two
ranks (gloo here, NCCL there), the multicast-off environment and engine config of every GPU engine — fails CI
when it regresses, not only the GPU host.
"""

from __future__ import annotations

import openai
import psutil
import pytest

from app.local_cluster import LocalCluster, load_serve_config
from deployments.vllm_adapter import NO_NVLINK_MULTICAST_ENV
from tests.cpu.engine_apps import REPO

MODEL = "tiny-tp2"
RAY_WORKERS = {"RayWorkerProc", "RayWorkerWrapper"}  # vLLM's Ray worker actor: 0.32 (RayExecutorV2) / 0.26
PLATFORM = {"SUMMIT_VLLM_CPU_RAY": "1"}


@pytest.fixture(scope="module")
def tp2_app(tiny_model_dir):
    cluster = LocalCluster(num_cpus=4, num_gpus=2, env=PLATFORM)
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    application = config["applications"][0]
    application["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    application["runtime_env"]["env_vars"].update(PLATFORM, OMP_NUM_THREADS="1")
    application["args"] = {"placement_wait_s": 60, "models": [{
        "name": MODEL, "source": str(tiny_model_dir), "accelerator": "gpu", "tensor_parallel_size": 2,
        "gpus_per_node": 2,
        "engine_kwargs": {"dtype": "bfloat16", "max_model_len": 1024, "max_num_seqs": 8, "enforce_eager": True,
                          "kv_cache_memory_bytes": 64 << 20},
        "deployment": {"num_cpus": 0.5}}]}
    try:
        cluster.start()
        cluster.serve_deploy(config, timeout_s=900)
        yield cluster
    finally:
        cluster.stop()


def test_a_tp2_replica_answers_from_two_workers_in_its_placement_group(tp2_app):
    client = openai.OpenAI(base_url=tp2_app.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.completions.create(model=MODEL, prompt="Split across workers", max_tokens=8, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and len(r.choices[0].logprobs.top_logprobs) == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 8

    actors = tp2_app.alive_actors()
    (replica,) = [a for a in actors if a["class_name"] == f"ServeReplica:summit:LLMServer:{MODEL}"]
    workers = [a for a in actors if a["class_name"] in RAY_WORKERS]
    assert len(workers) == 2, [a["class_name"] for a in actors]
    assert {w["placement_group_id"] for w in workers} == {replica["placement_group_id"]}
    (group,) = [g for g in tp2_app.placement_groups() if g["placement_group_id"] == replica["placement_group_id"]]
    assert [b["unit_resources"].get("GPU") for b in group["bundles"]] == [1, 1]  # one worker slot per rank
    assert len({b["node_id"] for b in group["bundles"]}) == 1  # TP stays inside a node (STRICT_PACK)


def test_every_engine_process_runs_with_nvlink_multicast_off(tp2_app):
    """The replica, its engine core and both Ray workers (one per rank) see the multicast-off environment, and
    the engine's own config has FlashInfer's all-reduce fusion off."""
    actors = tp2_app.alive_actors()
    (replica,) = [a for a in actors if a["class_name"] == f"ServeReplica:summit:LLMServer:{MODEL}"]
    replica_proc = psutil.Process(replica["pid"])
    processes = [replica_proc, *replica_proc.children(recursive=True)]
    processes += [psutil.Process(a["pid"]) for a in actors if a["class_name"] in RAY_WORKERS]
    assert len(processes) >= 4, processes  # replica, engine core, two workers
    for proc in processes:
        env = proc.environ()
        missing = {k: env.get(k) for k, v in NO_NVLINK_MULTICAST_ENV.items() if env.get(k) != v}
        assert not missing, f"{proc.pid} {proc.cmdline()[:3]}: {missing}"

    logs = sorted((tp2_app.temp_dir / "session_latest" / "logs").glob(f"worker-*-{replica['pid']}.*"))
    engine_config = [line for f in logs for line in f.read_text(errors="replace").splitlines()
                     if "Initializing a V1 LLM engine" in line]
    assert engine_config, f"no engine config line in {[f.name for f in logs]}"
    assert "'fuse_allreduce_rms': False" in engine_config[0], engine_config[0][-2000:]
    assert not any("mnnvl" in f.read_text(errors="replace") for f in logs)
