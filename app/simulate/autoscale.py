"""The simulator's autoscaling: Serve's own decision code, called as Serve's controller calls it.

The policy is Serve's default (`replica_queue_length_autoscaling_policy`: ongoing requests against
`target_ongoing_requests`) or Summit's latency-target policy (deployments/observability/slo.py), each wrapped by
Serve's `_apply_autoscaling_config` (min/max replicas, scaling factors, upscale/downscale delays) and called with an
`AutoscalingContext` built from the simulated replicas. Serve's delays read the wall clock (`time.time()` in
`ray.serve.autoscaling_policy`); here they read the simulation's clock for the duration of the call. This module is
the one place `summit simulate` touches Serve's private API.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from ray.serve import autoscaling_policy as serve_policy
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.observability.slo import LatencyTargetPolicy


@contextlib.contextmanager
def _clock(now: float) -> Iterator[None]:
    real = serve_policy.time
    serve_policy.time = SimpleNamespace(time=lambda: now)
    try:
        yield
    finally:
        serve_policy.time = real


class SimAutoscaler:
    """One deployment's autoscaling decisions. `config`: the deployment's autoscaling_config as Summit builds it
    (app/config/autoscaling.py: Serve's keys, `policy` already a `policy_function` + `policy_kwargs` where latency
    targets are given)."""

    def __init__(self, config: Mapping[str, Any], deployment: str = "LLMServer:sim"):
        config = dict(config)
        policy = config.pop("policy", None)
        self.config = AutoscalingConfig(**config)
        if policy and policy.get("policy_kwargs") is not None:
            self.latency = LatencyTargetPolicy(**policy["policy_kwargs"])
            func: Callable = self.latency
        else:
            self.latency = None
            func = serve_policy.replica_queue_length_autoscaling_policy
        self._policy = serve_policy._apply_autoscaling_config(func)
        self._id = DeploymentID(name=deployment, app_name="summit")
        self.state: dict[str, Any] = {}

    def decide(
        self,
        now: float,
        running: list[str],
        target: int,
        total_requests: float,
        queued_requests: float,
        latencies: Mapping[str, Mapping[str, float]] | None = None,
    ) -> int:
        """The replica count Serve would ask for now. `latencies`: {"ttft_p90_ms": {replica: ms}, ...} over the
        look-back window (what the replicas' custom metrics report)."""
        replicas = [ReplicaID(unique_id=r, deployment_id=self._id) for r in running]
        metrics = {
            k: {ReplicaID(unique_id=r, deployment_id=self._id): v for r, v in per.items()}
            for k, per in (latencies or {}).items()
        }
        ctx = AutoscalingContext(
            deployment_id=self._id,
            deployment_name=self._id.name,
            app_name=self._id.app_name,
            current_num_replicas=len(running),
            target_num_replicas=target,
            running_replicas=replicas,
            total_num_requests=total_requests,
            total_queued_requests=queued_requests,
            aggregated_metrics=metrics,
            raw_metrics={},
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=dict(self.state),
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=self.config,
        )
        with _clock(now):
            decision, self.state = self._policy(ctx)
        # Serve's controller bounds the policy's answer (AutoscalingState.apply_bounds)
        return max(self.config.min_replicas, min(self.config.max_replicas, math.ceil(decision)))
