"""The Serve YAML's `args:` for `app.builder:build_app`, as one pydantic root model.

Unknown keys are rejected with the key named; vLLM engine kwargs are checked against the fields of
vLLM's own `AsyncEngineArgs` (asked through `deployments.vllm_adapter`, not a hand-written list).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.batch.options import BatchOptions
from app.engine_checks import check_cpu_quantization, check_engine_kwargs, check_tool_options, resolve_chat_template
from app.lora import LORA_ENGINE_KEYS, LoraOptions
from app.monitoring import MonitoringOptions

_ENV_REF = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand_env(value: str, env: dict[str, str] | None = None) -> str:
    """Expand `$VAR`, `${VAR}` and `${VAR:-default}`, then `~`. An unset variable without default is an error."""
    env = os.environ if env is None else env

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        raise ValueError(f"environment variable {name} is not set (give it in runtime_env.env_vars or use ${{{name}:-default}})")

    return os.path.expanduser(_ENV_REF.sub(sub, value))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentOptions(_Strict):
    """Ray Serve options of one model's engine deployment."""

    num_replicas: int = Field(1, ge=0, description="Fixed replica count (ignored when autoscaling_config is set).")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...). "
        "Defaults (app/autoscaling.py): min_replicas 1 (0 allowed: cold start), max_replicas = min_replicas, "
        "target_ongoing_requests = ceil(0.75 × max_num_seqs) capped at max_ongoing_requests."
    )
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests one replica takes at once. Default: the engine's max_num_seqs (Serve's 5 would throttle it)."
    )
    max_queued_requests: int = Field(-1, ge=-1, description="Requests queued per caller before Serve rejects them; -1 = no bound.")
    overload_status_code: Literal[429, 503] = Field(
        503, description="HTTP status of a request rejected because max_queued_requests is full (OpenAI clients retry both)."
    )
    retry_after_s: float = Field(1.0, ge=0, description="`Retry-After` seconds sent with an overload rejection.")
    num_cpus: float | None = Field(None, ge=0, description="CPUs of the replica actor. Default: 1 on GPU, 0.5 on CPU.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve asks the engine whether it is alive.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="How long a health check may take before the replica is replaced.")
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0, description="Time given to running requests when a replica stops.")


class RoutingOptions(_Strict):
    """How the ingress picks one of a model's replicas (decisions in app/routing.py, Serve routers in deployments/routers.py)."""

    policy: Literal["least_load", "prefix_affinity", "session_affinity"] = Field(
        "least_load",
        description="least_load: Serve's power-of-two choices; prefix_affinity: same leading prompt block → same replica "
        "(vLLM prefix-cache hits) unless overloaded; session_affinity: same `x-session-id` header (or `user`) → same replica while it lives.",
    )
    prefix_chars: int = Field(
        1024, ge=16, description="prefix_affinity: characters of the prompt's leading block (stand-in for tokens: ≈ 4 per token; "
        "cover at least one vLLM KV block, 128 tokens on CPU / 16 on GPU). Shorter prompts are routed by load."
    )
    imbalance: int = Field(
        8, ge=0, description="prefix_affinity: ongoing requests a prefix's replica may have above the least-loaded one before the prefix moves."
    )
    max_tracked: int = Field(100_000, ge=1, description="Prefixes or sessions remembered per ingress replica (least recently used dropped).")


