"""The YAML's `monitoring:` block: Summit's and vLLM's metrics (on by default) and OpenTelemetry traces (off by
default). What they export: docs/operations/monitoring.md; deployments/observability/metrics.py and
deployments/observability/tracing.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TracingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exporter: Literal["none", "otlp", "console", "memory", "serve"] = Field(
        "none",
        description="Where each request's spans go: none (off), otlp (an OpenTelemetry collector at `endpoint`, "
        "gRPC), console (the replica's log), serve (Ray Serve's own tracer: its `tracing_config` exporter), "
        "memory (kept in the replica for tests: `LLMServer.recent_spans`).",
    )
    endpoint: str | None = Field(
        None, description="The OTLP collector (e.g. http://127.0.0.1:4317), for exporter otlp."
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of requests traced when the client sent no "
        "`traceparent` (a client's sampled flag is honoured).",
    )

    @model_validator(mode="after")
    def _endpoint(self) -> TracingOptions:
        if self.exporter == "otlp" and not self.endpoint:
            raise ValueError("monitoring.tracing.endpoint is required with exporter: otlp (e.g. http://127.0.0.1:4317)")
        return self


class MonitoringOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metrics: bool = Field(
        True,
        description="vLLM's engine metrics and Summit's serving metrics through Ray's metrics "
        "system (each node's Prometheus endpoint); false turns both off.",
    )
    tracing: TracingOptions = Field(default_factory=TracingOptions, description="OpenTelemetry traces per request.")
    warmup: bool = Field(True, description="Each replica answers one short completion before it takes traffic.")
