"""Does routing on the cache pay? Power-of-two (least_load), prefix_affinity and kv_cache on the same loads, one run.

    python bench/routing.py                          # tiny model on CPU, 2 replicas per policy, every load
    python bench/routing.py --loads multi_turn overflow2x --rounds 2
    python bench/routing.py --kv-cache-tokens 65536  # a cache that holds every prefix on every replica

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
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import routing_loads  # noqa: E402
from bench.loadgen import LoadResult, stream_completion  # noqa: E402
from deployments.routing.kv_blocks import DEFAULT_LOAD_COST_TOKENS  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config  # noqa: E402
from tests.ray_metrics import scrape, settled, total  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP = "summit"
POLICIES = {"p2c": "least_load", "affinity": "prefix_affinity", "kv": "kv_cache"}
TOKENS_PER_WORD = 1.5  # the tiny model's tokenizer on the loads' words (app/clusters/tiny_model.py)
CPU_BLOCK_TOKENS = 128  # vLLM's KV block on its CPU backend


def kv_bytes_per_token(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2  # K and V, bf16


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
    config["applications"][0]["args"]["models"] = [
        {
            **base,
            "name": name,
            "source": model_dir,
            "engine_kwargs": engine,
            "deployment": {**base["deployment"], "num_replicas": ns.replicas},
            "routing": {"policy": policy},
        }
        for name, policy in POLICIES.items()
    ]
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


def cache_totals(cluster: LocalCluster, model: str, replicas: int) -> dict[str, float]:
    """vLLM's prefix-cache counters of the model's engines, summed, as Ray's metrics endpoint exports them."""

    def read() -> dict[str, float]:
        s = scrape(cluster)
        return {k: total(s, f"ray_vllm_prefix_cache_{k}_total", model_name=model) for k in ("queries", "hits")}

    return settled(read)


def measure(cluster: LocalCluster, ns: argparse.Namespace, model: str, prompts: list[str]) -> dict:
    warm = [f"Warm-up {i}: a short prompt that shares nothing." for i in range(2 * ns.replicas)]
    asyncio.run(run_policy(cluster.base_url, model, warm, ns.replicas, 4))  # first requests after start are slow
    before = cache_totals(cluster, model, ns.replicas)
    result, replicas = asyncio.run(run_policy(cluster.base_url, model, prompts, ns.concurrency, ns.max_tokens))
    after = cache_totals(cluster, model, ns.replicas)
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {
        "result": result,
        "replicas": sorted(replicas.values(), reverse=True),
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries else float("nan"),
    }


def median_row(runs: list[dict]) -> dict:
    """One policy's rounds on one load: the median of each figure."""
    import statistics

    keys = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "hit_rate", "errors")
    rows = [{**f["result"].row(), "hit_rate": f["hit_rate"]} for f in runs]
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
    ns = p.parse_args()

    model_dir = ns.model_dir
    if model_dir is None:
        from app.clusters.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-bench-")) / "tiny-llama"))
    cache_words = round(ns.kv_cache_tokens / TOKENS_PER_WORD)
    # the replay counts a word as a token: the CPU engine's blocks and kv_cache's load cost, in words
    shape = {
        "replicas": ns.replicas,
        "cache_words": cache_words,
        "block_size": round(CPU_BLOCK_TOKENS / TOKENS_PER_WORD),
    }
    predicted = {
        load: {
            name: routing_loads.replayed(
                load,
                policy,
                3,
                **shape,
                **({"load_cost_tokens": round(DEFAULT_LOAD_COST_TOKENS / TOKENS_PER_WORD)} if name == "kv" else {}),
            )
            for name, policy in POLICIES.items()
        }
        for load in ns.loads
    }

    cluster = LocalCluster(num_cpus=6, env={"SUMMIT_TINY_MODEL": model_dir}, fast_metrics=True)  # read: hit rates
    figures: dict[str, dict[str, dict]] = {}
    described: dict[str, dict] = {}
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.serve_deploy(app_config(ns, model_dir), timeout_s=ns.start_timeout)
        print(f"{len(POLICIES) * ns.replicas} engines ready in {time.monotonic() - t0:.0f} s", flush=True)
        for load in ns.loads:
            runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
            for round_ in range(ns.rounds):
                drawn = routing_loads.make(load, cache_words, ns.replicas, seed=round_)
                prompts = drawn.prompts
                described[load] = {"about": drawn.about, "requests": len(prompts), "replayed_hit_rate": predicted[load]}
                print(
                    f"{load} round {round_ + 1}: {drawn.about}; {len(prompts)} requests at concurrency "
                    f"{ns.concurrency}; KV cache {ns.kv_cache_tokens} tokens per replica",
                    flush=True,
                )
                order = list(POLICIES) if round_ % 2 == 0 else list(reversed(POLICIES))
                for name in order:
                    runs[name].append(measure(cluster, ns, name, prompts))
            figures[load] = {name: median_row(r) for name, r in runs.items()}
    finally:
        cluster.stop()

    for load, by_policy in figures.items():
        print(
            f"\n{load}: {described[load]}\n{'policy':<10}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
            f"{'tok/s':>9}{'errors':>8}  requests per replica"
        )
        for name, f in by_policy.items():
            print(
                f"{name:<10}{f['hit_rate']:>10.1%}{f['ttft_p50_ms']:>13.1f}{f['ttft_p99_ms']:>13.1f}"
                f"{f['out_tok_s']:>9.1f}{f['errors']:>8}  {f['requests_per_replica']}  "
                f"(replayed: {described[load]['replayed_hit_rate'][name]:.1%})"
            )
        b = by_policy["p2c"]
        for name in ("affinity", "kv"):
            a = by_policy[name]
            print(
                f"{name} / p2c: hit rate {a['hit_rate'] / b['hit_rate']:.2f}x, "
                f"TTFT p50 {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x, "
                f"TTFT p99 {a['ttft_p99_ms'] / b['ttft_p99_ms']:.2f}x, "
                f"tok/s {a['out_tok_s'] / b['out_tok_s']:.2f}x"
            )
    if ns.json:
        rows = [
            {"peer": POLICIES[name], "policy": POLICIES[name], "load": load, **f}
            for load, by_policy in figures.items()
            for name, f in by_policy.items()
        ]
        Path(ns.json).write_text(json.dumps({"args": vars(ns), "loads": described, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
