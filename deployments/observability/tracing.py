"""OpenTelemetry traces of requests, one trace per request, recorded by the engine replica's front.

A request's spans (children of the client's span when it sent a W3C `traceparent`, which the response returns with
the replica's span id):
- `summit.request` (server span: arrival — at the route picker or ingress when there is one — to the last byte, or
  the abort) — attributes model, route,
  replica, request id, status, `summit.aborted`;
- `summit.route` — the routing decision: policy, outcome and chosen replica, timed where it was taken (the route
  picker on the direct path, the caller's router on a handle), from the `x-serve-router-decision` header;
- `summit.queue` — the wait for a running slot on the replica (direct path's bound);
- `summit.prefill_pool` — a disaggregated model's prompt on its prefill pool;
- `summit.engine.prefill` — vLLM's app received the request until its first output (first token, or the whole
  answer when not streamed); `summit.engine.decode` — first output to the end.
The YAML picks the exporter (app/monitoring.TracingOptions); off, the front records nothing.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

logger = logging.getLogger("ray.serve")

# The routing decision, as the router writes it: "policy;outcome;replica;t_start;t_end" (epoch seconds). HAProxy
# drops a client's x-serve-router-* headers before the route picker sets this one.
DECISION_HEADER = b"x-serve-router-decision"
TRACEPARENT = b"traceparent"
_MEMORY_SPANS = 20_000


def decision_value(policy: str, outcome: str, replica: str, start_s: float, end_s: float) -> str:
    return f"{policy};{outcome};{replica};{start_s:.6f};{end_s:.6f}"


def parse_decision(value: bytes | None) -> dict[str, Any] | None:
    try:
        policy, outcome, replica, start, end = value.decode().split(";")
        return {"policy": policy, "outcome": outcome, "replica": replica, "start_s": float(start), "end_s": float(end)}
    except (AttributeError, ValueError, UnicodeDecodeError):
        return None


class _BoundedMemoryExporter:
    """The SDK's in-memory exporter, bounded (a long-lived replica would otherwise keep every span)."""

    def __init__(self):
        self.spans: collections.deque = collections.deque(maxlen=_MEMORY_SPANS)

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class Tracing:
    """The replica's tracer from `monitoring.tracing`; `request()` is None when tracing is off."""

    def __init__(self, options, service: str = "summit"):
        self.enabled = options is not None and options.exporter != "none"
        self._memory: _BoundedMemoryExporter | None = None
        if not self.enabled:
            return
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._propagator = TraceContextTextMapPropagator()
        if options.exporter == "serve":  # Ray Serve's own tracer provider (its tracing_config), set in every replica
            self._tracer = trace.get_tracer("summit")
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            sampler=ParentBased(TraceIdRatioBased(options.sample_ratio)),
        )
        if options.exporter == "memory":
            self._memory = _BoundedMemoryExporter()
            provider.add_span_processor(SimpleSpanProcessor(self._memory))
        elif options.exporter == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=options.endpoint)))
        self._tracer = provider.get_tracer("summit")

    def request(self, headers, attributes: dict[str, Any], start_ns: int) -> RequestTrace | None:
        if not self.enabled:
            return None
        carrier = {
            k.decode("latin-1").lower(): v.decode("latin-1")
            for k, v in headers
            if k.lower() in (TRACEPARENT, b"tracestate")
        }
        return RequestTrace(self._tracer, self._propagator, self._propagator.extract(carrier), attributes, start_ns)

    def recent_spans(self, trace_id: str | None = None) -> list[dict]:
        """The memory exporter's finished spans (of one trace, by its hex id), oldest first."""
        if self._memory is None:
            raise RuntimeError("recent_spans needs monitoring.tracing.exporter: memory")
        return [
            _span_dict(s)
            for s in list(self._memory.spans)
            if trace_id is None or format(s.context.trace_id, "032x") == trace_id
        ]


class RequestTrace:
    """One request's spans (module docstring); every method is cheap and safe to call once the request ended."""

    def __init__(self, tracer, propagator, parent, attributes: dict[str, Any], start_ns: int):
        from opentelemetry import trace

        self._tracer, self._propagator = tracer, propagator
        self.root = tracer.start_span(
            "summit.request", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes, start_time=start_ns
        )
        self._context = trace.set_span_in_context(self.root)
        self._prefill = self._decode = None
        self._ended = False

    def child(self, name: str, start_ns: int, end_ns: int | None = None, attributes: dict | None = None):
        span = self._tracer.start_span(name, context=self._context, attributes=attributes, start_time=start_ns)
        if end_ns is not None:
            span.end(end_time=end_ns)
        return span

    def routed(self, decision: dict[str, Any] | None, replica: str, arrival_ns: int) -> None:
        if decision is None:  # no router chose: HAProxy's own balancing (one model, least load)
            self.child(
                "summit.route",
                arrival_ns,
                arrival_ns,
                {"summit.routing.policy": "haproxy", "summit.routing.replica": replica},
            )
            return
        self.child(
            "summit.route",
            int(decision["start_s"] * 1e9),
            int(decision["end_s"] * 1e9),
            {
                "summit.routing.policy": decision["policy"],
                "summit.routing.outcome": decision["outcome"],
                "summit.routing.replica": decision["replica"] or replica,
            },
        )

    def engine_received(self) -> None:
        self._prefill = self.child("summit.engine.prefill", time.time_ns())

    def first_output(self) -> None:
        if self._prefill is not None and self._decode is None:
            now = time.time_ns()
            self._prefill.end(end_time=now)
            self._decode = self.child("summit.engine.decode", now)

    def end(self, status: int | None, aborted: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        from opentelemetry.trace import Status, StatusCode

        now = time.time_ns()
        for span in (self._prefill, self._decode):
            if span is not None and span.is_recording():
                span.end(end_time=now)
        if status is not None:
            self.root.set_attribute("http.response.status_code", status)
        self.root.set_attribute("summit.aborted", aborted)
        if aborted:
            self.root.add_event("summit.abort", {"reason": "client disconnected"})
            self.root.set_status(Status(StatusCode.ERROR, "client disconnected"))
        elif status is not None and status >= 500:
            self.root.set_status(Status(StatusCode.ERROR))
        else:
            self.root.add_event("summit.end")
        self.root.end(end_time=now)

    def traceparent(self) -> bytes:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._context)
        return carrier.get("traceparent", "").encode()


def _span_dict(span) -> dict:
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [e.name for e in span.events],
        "status": span.status.status_code.name,
    }
