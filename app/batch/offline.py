"""`summit batch IN.jsonl -o OUT.jsonl --config X.yaml`: a batch file through the same runner core and engine
deployments as the online Batch API, without HTTP: the YAML's models are deployed on a Ray cluster (a private local
one unless `--address` is given) with no HTTP proxy, and each line goes to its model's engine deployment through a
Serve handle. Output lines go to OUT (2xx answers) and ERR (the rest) in OpenAI's batch output format, appended as
they finish: a rerun skips every custom_id already in either file (resumable), but runs again the lines of the errors
file that `retry_errors` names (by default the transient ones: a 5xx, 408 or 429, or no answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from app.batch.progress import Progress
from deployments.batch.core import run_lines
from deployments.batch.lines import Line, parse_lines

OFFLINE_APP = "summit-batch"


def finished_ids(*paths: Path) -> set[str]:
    """custom_ids already written to these output files. A torn last line (the run was killed while writing it)
    is cut off, so that the line runs again and is written whole."""
    done: set[str] = set()
    for path in paths:
        if not path.exists():
            continue
        data = path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            with open(path, "r+b") as f:
                f.truncate(len(whole))
        for raw in whole.splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                done.add(json.loads(raw)["custom_id"])
    return done


def app_args(config_path: str, app_name: str | None) -> tuple[dict, dict]:
    """The Summit app's `args` and `runtime_env` from a Serve YAML (its one app, or the one named)."""
    doc = yaml.safe_load(Path(config_path).read_text())
    apps = [a for a in doc.get("applications", []) if app_name in (None, a.get("name"))]
    apps = [a for a in apps if a.get("import_path") == "app.build:build_app"]
    if len(apps) != 1:
        raise ValueError(f"{config_path}: name the Summit application with --app (found {len(apps)})")
    args = dict(apps[0].get("args") or {})
    args.pop("batch", None)  # the offline run needs no Batch API
    args["ingress"] = {**(args.get("ingress") or {}), "path": "hops"}  # no HTTP: per-model engine deployments
    return args, apps[0].get("runtime_env") or {}


def run(
    in_path: str,
    out_path: str,
    config_path: str,
    err_path: str | None = None,
    address: str | None = None,
    concurrency: int = 512,
    app_name: str | None = None,
    progress: bool = True,
    num_cpus: int | None = None,
    ray_data: bool = False,
    retry: str = "transient",
) -> dict[str, Any]:
    """Run a batch file; a summary ({lines, skipped, ran, completed, failed, output_tokens, seconds, tok_per_s})."""
    import ray
    from ray import serve

    from app.build.engine_checks import load_config

    out, err = Path(out_path), Path(err_path or _errors_path(out_path))
    args, runtime_env = app_args(config_path, app_name)
    config = load_config(args)
    lines, skip, todo = _lines_to_run(Path(in_path), config, out, err, retry)
    summary: dict[str, Any] = {
        "lines": len(lines),
        "skipped": len(lines) - len(todo),
        "ran": 0,
        "completed": 0,
        "failed": 0,
        "output_tokens": 0,
    }
    if not todo:
        return {**summary, "seconds": 0.0, "tok_per_s": 0.0}
    own_ray = _start_ray(address, num_cpus, runtime_env)
    try:
        if ray_data:
            from app.batch.ray_data import run_ray_data

            counts = run_ray_data(todo, config, out, err, progress)
        else:
            bar = Progress(len(lines), len(skip), progress)
            counts = _run_on_serve(args, config, todo, out, err, concurrency, bar)
        summary.update(counts)
        return summary
    finally:
        if not ray_data:
            with contextlib.suppress(Exception):
                serve.delete(OFFLINE_APP) if not own_ray else serve.shutdown()
        ray.shutdown()


def _lines_to_run(
    in_path: Path, config, out: Path, err: Path, retry: str = "transient"
) -> tuple[list[Line], set[str], list[Line]]:
    """(every line, the ids a former run finished, the lines left to run); a malformed file fails naming its lines.
    A line in the errors file runs again when `retry` says so (retry_errors), and leaves that file."""
    lines, errors = parse_lines(in_path.read_bytes(), None, [m.name for m in config.models], 10**9)
    if errors:
        raise ValueError(
            "; ".join(e.message for e in errors[:10]) + (f" (and {len(errors) - 10} more)" if len(errors) > 10 else "")
        )
    retry_errors(err, retry)
    skip = finished_ids(out, err)
    return lines, skip, [line for line in lines if line.custom_id not in skip]


RETRY_ERRORS = ("transient", "all", "none")


