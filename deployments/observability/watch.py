"""One request's measurements on its engine replica: the arrival-to-engine metric and the request's trace, fed by
the front at each step (deployments/observability/metrics.py, deployments/observability/tracing.py)."""

from __future__ import annotations

import time

from deployments.http.protocol import ARRIVAL_HEADER, REQUEST_ID_HEADER
from deployments.http.protocol import header as _header
from deployments.observability.metrics import ReplicaMetrics
from deployments.observability.tracing import DECISION_HEADER, RequestTrace, Tracing, parse_decision

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
        now_ns = time.time_ns()
        self._arrival_s = arrival_s(headers, internal, now_ns / 1e9)
        self.trace: RequestTrace | None = None
        if tracing is not None and tracing.enabled:
            request_id = _header(headers, REQUEST_ID_HEADER)
            self.trace = tracing.request(
                headers,
                {
                    "http.route": scope["path"],
                    "gen_ai.request.model": model,
                    "summit.replica": replica,
                    "summit.request_id": request_id.decode("latin-1") if request_id else "",
                },
                int(self._arrival_s * 1e9),
            )
            self.trace.routed(parse_decision(_header(headers, DECISION_HEADER)), replica, now_ns)
        self.status: int | None = None
        self._ended = False

    def span(self, name: str, start_ns: int, end_ns: int | None = None, attributes: dict | None = None):
        return None if self.trace is None else self.trace.child(name, start_ns, end_ns, attributes)

    def engine_received(self) -> None:
        if self.metrics is not None:
            self.metrics.arrival_to_engine(time.time() - self._arrival_s)
        if self.trace is not None:
            self.trace.engine_received()

    def response_headers(self, headers: list) -> list:
        if self.trace is not None and (traceparent := self.trace.traceparent()):
            headers.append((b"traceparent", traceparent))
        return headers

    def first_output(self) -> None:
        if self.trace is not None:
            self.trace.first_output()

    def end(self, aborted: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        if aborted and self.metrics is not None:
            self.metrics.client_abort()
        if self.trace is not None:
            self.trace.end(self.status, aborted)