class PDSide(_Strict):
    """One side of a disaggregated model (its prefill pool or its decode pool): a Serve deployment of its own. A key
    left out is the model's."""

    tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs one pipeline stage of this side spans.")
    pipeline_parallel_size: int | None = Field(None, ge=1, description="Pipeline stages of this side.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments merged over the model's.")
    deployment: DeploymentOptions | None = Field(None, description="Ray Serve options of this side's deployment.")
    routing: RoutingOptions | None = Field(None, description="How this side's replica is chosen (prefill: "
                                           "prefix_affinity keeps a prefix's KV where it was computed).")

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs_known(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        check_engine_kwargs(kwargs)
        return kwargs


class DisaggregationOptions(_Strict):
    """Prefill/decode disaggregation: the model's prompts are computed by a prefill pool, its tokens generated by a
    decode pool that loads the prompt's KV cache through one of vLLM's KV connectors instead of computing it."""

    connector: str = Field(description="vLLM KV connector: shared_storage (vLLM's example connector: files on a path "
                           "both pools see; for CPU and tests), nixl (GPUs), lmcache, mooncake, or any connector class "
                           "the installed vLLM registers.")
    connector_config: dict[str, Any] = Field(
        default_factory=dict, description="The connector's own options (vLLM's kv_connector_extra_config), e.g. "
        "shared_storage_path. shared_storage defaults to /tmp/summit-kv/<model>.")
    kv_buffer_device: Literal["cpu", "cuda"] | None = Field(
        None, description="Where the connector stages KV: default cpu for CPU engines, cuda for GPU engines.")
    fallback: Literal["aggregated", "error"] = Field(
        "aggregated", description="When the prefill pool cannot serve a request or its KV cannot be loaded: "
        "aggregated = the decode replica computes the prompt itself; error = answer 503 + Retry-After.")
    prefill: PDSide = Field(default_factory=PDSide, description="The prefill pool.")
    decode: PDSide = Field(default_factory=PDSide, description="The decode pool (it streams the answer).")

    @field_validator("connector")
    @classmethod
    def _connector_known(cls, v: str) -> str:
        from deployments.vllm_adapter import kv_connector

        kv_connector(v)  # raises naming the known ones
        return v


class ModelConfig(_Strict):
    """One served model: where its weights are, how vLLM runs it, how Serve deploys it."""

    name: str = Field(description="The OpenAI `model` name clients send; also the Serve deployment's suffix.")
    source: str | None = Field(
        None, description="Checkpoint path or hub id. `$VAR`, `${VAR:-default}` and `~` are expanded where the app is built."
    )
    source_env: str | None = Field(None, description="Name of an environment variable holding the path (instead of `source`).")
    accelerator: Literal["cpu", "gpu"] = Field("gpu", description="Where the engine runs.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one pipeline stage is split across (inside one node).")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (may span nodes).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments (AsyncEngineArgs fields).")
    frontend_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vLLM OpenAI-server options that are not engine args (chat_template, tool_call_parser, ...)."
    )
    stream_coalesce_ms: float = Field(
        20.0, ge=0, le=1000, description="Merge a stream's chunks that arrive within this window into one message (first token never waits)."
    )
    stream_migration: Literal["greedy", "all", "off"] = Field(
        "greedy", description="When a replica's engine dies mid-stream, go on from another replica: greedy (temperature-0 "
        "streams, continued exactly), all (any temperature: sampled anew from there), off (README: Reliability).")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options.")
    routing: RoutingOptions = Field(default_factory=RoutingOptions, description="Replica choice: least_load (default), prefix_affinity or session_affinity.")
    gpus_per_node: int | None = Field(
        None, ge=1, description="GPUs of each node this model is placed on (placement and `summit validate`); default 8."
    )
    allow_cross_node_tp: bool = Field(
        False, description="Accept a TP group split across nodes (all-reduce over the network every layer); refused otherwise."
    )
    disaggregation: DisaggregationOptions | None = Field(
        None, description="Prefill/decode disaggregation over a vLLM KV connector (README: Disaggregated prefill).")
    lora: LoraOptions | None = Field(None, description="LoRA adapters served on this model, each an OpenAI `model` "
                                     "name (README: LoRA adapters).")
    model_preset: str | None = Field(
        None, description="Architecture preset (llama-3.1-8b/70b/405b) that `summit validate` sizes when the checkpoint's "
        "config.json is not readable where it runs. Not used to load the model."
    )

    @field_validator("model_preset")
    @classmethod
    def _preset_known(cls, v: str | None) -> str | None:
        if v is not None:
            from app.model_presets import get_preset

            try:
                get_preset(v)
            except KeyError as e:
                raise ValueError(f"models[].model_preset: {e.args[0]}") from None
        return v

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError("models[].name must be non-empty without spaces, e.g. `name: llama-3.1-8b`")
        return v

    @model_validator(mode="after")
    def _source_given(self) -> ModelConfig:
        if (self.source is None) == (self.source_env is None):
            raise ValueError(f"model {self.name!r}: give exactly one of `source` (a path) or `source_env` (an env var name)")
        return self

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs_known(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        check_engine_kwargs(kwargs)
        return kwargs

    @field_validator("frontend_kwargs")
    @classmethod
    def _frontend_kwargs_known(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        from deployments.vllm_adapter import frontend_arg_names

        known = frontend_arg_names()
        for key in kwargs:
            if key not in known:
                raise ValueError(f"frontend_kwargs.{key} is not an option of vLLM's OpenAI server; known: {', '.join(sorted(known))}")
        check_tool_options(kwargs)
        return resolve_chat_template(kwargs)

    def resolved_source(self, env: dict[str, str] | None = None) -> str:
        env = os.environ if env is None else env
        if self.source_env is not None:
            if self.source_env not in env:
                raise ValueError(f"model {self.name!r}: source_env {self.source_env} is not set; set it in runtime_env.env_vars")
            return os.path.expanduser(env[self.source_env])
        return expand_env(self.source, env)

    def engine_args(self) -> dict[str, Any]:
        """What vLLM is started with (the adapter adds the parallel sizes, executor and GPU safety settings)."""
        from deployments.vllm_adapter import engine_kwargs

        given = {**self.engine_kwargs, **(self.lora.engine_kwargs() if self.lora else {})}
        return engine_kwargs(given, self.accelerator, self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def adapter_names(self) -> list[str]:
        return [a.name for a in self.lora.adapters] if self.lora else []

    @model_validator(mode="after")
    def _lora_in_one_place(self) -> ModelConfig:
        if clash := sorted(set(self.engine_kwargs) & set(LORA_ENGINE_KEYS)):
            key = clash[0]
            raise ValueError(f"model {self.name!r}: engine_kwargs.{key}: LoRA is set with the model's `lora:` key "
                             "(adapters, max_loras, max_lora_rank); remove it from engine_kwargs")
        if self.lora and self.disaggregation:
            raise ValueError(f"model {self.name!r}: `lora` and `disaggregation` together are not supported; remove one")
        return self

    @model_validator(mode="after")
    def _engine_kwargs_fit_the_accelerator(self) -> ModelConfig:
        if self.accelerator == "gpu":
            from deployments.vllm_adapter import check_gpu_engine_kwargs

            check_gpu_engine_kwargs(self.engine_kwargs)
        else:
            check_cpu_quantization(self.name, self.engine_kwargs)
        return self

    @model_validator(mode="after")
    def _autoscaling_consistent(self) -> ModelConfig:
        self.serve_autoscaling_config()  # raises naming the key
        return self

    @model_validator(mode="after")
    def _disaggregation_possible(self) -> ModelConfig:
        if self.disaggregation is None:
            return self
        for role in ("prefill", "decode"):
            side = self.pd_side(role)
            if side.tensor_parallel_size * side.pipeline_parallel_size > 1:
                raise ValueError(
                    f"model {self.name!r}: disaggregation.{role} with tensor_parallel_size x pipeline_parallel_size > 1 "
                    "is not supported yet (untested with a KV connector); give that side 1 x 1, or drop disaggregation")
            side.serve_autoscaling_config()  # raises naming the key
        if self.accelerator == "cpu" and self.resolved_kv_buffer_device() != "cpu":
            raise ValueError(f"model {self.name!r}: disaggregation.kv_buffer_device "
                             f"{self.disaggregation.kv_buffer_device!r} needs GPUs; CPU engines stage KV in cpu")
        return self

    def disaggregation_problem(self) -> str | None:
        """Why this machine's vLLM cannot run the model's KV connector (a package missing), or None. Asked where the
        app is built (the engines' image), not by `summit validate` on a machine that may lack the package."""
        if self.disaggregation is None:
            return None
        from deployments.vllm_adapter import disaggregation_problem

        problem = disaggregation_problem(self.disaggregation.connector)
        return problem and f"model {self.name!r}: disaggregation.connector: {problem}"

    def resolved_kv_buffer_device(self) -> str:
        given = self.disaggregation.kv_buffer_device if self.disaggregation else None
        return given or ("cpu" if self.accelerator == "cpu" else "cuda")

    @property
    def disaggregation_fallback(self) -> str:
        return self.disaggregation.fallback if self.disaggregation else "aggregated"

    def pd_side(self, role: Literal["prefill", "decode"]) -> ModelConfig:
        """The model as one side of its disaggregation runs it: that side's parallelism, deployment, routing and engine
        settings over the model's, and vLLM's kv_transfer_config for that side (no further validation: the model's
        own is done)."""
        from deployments.vllm_adapter import connector_engine_kwargs, kv_transfer_config

        pd = self.disaggregation
        side: PDSide = getattr(pd, role)
        extra = dict(pd.connector_config)
        if pd.connector == "shared_storage":
            extra.setdefault("shared_storage_path", f"/tmp/summit-kv/{self.name}")
        kv = kv_transfer_config(pd.connector, role, extra, self.resolved_kv_buffer_device(),
                                "recompute" if pd.fallback == "aggregated" else "fail")
        engine_kwargs = {**self.engine_kwargs, **side.engine_kwargs}
        engine_kwargs.update(connector_engine_kwargs(pd.connector, role, engine_kwargs), kv_transfer_config=kv)
        return self.model_copy(update={
            "tensor_parallel_size": side.tensor_parallel_size or self.tensor_parallel_size,
            "pipeline_parallel_size": side.pipeline_parallel_size or self.pipeline_parallel_size,
            "engine_kwargs": engine_kwargs,
            "deployment": side.deployment or self.deployment, "routing": side.routing or self.routing,
            # the decode side keeps the options (its front reads `fallback`); the prefill side is a plain engine
            "disaggregation": pd if role == "decode" else None})

    @property
    def max_num_seqs(self) -> int:
        from deployments.vllm_adapter import DEFAULT_MAX_NUM_SEQS

        return int(self.engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)

    @property
    def max_ongoing_requests(self) -> int:
        """Requests one replica takes at once: the deployment's setting, else the engine's batch size."""
        return self.deployment.max_ongoing_requests or self.max_num_seqs

    def serve_autoscaling_config(self) -> dict[str, Any] | None:
        """The deployment's autoscaling_config with Summit's defaults filled in, or None for a fixed replica count."""
        from app.autoscaling import autoscaling_config

        given = self.deployment.autoscaling_config
        if given is None:
            return None
        return autoscaling_config(given, self.max_num_seqs, self.max_ongoing_requests)


class IngressOptions(_Strict):
    path: Literal["auto", "direct", "hops"] = Field(
        "auto", description="Request path. direct: HAProxy sends each request to the replica that owns the engine "
        "(needs RAY_SERVE_ENABLE_HA_PROXY=1 and models of one shape); hops: Serve's proxy -> OpenAIIngress -> model "
        "replica; auto: direct where it can be, else hops (the log says why).")
    num_replicas: int = Field(1, ge=1, description="Replicas of the HTTP ingress deployment (of the ingress request "
                              "router on the direct path).")
    num_cpus: float = Field(0.1, ge=0, description="CPUs of one ingress replica.")
    max_ongoing_requests: int = Field(2048, ge=1, description="Requests one ingress replica handles at once.")


class RateLimitOptions(_Strict):
    """Per-key limits (each API key its own), enforced across the application's replicas (deployments/rate_limit.py)."""

    requests_per_minute: int | None = Field(None, ge=1, description="OpenAI POST requests a key may send a minute.")
    tokens_per_minute: int | None = Field(None, ge=1, description="Prompt (≈ characters / 4) + max_tokens, charged on arrival.")
    default_max_tokens: int = Field(1024, ge=0, description="What a request without max_tokens is charged for its output.")

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimitOptions:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ValueError("auth.rate_limit: give requests_per_minute and/or tokens_per_minute (or remove rate_limit)")
        return self


class AuthOptions(_Strict):
    """API keys required on every OpenAI route (`Authorization: Bearer KEY`; `/health` stays open)."""

    api_keys_env: str | None = Field(
        None, description="Environment variable holding the keys (comma-separated), read where the ingress runs.")
    api_keys_file: str | None = Field(None, description="File holding the keys, one a line (e.g. a mounted secret).")
    rate_limit: RateLimitOptions | None = Field(None, description="Requests and tokens per minute per key (off if absent).")

    @model_validator(mode="after")
    def _one_source(self) -> AuthOptions:
        if (self.api_keys_env is None) == (self.api_keys_file is None):
            raise ValueError("auth: give exactly one of `api_keys_env` (an env var name) or `api_keys_file` (a path)")
        return self


class SummitConfig(_Strict):
    """Root of the Serve YAML's `args:` for `app.builder:build_app`."""

    models: list[ModelConfig] = Field(min_length=1, description="The models this application serves.")
    ingress: IngressOptions = Field(default_factory=IngressOptions, description="The OpenAI HTTP ingress.")
    auth: AuthOptions | None = Field(None, description="API keys for the OpenAI routes; off when absent.")
    batch: BatchOptions | None = Field(None, description="The OpenAI Batch API (`/v1/files`, `/v1/batches`); off when "
                                       "absent (`batch: {}` turns it on with the defaults).")
    monitoring: MonitoringOptions = Field(default_factory=MonitoringOptions, description="Metrics, traces, warm-up.")
    placement_wait_s: float = Field(
        1800.0, ge=-1, description="How long building the app waits for the Ray cluster to have nodes that can hold one "
        "replica of every model (its placement group, or its actor's CPUs/GPU) before the deploy fails naming the missing "
        "resource; long enough by default for a cluster launcher or KubeRay to bring GPU nodes up. 0: check once; "
        "-1: never fail (Serve then waits for nodes without end, as it does on its own)."
    )

    @model_validator(mode="after")
    def _unique_names(self) -> SummitConfig:
        names = [n for m in self.models for n in [m.name, *m.adapter_names]]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"models[].name and lora.adapters[].name must be unique; repeated: {', '.join(dupes)}")
        runtime = [m.name for m in self.models if m.lora and m.lora.runtime_loading]
        if runtime and self.auth is None:
            raise ValueError(f"models[{runtime[0]!r}].lora.runtime_loading: loading adapters at run time needs API keys "
                             "(anyone could load code-bearing files otherwise). Fix: add `auth: {api_keys_env: "
                             "SUMMIT_API_KEYS}` (or api_keys_file), or remove runtime_loading")
        return self

    @property
    def runtime_lora_models(self) -> list[str]:
        """The models whose adapters may be added and removed at run time (lora.runtime_loading)."""
        return [m.name for m in self.models if m.lora and m.lora.runtime_loading]
