"""Prefill/decode disaggregation: Summit's (1 prefill + 1 decode replica) vs Summit aggregated (2 replicas) vs vLLM's
own two-server disaggregation (prefill and decode `vllm serve` behind bench/pd_proxy.py), same engines, connector
and load, one after the other in one run. Long prompts, streamed answers: TTFT p50/p99, time per output token
(TPOT) p50/p99 and output tok/s at each concurrency; for Summit's disaggregation also the decode replica's phases
(prefill pool's answer, KV load + first token, stream: p50/p99 from its log lines).

    # the 2-core CPU box (rehearsal): tiny model, vLLM's shared-storage connector
    python bench/pd.py --concurrency 4 8 --prompt-words 600 --max-tokens 64
    # two GPUs (Llama-3.1-8B shapes, dummy weights, NIXL): see scripts/gpu_host.sh pd
    python bench/pd.py --model-dir DIR --accelerator gpu --load-format dummy --connector nixl \\
        --concurrency 8 32 128 --prompt-words 1500 --max-tokens 256 --client-procs 8

Not a test: nothing is asserted. `--json FILE` writes `[{peer, concurrency, out_tok_s, ttft_p50_ms, ttft_p99_ms,
tpot_p50_ms, tpot_p99_ms, ...}]`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import LoadResult, percentile  # noqa: E402
from bench.serve_overhead import (
    MODEL,
    cli_flags,
    engine_env,
    engine_kwargs,
    run_loads,
    serve_app_config,
    serve_peer,  # noqa: E402
    wait_http,
)
from deployments.engine import connector_engine_kwargs, kv_transfer_config  # noqa: E402
from deployments.observability.watch import PD_PHASES, pd_phase_lines  # noqa: E402
from tests.local_cluster import LOOPBACK, free_port, loopback_env  # noqa: E402


def connector_config(ns: argparse.Namespace, tag: str) -> dict:
    if ns.connector == "shared_storage":
        return {"shared_storage_path": tempfile.mkdtemp(prefix=f"pd-kv-{tag}-")}
    return {}


def buffer_device(ns: argparse.Namespace) -> str:
    return "cpu" if ns.accelerator == "cpu" else "cuda"


def summit_model(ns: argparse.Namespace, model_dir: str, **fields) -> dict:
    return {
        "name": MODEL,
        "source": model_dir,
        "accelerator": ns.accelerator,
        "engine_kwargs": engine_kwargs(ns),
        "deployment": {"num_cpus": 0.5 if ns.accelerator == "cpu" else 1},
        # every token sent as it comes: TPOT is measured between chunks, which coalescing would merge
        "stream_coalesce_ms": 0,
        **fields,
    }


def summit_config(ns: argparse.Namespace, model: dict) -> dict:
    return serve_app_config(ns, {"models": [model]})


class DecodePhases:
    """After each load, the phases the decode replica logged for its requests (one line per disaggregated request,
    deployments/observability/watch.py): p50/p99 of each, added to the load's row."""

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, cluster, result: LoadResult) -> None:
        lines = []
        for request_id, phases in pd_phase_lines(cluster.temp_dir / "session_latest" / "logs" / "serve"):
            if request_id not in self.seen:
                self.seen.add(request_id)
                lines.append(phases)
        new: dict[str, list[float]] = {}
        for phases in lines[-result.requests :]:  # the load's own requests (the warm-up's came first)
            for phase, ms in phases.items():
                new.setdefault(phase, []).append(ms)
        result.extra["pd_requests_logged"] = len(new.get("prefill", []))
        for phase, values in new.items():
            result.extra[f"{phase}_p50_ms"] = round(percentile(values, 50), 1)
            result.extra[f"{phase}_p99_ms"] = round(percentile(values, 99), 1)
        print(
            f"  c={result.concurrency} decode replica's phases (p50/p99 ms): "
            + ", ".join(f"{p} {result.extra.get(p + '_p50_ms')}/{result.extra.get(p + '_p99_ms')}" for p in PD_PHASES),
            flush=True,
        )


def bench_summit_pd(ns, model_dir):
    model = summit_model(
        ns,
        model_dir,
        disaggregation={
            "connector": ns.connector,
            "connector_config": connector_config(ns, "summit"),
            "kv_buffer_device": buffer_device(ns),
        },
    )
    return serve_peer(ns, summit_config(ns, model), engine_env(ns), haproxy=True, observe=DecodePhases())


def bench_summit_agg(ns, model_dir):
    model = summit_model(ns, model_dir)
    model["deployment"]["num_replicas"] = 2
    return serve_peer(ns, summit_config(ns, model), engine_env(ns), haproxy=True)


