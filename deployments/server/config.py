"""The one object an engine deployment (LLMServer) is bound with; the builder makes it, app/build/options.py derives
the deployment's Serve options from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from app.config import AuthOptions, ModelConfig, MonitoringOptions


@dataclass
class ServerConfig:
    # (config, resolved source) of each model the deployment hosts, one per replica (the replica's rank picks it)
    models: list[tuple[ModelConfig, str]]
    monitoring: MonitoringOptions = field(default_factory=MonitoringOptions)  # metrics, traces, warm-up
    # the API keys and rate limits where this deployment is the HTTP entry (direct path); None on the two-hop path
    auth: AuthOptions | None = None
    # each disaggregated model's prefill pool (handles): this deployment is then that model's decode pool
    prefill: dict[str, Any] | None = None
    batch_api: Any = None  # the Batch API's store, which the entry hands /v1/files and /v1/batches to
    limiter: Any = None  # the per-key RateLimiter (`auth.rate_limit`)
    adapter_registry: Any = None  # the adapters loaded at run time (lora.runtime_loading)
    # entry: the direct path's HTTP entry (every model of one shape, one a replica); model: one model's engine
    # behind the two-hop ingress; prefill: a disaggregated model's prefill pool (the decode side calls it)
    role: Literal["entry", "model", "prefill"] = "model"

    @property
    def names(self) -> list[str]:
        return [m.name for m, _ in self.models]
