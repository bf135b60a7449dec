"""A disaggregated model's prefill and decode sides as vLLM runs them, a model whose moving streams carry their KV
(`kv_migration`: every replica produces and consumes) — the KV connector's settings are vLLM's, asked through
`deployments.engine` — and whether this machine's vLLM can run the connector."""

from __future__ import annotations

from typing import Literal

from app.config import ModelConfig
from deployments import engine


def pd_side(model: ModelConfig, role: Literal["prefill", "decode"]) -> ModelConfig:
    """The model as one side of its disaggregation runs it: that side's parallelism, deployment, routing and engine
    settings over the model's (`ModelConfig.side_config`), and vLLM's kv_transfer_config for that side (no further
    validation: the model's own is done)."""
    pd = model.disaggregation
    extra = dict(pd.connector_config)
    if pd.connector == "shared_storage":
        extra.setdefault("shared_storage_path", f"/tmp/summit-kv/{model.name}")
    kv = engine.kv_transfer_config(
        pd.connector,
        role,
        extra,
        model.resolved_kv_buffer_device(),
        "recompute" if pd.fallback == "aggregated" else "fail",
    )
    side = model.side_config(role)
    engine_kwargs = dict(side.engine_kwargs)
    engine_kwargs.update(engine.connector_engine_kwargs(pd.connector, role, engine_kwargs), kv_transfer_config=kv)
    return side.model_copy(update={"engine_kwargs": engine_kwargs})


def kv_migrating(model: ModelConfig) -> ModelConfig:
    """The model as its replicas run it: with `kv_migration`, every engine runs the connector both ways (the replica
    a stream leaves keeps its KV for the one that goes on with it)."""
    kv = model.kv_migration
    if kv is None:
        return model
    extra = dict(kv.connector_config)
    if kv.connector == "shared_storage":
        extra.setdefault("shared_storage_path", f"/tmp/summit-kv/{model.name}-migration")
    config = engine.kv_transfer_config(kv.connector, "both", extra, model.resolved_kv_buffer_device(), "recompute")
    engine_kwargs = dict(model.engine_kwargs)
    engine_kwargs.update(engine.connector_engine_kwargs(kv.connector, "both", engine_kwargs), kv_transfer_config=config)
    return model.model_copy(update={"engine_kwargs": engine_kwargs})


def disaggregation_problem(model: ModelConfig) -> str | None:
    """Why this machine's vLLM cannot run the model's KV connector (a package missing), or None. Asked where the
    app is built (the engines' image), not by `summit validate` on a machine that may lack the package."""
    kv = model.disaggregation or model.kv_migration
    if kv is None:
        return None
    problem = engine.disaggregation_problem(kv.connector)
    key = "disaggregation" if model.disaggregation else "kv_migration"
    return problem and f"model {model.name!r}: {key}.connector: {problem}"
