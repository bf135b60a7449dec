"""The vLLM platform plugin that lets the CPU engine run on vLLM's Ray executor (used by
tests/cpu/test_multinode.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from deployments import engine as vllm_adapter


def test_plugin_is_registered_with_vllm_and_off_by_default(monkeypatch):
    (plugin,) = [e for e in entry_points(group="vllm.platform_plugins") if e.name == "summit_cpu_ray"]
    assert plugin.load() is vllm_adapter.cpu_ray_platform
    monkeypatch.delenv(vllm_adapter.CPU_RAY_PLATFORM_ENV, raising=False)
    assert vllm_adapter.cpu_ray_platform() is None
    monkeypatch.setenv(vllm_adapter.CPU_RAY_PLATFORM_ENV, "1")
    assert vllm_adapter.cpu_ray_platform() == "deployments.engine.platform.CpuRayPlatform"


def test_vllm_picks_the_plugin_only_when_switched_on():
    code = (
        "from vllm.platforms import current_platform as p; "
        "print(type(p).__name__, p.device_type, repr(p.ray_device_key))"
    )
    env_on = {**_env(), vllm_adapter.CPU_RAY_PLATFORM_ENV: "1"}
    on = subprocess.run([sys.executable, "-c", code], env=env_on, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert on.stdout.split()[-3:] == ["CpuRayPlatform", "cpu", "'GPU'"]
    assert off.stdout.split()[-3:] == ["CpuPlatform", "cpu", "''"]  # vLLM's own: no Ray device key


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != vllm_adapter.CPU_RAY_PLATFORM_ENV}


def test_the_engine_core_forks_its_workers_only_where_the_replica_asked(monkeypatch):
    """vLLM's general plugin, called in each of its processes: only an engine core whose replica set
    FORK_WORKERS_ENV switches vLLM's start method for its workers to fork (and marks its environment)."""
    import multiprocessing

    from deployments.engine import platform

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "summit_engine_core_forks_workers"]
    assert plugin.load() is platform.engine_core_forks_workers
    process = multiprocessing.current_process()
    for name, asked, forks in [
        ("EngineCore", "1", True),
        ("EngineCore_DP0", "1", True),
        ("EngineCore", None, False),  # a vLLM engine outside Summit's replicas
        ("VllmWorker-0", "1", False),  # a worker (spawned where vLLM had to): nothing to start
        ("MainProcess", "1", False),  # the replica itself: vLLM must spawn the core from a Ray actor
    ]:
        monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        monkeypatch.delenv(platform.FORKING_CORE_ENV, raising=False)
        if asked is None:
            monkeypatch.delenv(platform.FORK_WORKERS_ENV, raising=False)
        else:
            monkeypatch.setenv(platform.FORK_WORKERS_ENV, asked)
        monkeypatch.setattr(process, "name", name)
        platform.engine_core_forks_workers()
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == ("fork" if forks else "spawn"), name
        assert (os.environ.get(platform.FORKING_CORE_ENV) == str(os.getpid())) is forks, name


def test_queue_readers_spin_briefly_only_in_engine_processes_whose_replica_asked():
    """vLLM's general plugin: in an engine core or worker with SPIN_ENV set, a shared-memory queue reader made after it
    spins that long (vLLM's own default: 1 s); not in the replica's main process, nor without SPIN_ENV. One fresh
    interpreter (the plugin patches vLLM's class for its process), the cases in an order where each would show."""
    from deployments.engine import platform

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "summit_shm_readers_spin_briefly"]
    assert plugin.load() is platform.shm_readers_spin_briefly
    code = f"""
import multiprocessing, os, tempfile, zmq
from deployments.engine.platform import shm_readers_spin_briefly
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

def spin(name, asked):
    multiprocessing.current_process().name = name
    os.environ.pop("{platform.SPIN_ENV}", None)
    if asked:
        os.environ["{platform.SPIN_ENV}"] = asked
    shm_readers_spin_briefly()
    path = "ipc://" + tempfile.mktemp()
    return SpinCondition(is_reader=True, context=zmq.Context(), notify_address=path).busy_loop_s

print(spin("EngineCore", None), spin("MainProcess", "0.1"), spin("VllmWorker-0", "0.25"), spin("EngineCore", "0.1"))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    # the last: a second call keeps the first's patch (vLLM may call its plugins again)
    assert [float(x) for x in run.stdout.split()[-4:]] == [1.0, 1.0, 0.25, 0.25]


def test_queue_spinners_sleep_instead_of_yielding_only_in_engine_processes_that_ask():
    """vLLM's general plugin: in an engine core or worker with SPIN_SLEEP_ENV set, vLLM's shm queue module polls with a
    sleep of that many microseconds instead of `sched_yield`; not in the replica's main process, not unset, not 0.
    One fresh interpreter per case (the plugin patches vLLM's module for its process)."""
    from deployments.engine import platform

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "summit_shm_spinners_sleep"]
    assert plugin.load() is platform.shm_spinners_sleep

    def poll_in(name: str, micros: str | None) -> str:
        code = f"""
import multiprocessing, os, time
multiprocessing.current_process().name = {name!r}
os.environ.pop("{platform.SPIN_SLEEP_ENV}", None)  # an in-process engine of the test's own worker may have set it
if {micros!r} is not None:
    os.environ["{platform.SPIN_SLEEP_ENV}"] = {micros!r}
from deployments.engine.platform import shm_spinners_sleep
from vllm.distributed.device_communicators import shm_broadcast
shm_spinners_sleep()
shm_spinners_sleep()  # vLLM may load its plugins twice in a process
slept = []
time.sleep = slept.append  # what a poll asks of the OS (os.sched_yield is left alone)
shm_broadcast.sched_yield()
print(getattr(shm_broadcast.sched_yield, "__summit_sleep__", "yield"), slept)
"""
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.strip().splitlines()[-1]

    assert poll_in("EngineCore_DP0", "500") == "0.0005 [0.0005]"  # a poll sleeps 500 us
    assert poll_in("VllmWorker-0", "50") == "5e-05 [5e-05]"
    assert poll_in("MainProcess", "50") == "yield []"  # the replica reads no such queue
    assert poll_in("EngineCore_DP0", None) == "yield []"
    assert poll_in("EngineCore_DP0", "0") == "yield []"  # the YAML's way back to vLLM's own


def test_a_spin_sleep_that_is_no_number_is_refused_naming_the_key(monkeypatch):
    """The replica refuses SUMMIT_ENGINE_SPIN_SLEEP_US that is no number of microseconds before its engine starts
    (a plugin in the engine core could only ignore it); a given number is kept as given."""
    from deployments.engine import platform
    from deployments.engine.app import _cpu_spinners_sleep

    for bad in ("fast", "-5"):
        monkeypatch.setenv(platform.SPIN_SLEEP_ENV, bad)
        with pytest.raises(ValueError, match=f"runtime_env.env_vars.{platform.SPIN_SLEEP_ENV}="):
            _cpu_spinners_sleep()
    monkeypatch.setenv(platform.SPIN_SLEEP_ENV, "0")
    _cpu_spinners_sleep()
    assert os.environ[platform.SPIN_SLEEP_ENV] == "0"
