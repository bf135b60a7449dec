"""Monitoring's pure parts: the YAML block, the routing decision header, the arrival time, a request's spans (the SDK's
in-memory exporter, in this process) and the routers' decision outcomes. The real app: tests/cpu/test_monitoring.py."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from app.config import SummitConfig
from app.config.monitoring import MonitoringOptions, TracingOptions
from deployments.observability.tracing import DECISION_HEADER, Tracing, decision_value, parse_decision
from deployments.observability.watch import ARRIVAL_HEADER, RequestWatch, arrival_s
from deployments.routing import policies as routing
from deployments.routing.routers import _PrefixAffinity, _SessionAffinity

TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def test_monitoring_defaults_metrics_on_traces_off_and_names_the_missing_endpoint():
    options = SummitConfig.model_validate({"models": [{"name": "m", "source": "/m"}]}).monitoring
    assert options.metrics and options.warmup and options.tracing.exporter == "none"
    with pytest.raises(ValidationError, match="monitoring.tracing.endpoint"):
        MonitoringOptions.model_validate({"tracing": {"exporter": "otlp"}})
    with pytest.raises(ValidationError, match="exporter"):
        MonitoringOptions.model_validate({"tracing": {"exporter": "jaeger"}})


def test_the_decision_header_round_trips_and_bad_values_are_ignored():
    value = decision_value("prefix_affinity", "hit", "abc", 10.5, 10.75)
    assert parse_decision(value.encode()) == {
        "policy": "prefix_affinity",
        "outcome": "hit",
        "replica": "abc",
        "start_s": 10.5,
        "end_s": 10.75,
    }
    for bad in (None, b"", b"a;b", b"a;b;c;x;y", b"\xff\xfe"):
        assert parse_decision(bad) is None


def test_arrival_is_the_earliest_trusted_time_within_bounds():
    now = 1000.0
    decision = (DECISION_HEADER, decision_value("p", "hit", "r", 999.0, 999.1).encode())
    assert arrival_s([decision], internal=False, now_s=now) == 999.0
    forwarded = (ARRIVAL_HEADER, b"998.5")
    assert arrival_s([forwarded], internal=True, now_s=now) == 998.5
    assert arrival_s([forwarded], internal=False, now_s=now) == now  # a client's header is not believed
    assert arrival_s([(ARRIVAL_HEADER, b"1")], internal=True, now_s=now) == now - 600  # a clock far off: bounded
    assert arrival_s([(ARRIVAL_HEADER, b"junk")], internal=True, now_s=now) == now


def test_a_request_is_one_trace_under_the_clients_span():
    tracing = Tracing(TracingOptions(exporter="memory"))
    headers = [
        (b"traceparent", f"00-{TRACE}-{CLIENT_SPAN}-01".encode()),
        (b"x-request-id", b"req-1"),
        (DECISION_HEADER, b"prefix_affinity;new;r1;1.0;1.001"),
    ]
    watch = RequestWatch(None, tracing, {"path": "/v1/completions"}, headers, "r1", "m", internal=False)
    watch.span("summit.queue", 1, 2)
    watch.engine_received()
    out = watch.response_headers([])
    watch.first_output()
    watch.status = 200
    watch.end()
    watch.end(aborted=True)  # a second end changes nothing
    spans = {s["name"]: s for s in tracing.recent_spans(TRACE)}
    assert set(spans) == {
        "summit.request",
        "summit.route",
        "summit.queue",
        "summit.engine.prefill",
        "summit.engine.decode",
    }
    root = spans["summit.request"]
    assert root["parent_id"] == CLIENT_SPAN and root["events"] == ["summit.end"]
    assert out == [(b"traceparent", f"00-{TRACE}-{root['span_id']}-01".encode())]
    assert all(s["parent_id"] == root["span_id"] for name, s in spans.items() if name != "summit.request")
    assert spans["summit.route"]["attributes"]["summit.routing.outcome"] == "new"
    assert root["attributes"]["summit.request_id"] == "req-1" and root["attributes"]["summit.aborted"] is False


def test_an_aborted_request_ends_its_trace_as_an_error_and_tracing_off_records_nothing():
    tracing = Tracing(TracingOptions(exporter="memory"))
    watch = RequestWatch(None, tracing, {"path": "/v1/completions"}, [], "r1", "m", internal=False)
    watch.engine_received()
    watch.end(aborted=True)
    (root,) = [s for s in tracing.recent_spans() if s["name"] == "summit.request"]
    assert root["status"] == "ERROR" and root["events"] == ["summit.abort"] and root["parent_id"] is None
    off = Tracing(TracingOptions())
    assert not off.enabled and RequestWatch(None, off, {"path": "/"}, [], "r", "m", False).trace is None


def test_routers_tell_why_they_chose():
    rng = random.Random(0)
    policy = _PrefixAffinity(imbalance=2)
    loads = {"a": 0, "b": 0}
    first, why = policy.decide_why("k", loads, rng)
    assert why == "new"
    assert policy.decide_why("k", loads, rng) == (first, "hit")
    other = "b" if first == "a" else "a"
    assert policy.decide_why("k", {first: 5, other: 0}, rng) == (other, "spill")
    assert policy.decide_why(None, loads, rng)[1] == "least_load"
    session = _SessionAffinity()
    owner, why = session.decide_why("s", loads, rng)
    assert why == "new" and session.decide_why("s", {owner: 9, "c": 0}, rng) == (owner, "hit")


def test_the_affinity_table_peek_does_not_refresh_a_key():
    table = routing.AffinityTable(max_keys=2)
    table.assign("x", "a")
    table.assign("y", "b")
    assert table.peek("x") == "a"
    table.assign("z", "c")  # x stays the least recently used: dropped
    assert table.peek("x") is None and table.peek("y") == "b"
