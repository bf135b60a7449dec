"""One engine served by two front processes (`models[].front_processes: 2`), direct path, real engine: the replica
and its front process both listen on the replica's one HTTP port (what HAProxy knows), each a client of the same
engine core, and a front process that dies gets its replica replaced.

Which process answered a request is told by vLLM's own counters in each process (`generation_tokens`: a client
counts the tokens of the requests it sent the core): the load's tokens must be exactly the sum of both processes',
and each must have some."""

from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from tests.cpu.engine_apps import (
    deployed,
    deployment_details,
    replica_ports,
    running_replicas,
    serve_log_lines,
    tiny_model,
    wait_for,
)
from tests.engine_checks import Throttle, engine_core_processes
from tests.replica_probe import probe
from tests.resume_checks import read_stream, same_stream, text_of

MODEL = "tiny-fronts"
POOL = f"LLMServer:{MODEL}"
STREAMS, TOKENS = 24, 16


@pytest.fixture(scope="module")
def fronts(tiny_model_dir):
    model = tiny_model(
        MODEL,
        {"max_num_seqs": 16},
        {"num_replicas": 1, "graceful_shutdown_timeout_s": 120},
        front_processes=2,
        stream_resume={},
    )
    with deployed([model], tiny_model_dir, haproxy=True) as cluster:
        yield cluster


def replica_stats(cluster) -> dict:
    answers = probe(cluster.address, "each", "summit", POOL, "stats", "--replicas", "1")
    return next(iter(answers.values()))


def with_front(cluster, timeout_s: float = 180) -> dict:
    """The replica's stats once its front process listens beside it."""
    seen: dict = {}

    def ready() -> bool:
        seen.update(replica_stats(cluster))
        return len(seen["fronts"]) == 1 and seen["fronts"][0]["listening"]

    assert wait_for(ready, timeout_s, 1), f"{seen}\n{serve_log_lines(cluster, 'front process')}"
    return dict(seen)


def replica_state(cluster, replica_id: str) -> str | None:
    """A replica's state in Serve's view (None where Serve lists no such replica, or no deployment while the
    application is being built again)."""
    try:
        replicas = deployment_details(cluster, POOL)["replicas"]
    except KeyError:
        return None
    return next((r["state"] for r in replicas if r["replica_id"] == replica_id), None)


def open_stream(client: openai.OpenAI, i: int, tokens: int):
    """Story `i`'s streamed completion of `tokens` tokens, its raw response (`.headers`, `.parse()`: the chunks)."""
    return client.completions.with_raw_response.create(
        model=MODEL,
        prompt=f"Story {i}:",
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )


