"""Summit's vLLM plugins: the engine core forks its workers (every engine), its queue readers spin briefly (where
asked) and sleep between polls instead of yielding (CPU engines), and vLLM's CPU platform with Ray's executor (test
clusters only).

`engine_core_forks_workers` (the `vllm.general_plugins` entry point, pyproject.toml): a Summit replica is a Ray actor,
so vLLM must spawn its engine core from it, and writes `VLLM_WORKER_MULTIPROC_METHOD=spawn` into the environment the
core inherits; the core would then spawn its `mp` workers too, each a fresh interpreter that imports torch and vLLM
again (about 10 s of CPU per engine start, measured on 2 cores: 30-35 s -> 21-22 s for the tiny model). The core is no
Ray actor, and vLLM's own server forks the workers from its core; where the replica asks for it
(`FORK_WORKERS_ENV`, set by deployments/engine/app.py for the `mp` executor unless the YAML's runtime_env sets it to
0), the core does the same. vLLM still spawns where it must (CUDA initialized in the core, for example).

`shm_readers_spin_briefly` (a `vllm.general_plugins` entry point too): vLLM's shared-memory queues between an engine
core and its `mp` workers (the core's inputs to the workers, their outputs back) are read by spinning: after each
read, a reader polls the buffer for 1 s (`sched_yield` in a loop) before it waits for the writer's notification. An
engine answering a request a second keeps each worker spinning a whole core between requests (measured on 2 cores,
the tiny model: 30 requests 1.5 s apart cost its worker 31 CPU-s; 4 CPU-s with a 0.1 s spin, at the same latency).
Where SPIN_ENV is set (the app's runtime_env.env_vars; Summit's test clusters set 0.1), the readers of the core and
its workers spin that long instead. Not by default: under load a CPU step often outlasts a short spin, and the reader
then waits for a notification before each step: the tiny model at 16 streams on 2 cores served 411-542 tok/s with
0.1 s against 793-1,011 with vLLM's 1 s (bench/results/cpu-engine-spin-2026-11-27.md).

`shm_spinners_sleep` (a `vllm.general_plugins` entry point too): while they spin, vLLM's queue readers (and a writer
waiting for its readers) call `sched_yield` in a loop. On a CPU engine the core and its worker then hold both cores of
a small machine between steps, and every other process there (the replica's front, HAProxy, a client on the same box)
waits for a CPU: measured on 2 cores at 16 streams, the benchmark's client thread waited 9.6 s of a 10.4-s load for a
CPU while it ran 0.3 s, requests reached the engine late, its batches shrank and its CPU per token doubled. Where
SPIN_SLEEP_ENV is set (deployments/engine/app.py sets CPU_SPIN_SLEEP_US for every CPU engine unless the YAML's
runtime_env sets it; 0: vLLM's own yield), the spinners sleep that many microseconds between polls instead: the same
load ran 1,953-2,093 tok/s at TTFT p50 107-127 ms instead of 594-1,394 tok/s at 142-860 ms
(bench/results/cpu-serving-2026-11-27.md).

`cpu_ray_platform`:

vLLM's CpuPlatform has no Ray device key, so its Ray executor refuses to start ("current platform cpu does not
support ray") and a CPU engine can only run the `mp` executor, inside one node. vLLM's supported extension point
for platforms is the `vllm.platform_plugins` entry-point group (pyproject.toml registers `cpu_ray_platform`
below): an out-of-tree platform that is active wins over the built-in ones, in every vLLM process, Ray workers
included. The one below is vLLM's CpuPlatform with Ray's "GPU" resource as the worker slot: vLLM's Ray executor
then places one worker per `{"GPU": 1}` bundle of the replica's placement group, exactly as on GPUs, while every
worker computes on the CPU. The nodes of such a cluster declare worker slots with `ray start --num-gpus N`.
It is active only where CPU_RAY_PLATFORM_ENV is "1" (the Serve app's runtime_env.env_vars): Summit's CI uses it
to run the GPU placement path (TP x PP across Ray nodes) for real on CPU-only machines.
"""

from __future__ import annotations

import functools
import os

