"""vLLM's CPU platform with Ray's executor: a vLLM platform plugin, for test clusters only.

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
