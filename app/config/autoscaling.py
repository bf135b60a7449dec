"""A model's Serve `autoscaling_config` with defaults that scale an LLM engine (pure: no Ray calls).

Serve decides replicas as ceil(ongoing requests per replica / `target_ongoing_requests`), counting requests
running in a replica and those queued at the callers' handles. Serve's default target is 2: tuned for models
that take one request at a time, it would ask for a replica per two streams of an engine that batches 64.
Summit derives the target from the engine's batch size instead:

    target_ongoing_requests = ceil(0.75 × max_num_seqs), at most max_ongoing_requests

Why 0.75: below the engine's batch size, because a new replica takes minutes to start (engine start, weights,
warm-up: 25–35 s for the tiny CPU model, minutes for a large GPU model) and must be asked for while the running
ones still have room; not as low as 0.5, because an LLM engine's throughput grows almost linearly with its
batch until it is memory-bound, so replicas held at half a batch cost about twice the accelerators for the
same traffic. A replica never runs more than `max_ongoing_requests` at once, so the target is capped there:
a larger target could only be reached by requests queued at the handles.

Other defaults: `min_replicas` 1 (0 is allowed: the first request after idling waits for a cold start),
`max_replicas` = max(min_replicas, 1) as in Serve (give it to allow scaling). The delays and windows stay
Serve's (upscale 30 s, downscale 600 s, look-back 30 s): an engine is too slow to start to follow seconds of
traffic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TARGET_FRACTION_OF_BATCH = 0.75
# Latency-target autoscaling (`policy: {ttft_p90_ms, tpot_p90_ms}`): the policy class, in the runtime
LATENCY_POLICY = "deployments.observability.slo:LatencyTargetPolicy"
LATENCY_TARGETS = ("ttft_p90_ms", "tpot_p90_ms")


def default_target_ongoing_requests(max_num_seqs: int, max_ongoing_requests: int) -> int:
    """ceil(0.75 × the engine's max_num_seqs), capped at the replica's max_ongoing_requests, at least 1."""
    return max(1, min(math.ceil(TARGET_FRACTION_OF_BATCH * max_num_seqs), max_ongoing_requests))


def autoscaling_config(given: Mapping[str, Any], max_num_seqs: int, max_ongoing_requests: int) -> dict[str, Any]:
    """The Serve autoscaling_config for a model: `given` plus Summit's defaults, checked.

    Raises ValueError naming the key when a key is not one of Serve's, when the replica bounds are inconsistent
    or when `target_ongoing_requests` exceeds `max_ongoing_requests` (the target could never be reached).
    """
    known = _serve_autoscaling_fields()
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"deployment.autoscaling_config.{unknown[0]} is not a Ray Serve autoscaling option; "
            f"known: {', '.join(sorted(known))}"
        )
    config = dict(given)
    policy = config.get("policy")
    if isinstance(policy, Mapping) and "policy_function" not in policy:
        config["policy"] = latency_policy(policy)
    config.setdefault("min_replicas", 1)
    config.setdefault("max_replicas", max(1, config["min_replicas"]))
    config.setdefault("target_ongoing_requests", default_target_ongoing_requests(max_num_seqs, max_ongoing_requests))
    low, high, initial = config["min_replicas"], config["max_replicas"], config.get("initial_replicas")
    if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= high and high >= 1):
        raise ValueError(
            f"deployment.autoscaling_config: need integers 0 <= min_replicas <= max_replicas and "
            f"max_replicas >= 1; got min_replicas={low!r}, max_replicas={high!r}"
        )
    if initial is not None and not (isinstance(initial, int) and low <= initial <= high):
        raise ValueError(
            f"deployment.autoscaling_config.initial_replicas={initial!r} must lie between "
            f"min_replicas ({low}) and max_replicas ({high})"
        )
    target = config["target_ongoing_requests"]
    if not isinstance(target, (int, float)) or target <= 0:
        raise ValueError(f"deployment.autoscaling_config.target_ongoing_requests={target!r} must be a positive number")
    if target > max_ongoing_requests:
        raise ValueError(
            f"deployment.autoscaling_config.target_ongoing_requests ({target}) exceeds the replica's "
            f"max_ongoing_requests ({max_ongoing_requests}): a replica never runs more at once. Lower the "
            f"target or raise deployment.max_ongoing_requests"
        )
    return config


def latency_policy(given: Mapping[str, Any]) -> dict[str, Any]:
    """Serve's `policy` (`policy_function` + `policy_kwargs`) for Summit's `{ttft_p90_ms, tpot_p90_ms,
    scale_in_below}`; raises ValueError naming the key."""
    known = {*LATENCY_TARGETS, "scale_in_below"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"deployment.autoscaling_config.policy.{unknown[0]} is not a latency target; known: "
            f"{', '.join(sorted(known))} (or give Serve's own policy_function)"
        )
    kwargs = {}
    for key in LATENCY_TARGETS:
        value = given.get(key)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"deployment.autoscaling_config.policy.{key}={value!r} must be a positive number")
            kwargs[key] = float(value)
    if not kwargs:
        raise ValueError("deployment.autoscaling_config.policy: give ttft_p90_ms, tpot_p90_ms or both")
    low = given.get("scale_in_below", 0.5)
    if not isinstance(low, (int, float)) or not 0 <= low < 1:
        raise ValueError(f"deployment.autoscaling_config.policy.scale_in_below={low!r} must lie in [0, 1)")
    return {"policy_function": LATENCY_POLICY, "policy_kwargs": {**kwargs, "scale_in_below": float(low)}}


def _serve_autoscaling_fields() -> frozenset[str]:
    from ray.serve.config import AutoscalingConfig

    return frozenset(AutoscalingConfig.model_fields)
