"""One model across two GPUs: TP=2 and PP=2 inside one node (vLLM's `mp` executor on the two GPUs the replica holds),
PP=2 across two Ray nodes (vLLM's Ray executor in the replica's placement group), and two TP=1 replicas on distinct
GPUs behind the router.

Needs 2 GPUs. The cross-node test starts a second cluster whose worker node lives in a network namespace with its
own address (tests/netns_hosts.py: pyroute2 + nsenter, no iproute2 needed), one GPU per node, and checks that vLLM's
Ray workers themselves run on both nodes. Every multi-GPU engine is checked for NVLink multicast being off
(environment of every engine process, FlashInfer all-reduce fusion off in the engine config, no "mnnvl" in its logs).
"""

from __future__ import annotations

import subprocess

import openai
import psutil
import pytest
import torch

from deployments.engine import NO_NVLINK_MULTICAST_ENV
from tests.engine_checks import (
    assert_env_has,
    assert_multicast_off,
    mp_workers,
    ray_worker_processes,
    replica_actors,
    vllm_workers,
)
from tests.gpu.conftest import app_config, tiny_gpu_model
from tests.local_cluster import LocalCluster
from tests.netns_hosts import NetnsHost, netns_available

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def answer(base_url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(
        model="tiny-llama", prompt="Split across GPUs", max_tokens=16, logprobs=2, extra_body={"ignore_eos": True}
    )


def gpu_uuid_of_pids() -> dict[int, str]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(pid): uuid.strip() for pid, uuid in (line.split(",") for line in out.splitlines() if line.strip())}


def check_one_replica_on_two_gpus(cluster: LocalCluster) -> None:
    r = answer(cluster.base_url)
    assert r.usage.completion_tokens == 16 and len(r.choices[0].logprobs.tokens) == 16
    (replica,) = replica_actors(cluster, "tiny-llama")
    assert replica["placement_group_id"] is None and not vllm_workers(cluster)  # no group, no Ray workers
    workers = mp_workers(replica)
    assert len(workers) == 2, [w.cmdline() for w in workers]
    uuids = gpu_uuid_of_pids()
    assert len({uuids[w.pid] for w in workers if w.pid in uuids}) == 2, uuids  # one GPU per rank
    assert_multicast_off(cluster, replica)


def test_tensor_parallel_2_on_the_replicas_two_gpus(summit, model_dirs):
    summit.serve_deploy(
        app_config([tiny_gpu_model(model_dirs, tensor_parallel_size=2, gpus_per_node=2)]), timeout_s=900
    )
    check_one_replica_on_two_gpus(summit)


def test_pipeline_parallel_2_on_one_node(summit, model_dirs):
    summit.serve_deploy(
        app_config([tiny_gpu_model(model_dirs, pipeline_parallel_size=2, gpus_per_node=2)]), timeout_s=900
    )
    check_one_replica_on_two_gpus(summit)


def test_two_tp1_replicas_on_distinct_gpus_behind_the_router(summit, model_dirs):
    model = tiny_gpu_model(model_dirs, deployment={"num_replicas": 2})
    summit.serve_deploy(app_config([model]), timeout_s=900)
    client = openai.OpenAI(base_url=summit.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    answered = set()
    for _ in range(16):
        raw = client.completions.with_raw_response.create(model="tiny-llama", prompt="Which GPU?", max_tokens=4)
        answered.add(raw.headers["x-summit-replica"])
    assert len(answered) == 2, answered  # the router uses both replicas
    uuids = gpu_uuid_of_pids()
    gpus = []
    for replica in replica_actors(summit, "tiny-llama"):
        tree = [replica["pid"], *(p.pid for p in psutil.Process(replica["pid"]).children(recursive=True))]
        gpus.append({uuids[pid] for pid in tree if pid in uuids})
    assert len(gpus) == 2 and all(len(g) == 1 for g in gpus) and gpus[0] != gpus[1], gpus
    summit.serve_shutdown()  # frees both GPUs for the cross-node test


@pytest.mark.skipif(not netns_available(), reason="needs root, pyroute2 and nsenter for a second host")
def test_pipeline_parallel_2_across_two_nodes(summit, model_dirs):
    summit.serve_shutdown()  # frees both GPUs of the session cluster
    host = NetnsHost(subnet=252).up()
    head_env = {
        "CUDA_VISIBLE_DEVICES": "0",
        "VLLM_HOST_IP": host.root_ip,
        "NCCL_SOCKET_IFNAME": host.root_if,
        "GLOO_SOCKET_IFNAME": host.root_if,
        # one hostname in both namespaces: NCCL would take them for one host and reach for shared memory and CUDA IPC
        # over abstract Unix sockets, which a network namespace does not share ("unhandled system error"); a host id
        # of its own per node makes NCCL use the network between them, as between two machines
        "NCCL_HOSTID": "summit-head",
    }
    cluster = LocalCluster(num_cpus=8, num_gpus=1, node_ip=host.root_ip, env=head_env)
    try:
        cluster.start()
        cluster.add_worker(
            host.host_ip,
            num_cpus=8,
            num_gpus=1,
            prefix=host.exec_prefix,
            env={
                "CUDA_VISIBLE_DEVICES": "1",
                "VLLM_HOST_IP": host.host_ip,
                "NCCL_SOCKET_IFNAME": host.host_if,
                "GLOO_SOCKET_IFNAME": host.host_if,
                "NCCL_HOSTID": "summit-worker",
            },
        )
        model = tiny_gpu_model(model_dirs, pipeline_parallel_size=2, gpus_per_node=1)
        cluster.serve_deploy(app_config([model]), timeout_s=900)
        r = answer(cluster.base_url)
        assert r.usage.completion_tokens == 16
        ip_of = {n["node_id"]: n["node_ip"] for n in cluster.alive_nodes()}
        worker_ips = sorted(ip_of[w["node_id"]] for w in vllm_workers(cluster))
        print("vLLM Ray workers on", worker_ips)
        assert worker_ips == sorted([host.root_ip, host.host_ip])  # one pipeline stage on each node
        procs = ray_worker_processes()  # vLLM copies the multicast-off environment to its Ray workers
        assert len(procs) == 2, [p.cmdline()[:1] for p in procs]
        assert_env_has(procs, NO_NVLINK_MULTICAST_ENV)
    finally:
        cluster.stop()
        host.down()
