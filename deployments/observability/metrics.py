"""Summit's serving metrics, through Ray's metrics system (`ray.util.metrics`): each Ray node's metrics endpoint
exports them (Prometheus names get Ray's `ray_` prefix: `ray_summit_...`), beside vLLM's own engine metrics, which
`EngineMetricsBridge` mirrors there (`ray_vllm_...`, labelled `model_name`, `engine` and `ReplicaId`). Summit's
carry `model` and `replica` (the Serve replica id) where a replica records them.

What is measured (monitoring/summit-dashboard.json has a panel for each, but the PD phases and the offload credit:
the dashboard's test load has neither a disaggregated model nor an offload tier; the features' pages give their
queries):
- `summit_arrival_to_engine_seconds`: from the request's arrival (at the route picker, the two-hop ingress or the
  replica, whichever came first) to vLLM's app in the replica receiving it — routing, hops and queueing; the rest of
  a request's life is the engine's (vLLM's TTFT, inter-token and e2e histograms);
- `summit_routing_decisions`: each routing decision, by model, policy and outcome (affinity `hit`, `spill` to a less
  loaded replica, `new` key, `least_load` without a key, `fallback` when the model had no replica);
- `summit_routing_offload_blocks`: kv_cache routing's credit from vLLM's CPU offload tier (`kv_offloading_size`): blocks
  of the chosen replica's cached prefix it held only there;
- `summit_pd_phase_seconds`: a disaggregated request's phases on its decode replica (`phase`: prefill,
  first_token, stream), so a slow first token tells whether the prefill pool or the KV load took the time;
- `summit_overload_rejections`, `summit_client_aborts` (a client that left mid-request: the engine request aborted);
- `summit_batch_lines` (Batch API lines finished, by outcome) and `summit_batches_active`;
- `summit_replica_load_stage` (1 engine start: weights, KV-cache profiling, compilation; 2 warm-up; 3 ready) and
  `summit_replica_load_seconds` per stage, so a long start shows where it is.
Metrics are created on first use in the process that records them (a Ray worker); `enabled(False)` makes every
recorder a no-op (the YAML's `monitoring.metrics: false`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import Counter

logger = logging.getLogger("ray.serve")

LATENCY_BUCKETS_S = [
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
]
LOAD_STAGES = {"engine": 1, "warmup": 2, "ready": 3}

_enabled = True


def enable(on: bool) -> None:
    global _enabled
    _enabled = on


@functools.cache
def _metric(kind: str, name: str, description: str, tag_keys: tuple[str, ...]):
    from ray.util import metrics

    if kind == "histogram":
        return metrics.Histogram(name, description, boundaries=LATENCY_BUCKETS_S, tag_keys=tag_keys)
    return getattr(metrics, kind.capitalize())(name, description, tag_keys=tag_keys)


def _record(kind: str, name: str, description: str, value: float, tags: dict[str, str], keep: bool = True) -> None:
    if not _enabled:
        return
    try:
        metric = _metric(kind, name, description, tuple(tags))
        if kind == "counter" and value == 0:  # a series at 0 from the start, so that its first event is an increase
            metric._record(0, tags=tags)  # (Counter.inc refuses 0)
        else:
            getattr(metric, {"counter": "inc", "gauge": "set", "histogram": "observe"}[kind])(value, tags)
    except Exception as e:  # noqa: BLE001 — outside a Ray worker (unit tests): measuring never fails a request
        logger.debug("metric %s not recorded: %s", name, e)
        return
    if kind == "gauge" and keep:
        _Refresher.keep(metric, value, tags)


def report_period_s() -> float:
    """Half of Ray's metrics report interval: often enough that every report carries fresh values."""
    return max(0.5, float(os.environ.get("RAY_metrics_report_interval_ms", "10000")) / 2000)


class EngineMetricsBridge:
    """vLLM's engine metrics into Ray's metrics system. vLLM records them in its process (its prometheus_client
    logger: ~2 µs an observation, one per generated token for the inter-token latency); this thread mirrors them into
    Ray's metrics every `report_period_s()` — counters by their increase, gauges as they are, histograms as their
    cumulative `_bucket` / `_count` / `_sum` series — labelled with the replica (`ReplicaId`). vLLM's own Ray stat
    logger records every observation through Ray instead: on an H100 at 256 streams (8B shapes) that cost 22 % of
    the tokens per second (bench/results/h100-monitoring-cost-2026-11-24.md)."""

    def __init__(self, samples, replica: str):
        self._samples, self._replica = samples, replica
        self._counters: dict = {}
        self._thread = threading.Thread(target=self._run, name="summit-engine-metrics", daemon=True)

    def start(self) -> EngineMetricsBridge:
        if _enabled:
            self.flush()
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(report_period_s())
            try:
                self.flush()
            except Exception:  # noqa: BLE001 — a metric that cannot be read this time: the next flush tries again
                logger.debug("engine metrics not mirrored", exc_info=True)

    def flush(self) -> None:
        for kind, name, labels, value in self._samples():
            tags = {**labels, "ReplicaId": self._replica}
            description = f"vLLM's {name} (mirrored by Summit)"
            if kind == "gauge":
                _record("gauge", name, description, value, tags, keep=False)
                continue
            key = (name, tuple(sorted(tags.items())))
            last = self._counters.get(key)
            if last is None or value > last:
                _record("counter", name, description, value - (last or 0), tags)  # 0 at first: the series starts
            self._counters[key] = max(value, last or 0)


