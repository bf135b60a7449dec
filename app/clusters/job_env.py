"""One Summit cluster's own ports and files, so that two on one machine (two SLURM jobs on a node, two test
clusters) do not collide: the Ray ports, Serve's HTTP port, HAProxy's files and ports, and the replicas' port
windows. `summit job-env` prints them as `export` lines for the sbatch job (cluster_yaml/slurm/summit.sbatch)."""

from __future__ import annotations

import functools
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from app.build.options import DIRECT_PATH_ENV

LOOPBACK = "127.0.0.1"

_handed_out: set[int] = set()  # ports this process gave to a cluster: two clusters of one test run never share
_CLAIMS = Path(tempfile.gettempdir()) / "summit-port-claims"
_CLAIM_FRESH_S = 600  # a claim whose process is gone still holds this long: the cluster it named may be starting


def _claim(name: str) -> bool:
    """Claim `name` (a port or a window) on this machine, for processes that pick ports side by side (two test
    workers, two SLURM jobs starting on one node): a port that is free now may be taken by the other's cluster a few
    seconds later. A claim holds while the process that made it lives, and for `_CLAIM_FRESH_S` after it was made."""
    _CLAIMS.mkdir(parents=True, exist_ok=True)
    path = _CLAIMS / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            pid, age = int(path.read_text() or 0), time.time() - path.stat().st_mtime
        except (OSError, ValueError):
            return False  # being written by its claimer
        if age < _CLAIM_FRESH_S or _alive(pid):
            return False
        mine = path.with_name(f".{name}.{os.getpid()}")
        mine.write_text(str(os.getpid()))
        os.replace(mine, path)
        return True
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


@functools.cache
def _ephemeral_range() -> tuple[int, int]:
    """Linux's range for ports that bind(0) and connect() pick (net.ipv4.ip_local_port_range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now, above the kernel's ephemeral range: a port the kernel hands out to any bind(0) or connect()
    (SLURM's srun took a job's dashboard port so, between `summit job-env` and `ray start`) is never chosen."""
    low = _ephemeral_range()[1] + 1
    for _ in range(2000 if 65535 - low >= 1000 else 0):
        port = random.randrange(low, 65536)
        if port not in _handed_out and _bindable(port) and _claim(f"port-{port}"):
            _handed_out.add(port)
            return port
    while True:  # a machine whose ephemeral range leaves no room above it: the kernel's choice
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in _handed_out and _claim(f"port-{port}"):
            _handed_out.add(port)
            return port


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind((LOOPBACK, port))
        return True
    except OSError:
        return False


def free_port_window(low: int, high: int, size: int = 100) -> int:
    """The first port of `size` consecutive ports in [low, high) that are free now (below Linux's ephemeral range,
    free_port draws above it), picked at random so that clusters started side by side get different windows.

    Every port is checked, and windows handed out by this process are never handed out again: Serve's replicas bind
    their ports with SO_REUSEPORT, so a replica of one cluster whose window overlapped another's would share a port
    with the other's replica, and the kernel would split one cluster's requests between both (seen in CI: a request
    to one app answered "model does not exist" by another app's replica)."""
    for _ in range(200):
        base = random.randrange(low, high - size, size)
        window = set(range(base, base + size))
        if window & _handed_out:
            continue
        if not all(_bindable(port) for port in window) or not _claim(f"window-{base}"):
            continue
        _handed_out.update(window)
        return base
    raise RuntimeError(f"no free window of {size} ports in [{low}, {high})")


def haproxy_env(state_dir: Path) -> dict[str, str]:
    """Serve's HAProxy option with this cluster's own files and ports: by default HAProxy keeps its config and admin
    socket under /tmp/haproxy-serve, its stats and metrics on ports 8404 / 9101 and its fallback proxy on 8500 / 9500,
    one set per machine.

    Keep `state_dir` short: Serve adds a 56-character node id below it and HAProxy refuses socket paths over 97."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return {
        **DIRECT_PATH_ENV,
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(state_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(state_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(state_dir / "metrics.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(state_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(state_dir / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        # The head's fallback Serve proxy, HAProxy's `backup` server while an app has no ready replica. Its default
        # ports (8500 / 9500) are one per machine and bound with SO_REUSEPORT: two clusters' fallback proxies would
        # share them and the kernel would hand one cluster's requests to the other's apps (seen in CI: a replaced
        # replica's requests answered "model does not exist" by another test cluster).
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        # stats and metrics on loopback (app/clusters/haproxy.py), as scripts/serve.sh runs it
        "RAY_SERVE_HAPROXY_BINARY_PATH": summit_haproxy() or "",
        # replicas' own HTTP and gRPC ports: a window per cluster (Serve's default 30000+ / 40000+ is one per machine,
        # and two test clusters side by side would both take 30000)
        **{
            f"RAY_SERVE_DIRECT_INGRESS_{bound}_{proto}_PORT": str(base + (0 if bound == "MIN" else 99))
            for proto, base in [("HTTP", free_port_window(20000, 26000)), ("GRPC", free_port_window(26000, 32000))]
            for bound in ("MIN", "MAX")
        },
    }


def job_env(state_dir: Path) -> dict[str, str]:
    """Everything one job's Ray and Serve need of their own: Ray's GCS, dashboard and client ports, Serve's HTTP
    port (SUMMIT_HTTP_PORT), and the direct path's HAProxy with its files under `state_dir` (keep it short)."""
    return {
        "SUMMIT_RAY_PORT": str(free_port()),
        "SUMMIT_DASHBOARD_PORT": str(free_port()),
        "SUMMIT_HTTP_PORT": str(free_port()),
        **haproxy_env(state_dir),
    }


