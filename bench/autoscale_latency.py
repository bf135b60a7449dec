"""Latency-target autoscaling under a load that pushes TTFT past its target, with its timeline.

    python bench/autoscale_latency.py --accelerator gpu --gpus 1 --json out.json   # 8B shape on a GPU host
    python bench/autoscale_latency.py                                              # the tiny model on CPU

One model with `autoscaling_config.policy: {ttft_p90_ms: TARGET}` (deployments/observability/slo.py), 1 to 2
replicas, each engine `--max-num-seqs` wide. The load runs in phases of streamed completions at a fixed concurrency
(`--phases SECONDS:STREAMS ...`): a light phase under the target, a heavy one whose queueing pushes TTFT p90 past it
(more streams than one engine's batch, queued in the engine: `max_ongoing_requests` 4x its batch, since the policy
reads vLLM's TTFT from a request's arrival in the engine), then a light one again. Every 2 s the timeline records
the replicas Serve runs and starts, and the p90 TTFT the clients measured over the last `--window-s` seconds. The
summary gives when the second replica was asked for and running, when the clients' p90 came back under the target,
and when the count went back to one. On a one-GPU host both engines share GPU 0 (bench/routing.py says how). Not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engines import (  # noqa: E402
    GPU_APP_ENV,
    gpu_cluster_env,
    gpu_engine,
    kv_bytes_per_token,
    model_dir_for,
    multicast_hits,
)
from bench.loadgen import stream_completion  # noqa: E402
from tests.cpu.engine_apps import deployment_details  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "scaled"
DEPLOYMENT = f"LLMServer:{MODEL}"
# Serve's replicas and handles report their autoscaling metrics every 10 s by default; the policy reads them
PUSH = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


def app_config(ns: argparse.Namespace, model_dir: str) -> dict:
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    config["applications"][0]["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    config["applications"][0]["args"].pop("batch", None)
    base = config["applications"][0]["args"]["models"][0]
    engine = {**base["engine_kwargs"], "max_model_len": ns.max_model_len, "max_num_seqs": ns.max_num_seqs}
    deployment = {k: v for k, v in base["deployment"].items() if k != "num_replicas"}
    if ns.accelerator == "gpu":
        kv = ns.kv_cache_tokens * kv_bytes_per_token(model_dir)
        engine = gpu_engine({**engine, "kv_cache_memory_bytes": kv}, ns.gpu_memory_utilization)
        deployment.pop("num_cpus", None)
        config["applications"][0]["runtime_env"]["env_vars"] = dict(GPU_APP_ENV)
    # room for requests to wait in the engine's own queue: the policy reads vLLM's TTFT, from a request's arrival in
    # the engine (requests held at Serve's handles above max_ongoing_requests are not in it)
    deployment["max_ongoing_requests"] = ns.max_ongoing_requests or 4 * ns.max_num_seqs
    deployment["autoscaling_config"] = {
        "min_replicas": 1,
        "max_replicas": 2,
        "initial_replicas": 1,
        "upscale_delay_s": ns.upscale_delay_s,
        "downscale_delay_s": ns.downscale_delay_s,
        "look_back_period_s": ns.look_back_s,
        "policy": {"ttft_p90_ms": ns.target_ttft_ms, "scale_in_below": ns.scale_in_below},
    }
    config["applications"][0]["args"]["models"] = [
        {
            **base,
            "name": MODEL,
            "source": model_dir,
            "accelerator": ns.accelerator,
            "engine_kwargs": engine,
            "deployment": deployment,
        }
    ]
    return config


def replica_states(cluster: LocalCluster) -> dict[str, int]:
    try:
        replicas = deployment_details(cluster, DEPLOYMENT)["replicas"]
    except Exception:  # noqa: BLE001 — the dashboard busy for a moment: the sample says so
        return {"unknown": 1}
    states: dict[str, int] = {}
    for r in replicas:
        states[r["state"]] = states.get(r["state"], 0) + 1
    return states


def p90(values: list[float]) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=10)[-1]


async def run(cluster: LocalCluster, ns: argparse.Namespace, prompt: str) -> dict:
    phases = [(float(s), int(c)) for s, c in (p.split(":") for p in ns.phases)]
    done: list[tuple[float, float]] = []  # (finished at, TTFT s) since the start
    errors: list[str] = []
    timeline: list[dict] = []
    t0 = time.monotonic()
    phase_of = {"index": 0}

    async def streams(client: httpx.AsyncClient, until: float, n: int) -> None:
        async def one() -> None:
            while time.monotonic() < until:
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": ns.max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                timing: dict = {}
                try:
                    ttft, tokens, _ = await stream_completion(client, "/v1/completions", body, timing)
                except httpx.HTTPError as e:
                    ttft, tokens, timing["error"] = None, -1, repr(e)
                if tokens < 0 or ttft is None:
                    errors.append(timing.get("error", "no token"))
                    await asyncio.sleep(0.5)  # a refused request: do not spin on it
                    continue
                done.append((time.monotonic() - t0, ttft))

        await asyncio.gather(*(one() for _ in range(n)))

    async def sample() -> None:
        while True:
            now = time.monotonic() - t0
            window = [t for at, t in done if at >= now - ns.window_s]
            value = p90(window)
            states = await asyncio.to_thread(replica_states, cluster)
            timeline.append(
                {
                    "t_s": round(now, 1),
                    "phase": phase_of["index"],
                    "streams": phases[phase_of["index"]][1],
                    "replicas": states,
                    "ttft_p90_ms": None if value is None else round(value * 1000, 1),
                    "answered_in_window": len(window),
                }
            )
            print(json.dumps(timeline[-1]), flush=True)
            await asyncio.sleep(2)

    sampler = asyncio.create_task(sample())
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=600) as client:
        for i, (seconds, n) in enumerate(phases):
            phase_of["index"] = i
            await streams(client, time.monotonic() + seconds, n)
        # after the load: wait for the count to come back to one (Serve's downscale delay), sampling on
        deadline = time.monotonic() + ns.settle_s
        while time.monotonic() < deadline:
            states = timeline[-1]["replicas"] if timeline else {}
            if (
                sum(states.values()) == 1
                and states.get("RUNNING") == 1
                and any(sum(s["replicas"].values()) == 2 for s in timeline)
            ):
                break
            await asyncio.sleep(2)
    sampler.cancel()
    return {"timeline": timeline, "errors": len(errors), "error_examples": errors[:3], "requests": len(done)}


def summary(ns: argparse.Namespace, out: dict) -> dict:
    tl = out["timeline"]
    target = ns.target_ttft_ms

    def first(pred, after: float = -1.0):
        return next((s["t_s"] for s in tl if s["t_s"] > after and pred(s)), None)

    heavy_start = sum(float(p.split(":")[0]) for p in ns.phases[:1])
    over = first(lambda s: (s["ttft_p90_ms"] or 0) > target)
    asked = first(lambda s: sum(s["replicas"].values()) >= 2)
    running = first(lambda s: s["replicas"].get("RUNNING", 0) >= 2)
    back_under = (
        first(lambda s: s["ttft_p90_ms"] is not None and s["ttft_p90_ms"] <= target and s["phase"] == 1, running)
        if running is not None
        else None
    )
    one_again = first(lambda s: sum(s["replicas"].values()) == 1, asked) if asked is not None else None
    return {
        "target_ttft_p90_ms": target,
        "heavy_phase_starts_s": heavy_start,
        "p90_past_target_s": over,
        "second_replica_asked_s": asked,
        "second_replica_running_s": running,
        "p90_back_under_target_s": back_under,
        "back_to_one_replica_s": one_again,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--gpus", type=int, default=None, help="GPU: the host's GPUs (1: both engines on GPU 0)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-ongoing-requests", type=int, default=None, help="per replica (default 4 x max_num_seqs)")
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--target-ttft-ms", type=float, default=500)
    p.add_argument("--scale-in-below", type=float, default=0.5)
    p.add_argument("--upscale-delay-s", type=float, default=5)
    p.add_argument("--downscale-delay-s", type=float, default=30)
    p.add_argument("--look-back-s", type=float, default=10)
    p.add_argument("--window-s", type=float, default=10, help="the clients' p90 over this many seconds")
    p.add_argument("--phases", nargs="+", default=["30:2", "150:16", "60:1"], help="SECONDS:STREAMS each")
    p.add_argument("--settle-s", type=float, default=120, help="after the load, wait this long for one replica")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--json", help="also write the timeline and summary here")
    ns = p.parse_args()

    model_dir = model_dir_for(ns.accelerator, ns.preset)
    env = {"SUMMIT_TINY_MODEL": model_dir, **PUSH}
    num_gpus = None
    if ns.accelerator == "gpu":
        gpu_env, num_gpus = gpu_cluster_env(2, ns.gpus)  # both engines on GPU 0 of a one-GPU host
        env.update(gpu_env)
    from app.clusters.tiny_model import _WORDS

    prompt = "Summarise: " + " ".join(_WORDS[i % len(_WORDS)] for i in range(ns.prompt_words))
    cluster = LocalCluster(num_cpus=4 if ns.accelerator == "cpu" else 8, num_gpus=num_gpus, env=env)
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.serve_deploy(app_config(ns, model_dir), timeout_s=ns.start_timeout)
        ready_s = round(time.monotonic() - t0, 1)
        print(f"ready in {ready_s:.0f} s", flush=True)
        out = asyncio.run(run(cluster, ns, prompt))
    finally:
        multicast = multicast_hits(cluster)
        cluster.stop()
    out["summary"] = summary(ns, out)
    out["ready_s"] = ready_s
    out["multicast_in_logs"] = multicast
    print(f"log files naming NVLink multicast: {multicast or 'none'}")
    print(json.dumps(out["summary"], indent=2))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"args": vars(ns), **out}, indent=2))


if __name__ == "__main__":
    main()
