"""vLLM's KV connectors for prefill/decode disaggregation and for streams that carry their KV cache when they move:
which exist, what one needs, each side's `kv_transfer_config` and the engine settings a side needs for its
connector."""

from __future__ import annotations

import dataclasses
from typing import Any

from deployments.engine.args import vllm_version

# Summit's short names for vLLM's KV connectors (any other name vLLM registers is taken as it is).
CONNECTOR_ALIASES = {
    "shared_storage": "ExampleConnector",
    "nixl": "NixlConnector",
    "lmcache": "LMCacheConnectorV1",
    "mooncake": "MooncakeConnector",
}


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
        raise ValueError(
            f"disaggregation.connector: {name!r} is not a KV connector of the installed vLLM "
            f"({vllm_version()}); known: {', '.join(aliases + sorted(known))}"
        )
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


def kv_transfer_config(
    connector: str, role: str, extra: dict[str, Any], buffer_device: str, load_failure: str
) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for one side of a disaggregated model. `role`: "prefill" (produces KV), "decode"
    (consumes it) or "both" (a model whose moving streams carry their KV: every replica does both);
    `load_failure`: "recompute" (a decode that cannot load the KV computes it) or "fail"."""
    from vllm.config import KVTransferConfig

    name = kv_connector(connector)
    # NIXL pairs engines that both hold a transfer agent (vLLM's own examples run it kv_both on each side)
    if name.startswith("Nixl") or role == "both":
        kv_role = "kv_both"
    else:
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    config = {
        "kv_connector": name,
        "kv_role": kv_role,
        "kv_buffer_device": buffer_device,
        "kv_connector_extra_config": dict(extra),
    }
    if "kv_load_failure_policy" in {f.name for f in dataclasses.fields(KVTransferConfig)}:  # newer than some 0.2x lines
        config["kv_load_failure_policy"] = load_failure
    return config


def connector_engine_kwargs(connector: str, role: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine settings one side needs for its connector to work, over the given ones. vLLM's shared-storage example
    connector stores a prompt's KV from the prompt's first scheduled step only: a prefill split into chunks (a long
    prompt, or several arriving at once) stores part of it under the whole prompt's key, and the decode engine that
    loads it dies ("shape mismatch", FACTS). Its prefill side (and an engine that does both) therefore schedules whole
    prompts."""
    if kv_connector(connector) != "ExampleConnector" or role == "decode":
        return {}
    needed: dict[str, Any] = {"enable_chunked_prefill": False}
    limit, budget = engine_kwargs.get("max_model_len"), engine_kwargs.get("max_num_batched_tokens")
    if limit and budget and budget < limit:
        needed["max_num_batched_tokens"] = limit
    return needed


def hand_off_tokens(connector: str, ids: list[int]) -> list[int]:
    """The tokens a moving stream's engine runs to hand its KV off over `connector` (the stream goes on from `ids`).
    vLLM's example (shared-storage) connector stores a prompt of n tokens under its first (n-1)//block*block and
    looks one up under its first (n-2)//block*block: a hand-off of all n is not found when n-1 is a multiple of the
    block, so it hands off the first n-1 (stored under the key the stream's continuation looks up). Any other
    connector: all of them (NIXL gives the blocks of exactly the tokens the continuation has)."""
    return ids[:-1] if kv_connector(connector) == "ExampleConnector" else ids
