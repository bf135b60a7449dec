"""Say when a Serve YAML's application answers, or why it never will: `serve run CONFIG` and `serve deploy` only say
that they submitted the config. Readiness is the engines answering on the YAML's HTTP port while Serve reports the
applications running; a start that fails ends the wait at once with the engine's own words
(app/clusters/serve_status.py), a start that hangs at the timeout with the last line each starting replica wrote."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from app.clusters.serve_status import Dashboard, Verdict, starting_replicas, verdict
from deployments.http.protocol import PATH_HEADER


def base_url(config_path: str | Path) -> str:
    """Where the YAML's `http_options` put Serve's HTTP endpoint, as a client on this machine reaches it."""
    config = yaml.safe_load(Path(config_path).read_text()) or {}
    http = config.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{http.get('port', 8000)}"


@dataclass
class Ready:
    models: list[str]
    path: str  # the app's request path, as its /v1/models answer tells it: "direct", or "hops; why"


def engines_answering(url: str, timeout_s: float = 2.0) -> Ready | None:
    """The served model names once every model's engine answers `/v1/models` (vLLM's entries carry
    `max_model_len`; the ingress lists a model it cannot reach without it), else None. With API keys on, the key
    is taken from OPENAI_API_KEY, as the OpenAI clients take it."""
    request = urllib.request.Request(f"{url}/v1/models")
    if os.environ.get("OPENAI_API_KEY"):
        request.add_header("Authorization", f"Bearer {os.environ['OPENAI_API_KEY']}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            data = json.load(response)["data"]
            path = response.headers.get(PATH_HEADER.decode()) or "direct"
    except Exception:  # not answering yet, in whatever way (refused, reset, a half response from a proxy reloading)
        return None
    if data and all("max_model_len" in m for m in data):
        return Ready([m["id"] for m in data], path)
    return None


def path_warning(path: str) -> str | None:
    """A one-line warning with the fix, when the app runs on the two-hop path because Ray was started without the
    direct path's settings (README command 1, SLURM, the launcher files and KubeRay all start it with them)."""
    if path.startswith("hops") and "RAY_SERVE_ENABLE_HA_PROXY" in path:
        return (
            "summit: warning: requests take the two-hop path (Serve's proxy, then an ingress replica): Ray was "
            'started without the direct path\'s settings. Fix: stop Ray, run `eval "$(summit direct-path-env)"`, '
            "then `ray start` and `serve deploy` again (docs/operations/troubleshooting.md)"
        )
    return None


def app_names(config_path: str | Path) -> list[str]:
    """The names of the YAML's applications (Serve's default name for one without)."""
    config = yaml.safe_load(Path(config_path).read_text()) or {}
    return [a.get("name") or "default" for a in config.get("applications") or []]


def dashboard_address(given: str | None = None) -> str:
    """The Ray dashboard that `serve deploy` talked to: the option, RAY_DASHBOARD_ADDRESS (Serve's CLI reads it
    too), else the head's default port on this machine."""
    return given or os.environ.get("RAY_DASHBOARD_ADDRESS") or "http://127.0.0.1:8265"


@dataclass
class Outcome:
    """How a wait ended: ready (`ready` set), failed (Serve's verdict), timeout or gone (`while_pid` exited)."""

    state: str
    ready: Ready | None = None
    verdict: Verdict | None = None
    last_logged: list[str] = field(default_factory=list)  # a timeout: what each starting replica wrote last


