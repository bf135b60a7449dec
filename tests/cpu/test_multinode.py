"""Two Ray nodes on one machine, each a host of its own, and one replica pipelined across both — for real.

The head runs in the root network namespace on 10.251.0.1, the worker node in network and PID namespaces of its own
on 10.251.0.2 (tests/netns_hosts.py), each from its own `ray start`. Each node declares one Ray "GPU": a worker slot.
The engine is vLLM on the CPU, run on vLLM's Ray executor through Summit's platform plugin
(`deployments/engine/platform.py`, switched on by SUMMIT_VLLM_CPU_RAY=1): the executor starts one vLLM worker per
GPU bundle of the replica's placement group, exactly as on GPUs, and the workers compute on the CPU.

What runs here, plainly:
- the model is Summit's GPU path (`accelerator: gpu`, PP 2, `gpus_per_node: 1`): app/build/placement.py's plan, the
  replica's placement group, and vLLM's Ray executor on that group;
- the two bundles land on two different nodes, as the plan says (the head has 1 CPU, so bundle 0 — the replica's
  own CPUs plus stage 0 — must go to the worker node: the replica does not run on the head);
- **vLLM's engine workers themselves run on both nodes**, one pipeline stage each, exchanging activations across
  the veth pair (read from Ray's state API), and the replica answers through the OpenAI API;
- a replica whose plan no node can hold (TP 2 inside one node, nodes of 1 slot) fails the deploy with a message
  naming the missing resource instead of pending without end.

The two-node test is in the long tier (SUMMIT_TEST_LONG=1: two Ray nodes and a compiled two-stage engine, as much CPU
as a whole app of the test command; tests/README.md); the deploy checks run in every run, on one node of one slot.
"""

from __future__ import annotations

import openai
import pytest

from app.build.builder import NO_HAPROXY
from app.clusters.ready import engines_answering, path_warning
from deployments.engine import NO_NVLINK_MULTICAST_ENV
from tests.cpu.engine_apps import REPO
from tests.engine_checks import RAY_WORKERS, assert_env_has, ray_worker_processes
from tests.local_cluster import DeployFailed, LocalCluster, load_serve_config
from tests.netns_hosts import NetnsHost, netns_problem


@pytest.fixture(scope="module", autouse=True)
def _second_host_possible():
    """A tool the README's set-up installs that is missing fails the module (a skip would hide a broken CI)."""
    problem = netns_problem()
    assert problem is None, problem


MODEL = "tiny-pp2"
PLATFORM = {"SUMMIT_VLLM_CPU_RAY": "1"}


def pipelined_model(name: str, tiny_model_dir, **layout) -> dict:
    return {
        "name": name,
        "source": str(tiny_model_dir),
        "accelerator": "gpu",
        "gpus_per_node": 1,
        **layout,
        # PP on vLLM's CPU backend needs the compiled model (eager mode has no intermediate tensors between stages).
        "engine_kwargs": {
            "dtype": "bfloat16",
            "max_model_len": 1024,
            "max_num_seqs": 8,
            "enforce_eager": False,
            "kv_cache_memory_bytes": 64 << 20,
        },
        "deployment": {"num_cpus": 0.5, "health_check_period_s": 5},
    }


