"""Does prefix affinity pay? Power-of-two (least_load) vs prefix_affinity on the same shared-prefix workload, one run.

    python bench/routing.py                          # tiny model on CPU, 8 system prompts x 16 questions,
                                                     # 2 replicas each
    python bench/routing.py --kv-cache-tokens 65536  # a cache that holds every prefix on every replica

One app serves the same model twice, `p2c` (Serve's power-of-two choices) and `affinity` (PrefixAffinityRouter),
2 replicas each (4 engines). Each policy gets the same requests in the same order: every request is one of
`--systems` system prompts (≥ 256 tokens each) followed by a short question, streamed at `--concurrency`.
Prints, per policy, vLLM's own prefix-cache hit rate (`vllm:prefix_cache_hits / queries`, summed over the
replicas, read from Ray's metrics endpoint), TTFT p50/p99, output tok/s and how requests split over
replicas; then affinity's ratios to p2c. Not a test: nothing is asserted.

The default KV cache (`--kv-cache-tokens`) is sized so one replica holds about two thirds of the system prompts: the
case that matters in production, where the prompts in use outnumber what one replica's cache keeps. Under p2c
every replica sees every prompt and evicts; under affinity each sees half of them. With a cache that holds
everything, p2c only misses each prompt once per replica and the difference shrinks to those misses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import LoadResult, stream_completion  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config  # noqa: E402
from tests.ray_metrics import scrape, settled, total  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP = "summit"
POLICIES = {"p2c": "least_load", "affinity": "prefix_affinity"}


def system_prompts(n: int, words: int) -> list[str]:
    """Distinct system prompts, different from their first characters on (the router keys on the leading block)."""
    from app.clusters.tiny_model import _WORDS

    out = []
    for i in range(n):
        rng = random.Random(1000 + i)
        out.append(
            f"System prompt {i}. You answer as assistant number {i}. "
            + " ".join(rng.choice(_WORDS) for _ in range(words))
            + "\n"
        )
    return out


def workload(systems: list[str], questions: int, seed: int = 0) -> list[str]:
    prompts = [f"{s}Question {q}: what does rule {q} say?" for s in systems for q in range(questions)]
    random.Random(seed).shuffle(prompts)
    return prompts


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="model dir (default: make the tiny model)")
    p.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    p.add_argument(
        "--system-words",
        type=int,
        default=330,
        help="words per system prompt (≈ 1.5 tokens each on the tiny tokenizer)",
    )
    p.add_argument("--questions", type=int, default=16, help="questions per system prompt")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2, help="replicas per policy")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-tokens", type=int, default=2816, help="KV cache per replica, in tokens")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--json", help="also write the figures here")
    ns = p.parse_args()

    model_dir = ns.model_dir
    if model_dir is None:
        from app.clusters.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-bench-")) / "tiny-llama"))
    systems = system_prompts(ns.systems, ns.system_words)
    prompts = workload(systems, ns.questions)

    cluster = LocalCluster(num_cpus=4, env={"SUMMIT_TINY_MODEL": model_dir})
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.serve_deploy(app_config(ns, model_dir), timeout_s=ns.start_timeout)
        print(f"4 engines ready in {time.monotonic() - t0:.0f} s", flush=True)
        tokens = [
            len(
                httpx.post(cluster.base_url + "/tokenize", json={"model": "p2c", "prompt": s}, timeout=60).json()[
                    "tokens"
                ]
            )
            for s in systems
        ]
        print(
            f"{ns.systems} system prompts of {min(tokens)}-{max(tokens)} tokens x {ns.questions} questions = "
            f"{len(prompts)} requests at concurrency {ns.concurrency}; KV cache {ns.kv_cache_tokens} tokens "
            f"per replica = {ns.kv_cache_tokens / sum(tokens):.0%} of all system prompts",
            flush=True,
        )
        figures = {name: measure(cluster, ns, name, prompts) for name in POLICIES}
    finally:
        cluster.stop()

    print(
        f"\n{'policy':<10}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'tok/s':>9}{'errors':>8}"
        "  requests per replica"
    )
    for name, f in figures.items():
        r = f["result"]
        print(
            f"{name:<10}{f['hit_rate']:>10.1%}{r.ttft_pct(50) * 1e3:>13.1f}{r.ttft_pct(99) * 1e3:>13.1f}"
            f"{r.tok_per_s:>9.1f}{r.errors:>8}  {f['replicas']}"
        )
    a, b = figures["affinity"], figures["p2c"]
    print(
        f"affinity / p2c: hit rate {a['hit_rate'] / b['hit_rate']:.2f}x, "
        f"TTFT p50 {a['result'].ttft_pct(50) / b['result'].ttft_pct(50):.2f}x, "
        f"TTFT p99 {a['result'].ttft_pct(99) / b['result'].ttft_pct(99):.2f}x"
    )
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                {
                    "args": vars(ns),
                    "system_prompt_tokens": tokens,
                    "policies": {
                        n: {
                            **f["result"].row(),
                            "hit_rate": f["hit_rate"],
                            "queries": f["queries"],
                            "hits": f["hits"],
                            "requests_per_replica": f["replicas"],
                        }
                        for n, f in figures.items()
                    },
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
