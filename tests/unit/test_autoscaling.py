"""Autoscaling defaults derived from the engine's batch size, and the deployment options they become."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray import serve

from app.build.options import llm_deployment_options
from app.config import ModelConfig, SummitConfig
from app.config.autoscaling import autoscaling_config, default_target_ongoing_requests


def model(deployment: dict, **engine_kwargs) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "m",
            "source": "/models/m",
            "accelerator": "cpu",
            "engine_kwargs": engine_kwargs,
            "deployment": deployment,
        }
    )


@pytest.mark.parametrize(
    "max_num_seqs, max_ongoing, target",
    [
        (256, 256, 192),  # vLLM's default batch: scale at three quarters of it
        (64, 64, 48),
        (4, 4, 3),
        (1, 1, 1),  # never below one request
        (64, 16, 16),  # capped at what a replica takes at once
        (5, 5, 4),  # rounded up
    ],
)
def test_target_is_three_quarters_of_the_batch_capped_at_max_ongoing(max_num_seqs, max_ongoing, target):
    assert default_target_ongoing_requests(max_num_seqs, max_ongoing) == target


def test_defaults_filled_and_given_values_kept():
    assert autoscaling_config({}, 64, 64) == {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 48}
    given = {"min_replicas": 0, "max_replicas": 4, "target_ongoing_requests": 10, "upscale_delay_s": 5}
    assert autoscaling_config(given, 64, 64) == given
    assert autoscaling_config({"min_replicas": 3}, 8, 8)["max_replicas"] == 3


@pytest.mark.parametrize(
    "given, named",
    [
        ({"max_replica": 4}, "autoscaling_config.max_replica"),
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
        ({"min_replicas": 0, "max_replicas": 0}, "max_replicas >= 1"),
        ({"max_replicas": 2, "initial_replicas": 3}, "initial_replicas"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
        ({"target_ongoing_requests": 65}, "max_ongoing_requests"),
    ],
)
def test_bad_autoscaling_is_named(given, named):
    with pytest.raises(ValueError, match=named):
        autoscaling_config(given, 64, 64)


def test_config_rejects_a_target_above_max_ongoing_requests():
    with pytest.raises(ValidationError, match="target_ongoing_requests"):
        SummitConfig.model_validate(
            {
                "models": [
                    {
                        "name": "m",
                        "source": "/m",
                        "accelerator": "cpu",
                        "engine_kwargs": {"max_num_seqs": 8},
                        "deployment": {
                            "max_ongoing_requests": 4,
                            "autoscaling_config": {"max_replicas": 2, "target_ongoing_requests": 6},
                        },
                    }
                ]
            }
        )


def test_deployment_options_carry_the_derived_autoscaling_config_and_serve_accepts_them():
    m = model({"autoscaling_config": {"min_replicas": 0, "max_replicas": 3}}, max_num_seqs=16)
    options = llm_deployment_options(m)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 3, "target_ongoing_requests": 12}
    assert options["max_ongoing_requests"] == 16 >= options["autoscaling_config"]["target_ongoing_requests"]

    class FakeServer:
        pass

    config = serve.deployment(FakeServer).options(**options)._deployment_config
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (0, 3)
    assert config.autoscaling_config.target_ongoing_requests == 12


def test_a_small_max_ongoing_requests_caps_the_derived_target():
    options = llm_deployment_options(
        model({"max_ongoing_requests": 2, "autoscaling_config": {"max_replicas": 2}}, max_num_seqs=8)
    )
    assert options["autoscaling_config"]["target_ongoing_requests"] == 2


def test_fixed_replicas_without_autoscaling():
    options = llm_deployment_options(model({"num_replicas": 2}))
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options


def test_overload_answer_goes_to_serves_backpressure_config():
    options = llm_deployment_options(
        model({"max_queued_requests": 4, "overload_status_code": 429, "retry_after_s": 2.5})
    )
    assert options["max_queued_requests"] == 4
    assert options["backpressure_config"] == {"status_code": 429, "retry_after_s": 2.5}

    class FakeServer:
        pass

    config = serve.deployment(FakeServer).options(**options)._deployment_config.backpressure_config
    assert (config.status_code, config.retry_after_s) == (429, 2.5)
    with pytest.raises(ValidationError, match="overload_status_code"):
        model({"overload_status_code": 500})