def transient(line: dict) -> bool:
    """An error another run may not meet: a 5xx, 408 or 429 answer, or none at all (the request did not end)."""
    status = (line.get("response") or {}).get("status_code")
    return status is None or status >= 500 or status in (408, 429)


def retry_errors(err: Path, which: str) -> int:
    """Take the errors file's lines to run again out of it (`which`: transient = 5xx, 408, 429 or no answer; all;
    none): a resubmitted job runs them, and each custom_id stays in exactly one of the two files. The lines kept
    (a 4xx is the request's own fault) are written back; returns how many were taken."""
    if which == "none" or not err.exists():
        return 0
    finished_ids(err)  # a torn last line cut off first
    kept, taken = [], 0
    for raw in err.read_bytes().splitlines():
        try:
            again = which == "all" or transient(json.loads(raw))
        except (ValueError, AttributeError):
            again = False
        if again:
            taken += 1
        else:
            kept.append(raw + b"\n")
    if taken:
        tmp = err.with_name(err.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, err)
    return taken


PRIVATE_RAY_TRIES = 3  # starts of the private Ray (Ray gives its node a fixed 30 s to register)


def _start_ray(address: str | None, num_cpus: int | None, runtime_env: dict) -> bool:
    """Join the cluster at `address`, or start a private one-node Ray on loopback (True) with its own temp dir."""
    import ray

    env_vars = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **(runtime_env.get("env_vars") or {})}
    os.environ.setdefault("RAY_AUTH_MODE", env_vars["RAY_AUTH_MODE"])
    common = {"runtime_env": {**runtime_env, "env_vars": env_vars}, "logging_level": "ERROR", "log_to_driver": False}
    if address is not None:
        ray.init(address=address, **common)
        return False
    for attempt in range(1, PRIVATE_RAY_TRIES + 1):
        temp_dir = tempfile.mkdtemp(prefix="summit-batch-ray-")
        try:
            ray.init(
                num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, _node_ip_address="127.0.0.1", **common
            )
            return True
        except Exception as e:  # Ray gives its node a fixed 30 s to register; a loaded machine can miss it
            if "timed out during startup" not in str(e) or attempt == PRIVATE_RAY_TRIES:
                raise
            ray.shutdown()
            _stop_processes_under(temp_dir)
            print(
                f"summit batch: the private Ray did not start ({e}); starting it again ({attempt} of "
                f"{PRIVATE_RAY_TRIES} tries)",
                file=sys.stderr,
            )
    raise AssertionError("not reached: the last try returns or raises")


def _stop_processes_under(temp_dir: str) -> None:
    """Kill what a private Ray that did not start left running (its processes name its temp dir)."""
    import psutil

    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if temp_dir in " ".join(proc.cmdline()):
                proc.kill()


def _run_on_serve(args: dict, config, todo: list[Line], out: Path, err: Path, concurrency: int, bar) -> dict:
    """The YAML's app on Serve without HTTP (the same engines and vLLM validation as online), the lines through it."""
    from ray import serve

    from app.build.builder import build_app, engine_deployment_names

    serve.start(proxy_location="Disabled")
    serve.run(build_app(args), name=OFFLINE_APP, route_prefix=None)
    handles = {
        name: serve.get_deployment_handle(dep, OFFLINE_APP)
        for name, dep in engine_deployment_names(config, "hops").items()
    }
    return asyncio.run(_run_lines(todo, handles, out, err, concurrency, bar))


async def _run_lines(
    todo: list[Line], handles: dict, out: Path, err: Path, concurrency: int, progress: Progress
) -> dict[str, Any]:
    from deployments.batch.runner import send_group

    counts = {"ran": 0, "completed": 0, "failed": 0, "output_tokens": 0}
    start = time.monotonic()
    with open(out, "ab") as out_f, open(err, "ab") as err_f:

        async def done(line: Line, ok: bool, result: dict, tokens: int) -> None:
            f = out_f if ok else err_f
            f.write(json.dumps(result).encode() + b"\n")
            f.flush()
            counts["ran"] += 1
            counts["completed" if ok else "failed"] += 1
            counts["output_tokens"] += tokens
            progress.update(tokens)

        try:
            await run_lines(todo, lambda group: send_group(handles[group[0].model], group), done, concurrency)
        finally:
            progress.close()
            for f in (out_f, err_f):
                f.flush()
                os.fsync(f.fileno())
    seconds = time.monotonic() - start
    return {**counts, "seconds": round(seconds, 2), "tok_per_s": round(counts["output_tokens"] / max(seconds, 1e-9), 1)}


def _errors_path(out_path: str) -> str:
    base = out_path[: -len(".jsonl")] if out_path.endswith(".jsonl") else out_path
    return base + ".errors.jsonl"
