"""Tensor parallel through Summit's placement group, and pipeline parallel across two Ray nodes.

Needs 2 GPUs. The PP test starts a second cluster whose worker node lives in a network namespace with its own
address (tests/netns_hosts.py), one GPU per node, and checks that vLLM's Ray workers themselves run on both nodes.
"""

from __future__ import annotations

import openai
import pytest
import torch

from app.local_cluster import LocalCluster
from tests.gpu.conftest import app_config, tiny_gpu_model
from tests.netns_hosts import NetnsHost, netns_available

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def vllm_workers() -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000) if "RayWorkerWrapper" in a.class_name]


def answer(base_url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(model="tiny-llama", prompt="Split across GPUs", max_tokens=16, logprobs=2,
                                     extra_body={"ignore_eos": True})


def test_tensor_parallel_2_in_one_placement_group(summit, model_dirs):
    import ray

    summit.serve_deploy(app_config([tiny_gpu_model(model_dirs, tensor_parallel_size=2)]), timeout_s=900)
    r = answer(summit.base_url)
    assert r.usage.completion_tokens == 16 and len(r.choices[0].logprobs.tokens) == 16
    ray.init(address=summit.address, logging_level="ERROR", log_to_driver=False, ignore_reinit_error=True)
    workers = vllm_workers()
    assert len(workers) == 2, [w.class_name for w in workers]
    assert len({w.placement_group_id for w in workers}) == 1  # both in the replica's placement group
    summit.serve_shutdown()


@pytest.mark.skipif(not netns_available(), reason="needs root and `ip netns`")
def test_pipeline_parallel_2_across_two_nodes(summit, model_dirs):
    import ray

    summit.serve_shutdown()  # frees both GPUs of the session cluster
    ray.shutdown()
    host = NetnsHost(subnet=252).up()
    head_env = {"CUDA_VISIBLE_DEVICES": "0", "NCCL_SOCKET_IFNAME": host.root_if, "GLOO_SOCKET_IFNAME": host.root_if}
    cluster = LocalCluster(num_cpus=8, num_gpus=1, node_ip=host.root_ip, env=head_env)
    try:
        cluster.start()
        cluster.add_worker(host.host_ip, num_cpus=8, num_gpus=1, prefix=host.exec_prefix,
                           env={"CUDA_VISIBLE_DEVICES": "1", "NCCL_SOCKET_IFNAME": host.host_if,
                                "GLOO_SOCKET_IFNAME": host.host_if})
        model = tiny_gpu_model(model_dirs, pipeline_parallel_size=2, gpus_per_node=1)
        cluster.serve_deploy(app_config([model]), timeout_s=900)
        r = answer(cluster.base_url)
        assert r.usage.completion_tokens == 16
        workers = vllm_workers()
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        worker_ips = sorted(nodes[w.node_id] for w in workers)
        print("vLLM Ray workers on", worker_ips)
        assert worker_ips == sorted([host.root_ip, host.host_ip])  # one pipeline stage on each node
    finally:
        ray.shutdown()
        cluster.stop()
        host.down()
