"""Moving a stream off a live replica: its KV cache carried over the model's KV connector (`kv_migration`) against
the other replica recomputing it (`move_streams(recompute=True)`), one app, alternating rounds at each context length.

Each round: `--background` long streams run on the target replica; a stream of `context` prompt tokens (random token
ids, distinct per round: neither engine has them cached) streams from the source replica's own port; after
`--events-before` of its events the source is told to move it. Figures, medians over the rounds:
- cut -> next token: the longest gap between two of the moved stream's events after the move was asked (the cut,
  the hand-off, the other engine loading or computing the context, its first token);
- the background streams' time per output token in the window from the move to 1 s after the moved stream's next
  token, against the second before the move;
- the tokens of context the other engine loaded through its connector (vLLM's `prompt_tokens_by_source`).

    # the 2-core CPU box (rehearsal): tiny model, vLLM's shared-storage connector
    python bench/kv_migration.py --contexts 300 900 --rounds 3 --json /tmp/kvm.json
    # two GPUs (Llama-3.1-8B shapes, dummy weights, NIXL): scripts/gpu_host.sh kv-migration
    python bench/kv_migration.py --accelerator gpu --model-dir DIR --load-format dummy \\
        --contexts 1024 8192 32768 --max-model-len 40000 --rounds 3 --json results.json

Not a test: nothing is asserted. `--json FILE` writes one row a mode and context: {peer (summit-kv-carried |
summit-recompute), concurrency (the moved stream + the background ones), context_tokens, cut_to_next_token_p50_ms
(also as ttft_p50_ms: the continuation's first token, seen by the client) and _p99, target_tpot_before_ms,
target_tpot_during_ms, out_tok_s (the background streams' during the move), loaded_tokens_p50, decisions,
move_call_p50_ms (the move's call: the source's cut and hand-off), nixl_{transfers,xfer_s,post_s,mib,descriptors}_p50
(the target's NIXL reads of one move, from vLLM's own NIXL metrics; 0 with another connector),
serving_cpu_s_per_1k_tok: null}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.build.options import DIRECT_PATH_ENV  # noqa: E402
from bench.engines import gpu_cluster_env, multicast_hits  # noqa: E402
from bench.loadgen import percentile  # noqa: E402
from bench.serve_overhead import MODEL, engine_kwargs, serve_app_config  # noqa: E402
from tests.cpu.engine_apps import replica_ports  # noqa: E402
from tests.local_cluster import RAY_WORKER_PRESTART, LocalCluster  # noqa: E402
from tests.replica_probe import probe  # noqa: E402

POOL = f"LLMServer:{MODEL}"
MODES = {"summit-kv-carried": False, "summit-recompute": True}  # peer -> move_streams(recompute=...)


def summit_config(ns: argparse.Namespace, model_dir: str, storage: str) -> dict:
    connector_config = {"shared_storage_path": storage} if ns.connector == "shared_storage" else {}
    engine = engine_kwargs(ns)
    if ns.block_size:
        engine["block_size"] = ns.block_size
    if ns.accelerator == "gpu" and ns.eager:
        engine["enforce_eager"] = True  # two engines start in minutes, not more (the stall is a prefill or a load)
    model = {
        "name": MODEL,
        "source": model_dir,
        "accelerator": ns.accelerator,
        "engine_kwargs": engine,
        "deployment": {"num_replicas": 2, "num_cpus": 0.5 if ns.accelerator == "cpu" else 1},
        "stream_coalesce_ms": 0,  # every token as it comes: the gaps are the engine's
        "kv_migration": {"connector": ns.connector, "connector_config": connector_config, "min_tokens": 1},
    }
    ucx = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}  # NIXL's transport, as this shell sets it
    return serve_app_config(ns, {"models": [model]}, ucx)


class Stream(threading.Thread):
    """One streamed completion of `prompt` (token ids) to `url`, each event's arrival time kept."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, request_id: str):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens, self.request_id = url, prompt, max_tokens, request_id
        self.times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST",
                self.url + "/v1/completions",
                json=body,
                headers={"x-request-id": self.request_id},
                timeout=600,
            ) as r:
                if r.status_code != 200:
                    self.error = f"{r.status_code} {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        if '"error"' in line[:20]:
                            self.error = line[:300]
                        self.times.append(time.monotonic())
        except httpx.HTTPError as e:
            self.error = repr(e)


