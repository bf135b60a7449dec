"""Ray Serve request routers for Summit's routing policies; the decisions themselves are in
`deployments/routing/policies.py`.

A router lives in the process that holds the deployment handle (each ingress replica has its own), is
chosen per model with the deployment option `request_router_config` (see `request_router_options`) and
gets its kwargs through `initialize_state`. Its affinity tables are local to that process: with several
ingress replicas each learns its own owners, and ties between equally loaded replicas are broken by a
hash of the key so that they mostly agree.

Policies (one deployment per model: its router; several models in one deployment, the direct path's pool:
`ModelPolicyRouter`, which keeps each request to its model's replicas and applies that model's policy):
- `least_load`: Serve's own `PowerOfTwoChoicesRequestRouter` (the default; no option is set).
- `prefix_affinity`: `PrefixAffinityRouter` — same leading prompt block → same replica, unless overloaded.
- `session_affinity`: `SessionAffinityRouter` — same `x-session-id` (or `user`) → same replica while it lives.
- `kv_cache`: `KVCacheRouter` — to the replica whose engine holds the longest cached prefix of the request's tokens
  (vLLM's KV events, `kv_blocks.py`), unless overloaded; a LoRA adapter's blocks are its own.

The routers do not use Serve's `FIFOMixin`: it hands the replica chosen for one request to the oldest
pending request, which would send that other request's prefix or session to the wrong replica.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.http.protocol import AVOID_HEADER, TARGET_HEADER, HTTPRequest
from deployments.observability import metrics
from deployments.observability.tracing import DECISION_HEADER, decision_value
from deployments.routing import policies as routing
from deployments.routing.kv_policy import KVCachePolicy

logger = logging.getLogger("ray.serve")
ASLEEP_LOAD = 4  # ongoing requests a sleeping replica (deployment.sleep) counts as beyond its own


class _Policy:
    """One model's routing decision: the request's affinity key (None: least load) and the replica for a key."""

    # Whether only the chosen replica may take a keyed request. When False, the other replicas form a
    # second rank that Serve tries (least loaded first) if the chosen one is full.
    strict = False
    name = "least_load"

    def __init__(self, max_tracked: int = routing.DEFAULT_MAX_TRACKED):
        self.table = routing.AffinityTable(max_tracked)

    def key(self, request: HTTPRequest, pending_request: PendingRequest) -> str | None:
        return None

    def forget_replicas(self, alive: list[str]) -> None:
        self.table.forget_replicas(alive)

    def decide(self, key: str, loads: routing.Loads) -> str:
        raise NotImplementedError

    def decide_why(self, key: str | None, loads: routing.Loads, rng: random.Random) -> tuple[str, str]:
        """(replica, outcome): `least_load` without a key; else `new` (a key not seen), `hit` (its owner) or
        `spill` (a replica other than its owner, which is overloaded or gone)."""
        if key is None:
            return routing.power_of_two(loads, rng), "least_load"
        owner = self.table.peek(key)
        chosen = self.decide(key, loads)
        return chosen, "new" if owner is None else "hit" if chosen == owner else "spill"


class _LeastLoad(_Policy):
    """Power of two choices (every request has no key)."""


class _PrefixAffinity(_Policy):
    """Requests whose prompts share a leading block go to the replica that holds that prefix in its KV cache."""

    name = "prefix_affinity"

    def __init__(
        self,
        prefix_chars: int = routing.DEFAULT_PREFIX_CHARS,
        imbalance: int = routing.DEFAULT_IMBALANCE,
        max_tracked: int = routing.DEFAULT_MAX_TRACKED,
    ):
        super().__init__(max_tracked)
        self.prefix_chars, self.imbalance = prefix_chars, imbalance

    def key(self, request: HTTPRequest, pending_request: PendingRequest) -> str | None:
        return routing.prefix_key(routing.request_body(request.body), self.prefix_chars)

    def decide(self, key: str, loads: routing.Loads) -> str:
        return routing.prefix_affinity(self.table, key, loads, self.imbalance)


class _SessionAffinity(_Policy):
    """A session (`x-session-id` header, else Serve's session id, else `user`) stays on one replica while it lives."""

    # A session waits for its replica rather than breaking; Serve's backpressure bounds the wait.
    strict = True
    name = "session_affinity"

    def key(self, request: HTTPRequest, pending_request: PendingRequest) -> str | None:
        session_id = pending_request.metadata.session_id
        # The header is enough most of the time: parse the body only when it is missing.
        return routing.session_key(None, request.headers, session_id) or routing.session_key(
            routing.request_body(request.body), []
        )

    def decide(self, key: str, loads: routing.Loads) -> str:
        return routing.session_affinity(self.table, key, loads)


class _AdapterAffinity:
    """A LoRA adapter's requests go to a replica that has it loaded (each replica reports its loaded adapters every
    MODEL_STATS_PERIOD_S; a replica chosen for an adapter counts as having it for HOLD_S meanwhile; an adapter loaded
    at run time is held by its home, which every replica's report names), unless that one is `imbalance` requests
    busier than the least-loaded replica, which then loads it too."""

    name = "adapter_affinity"
    strict = False
    HOLD_S = 10.0

    def __init__(self, imbalance: int = routing.DEFAULT_IMBALANCE):
        self.imbalance = imbalance
        self._chosen: dict[tuple[str, str], float] = {}  # (adapter, replica) -> when it was last sent there

    def decide(self, adapter: str, loads: routing.Loads, replicas: list[RunningReplica]) -> tuple[str, str]:
        now = time.monotonic()
        self._chosen = {k: t for k, t in self._chosen.items() if now - t < self.HOLD_S}
        holders = {r.replica_id.unique_id for r in replicas if adapter in r.routing_stats.get("loaded", ())}
        holders |= homes_of(adapter, replicas)
        holders |= {rid for (name, rid), _ in self._chosen.items() if name == adapter}
        chosen, outcome = routing.adapter_affinity(adapter, loads, holders, self.imbalance)
        self._chosen[(adapter, chosen)] = now
        return chosen, outcome


_POLICIES: dict[str, type] = {
    "least_load": _LeastLoad,
    "prefix_affinity": _PrefixAffinity,
    "session_affinity": _SessionAffinity,
    "kv_cache": KVCachePolicy,
}


class _SummitRouter(RequestRouter):
    """Shared plumbing: keep to the request's model, gather queue lengths, rank the replica its policy picks."""

    # Queue-length probes per routing decision before a silent replica counts as full.
    probe_attempts = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._policies: dict[str | None, _Policy] = {None: _LeastLoad()}
        self._adapters = _AdapterAffinity()
        self._rng = random.Random()

    def _policy(self, model: str | None) -> _Policy:
        return self._policies.get(model) or self._policies[None]

    def _serves_no_such_model(self, model: str | None, replicas: list[RunningReplica]) -> bool:
        """Whether `model` is a name no model of this deployment has (its policies are keyed by its models' names),
        where no replica has LoRA adapters (one loaded at run time reaches the routers' stats a second later)."""
        return (
            model is not None
            and len(self._policies) > 1
            and model not in self._policies
            and not any("adapters" in r.routing_stats for r in replicas)
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Without this Serve's retry loop re-asks at once, spinning while every choice is full.
            pending_request.routing_context.should_backoff = True
        request = _http_request(pending_request)
        if pinned := _pinned(request, candidate_replicas):
            return [pinned]
        model = request.model if request else None
        candidate_replicas = self._serving(request, model, candidate_replicas)
        if not candidate_replicas:
            return []  # the model's replicas have not reported yet: Serve asks again after a backoff
        policy = self._policy(model)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = await self._loads(candidate_replicas, ASLEEP_LOAD if request is not None else 0)  # probes: by load
        started = time.time()
        if model is not None and any(model in r.routing_stats.get("adapters", ()) for r in candidate_replicas):
            # a LoRA adapter: by its own cached blocks where its model routes by KV cache, else to a replica that has
            # it loaded
            key, base = model, self._policy(_base_model(model, candidate_replicas))
            found = None
            if isinstance(base, KVCachePolicy):
                found = await base.route(request, loads, self._rng, candidate_replicas, lora=model, model=model)
            if found is not None and found[1] != "new":
                policy, (chosen, outcome, _) = base, found
            else:
                policy = self._adapters
                chosen, outcome = policy.decide(model, loads, candidate_replicas)
            if found is not None:
                base.claim(found[2], chosen)
        elif isinstance(policy, KVCachePolicy):
            found = await policy.route(request, loads, self._rng, candidate_replicas, model=model)
            key = None
            if found is None:
                chosen, outcome = routing.power_of_two(loads, self._rng), "least_load"
            else:
                (chosen, outcome, hashes) = found
                policy.claim(hashes, chosen)
        else:
            key = None if request is None else policy.key(request, pending_request)
            chosen, outcome = policy.decide_why(key, loads, self._rng)
        metrics.routing_decision(model, policy.name, outcome)
        if request is not None:  # the replica's trace tells it (deployments/observability/tracing.py)
            request.set_header(
                DECISION_HEADER, decision_value(policy.name, outcome, chosen, started, time.time()).encode()
            )
        if key is not None and policy.strict:
            return [[by_id[chosen]]]
        return [[by_id[chosen]], [r for rid, r in by_id.items() if rid != chosen]]

    def _serving(
        self, request: HTTPRequest | None, model: str | None, replicas: list[RunningReplica]
    ) -> list[RunningReplica]:
        """The replicas that may take the request: its model's (none: they have not reported yet), but not the one
        a resumed stream's engine died on."""
        serving = same_model(replicas, model)
        if not serving and self._serves_no_such_model(model, replicas):
            # a name no model of this deployment has: any replica's front answers the 404 (waiting for its replicas
            # took the direct path's route picker its 3 s, and HAProxy's 5 s ran out on a loaded box: a plain 503)
            serving = replicas
        avoid = request.header(AVOID_HEADER) if request else None  # a resumed stream's dead replica
        if avoid and len(serving) > 1:
            serving = [r for r in serving if r.replica_id.unique_id != avoid.decode()] or serving
        return serving

    async def _loads(self, replicas: list[RunningReplica], asleep_load: int = 0) -> dict[str, int]:
        """Ongoing requests per replica from Serve's queue-length cache; stale entries are probed the way
        Serve's own routers do, with the deadline doubling on each retry (0.1 s first: a replica on busy
        cores misses it, and counting it full would pile every request on the others). A replica that
        never answers counts as full. A sleeping replica counts `asleep_load` more."""
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
        for r in replicas if asleep_load else ():  # a sleeping engine answers after its wake: busier than an awake one
            if r.routing_stats.get("asleep"):
                loads[r.replica_id.unique_id] += asleep_load
        return loads

    def _forget_gone_replicas(self) -> None:
        alive = [rid.unique_id for rid in self._replica_id_set]
        for policy in self._policies.values():
            policy.forget_replicas(alive)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """The pending request with these very metadata gets the replica. Serve's base finds it by its internal
        request id, which every handle call made inside one Serve request shares (a batch group's calls to a prefill
        pool): it indexes only the first of them, and the others were never fulfilled (a batch line hung)."""
        for pending in self._pending_requests_to_fulfill if request_metadata is not None else ():
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                if self._pending_requests_by_id.get(request_metadata.internal_request_id) is pending:
                    self._remove_pending_request_from_indices(pending)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        if self._replica_id_set != before:
            self._forget_gone_replicas()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_gone_replicas()


def _http_request(pending_request: PendingRequest | None) -> HTTPRequest | None:
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if isinstance(a, HTTPRequest)), None)