def streamed(base_url: str, i: int, tokens: int = TOKENS) -> tuple[int, str | None]:
    """One streamed completion on its own connection: (tokens, finish_reason)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        chunks = list(open_stream(client, i, tokens).parse())
    finally:
        client.close()
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks[-1].usage.completion_tokens, reasons[-1] if reasons else None


def test_the_replica_and_its_front_process_answer_on_its_port_from_one_engine(fronts):
    before = with_front(fronts)
    front = before["fronts"][0]
    assert front["pid"] != before["pid"]
    # one engine core, the replica's child; the front process has none
    assert len(engine_core_processes(before["pid"])) == 1
    assert engine_core_processes(front["pid"]) == []

    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(lambda i: streamed(fronts.base_url, i), range(STREAMS)))
    assert results == [(TOKENS, "length")] * STREAMS

    after = replica_stats(fronts)
    by_replica = after["generation_tokens"] - before["generation_tokens"]
    by_front = after["fronts"][0]["generation_tokens"] - front["generation_tokens"]
    assert by_replica + by_front == STREAMS * TOKENS, (by_replica, by_front)
    assert by_replica > 0 and by_front > 0, f"every process should have taken connections: {by_replica}, {by_front}"

    # HAProxy's health check on the port is answered alike by either process
    ((host, port),) = replica_ports(fronts)
    answers = {(r.status_code, r.text) for r in (httpx.get(f"http://{host}:{port}/-/healthz") for _ in range(20))}
    assert answers == {(200, "success")}


def test_a_dropped_stream_resumes_through_either_process_of_its_replica(fronts):
    """stream_resume with two processes on the replica's port (the kernel spreads connections over them): streams
    dropped after 3 events until one is kept by each process (the front index in its id), each resumed until both
    processes have taken a resume of it, straight at the replica's port: every resume gets the rest once, one stream
    with the dropped part (ids 1..N) and the text of an uncut run. So a resume reaching the other process goes on to the
    keeper (a front process through its replica; the replica to its front process). Fails if a process answers a
    stream it does not keep (404), or a resume repeats or skips events."""
    with_front(fronts)
    ((host, port),) = replica_ports(fronts)
    url = f"http://{host}:{port}/v1/completions"
    body = {"model": MODEL, "prompt": "Tale of two", "max_tokens": 24, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    uncut = read_stream(url, body, {})
    assert uncut.done, uncut
    checked: dict[int, set[str]] = {}
    for _ in range(24):
        if len(checked) == 2 and all(len(a) == 2 for a in checked.values()):
            break
        first = read_stream(url, body, {}, stop_after=3)
        keeper = int(first.headers["x-summit-stream-id"].split("-")[2])
        accepted = checked.setdefault(keeper, set())
        for _ in range(16):
            if len(accepted) == 2:
                break
            rest = read_stream(url, None, {"last-event-id": first.last_id})
            story = lambda: serve_log_lines(fronts, first.headers["x-summit-stream-id"])  # noqa: E731 — on failure
            assert rest.status == 200, (keeper, rest.headers, rest.body, story())
            same_stream(first, rest)
            assert rest.done and text_of(first.events + rest.events) == text_of(uncut.events), (keeper, rest, story())
            accepted.add(rest.headers.get("x-summit-front", "0"))  # which process took the connection
    assert checked == {0: {"0", "1"}, 1: {"0", "1"}}, checked


class Stream:
    """A streamed completion on its own connection, read in a thread: which process answered (`x-summit-front`:
    a front process's index; None: the replica's own) and how it ended. `cut()` closes the connection under it."""

    def __init__(self, base_url: str, i: int, tokens: int):
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=300)
        self.front: str | None = None
        self.outcome: str | None = None
        self.started = threading.Event()
        body = {"model": MODEL, "prompt": f"Tale {i}:", "max_tokens": tokens, "stream": True, "ignore_eos": True}
        self.thread = threading.Thread(target=self._run, args=(body,), daemon=True)
        self.thread.start()

    def _run(self, body: dict) -> None:
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            answer = self.conn.getresponse()
            self.front = answer.getheader("x-summit-front")
            self.started.set()
            text = answer.read().decode()
            whole = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            self.outcome = "complete" if whole and '"finish_reason":"length"' in text else f"ended: {text[-300:]}"
        except Exception as e:  # noqa: BLE001 — the stream was cut (or by the test)
            self.outcome = f"cut: {type(e).__name__}"
        finally:
            self.started.set()

    def cut(self) -> None:
        self.conn.sock.shutdown(socket.SHUT_RDWR)

    def ended(self, timeout_s: float) -> str | None:
        self.thread.join(timeout_s)
        return self.outcome


def refused(host: str, port: int) -> bool:
    """No process listens on the old replica's port any more: Serve closed the replica's listener, and its front
    process (draining) closed its own."""
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def test_a_stopping_replica_drains_its_front_process_streams(fronts):
    """Streams run on both processes of the replica (sent to its port), its engine paused, while the app is
    redeployed with a change (Serve replaces the replica). Once the old replica is stopping, the streams on its own
    process are closed by their clients, so Serve goes on to stop it; its front process must then drain: stop taking
    connections (the port refuses them) and keep the engine core up until its own streams end, which they do
    complete once the engine runs again."""
    before = with_front(fronts)
    (core,) = engine_core_processes(before["pid"])
    ((host, port),) = replica_ports(fronts)
    streams: list[Stream] = []
    with Throttle([core]) as throttle:
        while len(streams) < 24 and {s.front for s in streams} != {None, "1"}:  # some on each process
            # straight to the replica's port (where HAProxy would send them): a cut connection reaches the replica
            # at once (HAProxy would keep its side open while no byte flows)
            streams.append(Stream(f"http://{host}:{port}", len(streams), 400))
            assert streams[-1].started.wait(120), "a stream got no answer"
        assert {s.front for s in streams} == {None, "1"}, [s.front for s in streams]
        throttle.hold()  # no step more: no stream can end on its own
        config = copy.deepcopy(fronts.serve_config)
        config["applications"][0]["args"]["models"][0]["engine_kwargs"]["max_num_seqs"] = 12
        fronts.serve_config = config
        deploy = ThreadPoolExecutor(1).submit(fronts.serve_deploy, config)
        stopping = wait_for(lambda: replica_state(fronts, before["replica_id"]) == "STOPPING", 300, 0.5)
        for s in streams:
            if s.front is None:
                s.cut()  # the replica's own requests end: Serve goes on to stop it
        # Serve keeps a stopping replica reachable 30 s (RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S) first
        draining = wait_for(lambda: refused(host, port), 180, 0.5)
    outcomes = [s.ended(120) for s in streams if s.front == "1"]
    deploy.result()
    assert stopping, deployment_details(fronts, POOL)
    assert draining, "the old replica's front process never stopped taking connections\n" + serve_log_lines(
        fronts, before["replica_id"]
    )
    assert outcomes and all(o == "complete" for o in outcomes), outcomes
    assert wait_for(lambda: running_replicas(fronts, POOL) != [before["replica_id"]], 120), deployment_details(
        fronts, POOL
    )


def test_a_front_process_that_dies_gets_its_replica_replaced(fronts):
    before = with_front(fronts)
    (old_core,) = engine_core_processes(before["pid"])
    os.kill(before["fronts"][0]["pid"], signal.SIGKILL)

    def replaced() -> bool:
        running = running_replicas(fronts, POOL)
        return len(running) == 1 and running[0] != before["replica_id"]

    assert wait_for(replaced, 360, 1), deployment_details(fronts, POOL)
    after = with_front(fronts)
    assert after["replica_id"] != before["replica_id"] and after["fronts"][0]["pid"] != before["fronts"][0]["pid"]
    assert wait_for(lambda: not old_core.is_running() or old_core.status() == psutil.STATUS_ZOMBIE, 60)
    assert streamed(fronts.base_url, 0) == (TOKENS, "length")


def ended_how(base_url: str, i: int, tokens: int) -> tuple[str, str]:
    """A streamed completion read to its end: (the process that answered it: `x-summit-front`'s index, "replica"
    without one, "-" when refused before an answer; how it ended: "complete", "error event: <message>" (an OpenAI
    error inside the stream), "refused: <status>" (an error answer instead of a stream) or "cut: <exception>" (the
    connection closed under it))."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    process = "-"
    try:
        raw = open_stream(client, i, tokens)
        process = raw.headers.get("x-summit-front", "replica")
        chunks = list(raw.parse())
    except openai.APIStatusError as e:
        return process, f"refused: {e.status_code}"
    except openai.APIConnectionError as e:
        return process, f"cut: {type(e).__name__}: {e}"
    except openai.APIError as e:
        return process, f"error event: {e.message}"
    finally:
        client.close()
    usage = chunks[-1].usage.completion_tokens if chunks and chunks[-1].usage else None
    return process, "complete" if usage == tokens else f"short: {usage}"


