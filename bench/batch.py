"""Batch throughput: Summit's online Batch API vs the offline `summit batch` command vs vLLM's own offline
`LLM.generate`, on the same model and engine settings, one after the other in one run; and online TTFT (16 streams)
with no batch running vs while the batch API works through a second run of the same batch (the first runs alone:
its throughput).

    python bench/batch.py                       # 2,000 completion lines on the tiny model (CPU)
    python bench/batch.py --lines 200 --max-tokens 8 --online-requests 32   # quick rehearsal
    # one GPU, Llama-3.1-8B shapes, dummy weights (scripts/gpu_host.sh batch PEER):
    python bench/batch.py --model-dir DIR --accelerator gpu --load-format dummy --max-num-seqs 256 \
        --batch-concurrency 256 --offline-concurrency 256 --max-tokens 64 --only api

Output tok/s of each peer counts the time from the start of its work to its last line (engines already loaded: the
batch API from `batches.create` to `completed`; the command from its first line to its last; LLM.generate its call).
`--json FILE` writes `[{peer, concurrency, out_tok_s, ttft_p50_ms, ttft_p99_ms, ...}]`. Not a test: nothing asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import LoadResult, make_prompts, run_load  # noqa: E402
from tests.local_cluster import LocalCluster, load_serve_config, loopback_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"


def batch_lines(ns) -> list[dict]:
    prompts = make_prompts(ns.lines, ns.prompt_words, seed=3)
    return [
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": p, "max_tokens": ns.max_tokens, "temperature": 0, "ignore_eos": True},
        }
        for i, p in enumerate(prompts)
    ]


def engine_kwargs(ns) -> dict:
    kwargs = {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": ns.max_num_seqs}
    if ns.accelerator == "cpu":
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    if ns.load_format:
        kwargs["load_format"] = ns.load_format
    if ns.priority:
        kwargs["scheduling_policy"] = "priority"
    return kwargs


def serve_config(ns, model_dir: str) -> dict:
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    app = config["applications"][0]
    app["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    model = app["args"]["models"][0]
    model["source"] = model_dir
    model["engine_kwargs"] = engine_kwargs(ns)
    model["accelerator"] = ns.accelerator
    if ns.accelerator == "gpu":
        model["deployment"]["num_cpus"] = 1
    app["args"]["batch"] = {
        **app["args"].get("batch", {}),
        "max_concurrency": ns.batch_concurrency,
        "online_share": ns.online_share,
    }
    return config


def bench_api(ns, model_dir: str, lines: list[dict]) -> list[dict]:
    """The Batch API on the direct path; online TTFT before and during the batch."""
    import openai

    cluster = LocalCluster(num_cpus=max(4, os.cpu_count() or 4), env=bench_env(ns), haproxy=True)
    rows = []
    try:
        cluster.start()
        cluster.serve_deploy(serve_config(ns, model_dir), timeout_s=900)
        online = make_prompts(ns.online_requests, 40, seed=9)
        asyncio.run(run_load(cluster.base_url, MODEL, online[:8], 8, 4))  # warm-up
        alone = asyncio.run(run_load(cluster.base_url, MODEL, online, 16, ns.online_max_tokens))
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", timeout=120)
        data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        infile = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")

        def run_batch(online_load: bool):
            t0 = time.monotonic()
            batch = client.batches.create(input_file_id=infile.id, endpoint="/v1/completions", completion_window="24h")
            during = done_during = None
            while online_load:  # online load once the batch is well under way
                b = client.batches.retrieve(batch.id)
                if b.status != "validating" and b.request_counts and b.request_counts.completed >= 0.1 * len(lines):
                    during = asyncio.run(run_load(cluster.base_url, MODEL, online, 16, ns.online_max_tokens))
                    before = b.request_counts.completed
                    done_during = client.batches.retrieve(batch.id).request_counts.completed - before
                    break
                time.sleep(0.2)
            ended = ("completed", "failed", "expired", "cancelled")
            progress = []  # (seconds since create, lines completed), about one a second
            while (b := client.batches.retrieve(batch.id)).status not in ended:
                done_now = b.request_counts.completed if b.request_counts else 0
                if not progress or time.monotonic() - t0 - progress[-1][0] >= 1:
                    progress.append((round(time.monotonic() - t0, 1), done_now))
                time.sleep(0.2)
            wall = time.monotonic() - t0
            out = client.files.content(b.output_file_id).content.decode().splitlines() if b.output_file_id else []
            tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out)
            peer = "summit-batch-api" + ("+online" if online_load else "")
            summary = row(peer, ns.batch_concurrency, tokens, wall, completed=len(out), failed=b.request_counts.failed)
            summary["progress"] = progress
            return summary, during, done_during

        # the batch alone (its throughput; --rounds times, the median kept), then again with the online load while
        # it runs (online TTFT)
        rows.append(median_row([run_batch(False)[0] for _ in range(ns.rounds)]))
        with_online, during, done_during = run_batch(True)
        rows.append(with_online)
        rows.append(online_row("online-16", alone))
        rows.append(online_row("online-16+batch", during, batch_lines_done_during_load=done_during))
    finally:
        cluster.stop()
    return rows


def bench_offline(ns, model_dir: str, lines: list[dict], ray_data: bool = False) -> list[dict]:
    """`summit batch` (each round its own start: the command deploys, runs and stops)."""
    return [median_row([offline_round(ns, model_dir, lines, ray_data)[0] for _ in range(ns.offline_rounds)])]


def offline_round(ns, model_dir: str, lines: list[dict], ray_data: bool) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    infile, out = tmp / "in.jsonl", tmp / "out.jsonl"
    infile.write_text("".join(json.dumps(x) + "\n" for x in lines))
    config = serve_config(ns, model_dir)
    config["applications"][0]["args"].pop("batch")
    (tmp / "c.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "batch",
            str(infile),
            "-o",
            str(out),
            "--config",
            str(tmp / "c.yaml"),
            "--num-cpus",
            "4",
            "--no-progress",
            "--concurrency",
            str(ns.offline_concurrency),
            *(["--ray-data"] if ray_data else []),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=loopback_env({"RAY_AUTH_MODE": "disabled", **bench_env(ns)}),
    )
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    return [
        row(
            "summit-ray-data" if ray_data else "summit-offline",
            ns.offline_concurrency,
            summary["output_tokens"],
            summary["seconds"],
            completed=summary["completed"],
            failed=summary["failed"],
        )
    ]


def bench_generate(ns, model_dir: str, lines: list[dict]) -> list[dict]:
    """vLLM's LLM.generate in a child process (its own engine), the same prompts and sampling."""
    code = f"""
import json, time, sys
from vllm import LLM, SamplingParams
lines = [json.loads(x) for x in open({str(ns._in)!r})]
llm = LLM(model={model_dir!r}, **json.loads({json.dumps(json.dumps(generate_kwargs(ns)))}))
params = SamplingParams(max_tokens={ns.max_tokens}, temperature=0, ignore_eos=True)
llm.generate([x["body"]["prompt"] for x in lines[:8]], params, use_tqdm=False)
for _ in range({ns.rounds}):
    t0 = time.monotonic()
    outs = llm.generate([x["body"]["prompt"] for x in lines], params, use_tqdm=False)
    wall = time.monotonic() - t0
    print("BENCH_RESULT " + json.dumps({{"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall": wall}}),
          flush=True)
"""
    env = loopback_env({"RAY_AUTH_MODE": "disabled", **bench_env(ns)})
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    results = [json.loads(x[13:]) for x in run.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    return [median_row([row("vllm-generate", ns.lines, r["tokens"], r["wall"]) for r in results])]


def bench_env(ns) -> dict[str, str]:
    """Every peer's engine environment: one OpenMP thread on CPU; NVLink multicast off on GPUs."""
    if ns.accelerator == "gpu":
        from deployments.engine import NO_NVLINK_MULTICAST_ENV

        return dict(NO_NVLINK_MULTICAST_ENV)
    return {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def generate_kwargs(ns) -> dict:
    """LLM.generate's engine: Summit's settings, and on GPUs what Summit's adapter sets for every GPU engine."""
    kwargs = engine_kwargs(ns)
    if ns.accelerator == "gpu":
        kwargs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    return kwargs


def row(peer: str, concurrency: int, tokens: int, wall: float, **extra) -> dict:
    return {
        "peer": peer,
        "concurrency": concurrency,
        "out_tok_s": round(tokens / wall, 1),
        "ttft_p50_ms": None,
        "ttft_p99_ms": None,
        "output_tokens": tokens,
        "seconds": round(wall, 2),
        **extra,
    }


def median_row(rounds: list[dict]) -> dict:
    """The round with the median tok/s, every round's tok/s beside it (`rounds`)."""
    ordered = sorted(rounds, key=lambda r: r["out_tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds": [r["out_tok_s"] for r in rounds]}


def online_row(peer: str, r: LoadResult, **extra) -> dict:
    return {
        "peer": peer,
        "concurrency": r.concurrency,
        "out_tok_s": round(r.tok_per_s, 1),
        "ttft_p50_ms": round(r.ttft_pct(50) * 1e3, 1),
        "ttft_p99_ms": round(r.ttft_pct(99) * 1e3, 1),
        "errors": r.errors,
        **extra,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="model or config dir (default: make the tiny model)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--load-format", default=None, help="e.g. dummy (random weights for a config-only dir)")
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--batch-concurrency", type=int, default=64, help="the app's batch.max_concurrency")
    p.add_argument("--offline-concurrency", type=int, default=64)
    p.add_argument(
        "--priority",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="engines schedule by priority (batch lines below online requests; measured 3x slower on vLLM 0.26)",
    )
    p.add_argument(
        "--online-share", type=float, default=0.1, help="the app's batch.online_share (batch beside online requests)"
    )
    p.add_argument("--online-requests", type=int, default=64)
    p.add_argument("--online-max-tokens", type=int, default=16)
    p.add_argument("--only", choices=["api", "offline", "ray-data", "generate"], nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=1, help="runs of LLM.generate and of the Batch API alone (median)")
    p.add_argument("--offline-rounds", type=int, default=1, help="runs of `summit batch` (each starts the app)")
    p.add_argument("--json", help="also write the figures here")
    ns = p.parse_args()
    from app.clusters.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    model_dir = ns.model_dir or str(make_tiny_model(tmp / "tiny-llama", max_len=2048))
    lines = batch_lines(ns)
    ns._in = tmp / "lines.jsonl"
    ns._in.write_text("".join(json.dumps(x) + "\n" for x in lines))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows: list[dict] = []

    def bench_ray_data(ns, model_dir, lines):
        return bench_offline(ns, model_dir, lines, ray_data=True)

    for name, fn in (
        ("api", bench_api),
        ("offline", bench_offline),
        ("ray-data", bench_ray_data),
        ("generate", bench_generate),
    ):
        if ns.only is None or name in ns.only:
            t0 = time.monotonic()
            rows += fn(ns, model_dir, lines)
            print(f"{name}: {time.monotonic() - t0:.0f} s: {rows[-1]}", flush=True)
    generate = next((r["out_tok_s"] for r in rows if r["peer"] == "vllm-generate"), None)
    alone = next((r["ttft_p50_ms"] for r in rows if r["peer"] == "online-16"), None)
    print(f"\n{'peer':<18}{'conc':>6}{'tok/s':>10}{'vs generate':>13}{'TTFT p50':>10}{'TTFT p99':>10}")
    for r in rows:
        ratio = f"{r['out_tok_s'] / generate:.2f}x" if generate and r["ttft_p50_ms"] is None else ""
        ttft = f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}" if r["ttft_p50_ms"] is not None else ""
        print(f"{r['peer']:<18}{r['concurrency']:>6}{r['out_tok_s']:>10.1f}{ratio:>13}{ttft}")
    during = next((r["ttft_p50_ms"] for r in rows if r["peer"] == "online-16+batch"), None)
    if alone and during:
        print(f"online TTFT p50 under a running batch: {during / alone:.2f}x of no batch (goal <= 1.2x)")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
