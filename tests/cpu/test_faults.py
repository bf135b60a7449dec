"""Faults under load on a real engine, direct path (HAProxy -> a route picker -> 2 engine replicas): every client
gets an end or an error within a bound (none hangs), streams on a surviving replica complete, new requests succeed
once a replica is up, and a redeploy or scale-down drains running streams to their end.

Each case sends streams (`Load`) and sorts what each client saw: completed (every token and [DONE]), refused (an
OpenAI-shaped error answer), error event (an OpenAI error inside the stream, then its end), cut (the connection
closed mid-stream: the client's HTTP library raises), hung (no end within the bound), lost (the stream ended
without an error or all its tokens: what a client cannot tell from success). Figures: `FIGURES`, printed per case.

Stream migration, first (the app is fresh): the engine under four temperature-0 streams (completions and chat, with and
without token ids) is killed mid-stream; each client sees one uninterrupted stream equal, token for token, to the same
request run without a fault, and no error. Its references go through HAProxy; the four struck streams go straight to
one replica's own HTTP port (where HAProxy would forward them), so that one kill strikes all four: through HAProxy the
route picker places each new stream only once the busy replica answers its load probe, seconds later on 2 cores.
(The continuation itself, cut at any chunk, is checked on an in-process engine in test_migration.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from tests.cpu.engine_apps import (
    deployed,
    deployment_details,
    replica_ports,
    running_replicas,
    serve_log_lines,
    serve_log_matches,
    tiny_model,
    wait_for,
)
from tests.engine_checks import Throttle, engine_core_processes
from tests.ray_metrics import scrape, total
from tests.resume_checks import parsed

# Every case runs in CI. Streams are short; what must be in flight when a fault strikes is held there: the engines'
# core processes crawl (`held`) from before the load until the fault, so a case cannot pass because its streams ended
# before the fault (the tiny model is fast). `SUMMIT_FAULT_SUITE=1` runs the cases with long streams at full speed
# (the faults strike whatever is running).
LONG = os.environ.get("SUMMIT_FAULT_SUITE") == "1"

MODEL = "tiny-fault"
POOL = f"LLMServer:{MODEL}"
BOUND_S = 60.0  # a client that receives nothing (no byte, no end, no error) for this long is hung
TOKENS = 4000 if LONG else 600
FIGURES: dict[str, dict] = {}


@dataclass
class Outcome:
    kind: str  # completed | refused | error_event | cut | hung | lost
    replica: str | None
    detail: str = ""
    greedy: bool = False  # temperature 0: resumed on another replica if its engine dies (stream migration)
    ended: float = field(default_factory=time.monotonic)


def stream(
    base_url: str,
    name: str,
    on_start=lambda replica: None,
    tokens: int = TOKENS,
    greedy: bool = False,
    bound_s: float = BOUND_S,
) -> Outcome:
    """One streamed completion read to its end; `on_start(replica)` once it has its first bytes (or its answer)."""
    outcome = _stream(base_url, name, on_start, tokens, greedy, bound_s)
    outcome.greedy = greedy
    return outcome


def _stream(base_url: str, name: str, on_start, tokens: int, greedy: bool, bound_s: float) -> Outcome:
    body = {
        "model": MODEL,
        "prompt": f"{name}: " + "tell a story " * (len(name) % 7),
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"temperature": 0} if greedy else {}),
    }
    replica, signalled = None, False
    try:
        with httpx.Client(base_url=base_url, timeout=httpx.Timeout(bound_s, connect=10)) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                replica = r.headers.get("x-summit-replica")
                if r.status_code != 200:
                    text = r.read().decode(errors="replace")
                    shaped = "error" in json.loads(text) if text.startswith("{") else False
                    return Outcome(
                        "refused" if shaped else "lost",
                        replica,
                        f"{r.status_code} retry-after={r.headers.get('retry-after')} {text[:160]}",
                    )
                usage, error, done = None, None, False
                for line in r.iter_lines():
                    if not signalled:
                        on_start(replica)
                        signalled = True
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    error = chunk.get("error") or error
                    usage = chunk.get("usage") or usage
        if error is not None and done:
            return Outcome("error_event", replica, str(error)[:200])
        if done and usage and usage["completion_tokens"] == tokens:
            return Outcome("completed", replica)
        return Outcome("lost", replica, f"done={done} usage={usage}")
    except httpx.TimeoutException:
        return Outcome("hung", replica, "read timed out")
    except httpx.HTTPError as e:
        return Outcome("cut", replica, repr(e)[:200])
    finally:
        if not signalled:
            on_start(None)


class Load:
    """`n` streams in threads (their prompts start with `name`, so that each case spreads anew over the replicas);
    `wait_started(k)` returns once k of them have their first bytes (or an answer); `busiest()` is the replica that
    streams the most of them right now."""

    def __init__(
        self, base_url: str, n: int, name: str, tokens: int = TOKENS, greedy_every: int = 0, bound_s: float = BOUND_S
    ):
        self.name, self.bound_s = name, bound_s
        self._started = threading.Semaphore(0)
        self._running: Counter = Counter()  # streams started and not ended, by replica
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(n)
        self._futures = [
            self._pool.submit(
                self._stream, base_url, f"{i} {name}", tokens, bool(greedy_every) and i % greedy_every == 0
            )
            for i in range(n)
        ]

    def _stream(self, base_url: str, name: str, tokens: int, greedy: bool) -> Outcome:
        started: list[str | None] = []

        def on_start(replica: str | None) -> None:
            started.append(replica)
            if replica:
                with self._lock:
                    self._running[replica] += 1
            self._started.release()

        outcome = stream(base_url, name, on_start, tokens, greedy, self.bound_s)
        if started and started[0]:
            with self._lock:
                self._running[started[0]] -= 1
        return outcome

    def wait_started(self, k: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        for _ in range(k):
            assert self._started.acquire(timeout=max(0.1, deadline - time.monotonic())), "streams did not start"

    def busiest(self) -> str:
        """The replica with the most streams running now (a stream started early may already have ended)."""
        with self._lock:
            replica, running = self._running.most_common(1)[0]
        assert running > 0, f"no stream is running on any replica: {dict(self._running)}"
        return replica

    def running(self) -> dict[str, int]:
        """Streams started and not ended, by replica."""
        with self._lock:
            return {r: n for r, n in self._running.items() if n > 0}

    def outcomes(self) -> list[Outcome]:
        results = [f.result() for f in self._futures]  # each ends: a read waits at most BOUND_S
        self._pool.shutdown()
        return results


def figures(case: str, outcomes: list[Outcome], **extra) -> dict:
    counts = Counter(o.kind for o in outcomes)
    FIGURES[case] = {
        "sent": len(outcomes),
        **{k: counts.get(k, 0) for k in ("completed", "refused", "error_event", "cut", "hung", "lost")},
        **extra,
        "refusals": sorted({o.detail[:120] for o in outcomes if o.kind == "refused"})[:3],
    }
    print(f"\n{case}: {json.dumps(FIGURES[case])}")
    return FIGURES[case]


def answers(base_url: str, timeout_s: float = 180) -> dict:
    """Seconds until a new completion succeeds (asked once a second), and what the failed asks got meanwhile."""
    t0, seen = time.monotonic(), Counter()

    def ok() -> bool:
        try:
            r = httpx.post(
                base_url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "again", "max_tokens": 2}
            )
        except httpx.HTTPError as e:
            seen[type(e).__name__] += 1
            return False
        if r.status_code != 200:
            shaped = r.headers.get("content-type", "").startswith("application/json") and "error" in r.json()
            seen[f"{r.status_code}{'' if shaped else ' (not OpenAI-shaped)'}"] += 1
        return r.status_code == 200

    assert wait_for(ok, timeout_s, 1), f"no completion succeeded within {timeout_s} s: {dict(seen)}"
    return {"recovered_s": round(time.monotonic() - t0, 1), "meanwhile": dict(seen)}


def replica_actor(cluster, replica_id: str) -> dict:
    return next(a for a in cluster.alive_actors() if a["class_name"].endswith(POOL) and a["name"].endswith(replica_id))


def two_running(cluster) -> None:
    assert wait_for(lambda: len(running_replicas(cluster, POOL)) == 2, 240, 1), deployment_details(cluster, POOL)


def cores_by_replica(cluster, count: int = 2) -> dict[str, list[psutil.Process]]:
    """Each running replica's engine core processes, once `count` replicas run and each has its engine (after a
    case that killed one, Serve may still be replacing it)."""
    cores: dict[str, list[psutil.Process]] = {}

    def ready() -> bool:
        cores.clear()
        replicas = running_replicas(cluster, POOL)
        actors = [a for a in cluster.alive_actors() if a["class_name"].endswith(POOL)]
        for r in replicas:
            actor = next((a for a in actors if a["name"].endswith(r)), None)
            cores[r] = engine_core_processes(actor["pid"]) if actor else []
        return len(replicas) == count and all(cores.values())

    assert wait_for(ready, 360, 1), f"each of {count} replicas should own a vLLM EngineCore process: {cores}"
    each_takes_requests(cluster, set(cores))
    return cores


def each_takes_requests(cluster, replicas: set[str], timeout_s: float = 120) -> None:
    """Short completions through the cluster's front door (prompts that spread over the replicas) until each of
    `replicas` has answered one: Serve reports a replacement RUNNING before HAProxy routes to it (a case that struck
    then sent its whole load to the one replica HAProxy knew, and had no survivor to compare)."""
    seen: Counter = Counter()

    def each_answered() -> bool:
        try:
            r = httpx.post(
                cluster.base_url + "/v1/completions",
                timeout=30,
                json={"model": MODEL, "prompt": f"{sum(seen.values())} which replica?", "max_tokens": 1},
            )
        except httpx.HTTPError:
            return False
        seen[r.headers.get("x-summit-replica") if r.status_code == 200 else r.status_code] += 1
        return replicas <= set(seen)

    assert wait_for(each_answered, timeout_s, 0.2), f"not every replica of {sorted(replicas)} answered: {seen}"


def held(procs: list[psutil.Process]):
    """The engines crawl (Throttle: paused but 2 ms of every 250) while a case's load starts and its fault strikes:
    the tiny model would otherwise outrun the Python clients of a loaded box (a stream whole in the buffers while its
    client reads its first line), and a fault would strike streams already ended. A no-op in the long suite
    (`SUMMIT_FAULT_SUITE=1`), where faults strike whatever runs."""
    return contextlib.nullcontext() if LONG else Throttle(procs)


def every(cores: dict[str, list[psutil.Process]]) -> list[psutil.Process]:
    return [p for procs in cores.values() for p in procs]


@pytest.fixture(scope="module")
def faults(tiny_model_dir):
    # 8 streams at a time per engine, KV for more than that (≈ 2 KiB a token)
    model = tiny_model(
        MODEL,
        {"max_num_seqs": 8, "max_model_len": 8192, "kv_cache_memory_bytes": 512 << 20},
        {"num_replicas": 2, "max_ongoing_requests": 64, "graceful_shutdown_timeout_s": 120},
        routing={"policy": "prefix_affinity", "prefix_chars": 16},
    )
    with deployed([model], tiny_model_dir, haproxy=True, fast_metrics=True) as cluster:
        two_running(cluster)
        yield cluster
    print("\nfault figures:", json.dumps(FIGURES, indent=1))


# Stream migration (first case): the victim engine crawls until the strike (Throttle): no stream can end before it
MIGRATION_TOKENS = 1500
CASES = {
    "completion+ids": ("/v1/completions", {"prompt": "The summit ridge in winter", "return_token_ids": True}),
    "completion": ("/v1/completions", {"prompt": "A long descent from the col"}),
    "chat+ids": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Tell me of the ridge"}], "return_token_ids": True},
    ),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "And of the glacier"}]}),
}


async def run_streams(base_url: str, strike=None, request_ids: dict[str, str] | None = None) -> dict[str, dict]:
    """The four temperature-0 streams of CASES at once, each read to its end: text, token ids (when asked), usage,
    ids, errors, replica. One event loop reads them all (fair: with a thread each, on 2 cores, CI saw one stream's
    reader 2,500 events ahead of another's); lines are parsed after the end. `strike(progress)`, when given, runs
    beside the streams with each stream's lines so far."""
    progress: dict[str, list[str]] = {name: [] for name in CASES}
    replicas: dict[str, str | None] = {}

    async def one(client: httpx.AsyncClient, name: str, path: str, extra: dict) -> None:
        body = {
            "model": MODEL,
            "max_tokens": MIGRATION_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        headers = {"x-request-id": request_ids[name]} if request_ids else {}
        async with client.stream("POST", path, json=body, headers=headers) as r:
            replicas[name] = r.headers.get("x-summit-replica")
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    progress[name].append(line)

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120, connect=10)) as client:
        streams = [asyncio.create_task(one(client, name, path, extra)) for name, (path, extra) in CASES.items()]
        if strike is not None:
            await strike(progress)
        await asyncio.gather(*streams)
    return {name: {**parsed(progress[name]), "replica": replicas[name]} for name in CASES}