def bench_vllm_pd(ns, model_dir):
    """Two `vllm serve` (prefill on GPU 0, decode on GPU 1) with the connector Summit would give them, and the proxy."""
    extra = connector_config(ns, "vllm")
    procs: list[subprocess.Popen] = []
    urls = {}
    try:
        t0 = time.monotonic()
        for index, role in enumerate(("prefill", "decode")):
            port = free_port()
            kv = kv_transfer_config(ns.connector, role, extra, buffer_device(ns), "recompute")
            flags = {**engine_kwargs(ns)}
            flags.update(connector_engine_kwargs(ns.connector, role, flags), kv_transfer_config=json.dumps(kv))
            if ns.accelerator == "gpu":
                flags["compilation_config"] = json.dumps({"pass_config": {"fuse_allreduce_rms": False}})
            env = {**engine_env(ns), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            if ns.accelerator == "gpu":
                env["CUDA_VISIBLE_DEVICES"] = "0" if ns.same_gpu else str(index)
            if ns.gpu_memory_utilization:
                flags["gpu_memory_utilization"] = ns.gpu_memory_utilization
            cmd = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--served-model-name",
                MODEL,
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--disable-uvicorn-access-log",
                *cli_flags(flags),
            ]
            log = open(Path(tempfile.gettempdir()) / f"bench-pd-{role}-{port}.log", "wb")
            procs.append(
                subprocess.Popen(
                    cmd, env=loopback_env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            urls[role] = f"http://{LOOPBACK}:{port}"
        for proc, url in zip(procs, urls.values()):
            wait_http(url + "/v1/models", proc, ns.start_timeout)
        port = free_port()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("pd_proxy.py")),
                    "--port",
                    str(port),
                    "--prefill",
                    urls["prefill"],
                    "--decode",
                    urls["decode"],
                ],
                env=loopback_env(),
                start_new_session=True,
            )
        )
        wait_http(f"http://{LOOPBACK}:{port}/v1/models", procs[-1], 60)
        return time.monotonic() - t0, run_loads(f"http://{LOOPBACK}:{port}", ns, [p.pid for p in procs])
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


PEERS = {"summit-pd": bench_summit_pd, "summit-agg": bench_summit_agg, "vllm-pd": bench_vllm_pd}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="model or config dir (default: make the tiny model)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--load-format", default=None)
    p.add_argument("--connector", default=None, help="default: shared_storage on CPU, nixl on GPUs")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--requests-per-stream", type=int, default=None)
    p.add_argument(
        "--prompt-words",
        type=int,
        default=600,
        help="words per prompt (≈ 1.5 tokens each on the tiny model's tokenizer; Llama's: ≈ 1.3)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--omp-threads", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--only", choices=list(PEERS), default=None)
    p.add_argument(
        "--same-gpu",
        action="store_true",
        help="vllm-pd only: both servers on GPU 0 (a one-GPU smoke test "
        "of the connector; give --gpu-memory-utilization 0.4)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm-pd only")
    p.add_argument("--json", help="also write the figures here")
    ns = p.parse_args()
    # Prompts share no KV block: every request's prefill is real work (what PD is for), and vLLM's shared-storage
    # example connector cannot load a prompt's KV beside a partial local prefix-cache hit (FACTS: the decode engine
    # dies with a shape mismatch), so shared leading blocks would measure that connector's bug instead.
    ns.models, ns.coalesce_ms, ns.distinct_prompts = 1, None, True
    ns.connector = ns.connector or ("shared_storage" if ns.accelerator == "cpu" else "nixl")
    model_dir = ns.model_dir
    if model_dir is None:
        from app.clusters.tiny_model import make_tiny_model

        model_dir = str(
            make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-bench-")) / "tiny-llama", max_len=ns.max_model_len)
        )
    results: dict[str, tuple[float, list[LoadResult]]] = {}
    for name, fn in PEERS.items():
        if ns.only in (None, name):
            results[name] = fn(ns, model_dir)
            print(f"{name}: ready in {results[name][0]:.1f} s", flush=True)
    print(
        f"\n{'peer':<12}{'conc':>6}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
        f"{'errors':>8}   (ms)"
    )
    for name, (_, rows) in results.items():
        for r in rows:
            print(
                f"{name:<12}{r.concurrency:>6}{r.tok_per_s:>10.1f}{r.ttft_pct(50) * 1e3:>10.1f}"
                f"{r.ttft_pct(99) * 1e3:>10.1f}{percentile(r.tpot_s or [], 50) * 1e3:>10.2f}"
                f"{percentile(r.tpot_s or [], 99) * 1e3:>10.2f}{r.errors:>8}"
            )
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                [
                    {"peer": name, "ready_s": round(ready, 1), **r.row()}
                    for name, (ready, rows) in results.items()
                    for r in rows
                ],
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
