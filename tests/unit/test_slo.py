"""Latency-target autoscaling's parts without Ray: the p90 of vLLM-shaped cumulative histograms, a replica's window
between reports, the policy's decision, and the YAML's `policy: {ttft_p90_ms, tpot_p90_ms}` turned into Serve's
custom policy. On a real engine and Serve's controller: tests/cpu/test_scaling.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from app.config.autoscaling import LATENCY_POLICY, autoscaling_config
from app.config.root import SummitConfig
from deployments.observability.slo import LatencyTargetPolicy, LatencyWindow, quantile


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile():
    buckets = {0.1: 50, 0.2: 80, 0.4: 100, math.inf: 100}  # cumulative
    assert quantile(buckets, 0.5) == pytest.approx(0.1)
    assert quantile(buckets, 0.9) == pytest.approx(0.3)  # rank 90 is half-way through (0.2, 0.4]
    assert quantile({0.1: 0, math.inf: 0}) is None
    assert quantile({0.1: 0, 0.2: 0, math.inf: 10}) == 0.2  # the open last bucket: its lower bound


def test_a_replicas_window_reports_only_what_happened_since_its_last_report():
    window = LatencyWindow()
    first = window.report({"ttft": {0.1: 10, 1.0: 10, math.inf: 10}, "tpot": {0.01: 100, math.inf: 100}})
    assert first["ttft_p90_ms"] == pytest.approx(90.0) and first["tpot_p90_ms"] == pytest.approx(9.0)
    slow = window.report({"ttft": {0.1: 10, 1.0: 20, math.inf: 20}, "tpot": {0.01: 100, math.inf: 100}})
    assert slow["ttft_p90_ms"] == pytest.approx(910.0)  # the ten new ones, all in (0.1, 1]
    assert slow["tpot_p90_ms"] == 0.0  # nothing new: an idle replica reports 0
    assert window.report({}) == {"ttft_p90_ms": 0.0, "tpot_p90_ms": 0.0}
    seen = window.report({"ttft": {0.1: 10, 1.0: 30, math.inf: 30}, "tpot": {0.01: 100, math.inf: 100}})
    assert seen["ttft_p90_ms"] == pytest.approx(865.0)  # 30 since the empty report: rank 27 of (0.1, 1] holding 20
    held = window.report({"ttft": {0.1: 10, 1.0: 30, math.inf: 30}, "tpot": {0.01: 100, math.inf: 100}}, busy=True)
    assert held["ttft_p90_ms"] == pytest.approx(865.0)  # requests in flight, none at a first token: the last value


def ctx(replicas: int, target: int | None = None, **metrics) -> SimpleNamespace:
    return SimpleNamespace(
        current_num_replicas=replicas, target_num_replicas=target or replicas, aggregated_metrics=metrics
    )


def test_the_policy_scales_out_on_the_slowest_replica_and_in_when_well_under_every_target():
    policy = LatencyTargetPolicy(ttft_p90_ms=500, tpot_p90_ms=50)
    assert policy(ctx(1, ttft_p90_ms={"a": 600.0}, tpot_p90_ms={"a": 10.0}))[0] == 2
    assert policy(ctx(2, ttft_p90_ms={"a": 100.0, "b": 5000.0}))[0] == 4  # 10x over: at most twice as many
    assert policy(ctx(3, ttft_p90_ms={"a": 300.0}, tpot_p90_ms={"a": 60.0}))[0] == 4  # TPOT's miss (1.2x) decides
    assert policy(ctx(3, ttft_p90_ms={"a": 300.0}, tpot_p90_ms={"a": 40.0}))[0] == 3  # between: keep
    assert policy(ctx(3, ttft_p90_ms={"a": 0.0}, tpot_p90_ms={"a": 0.0}))[0] == 2  # idle: one fewer
    assert policy(ctx(2))[0] == 1  # nothing reported
    assert policy(ctx(1, 2, ttft_p90_ms={"a": 100.0}))[0] == 2  # a replica starting is kept while there is load
    assert policy(ctx(1, 2, ttft_p90_ms={"a": 0.0}))[0] == 0  # but not for an idle model
    only_ttft = LatencyTargetPolicy(ttft_p90_ms=500)
    assert only_ttft(ctx(1, ttft_p90_ms={"a": 400.0}, tpot_p90_ms={"a": 1e6}))[0] == 1  # TPOT not a target


def test_latency_well_under_target_drops_a_replica_only_when_the_load_fits_on_fewer():
    """Two replicas keep a heavy load's TTFT at 50 ms (0.1 of the target: under `scale_in_below`); the 16 requests
    ongoing would not fit on one at its target of 6, so the count stays (dropping it would push TTFT back past the
    target, and the count would flap); 3 ongoing fit, and it goes. Fails if the policy
    scales in on latency alone, or never scales in under a light load."""
    policy = LatencyTargetPolicy(ttft_p90_ms=500)
    config = SimpleNamespace(target_ongoing_requests=6)
    heavy = SimpleNamespace(**vars(ctx(2, ttft_p90_ms={"a": 50.0, "b": 40.0})), config=config, total_num_requests=16)
    light = SimpleNamespace(**vars(ctx(2, ttft_p90_ms={"a": 50.0, "b": 40.0})), config=config, total_num_requests=3)
    assert policy(heavy)[0] == 2
    assert policy(light)[0] == 1
    after = SimpleNamespace(**vars(ctx(16, ttft_p90_ms={"a": 30.0})), config=config, total_num_requests=7)
    assert policy(after)[0] == 2
    idle = SimpleNamespace(**vars(ctx(1, ttft_p90_ms={"a": 0.0})), config=config, total_num_requests=0)
    assert policy(idle)[0] == 0  # an idle model still goes to zero where min_replicas allows


def test_the_yaml_targets_become_serves_custom_policy_and_bad_ones_are_named():
    config = autoscaling_config({"min_replicas": 1, "max_replicas": 3, "policy": {"ttft_p90_ms": 800}}, 8, 16)
    assert config["policy"] == {
        "policy_function": LATENCY_POLICY,
        "policy_kwargs": {"ttft_p90_ms": 800.0, "scale_in_below": 0.5},
    }
    from ray.serve.config import AutoscalingConfig

    assert AutoscalingConfig(**config).policy.policy_function == LATENCY_POLICY  # Serve takes it as it is
    for bad, named in (
        ({"ttft_p95_ms": 1}, "policy.ttft_p95_ms"),
        ({}, "give ttft_p90_ms, tpot_p90_ms or both"),
        ({"tpot_p90_ms": -3}, "policy.tpot_p90_ms=-3"),
        ({"ttft_p90_ms": 9, "scale_in_below": 1.5}, "policy.scale_in_below"),
    ):
        with pytest.raises(ValueError, match=named):
            autoscaling_config({"policy": bad}, 8, 16)
    model = {
        "name": "m",
        "source": "/models/m",
        "accelerator": "cpu",
        "deployment": {"autoscaling_config": {"max_replicas": 2, "policy": {"ttft_p90_ms": 800}}},
    }
    with pytest.raises(ValueError, match="monitoring: {metrics: true}"):
        SummitConfig.model_validate({"models": [model], "monitoring": {"metrics": False}})
    SummitConfig.model_validate({"models": [model], "monitoring": {"metrics": True}})


def test_requests_queued_at_the_handles_scale_out_though_the_engines_p90_is_under_target():
    """Every replica full and 300 requests queued at the handles while the engines' own TTFT p90 reads 50 ms
    against a 300-ms target: the engines' histograms start when a request reaches its engine, so they cannot see the
    wait; the policy asks for what Serve's target would (812 requests at 192 a replica: 5) in one step, and keeps the
    count once nothing is queued. Fails if the policy decides on the engines' latency alone
    (it would keep 2 replicas while the queue grows: summit simulate's spike)."""
    policy = LatencyTargetPolicy(ttft_p90_ms=300)
    config = SimpleNamespace(target_ongoing_requests=192)
    full = SimpleNamespace(
        **vars(ctx(2, ttft_p90_ms={"a": 50.0, "b": 40.0})),
        config=config,
        total_num_requests=812,
        total_queued_requests=300,
    )
    assert policy(full)[0] == 5  # ceil(812 / 192)
    drained = SimpleNamespace(**vars(full))
    drained.total_queued_requests, drained.total_num_requests = 0, 300
    assert policy(drained)[0] == 2