def strike_once(app, reference: dict[str, dict]) -> set[str]:
    """The four streams to one replica, whose engine is killed once each has its first events; every stream must
    still equal its reference. The streams resumed elsewhere (the replica's log and Ray's counter agree)."""
    # the victim's engine processes are found before the streams start: Ray's state API takes seconds on 2 cores
    answered: dict = {}

    def a_replica_answers() -> bool:  # after an earlier strike HAProxy's config may still name the dead replica
        for host, port in replica_ports(app):
            try:
                r = httpx.post(
                    f"http://{host}:{port}/v1/completions",
                    timeout=60,
                    json={"model": MODEL, "prompt": "Which replica?", "max_tokens": 1},
                )
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                answered.update(host=host, port=port, victim=r.headers["x-summit-replica"])
                return True
        return False

    assert wait_for(a_replica_answers, 120, 1), replica_ports(app)
    host, port, victim = answered["host"], answered["port"], answered["victim"]
    actor = next(a for a in app.alive_actors() if a["class_name"].endswith(POOL) and a["name"].endswith(victim))
    cores = engine_core_processes(actor["pid"])
    assert cores
    migrations_before = migrations(app)
    request_ids = {name: f"migrate-{i}-{time.time_ns()}" for i, name in enumerate(CASES)}

    async def strike(progress: dict[str, list]) -> None:  # as soon as every stream is under way
        deadline = time.monotonic() + 120
        while not all(progress.values()):
            assert time.monotonic() < deadline, {name: len(p) for name, p in progress.items()}
            await asyncio.sleep(0.01)
        for proc in cores:
            proc.kill()

    # the victim's engine crawls (2 ms of every 250) until the kill: every stream is provably mid-generation when
    # its engine dies, however far behind a starved client reads
    with Throttle(cores):
        migrated = asyncio.run(run_streams(f"http://{host}:{port}", strike, request_ids))

    for name, seen in migrated.items():
        ref = reference[name]
        assert seen["replica"] == victim, (name, seen["replica"], victim)  # one replica's own port
        assert not seen["errors"] and seen["done"], (name, seen["errors"])
        assert len(seen["chunk_ids"]) == 1, f"{name}: one stream id throughout, got {seen['chunk_ids']}"
        assert seen["usage"] == ref["usage"], name
        if ref["ids"]:
            assert len(seen["ids"]) == MIGRATION_TOKENS and seen["ids"] == ref["ids"], name
        assert seen["text"] == ref["text"], name
    resumed = {
        name for name, rid in request_ids.items() if serve_log_matches(app, f"request {rid} resumed on another replica")
    }
    # Ray exports metrics every few seconds; a loaded CI box took over 30 s once
    assert wait_for(lambda: migrations(app) - migrations_before == len(resumed), 120, 1), (migrations(app), resumed)
    return resumed


