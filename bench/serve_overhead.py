"""Summit vs vLLM's own api_server: the same model, engine settings and load, one after the other in one run.

    python bench/serve_overhead.py                       # tiny model on CPU: 64 requests x 64 tokens at 16
    python bench/serve_overhead.py --model-dir DIR --accelerator gpu --load-format dummy \\
        --concurrency 1 32 256 --requests 256 --max-tokens 256 --prompt-words 100 --client-procs 8
    # the DP-vs-TP question on 2 GPUs: one engine on both (TP 2) vs two engines (Summit: 2 replicas behind its
    # router; vLLM: --data-parallel-size 2), each peer in each layout, same load
    python bench/serve_overhead.py ... --layouts 2x1 1x2

`summit` is Summit on its direct path (Serve's HAProxy -> the engine replica); `--hops` adds the two-hop path,
`--rayllm` Ray Serve LLM 2.60 with its direct streaming (same HAProxy environment and engine settings).
`--rounds N` alternates the peers N times and reports each one's median round. `--models N` serves N models of one
shape (one engine each) and spreads the load over them: Summit as one application (one base URL, the direct path's
route picker), vLLM as N api_servers (the client picks each model's server); Ray Serve LLM's direct streaming takes
one model per application and is left out. `--monitoring-cost` runs only Summit, with its monitoring off and on
(metrics and traces), and prints the on/off ratios of CPU-seconds (every process of the Ray cluster, metrics agent
included) per 1,000 output tokens and of tok/s. `--spin-cost` runs vLLM, Summit, and Summit with its engine's queue
readers spinning 0.1 s after a read instead of vLLM's 1 s (`SUMMIT_ENGINE_SPIN_S=0.1`). `--resume-cost` runs only
Summit, with `models[].stream_resume` off and on (`summit-resume`: every event numbered and kept).
`--front-processes N` adds `summit-fronts`, the direct path with `models[].front_processes: N` (the engine's serving
work in N processes that share the replica's port). `--profile DIR` records py-spy on the replica, vLLM's server and
the engine processes during each load (bench/pyspy.py). Prints output tok/s, TTFT p50/p99 and serving CPU-seconds per
1,000 tokens (every process but vLLM's engine core and workers) of each, and Summit's ratios to vLLM. Not a test:
nothing is asserted.
`--json FILE` writes `[{peer, concurrency, out_tok_s, ttft_p50_ms, ttft_p99_ms, ...}]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.build.options import DIRECT_PATH_ENV  # noqa: E402
from bench.loadgen import LoadResult, cpu_by_process, cpu_used_s, make_prompts, run_load, run_load_processes, tree_cpu_s  # noqa: E402
from deployments.engine import NO_NVLINK_MULTICAST_ENV  # noqa: E402
from tests.local_cluster import (  # noqa: E402
    LOOPBACK,
    RAY_WORKER_PRESTART,
    LocalCluster,
    _http_ok,
    free_port,
    loopback_env,
)

MODEL = "bench-model"


def model_names(ns: argparse.Namespace) -> list[str]:
    if getattr(ns, "served", None):  # bench/flagship.py: the YAML's model
        return [ns.served]
    return [MODEL] if ns.models == 1 else [f"{MODEL}-{k}" for k in range(ns.models)]


def engine_kwargs(ns: argparse.Namespace) -> dict:
    kwargs = {"dtype": "bfloat16", "max_model_len": ns.max_model_len, "max_num_seqs": ns.max_num_seqs}
    if ns.accelerator == "cpu":
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    if ns.load_format:
        kwargs["load_format"] = ns.load_format
    if getattr(ns, "gpu_memory_utilization", None):  # --together: peers share the GPU, each with the same fraction
        kwargs["gpu_memory_utilization"] = ns.gpu_memory_utilization
    return kwargs


def engine_env(ns: argparse.Namespace) -> dict[str, str]:
    if ns.accelerator != "cpu":
        return dict(NO_NVLINK_MULTICAST_ENV)  # for vLLM's own server too (Summit's builder sets it for its engines)
    # Ray sets OMP_NUM_THREADS from a replica's num_cpus (0.5 -> 1 thread); vLLM's own server would take every
    # core. Both peers get the same thread count so that the ratio measures the serving path, not the threads.
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": str(ns.omp_threads),
    }


def cli_flags(kwargs: dict) -> list[str]:
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is False:  # vLLM's boolean flags: --no-<name>
            flags.append("--no-" + key.replace("_", "-"))
        else:
            flags += [flag] if value is True else [flag, str(value)]
    return flags


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if _http_ok(url):
            return time.monotonic() - t0
        time.sleep(1)
    raise TimeoutError(url)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written), the HBM bound's denominator."""
    import torch

    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / 10
    del x, y
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / dt / 1e9


