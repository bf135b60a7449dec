"""The YAML's options around a model's engine: its Serve deployment, replica routing, the HTTP ingress and API keys."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """A YAML block: unknown keys are refused (naming them), values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SleepOptions(Strict):
    """When a replica's engine sleeps, how deep, and (models sharing a GPU) how long a model keeps it."""

    after_idle_s: float | None = Field(
        None,
        gt=0,
        description="Put the engine to sleep after this many seconds without requests; the next request wakes it "
        "(it waits, it is not refused). None: sleep only to let a model that shares the GPU run (share_with).",
    )
    level: Literal[1, 2] = Field(
        1,
        description="vLLM's sleep level. 1: weights to CPU memory, KV cache freed (wake: a copy back, seconds). "
        "2: weights and KV cache freed (wake: the weights are loaded again from the checkpoint).",
    )
    min_awake_s: float = Field(
        5.0,
        ge=0,
        description="share_with: once awake, a model keeps the GPU at least this long while it has requests; then, "
        "if another model of its group waits, it takes no new requests, lets its running ones finish (never "
        "mid-stream) and sleeps. Requests wait in arrival order, so no model starves.",
    )


class DeploymentOptions(Strict):
    """Ray Serve options of one model's engine deployment."""

    num_replicas: int = Field(1, ge=0, description="Fixed replica count (ignored when autoscaling_config is set).")
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...). "
        "Defaults (app/config/autoscaling.py): min_replicas 1 (0 allowed: cold start), max_replicas = min_replicas, "
        "target_ongoing_requests = ceil(0.75 × max_num_seqs) capped at max_ongoing_requests. "
        "`policy: {ttft_p90_ms, tpot_p90_ms}` scales on the latency vLLM measured instead.",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests one replica takes at once. Default: the engine's max_num_seqs "
        "(Serve's 5 would throttle it).",
    )
    max_queued_requests: int = Field(
        -1, ge=-1, description="Requests queued per caller before Serve rejects them; -1 = no bound."
    )
    overload_status_code: Literal[429, 503] = Field(
        503,
        description="HTTP status of a request rejected because max_queued_requests is full "
        "(OpenAI clients retry both).",
    )
    retry_after_s: float = Field(1.0, ge=0, description="`Retry-After` seconds sent with an overload rejection.")
    num_cpus: float | None = Field(None, ge=0, description="CPUs of the replica actor. Default: 1 on GPU, 0.5 on CPU.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve asks the engine whether it is alive.")
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="How long a health check may take before the replica is replaced."
    )
    graceful_shutdown_timeout_s: float = Field(
        20.0, ge=0, description="Time given to running requests when a replica stops."
    )
    max_start_attempts: int = Field(
        3,
        ge=1,
        description="Replica starts that may fail (across the model's replicas) before Serve fails the application "
        "instead of starting another (Serve's max_constructor_retry_count; it applies until a replica has started). "
        "Summit's control plane (`summit wait-ready`, `serve-local`, the SLURM job) does not wait for them when the "
        "engine's own error says another attempt would fail the same way (a missing checkpoint, a KV cache too small "
        "for max_model_len): it stops at the first, with that error.",
    )
    sleep: SleepOptions | None = Field(
        None,
        description="vLLM sleep mode: the engine sleeps when idle (after_idle_s) or while a model sharing its GPU "
        "runs (share_with), and wakes for the next request (docs/features/sleep-mode.md).",
    )