def _pinned(request: HTTPRequest | None, replicas: list[RunningReplica]) -> list[RunningReplica]:
    """The replica a request must go to while it lives: the one keeping the stored response it names
    (deployments/http/response_ids.py)."""
    target = request.header(TARGET_HEADER) if request else None
    pinned = [r for r in replicas if target and r.replica_id.unique_id == target.decode()]
    if pinned:
        metrics.routing_decision(request.model, "stored_response", "hit")
    return pinned


def _base_model(adapter: str, replicas: list[RunningReplica]) -> str | None:
    """The model whose replicas serve LoRA adapter `adapter`."""
    serving = (r for r in replicas if adapter in r.routing_stats.get("adapters", ()))
    return next((r.routing_stats.get("model") for r in serving), None)


def homes_of(adapter: str, replicas: list[RunningReplica]) -> set[str]:
    """The replica that loaded LoRA adapter `adapter` at run time, as any replica's routing stats name it."""
    return {home for r in replicas if (home := r.routing_stats.get("homes", {}).get(adapter))}


def same_model(replicas: list[RunningReplica], model: str | None) -> list[RunningReplica]:
    """The replicas serving `model` (or the model a LoRA adapter `model` belongs to), where a deployment hosts several
    models (each replica reports its own and its adapters in `record_routing_stats`, and the home of each adapter
    loaded at run time); all of them when the request names none or the replicas report nothing."""
    if model is None or not any(r.routing_stats.get("model") for r in replicas):
        return replicas
    homes = homes_of(model, replicas)
    return [
        r
        for r in replicas
        if r.routing_stats.get("model") == model
        or model in r.routing_stats.get("adapters", ())
        or (homes and r.replica_id.unique_id in homes)  # an adapter's home, whose own report has not told it yet
    ]


