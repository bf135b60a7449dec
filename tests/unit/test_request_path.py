"""Which request path a YAML gets (app/builder.request_path) and how models share one engine deployment on it."""

from __future__ import annotations

import pytest

from app.builder import request_path
from app.config import SummitConfig
from app.deployment_options import engine_pool_options, pool_model_index, pool_problem
from deployments.route_picker import body_model


def config(*models: dict, path: str = "auto") -> SummitConfig:
    return SummitConfig.model_validate({
        "ingress": {"path": path},
        "models": [{"source": "/models/m", "accelerator": "cpu", "deployment": {"num_cpus": 0.5}, **m} for m in models]})


def test_one_model_goes_direct_behind_haproxy_and_hops_without():
    assert request_path(config({"name": "a"}), haproxy=True)[0] == "direct"
    path, why = request_path(config({"name": "a"}), haproxy=False)
    assert path == "hops" and "RAY_SERVE_ENABLE_HA_PROXY" in why
    assert request_path(config({"name": "a"}, path="hops"), haproxy=True)[0] == "hops"


def test_models_of_one_shape_share_one_direct_deployment():
    two = config({"name": "a", "deployment": {"num_replicas": 2, "num_cpus": 0.5}}, {"name": "b"})
    assert request_path(two, haproxy=True)[0] == "direct"
    options = engine_pool_options(two.models)
    assert options["name"] == "LLMServer:a+b" and options["num_replicas"] == 3
    assert options["request_router_config"]["request_router_class"].endswith("LeastLoadRouter")
    assert [pool_model_index(rank, [2, 1]) for rank in range(4)] == [0, 0, 1, 0]


@pytest.mark.parametrize("b, named", [
    ({"deployment": {"num_cpus": 1.0}}, "ray_actor_options"),
    ({"routing": {"policy": "prefix_affinity"}}, "request_router_config"),
    ({"deployment": {"num_cpus": 0.5, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}, "autoscaling"),
])
def test_models_of_different_shapes_fall_back_to_hops_saying_why(b, named):
    different = config({"name": "a"}, {"name": "b", **b})
    assert named in pool_problem(different.models)
    path, why = request_path(different, haproxy=True)
    assert path == "hops" and named in why
    with pytest.raises(ValueError, match="ingress.path: direct is not possible.*" + named):
        request_path(config({"name": "a"}, {"name": "b", **b}, path="direct"), haproxy=True)


def test_route_picker_reads_the_model_of_a_whole_body_only():
    assert body_model(b'{"model": "a", "prompt": "x"}') == "a"
    assert body_model(b'{"model": "a", "prompt": "x') is None  # cut at HAProxy's buffer: no guess
    assert body_model(b'[1]') is None and body_model(b'{"model": 3}') is None