class _Refresher:
    """Ray's metrics agent drops a gauge's value that its process has not reported for two report intervals, and a
    process reports a gauge only when it is set: a value set once (a replica's load stage) would vanish. This sets
    every gauge of the process again twice per interval."""

    _values: dict = {}
    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    @classmethod
    def keep(cls, metric, value: float, tags: dict[str, str]) -> None:
        with cls._lock:
            cls._values[(id(metric), tuple(sorted(tags.items())))] = (metric, value, tags)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="summit-gauges", daemon=True)
                cls._thread.start()

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(report_period_s())
            with cls._lock:
                values = list(cls._values.values())
            for metric, value, tags in values:
                with contextlib.suppress(Exception):
                    metric.set(value, tags)


class ReplicaMetrics:
    """What one engine replica records, tagged with its model and replica id."""

    def __init__(self, model: str, replica: str):
        self.tags = {"model": model, "replica": replica}
        # what this process recorded, counted here too (the replica's stats): arrival_to_engine's observations and
        # pd_phase's per phase
        self.arrivals = 0
        self.pd_phases: dict[str, int] = {}
        self._stage: str | None = None
        self._stage_start = time.monotonic()

    def start_counters(self) -> None:
        """The replica's counters at 0, before their first event."""
        self.overload_rejection(0)
        self.client_abort(0)

    def arrival_to_engine(self, seconds: float) -> None:
        self.arrivals += 1
        _record(
            "histogram",
            "summit_arrival_to_engine_seconds",
            "Seconds from a request's arrival (route picker, "
            "ingress or replica) to vLLM's app in the replica receiving it: routing, hops and queueing.",
            max(0.0, seconds),
            self.tags,
        )

    def overload_rejection(self, n: int = 1) -> None:
        _record(
            "counter",
            "summit_overload_rejections",
            "Requests answered 429/503 because the replica's running and queued requests were at their bound.",
            n,
            self.tags,
        )

    def client_abort(self, n: int = 1) -> None:
        _record(
            "counter",
            "summit_client_aborts",
            "Requests whose client left before the answer ended (the engine request was aborted).",
            n,
            self.tags,
        )

    def stream_migration(self, outcome: str) -> None:
        _record(
            "counter",
            "summit_stream_migrations",
            "Streams that went on from another replica, by outcome: resumed (their engine died), moved_kv / "
            "moved_recompute (moved off a live replica, their KV cache carried or recomputed), failed (no replica "
            "took the continuation in time: the client got an error), client_gone.",
            1,
            {**self.tags, "outcome": outcome},
        )

    def pd_phase(self, phase: str, seconds: float) -> None:
        self.pd_phases[phase] = self.pd_phases.get(phase, 0) + 1
        _record(
            "histogram",
            "summit_pd_phase_seconds",
            "A disaggregated request's phases on its decode replica: prefill (the prefill pool's answer: hop, queue, "
            "prompt), first_token (decode engine: KV load and the first token), stream (the rest of the answer).",
            max(0.0, seconds),
            {**self.tags, "phase": phase},
        )

    def load_stage(self, stage: str) -> None:
        """Enter a start-up stage (LOAD_STAGES); the previous one's duration is recorded."""
        now = time.monotonic()
        if self._stage is not None:
            self.stage_seconds(self._stage, now - self._stage_start)
        self._stage, self._stage_start = stage, now
        _record(
            "gauge",
            "summit_replica_load_stage",
            "Where the replica's start is: 1 engine start (weights, KV-cache "
            "profiling, compilation), 2 warm-up request, 3 ready.",
            LOAD_STAGES[stage],
            self.tags,
        )

    def stage_seconds(self, stage: str, seconds: float) -> None:
        _record(
            "gauge",
            "summit_replica_load_seconds",
            "Seconds the replica spent (so far) in each start-up stage.",
            seconds,
            {**self.tags, "stage": stage},
        )

    def stage_elapsed(self) -> tuple[str | None, float]:
        return self._stage, time.monotonic() - self._stage_start


# Routing decisions made in this process (by its handles' routers), also counted here: (model, policy, outcome) -> n
decisions: Counter = Counter()


def routing_decision(model: str | None, policy: str, outcome: str) -> None:
    decisions[(model or "", policy, outcome)] += 1
    _record(
        "counter",
        "summit_routing_decisions",
        "Routing decisions by model, policy and outcome (hit: the affinity "
        "owner; spill: a less loaded replica than the owner; new: a key seen first; least_load: no key; fallback: "
        "no replica of the model, any replica answers).",
        1,
        {"model": model or "", "policy": policy, "outcome": outcome},
    )


def routing_offload_blocks(model: str | None, blocks: int) -> None:
    _record(
        "counter",
        "summit_routing_offload_blocks",
        "kv_cache routing: blocks of the chosen replica's cached prefix that it held only in vLLM's CPU offload tier "
        "(credited routing.cpu_block_credit each), by model.",
        blocks,
        {"model": model or ""},
    )


def batch_line(model: str, outcome: str, n: int = 1) -> None:
    _record(
        "counter",
        "summit_batch_lines",
        "Batch API lines finished, by model and outcome (completed / failed).",
        n,
        {"model": model, "outcome": outcome},
    )


def batches_active(count: int) -> None:
    _record("gauge", "summit_batches_active", "Batches the runner is working through.", count, {})
