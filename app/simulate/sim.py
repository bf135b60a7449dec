"""`summit simulate`'s discrete-event simulation (simpy): replicas that each run a simulated vLLM engine
(app/simulate/engine.py) with step times from a measured profile, Summit's own router deciding where each request
goes (app/simulate/router.py), Serve's handle queue when every replica holds `max_ongoing_requests`, and Serve's own
autoscaling decisions every control period (app/simulate/autoscale.py), with replicas that take `start_s` to start.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import simpy

from app.simulate.autoscale import SimAutoscaler
from app.simulate.engine import SimEngine, SimRequest
from app.simulate.profile import StepProfile
from app.simulate.router import ReplicaIndex, SimRouter
from deployments.routing.routers import ASLEEP_LOAD


@dataclass
class SimModel:
    """One model as the simulation runs it (from the Serve YAML, app/simulate/config.py)."""

    name: str
    policy: str = "least_load"
    routing: dict[str, Any] = field(default_factory=dict)
    replicas: int = 1
    autoscaling: dict[str, Any] | None = None  # Serve's autoscaling_config (Summit's form), None: fixed count
    max_ongoing_requests: int = 256
    kv_tokens: int = 65536
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    sleep_after_idle_s: float | None = None  # deployment.sleep.after_idle_s: an idle engine sleeps, a request wakes it
    path_s: float = 0.0  # the serving path's own time a request (HTTP, tokenizing, routing): before its engine sees it


class Replica:
    def __init__(self, sim: Simulation, rid: str, ready_at: float):
        self.sim, self.rid, self.ready_at = sim, rid, ready_at
        m = sim.model
        self.index = ReplicaIndex(m.kv_tokens // m.block_size)
        # the engine's KV events feed the runtime's index only where a policy reads it (kv_cache): the index costs
        # a dictionary entry and a log record a block, which 64 replicas of long prompts feel
        events = self.index.events if m.policy == "kv_cache" else None
        self.engine = SimEngine(
            m.kv_tokens // m.block_size, m.block_size, m.max_num_seqs, m.max_num_batched_tokens, events
        )
        self.state = "starting"
        self.asleep = False  # vLLM sleep mode: it wakes (the profile's wake_s) for the next request
        self.wakes = 0
        self.wakeup = sim.env.event()
        self.in_run = False
        self.observed: deque[tuple[float, float, float]] = deque()  # (time, engine TTFT ms, TPOT ms)
        self.process = sim.env.process(self._loop())

    def add(self, req: SimRequest) -> None:
        req.replica = self.rid
        req.engine_arrival = self.sim.env.now
        self.engine.add(req)
        if self.in_run:
            self.process.interrupt()
        elif not self.wakeup.triggered:
            self.wakeup.succeed()

    def _loop(self):
        env, profile = self.sim.env, self.sim.profile
        yield env.timeout(max(0.0, self.ready_at - env.now))
        if self.state == "starting":
            self.state = "running"
            self.sim.dispatch()
        while self.state != "removed":
            k = self.engine.decode_run_length()
            if k:
                step_s = profile.step_s(0, len(self.engine.running), self.engine.context_tokens())
                start = env.now
                self.in_run = True
                try:
                    yield env.timeout(k * step_s)
                except simpy.Interrupt:  # a new request: it joins at the end of the step under way
                    self.in_run = False
                    k = min(k, math.floor((env.now - start) / step_s) + 1)
                    yield env.timeout(max(0.0, start + k * step_s - env.now))
                self.in_run = False
                self._done(self.engine.decode_run(k, start, step_s))
                continue
            step = self.engine.allocate(self.engine.plan())
            if not step.decodes and not step.prefills:
                if self.state == "draining" and self.engine.idle():
                    self.state = "removed"
                    break
                self.wakeup = env.event()
                sleep_after = self.sim.model.sleep_after_idle_s
                if sleep_after is not None and not self.asleep and self.state == "running":
                    yield self.wakeup | env.timeout(sleep_after)
                    if not self.wakeup.triggered:
                        self.asleep = True
                        continue
                else:
                    yield self.wakeup
                if self.asleep:
                    yield env.timeout(profile.wake_s)
                    self.asleep = False
                    self.wakes += 1
                continue
            yield env.timeout(profile.step_s(step.prefill_tokens, len(step.decodes), self.engine.context_tokens()))
            self._done(self.engine.apply(step, env.now))

    def _done(self, finished: list[SimRequest]) -> None:
        now = self.sim.env.now
        for r in finished:
            ttft = (r.first_token_at - r.engine_arrival) * 1000
            tpot = (r.finished_at - r.first_token_at) * 1000 / max(1, r.output_len - 1)
            self.observed.append((now, ttft, tpot))
        if finished:
            self.sim.finished(finished)

    def p90s(self, since: float) -> tuple[float, float]:
        while self.observed and self.observed[0][0] < since:
            self.observed.popleft()
        if not self.observed:
            return 0.0, 0.0
        return _p90([o[1] for o in self.observed]), _p90([o[2] for o in self.observed])


def _p90(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


class Simulation:
    def __init__(self, model: SimModel, profile: StepProfile, seed: int = 0, control_s: float = 1.0):
        self.env = simpy.Environment()
        self.model, self.profile, self.control_s = model, profile, control_s
        self.router = SimRouter(model.policy, model.routing, model.block_size, lambda: self.env.now, seed)
        self.replicas: dict[str, Replica] = {}
        self._next_id = 0
        self.queue: deque[SimRequest] = deque()  # Serve's handle queue: every replica at max_ongoing_requests
        self.done: list[SimRequest] = []
        self.timeline: list[dict] = []
        self._waiters: dict[int, simpy.Event] = {}
        self.rejected: list[SimRequest] = []  # longer than max_model_len
        self.target = model.replicas
        self._controlled = False
        for _ in range(model.replicas):
            self._start(ready_at=0.0)
        self.autoscaler = SimAutoscaler(model.autoscaling) if model.autoscaling else None

    def _start(self, ready_at: float) -> Replica:
        rid = f"r{self._next_id}"
        self._next_id += 1
        self.replicas[rid] = Replica(self, rid, ready_at)
        return self.replicas[rid]

    def routable(self) -> dict[str, int]:
        """The loads Summit's router sees: ongoing requests, a sleeping replica `ASLEEP_LOAD` more (as
        deployments/routing/routers.py counts it); replicas at `max_ongoing_requests` are not offered."""
        cap = self.model.max_ongoing_requests
        return {
            rid: r.engine.ongoing + (ASLEEP_LOAD if r.asleep else 0)
            for rid, r in self.replicas.items()
            if r.state == "running" and r.engine.ongoing < cap
        }

    def submit(self, req: SimRequest) -> None:
        if len(req.tokens) + req.output_len > self.model.max_model_len:  # vLLM answers it 400: it ends at once
            req.finished_at = self.env.now
            self.rejected.append(req)
            self.finished([])
            waiter = self._waiters.pop(req.rid, None)
            if waiter is not None:
                waiter.succeed()
            return
        if self.model.path_s:
            self.env.process(self._after_path(req))
            return
        self.queue.append(req)
        self.dispatch()

    def _after_path(self, req: SimRequest):
        yield self.env.timeout(self.model.path_s)
        self.queue.append(req)
        self.dispatch()

    def dispatch(self) -> None:
        while self.queue:
            loads = self.routable()
            if not loads:
                return
            req = self.queue.popleft()
            chosen = self.router.choose(req, loads, {rid: self.replicas[rid].index for rid in loads})
            self.replicas[chosen].add(req)

    def finished(self, reqs: list[SimRequest]) -> None:
        self.done.extend(reqs)
        for r in reqs:
            waiter = self._waiters.pop(r.rid, None)
            if waiter is not None:
                waiter.succeed()
        self.dispatch()

    def _client(self, todo: deque[SimRequest]):
        """A closed-loop client: its next request once its last one ended."""
        while todo:
            req = todo.popleft()
            req.arrival = self.env.now
            self._waiters[req.rid] = self.env.event()
            waiter = self._waiters[req.rid]
            self.submit(req)
            yield waiter

    def _arrivals(self, requests: list[SimRequest]):
        for req in requests:
            yield self.env.timeout(max(0.0, req.arrival - self.env.now))
            self.submit(req)

    def _control(self, until: float):
        while self.env.now < until:
            yield self.env.timeout(self.control_s)
            self._scale()
            self._record()

    def _scale(self) -> None:
        if self.autoscaler is None:
            return
        now = self.env.now
        running = [rid for rid, r in self.replicas.items() if r.state == "running"]
        look_back = self.autoscaler.config.look_back_period_s
        p90 = {rid: self.replicas[rid].p90s(now - look_back) for rid in running}
        latencies = {"ttft_p90_ms": {r: v[0] for r, v in p90.items()}, "tpot_p90_ms": {r: v[1] for r, v in p90.items()}}
        total = sum(r.engine.ongoing for r in self.replicas.values() if r.state == "running") + len(self.queue)
        decision = self.autoscaler.decide(now, running, self.target, total, len(self.queue), latencies)
        live = [r for r in self.replicas.values() if r.state in ("starting", "running")]
        for _ in range(decision - len(live)):
            self._start(ready_at=now + self.profile.start_s)
        if decision < len(live):
            # starting ones first, then the least busy running ones
            order = sorted(live, key=lambda r: (r.state != "starting", r.engine.ongoing))
            for r in order[: len(live) - decision]:
                r.state = "draining"
                if not r.wakeup.triggered:
                    r.wakeup.succeed()
            self.router.forget([r.rid for r in live if r.state != "draining"])
        self.target = decision

    def _record(self) -> None:
        states: dict[str, int] = {}
        for r in self.replicas.values():
            if r.state != "removed":
                state = "asleep" if r.asleep else r.state
                states[state] = states.get(state, 0) + 1
        self.timeline.append(
            {
                "t_s": round(self.env.now, 3),
                "replicas": states,
                "ongoing": sum(r.engine.ongoing for r in self.replicas.values()),
                "queued": len(self.queue),
            }
        )

    def run(self, requests: list[SimRequest], clients: int | None = None, until: float | None = None) -> list:
        """Every request through the simulation (open loop: at its arrival time, counted from now; `clients`: closed
        loop, that many clients each sending its next request when its last ended); returns the ones it finished. A
        later call runs more requests on the same replicas (what their caches hold stays)."""
        now = self.env.now
        last = max((now + r.arrival for r in requests), default=now)
        horizon = until if until is not None else last + 24 * 3600.0
        if clients:
            todo = deque(requests)
            for _ in range(clients):
                self.env.process(self._client(todo))
        else:
            for r in requests:
                r.arrival += now
            self.env.process(self._arrivals(sorted(requests, key=lambda r: r.arrival)))
        if not self._controlled:
            self._controlled = True
            self.env.process(self._control(horizon))
        before = len(self.done)
        total = len(self.done) + len(self.rejected) + len(requests)
        while len(self.done) + len(self.rejected) < total and self.env.peek() < horizon:
            self.env.step()
        return self.done[before:]