def wait_ready(
    url: str,
    timeout_s: float,
    interval_s: float = 1.0,
    while_pid: int | None = None,
    dashboard: Callable[[], Dashboard | None] = lambda: None,
    names: list[str] | None = None,
) -> Outcome:
    """Poll until the engines answer and Serve reports every application of `names` running, Serve reports one
    failed (`dashboard()`: where to ask, None while unknown; without one, the HTTP answer alone decides), the timeout
    passes or `while_pid` exits. A port answering for another server while Serve says the app is still starting is
    not taken for ready."""
    deadline = time.monotonic() + timeout_s
    status = Verdict("starting")
    while time.monotonic() < deadline:
        board = dashboard()
        apps = board.applications() if board is not None else None
        if apps is not None and names:
            status = verdict(apps, names)
            if status.state == "failed":
                return Outcome("failed", verdict=status)
        ready = engines_answering(url)
        if ready is not None and (apps is None or not names or status.state == "running"):
            return Outcome("ready", ready)
        if while_pid is not None and not psutil.pid_exists(while_pid):
            return Outcome("gone")
        time.sleep(interval_s)
    board = dashboard()
    return Outcome("timeout", verdict=status, last_logged=last_logged(board, names or []) if board else [])


def last_logged(board: Dashboard, names: list[str]) -> list[str]:
    """For each replica of `names` still starting: the last line its process (and so its engine) wrote."""
    apps = board.applications() or {}
    said = []
    for deployment, replica in starting_replicas(apps, names):
        lines = board.actor_output(replica["actor_id"]) if replica.get("actor_id") else []
        if lines:
            said.append(f"{deployment} replica {replica.get('replica_id')} last logged: {lines[-1].strip()}")
    return said


def wait_and_say(
    url: str,
    timeout_s: float,
    while_pid: int | None = None,
    quiet=lambda: False,
    dashboard: Callable[[], Dashboard | None] = lambda: None,
    names: list[str] | None = None,
) -> Outcome:
    """Wait for the engines, then say so on stdout (with the request path's warning on stderr), or say on stderr why
    they never will (the engine's own words, the fix, the log) or that they did not in time; nothing is said once
    `quiet()` holds (the server is being stopped)."""
    start = time.monotonic()
    outcome = wait_ready(url, timeout_s, while_pid=while_pid, dashboard=dashboard, names=names)
    if quiet():
        return outcome
    took = time.monotonic() - start
    for line in describe(outcome, url, took):
        print(line, file=sys.stdout if outcome.state == "ready" else sys.stderr, flush=True)
    if outcome.state == "ready" and (warning := path_warning(outcome.ready.path)):
        print(warning, file=sys.stderr, flush=True)
    return outcome


def describe(outcome: Outcome, url: str, took: float) -> list[str]:
    """The lines that say how the wait ended."""
    if outcome.state == "ready":
        return [f"summit: ready after {took:.0f} s: {url}/v1 serves {', '.join(outcome.ready.models)}"]
    if outcome.state == "failed":
        verdict_ = outcome.verdict
        lines = [f"summit: failed after {took:.0f} s: {verdict_.reason}"]
        if verdict_.failure is not None:
            lines.append(f"summit: fix: {verdict_.failure.fix}")
            if verdict_.failure.log:
                lines.append(f"summit: the replica's log: {verdict_.failure.log}")
        return lines
    if outcome.state == "gone":
        return [f"summit: the server exited before {url} answered"]
    lines = [f"summit: {url} not answering after {took:.0f} s"]
    if outcome.verdict is not None and outcome.verdict.detail:
        lines.append(f"summit: Serve says: {outcome.verdict.detail}")
    lines += [f"summit: {line}" for line in outcome.last_logged]
    return lines


def write_report(path: str | Path, outcome: Outcome) -> None:
    """How the wait ended, as JSON (the SLURM job puts it into endpoint.json): state, reason, and for an engine's
    failure its kind, fix and log; for a timeout what the starting replicas last wrote."""
    failure = outcome.verdict.failure if outcome.verdict is not None else None
    doc = {
        "state": outcome.state,
        "reason": outcome.verdict.reason if outcome.verdict is not None else None,
        "serve_status": outcome.verdict.serve_status if outcome.verdict is not None else None,
        "last_logged": outcome.last_logged,
        **({"model": failure.model, "kind": failure.kind, "fix": failure.fix, "log": failure.log} if failure else {}),
    }
    Path(path).write_text(json.dumps(doc, indent=1))
