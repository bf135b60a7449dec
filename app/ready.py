"""Say when a Serve YAML's application answers: `serve run CONFIG` only says that it submitted the config."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import psutil
import yaml


def base_url(config_path: str | Path) -> str:
    """Where the YAML's `http_options` put Serve's HTTP endpoint, as a client on this machine reaches it."""
    config = yaml.safe_load(Path(config_path).read_text()) or {}
    http = config.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{http.get('port', 8000)}"


def engines_answering(url: str, timeout_s: float = 2.0) -> list[str] | None:
    """The served model names once every model's engine answers `/v1/models` (vLLM's entries carry
    `max_model_len`; the ingress lists a model it cannot reach without it), else None. With API keys on, the key
    is taken from OPENAI_API_KEY, as the OpenAI clients take it."""
    request = urllib.request.Request(f"{url}/v1/models")
    if os.environ.get("OPENAI_API_KEY"):
        request.add_header("Authorization", f"Bearer {os.environ['OPENAI_API_KEY']}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            data = json.load(response)["data"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data and all("max_model_len" in m for m in data):
        return [m["id"] for m in data]
    return None


def wait_ready(url: str, timeout_s: float, interval_s: float = 1.0, while_pid: int | None = None) -> list[str] | None:
    """Poll until the engines answer (their model names), the timeout passes or `while_pid` exits (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (models := engines_answering(url)) is not None:
            return models
        if while_pid is not None and not psutil.pid_exists(while_pid):
            return None
        time.sleep(interval_s)
    return None