class _OnePolicyRouter(_SummitRouter):
    """Every request of the deployment by one policy (its kwargs from `request_router_kwargs`)."""

    policy: type[_Policy] = _LeastLoad

    def initialize_state(self, **kwargs: Any) -> None:
        self._policies = {None: self.policy(**kwargs)}
        if kwargs:
            logger.info("%s for %s: %s", type(self).__name__, self._deployment_id, kwargs)


class PrefixAffinityRouter(_OnePolicyRouter):
    """Requests whose prompts share a leading block go to the replica that holds that prefix in its KV cache."""

    name = "prefix_affinity"

    policy = _PrefixAffinity


class SessionAffinityRouter(_OnePolicyRouter):
    """A session (`x-session-id` header, else Serve's session id, else `user`) stays on one replica while it lives."""

    policy = _SessionAffinity


class KVCacheRouter(_OnePolicyRouter):
    """To the replica whose engine holds the longest cached prefix of the request's tokens, unless overloaded."""

    policy = KVCachePolicy


class ModelPolicyRouter(_SummitRouter):
    """A deployment hosting several models (the direct path's pool): each model's requests keep to its replicas and
    go by that model's own policy, e.g. one model prefix_affinity, another session_affinity."""

    def initialize_state(self, policies: dict[str, dict[str, Any]] | None = None) -> None:
        self._policies = {None: _LeastLoad()}
        for model, options in (policies or {}).items():
            options = dict(options)
            self._policies[model] = _POLICIES[options.pop("policy")](**options)
        logger.info("ModelPolicyRouter for %s: %s", self._deployment_id, policies)