def replica_urls(cluster, replicas: int = 2, timeout_s: float = 300) -> dict[str, str]:
    """Each replica's id -> its own URL (the direct path's ports), once `replicas` of them answer."""
    urls: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(urls) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sorted(urls)} of {replicas} replicas answered on their own ports")
        for host, port in replica_ports(cluster):
            try:
                r = httpx.post(
                    f"http://{host}:{port}/v1/completions",
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                    timeout=120,
                )
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                urls[r.headers["x-summit-replica"]] = f"http://{host}:{port}"
        time.sleep(1)
    return urls


def connector_stats(cluster) -> dict[str, dict[str, float]]:
    """Each replica's tokens loaded through its connector (`loaded`) and the connector's own counters (NIXL's
    transfer time, bytes, descriptors: `nixl_*`), so far."""
    answers = probe(cluster.address, "each", "summit", POOL, "stats", "--replicas", "2")
    return {
        rid: {"loaded": s["prompt_tokens_by_source"].get("external_kv_transfer", 0), **s.get("kv_connector", {})}
        for rid, s in answers.items()
    }


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def tpot(times: list[float], start: float, end: float) -> float | None:
    window = [t for t in times if start <= t <= end]
    gaps = [b - a for a, b in zip(window, window[1:])]
    return statistics.mean(gaps) if gaps else None


def one_round(ns, cluster, source: str, target: str, urls: dict, context: int, recompute: bool, rng) -> dict:
    vocab = ns.vocab
    rid = f"kvm-{context}-{int(recompute)}-{time.time_ns()}"
    background = [
        Stream(
            urls[target], [rng.randrange(100, vocab) for _ in range(64)], ns.background_tokens, f"bg-{i}-{rng.random()}"
        )
        for i in range(ns.background)
    ]
    before = connector_stats(cluster)  # idle: Summit's routers send the probe to both replicas
    for s in background:
        s.start()
    while background and any(len(s.times) < 8 for s in background if s.error is None):
        time.sleep(0.01)
    moved = Stream(urls[source], [rng.randrange(100, vocab) for _ in range(context)], ns.max_tokens, rid)
    moved.start()
    while len(moved.times) < ns.events_before and moved.error is None and moved.is_alive():
        time.sleep(0.002)
    asked = time.monotonic()
    answer, moved_s = (
        probe(
            cluster.address,
            "call",
            "summit",
            POOL,
            source,
            "move_streams",
            rid,
            "--kwargs",
            json.dumps({"recompute": recompute}),
        ),
        time.monotonic() - asked,
    )  # the call returns once the source decided (and handed its KV off)
    moved.join()
    decisions = [m for m in answer["moved"] if m.get("request_id") == rid]
    after_cut = [t for t in moved.times if t >= asked]
    earlier = [t for t in moved.times if t < asked][-1:]
    gaps = [b - a for a, b in zip(earlier + after_cut, after_cut)]
    stall = max(gaps) if gaps else None
    resumed_at = (earlier + after_cut)[gaps.index(stall) + 1] if gaps else asked
    for s in background:
        s.join()
    bg_before = [tpot(s.times, asked - 1.0, asked) for s in background]
    bg_during = [tpot(s.times, asked, resumed_at + 1.0) for s in background]
    during_tokens = sum(len([t for t in s.times if asked <= t <= resumed_at + 1.0]) for s in background)
    on_target = grown(before.get(target, {}), connector_stats(cluster).get(target, {}))
    return {
        "stall_s": stall,
        "move_call_s": moved_s,
        "loaded": on_target.get("loaded", 0),
        # the target's NIXL reads of this move: count, seconds in all, MiB, descriptors (GPU runs)
        "xfer": {
            "transfers": on_target.get("nixl_xfer_time_seconds_count", 0),
            "xfer_s": on_target.get("nixl_xfer_time_seconds_sum", 0),
            "post_s": on_target.get("nixl_post_time_seconds_sum", 0),
            "mib": on_target.get("nixl_bytes_transferred_sum", 0) / 2**20,
            "descriptors": on_target.get("nixl_num_descriptors_sum", 0),
        },
        "bg_before": statistics.mean([x for x in bg_before if x is not None] or [float("nan")]),
        "bg_during": statistics.mean([x for x in bg_during if x is not None] or [float("nan")]),
        "bg_tok_s": during_tokens / max(1e-9, resumed_at + 1.0 - asked),
        "decision": decisions[0] if decisions else None,
        "errors": [e for e in [moved.error, *(s.error for s in background)] if e],
    }


