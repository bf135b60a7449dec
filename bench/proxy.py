"""Ray Serve's default (Python) proxy vs its HAProxy option, same Summit app and load, one after the other in one run.

    python bench/proxy.py                      # tiny model on CPU; both proxies
    python bench/proxy.py --rounds 2           # alternate the peers twice (default, proxy, default, proxy)

`RAY_SERVE_ENABLE_HA_PROXY=1` (read by the Serve controller, so set where `ray start` runs) replaces the Python
proxy actor with HAProxy, which forwards each HTTP request straight to an ingress replica's own HTTP port; Summit
then builds its direct path (the engine replica is the ingress), so this compares the two-hop path (Python proxy ->
OpenAIIngress -> LLMServer) with the direct path (HAProxy -> LLMServer). Each peer gets its own private
cluster and serve_configs/tiny-cpu.yaml, then two loads:

- `short`: non-streamed completions of 1 token at `--short-concurrency`: requests/s and latency p50/p99, where
  the proxy's own per-request cost is the largest share;
- `stream`: streamed completions of `--max-tokens` tokens at `--concurrency`: output tok/s and TTFT p50/p99,
  where every SSE chunk also crosses the proxy.

Prints both peers' figures and HAProxy's ratios to the default. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import LoadResult, make_prompts, percentile, run_load  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
PEERS = {"default": False, "haproxy": True}


async def short_requests(base_url: str, n: int, concurrency: int) -> dict:
    """`n` non-streamed 1-token completions with `concurrency` in flight: req/s and latency percentiles."""
    latencies: list[float] = []
    errors = 0
    prompts = iter(make_prompts(n, 8, seed=7))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker():
            nonlocal errors
            for prompt in prompts:
                t = time.perf_counter()
                r = await client.post(
                    base_url + "/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                )
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {
        "req_s": len(latencies) / wall,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "errors": errors,
    }


def bench_peer(name: str, haproxy: bool, ns: argparse.Namespace, model_dir: str) -> dict:
    cluster = LocalCluster(num_cpus=4, env={"SUMMIT_TINY_MODEL": model_dir}, haproxy=haproxy)
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.serve_deploy(config)
        ready = time.monotonic() - t0
        listening = _listeners(cluster)
        asyncio.run(short_requests(cluster.base_url, 32, 4))  # warm-up
        short = asyncio.run(short_requests(cluster.base_url, ns.short_requests, ns.short_concurrency))
        stream: LoadResult = asyncio.run(
            run_load(cluster.base_url, MODEL, make_prompts(ns.requests, 16), ns.concurrency, ns.max_tokens)
        )
    finally:
        cluster.stop()
    print(f"{name}: ready in {ready:.0f} s; HTTP listeners of Serve: {listening}", flush=True)
    return {"ready_s": ready, "short": short, "stream": stream.row()}


def _listeners(cluster: LocalCluster) -> list[str]:
    """Addresses Serve's processes listen on for HTTP (the proxy port, and replicas' direct-ingress ports)."""
    import psutil

    procs = [psutil.Process(cluster.proc.pid), *psutil.Process(cluster.proc.pid).children(recursive=True)]
    pids = {p.pid for p in procs}
    out = set()
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            name = psutil.Process(c.pid).name()
            if "haproxy" in name or c.laddr.port == cluster.http_port or name.startswith("ray::Serve"):
                out.add(f"{name}@{c.laddr.ip}:{c.laddr.port}")
    return sorted(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1, help="alternate the peers this many times")
    p.add_argument("--short-requests", type=int, default=400)
    p.add_argument("--short-concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", help="also write the figures here")
    ns = p.parse_args()

    from app.clusters.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-bench-")) / "tiny-llama"))
    runs: dict[str, list[dict]] = {name: [] for name in PEERS}
    for _ in range(ns.rounds):
        for name, haproxy in PEERS.items():
            runs[name].append(bench_peer(name, haproxy, ns, model_dir))

    print(
        f"\n{'proxy':<9}{'short req/s':>12}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'stream tok/s':>14}{'TTFT p50':>10}{'TTFT p99':>10}{'err':>5}"
    )
    for name, rows in runs.items():
        for r in rows:
            s, t = r["short"], r["stream"]
            print(
                f"{name:<9}{s['req_s']:>12.1f}{s['p50_ms']:>9.1f}{s['p99_ms']:>9.1f}{t['out_tok_s']:>14.1f}"
                f"{t['ttft_p50_ms']:>10.1f}{t['ttft_p99_ms']:>10.1f}{s['errors'] + t['errors']:>5}"
            )
    for d, h in zip(runs["default"], runs["haproxy"]):
        print(
            f"ratio haproxy/default: short req/s {h['short']['req_s'] / d['short']['req_s']:.2f}x, "
            f"latency p50 {h['short']['p50_ms'] / d['short']['p50_ms']:.2f}x; "
            f"stream tok/s {h['stream']['out_tok_s'] / d['stream']['out_tok_s']:.2f}x, "
            f"TTFT p50 {h['stream']['ttft_p50_ms'] / d['stream']['ttft_p50_ms']:.2f}x"
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