CPU_RAY_PLATFORM_ENV = "SUMMIT_VLLM_CPU_RAY"
FORK_WORKERS_ENV = "SUMMIT_ENGINE_CORE_FORKS_WORKERS"
# set in the engine core's environment once it chose to fork: a worker spawned anyway would carry it in its initial
# environment (/proc/PID/environ), a forked one cannot (tests/engine_checks.py: assert_workers_forked_by_the_core)
FORKING_CORE_ENV = "SUMMIT_FORKING_ENGINE_CORE"
SPIN_ENV = "SUMMIT_ENGINE_SPIN_S"
SPIN_SLEEP_ENV = "SUMMIT_ENGINE_SPIN_SLEEP_US"
# what a CPU engine's spinners sleep between polls unless the YAML says (deployments/engine/app.py)
CPU_SPIN_SLEEP_US = 50


def engine_core_forks_workers() -> None:
    """Entry point of the `vllm.general_plugins` group: vLLM calls it once in each of its processes (the replica, the
    engine core, a spawned worker). Acts only in an engine core whose replica asked for it."""
    import multiprocessing

    if os.environ.get(FORK_WORKERS_ENV) != "1" or not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    os.environ[FORKING_CORE_ENV] = str(os.getpid())


def shm_readers_spin_briefly() -> None:
    """Entry point of the `vllm.general_plugins` group: in an engine core and a spawned worker (a forked worker
    inherits its core's), the shared-memory queue readers made from now on spin SPIN_ENV seconds after a read instead
    of vLLM's 1 s. Not in the replica (its main process reads no such queue), nor where SPIN_ENV is unset."""
    import inspect
    import multiprocessing

    seconds = os.environ.get(SPIN_ENV)
    if seconds is None or multiprocessing.current_process().name == "MainProcess":
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # a vLLM without it (its readers poll as they do)
        return
    original = SpinCondition.__init__
    if (
        getattr(original, "__summit_spin__", None) is not None
        or "busy_loop_s" not in inspect.signature(original).parameters
    ):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if len(args) < 4:  # is_reader, context, notify_address[, busy_loop_s]
            kwargs.setdefault("busy_loop_s", float(seconds))
        original(self, *args, **kwargs)

    __init__.__summit_spin__ = float(seconds)
    SpinCondition.__init__ = __init__


def shm_spinners_sleep() -> None:
    """Entry point of the `vllm.general_plugins` group: in an engine core and its workers, vLLM's shared-memory queue
    spinners (a reader waiting for the next message, a writer waiting for its readers) sleep SPIN_SLEEP_ENV
    microseconds between polls instead of calling `sched_yield`. Not in the replica, nor where the variable is unset
    or 0."""
    import multiprocessing
    import time

    try:
        seconds = float(os.environ.get(SPIN_SLEEP_ENV) or 0) / 1e6
    except ValueError:  # the replica refused it before starting its engine (deployments/engine/app.py)
        return
    if seconds <= 0 or multiprocessing.current_process().name == "MainProcess":
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    current = getattr(shm_broadcast, "sched_yield", None)
    if current is None or getattr(current, "__summit_sleep__", None) is not None:
        return

    def sleep_briefly() -> None:
        time.sleep(seconds)

    sleep_briefly.__summit_sleep__ = seconds
    shm_broadcast.sched_yield = sleep_briefly


def cpu_ray_platform() -> str | None:
    """Entry point of the `vllm.platform_plugins` group: the platform's qualified name when switched on."""
    return f"{__name__}.CpuRayPlatform" if os.environ.get(CPU_RAY_PLATFORM_ENV) == "1" else None


@functools.lru_cache(maxsize=1)
def _cpu_ray_platform_class():
    from vllm.platforms.cpu import CpuPlatform

    class CpuRayPlatform(CpuPlatform):
        ray_device_key = "GPU"  # one Ray "GPU" slot per worker; the worker itself runs on the CPU

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            super().check_and_update_config(vllm_config)
            if vllm_config.parallel_config.distributed_executor_backend == "ray":
                # Pipeline stages hand tensors over Ray's shared-memory channels (NCCL needs CUDA).
                os.environ["VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE"] = "shm"

    CpuRayPlatform.__qualname__ = CpuRayPlatform.__name__ = "CpuRayPlatform"
    CpuRayPlatform.__module__ = __name__
    return CpuRayPlatform


def __getattr__(name: str):
    # vLLM resolves the plugin's qualified name with getattr: build the class (importing vLLM) only then.
    if name == "CpuRayPlatform":
        return _cpu_ray_platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
