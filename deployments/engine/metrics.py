"""This process's vLLM metrics as vLLM records them (its prometheus_client registry)."""

from __future__ import annotations


def engine_metric_samples():
    """This process's vLLM metrics as vLLM records them (its prometheus_client registry), flattened for Ray's metrics
    system: ("counter" | "gauge", name with `:` made `_`, labels, value); a histogram becomes cumulative gauges
    `<name>_bucket` (label `le`), `<name>_count` and `<name>_sum`, the series Prometheus's own histograms have."""
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram, get_metrics_snapshot

    for metric in get_metrics_snapshot():
        name = metric.name.replace(":", "_")
        if isinstance(metric, Counter):
            yield "counter", name, metric.labels, metric.value
        elif isinstance(metric, Gauge):
            yield "gauge", name, metric.labels, metric.value
        elif isinstance(metric, Histogram):
            for le, count in metric.buckets.items():
                yield "gauge", name + "_bucket", {**metric.labels, "le": le}, count
            yield "gauge", name + "_count", metric.labels, metric.count
            yield "gauge", name + "_sum", metric.labels, metric.sum


def kv_cache_usage() -> float | None:
    """The share of this process's engine's KV-cache blocks held by requests as of its last step (vLLM's
    `vllm:kv_cache_usage_perc`; blocks kept only for prefix caching count as free); None with metrics off."""
    from vllm.v1.metrics.reader import Gauge, get_metrics_snapshot

    values = [m.value for m in get_metrics_snapshot() if isinstance(m, Gauge) and m.name == "vllm:kv_cache_usage_perc"]
    return max(values) if values else None


def generation_tokens() -> int | None:
    """Tokens this process's engine has generated so far, aborted requests' included (vLLM's
    `vllm:generation_tokens` counter, updated every engine step); None with metrics off."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    values = [m.value for m in get_metrics_snapshot() if isinstance(m, Counter) and m.name == "vllm:generation_tokens"]
    return sum(values) if values else None


def recorded_totals() -> dict[str, float]:
    """What this process's vLLM has recorded so far, under vLLM's names, summed over label sets: each counter's value,
    each histogram's `<name>_count` and `<name>_sum`. Ray's metrics endpoint exports the same values once its reports
    are in (`engine_metric_samples`); tests compare the two."""
    from vllm.v1.metrics.reader import Counter, Histogram, get_metrics_snapshot

    totals: dict[str, float] = {}
    for metric in get_metrics_snapshot():
        if isinstance(metric, Counter):
            totals[metric.name] = totals.get(metric.name, 0) + metric.value
        elif isinstance(metric, Histogram):
            totals[metric.name + "_count"] = totals.get(metric.name + "_count", 0) + metric.count
            totals[metric.name + "_sum"] = totals.get(metric.name + "_sum", 0) + metric.sum
    return totals


# vLLM's latency histograms that latency-target autoscaling reads (deployments/observability/slo.py)
LATENCY_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:inter_token_latency_seconds"}


def latency_buckets() -> dict[str, dict[float, int]]:
    """This process's engine's time-to-first-token and inter-token latency histograms, as cumulative counts per
    bucket upper bound in seconds (`+Inf` as math.inf), summed over their label sets; empty with metrics off."""
    import math

    from vllm.v1.metrics.reader import Histogram, get_metrics_snapshot

    wanted = {name: key for key, name in LATENCY_HISTOGRAMS.items()}
    out: dict[str, dict[float, int]] = {}
    for metric in get_metrics_snapshot():
        key = wanted.get(metric.name)
        if key is None or not isinstance(metric, Histogram):
            continue
        buckets = out.setdefault(key, {})
        for le, count in metric.buckets.items():
            bound = math.inf if le in ("+Inf", "inf") else float(le)
            buckets[bound] = buckets.get(bound, 0) + count
    return out


def prompt_tokens_by_source() -> dict[str, int]:
    """Prompt tokens this process's engine took from each source so far — `local_compute`, `local_cache_hit`,
    `external_kv_transfer` (loaded through its KV connector) — as vLLM counts them (`vllm:prompt_tokens_by_source`);
    empty with metrics off or on a vLLM without that counter."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    out: dict[str, int] = {}
    for m in get_metrics_snapshot():
        if isinstance(m, Counter) and m.name == "vllm:prompt_tokens_by_source":
            source = m.labels.get("source", "")
            out[source] = out.get(source, 0) + int(m.value)
    return out


def kv_connector_counters() -> dict[str, float]:
    """The KV connector's own counters in this process (vLLM's `vllm:nixl_*` metrics: transfers' time, bytes,
    descriptors, failures), as `<name>_sum` / `<name>_count` for a histogram, the value for a counter; empty with
    metrics off, another connector, or a vLLM without them."""
    from vllm.v1.metrics.reader import Counter, Histogram, get_metrics_snapshot

    out: dict[str, float] = {}
    for m in get_metrics_snapshot():
        if not m.name.startswith("vllm:nixl_"):
            continue
        name = m.name.removeprefix("vllm:")
        if isinstance(m, Histogram):
            out[name + "_sum"] = out.get(name + "_sum", 0.0) + float(m.sum)
            out[name + "_count"] = out.get(name + "_count", 0.0) + float(m.count)
        elif isinstance(m, Counter):
            out[name] = out.get(name, 0.0) + float(m.value)
    return out