def test_streams_resume_on_another_replica_token_for_token(faults):
    app = faults
    two_running(app)
    reference = asyncio.run(run_streams(app.base_url))
    assert all(r["usage"]["completion_tokens"] == MIGRATION_TOKENS and not r["errors"] for r in reference.values())
    resumed = strike_once(app, reference)
    print(f"streams resumed: {sorted(resumed)}")
    # each stream went on from another replica (not merely ended before the strike)
    assert resumed == set(CASES), resumed


def migrations(cluster) -> float:
    return total(scrape(cluster), "ray_summit_stream_migrations_total", model=MODEL, outcome="resumed")


def test_engine_killed_under_32_streams(faults):
    cores = cores_by_replica(faults)
    earlier = len(serve_log_matches(faults, "resumed on another replica"))  # the migration case's
    with held(every(cores)):
        load = Load(faults.base_url, 32, "engine", greedy_every=2)  # half at temperature 0: resumed elsewhere
        load.wait_started(8)
        victim = load.busiest()
        in_flight = load.running().get(victim, 0)
        for proc in cores[victim]:
            proc.kill()  # SIGKILL ends a stopped process too
    outcomes = load.outcomes()
    recovered = answers(faults.base_url)
    on_victim = [o for o in outcomes if o.replica == victim]
    resumed: list[str] = []

    def resumed_now() -> bool:
        resumed[:] = serve_log_matches(faults, "resumed on another replica")[earlier:]
        return bool(resumed)

    # the engine died under streams it was generating: its temperature-0 ones went on from another replica
    assert wait_for(resumed_now, 10, 1), serve_log_lines(faults, "request ")
    f = figures(
        "engine killed",
        outcomes,
        **recovered,
        on_victim=len(on_victim),
        in_flight_at_kill=in_flight,
        resumed=len(resumed),
        greedy_on_victim_completed=sum(o.greedy and o.kind == "completed" for o in on_victim),
        sampled_on_victim_errors=sum(not o.greedy and o.kind != "completed" for o in on_victim),
    )
    assert f["hung"] == 0 and f["lost"] == 0, [o for o in outcomes if o.kind in ("hung", "lost")]
    # the victim's sampled streams end with an error the client sees (the engines crawl from before the load until
    # the kill: some sampled stream was still running there), its temperature-0 ones go on elsewhere
    assert f["sampled_on_victim_errors"] >= 1, [o for o in on_victim if not o.greedy]
    # (one that had no stream yet may be refused 503 + Retry-After, as any request to a dead engine)
    greedy = [o for o in on_victim if o.greedy]
    assert all(o.kind in ("completed", "refused") for o in greedy), (
        greedy,
        serve_log_lines(faults, "continuation"),
    )
    survivors = [o for o in outcomes if o.replica and o.replica != victim]
    assert survivors and all(o.kind == "completed" for o in survivors), survivors
    assert all(o.kind in ("completed", "error_event", "refused") for o in on_victim), outcomes
    # the victim stays up while it relays resumed streams: the next case starts once Serve has replaced it
    assert wait_for(lambda: victim not in running_replicas(faults, POOL), 360, 1), deployment_details(faults, POOL)
    two_running(faults)


