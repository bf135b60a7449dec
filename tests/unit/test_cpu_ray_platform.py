"""The vLLM platform plugin that lets the CPU engine run on vLLM's Ray executor (used by
tests/cpu/test_multinode.py)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

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
    import os

    return {k: v for k, v in os.environ.items() if k != vllm_adapter.CPU_RAY_PLATFORM_ENV}
