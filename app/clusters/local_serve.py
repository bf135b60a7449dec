"""`summit serve-local CONFIG` (README command 1): `serve run` a Serve YAML on a private Ray instance of this machine,
say when its engines answer, and stop it on Ctrl-C — at once when no request is in flight, else once the requests in
flight have ended (streams run to their end); a second Ctrl-C stops it at once. Every process it started goes with
it. On the direct path HAProxy's admin socket says what is in flight (a client's idle keep-alive connection, an open
chat window, holds nothing up); without HAProxy, open client connections stand for requests.

`serve run` runs in a session of its own, so that the terminal's Ctrl-C reaches this process only: sent to the whole
process group, it also reached Ray's daemons and workers mid-shutdown, and `serve run` then waited out its 30 s
shutdown timeout for a controller that could no longer finish. It runs under a guard (app/clusters/guard.py): when
this process dies, however (SIGKILL, a closed terminal), the kernel tells the guard, which stops every process the
server started (Ray's daemons and HAProxy included: they are re-parented to the guard, not to init); and its output
passes through the guard, so that `summit serve-local ... | tee log` and Ctrl-C (which ends `tee` too) does not
kill `serve run` by SIGPIPE mid-drain. When the server fails, its Ray session's logs are copied to
`logs/serve-local-<time>/` before anything is removed."""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import psutil

from app.clusters.guard import stop_processes
from app.clusters.ready import Outcome, app_names, base_url, wait_and_say
from app.clusters.serve_status import Dashboard

_TCP_ESTABLISHED = "01"


