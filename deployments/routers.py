"""Ray Serve request routers for Summit's routing policies; the decisions themselves are in `app/routing.py`.

A router lives in the process that holds the deployment handle (each ingress replica has its own), is
chosen per model with the deployment option `request_router_config` (see `request_router_options`) and
gets its kwargs through `initialize_state`. Its affinity tables are local to that process: with several
ingress replicas each learns its own owners, and ties between equally loaded replicas are broken by a
hash of the key so that they mostly agree.

Policies:
- `least_load`: Serve's own `PowerOfTwoChoicesRequestRouter` (the default; no option is set); on a deployment
  hosting several models, `LeastLoadRouter` (the same choice among the request's model's replicas).
- `prefix_affinity`: `PrefixAffinityRouter` — same leading prompt block → same replica, unless overloaded.
- `session_affinity`: `SessionAffinityRouter` — same `x-session-id` (or `user`) → same replica while it lives.

The routers do not use Serve's `FIFOMixin`: it hands the replica chosen for one request to the oldest
pending request, which would send that other request's prefix or session to the wrong replica.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app import routing
from deployments.protocol import HTTPRequest

logger = logging.getLogger("ray.serve")


class _AffinityRouter(RequestRouter):
    """Shared plumbing: read the request's key, gather queue lengths, rank the replica app.routing picks."""

    # Whether only the chosen replica may take a keyed request. When False, the other replicas form a
    # second rank that Serve tries (least loaded first) if the chosen one is full.
    strict = False
    # Queue-length probes per routing decision before a silent replica counts as full.
    probe_attempts = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._table = routing.AffinityTable()
        self._rng = random.Random()

    def initialize_state(self, max_tracked: int = routing.DEFAULT_MAX_TRACKED) -> None:
        self._table = routing.AffinityTable(max_tracked)

    def _key(self, request: HTTPRequest, pending_request: PendingRequest) -> str | None:
        raise NotImplementedError

    def _decide(self, key: str, loads: routing.Loads) -> str:
        raise NotImplementedError

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Without this Serve's retry loop re-asks at once, spinning while every choice is full.
            pending_request.routing_context.should_backoff = True
        request = _http_request(pending_request)
        candidate_replicas = same_model(candidate_replicas, request.model if request else None)
        if not candidate_replicas:  # the model's replicas have not reported yet: Serve asks again after a backoff
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = await self._loads(candidate_replicas)
        key = None if request is None else self._key(request, pending_request)
        chosen = routing.power_of_two(loads, self._rng) if key is None else self._decide(key, loads)
        if key is not None and self.strict:
            return [[by_id[chosen]]]
        return [[by_id[chosen]], [r for rid, r in by_id.items() if rid != chosen]]


    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Ongoing requests per replica from Serve's queue-length cache; stale entries are probed the way
        Serve's own routers do, with the deadline doubling on each retry (0.1 s first: a replica on busy
        cores misses it, and counting it full would pile every request on the others). A replica that
        never answers counts as full."""
        loads: dict[str, int] = {}
        stale = []
        for r in replicas:
            queue_len = self._replica_queue_len_cache.get(r.replica_id)
            if queue_len is None:
                stale.append(r)
            else:
                loads[r.replica_id.unique_id] = queue_len
        for backoff_index in range(self.probe_attempts):
            if not stale:
                break
            answers, stale = await self._probe_queue_lens(stale, backoff_index), []
            for r, queue_len in answers:
                if queue_len is None:
                    stale.append(r)
                else:
                    loads[r.replica_id.unique_id] = queue_len
        for r in stale:
            loads[r.replica_id.unique_id] = r.max_ongoing_requests
        return loads

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        if self._replica_id_set != before:
            self._table.forget_replicas(rid.unique_id for rid in self._replica_id_set)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.forget_replicas(rid.unique_id for rid in self._replica_id_set)


def _http_request(pending_request: PendingRequest | None) -> HTTPRequest | None:
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if isinstance(a, HTTPRequest)), None)


def same_model(replicas: list[RunningReplica], model: str | None) -> list[RunningReplica]:
    """The replicas serving `model`, where a deployment hosts several models (each replica reports its own in
    `record_routing_stats`); all of them when the request names none or the deployment hosts one model."""
    if model is None or not any(r.routing_stats.get("model") for r in replicas):
        return replicas
    return [r for r in replicas if r.routing_stats.get("model") == model]


class LeastLoadRouter(_AffinityRouter):
    """Power of two choices among the request's model's replicas (Serve's own router knows nothing of models)."""

    def _key(self, request: HTTPRequest, pending_request: PendingRequest) -> str | None:
        return None


class PrefixAffinityRouter(_AffinityRouter):
    """Requests whose prompts share a leading block go to the replica that holds that prefix in its KV cache."""

    _prefix_chars = routing.DEFAULT_PREFIX_CHARS
    _imbalance = routing.DEFAULT_IMBALANCE

    def initialize_state(
        self,
        prefix_chars: int = routing.DEFAULT_PREFIX_CHARS,
        imbalance: int = routing.DEFAULT_IMBALANCE,
        max_tracked: int = routing.DEFAULT_MAX_TRACKED,
    ) -> None:
        super().initialize_state(max_tracked)
        self._prefix_chars = prefix_chars
        self._imbalance = imbalance
        logger.info("PrefixAffinityRouter for %s: prefix_chars=%d imbalance=%d", self._deployment_id, prefix_chars, imbalance)

    def _key(self, request: HTTPRequest, pending_request: PendingRequest) -> str | None:
        return routing.prefix_key(routing.request_body(request.body), self._prefix_chars)

    def _decide(self, key: str, loads: routing.Loads) -> str:
        return routing.prefix_affinity(self._table, key, loads, self._imbalance)


class SessionAffinityRouter(_AffinityRouter):
    """A session (`x-session-id` header, else Serve's session id, else `user`) stays on one replica while it lives."""

    # A session waits for its replica rather than breaking; Serve's backpressure bounds the wait.
    strict = True

    def _key(self, request: HTTPRequest, pending_request: PendingRequest) -> str | None:
        session_id = pending_request.metadata.session_id
        # The header is enough most of the time: parse the body only when it is missing.
        return routing.session_key(None, request.headers, session_id) or routing.session_key(routing.request_body(request.body), [])

    def _decide(self, key: str, loads: routing.Loads) -> str:
        return routing.session_affinity(self._table, key, loads)


_ROUTERS: dict[str, tuple[type[_AffinityRouter], set[str]]] = {
    "least_load": (LeastLoadRouter, {"max_tracked"}),
    "prefix_affinity": (PrefixAffinityRouter, {"prefix_chars", "imbalance", "max_tracked"}),
    "session_affinity": (SessionAffinityRouter, {"max_tracked"}),
}
_ALL_KWARGS = set().union(*(accepted for _, accepted in _ROUTERS.values()))


# How often a replica's routing stats (the model it serves) reach the routers, where a deployment hosts several models.
MODEL_STATS_PERIOD_S = 1.0


def request_router_options(policy: str, *, models_per_deployment: int = 1, **kwargs: Any) -> dict[str, Any]:
    """Deployment options selecting `policy`'s router:
    `{"request_router_config": {"request_router_class": "<module>.<Class>", "request_router_kwargs": {...}}}`, or `{}`
    for least_load on a one-model deployment (Serve's default router). A deployment hosting several models always
    gets a Summit router (it keeps each request to its model's replicas) and the replicas' model every second.

    Kwargs meant for another policy are dropped (a RoutingOptions model carries them all); unknown ones fail.
    """
    unknown = set(kwargs) - _ALL_KWARGS
    if unknown:
        raise ValueError(f"unknown routing option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(_ALL_KWARGS))}")
    if policy not in _ROUTERS:
        raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(_ROUTERS)}")
    if policy == "least_load" and models_per_deployment == 1:
        return {}
    router, accepted = _ROUTERS[policy]
    config: dict[str, Any] = {
        "request_router_class": f"{router.__module__}.{router.__qualname__}",
        "request_router_kwargs": {k: v for k, v in kwargs.items() if k in accepted},
    }
    if models_per_deployment > 1:
        config["request_routing_stats_period_s"] = MODEL_STATS_PERIOD_S
    return {"request_router_config": config}
