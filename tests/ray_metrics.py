"""Read a test cluster's metrics as Prometheus would: every node's endpoint (Ray's metrics agent), as listed in the
service-discovery file Ray writes for Prometheus, parsed with prometheus_client. Values are the exported ones
(Summit's and vLLM's, through Ray's metrics system), seconds behind the engine (Ray reports every 2 s in tests)."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


def endpoints(cluster) -> list[str]:
    """host:port of every node's metrics endpoint (Ray's `prom_metrics_service_discovery.json`), else the head's."""
    path = cluster.temp_dir / "prom_metrics_service_discovery.json"  # the head's copy, at the top of its temp dir
    targets: list[str] = []
    if path.exists():
        for group in json.loads(path.read_text()):
            targets += group.get("targets", [])
    return targets or [f"{cluster.node_ip}:{cluster.metrics_port}"]


def scrape(cluster) -> list[Sample]:
    samples: list[Sample] = []
    for target in endpoints(cluster):
        try:
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            samples += [Sample(s.name, dict(s.labels), s.value) for s in family.samples]
    return samples


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (model=..., ReplicaId=...)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def by_label(samples: list[Sample], name: str, label: str, **labels: str) -> dict[str, float]:
    """{label value: sum} of `name`'s samples, e.g. generated tokens per ReplicaId."""
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            out[s.labels.get(label, "")] = out.get(s.labels.get(label, ""), 0.0) + s.value
    return out


def settled(read, gap_s: float = 3.0, tries: int = 20):
    """`read()`'s value once two reads `gap_s` apart agree: with Ray reporting every 2 s (tests), it then mostly
    includes every event that happened before the first of them; Ray's export was seen lagging over 30 s on a loaded
    box, so this is for a reading taken *before* what a test does (a lagging one there makes the later comparison
    fail, never pass). A reading *after* it waits until the count includes something known to come last (the
    test's own requests, or a sentinel request on the same engine), never on two equal reads."""
    last = read()
    for _ in range(tries):
        time.sleep(gap_s)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError(f"metrics did not settle: {last}")