def test_replica_actor_killed_under_streams(faults):
    cores = cores_by_replica(faults)
    pids = {r: replica_actor(faults, r)["pid"] for r in cores}
    with held(every(cores)):
        load = Load(faults.base_url, 32, "actor")
        load.wait_started(8)
        victim = load.busiest()
        in_flight = load.running().get(victim, 0)
        psutil.Process(pids[victim]).kill()
    outcomes = load.outcomes()
    recovered = answers(faults.base_url)
    f = figures(
        "replica actor killed",
        outcomes,
        **recovered,
        on_victim=sum(o.replica == victim for o in outcomes),
        in_flight_at_kill=in_flight,
    )
    assert f["hung"] == 0 and f["lost"] == 0, [o for o in outcomes if o.kind in ("hung", "lost")]
    assert f["cut"] + f["error_event"] >= 1, outcomes  # the victim's unfinished streams end in an error they see
    assert all(o.kind == "completed" for o in outcomes if o.replica and o.replica != victim), outcomes
    for proc in cores[victim]:  # an orphan outside the cluster's process tree, if it outlived its replica
        proc.kill() if proc.is_running() else None
    two_running(faults)


def _haproxies(cluster) -> list[psutil.Process]:
    """This cluster's HAProxy processes (after a reload, the old one serves its open connections beside the new)."""
    state = str(cluster.temp_dir / "h")
    return [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] == "haproxy" and any(state in part for part in p.info["cmdline"] or [])
    ]