def hbm_bound_tok_s(model_dir: str, bandwidth_gbs: float) -> float:
    """Single-stream decode ceiling: every weight byte is read once per token at the measured copy rate."""
    from app.plan.planner import load_shape, weight_bytes

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = load_shape(model_dir, config)
    streamed = weight_bytes(shape, "bf16") - 2 * config["vocab_size"] * config["hidden_size"]  # one embedding row only
    return bandwidth_gbs * 1e9 / streamed


def run_loads(
    base_url: str | list[str], ns: argparse.Namespace, server_pids: list[int], after_each=None
) -> list[LoadResult]:
    """Each concurrency level's load over the models, with the CPU the servers' process trees used meanwhile;
    `after_each(result)` (optional) adds what the server measured to the result."""
    models = model_names(ns)
    asyncio.run(
        run_load(
            base_url,
            models,
            make_prompts(4 * len(models), ns.prompt_words, seed=1, distinct=getattr(ns, "distinct_prompts", False)),
            4,
            8,
        )
    )
    results = []
    per_level = getattr(ns, "requests_per_level", None)  # bench/flagship.py: a count per concurrency level
    for i, c in enumerate(ns.concurrency):
        n = ns.requests if ns.requests_per_stream is None else max(8, c * ns.requests_per_stream)
        if per_level:
            n = per_level[i]
        prompts = make_prompts(n, ns.prompt_words, distinct=getattr(ns, "distinct_prompts", False))
        before = [tree_cpu_s(pid) for pid in server_pids]
        with profiled(ns, server_pids, f"c{c}"):
            result = run_load_processes(base_url, models, prompts, c, ns.max_tokens, ns.client_procs)
        after = [tree_cpu_s(pid) for pid in server_pids]
        result.cpu_s = sum(cpu_used_s(b, a) for b, a in zip(before, after))
        result.serving_cpu_s = sum(cpu_used_s(b, a, serving_only=True) for b, a in zip(before, after))
        merged_before = {k: v for b in before for k, v in b.items()}
        result.cpu_breakdown = cpu_by_process(merged_before, {k: v for a in after for k, v in a.items()})
        if after_each is not None:
            after_each(result)
        print(
            f"  c={c}: {result.tok_per_s:.0f} tok/s, TTFT p50 {result.ttft_pct(50) * 1e3:.1f} ms, "
            f"p99 {result.ttft_pct(99) * 1e3:.1f} ms; serving CPU-s/1k tok {result.serving_cpu_per_1k_tok()}; "
            "CPU s by process: " + ", ".join(f"{name} {s:.1f}" for name, s in result.cpu_breakdown),
            flush=True,
        )
        results.append(result)
    return results


@contextlib.contextmanager
def profiled(ns: argparse.Namespace, server_pids: list[int], load: str):
    """With `--profile DIR`: py-spy samples the serving and engine processes of the servers' trees (PROFILED_ROLES,
    50 Hz) while the load runs; a summary per process (bench/pyspy.py) is printed and written beside the raw samples."""
    if not getattr(ns, "profile", None):
        yield
        return
    from bench.pyspy import record

    where = Path(ns.profile) / f"{getattr(ns, 'peer', 'server')}-{load}"
    with record([pid for root in server_pids for pid in serving_processes(root)], where):
        yield


# the processes a request's work runs in (a py-spy per idle Ray daemon took more CPU than the load on 2 cores)
PROFILED_ROLES = ("ray::ServeReplica", "ray::FrontProcess", "ray::HAProxyManager", "VLLM::", "python vllm.entrypoints")


