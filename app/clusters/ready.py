"""Say when a Serve YAML's application answers: `serve run CONFIG` only says that it submitted the config."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

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


def wait_ready(url: str, timeout_s: float, interval_s: float = 1.0, while_pid: int | None = None) -> Ready | None:
    """Poll until the engines answer (their model names and the request path), the timeout passes or `while_pid`
    exits (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (ready := engines_answering(url)) is not None:
            return ready
        if while_pid is not None and not psutil.pid_exists(while_pid):
            return None
        time.sleep(interval_s)
    return None


def wait_and_say(url: str, timeout_s: float, while_pid: int | None = None, quiet=lambda: False) -> bool:
    """Wait for the engines, then say so on stdout (with the request path's warning on stderr), or that they never
    answered; nothing is said once `quiet()` holds (the server is being stopped). True when they answer."""
    start = time.monotonic()
    ready = wait_ready(url, timeout_s, while_pid=while_pid)
    if quiet():
        return ready is not None
    took = time.monotonic() - start
    if ready is None:
        print(f"summit: {url} not answering after {took:.0f} s", file=sys.stderr, flush=True)
        return False
    print(f"summit: ready after {took:.0f} s: {url}/v1 serves {', '.join(ready.models)}", flush=True)
    if warning := path_warning(ready.path):
        print(warning, file=sys.stderr, flush=True)
    return True