def connections_to(port: int) -> int:
    """Established TCP connections whose local end is `port` on this machine (clients of the HTTP endpoint), read
    from /proc: no tool needed."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _TCP_ESTABLISHED and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def haproxy_socket(started: float) -> Path | None:
    """The admin socket of the HAProxy this server started (Serve puts it in a folder named by the node's id under
    RAY_SERVE_HAPROXY_SOCKET_PATH's folder): the newest one made since `started` (a time.time())."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return None
    configured = Path(os.environ.get("RAY_SERVE_HAPROXY_SOCKET_PATH", "/tmp/haproxy-serve/admin.sock"))
    found = []
    for path in configured.parent.glob(f"*/{configured.name}"):
        try:
            made = path.stat().st_mtime
        except OSError:
            continue
        if made >= started - 1:
            found.append((made, path))
    return max(found)[1] if found else None


def haproxy_in_flight(sock: Path) -> int | None:
    """Requests HAProxy is forwarding or queueing now (its backends' current and queued streams, `show stat`); None
    when its socket does not answer. A stream ends with its response: idle keep-alive connections are not counted."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(sock))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return None
    rows = csv.DictReader(io.StringIO(data.decode(errors="replace").removeprefix("# ")))
    return sum(
        int(row.get("scur") or 0) + int(row.get("qcur") or 0)
        for row in rows
        if row.get("svname") == "BACKEND" and row.get("pxname") != "stats"
    )


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def soft_stopping_connections(sock: Path, port: int) -> int:
    """Client connections to `port` still held by HAProxy processes that a reload replaced (Serve reloads HAProxy when
    replicas change: the new process answers the admin socket, the old one finishes its streams and exits, and it has
    closed its idle keep-alive connections, so each connection it holds is a request in flight)."""
    folder = str(sock.parent)
    mine = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
        if "haproxy" in (proc.info["name"] or "") and any(folder in part for part in proc.info["cmdline"] or []):
            mine.append(proc)
    count = 0
    for proc in sorted(mine, key=lambda p: p.info["create_time"])[:-1]:  # all but the newest
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        count += sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)
    return count


def in_flight(port: int, started: float) -> tuple[int, str]:
    """(count, what it counts): requests in flight at HAProxy (the serving process's and those a reload left to finish
    in the one it replaced), or else open client connections to `port`."""
    sock = haproxy_socket(started)
    busy = haproxy_in_flight(sock) if sock else None
    if busy is None:
        return connections_to(port), "open connection(s)"
    return busy + soft_stopping_connections(sock, port), "request(s) in flight"


# Ray's own start gives its node 30 s to register with the GCS (ray/_private/node.py): on a loaded machine it may not
_RAY_NODE_TIMED_OUT = b"The current node timed out during startup"
# ray.init's line for a local instance: "Started a local Ray instance. View the dashboard at http://127.0.0.1:8265"
_DASHBOARD_AT = re.compile(rb"View the dashboard at (https?://[\w.:\[\]-]+)")
_ANSI = re.compile(rb"\x1b\[[0-9;]*m")


def own_haproxy_ports() -> Path | None:
    """On the direct path, HAProxy's files and ports of this server's own (free ports, a folder under /tmp) unless the
    environment already names them: Serve's defaults (stats 8404, metrics 9101, fallback proxy 8500 / 9500, the
    replicas' 30000+ / 40000+) are one set per machine, and a second user's server on a shared node would collide."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1" or "RAY_SERVE_HAPROXY_STATS_PORT" in os.environ:
        return None
    from app.clusters.job_env import haproxy_env

    folder = Path(tempfile.mkdtemp(prefix="summit-", dir="/tmp"))  # short: HAProxy's socket paths
    os.environ.update(haproxy_env(folder / "h"))
    return folder


def serve_local(config: str, timeout_s: float = 1800) -> int:
    url = base_url(config)
    port = urlparse(url).port or 8000
    if taken := port_holder(urlparse(url).hostname or "127.0.0.1", port):
        print(
            f"summit: port {port} (http_options.port of {config}) is taken by {taken}: stop it, or set another "
            "http_options.port",
            file=sys.stderr,
        )
        return 1
    own = own_haproxy_ports()
    try:
        return _serve_local(config, url, port, timeout_s)
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def _serve_local(config: str, url: str, port: int, timeout_s: float) -> int:
    started = time.time()
    interrupts: list[float] = []
    signal.signal(signal.SIGINT, lambda *_: interrupts.append(time.monotonic()))
    signal.signal(signal.SIGTERM, lambda *_: interrupts.append(time.monotonic()))
    signal.signal(signal.SIGHUP, lambda *_: interrupts.append(time.monotonic()))  # the terminal closed
    names = app_names(config)
    for attempt in (1, 2):
        server, said = _serve_run(config)
        known: dict[int, psutil.Process] = {}  # the server's processes seen so far (Ray's daemons outlive their parent)
        stopping = lambda s=server: bool(interrupts) or s.poll() is not None  # noqa: E731
        outcome: list[Outcome] = []  # how the wait for the engines ended: a failure or a timeout stops the server

        def wait(s=server, said=said) -> None:
            board = lambda: Dashboard(said.dashboard) if said.dashboard else None  # noqa: E731
            outcome.append(wait_and_say(url, timeout_s, s.pid, stopping, dashboard=board, names=names))

        threading.Thread(target=wait, daemon=True).start()
        _run_until_stopped(server, known, interrupts, port, started, outcome)
        known.update({p.pid: p for p in process_tree(server.pid)})
        stop_processes([p for p in known.values() if p.is_running()])
        if attempt == 1 and not interrupts and server.returncode and said.ray_timed_out.wait(2):
            print("summit: Ray's node did not register in time (a busy machine?); starting again", file=sys.stderr)
            continue
        break
    failed = not interrupts and (server.returncode or (outcome and outcome[0].state in ("failed", "timeout")))
    if failed:
        kept = keep_session_logs(started, Path("logs") / time.strftime("serve-local-%Y%m%d-%H%M%S"))
        if kept is not None:
            print(f"summit: the server failed; its Ray logs (replicas, engines, controller): {kept}", file=sys.stderr)
    return 0 if interrupts else (server.returncode or (1 if failed else 0))


def keep_session_logs(started: float, dest: Path) -> Path | None:
    """Copy the logs of the Ray session this server started (`$RAY_TMPDIR/ray/session_latest`, if it began after
    `started`) to `dest`; None when there is none."""
    session = Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray" / "session_latest"
    try:
        logs = session.resolve() / "logs"
        if session.resolve().stat().st_mtime < started - 5 or not logs.is_dir():
            return None
        shutil.copytree(logs, dest, symlinks=True, ignore_dangling_symlinks=True, dirs_exist_ok=True)
    except OSError:
        return None
    return dest.resolve()


@dataclass
class _Said:
    """What `serve run` said on its way that this process acts on."""

    ray_timed_out: threading.Event = field(default_factory=threading.Event)  # Ray's node missed its 30 s
    dashboard: str | None = None  # the local Ray instance's dashboard ("View the dashboard at http://...")


def serve_command() -> str:
    """Serve's CLI beside this Python (a venv's bin, used without activating it), else the one on PATH."""
    from app.clusters.job_env import venv_command

    return venv_command("serve") or "serve"


def port_holder(host: str, port: int) -> str | None:
    """Who listens on `port` already ("PID 123 (python3 -m ...)", or "another process" where it cannot be told), or
    None when the port is free to bind."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError:
            pass
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                cmd = " ".join(psutil.Process(conn.pid).cmdline()[:4])
                return f"PID {conn.pid} ({cmd})"
    except (psutil.Error, OSError):
        pass
    return "another process"


def _serve_run(config: str) -> tuple[subprocess.Popen, _Said]:
    """`serve run` of the YAML on a fresh local Ray instance, its stderr passed on (and read for what `_Said` keeps)."""
    # under a guard (app/clusters/guard.py): nothing it starts outlives this process, whatever ends it
    guarded = [
        sys.executable,
        "-m",
        "app.clusters.guard",
        str(os.getpid()),
        "--",
        serve_command(),
        "run",
        "-a",
        "local",
    ]
    server = subprocess.Popen([*guarded, config], start_new_session=True, stderr=subprocess.PIPE)
    said = _Said()

    def pass_on() -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in server.stderr:
            if _RAY_NODE_TIMED_OUT in line:
                said.ray_timed_out.set()
            if said.dashboard is None and (found := _DASHBOARD_AT.search(_ANSI.sub(b"", line))):
                said.dashboard = found.group(1).decode()
            if out is not None:
                try:
                    out.write(line)
                    out.flush()
                except (BrokenPipeError, OSError, ValueError):
                    out = None  # whoever read our stderr is gone: keep reading for the message above

    threading.Thread(target=pass_on, daemon=True).start()
    return server, said


def _run_until_stopped(
    server: subprocess.Popen,
    known: dict[int, psutil.Process],
    interrupts: list[float],
    port: int,
    started: float,
    outcome: list,
) -> None:
    """Until the server exits, its start fails or times out (`outcome`), or Ctrl-C: at once with no request in flight,
    else once they ended (or Ctrl-C again)."""
    draining, looked = False, 0.0
    while server.poll() is None:
        if outcome and outcome[0].state in ("failed", "timeout"):
            known.update({p.pid: p for p in process_tree(server.pid)})
            print("summit: stopping the server (it cannot serve)", file=sys.stderr, flush=True)
            return
        if time.monotonic() - looked > 2:
            known.update({p.pid: p for p in process_tree(server.pid)})
            looked = time.monotonic()
        if interrupts and not draining:
            busy, what = in_flight(port, started)
            if busy == 0:
                print("summit: stopping (no request in flight)", file=sys.stderr, flush=True)
                return
            print(
                f"summit: draining: stopping once {busy} {what} end; Ctrl-C again stops now",
                file=sys.stderr,
                flush=True,
            )
            draining = True
        elif draining and len(interrupts) > 1:
            print("summit: stopping now", file=sys.stderr, flush=True)
            return
        elif draining and in_flight(port, started)[0] == 0:
            print("summit: drained; stopping", file=sys.stderr, flush=True)
            return
        time.sleep(0.2)
