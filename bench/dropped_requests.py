"""Requests that are no stream, dropped by their client (the official client's read timeout), through HAProxy on the
direct path: was each aborted in the engine, and how much CPU did HAProxy spend meanwhile. A private CPU cluster with
the tiny model (serve_configs/tiny-cpu.yaml, one front process).

    python bench/dropped_requests.py --trials 8                  # as shipped
    python bench/dropped_requests.py --trials 8 --keep-splicing  # Serve's HAProxy config as Serve writes it

Measured on 2 cores (2026-11-28): as shipped 12 of 12 aborted over two runs (HAProxy ~0 CPU-s); with Serve's
`option splice-request` / `splice-response` kept, 2 of 8 and 3 of 6 (the others generated all 2,000 tokens while
HAProxy spun a core: 5-7 CPU-s each). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.clusters.tiny_model import make_tiny_model  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config  # noqa: E402
from tests.replica_probe import probe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--keep-splicing", action="store_true", help="HAProxy with Serve's splice options")
    ns = p.parse_args()
    model_dir = Path.home() / ".cache/summit/models/tiny-llama"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir)
    env = {"SUMMIT_TINY_MODEL": str(model_dir)}
    if ns.keep_splicing:
        env["SUMMIT_HAPROXY_KEEP_SPLICING"] = "1"
    cluster = LocalCluster(num_cpus=4, env=env, haproxy=True)
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    model = config["applications"][0]["args"]["models"][0]
    model["front_processes"] = 1
    body = {"model": model["name"], "max_tokens": ns.max_tokens, "ignore_eos": True}
    try:
        cluster.start()
        cluster.serve_deploy(config)

        def stats() -> dict:
            answers = probe(cluster.address, "each", "summit", f"LLMServer:{model['name']}", "stats", "--replicas", "1")
            return next(iter(answers.values()))

        def haproxy_cpu_s() -> float:
            procs = psutil.process_iter(["name", "cpu_times"])
            return sum(sum(p.info["cpu_times"][:2]) for p in procs if p.info["name"] == "haproxy")

        aborted = 0
        for trial in range(ns.trials):
            tokens, cpu = stats()["generation_tokens"], haproxy_cpu_s()
            try:
                httpx.post(cluster.base_url + "/v1/completions", json={**body, "prompt": f"x{trial}"}, timeout=1)
            except httpx.ReadTimeout:
                pass
            deadline = time.monotonic() + 60
            while stats()["num_unfinished_requests"] and time.monotonic() < deadline:
                time.sleep(1)
            generated = stats()["generation_tokens"] - tokens
            aborted += generated < ns.max_tokens
            print(f"trial {trial}: {generated} tokens generated, HAProxy {haproxy_cpu_s() - cpu:.2f} CPU-s", flush=True)
        print(f"{aborted} of {ns.trials} dropped requests aborted")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
