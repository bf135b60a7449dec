"""Which request path a YAML gets (app/builder.request_path) and how models share one engine deployment on it."""

from __future__ import annotations

import pytest

from app.build.builder import check_front_processes, request_path
from app.build.options import FRONT_BOUNDS_ONGOING, engine_pool_options, pool_problem
from app.config import SummitConfig
from deployments.routing.picker import body_fields
from deployments.server.pool import pool_model_index


def config(*models: dict, path: str = "auto") -> SummitConfig:
    return SummitConfig.model_validate(
        {
            "ingress": {"path": path},
            "models": [
                {"source": "/models/m", "accelerator": "cpu", "deployment": {"num_cpus": 0.5}, **m} for m in models
            ],
        }
    )


def test_one_model_goes_direct_behind_haproxy_and_hops_without():
    assert request_path(config({"name": "a"}), haproxy=True)[0] == "direct"
    path, why = request_path(config({"name": "a"}), haproxy=False)
    assert path == "hops" and "RAY_SERVE_ENABLE_HA_PROXY" in why
    assert request_path(config({"name": "a"}, path="hops"), haproxy=True)[0] == "hops"


def test_models_with_their_own_routing_policies_share_one_direct_deployment():
    """Routing is per model in a shared deployment (ModelPolicyRouter); the engines' own settings may differ too."""
    two = config(
        {
            "name": "p",
            "routing": {"policy": "prefix_affinity", "imbalance": 4},
            "engine_kwargs": {"max_model_len": 8192},
        },
        {"name": "s", "routing": {"policy": "session_affinity"}, "source": "/models/other"},
    )
    assert request_path(two, haproxy=True)[0] == "direct"
    router = engine_pool_options(two.models)["request_router_config"]
    assert router["request_router_kwargs"]["policies"] == {
        "p": {"policy": "prefix_affinity", "prefix_chars": 1024, "imbalance": 4, "max_tracked": 100000},
        "s": {"policy": "session_affinity", "max_tracked": 100000},
    }


def test_models_of_one_shape_share_one_direct_deployment():
    two = config({"name": "a", "deployment": {"num_replicas": 2, "num_cpus": 0.5}}, {"name": "b"})
    assert request_path(two, haproxy=True)[0] == "direct"
    options = engine_pool_options(two.models)
    assert options["name"] == "LLMServer:a+b" and options["num_replicas"] == 3
    assert options["request_router_config"]["request_router_class"].endswith("ModelPolicyRouter")
    assert [pool_model_index(rank, [2, 1]) for rank in range(4)] == [0, 0, 1, 0]


@pytest.mark.parametrize(
    "b, named",
    [
        ({"deployment": {"num_cpus": 1.0}}, "ray_actor_options"),
        (
            {"deployment": {"num_cpus": 0.5, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}},
            "autoscaling",
        ),
    ],
)
def test_models_of_different_shapes_fall_back_to_hops_saying_why(b, named):
    different = config({"name": "a"}, {"name": "b", **b})
    assert named in pool_problem(different.models)
    path, why = request_path(different, haproxy=True)
    assert path == "hops" and named in why
    with pytest.raises(ValueError, match="ingress.path: direct is not possible.*" + named):
        request_path(config({"name": "a"}, {"name": "b", **b}, path="direct"), haproxy=True)


def test_route_picker_reads_the_model_of_a_whole_body_only():
    assert body_fields(b'{"model": "a", "prompt": "x"}') == ("a", None)
    assert body_fields(b'{"model": "a", "prompt": "x') == (None, None)  # cut at HAProxy's buffer: no guess
    assert body_fields(b"[1]") == (None, None) and body_fields(b'{"model": 3}') == (None, None)


def test_a_bounded_queue_on_the_direct_path_is_the_fronts():
    """Serve passes every request on (its own rejection is plain text); the replica's front bounds them."""
    one = config(
        {
            "name": "a",
            "engine_kwargs": {"max_num_seqs": 4},
            "deployment": {"num_cpus": 0.5, "max_queued_requests": 3, "overload_status_code": 429},
        }
    )
    options = engine_pool_options(one.models)
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (FRONT_BOUNDS_ONGOING, -1)
    unbounded = engine_pool_options(config({"name": "a", "engine_kwargs": {"max_num_seqs": 4}}).models)
    assert (unbounded["max_ongoing_requests"], unbounded["max_queued_requests"]) == (4, -1)


def test_front_processes_take_the_direct_path_only_and_the_refusal_names_the_key():
    fronts = config({"name": "a", "front_processes": 2})
    path, why = request_path(fronts, haproxy=True)
    check_front_processes(fronts, path, why)  # direct: accepted
    path, why = request_path(fronts, haproxy=False)
    with pytest.raises(ValueError, match=r"models\['a'\]\.front_processes > 1 .* two-hop path") as e:
        check_front_processes(fronts, path, why)
    assert "Fix: set front_processes: 1" in str(e.value)
    check_front_processes(config({"name": "a"}), path, why)  # one process: either path


@pytest.mark.parametrize(
    "extra",
    [
        {"lora": {"adapters": [{"name": "a-lora", "path": "/adapters/x"}]}},
        {"disaggregation": {"connector": "shared_storage"}},
    ],
)
def test_front_processes_refuse_lora_and_disaggregation_naming_both_keys(extra):
    with pytest.raises(ValueError, match=r"front_processes: 2 with `(lora|disaggregation)` is not supported"):
        config({"name": "a", "front_processes": 2, **extra})
    config({"name": "a", **extra})  # accepted with one process
