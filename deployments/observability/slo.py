"""Latency-target autoscaling: `deployment.autoscaling_config.policy: {ttft_p90_ms, tpot_p90_ms}`.

Each replica reports, through Serve's custom autoscaling metrics (`record_autoscaling_stats`), the p90 time to first
token and inter-token latency its engine measured since its last report (`LatencyWindow`, from vLLM's own
histograms); Serve's controller averages them over `look_back_period_s` and calls `LatencyTargetPolicy` (Serve's
custom autoscaling policy hook, a class built once with the YAML's targets). The policy compares the slowest
replica's p90 with each target: above a target it asks for more replicas (the ratio, at most twice as many), below
`scale_in_below` of every target (an idle model reports 0) it asks for as few as hold the requests ongoing (running and
queued at the handles) at the deployment's `target_ongoing_requests`, and none fewer while they would not fit on one
fewer (latency well under target *because* of the replicas is no reason to drop one); else it keeps the count. While
requests are queued at the handles (every replica full) it asks for at least what Serve's target would: the engines'
latencies start when a request reaches the engine and cannot see that wait (`summit simulate` found it: under a 10x
spike the engines' p90 stayed under target while clients waited minutes at the handles).
Serve applies min/max replicas and its upscale/downscale delays around it.

Self-contained (stdlib and Ray only): Serve pickles this module by value into its controller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TARGETS = {"ttft_p90_ms": "ttft", "tpot_p90_ms": "tpot"}  # the YAML's key -> vLLM's histogram (engine/metrics.py)
# app/config/autoscaling.py names the policy by its import path
QUANTILE = 0.9


def quantile(buckets: Mapping[float, int], q: float = QUANTILE) -> float | None:
    """The q-quantile of cumulative bucket counts (upper bound -> observations at or below it), interpolated inside
    its bucket as Prometheus's histogram_quantile does; None without observations. In the open last bucket: its lower
    bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


class LatencyWindow:
    """A replica's p90 latencies since its previous report, from its engine's cumulative histograms."""

    def __init__(self):
        self._last: dict[str, dict[float, int]] = {}
        self._reported: dict[str, float] = {}

    def report(self, cumulative: Mapping[str, Mapping[float, int]], busy: bool = False) -> dict[str, float]:
        """{`ttft_p90_ms`, `tpot_p90_ms`}: the window's p90 in ms. Where nothing was observed: 0 for an idle replica,
        the last value for a `busy` one (requests in flight but none reached a first token or a next one: an engine
        crawling under load must not read as idle)."""
        out = {}
        for key, name in TARGETS.items():
            now = dict(cumulative.get(name, {}))
            last = self._last.get(name, {})
            delta = {b: c - last.get(b, 0) for b, c in now.items()}
            self._last[name] = now
            value = quantile(delta)
            if value is not None:
                out[key] = round(value * 1000, 3)
            else:
                out[key] = self._reported.get(key, 0.0) if busy else 0.0
        self._reported = out
        return out


_pressure_gauge = None


def _export_pressure(application: str, deployment: str, pressure: float) -> None:
    """The policy's last pressure as `summit_autoscaling_latency_pressure` (Ray's metrics, from Serve's controller,
    which calls the policy several times a second: the gauge stays fresh)."""
    global _pressure_gauge
    try:
        from ray.util.metrics import Gauge

        if _pressure_gauge is None:
            _pressure_gauge = Gauge(
                "summit_autoscaling_latency_pressure",
                description="The latency-target autoscaling policy's last reading: the slowest replica's p90 over its "
                "target, the larger of the two targets' (0: nothing measured; above 1: it scales out).",
                tag_keys=("application", "deployment"),
            )
        _pressure_gauge.set(pressure, tags={"application": application, "deployment": deployment})
    except Exception:  # noqa: BLE001 — outside Ray (unit tests, the simulator): measuring never decides anything
        pass


class LatencyTargetPolicy:
    """Serve's custom autoscaling policy for latency targets (built once per deployment with the YAML's values)."""

    def __init__(self, ttft_p90_ms: float | None = None, tpot_p90_ms: float | None = None, scale_in_below: float = 0.5):
        self.targets = {k: v for k, v in (("ttft_p90_ms", ttft_p90_ms), ("tpot_p90_ms", tpot_p90_ms)) if v}
        self.scale_in_below = scale_in_below

    def pressure(self, metrics: Mapping[str, Mapping[Any, float]]) -> float:
        """The slowest replica's p90 over its target, the larger of the two targets' (0: nothing measured)."""
        ratios = [max(metrics.get(key, {}).values(), default=0.0) / target for key, target in self.targets.items()]
        return max(ratios, default=0.0)

    def decide(self, replicas: int, pressure: float) -> int:
        if pressure > 1.0:
            return max(replicas + 1, math.ceil(replicas * min(pressure, 2.0)))
        if pressure < self.scale_in_below:
            return max(replicas - 1, 0)
        return replicas

    @classmethod
    def fewer(cls, ctx, replicas: int) -> int:
        """Under every target: as few replicas as hold the requests ongoing now (Serve's total: running and queued at
        the handles) at the deployment's `target_ongoing_requests`, at most one fewer than now; one fewer where Serve
        gives neither (Serve's downscale delay and min_replicas apply after)."""
        needed = cls.needed(ctx, None)
        if needed is None:
            return max(replicas - 1, 0)
        return needed if needed < replicas else replicas

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        pressure = self.pressure(ctx.aggregated_metrics or {})
        _export_pressure(getattr(ctx, "app_name", None) or "", getattr(ctx, "deployment_name", ""), pressure)
        replicas = ctx.current_num_replicas
        decision = self.decide(replicas, pressure)
        if decision < replicas:
            decision = self.fewer(ctx, replicas)
        queued = getattr(ctx, "total_queued_requests", 0) or 0
        if queued > 0:
            # requests wait at the handles: every replica holds max_ongoing_requests. The engines' histograms start
            # at a request's arrival in the engine, so they cannot see that wait: scale out as Serve's own target
            # would (the requests ongoing and queued at `target_ongoing_requests` a replica), in one step: measured
            # demand, not a latency ratio (doubling per cold start took 380 s to recover a simulated 10x spike)
            decision = max(decision, self.needed(ctx, replicas + 1))
        if replicas < ctx.target_num_replicas and (pressure > 0 or queued > 0):
            # replicas still starting: keep them unless the model went idle (their engines take minutes to start)
            decision = max(decision, ctx.target_num_replicas)
        return decision, {"latency_pressure": round(pressure, 3)}

    @staticmethod
    def needed(ctx, default: int | None) -> int | None:
        """Replicas that hold Serve's total of requests (running and queued at the handles) at the deployment's
        `target_ongoing_requests`; `default` where Serve gives neither."""
        target = getattr(getattr(ctx, "config", None), "target_ongoing_requests", None)
        total = getattr(ctx, "total_num_requests", None)
        return math.ceil(total / target) if target and total is not None else default
