"""The root of the Serve YAML's `args:` for `app.build:build_app`."""

from __future__ import annotations

from pydantic import Field, model_validator

from app.config.autoscaling import LATENCY_POLICY
from app.config.batch import BatchOptions
from app.config.model import ModelConfig
from app.config.monitoring import MonitoringOptions
from app.config.options import AuthOptions, IngressOptions, Strict
from app.config.sleep import share_groups, sleep_problem


class SummitConfig(Strict):
    """Root of the Serve YAML's `args:` for `app.build:build_app`."""

    models: list[ModelConfig] = Field(min_length=1, description="The models this application serves.")
    ingress: IngressOptions = Field(default_factory=IngressOptions, description="The OpenAI HTTP ingress.")
    auth: AuthOptions | None = Field(None, description="API keys for the OpenAI routes; off when absent.")
    batch: BatchOptions | None = Field(
        None,
        description="The OpenAI Batch API (`/v1/files`, `/v1/batches`); off when "
        "absent (`batch: {}` turns it on with the defaults).",
    )
    monitoring: MonitoringOptions = Field(default_factory=MonitoringOptions, description="Metrics, traces, warm-up.")
    placement_wait_s: float = Field(
        1800.0,
        ge=-1,
        description="How long building the app waits for the Ray cluster to have nodes that can hold one replica "
        "of every model (its placement group, or its actor's CPUs/GPU) before the deploy fails naming the missing "
        "resource; long enough by default for a cluster launcher or KubeRay to bring GPU nodes up. 0: check once; "
        "-1: never fail (Serve then waits for nodes without end, as it does on its own).",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> SummitConfig:
        names = [n for m in self.models for n in [m.name, *m.adapter_names]]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"models[].name and lora.adapters[].name must be unique; repeated: {', '.join(dupes)}")
        runtime = [m.name for m in self.models if m.lora and m.lora.runtime_loading]
        if runtime and self.auth is None:
            raise ValueError(
                f"models[{runtime[0]!r}].lora.runtime_loading: loading adapters at run time needs API keys "
                "(anyone could load code-bearing files otherwise). Fix: add `auth: {api_keys_env: "
                "SUMMIT_API_KEYS}` (or api_keys_file), or remove runtime_loading"
            )
        if not self.monitoring.metrics:
            for m in self.models:
                policy = (m.serve_autoscaling_config() or {}).get("policy") or {}
                if isinstance(policy, dict) and policy.get("policy_function") == LATENCY_POLICY:
                    raise ValueError(
                        f"models[{m.name!r}].deployment.autoscaling_config.policy: latency targets are read from "
                        "vLLM's metrics; set `monitoring: {metrics: true}` or drop the targets"
                    )
        return self

    @model_validator(mode="after")
    def _share_groups(self) -> SummitConfig:
        """Tells each member of a share_with group its group (its replicas' GPU fraction and sleep mode follow), then
        refuses sleep mode where it cannot work."""
        for root, members in share_groups(self.models).items():
            for m in members:
                m._share = (root, len(members))
        for m in self.models:
            if problem := sleep_problem(m):
                raise ValueError(problem)
        return self

    @property
    def runtime_lora_models(self) -> list[str]:
        """The models whose adapters may be added and removed at run time (lora.runtime_loading)."""
        return [m.name for m in self.models if m.lora and m.lora.runtime_loading]
