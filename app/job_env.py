"""One Summit cluster's own ports and files, so that two on one machine (two SLURM jobs on a node, two test
clusters) do not collide: the Ray ports, Serve's HTTP port, HAProxy's files and ports, and the replicas' port
windows. `summit job-env` prints them as `export` lines for the sbatch job (cluster_yaml/slurm/summit.sbatch)."""

from __future__ import annotations

import random
import shutil
import socket
from pathlib import Path

from app.deployment_options import DIRECT_PATH_ENV

LOOPBACK = "127.0.0.1"

_handed_out: set[int] = set()  # ports this process gave to a cluster: two clusters of one test run never share


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def free_port_window(low: int, high: int, size: int = 100) -> int:
    """The first port of `size` consecutive ports in [low, high) that are free now (below Linux's ephemeral range,
    which free_port draws from), picked at random so that clusters started side by side get different windows.

    Every port is checked, and windows handed out by this process are never handed out again: Serve's replicas bind
    their ports with SO_REUSEPORT, so a replica of one cluster whose window overlapped another's would share a port
    with the other's replica, and the kernel would split one cluster's requests between both (seen in CI: a request
    to one app answered "model does not exist" by another app's replica)."""
    for _ in range(200):
        base = random.randrange(low, high - size, size)
        window = set(range(base, base + size))
        if window & _handed_out:
            continue
        try:
            for port in window:
                with socket.socket() as s:
                    s.bind((LOOPBACK, port))
        except OSError:
            continue
        _handed_out.update(window)
        return base
    raise RuntimeError(f"no free window of {size} ports in [{low}, {high})")


def haproxy_env(state_dir: Path) -> dict[str, str]:
    """Serve's HAProxy option with this cluster's own files and ports: by default HAProxy keeps its config and admin
    socket under /tmp/haproxy-serve and its stats and metrics on ports 8404 / 9101, one set per machine.

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
        # stats and metrics on loopback (app/haproxy.py), as scripts/serve.sh runs it
        "RAY_SERVE_HAPROXY_BINARY_PATH": shutil.which("summit-haproxy") or "",
        # replicas' own HTTP and gRPC ports: a window per cluster (Serve's default 30000+ / 40000+ is one per machine,
        # and two test clusters side by side would both take 30000)
        **{f"RAY_SERVE_DIRECT_INGRESS_{bound}_{proto}_PORT": str(base + (0 if bound == "MIN" else 99))
           for proto, base in [("HTTP", free_port_window(20000, 26000)), ("GRPC", free_port_window(26000, 32000))]
           for bound in ("MIN", "MAX")},
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


def job_serve_config(config: Path, http_port: int, out: Path) -> Path:
    """The Serve YAML with this job's HTTP port (on loopback unless the YAML binds elsewhere deliberately), its
    applications on the job's token auth (a YAML written for loopback development says `disabled`)."""
    import yaml

    data = yaml.safe_load(config.read_text())
    data["http_options"] = {"host": LOOPBACK, **data.get("http_options", {}), "port": http_port}
    for app in data.get("applications") or []:
        env_vars = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env_vars["RAY_AUTH_MODE"] = "token"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out