BUILDER = "app.build:build_app"


def job_serve_config(config: Path, http_port: int, out: Path, key_file: Path | None = None) -> Path:
    """The Serve YAML with this job's HTTP port (on loopback unless the YAML binds elsewhere deliberately), its
    applications on the job's token auth (a YAML written for loopback development says `disabled`). With `key_file`,
    Summit's applications without an `auth:` section of their own take their API keys from it (the job writes it):
    loopback on a shared node is open to every user of that node."""
    import yaml

    data = yaml.safe_load(config.read_text())
    data["http_options"] = {"host": LOOPBACK, **data.get("http_options", {}), "port": http_port}
    for app in data.get("applications") or []:
        env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env_vars["RAY_AUTH_MODE"] = "token"
        args = app.get("args") or {}
        if key_file is not None and app.get("import_path") == BUILDER and not args.get("auth"):
            app["args"] = {**args, "auth": {"api_keys_file": str(key_file)}}
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def uses_key_file(job_config: Path, key_file: Path) -> bool:
    import yaml

    apps = (yaml.safe_load(job_config.read_text()) or {}).get("applications") or []
    return any(((a.get("args") or {}).get("auth") or {}).get("api_keys_file") == str(key_file) for a in apps)


def write_api_key(path: Path) -> Path:
    """A new API key in a file only its owner reads (0600), one line."""
    import secrets

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"sk-summit-{secrets.token_urlsafe(32)}\n")
    os.chmod(path, 0o600)
    return path


def yaml_http_options(config: Path) -> dict:
    """A Serve YAML's `http_options` ({} when it has none)."""
    import yaml

    return (yaml.safe_load(config.read_text()) or {}).get("http_options") or {}


def job_drain_config(job_config: Path) -> Path:
    """The job's Serve YAML without applications, beside it (`<name>-drain.yaml`): deploying it deletes every
    application gracefully while Serve's proxies stay up. `serve shutdown` would stop the proxies at once, and on the
    direct path that kills HAProxy with the streams it carries; with the proxies up, each replica finishes its running
    requests (graceful_shutdown_timeout_s) and HAProxy's reload lets the replaced process finish its streams."""
    import yaml

    data = yaml.safe_load(job_config.read_text())
    data["applications"] = []
    out = job_config.with_name(f"{job_config.stem}-drain.yaml")
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def job_exports(state_dir: Path, config: Path, config_out: Path) -> dict[str, str]:
    """`summit job-env`: the job's own ports and files (job_env), its copy of the Serve YAML on its HTTP port, the
    host that copy binds and its drain config; an API key beside that copy (`api_key`, 0600) unless every application
    brings its own `auth:` (SUMMIT_API_KEY_FILE, empty then)."""
    env = job_env(state_dir)
    key_file = config_out.parent / "api_key"
    job_config = job_serve_config(config, int(env["SUMMIT_HTTP_PORT"]), config_out, key_file)
    env["SUMMIT_API_KEY_FILE"] = str(write_api_key(key_file)) if uses_key_file(job_config, key_file) else ""
    env["SUMMIT_JOB_CONFIG"] = str(job_config)
    env["SUMMIT_HTTP_HOST"] = str((yaml_http_options(job_config)).get("host", "127.0.0.1"))
    env["SUMMIT_DRAIN_CONFIG"] = str(job_drain_config(job_config))
    return env


def direct_path_exports() -> dict[str, str]:
    """`summit direct-path-env`: the direct path's environment, with Summit's HAProxy wrapper where installed."""
    env = dict(DIRECT_PATH_ENV)
    if binary := summit_haproxy():
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = binary
    return env


def venv_command(name: str) -> str | None:
    """A console script beside this Python (a venv's bin, used without activating it), else the one on PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def summit_haproxy() -> str | None:
    """Summit's HAProxy wrapper (app/clusters/haproxy.py), where installed."""
    return venv_command("summit-haproxy")


def exports(env: dict[str, str]) -> str:
    """`export KEY=VALUE` lines a shell can eval."""
    import shlex

    return "\n".join(f"export {key}={shlex.quote(value)}" for key, value in env.items())