def app_config(models: list[dict], placement_wait_s: float = 60) -> dict:
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    application = config["applications"][0]
    application["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    application["runtime_env"]["env_vars"].update(PLATFORM, OMP_NUM_THREADS="1")
    application["args"] = {"models": models, "placement_wait_s": placement_wait_s}
    return config


@pytest.fixture(scope="module")
def two_nodes():
    host = NetnsHost(subnet=251).up()
    head = LocalCluster(
        num_cpus=1,
        num_gpus=1,
        node_ip=host.root_ip,
        env={**PLATFORM, "VLLM_HOST_IP": host.root_ip, "GLOO_SOCKET_IFNAME": host.root_if},
    )
    try:
        head.start()
        head.add_worker(
            host.host_ip,
            num_cpus=4,
            num_gpus=1,
            prefix=host.exec_prefix,
            env={"VLLM_HOST_IP": host.host_ip, "GLOO_SOCKET_IFNAME": host.host_if},
        )
        yield head, host
    finally:
        head.stop()
        host.down()


@pytest.fixture(scope="module")
def one_slot_node():
    """One node of one Ray "GPU" slot, as each of `two_nodes` (no engine starts on it: the deploys are refused)."""
    cluster = LocalCluster(num_cpus=2, num_gpus=1, env=PLATFORM)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.mark.long
def test_a_pipeline_parallel_replica_runs_its_stages_on_two_nodes(two_nodes, tiny_model_dir):
    cluster, host = two_nodes
    cluster.serve_deploy(app_config([pipelined_model(MODEL, tiny_model_dir, pipeline_parallel_size=2)]), timeout_s=900)

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.completions.create(
        model=MODEL, prompt="Split across nodes", max_tokens=8, logprobs=2, extra_body={"ignore_eos": True}
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
    # this Ray runs without Serve's HAProxy: the app is on the two-hop path; `summit wait-ready` says so, with the fix
    ready = engines_answering(cluster.base_url)
    assert ready is not None and ready.path == f"hops; {NO_HAPROXY}", ready
    assert 'eval "$(summit direct-path-env)"' in (path_warning(ready.path) or "")

    ip_of = {n["node_id"]: n["node_ip"] for n in cluster.alive_nodes()}
    assert sorted(ip_of.values()) == sorted([host.root_ip, host.host_ip])
    (group,) = [g for g in cluster.placement_groups() if g["state"] == "CREATED" and f"LLMServer:{MODEL}" in g["name"]]
    bundle_ips = [ip_of[b["node_id"]] for b in sorted(group["bundles"], key=lambda b: b["bundle_id"]["bundle_index"])]
    # The plan: PACK, bundle i on node i // gpus_per_node, i.e. one stage per node; bundle 0 holds the replica's CPUs
    # too, which the 1-CPU head cannot fit.
    assert bundle_ips == [host.host_ip, host.root_ip], bundle_ips

    actors = cluster.alive_actors()
    (replica,) = [a for a in actors if a["class_name"] == f"ServeReplica:summit:LLMServer:{MODEL}"]
    assert ip_of[replica["node_id"]] == bundle_ips[0] and replica["placement_group_id"] == group["placement_group_id"]
    workers = [a for a in actors if a["class_name"] in RAY_WORKERS]
    print("vLLM Ray workers on", sorted(ip_of[w["node_id"]] for w in workers))
    assert sorted(ip_of[w["node_id"]] for w in workers) == sorted(bundle_ips), (
        "the engine's workers must run on both nodes"
    )
    assert {w["placement_group_id"] for w in workers} == {group["placement_group_id"]}
    # vLLM's Ray executor copies the multicast-off environment to its workers (VLLM_RAY_EXTRA_ENV_VARS_TO_COPY)
    procs = ray_worker_processes()
    assert len(procs) >= 2, [p.cmdline()[:1] for p in procs]
    assert_env_has(procs, NO_NVLINK_MULTICAST_ENV)


def test_a_replica_no_node_can_hold_fails_naming_the_resource(one_slot_node, tiny_model_dir):
    cluster = one_slot_node
    model = pipelined_model("tiny-tp2", tiny_model_dir, tensor_parallel_size=2, gpus_per_node=2)
    with pytest.raises(DeployFailed) as failed:
        cluster.serve_deploy(app_config([model], placement_wait_s=2), timeout_s=300)
    message = str(failed.value)
    assert "model 'tiny-tp2'" in message and "needs 2 GPUs on one node" in message, message
    assert "lower tensor_parallel_size to 1" in message and "placement_wait_s" in message, message


def test_weights_that_are_not_there_fail_the_deploy_before_any_replica_starts(one_slot_node, tiny_model_dir, tmp_path):
    """Checked where a replica would load them (a Ray task on a GPU node, for this GPU-shaped model): the deploy fails
    naming the model, the key and the path, and Serve started no replica of it."""
    cluster = one_slot_node
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    cases = [("tiny-gone", tmp_path / "nowhere", "does not exist"), ("tiny-empty", empty, "config")]
    models = [{**pipelined_model(name, tiny_model_dir), "source": str(source)} for name, source, _ in cases]
    with pytest.raises(DeployFailed) as failed:  # one deploy: every model's problem is named at once
        cluster.serve_deploy(app_config(models, placement_wait_s=2), timeout_s=300)
    message = str(failed.value)
    for name, source, why in cases:
        assert f"model '{name}': source '{source}'" in message and why in message, message
        assert not [a for a in cluster.alive_actors() if a["class_name"].endswith(f"LLMServer:{name}")]
    assert "Fix:" in message, message