def test_a_dead_engine_ends_the_front_process_streams_with_an_error_event(fronts):
    """Last (the replica is not replaced after): the engine core dies under streams on both processes; the front
    process learns it from the replica (its own client does not watch the core), so its streams end with vLLM's
    error event too, none cut or hung. Each stream's process is recorded (`x-summit-front`): the test needs running
    streams on both, and every stream the front process answered must end with the engine's error event (it fails if
    the front process's streams hang, are cut or end without it). Sampled streams (not resumed: stream migration
    resumes temperature-0 ones)."""
    before = with_front(fronts)
    (core,) = engine_core_processes(before["pid"])
    streams = 16  # the kernel spreads connections over the two processes: 8 once all went to one (~1 in 128)
    with Throttle([core]), ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(ended_how, fronts.base_url, i, 400) for i in range(streams)]

        def both_running() -> bool:
            s = replica_stats(fronts)
            # streams in the engine from both: the front process's count, and the replica's own client's requests
            return s["fronts"][0]["running"] > 0 and s["num_unfinished_requests"] > 0

        assert wait_for(both_running, 120, 0.5), replica_stats(fronts)
        core.kill()
        outcomes = [f.result(timeout=120) for f in futures]
    by_process: dict[str, list[str]] = {}
    for process, how in outcomes:
        by_process.setdefault(process, []).append(how)
    # streams the engine ran, on both processes, each ended by vLLM's error event
    assert {"replica", "1"} <= set(by_process), by_process
    for process in ("replica", "1"):
        assert by_process[process] and all(o.startswith("error event: ") for o in by_process[process]), by_process
    assert any(how.startswith("error event: EngineCore") for _, how in outcomes), by_process
    # a stream the replica had not yet passed to the engine is refused 503 (an honest retry), never cut or hung
    assert all(o == "refused: 503" for o in by_process.get("-", [])), by_process
