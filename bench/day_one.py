"""A cluster user's first day on one GPU, as the GPU quickstart's commands run it (`ray start --head`, `serve deploy`,
`summit wait-ready`; docs/getting-started/quickstart-gpu.md), two cases a run:

    python bench/day_one.py oom --json oom.json        # a model whose weights cannot fit the GPU (405B bf16
                                                       # shapes at TP 1): wait-ready must end within 60 s of vLLM's
                                                       # "CUDA out of memory" line, with that line
    python bench/day_one.py fp8 --json fp8.json        # Meta's FP8 405B, depth-reduced (full width, 4 layers, its
                                                       # exact quantization_config) through the shipped
                                                       # llama405b-fp8.yaml's model section at TP 1: starts, answers;
                                                       # vLLM's weight memory against `summit validate`'s figure
    python bench/day_one.py oom --cpu                  # rehearsal on a CPU machine: the tiny model, whose KV cache
                                                       # cannot hold max_model_len, stands in for the OOM; `fp8 --cpu`
                                                       # serves the tiny model through the same steps

Only the layout (TP 1 on one GPU), a short max_model_len and dummy weights (`load_format: dummy`) are changed in the
shipped YAML's model section. Each case's timings, the lines as `summit wait-ready` printed them, vLLM's own lines and
the engine processes' host memory (RSS, for `--mem`) go to --json; nothing is asserted. Ray runs in its own temp dir
and is stopped by its process group.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RAY_TEMP = "/tmp/summit-ray-day-one"  # scripts/gpu_host.sh stops a cluster left under /tmp/summit-ray-*
GiB = 1 << 30
VLLM_TIME = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")  # vLLM's log time, e.g. "INFO 12-07 05:19:45 [...]"
OOM_LINE = re.compile(r"(?:torch\.)?(?:cuda\.)?OutOfMemoryError: CUDA out of memory.*")
WEIGHTS_LINE = re.compile(r"Model loading took ([\d.]+) GiB")


def summit(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], env=env, text=True, capture_output=True, **kw)


def shipped_model_section(config: str, source_var: str, source: Path, cpu: bool, **engine) -> tuple[Path, dict]:
    """The shipped YAML with only its layout (TP 1 on one GPU), engine settings `engine` and the weights' path
    changed; written beside the run's logs. (`cpu`: the tiny model's YAML, for a rehearsal.)"""
    doc = yaml.safe_load((REPO / config).read_text())
    model = doc["applications"][0]["args"]["models"][0]
    if not cpu:
        model.update(tensor_parallel_size=1, pipeline_parallel_size=1, gpus_per_node=1)
    model["engine_kwargs"].update(engine)
    if cpu:  # vLLM's CPU engine takes this legacy variable over kv_cache_memory_bytes
        doc["applications"][0]["runtime_env"]["env_vars"].pop("VLLM_CPU_KVCACHE_SPACE", None)
    env_vars = doc["applications"][0]["runtime_env"].setdefault("env_vars", {})
    env_vars[source_var] = str(source)
    path = Path(RAY_TEMP + "-configs") / Path(config).name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, model


def start_ray(env: dict, logs: Path) -> subprocess.Popen:
    shutil.rmtree(RAY_TEMP, ignore_errors=True)
    head = ["ray", "start", "--head", "--dashboard-host=127.0.0.1", f"--temp-dir={RAY_TEMP}", "--block"]
    print("$ " + " ".join(head), flush=True)
    cluster = subprocess.Popen(
        head, env=env, stdout=open(logs / "ray-start.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 180
    while subprocess.run(["ray", "status"], env=env, capture_output=True).returncode != 0:
        if time.monotonic() > deadline or cluster.poll() is not None:
            raise RuntimeError(f"ray start did not come up ({logs / 'ray-start.log'})")
        time.sleep(1)
    return cluster


def stop_ray(cluster: subprocess.Popen, env: dict) -> None:
    """`serve shutdown` (it stops Serve's HAProxy, which runs in a session of its own), then Ray by its process
    group."""
    import signal

    try:
        subprocess.run(["serve", "shutdown", "-y"], env=env, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        pass

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(cluster.pid, sig)
            cluster.wait(30)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def ray_logs() -> list[Path]:
    return [f for f in Path(RAY_TEMP).glob("session_*/logs/**/*") if f.is_file() and f.suffix in (".out", ".err")]


def deploy_and_wait(config: Path, env: dict, logs: Path, timeout_s: int) -> dict:
    """`serve deploy CONFIG` then `summit wait-ready CONFIG` as the quickstart runs them; wall-clock times."""
    deployed = subprocess.run(["serve", "deploy", str(config)], env=env, text=True, capture_output=True)
    if deployed.returncode:
        raise RuntimeError(f"serve deploy failed: {deployed.stderr[-2000:]}")
    t0 = time.time()
    waited = summit(
        "wait-ready", str(config), "--timeout", str(timeout_s), "--report", str(logs / "report.json"), env=env
    )
    ended = time.time()
    said = waited.stdout + waited.stderr
    print(said, flush=True)
    report = json.loads((logs / "report.json").read_text()) if (logs / "report.json").exists() else {}
    return {
        "rc": waited.returncode,
        "printed": said.strip().splitlines(),
        "report": report,
        "deployed_at": t0,
        "ended_at": ended,
        "wait_s": round(ended - t0, 1),
    }


def vllm_line_time(pattern: re.Pattern, year: int) -> tuple[str | None, float | None]:
    """The earliest line of the run's Ray logs matching `pattern` that carries vLLM's log stamp, and its time (s);
    else the first unstamped one (a traceback printed raw), without a time."""
    stamped, raw = [], None
    for f in sorted(ray_logs()):
        for line in f.read_text(errors="replace").splitlines():
            if found := pattern.search(line):
                if stamp := VLLM_TIME.search(line):
                    when = datetime.strptime(f"{year}-{stamp.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()
                    stamped.append((when, found.group(0)))
                raw = raw or found.group(0)
    if stamped:
        when, line = min(stamped)
        return line, when
    return raw, None


def engine_rss_gib(config_model: str) -> float:
    """Host memory (RSS) of the replica processes and their engines (EngineCore, workers), GiB."""
    import psutil

    total = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"LLMServer:{config_model}" in cmd or "ServeReplica" in cmd:
            try:
                total += sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
            except psutil.Error:
                continue
    return round(total / GiB, 2)


def environment(cpu: bool) -> dict:
    """The quickstart's shell: token auth (a private HOME for the token; the CPU rehearsal's tiny-cpu.yaml runs its
    replicas with auth off, as README command 1 does), the direct path."""
    auth = "disabled" if cpu else "token"
    env = {**os.environ, "HOME": RAY_TEMP + "-home", "RAY_AUTH_MODE": auth, "PYTHONPATH": str(REPO)}
    Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
    if not cpu:
        subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    for name, value in re.findall(r"export (\w+)=(\S+)", summit("direct-path-env", env=env).stdout):
        env[name] = value.strip("'\"")
    return env


def run_oom(ns: argparse.Namespace, env: dict, logs: Path) -> dict:
    """405B bf16 shapes at TP 1 (812 GB on one GPU): vLLM fails allocating the weights. CPU rehearsal: the tiny
    model with a KV cache too small for its max_model_len."""
    if ns.cpu:
        source = Path(summit("make-tiny-model", str(Path(RAY_TEMP + "-models") / "tiny"), env=env).stdout.strip())
        config, _ = shipped_model_section(
            "serve_configs/tiny-cpu.yaml", "SUMMIT_TINY_MODEL", source, True, kv_cache_memory_bytes=1 << 20
        )
        pattern = re.compile(r"ValueError: To serve at least one request.*")
    else:
        source = Path(summit("make-model-config", "llama-3.1-405b", RAY_TEMP + "-models/405b", env=env).stdout.strip())
        config, _ = shipped_model_section(
            "serve_configs/llama405b.yaml", "LLAMA405B_PATH", source, False, load_format="dummy", max_model_len=8192
        )
        pattern = OOM_LINE
    cluster = start_ray(env, logs)
    try:
        waited = deploy_and_wait(config, env, logs, ns.timeout)
        line, at = vllm_line_time(pattern, datetime.now().year)
    finally:
        stop_ray(cluster, env)
    return {
        "case": "oom",
        "config": str(config),
        "wait_ready": {k: v for k, v in waited.items() if not k.endswith("_at")},
        "vllm_line": line,
        "ended_after_vllm_line_s": round(waited["ended_at"] - at, 1) if at else None,
        "multicast_backend_in_logs": any("mnnvl" in f.read_text(errors="replace").lower() for f in ray_logs()),
    }


def run_fp8(ns: argparse.Namespace, env: dict, logs: Path) -> dict:
    """Meta's FP8 405B at full width, 4 layers (its quantization_config over them) through llama405b-fp8.yaml's model
    section at TP 1; a chat answer; vLLM's "Model loading took X GiB" against `summit validate`'s weights."""
    if ns.cpu:
        var = "SUMMIT_TINY_MODEL"
        source = Path(summit("make-tiny-model", str(Path(RAY_TEMP + "-models") / "tiny"), env=env).stdout.strip())
        config, model = shipped_model_section("serve_configs/tiny-cpu.yaml", var, source, True)
    else:
        var = "LLAMA405B_FP8_PATH"
        made = summit(
            "make-model-config", "llama-3.1-405b-fp8", RAY_TEMP + "-models/405b-fp8-4l", "--layers", "4", env=env
        )
        source = Path(made.stdout.strip())
        config, model = shipped_model_section(
            "serve_configs/llama405b-fp8.yaml", var, source, False, load_format="dummy", max_model_len=8192
        )
    hardware = ("--gpu", ns.gpu, "--gpus-per-node", "1", "--nodes", "1")
    checked = summit("validate", str(config), *hardware, env={**env, var: str(source)})
    print(checked.stdout + checked.stderr, flush=True)
    validate_gib = re.search(r"weights ([\d.]+) GiB", checked.stdout)
    cluster = start_ray(env, logs)
    try:
        waited = deploy_and_wait(config, env, logs, ns.timeout)
        answer = chat(model["name"], env) if waited["rc"] == 0 else None
        rss = engine_rss_gib(model["name"])
    finally:
        stop_ray(cluster, env)
    loaded, _ = vllm_line_time(WEIGHTS_LINE, datetime.now().year)
    vllm_gib = float(WEIGHTS_LINE.search(loaded).group(1)) if loaded else None
    ours = float(validate_gib.group(1)) if validate_gib else None
    return {
        "case": "fp8",
        "config": str(config),
        "validate": checked.stdout.strip().splitlines(),
        "wait_ready": {k: v for k, v in waited.items() if not k.endswith("_at")},
        "answer": answer,
        "vllm_weights_gib": vllm_gib,
        "validate_weights_gib": ours,
        "ratio": round(ours / vllm_gib, 3) if ours and vllm_gib else None,
        "engine_rss_gib": rss,
        "multicast_backend_in_logs": any("mnnvl" in f.read_text(errors="replace").lower() for f in ray_logs()),
    }


def chat(model: str, env: dict) -> str:
    from openai import OpenAI

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name the tallest mountain."}], max_tokens=16
    )
    return reply.choices[0].message.content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=["oom", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="a rehearsal on a CPU machine (the tiny model)")
    parser.add_argument("--gpu", default="h200-141gb", help="summit validate's --gpu for the fp8 case")
    parser.add_argument("--timeout", type=int, default=900, help="wait-ready's --timeout")
    parser.add_argument("--logs", default="day-one-logs")
    parser.add_argument("--json", default=None)
    ns = parser.parse_args()
    logs = Path(ns.logs)
    logs.mkdir(parents=True, exist_ok=True)
    env = environment(ns.cpu)
    result = (run_oom if ns.case == "oom" else run_fp8)(ns, env, logs)
    print(json.dumps(result, indent=1))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
