"""One request's measurements on its engine replica: the arrival-to-engine metric and the request's trace, fed by
the front at each step (deployments/observability/metrics.py, deployments/observability/tracing.py)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from deployments.http.protocol import ARRIVAL_HEADER, REQUEST_ID_HEADER
from deployments.http.protocol import header as _header
from deployments.observability.metrics import ReplicaMetrics
from deployments.observability.tracing import DECISION_HEADER, RequestTrace, Tracing, parse_decision

logger = logging.getLogger("ray.serve")

PD_PHASES = ("prefill", "first_token", "stream")
_PD_LINE = "PD request %s (%s): prefill %.1f ms, first_token %.1f ms, stream %.1f ms"
_PD_LINE_RE = re.compile(r"PD request (\S+) \(\S+\): prefill ([\d.]+) ms, first_token ([\d.]+) ms, stream ([\d.]+) ms")

_MAX_EARLIER_S = 600.0  # a clock between nodes that is off by more than this is not believed


def arrival_s(headers, internal: bool, now_s: float) -> float:
    """The earliest arrival the request's headers tell (route picker's decision, or the ingress's arrival) or now."""
    times = [now_s]
    decision = parse_decision(_header(headers, DECISION_HEADER))
    if decision is not None:
        times.append(decision["start_s"])
    if internal:
        try:
            times.append(float(_header(headers, ARRIVAL_HEADER) or b""))
        except ValueError:
            pass
    return max(min(times), now_s - _MAX_EARLIER_S)


class RequestWatch:
    """Created when a request reaches this replica's engine path; its methods are no-ops for what is off."""

    def __init__(
        self,
        metrics: ReplicaMetrics | None,
        tracing: Tracing | None,
        scope: dict,
        headers,
        replica: str,
        model: str,
        internal: bool,
    ):
        self.metrics = metrics
        self._model = model
        request_id = _header(headers, REQUEST_ID_HEADER)
        self._request_id = request_id.decode("latin-1") if request_id else ""
        now_ns = time.time_ns()
        self._arrival_s = arrival_s(headers, internal, now_ns / 1e9)
        self.trace: RequestTrace | None = None
        if tracing is not None and tracing.enabled:
            self.trace = tracing.request(
                headers,
                {
                    "http.route": scope["path"],
                    "gen_ai.request.model": model,
                    "summit.replica": replica,
                    "summit.request_id": self._request_id,
                },
                int(self._arrival_s * 1e9),
            )
            self.trace.routed(parse_decision(_header(headers, DECISION_HEADER)), replica, now_ns)
        self.status: int | None = None
        self._ended = False
        # a disaggregated request's phases (time.time_ns): prefill pool's answer, decode engine's start, first output
        self._prefill_ns: int | None = None
        self._engine_ns: int | None = None
        self._first_ns: int | None = None

    def span(self, name: str, start_ns: int, end_ns: int | None = None, attributes: dict | None = None):
        return None if self.trace is None else self.trace.child(name, start_ns, end_ns, attributes)

    def prefilled(self, start_ns: int, end_ns: int, phases: bool) -> None:
        """A disaggregated request asked its prefill pool (hop, queue and prefill there); `phases`: the pool ran the
        prompt, so the decode engine loads its KV (the request's phases are recorded when it ends)."""
        self.span("summit.prefill_pool", start_ns, end_ns)
        if phases:
            self._prefill_ns = end_ns - start_ns

    def engine_received(self) -> None:
        if self._prefill_ns is not None:
            self._engine_ns = time.time_ns()
        if self.metrics is not None:
            self.metrics.arrival_to_engine(time.time() - self._arrival_s)
        if self.trace is not None:
            self.trace.engine_received()

    def response_headers(self, headers: list) -> list:
        if self.trace is not None and (traceparent := self.trace.traceparent()):
            headers.append((b"traceparent", traceparent))
        return headers

    def first_output(self) -> None:
        if self._engine_ns is not None and self._first_ns is None:
            self._first_ns = time.time_ns()
        if self.trace is not None:
            self.trace.first_output()

    def end(self, aborted: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        if aborted and self.metrics is not None:
            self.metrics.client_abort()
        if self._engine_ns is not None and not aborted and self.status == 200:
            self._pd_phases()
        if self.trace is not None:
            self.trace.end(self.status, aborted)

    def _pd_phases(self) -> None:
        """A disaggregated request's phases: a metric each, and one log line (bench/pd.py reads them)."""
        end_ns = time.time_ns()
        first_ns = self._first_ns or end_ns  # not streamed: the whole answer came at once
        phases = dict(
            zip(PD_PHASES, (self._prefill_ns / 1e9, (first_ns - self._engine_ns) / 1e9, (end_ns - first_ns) / 1e9))
        )
        if self.metrics is not None:
            for phase, seconds in phases.items():
                self.metrics.pd_phase(phase, seconds)
        logger.info(
            _PD_LINE,
            self._request_id or "-",
            self._model,
            *(s * 1e3 for s in phases.values()),
        )


def pd_phase_lines(serve_logs: Path) -> list[tuple[str, dict[str, float]]]:
    """The PD phase lines the replicas' logs under `serve_logs` hold (a Ray session's `logs/serve`), in each file's
    order: (request id, {phase: ms})."""
    return [
        (m[1], dict(zip(PD_PHASES, map(float, m.groups()[1:]))))
        for f in sorted(serve_logs.glob("replica_*.log"))
        for m in _PD_LINE_RE.finditer(f.read_text(errors="replace"))
    ]
