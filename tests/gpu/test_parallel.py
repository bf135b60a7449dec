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


RAY_WORKERS = {"RayWorkerWrapper", "RayWorkerProc"}  # vLLM's Ray worker actor: 0.26 / 0.32 (RayExecutorV2)


def vllm_workers(cluster: LocalCluster) -> list[dict]:
    return [a for a in cluster.alive_actors() if a["class_name"] in RAY_WORKERS]


def answer(base_url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(model="tiny-llama", prompt="Split across GPUs", max_tokens=16, logprobs=2,
                                     extra_body={"ignore_eos": True})


def test_tensor_parallel_2_in_one_placement_group(summit, model_dirs):
    summit.serve_deploy(app_config([tiny_gpu_model(model_dirs, tensor_parallel_size=2)]), timeout_s=900)
    r = answer(summit.base_url)
    assert r.usage.completion_tokens == 16 and len(r.choices[0].logprobs.tokens) == 16
    workers = vllm_workers(summit)
    assert len(workers) == 2, [w["class_name"] for w in workers]
    assert len({w["placement_group_id"] for w in workers}) == 1  # both in the replica's placement group
    summit.serve_shutdown()


@pytest.mark.skipif(not netns_available(), reason="needs root and `ip netns`")
def test_pipeline_parallel_2_across_two_nodes(summit, model_dirs):
    summit.serve_shutdown()  # frees both GPUs of the session cluster
    host = NetnsHost(subnet=252).up()
    head_env = {"CUDA_VISIBLE_DEVICES": "0", "VLLM_HOST_IP": host.root_ip, "NCCL_SOCKET_IFNAME": host.root_if,
                "GLOO_SOCKET_IFNAME": host.root_if}
    cluster = LocalCluster(num_cpus=8, num_gpus=1, node_ip=host.root_ip, env=head_env)
    try:
        cluster.start()
        cluster.add_worker(host.host_ip, num_cpus=8, num_gpus=1, prefix=host.exec_prefix,
                           env={"CUDA_VISIBLE_DEVICES": "1", "VLLM_HOST_IP": host.host_ip,
                                "NCCL_SOCKET_IFNAME": host.host_if, "GLOO_SOCKET_IFNAME": host.host_if})
        model = tiny_gpu_model(model_dirs, pipeline_parallel_size=2, gpus_per_node=1)
        cluster.serve_deploy(app_config([model]), timeout_s=900)
        r = answer(cluster.base_url)
        assert r.usage.completion_tokens == 16
        ip_of = {n["node_id"]: n["node_ip"] for n in cluster.alive_nodes()}
        worker_ips = sorted(ip_of[w["node_id"]] for w in vllm_workers(cluster))
        print("vLLM Ray workers on", worker_ips)
        assert worker_ips == sorted([host.root_ip, host.host_ip])  # one pipeline stage on each node
    finally:
        cluster.stop()
        host.down()