class RoutingOptions(Strict):
    """How the ingress picks one of a model's replicas (decisions in deployments/routing/policies.py, Serve routers
    in deployments/routing/routers.py)."""

    policy: Literal["least_load", "prefix_affinity", "session_affinity", "kv_cache"] = Field(
        "least_load",
        description="least_load: Serve's power-of-two choices; prefix_affinity: same leading prompt block → same "
        "replica (vLLM prefix-cache hits) unless overloaded; session_affinity: same `x-session-id` header (or `user`) "
        "→ same replica while it lives; kv_cache: the replica whose engine holds the longest cached prefix of the "
        "request's tokens (from vLLM's KV events) unless overloaded.",
    )
    prefix_chars: int = Field(
        1024,
        ge=16,
        description="prefix_affinity: characters of the prompt's leading block (stand-in for tokens: ≈ 4 per token; "
        "cover at least one vLLM KV block, 128 tokens on CPU / 16 on GPU). Shorter prompts are routed by load.",
    )
    imbalance: int = Field(
        8,
        ge=0,
        description="prefix_affinity, kv_cache: ongoing requests a prefix's replica may have above the least-loaded "
        "one before the prefix moves.",
    )
    cpu_block_credit: float = Field(
        0.5,
        ge=0,
        le=1,
        description="kv_cache: what a cached block held only in an offload tier (CPU memory) counts, against 1 for "
        "one in GPU memory.",
    )
    load_cost_tokens: int = Field(
        48,
        ge=0,
        description="kv_cache: what one ongoing request costs a replica, in tokens of cached prefix: a replica holding "
        "that many more of the prompt's tokens than another stays preferred for each request it has above it "
        "(within imbalance). 0: the replica holding the most, whatever its load within imbalance.",
    )
    claim_s: float = Field(
        10.0,
        ge=0,
        description="kv_cache: how long the replica chosen for a request counts as holding the request's blocks before "
        "its engine's KV events say so (the prefill), so that a burst of one new prefix is not spread meanwhile. 0: "
        "only the engines' events count.",
    )
    max_tracked: int = Field(
        100_000,
        ge=1,
        description="Prefixes, sessions or (kv_cache) claimed blocks remembered per ingress replica (least recently "
        "used dropped).",
    )


class IngressOptions(Strict):
    path: Literal["auto", "direct", "hops"] = Field(
        "auto",
        description="Request path. direct: HAProxy sends each request to the replica that owns the engine "
        "(needs RAY_SERVE_ENABLE_HA_PROXY=1 and models of one shape); hops: Serve's proxy -> OpenAIIngress -> model "
        "replica; auto: direct where it can be, else hops (the log says why).",
    )
    num_replicas: int = Field(
        1,
        ge=1,
        description="Replicas of the HTTP ingress deployment (of the ingress request router on the direct path).",
    )
    num_cpus: float = Field(0.1, ge=0, description="CPUs of one ingress replica.")
    max_ongoing_requests: int = Field(2048, ge=1, description="Requests one ingress replica handles at once.")


class RateLimitOptions(Strict):
    """Per-key limits (each API key its own), enforced across the application's replicas
    (deployments/pipeline/rate_limit.py)."""

    requests_per_minute: int | None = Field(None, ge=1, description="OpenAI POST requests a key may send a minute.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt (≈ characters / 4) + max_tokens, charged on arrival."
    )
    default_max_tokens: int = Field(
        1024, ge=0, description="What a request without max_tokens is charged for its output."
    )

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimitOptions:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ValueError(
                "auth.rate_limit: give requests_per_minute and/or tokens_per_minute (or remove rate_limit)"
            )
        return self


class AuthOptions(Strict):
    """API keys required on every OpenAI route (`Authorization: Bearer KEY`; `/health` stays open)."""

    api_keys_env: str | None = Field(
        None, description="Environment variable holding the keys (comma-separated), read where the ingress runs."
    )
    api_keys_file: str | None = Field(None, description="File holding the keys, one a line (e.g. a mounted secret).")
    rate_limit: RateLimitOptions | None = Field(
        None, description="Requests and tokens per minute per key (off if absent)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> AuthOptions:
        if (self.api_keys_env is None) == (self.api_keys_file is None):
            raise ValueError("auth: give exactly one of `api_keys_env` (an env var name) or `api_keys_file` (a path)")
        return self


class StreamResumeOptions(Strict):
    """Streams a client can pick up again after its connection dropped (docs/features/stream-resume.md): each event
    of a stream carries an SSE `id:`; a request sent again with `Last-Event-ID` gets the events after it, then the
    live rest. The engine goes on while the client is away."""

    window_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How long a stream waits for its client to come back (the engine goes on meanwhile; past it, the "
        "request is aborted), and how long an ended stream stays resumable.",
    )
    max_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        description="The streams' events one front process keeps, in bytes: the oldest ended streams go first; a "
        "stream that would pass it while live can no longer be resumed (410).",
    )
