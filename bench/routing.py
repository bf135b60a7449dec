"""Does routing on the cache pay? Power-of-two (least_load), prefix_affinity and kv_cache on the same loads, one run.

    python bench/routing.py                          # tiny model on CPU, 2 replicas per policy, every load
    python bench/routing.py --loads multi_turn overflow2x --rounds 2
    python bench/routing.py --kv-cache-tokens 65536  # a cache that holds every prefix on every replica
    python bench/routing.py --accelerator gpu --gpus 1 --rounds 2   # 8B shapes (dummy weights) on a GPU host
    python bench/routing.py --accelerator gpu --gpus 1 --policies kv kv-offload --loads overflow2x overflow6x

On GPUs each replica is a Llama 3.1 8B shape with random weights (`load_format: dummy`, the tiny tokenizer, eager
mode for quick starts), its KV cache `--kv-cache-tokens`. Where the host has fewer GPUs than engines (`--gpus`), Ray
is told there is one GPU per engine and does not set CUDA_VISIBLE_DEVICES: every engine runs on GPU 0, each with
`--gpu-memory-utilization` of it, and a policy's replicas share its compute (the same for every policy).
`kv-offload` is kv_cache routing on engines with vLLM's CPU offload tier (`kv_offloading_size: --offload-gib`); its
rows add vLLM's external (connector) prefix-cache hits and the router's credited offload blocks
(`summit_routing_offload_blocks`).

One app serves the same model three times, `p2c` (Serve's power-of-two choices), `affinity` (PrefixAffinityRouter) and
`kv` (KVCacheRouter: the engines' own KV events), 2 replicas each (6 engines). Each policy gets the same requests in
the same order, streamed at `--concurrency`. The loads are bench/routing_loads.py's (shared system prompts, multi-turn
chats, preambles sharing a long head, hot and cold documents, caches overflowing 2x and 6x), sized against
`--kv-cache-tokens` (the tiny model's tokenizer: ≈ 1.5 tokens a word); each round draws them anew. The same module
replays each load through Summit's own decisions with modelled caches: that prediction is printed beside the run.
Prints, per load and policy, vLLM's own prefix-cache hit rate (`vllm:prefix_cache_hits / queries`, summed over the
replicas, read from Ray's metrics endpoint), TTFT p50/p99, output tok/s and how requests split over replicas; then
the ratios to p2c. With `--rounds N` each load runs N rounds, the policies' order alternating, and medians are
reported. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import routing_loads  # noqa: E402
from bench.engines import (  # noqa: E402
    GPU_APP_ENV,
    gpu_cluster_env,
    gpu_engine,
    kv_bytes_per_token,
    model_dir_for,
    multicast_hits,
)
from bench.loadgen import LoadResult, stream_completion  # noqa: E402
from deployments.routing.kv_blocks import DEFAULT_LOAD_COST_TOKENS  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config  # noqa: E402
from tests.ray_metrics import scrape, settled, total  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP = "summit"
POLICIES = {"p2c": "least_load", "affinity": "prefix_affinity", "kv": "kv_cache", "kv-offload": "kv_cache"}
TOKENS_PER_WORD = 1.5  # the tiny model's tokenizer on the loads' words (app/clusters/tiny_model.py)
BLOCK_TOKENS = {"cpu": 128, "gpu": 16}  # vLLM's KV block on its CPU backend and its GPU default


def app_config(ns: argparse.Namespace, model_dir: str) -> dict:
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    # vLLM's CPU platform lets this legacy variable override kv_cache_memory_bytes: drop it so the size below holds.
    config["applications"][0]["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    base = config["applications"][0]["args"]["models"][0]
    engine = {
        **base["engine_kwargs"],
        "max_model_len": ns.max_model_len,
        "max_num_seqs": ns.max_num_seqs,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": ns.kv_cache_tokens * kv_bytes_per_token(model_dir),
    }
    deployment = {**base["deployment"], "num_replicas": ns.replicas}
    if ns.accelerator == "gpu":
        engine = gpu_engine(engine, ns.gpu_memory_utilization)
        deployment.pop("num_cpus", None)
        config["applications"][0]["runtime_env"]["env_vars"] = dict(GPU_APP_ENV)
    models = []
    for name in ns.policies:
        kwargs = dict(engine)
        if name == "kv-offload":
            kwargs["kv_offloading_size"] = ns.offload_gib
        models.append(
            {
                **base,
                "name": name,
                "source": model_dir,
                "accelerator": ns.accelerator,
                "engine_kwargs": kwargs,
                "deployment": deployment,
                "routing": {"policy": POLICIES[name]},
            }
        )
    config["applications"][0]["args"]["models"] = models
    return config


async def run_policy(
    base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[LoadResult, Counter]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts: list[float] = []
    totals = {"tokens": 0, "errors": 0}
    replicas: Counter = Counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def worker():
            while not queue.empty():
                body = {
                    "model": model,
                    "prompt": queue.get_nowait(),
                    "max_tokens": max_tokens,
                    "stream": True,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream_options": {"include_usage": True},
                }
                try:
                    ttft, tokens, replica = await stream_completion(client, "/v1/completions", body)
                except httpx.HTTPError:
                    ttft, tokens, replica = None, -1, None
                if tokens < 0:
                    totals["errors"] += 1
                    continue
                totals["tokens"] += tokens
                replicas[replica] += 1
                if ttft is not None:
                    ttfts.append(ttft)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return LoadResult(concurrency, len(prompts), totals["tokens"], wall, ttfts, totals["errors"]), replicas


def counters(cluster: LocalCluster, model: str) -> dict[str, float]:
    """The model's engines' counters, summed, as Ray's metrics endpoint exports them: requests finished, vLLM's
    prefix-cache queries and hits (and the external ones: a KV connector's, e.g. the CPU offload tier), and the
    router's credited offload blocks."""
    s = scrape(cluster)
    out = {k: total(s, f"ray_vllm_prefix_cache_{k}_total", model_name=model) for k in ("queries", "hits")}
    for k in ("queries", "hits"):
        out[f"external_{k}"] = total(s, f"ray_vllm_external_prefix_cache_{k}_total", model_name=model)
    out["finished"] = total(s, "ray_vllm_e2e_request_latency_seconds_count", model_name=model)
    out["offload_blocks"] = total(s, "ray_summit_routing_offload_blocks_total", model=model)
    return out


def counters_including(cluster: LocalCluster, model: str, finished: float, timeout_s: float = 120) -> dict:
    """`counters` once they count `finished` requests: an engine exports a request's prefix-cache figures with (or
    before) its finish, so that reading includes every request up to it (no waiting for two equal reads)."""
    deadline = time.monotonic() + timeout_s
    now = counters(cluster, model)
    while now["finished"] < finished and time.monotonic() < deadline:
        time.sleep(0.5)
        now = counters(cluster, model)
    if now["finished"] < finished:
        print(
            f"  {model}: {now['finished']:.0f} of {finished:.0f} requests counted after {timeout_s:.0f} s", flush=True
        )
    return now


def measure(cluster: LocalCluster, ns: argparse.Namespace, model: str, prompts: list[str], last: dict) -> dict:
    """One run of `prompts` on `model`. `last`: each model's counters after its previous run (the first run warms
    the model's engines first: the first requests after a start are slow)."""
    if model not in last:
        start = settled(lambda: counters(cluster, model))
        warm = [f"Warm-up {i}: a short prompt that shares nothing." for i in range(2 * ns.replicas)]
        asyncio.run(run_policy(cluster.base_url, model, warm, ns.replicas, 4))
        last[model] = counters_including(cluster, model, start["finished"] + len(warm))
    before = last[model]
    result, replicas = asyncio.run(run_policy(cluster.base_url, model, prompts, ns.concurrency, ns.max_tokens))
    after = counters_including(cluster, model, before["finished"] + len(prompts) - result.errors)
    if model == "kv-offload":  # the router's counter is exported by another process: one more export period
        time.sleep(2.5)
        after = {**after, "offload_blocks": counters(cluster, model)["offload_blocks"]}
    last[model] = after
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    external = after["external_hits"] - before["external_hits"]
    return {
        "result": result,
        "replicas": sorted(replicas.values(), reverse=True),
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries else float("nan"),
        # the offload tier's hits (vLLM counts a connector's as external) and the router's credit from it
        "external_hit_rate": external / queries if queries else float("nan"),
        "offload_blocks": after["offload_blocks"] - before["offload_blocks"],
    }


def median_row(runs: list[dict]) -> dict:
    """One policy's rounds on one load: the median of each figure."""
    import statistics

    keys = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "hit_rate", "external_hit_rate", "offload_blocks", "errors")
    rows = [
        {**f["result"].row(), **{k: f[k] for k in ("hit_rate", "external_hit_rate", "offload_blocks")}} for f in runs
    ]
    return {
        **{k: statistics.median(r[k] for r in rows) for k in keys},
        "concurrency": rows[0]["concurrency"],
        "requests": rows[0]["requests"],
        "rounds": len(rows),
        "hit_rates": [round(r["hit_rate"], 4) for r in rows],
        "requests_per_replica": [f["replicas"] for f in runs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="model dir (default: make the tiny model)")
    p.add_argument("--loads", nargs="+", choices=routing_loads.LOADS, default=list(routing_loads.LOADS))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2, help="replicas per policy")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=2816, help="KV cache per replica, in tokens")
    p.add_argument("--rounds", type=int, default=1, help="rounds per load (policies' order alternating)")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["p2c", "affinity", "kv"])
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--preset", default="llama-3.1-8b", help="GPU: the model shape (random weights)")
    p.add_argument("--gpus", type=int, default=None, help="GPU: the host's GPUs (default: one per engine)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.14, help="GPU: each engine's share of its GPU")
    p.add_argument("--offload-gib", type=float, default=8, help="kv-offload: vLLM's CPU tier per engine, GiB")
    ns = p.parse_args()
    if ns.policies[0] not in ("p2c", "kv"):
        p.error("--policies: the first is the baseline the others are compared with (p2c, or kv for kv-offload)")

    model_dir = model_dir_for(ns.accelerator, ns.preset, ns.model_dir)
    cache_words = round(ns.kv_cache_tokens / TOKENS_PER_WORD)
    # the replay counts a word as a token: the engine's blocks and kv_cache's load cost, in words
    shape = {
        "replicas": ns.replicas,
        "cache_words": cache_words,
        "block_size": max(1, round(BLOCK_TOKENS[ns.accelerator] / TOKENS_PER_WORD)),
    }
    predicted = {
        load: {
            name: routing_loads.replayed(
                load,
                policy,
                3,
                **shape,
                **(
                    {"load_cost_tokens": round(DEFAULT_LOAD_COST_TOKENS / TOKENS_PER_WORD)}
                    if POLICIES[name] == "kv_cache"
                    else {}
                ),
            )
            for name, policy in POLICIES.items()
            if name in ns.policies
        }
        for load in ns.loads
    }

    engines = len(ns.policies) * ns.replicas
    env = {"SUMMIT_TINY_MODEL": model_dir}
    num_gpus = None
    if ns.accelerator == "gpu":
        try:
            gpu_env, num_gpus = gpu_cluster_env(engines, ns.gpus)
        except ValueError as e:
            p.error(f"--gpus {ns.gpus}: {e}")
        env.update(gpu_env)
    # read: hit rates (Ray's metrics every 2 s)
    cluster = LocalCluster(num_cpus=6 if ns.accelerator == "cpu" else 12, num_gpus=num_gpus, env=env, fast_metrics=True)
    figures: dict[str, dict[str, dict]] = {}
    described: dict[str, dict] = {}
    ready_s = None
    last: dict[str, dict] = {}  # each model's counters after its last run
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.serve_deploy(app_config(ns, model_dir), timeout_s=ns.start_timeout)
        ready_s = round(time.monotonic() - t0, 1)
        print(f"{engines} engines ready in {ready_s:.0f} s", flush=True)
        for load in ns.loads:
            runs: dict[str, list[dict]] = {name: [] for name in ns.policies}
            for round_ in range(ns.rounds):
                drawn = routing_loads.make(load, cache_words, ns.replicas, seed=round_)
                prompts = drawn.prompts
                described[load] = {"about": drawn.about, "requests": len(prompts), "replayed_hit_rate": predicted[load]}
                print(
                    f"{load} round {round_ + 1}: {drawn.about}; {len(prompts)} requests at concurrency "
                    f"{ns.concurrency}; KV cache {ns.kv_cache_tokens} tokens per replica",
                    flush=True,
                )
                order = list(ns.policies) if round_ % 2 == 0 else list(reversed(ns.policies))
                for name in order:
                    runs[name].append(measure(cluster, ns, name, prompts, last))
            figures[load] = {name: median_row(r) for name, r in runs.items()}
            report(ns, load, described[load], figures[load])
            if ns.json:  # each load as it ends: a run cut short keeps what it measured
                save(ns, described, figures, ready_s, None)
    finally:
        multicast = multicast_hits(cluster)
        cluster.stop()
    print(f"log files naming NVLink multicast: {multicast or 'none'}")

    if ns.json:
        save(ns, described, figures, ready_s, multicast)


def report(ns: argparse.Namespace, load: str, about: dict, by_policy: dict[str, dict]) -> None:
    print(
        f"\n{load}: {about}\n{'policy':<11}{'hit rate':>10}{'external':>10}{'TTFT p50 ms':>13}"
        f"{'TTFT p99 ms':>13}{'tok/s':>9}{'errors':>8}  requests per replica",
        flush=True,
    )
    for name, f in by_policy.items():
        print(
            f"{name:<11}{f['hit_rate']:>10.1%}{f['external_hit_rate']:>10.1%}{f['ttft_p50_ms']:>13.1f}"
            f"{f['ttft_p99_ms']:>13.1f}{f['out_tok_s']:>9.1f}{f['errors']:>8}  {f['requests_per_replica']}  "
            f"(replayed: {about['replayed_hit_rate'][name]:.1%}; offload blocks credited {f['offload_blocks']:.0f})"
        )
    base = ns.policies[0]
    b = by_policy[base]
    for name in ns.policies[1:]:
        a = by_policy[name]
        print(
            f"{name} / {base}: hit rate {a['hit_rate'] / b['hit_rate']:.2f}x, "
            f"TTFT p50 {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x, "
            f"TTFT p99 {a['ttft_p99_ms'] / b['ttft_p99_ms']:.2f}x, "
            f"tok/s {a['out_tok_s'] / b['out_tok_s']:.2f}x",
            flush=True,
        )


def save(
    ns: argparse.Namespace, described: dict, figures: dict, ready_s: float | None, multicast: list[str] | None
) -> None:
    rows = [
        {"peer": name, "policy": POLICIES[name], "load": load, **f}
        for load, by_policy in figures.items()
        for name, f in by_policy.items()
    ]
    Path(ns.json).write_text(
        json.dumps(
            {
                "args": vars(ns),
                "loads": described,
                "engines_ready_s": ready_s,
                "multicast_in_logs": multicast,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