def test_haproxy_killed_under_streams(faults):
    cores = every(cores_by_replica(faults))
    with held(cores):
        load = Load(faults.base_url, 32, "haproxy")
        load.wait_started(8)
        in_flight = sum(load.running().values())
        old = _haproxies(faults)
        assert old, "no HAProxy of this cluster"
        for proc in old:
            proc.kill()
    outcomes = load.outcomes()
    recovered = answers(faults.base_url, 240)
    f = figures("HAProxy killed", outcomes, **recovered, in_flight_at_kill=in_flight)
    assert f["hung"] == 0 and f["lost"] == 0, [o for o in outcomes if o.kind in ("hung", "lost")]
    assert f["cut"] >= 1, outcomes  # HAProxy held the clients' connections of streams their engines had not ended
    assert not {p.pid for p in _haproxies(faults)} & {p.pid for p in old}  # Serve started a new one


def test_route_picker_killed(faults):
    picker = next(a for a in faults.alive_actors() if a["class_name"].endswith("RoutePicker"))
    load = Load(faults.base_url, 20, "picker")
    load.wait_started(10)
    psutil.Process(picker["pid"]).kill()
    after = Load(
        faults.base_url, 20, "after the picker", tokens=8
    )  # arrive while the picker is gone: answered or refused, never hung
    outcomes = load.outcomes() + after.outcomes()
    recovered = answers(faults.base_url)
    f = figures("route picker killed", outcomes, **recovered)
    assert f["hung"] == 0 and f["lost"] == 0 and f["cut"] == 0, [o for o in outcomes if o.kind != "completed"]
    assert wait_for(
        lambda: any(
            a["class_name"].endswith("RoutePicker") and a["pid"] != picker["pid"] for a in faults.alive_actors()
        ),
        120,
        1,
    )


