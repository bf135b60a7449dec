"""`routing:` in a model's config becomes the engine deployment's `request_router_config`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray import serve

from app.build.options import llm_deployment_options
from app.config import ModelConfig, RoutingOptions, SummitConfig
from deployments.routing import policies as routing


def model(**overrides) -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", "source": "/models/m", "accelerator": "cpu", **overrides})


def test_default_policy_keeps_serves_own_router():
    assert model().routing.policy == "least_load"
    assert "request_router_config" not in llm_deployment_options(model())


def test_prefix_affinity_names_its_router_and_kwargs():
    options = llm_deployment_options(model(routing={"policy": "prefix_affinity", "prefix_chars": 512, "imbalance": 4}))
    assert options["request_router_config"] == {
        "request_router_class": "deployments.routing.routers.PrefixAffinityRouter",
        "request_router_kwargs": {"prefix_chars": 512, "imbalance": 4, "max_tracked": routing.DEFAULT_MAX_TRACKED},
    }


def test_session_affinity_names_its_router_and_serve_accepts_the_options():
    options = llm_deployment_options(model(routing={"policy": "session_affinity", "max_tracked": 50}))
    assert (
        options["request_router_config"]["request_router_class"] == "deployments.routing.routers.SessionAffinityRouter"
    )
    assert options["request_router_config"]["request_router_kwargs"] == {"max_tracked": 50}

    class FakeServer:
        pass

    config = serve.deployment(FakeServer).options(**options)._deployment_config.request_router_config
    assert config.get_request_router_class().__name__ == "SessionAffinityRouter"


def test_config_defaults_match_the_routing_module():
    defaults = RoutingOptions()
    assert (defaults.prefix_chars, defaults.imbalance, defaults.max_tracked) == (
        routing.DEFAULT_PREFIX_CHARS,
        routing.DEFAULT_IMBALANCE,
        routing.DEFAULT_MAX_TRACKED,
    )


@pytest.mark.parametrize(
    "bad, named",
    [({"policy": "round_robin"}, "policy"), ({"prefix_tokens": 8}, "prefix_tokens"), ({"imbalance": -1}, "imbalance")],
)
def test_bad_routing_options_are_named(bad, named):
    with pytest.raises(ValidationError) as e:
        SummitConfig.model_validate({"models": [{"name": "m", "source": "/m", "accelerator": "cpu", "routing": bad}]})
    assert named in str(e.value)
