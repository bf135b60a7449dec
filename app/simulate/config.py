"""From a Serve YAML (and a measured profile) to the model `summit simulate` runs: the model's routing policy and
options, replicas or autoscaling (as Summit builds Serve's autoscaling_config), `max_ongoing_requests`, batch limits
and the KV cache one replica holds (`summit validate`'s figure on the GPU named, or `kv_cache_memory_bytes`)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from app.build import options as deployment_options
from app.plan.validate import kv_cache_tokens, summit_applications
from app.simulate.profile import StepProfile
from app.simulate.sim import SimModel


def sim_model(
    config_path: str | Path,
    profile: StepProfile,
    model: str | None = None,
    gpu: str | None = None,
    policy: str | None = None,
    replicas: int | None = None,
) -> SimModel:
    """The YAML's model `model` (the first if None); `policy` / `replicas` override the YAML's."""
    doc = yaml.safe_load(Path(config_path).read_text())
    models = [m for _, config in summit_applications(doc) for m in config.models]
    if not models:
        raise ValueError(f"{config_path}: no Summit application (import_path app.build:build_app) with models")
    chosen = next((m for m in models if model in (None, m.name)), None)
    if chosen is None:
        raise ValueError(f"--model {model!r}: the YAML's models are {', '.join(m.name for m in models)}")
    ek = chosen.engine_kwargs
    routing = {
        k: v for k, v in deployment_options.routing_kwargs(chosen).items() if k not in ("tokenizer", "chat_template")
    }
    name = policy or routing.pop("policy", "least_load")
    routing.pop("policy", None)
    auto = None if replicas is not None else chosen.serve_autoscaling_config()
    kv_tokens = profile.kv_tokens
    if chosen.accelerator == "gpu" and gpu is not None:
        kv_tokens = kv_cache_tokens(chosen, gpu, dict(os.environ))
    elif ek.get("kv_cache_memory_bytes") and profile.kv_tokens is None:
        raise ValueError("a CPU model's KV capacity comes from the profile (kv_tokens)")
    if not kv_tokens:
        raise ValueError("the KV cache's size is unknown: give --gpu (a GPU model) or a profile with kv_tokens")
    return SimModel(
        name=chosen.name,
        policy=name,
        routing=routing,
        replicas=replicas or (deployment_options.initial_replicas(chosen) if auto else chosen.deployment.num_replicas),
        autoscaling=auto,
        max_ongoing_requests=chosen.max_ongoing_requests,
        kv_tokens=int(kv_tokens),
        block_size=profile.block_size,
        max_num_seqs=chosen.max_num_seqs,
        max_num_batched_tokens=ek.get("max_num_batched_tokens") or profile.max_num_batched_tokens,
        max_model_len=ek.get("max_model_len") or 8192,
        sleep_after_idle_s=chosen.deployment.sleep.after_idle_s if chosen.deployment.sleep else None,
    )