class Stopping:
    """When each replica of the pool was first seen stopping (Serve's state), polled while a case runs."""

    def __init__(self, cluster):
        self.at: dict[str, float] = {}
        self._cluster, self._done = cluster, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(0.25):
            try:
                replicas = deployment_details(self._cluster, POOL)["replicas"]
            except Exception:  # noqa: BLE001 — the dashboard is busy: next poll
                continue
            for r in replicas:
                if r["state"] == "STOPPING":
                    self.at.setdefault(r["replica_id"], time.monotonic())

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _drains(cluster, case: str, change, replicas: int) -> dict:
    """Streams start on every replica, their engines crawling, then paused while the app is redeployed with
    `change` (of the app's Serve config); once Serve reports an old replica STOPPING the engines go on: the streams it
    still held end complete after it began stopping (drained, not cut), and that replica is gone afterwards."""
    by_replica = cores_by_replica(cluster, replicas)
    old, cores = set(by_replica), every(by_replica)
    stopping = Stopping(cluster)
    # the client's bound covers a new replica's start while the old engines crawl (a redeploy starts new ones before
    # it stops the old); they go on at full speed once an old replica is stopping
    with held(cores) as throttle:
        load = Load(cluster.base_url, 16 * replicas, case, bound_s=300)  # 16 for each engine: two waves of 8
        load.wait_started(8)
        if throttle is not None:  # no step more until an old replica is stopping: its streams cannot end before
            throttle.hold()
        in_flight = load.running()
        config = copy.deepcopy(cluster.serve_config)
        change(config["applications"][0])
        cluster.serve_config = config
        deploy = ThreadPoolExecutor(1).submit(cluster.serve_deploy, config)
        began = wait_for(lambda: bool(stopping.at), 300, 0.25)
    outcomes = load.outcomes()
    deploy.result()
    gone = wait_for(lambda: not old <= set(running_replicas(cluster, POOL)) and not _stopping(cluster), 240, 0.5)
    stopping.stop()
    drained = [o for o in outcomes if o.replica in stopping.at and o.ended > stopping.at[o.replica]]
    f = figures(
        case,
        outcomes,
        **answers(cluster.base_url),
        in_flight_at_signal=in_flight,
        drained=len(drained),
        stopped=sorted(stopping.at),
    )
    assert began, f"no old replica was seen stopping: {deployment_details(cluster, POOL)}"
    # every stream that started ends complete; one that arrives during the switch may be refused: 503 + Retry-After
    # (no replica could take it), or HAProxy's 408 when this starved box sent its body more than 5 s late
    assert f["completed"] + f["refused"] == f["sent"], [o for o in outcomes if o.kind not in ("completed", "refused")]
    assert all(
        (o.detail.startswith("503") and "retry-after=None" not in o.detail) or o.detail.startswith("408")
        for o in outcomes
        if o.kind == "refused"
    ), f["refusals"]
    assert drained, f"no stream was still running when its replica began stopping: {stopping.at}, {outcomes}"
    assert gone and set(stopping.at) <= old and not set(stopping.at) & set(running_replicas(cluster, POOL)), (
        deployment_details(cluster, POOL)
    )
    return f


def _stopping(cluster) -> bool:
    return any(r["state"] != "RUNNING" for r in deployment_details(cluster, POOL)["replicas"])


def test_scale_down_drains_running_streams(faults):
    before = set(running_replicas(faults, POOL))
    # Serve's per-deployment override: a light update that stops one replica and keeps the other (num_replicas in the
    # app's args would change Serve's code version and replace both)
    _drains(faults, "scale down 2 -> 1", lambda app: app.update(deployments=[{"name": POOL, "num_replicas": 1}]), 2)
    after = running_replicas(faults, POOL)
    assert len(after) == 1 and set(after) <= before, (before, after)


@pytest.mark.long  # a second set of replicas and engines (the long tier, SUMMIT_TEST_LONG=1; tests/README.md)
def test_redeploy_with_a_changed_config_drains_running_streams(faults):
    """Last: on the one replica the scale-down left (one engine start, not two). A change of the app's args: Serve's
    code version hashes them, so the replica is replaced and the old one drains."""
    before = set(running_replicas(faults, POOL))
    _drains(faults, "redeploy", lambda app: app["args"]["models"][0]["engine_kwargs"].update(max_num_seqs=6), 1)
    after = running_replicas(faults, POOL)
    assert len(after) == 1 and not set(after) & before, (before, after)