def log_lines(cluster, pattern: str) -> list[str]:
    """The lines of the cluster's logs that match `pattern` (a regular expression), each after its file's name."""
    found, wanted = [], re.compile(pattern)
    for path in sorted(cluster.temp_dir.rglob("*")):
        if path.is_file() and path.suffix in (".log", ".out", ".err"):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            found += [f"{path.name}: {line}\n" for line in text.splitlines() if wanted.search(line)]
    return found


def rows_of(results: dict[tuple[str, int], list[dict]], ns: argparse.Namespace) -> list[dict]:
    rows = []
    for (peer, context), every in results.items():
        got = [g for g in every if g["decision"] and g["decision"].get("kv") in ("kv", "recompute")]
        if not got:  # the stream ended before the move was asked: nothing measured
            continue
        stalls = [g["stall_s"] * 1e3 for g in got if g["stall_s"] is not None]
        rows.append(
            {
                "peer": peer,
                "concurrency": 1 + ns.background,
                "context_tokens": context,
                "rounds": len(got),
                "rounds_not_moved": len(every) - len(got),
                "cut_to_next_token_p50_ms": round(percentile(stalls, 50), 1),
                "cut_to_next_token_p99_ms": round(percentile(stalls, 99), 1),
                "ttft_p50_ms": round(percentile(stalls, 50), 1),
                "ttft_p99_ms": round(percentile(stalls, 99), 1),
                "target_tpot_before_ms": round(statistics.median(g["bg_before"] for g in got) * 1e3, 2),
                "target_tpot_during_ms": round(statistics.median(g["bg_during"] for g in got) * 1e3, 2),
                "out_tok_s": round(statistics.median(g["bg_tok_s"] for g in got), 1),
                "loaded_tokens_p50": statistics.median(g["loaded"] for g in got),
                "move_call_p50_ms": round(statistics.median(g["move_call_s"] for g in got) * 1e3, 1),
                **{
                    f"nixl_{k}_p50": round(statistics.median(g["xfer"][k] for g in got), 3)
                    for k in ("transfers", "xfer_s", "post_s", "mib", "descriptors")
                },
                "decisions": sorted({(g["decision"] or {}).get("kv", "none") for g in got}),
                "errors": sum(len(g["errors"]) for g in got),
                "serving_cpu_s_per_1k_tok": None,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="model or config dir (default: make the tiny model)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--load-format", default=None)
    p.add_argument("--connector", default=None, help="default: shared_storage on CPU, nixl on GPUs")
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 900])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=400, help="the moved stream's")
    p.add_argument("--events-before", type=int, default=16, help="the moved stream's events before the move")
    p.add_argument("--background", type=int, default=2, help="streams on the target during the move")
    p.add_argument("--background-tokens", type=int, default=400)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--omp-threads", type=int, default=1)
    p.add_argument("--gpus", type=int, default=None, help="the host's GPUs (1: both replicas share GPU 0)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="each engine's share of its GPU")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="GPU: enforce_eager")
    p.add_argument("--block-size", type=int, default=None, help="the engines' KV block size (vLLM's default: 16)")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--log-lines", help="write the cluster's log lines that match --log-pattern here (before it stops)")
    p.add_argument("--log-pattern", default=r"KV Transfer metrics|UCX|ucp_|cuda_ipc|nixl|NIXL")
    ns = p.parse_args()
    ns.connector = ns.connector or ("shared_storage" if ns.accelerator == "cpu" else "nixl")
    model_dir = ns.model_dir
    if model_dir is None:
        from app.clusters.tiny_model import make_tiny_model

        model_dir = str(
            make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-bench-")) / "tiny-llama", max_len=ns.max_model_len)
        )
    config_path = Path(model_dir) / "config.json"
    ns.vocab = json.loads(config_path.read_text()).get("vocab_size", 491) - 1 if config_path.exists() else 400
    storage = tempfile.mkdtemp(prefix="summit-kvm-")
    rng = random.Random(7)
    env = {"RAY_metrics_report_interval_ms": "10000", **{k: DIRECT_PATH_ENV[k] for k in RAY_WORKER_PRESTART}}
    num_gpus = None
    if ns.accelerator == "gpu":
        gpu_env, num_gpus = gpu_cluster_env(2, ns.gpus)  # a one-GPU host: both replicas on GPU 0
        env.update(gpu_env)
    cluster = LocalCluster(num_cpus=max(4, os.cpu_count() or 4), num_gpus=num_gpus, env=env, haproxy=True)
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.serve_deploy(summit_config(ns, model_dir, storage), timeout_s=ns.start_timeout)
        print(f"summit: ready in {time.monotonic() - t0:.1f} s", flush=True)
        urls = replica_urls(cluster)
        source, target = sorted(urls)[:2]
        for context in ns.contexts:
            for r in range(ns.rounds):
                order = list(MODES.items()) if r % 2 == 0 else list(MODES.items())[::-1]
                for peer, recompute in order:
                    got = one_round(ns, cluster, source, target, urls, context, recompute, rng)
                    results.setdefault((peer, context), []).append(got)
                    if ns.json:  # after every round: a run cut off by a time limit keeps what it measured
                        Path(ns.json).write_text(json.dumps(rows_of(results, ns), indent=1) + "\n")
                    print(
                        f"  {peer} context {context} round {r}: cut->next {(got['stall_s'] or 0) * 1e3:.1f} ms, loaded "
                        f"{got['loaded']}, target TPOT {got['bg_before'] * 1e3:.2f} -> {got['bg_during'] * 1e3:.2f} "
                        f"ms, move call {got['move_call_s'] * 1e3:.0f} ms, NIXL {got['xfer']}, {got['decision']}, "
                        f"errors {got['errors']}",
                        flush=True,
                    )
    finally:
        print(f"logs naming NVLink multicast: {multicast_hits(cluster) or 'none'}", flush=True)
        if ns.log_lines:  # before the cluster stops (stopping removes its logs)
            Path(ns.log_lines).write_text("".join(log_lines(cluster, ns.log_pattern)))
        cluster.stop()
    rows = rows_of(results, ns)
    print(f"\n{'peer':<20}{'context':>8}{'cut->next p50':>15}{'TPOT before':>13}{'during':>9}{'loaded':>8}   (ms)")
    for row in rows:
        print(
            f"{row['peer']:<20}{row['context_tokens']:>8}{row['cut_to_next_token_p50_ms']:>15.1f}"
            f"{row['target_tpot_before_ms']:>13.2f}{row['target_tpot_during_ms']:>9.2f}{row['loaded_tokens_p50']:>8}"
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
