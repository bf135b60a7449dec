"""The deployment options that pick Summit's request router for an engine deployment (and its kwargs): one model's
policy (`request_router_options`) or several models' (`pool_router_options`); the routers are in routers.py."""

from __future__ import annotations

from typing import Any

from deployments.routing.routers import (
    _POLICIES,
    KVCacheRouter,
    ModelPolicyRouter,
    PrefixAffinityRouter,
    SessionAffinityRouter,
    _OnePolicyRouter,
)

_ROUTERS: dict[str, tuple[type[_OnePolicyRouter], set[str]]] = {
    "least_load": (_OnePolicyRouter, {"max_tracked"}),  # Serve's own router on a one-model deployment
    "prefix_affinity": (PrefixAffinityRouter, {"prefix_chars", "imbalance", "max_tracked"}),
    "session_affinity": (SessionAffinityRouter, {"max_tracked"}),
    "kv_cache": (
        KVCacheRouter,
        {"imbalance", "max_tracked", "tokenizer", "chat_template", "cpu_block_credit", "load_cost_tokens", "claim_s"},
    ),
}
_ALL_KWARGS = set().union(*(accepted for _, accepted in _ROUTERS.values()))


# How often a replica's routing stats (the model it serves) reach the routers, where a deployment hosts several models.
MODEL_STATS_PERIOD_S = 1.0


def _policy_kwargs(policy: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = set(kwargs) - _ALL_KWARGS
    if unknown:
        raise ValueError(
            f"unknown routing option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(_ALL_KWARGS))}"
        )
    if policy not in _ROUTERS:
        raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(_ROUTERS)}")
    return {k: v for k, v in kwargs.items() if k in _ROUTERS[policy][1]}


def request_router_options(policy: str, **kwargs: Any) -> dict[str, Any]:
    """Deployment options selecting `policy`'s router for a deployment of one model:
    `{"request_router_config": {"request_router_class": "<module>.<Class>", "request_router_kwargs": {...}}}`, or `{}`
    for least_load (Serve's default router).

    Kwargs meant for another policy are dropped (a RoutingOptions model carries them all); unknown ones fail.
    """
    accepted = _policy_kwargs(policy, kwargs)
    if policy == "least_load":
        return {}
    router = _ROUTERS[policy][0]
    return {
        "request_router_config": {
            "request_router_class": f"{router.__module__}.{router.__qualname__}",
            "request_router_kwargs": accepted,
        }
    }


def pool_router_options(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Deployment options of a deployment hosting several models: `ModelPolicyRouter` with each model's policy and
    kwargs (`{model: {"policy": ..., **kwargs}}`), and the replicas' model reported every second."""
    per_model = {}
    for model, options in policies.items():
        options = dict(options)
        policy = options.pop("policy", "least_load")
        per_model[model] = {"policy": policy, **_policy_kwargs(policy, options)}
    return {
        "request_router_config": {
            "request_router_class": f"{ModelPolicyRouter.__module__}.{ModelPolicyRouter.__qualname__}",
            "request_router_kwargs": {"policies": per_model},
            "request_routing_stats_period_s": MODEL_STATS_PERIOD_S,
        }
    }


def make_policy(policy: str, **kwargs: Any):
    """The policy object a router of `policy` decides with (`routers._POLICIES`), from the model's routing options
    (others' dropped as above): what `summit simulate` drives with its simulated replicas (app/simulate/router.py)."""
    accepted = _policy_kwargs(policy, kwargs)
    if policy == "least_load":
        accepted = {}
    return _POLICIES[policy](**accepted)
