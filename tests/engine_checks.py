"""Checks on a running engine's processes, shared by the CPU and GPU suites (read from the OS and Ray's state API)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import httpx
import psutil

from deployments.engine import NO_NVLINK_MULTICAST_ENV
from deployments.engine.platform import FORKING_CORE_ENV
from tests.local_cluster import LocalCluster

RAY_WORKERS = {"RayWorkerProc", "RayWorkerWrapper"}  # vLLM's Ray worker actor: 0.32 (RayExecutorV2) / 0.26


def replica_actors(cluster: LocalCluster, model: str) -> list[dict]:
    return [a for a in cluster.alive_actors() if a["class_name"] == f"ServeReplica:summit:LLMServer:{model}"]


def vllm_workers(cluster: LocalCluster) -> list[dict]:
    return [a for a in cluster.alive_actors() if a["class_name"] in RAY_WORKERS]


def titled(procs, title: str) -> list[psutil.Process]:
    """Those of `procs` whose name or command line (vLLM sets process titles) holds `title`; one that exits while
    being read (a short-lived helper such as haproxy's reload) is not one of them."""
    found = []
    for proc in procs:
        try:
            if title in proc.name() or title in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _descendants_titled(pid: int, title: str) -> list[psutil.Process]:
    """Processes under `pid` whose name or command line holds `title`."""
    return titled(psutil.Process(pid).children(recursive=True), title)


def mp_workers(replica: dict) -> list[psutil.Process]:
    """vLLM's `mp` executor workers of a replica: processes under its engine core titled `VLLM::Worker...`."""
    return _descendants_titled(replica["pid"], "::Worker")


def runnable_share(procs: list[psutil.Process], samples: int = 40, every_s: float = 0.01) -> float:
    """The share of samples (one each `every_s`) in which a process's main thread was running or waiting for a CPU
    (state R in /proc/PID/stat) rather than asleep: a thread that spins on a queue is R, loaded box or not."""
    runnable = 0
    for _ in range(samples):
        for proc in procs:
            runnable += open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "R"
        time.sleep(every_s)
    return runnable / (samples * len(procs))


def assert_workers_forked_by_the_core(replica_pid: int) -> list[psutil.Process]:
    """Each `mp` worker of the replica's engine was forked by its engine core (deployments/engine/platform.py), not
    spawned: a forked process keeps its parent's initial environment block (/proc/PID/environ) byte for byte, without
    the marker the core set in its environment as it chose to fork, which a spawned worker would carry."""
    (core,) = engine_core_processes(replica_pid)
    workers = _descendants_titled(core.pid, "::Worker")
    assert workers, [w.cmdline() for w in core.children()]
    initial = open(f"/proc/{core.pid}/environ", "rb").read()
    for worker in workers:
        env = open(f"/proc/{worker.pid}/environ", "rb").read()
        assert f"{FORKING_CORE_ENV}=".encode() not in env, "a worker spawned by a core that meant to fork"
        assert env == initial, sorted(set(env.split(b"\0")) ^ set(initial.split(b"\0")))[:6]
    return workers


def engine_processes(cluster: LocalCluster, replica: dict) -> list[psutil.Process]:
    """The replica's process, its children (engine core, mp workers) and vLLM's Ray workers in its placement group."""
    proc = psutil.Process(replica["pid"])
    workers = [
        psutil.Process(w["pid"])
        for w in vllm_workers(cluster)
        if replica["placement_group_id"] and w["placement_group_id"] == replica["placement_group_id"]
    ]
    return [proc, *proc.children(recursive=True), *workers]


def assert_multicast_env(cluster: LocalCluster, replica: dict) -> list[psutil.Process]:
    """Every engine process (the replica, its children, vLLM's Ray workers in its group) sees the multicast-off
    environment; those processes."""
    procs = engine_processes(cluster, replica)
    assert_env_has(procs, NO_NVLINK_MULTICAST_ENV)
    return procs


def ray_worker_processes() -> list[psutil.Process]:
    """vLLM's Ray worker processes on this machine, by their process title, network-namespace hosts included (their
    processes are visible here under other ids than the state API's, which are their own PID namespace's)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        title = (proc.info["cmdline"] or [""])[0]
        if title.startswith("ray::") and any(name in title for name in RAY_WORKERS):
            found.append(proc)
    return found


def assert_env_has(procs: list[psutil.Process], want: dict[str, str]) -> None:
    for proc in procs:
        env = proc.environ()
        wrong = {k: env.get(k) for k, v in want.items() if env.get(k) != v}
        assert not wrong, f"pid {proc.pid} {proc.cmdline()[:3]}: {wrong}"


def assert_multicast_off(cluster: LocalCluster, replica: dict) -> None:
    """Every engine process sees the multicast-off environment; the engine's logged config has FlashInfer's all-reduce
    fusion off; no log of the replica mentions FlashInfer's multicast backend ("mnnvl")."""
    assert_multicast_env(cluster, replica)
    logs = sorted((cluster.temp_dir / "session_latest" / "logs").glob(f"worker-*-{replica['pid']}.*"))
    text = [f.read_text(errors="replace") for f in logs]
    config = [line for t in text for line in t.splitlines() if "Initializing a V1 LLM engine" in line]
    assert config, f"no engine config line in {[f.name for f in logs]}"
    assert "'fuse_allreduce_rms': False" in config[0], config[0][-2000:]
    assert not any("mnnvl" in t for t in text)


def model_engine_cores(cluster: LocalCluster, model: str) -> list[psutil.Process]:
    """The engine core processes of every replica of `model`'s deployment (`a+b` for a pool of two models)."""
    cores = [p for r in replica_actors(cluster, model) for p in engine_core_processes(r["pid"])]
    assert cores, f"each replica of {model} should own a vLLM EngineCore process"
    return cores


@contextlib.contextmanager
def paused(procs: list[psutil.Process]):
    """Engine cores paused (SIGSTOP) for the block, where nothing needs to flow meanwhile; resumed after it (those
    still alive)."""
    for p in procs:
        p.suspend()
    try:
        yield procs
    finally:
        for p in procs:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass


class HeldStreams:
    """Streams held ongoing until `held_streams`' block ends (then closed: the client gone, so vLLM aborts them)."""

    def __init__(self, http: httpx.Client, stack: contextlib.ExitStack):
        self._http, self._stack = http, stack

    def open(self, path: str, body: dict, headers: dict | None = None) -> str:
        """Start a stream of `body` and return the replica that took it (its answer's `x-summit-replica` header: the
        front answers it even while that replica's engine is paused)."""
        r = self._stack.enter_context(self._http.stream("POST", path, json={**body, "stream": True}, headers=headers))
        assert r.status_code == 200, r.read()
        return r.headers["x-summit-replica"]

    def pause(self, procs: list[psutil.Process]) -> None:
        """Pause these engine cores (SIGSTOP) until the block ends: the streams on them count ongoing however slow
        the box."""
        self._stack.enter_context(paused(procs))


@contextlib.contextmanager
def held_streams(http: httpx.Client, pause: list[psutil.Process] | None = None):
    """A `HeldStreams` for the block, with `pause`'s engine cores paused from the start (or, by `held.pause`, from
    when a replica holds what it should): how routing tests build a busy replica beside an idle one."""
    with contextlib.ExitStack() as stack:
        held = HeldStreams(http, stack)
        if pause:
            held.pause(pause)
        yield held


def engine_core_processes(replica_pid: int) -> list[psutil.Process]:
    return _descendants_titled(replica_pid, "EngineCore")


def kill_engine_and_wait_for_answers(
    base_url: str, model: str, replica_pid: int, replica_id: str, timeout_s: float = 300
) -> list:
    """SIGKILL the replica's vLLM engine core, then ask `model` once a second until it answers 200 (Serve replaced the
    replica); returns the failed answers meanwhile. Each must be a clean OpenAI-shaped 503 + Retry-After, and the 200
    must come from another replica than the killed one (`replica_id`). A request may also wait for the new replica
    (Serve queues it while the model has none: on a loaded box, longer than a minute) and be answered by it."""
    import time

    import httpx

    cores = engine_core_processes(replica_pid)
    assert cores, "the replica should own a vLLM EngineCore process"
    for proc in cores:
        proc.kill()
    body = {"model": model, "prompt": "after the crash", "max_tokens": 4, "ignore_eos": True}
    errors, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.post(base_url + "/v1/completions", json=body, timeout=max(deadline - time.monotonic(), 1))
        except httpx.TimeoutException:
            raise AssertionError(f"a request after the crash had no answer within {timeout_s:.0f} s") from None
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 4
            answered_by = r.headers.get("x-summit-replica")
            assert answered_by not in (None, replica_id), f"answered by {answered_by}, not a new replica"
            break
        errors.append(r)
        time.sleep(1)
    else:
        raise AssertionError(
            f"no successful request within {timeout_s:.0f} s; last: {errors[-1].status_code} {errors[-1].text}"
        )
    for failed in errors:
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["type"] == "ServiceUnavailableError"
        assert failed.headers["retry-after"] and "Traceback" not in failed.text
    return errors


_THROTTLE = """
import os, signal, sys, time
run_s, period_s, pids = float(sys.argv[1]), float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
state = {"done": False, "held": False}

def send(sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

def stop(*_):
    state["done"] = True

def hold(*_):
    state["held"] = True
    send(signal.SIGSTOP)

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGUSR1, hold)
try:  # keep the duty cycle on a loaded box: a real-time thread wakes when its sleep ends, before any other (root)
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except (OSError, AttributeError):
    try:
        os.nice(-10)
    except OSError:
        pass
print("throttling", flush=True)
while not state["done"]:
    if state["held"]:
        time.sleep(0.05)
        continue
    send(signal.SIGCONT)
    time.sleep(run_s)
    send(signal.SIGSTOP)
    time.sleep(period_s - run_s)
send(signal.SIGCONT)
"""


class Throttle:
    """Engine core processes slowed to a crawl: paused (SIGSTOP) except for `run_s` of every
    `period_s` (SIGCONT: a step or two of the tiny model), so a stream keeps flowing — its replica keeps writing,
    which is how it sees a client's disconnect — but cannot end while a test waits for something slower (a fault, a
    disconnect crossing HAProxy on a loaded box). The duty cycle runs in a process of its own: a thread of the test
    process would wait for the GIL behind the test's client threads and let the engines run far longer than `run_s`.
    `hold()` pauses them for good (until the context ends). A context manager; leaving it resumes them."""

    def __init__(self, procs: list[psutil.Process], run_s: float = 0.002, period_s: float = 0.25):
        self.procs, self.run_s, self.period_s = procs, run_s, period_s
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Throttle:
        args = [str(self.run_s), str(self.period_s), *(str(p.pid) for p in self.procs)]
        self._proc = subprocess.Popen([sys.executable, "-c", _THROTTLE, *args], stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout.readline().strip() == "throttling"
        return self

    def hold(self) -> None:
        """Paused from now on, no step more, until the context ends."""
        self._proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_stopped(p) for p in self.procs):
            time.sleep(0.01)

    def release(self) -> None:
        """Full speed from now on (what leaving the context does; once is enough)."""
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait(30)
        self._proc = None
        for p in self.procs:  # resumed whatever the script managed
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass

    def __exit__(self, *exc) -> None:
        self.release()


def _stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return True
