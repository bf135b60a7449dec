"""GPU suite: skipped without CUDA. One Ray cluster per session with all local GPUs; apps are redeployed per test
module."""

from __future__ import annotations

import pytest

from app.clusters.tiny_model import make_model_config, make_tiny_model
from tests.local_cluster import LocalCluster


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_report_header(config):
    return f"GPU suite: {_cuda_devices()} CUDA device(s)" + ("" if _cuda_devices() else " - tests/gpu skipped")


def pytest_collection_modifyitems(config, items):
    """Without CUDA every test here is collected and reported as skipped, with the reason (CI's report lists them)."""
    if _cuda_devices():
        return
    skip = pytest.mark.skip(reason="tests/gpu needs a CUDA device (none on this machine)")
    for item in items:
        if item.nodeid.startswith("tests/gpu/"):
            item.add_marker(skip)


GPU_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def app_config(models: list[dict]) -> dict:
    return {
        "proxy_location": "HeadOnly",
        "applications": [
            {
                "name": "summit",
                "route_prefix": "/",
                "import_path": "app.build:build_app",
                "runtime_env": {"env_vars": GPU_ENV},
                "args": {"models": models},
            }
        ],
    }


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {
        "tiny": str(make_tiny_model(root / "tiny-llama", hidden_size=256)),
        "8b": str(make_model_config("llama-3.1-8b", root / "llama-8b")),
    }


def tiny_gpu_model(model_dirs, **overrides) -> dict:
    return {
        "name": "tiny-llama",
        "source": model_dirs["tiny"],
        "accelerator": "gpu",
        "engine_kwargs": {"max_model_len": 2048, "gpu_memory_utilization": 0.15, "max_num_seqs": 128},
        **overrides,
    }


def llama8b_model(model_dirs) -> dict:
    return {
        "name": "llama-8b",
        "source": model_dirs["8b"],
        "accelerator": "gpu",
        "engine_kwargs": {"load_format": "dummy", "max_model_len": 4096, "gpu_memory_utilization": 0.85},
    }


@pytest.fixture(scope="session")
def gpu_cluster():
    # the direct path; test_pd_gpu reads Ray's metrics
    cluster = LocalCluster(num_cpus=8, num_gpus=_cuda_devices(), haproxy=True, fast_metrics=True)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def summit(gpu_cluster, model_dirs):
    """tiny-llama on one GPU, plus Llama-3.1-8B shapes (dummy weights) on a second GPU when there is one."""
    models = [tiny_gpu_model(model_dirs)]
    if _cuda_devices() > 1:
        models.append(llama8b_model(model_dirs))
    gpu_cluster.serve_deploy(app_config(models), timeout_s=900)
    return gpu_cluster