def serving_processes(root_pid: int) -> list[int]:
    """The processes of `root_pid`'s tree that serve requests (PROFILED_ROLES: the replica, vLLM's server, the
    engine's), for py-spy."""
    return [pid for pid, _, label in tree_cpu_s(root_pid) if label.startswith(PROFILED_ROLES)]


def bench_vllm(
    ns: argparse.Namespace, model_dir: str, tp: int = 1, replicas: int = 1
) -> tuple[float, list[LoadResult]]:
    """vLLM's api_server, one per model (`--models`), each on its own port."""
    with vllm_servers(ns, model_dir, tp, replicas) as (ready, urls, pids):
        return ready, run_loads(urls, ns, pids)


@contextlib.contextmanager
def vllm_servers(ns: argparse.Namespace, model_dir: str, tp: int = 1, replicas: int = 1):
    """vLLM's api_server(s) started and answering: yields (seconds until they answered, their URLs, their pids)."""
    flags = {**engine_kwargs(ns), "tensor_parallel_size": tp}
    if replicas > 1:
        flags["data_parallel_size"] = replicas
    if ns.accelerator == "gpu":  # what Summit's adapter sets for every GPU engine (no FlashInfer mnnvl all-reduce)
        flags["compilation_config"] = json.dumps({"pass_config": {"fuse_allreduce_rms": False}})
    servers: list[tuple[subprocess.Popen, str]] = []
    try:
        t0 = time.monotonic()
        for name in model_names(ns):
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--served-model-name",
                name,
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--disable-uvicorn-access-log",
                *cli_flags(flags),
            ]
            log = open(Path(tempfile.gettempdir()) / f"bench-vllm-{port}.log", "wb")
            servers.append(
                (
                    subprocess.Popen(
                        cmd,
                        env=loopback_env(engine_env(ns)),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    f"http://{LOOPBACK}:{port}",
                )
            )
        for proc, url in servers:
            wait_http(url + "/v1/models", proc, ns.start_timeout)
        yield time.monotonic() - t0, [url for _, url in servers], [proc.pid for proc, _ in servers]
    finally:
        for proc, _ in servers:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def bench_summit(
    ns: argparse.Namespace,
    model_dir: str,
    tp: int = 1,
    replicas: int = 1,
    haproxy: bool = False,
    monitoring: dict | None = None,
    app_env: dict[str, str] | None = None,
    cluster_env: dict[str, str] | None = None,
    fronts: int | None = None,
    resume: bool = False,
) -> tuple[float, list[LoadResult]]:
    config = summit_config(ns, model_dir, tp, replicas, monitoring, app_env, fronts, resume)
    return serve_peer(ns, config, {**engine_env(ns), **(cluster_env or {})}, haproxy)


def summit_config(
    ns: argparse.Namespace,
    model_dir: str,
    tp: int = 1,
    replicas: int = 1,
    monitoring: dict | None = None,
    app_env: dict[str, str] | None = None,
    fronts: int | None = None,
    resume: bool = False,
) -> dict:
    """The Serve config of Summit's peer: the shipped defaults but for the load's engine settings (`fronts`: None
    leaves models[].front_processes at its default, auto; `resume`: models[].stream_resume on)."""
    models = [
        {
            "name": name,
            "source": model_dir,
            "accelerator": ns.accelerator,
            "tensor_parallel_size": tp,
            "gpus_per_node": max(tp, 1),
            "engine_kwargs": engine_kwargs(ns),
            "stream_coalesce_ms": ns.coalesce_ms,
            "deployment": {"num_cpus": 0.5 if ns.accelerator == "cpu" else 1, "num_replicas": replicas},
            **({} if fronts is None else {"front_processes": fronts}),
            **({"stream_resume": {}} if resume else {}),
        }
        for name in model_names(ns)
    ]
    return serve_app_config(ns, {"models": models, **({"monitoring": monitoring} if monitoring else {})}, app_env)


def serve_app_config(
    ns: argparse.Namespace,
    args: dict,
    app_env: dict[str, str] | None = None,
    name: str = "summit",
    import_path: str = "app.build:build_app",
) -> dict:
    """A Serve config of one application at `/` (Summit's, unless `import_path` says another) built from `args`, its
    workers' environment the load's engine settings (engine_env) + `app_env`, auth off, workers at normal niceness."""
    env = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0", **engine_env(ns), **(app_env or {})}
    return {
        "proxy_location": "HeadOnly",
        "applications": [
            {
                "name": name,
                "route_prefix": "/",
                "import_path": import_path,
                "runtime_env": {"env_vars": env},
                "args": args,
            }
        ],
    }


# Monitoring's cost (--monitoring-cost): metrics (vLLM's and Summit's, through Ray's metrics system) and traces (every
# request, kept by the SDK's in-memory exporter: the span work without an exporter's network) off vs on.
MONITORING_OFF = {"metrics": False, "tracing": {"exporter": "none"}}
MONITORING_ON = {"metrics": True, "tracing": {"exporter": "memory"}}


def serve_peer(
    ns: argparse.Namespace, config: dict, env: dict[str, str], haproxy: bool, observe=None
) -> tuple[float, list[LoadResult]]:
    """A private Ray cluster with `config` deployed: (seconds until it answered, the loads' results);
    `observe(cluster, result)` (optional) runs after each load, before the cluster stops."""
    with summit_cluster(ns, config, env, haproxy) as (ready, cluster):
        after_each = None if observe is None else (lambda result: observe(cluster, result))
        # `ray start --block`: every Ray process
        return ready, run_loads(cluster.base_url, ns, [cluster.proc.pid], after_each)


@contextlib.contextmanager
def summit_cluster(ns: argparse.Namespace, config: dict, env: dict[str, str], haproxy: bool):
    """A private Ray cluster with `config` deployed and answering: yields (seconds until it answered, the cluster)."""
    # Ray's own metrics interval (10 s), as README command 1 runs: the test clusters' 2 s costs the daemons CPU; Ray's
    # worker prestart as the direct-path environment sets it (the test clusters keep Ray's default)
    lean = {k: DIRECT_PATH_ENV[k] for k in RAY_WORKER_PRESTART}
    env = {"RAY_metrics_report_interval_ms": "10000", **lean, **env}
    cluster = LocalCluster(num_cpus=max(4, os.cpu_count() or 4), env=env, haproxy=haproxy)
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.serve_deploy(config, timeout_s=ns.start_timeout)
        yield time.monotonic() - t0, cluster
    finally:
        # FlashInfer's NVLink-multicast all-reduce must never run: its backend's name in any log of the cluster
        hits = subprocess.run(["grep", "-rli", "mnnvl", str(cluster.temp_dir)], capture_output=True, text=True)
        named = hits.stdout.split() or "none"
        print(f"logs of Summit's cluster naming FlashInfer's multicast all-reduce backend: {named}", flush=True)
        cluster.stop()


RAYLLM_SITE = Path(__file__).resolve().parent / ".rayllm-site"


def bench_rayllm(
    ns: argparse.Namespace, model_dir: str, tp: int = 1, replicas: int = 1
) -> tuple[float, list[LoadResult]]:
    """Ray Serve LLM 2.60 (`ray.serve.llm:build_openai_app`) with its direct streaming (HAProxy -> its LLMServer
    replica), one model, the same engine settings and HAProxy environment as Summit's direct path. Its extra
    dependencies live apart from Summit's: `pip install --target bench/.rayllm-site --no-deps pyarrow jsonref`."""
    if not (RAYLLM_SITE / "pyarrow").is_dir():
        raise SystemExit(
            f"Ray Serve LLM needs pyarrow and jsonref: pip install --target {RAYLLM_SITE} --no-deps pyarrow jsonref"
        )
    llm_config = {
        "model_loading_config": {"model_id": MODEL, "model_source": model_dir},
        "engine_kwargs": {**engine_kwargs(ns), "tensor_parallel_size": tp},
        "deployment_config": {"num_replicas": replicas},
    }
    if ns.accelerator == "cpu":
        llm_config["accelerator_config"] = {"kind": "cpu"}
    config = serve_app_config(
        ns, {"llm_configs": [llm_config]}, name="rayllm", import_path="ray.serve.llm:build_openai_app"
    )
    path = os.pathsep.join(x for x in [str(RAYLLM_SITE), os.environ.get("PYTHONPATH", "")] if x)
    env = {**engine_env(ns), "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", "PYTHONPATH": path}
    return serve_peer(ns, config, env, haproxy=True)


@contextlib.contextmanager
def started_peer(ns: argparse.Namespace, name: str, model_dir: str):
    """One peer of `--together`, started and answering: yields (seconds until it answered, base URL(s), pids whose
    process trees are the peer's CPU)."""
    if name == "vllm":
        with vllm_servers(ns, model_dir) as (ready, urls, pids):
            yield ready, urls, pids
        return
    fronts = {"summit": None, "summit-1proc": 1, "summit-fronts": ns.front_processes}[name]
    with summit_cluster(ns, summit_config(ns, model_dir, fronts=fronts), engine_env(ns), True) as (ready, cluster):
        yield ready, cluster.base_url, [cluster.proc.pid]


def run_together(ns: argparse.Namespace, model_dir: str, names: list[str]) -> dict[str, list]:
    """`--together`: every peer started once, one after another (each engine with the same
    --gpu-memory-utilization of the one GPU), then --rounds rounds of their loads, the peers' order reversed each
    round (A B, B A, A B, ...); the idle peers wait meanwhile. Rounds per peer as main's loop keeps them."""
    rounds: dict[str, list] = {}
    with contextlib.ExitStack() as stack:
        started = {}
        for name in names:
            started[name] = stack.enter_context(started_peer(ns, name, model_dir))
            print(f"{name}: ready in {started[name][0]:.1f} s", flush=True)
        for round_no in range(ns.rounds):
            for name in names if round_no % 2 == 0 else names[::-1]:
                ready, urls, pids = started[name]
                ns.peer = f"{name}-r{round_no + 1}"
                print(f"round {round_no + 1} {name}", flush=True)
                rounds.setdefault(name, []).append((ready, run_loads(urls, ns, pids)))
                if ns.json:
                    write_json(ns.json, rounds)
    return rounds


def median_round(runs: list[tuple[float, list[LoadResult]]]) -> tuple[float, list[LoadResult]]:
    """Per concurrency, the round with the median tok/s (its TTFTs with it); ready time of the first round."""
    rows = []
    for i in range(len(runs[0][1])):
        ordered = sorted((run[1][i] for run in runs), key=lambda r: r.tok_per_s)
        rows.append(ordered[(len(ordered) - 1) // 2])
    return runs[0][0], rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="model or config dir (default: make the tiny model)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--load-format", default=None, help="e.g. dummy (random weights for a config-only dir)")
    p.add_argument(
        "--layouts",
        nargs="+",
        default=["1x1"],
        help="TPxREPLICAS per run, e.g. 2x1 1x2 (vLLM: --tensor-parallel-size TP --data-parallel-size REPLICAS)",
    )
    p.add_argument("--client-procs", type=int, default=1, help="client processes sharing each load level")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument(
        "--requests-per-stream",
        type=int,
        default=None,
        help="requests = max(8, concurrency x this) at each level (instead of --requests)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--coalesce-ms", type=float, default=None, help="Summit's stream_coalesce_ms (default: the config default)"
    )
    p.add_argument("--omp-threads", type=int, default=1, help="CPU engine threads for both peers (cpu only)")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument(
        "--hops",
        action="store_true",
        help="also Summit on the two-hop path (Serve's Python proxy -> "
        "OpenAIIngress -> replica); `summit` is the direct path (HAProxy -> replica)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the peers this many times; report each peer's median round (by tok/s at each concurrency)",
    )
    p.add_argument(
        "--rayllm",
        action="store_true",
        help="also Ray Serve LLM 2.60 with its direct streaming (one "
        "model; see bench_rayllm for its extra dependencies)",
    )
    p.add_argument(
        "--models",
        type=int,
        default=1,
        help="models of one shape, one engine each, the load spread over "
        "them (Summit: one application; vLLM: one api_server each; Ray Serve LLM: not with N > 1)",
    )
    p.add_argument("--only", choices=["vllm", "summit", "summit-hops", "rayllm", "summit-fronts"], default=None)
    p.add_argument(
        "--together",
        nargs="+",
        choices=["vllm", "summit", "summit-1proc", "summit-fronts"],
        help="start these peers once, side by side on the one GPU (each --gpu-memory-utilization), and alternate "
        "their loads --rounds times (summit: as shipped; summit-1proc: front_processes 1)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="every peer's engine (GPU)")
    p.add_argument(
        "--front-processes",
        type=int,
        default=1,
        help="N > 1 adds the peer summit-fronts: Summit's direct path with models[].front_processes: N",
    )
    p.add_argument(
        "--monitoring-cost",
        action="store_true",
        help="only Summit, monitoring off vs on (metrics and "
        "traces), alternating; prints the CPU-seconds per 1,000 tokens and tok/s ratios",
    )
    p.add_argument(
        "--spin-cost",
        action="store_true",
        help="vLLM, Summit, and Summit with its engine's queue readers spinning 0.1 s (SUMMIT_ENGINE_SPIN_S=0.1) "
        "instead of vLLM's 1 s",
    )
    p.add_argument(
        "--daemon-cost",
        action="store_true",
        help="vLLM, Summit, and Summit with Serve's control loop every 0.5 s (RAY_SERVE_CONTROL_LOOP_INTERVAL_S; "
        "Serve's default 0.1 s)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy (50 Hz) on the replica, vLLM's server and the engine processes of each peer during each load: "
        "raw samples and a summary per process in DIR (bench/pyspy.py)",
    )
    p.add_argument(
        "--resume-cost",
        action="store_true",
        help="only Summit, with models[].stream_resume off and on (summit-resume): the cost of keeping streams",
    )
    p.add_argument("--json", help="also write the figures here")
    ns = p.parse_args()
    if ns.coalesce_ms is None:
        from app.config import ModelConfig

        ns.coalesce_ms = ModelConfig.model_fields["stream_coalesce_ms"].default

    model_dir = ns.model_dir
    if model_dir is None:
        from app.clusters.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-bench-")) / "tiny-llama"))

    bound = None
    if ns.accelerator == "gpu":
        bw = copy_bandwidth_gbs()
        bound = hbm_bound_tok_s(model_dir, bw)
        print(f"copy bandwidth {bw:.0f} GB/s; single-stream HBM bound {bound:.1f} tok/s", flush=True)
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in ns.layouts]
    peers = {
        "vllm": bench_vllm,
        "summit": lambda ns, model_dir, tp, r: bench_summit(ns, model_dir, tp, r, haproxy=True),
        "summit-hops": bench_summit,
        "rayllm": bench_rayllm,
        "summit-monitoring-off": lambda ns, d, tp, r: bench_summit(ns, d, tp, r, True, MONITORING_OFF),
        "summit-monitoring-on": lambda ns, d, tp, r: bench_summit(ns, d, tp, r, True, MONITORING_ON),
        "summit-spin-0.1s": lambda ns, d, tp, r: bench_summit(
            ns, d, tp, r, True, None, {"SUMMIT_ENGINE_SPIN_S": "0.1"}
        ),
        "summit-loop-0.5s": lambda ns, d, tp, r: bench_summit(
            ns, d, tp, r, True, None, None, {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
        ),
        "summit-fronts": lambda ns, d, tp, r: bench_summit(ns, d, tp, r, True, fronts=ns.front_processes),
        "summit-resume": lambda ns, d, tp, r: bench_summit(ns, d, tp, r, True, resume=True),
    }
    wanted = {"vllm", "summit"} | ({"summit-hops"} if ns.hops else set()) | ({"rayllm"} if ns.rayllm else set())
    if ns.monitoring_cost:
        wanted = {"summit-monitoring-off", "summit-monitoring-on"}
    if ns.spin_cost:
        wanted = {"vllm", "summit", "summit-spin-0.1s"}
    if ns.daemon_cost:
        wanted = {"vllm", "summit", "summit-loop-0.5s"}
    if ns.resume_cost:
        wanted = {"summit", "summit-resume"}
    if ns.front_processes > 1:
        wanted |= {"summit-fronts"}
    if ns.models > 1 and "rayllm" in wanted:
        raise SystemExit(
            "--rayllm takes one model: Ray Serve LLM 2.60's direct streaming serves one model per application"
        )
    rounds: dict[str, list[tuple[float, list[LoadResult]]]] = {}
    if ns.together:
        rounds = run_together(ns, model_dir, ns.together)
    for round_no in range(0 if ns.together else ns.rounds):
        for tp, replicas in layouts:
            suffix = "" if (tp, replicas) == (1, 1) else f" tp{tp}x{replicas}"
            for name, fn in peers.items():
                if name in wanted and ns.only in (None, name):
                    ns.peer = f"{name}{suffix.replace(' ', '-')}-r{round_no + 1}"
                    rounds.setdefault(name + suffix, []).append(fn(ns, model_dir, tp, replicas))
                    print(
                        f"round {round_no + 1} {name + suffix}: ready in {rounds[name + suffix][-1][0]:.1f} s "
                        f"tok/s {[round(r.tok_per_s) for r in rounds[name + suffix][-1][1]]}",
                        flush=True,
                    )
                    if ns.json:  # after every peer, so that a run cut off by a time limit keeps what it measured
                        write_json(ns.json, rounds)
    results = {name: median_round(runs) for name, runs in rounds.items()}

    print(
        f"\n{'peer':<22}{'conc':>6}{'tok/s':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'errors':>8}"
        f"{'serving CPU s/1k tok':>22}{'all CPU s/1k tok':>18}"
    )
    for name, (_, rows) in results.items():
        for r in rows:
            print(
                f"{name:<22}{r.concurrency:>6}{r.tok_per_s:>10.1f}{r.ttft_pct(50) * 1e3:>13.1f}"
                f"{r.ttft_pct(99) * 1e3:>13.1f}{r.errors:>8}{r.serving_cpu_per_1k_tok() or float('nan'):>22.2f}"
                f"{r.cpu_per_1k_tok() or float('nan'):>18.2f}"
            )
    for name in results:
        base = "vllm" + name[len(name.split(" ")[0]) :]  # the vLLM run of the same layout
        if name != base and base in results:
            for v, s in zip(results[base][1], results[name][1]):
                print(
                    f"ratio {name}/{base} at c={v.concurrency}: tok/s {s.tok_per_s / v.tok_per_s:.2f}x, "
                    f"TTFT p50 {s.ttft_pct(50) / v.ttft_pct(50):.2f}x, serving CPU s/1k tok "
                    f"{(s.serving_cpu_per_1k_tok() or 0) / (v.serving_cpu_per_1k_tok() or float('nan')):.2f}x"
                )
    off, on = results.get("summit-monitoring-off"), results.get("summit-monitoring-on")
    if off and on:
        for a, b in zip(off[1], on[1]):
            print(
                f"ratio monitoring on/off at c={a.concurrency}: CPU s/1k tok "
                f"{(b.cpu_per_1k_tok() or 0) / (a.cpu_per_1k_tok() or float('nan')):.3f}x, tok/s "
                f"{b.tok_per_s / a.tok_per_s:.3f}x"
            )
    if bound:
        for name, (_, rows) in results.items():
            for r in rows:
                if r.concurrency == 1:
                    print(f"{name} single stream: {r.tok_per_s:.1f} tok/s = {r.tok_per_s / bound:.0%} of the HBM bound")
    if ns.json:
        write_json(ns.json, rounds)


MEDIAN_KEYS = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "serving_cpu_s_per_1k_tok")


def write_json(path: str, rounds: dict[str, list[tuple[float, list[LoadResult]]]]) -> None:
    """A row per peer and concurrency: its median round (by tok/s), each round's figures (`rounds`), and the median
    of each figure over the rounds (`medians`)."""
    rows = []
    for name, runs in rounds.items():
        ready, loads = median_round(runs)
        for i, x in enumerate(loads):
            each = [{k: row.get(k) for k in MEDIAN_KEYS} for row in (run[1][i].row() for run in runs)]
            medians = {k: statistics.median(v) for k in MEDIAN_KEYS if (v := [r[k] for r in each if r[k] is not None])}
            rows.append({"peer": name, "ready_s": round(ready, 1), **x.row(), "rounds": each, "medians": medians})
    Path(path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
