"""`summit serve-local CONFIG` (README command 1): `serve run` a Serve YAML on a private Ray instance of this machine,
say when its engines answer, and stop it on Ctrl-C — at once when no request is in flight, else once the requests in
flight have ended (streams run to their end); a second Ctrl-C stops it at once. Every process it started goes with
it. On the direct path HAProxy's admin socket says what is in flight (a client's idle keep-alive connection, an open
chat window, holds nothing up); without HAProxy, open client connections stand for requests.

`serve run` runs in a session of its own, so that the terminal's Ctrl-C reaches this process only: sent to the whole
process group, it also reached Ray's daemons and workers mid-shutdown, and `serve run` then waited out its 30 s
shutdown timeout for a controller that could no longer finish."""

from __future__ import annotations

import csv
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil

from app.clusters.ready import base_url, wait_and_say

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


def _stop(procs: list[psutil.Process], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` for what is left."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


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


def serve_local(config: str, timeout_s: float = 1800) -> int:
    url = base_url(config)
    port = urlparse(url).port or 8000
    started = time.time()
    interrupts: list[float] = []
    signal.signal(signal.SIGINT, lambda *_: interrupts.append(time.monotonic()))
    signal.signal(signal.SIGTERM, lambda *_: interrupts.append(time.monotonic()))
    for attempt in (1, 2):
        server, ray_timed_out = _serve_run(config)
        known: dict[int, psutil.Process] = {}  # the server's processes seen so far (Ray's daemons outlive their parent)
        stopping = lambda s=server: bool(interrupts) or s.poll() is not None  # noqa: E731
        threading.Thread(target=wait_and_say, args=(url, timeout_s, server.pid, stopping), daemon=True).start()
        _run_until_stopped(server, known, interrupts, port, started)
        known.update({p.pid: p for p in process_tree(server.pid)})
        _stop([p for p in known.values() if p.is_running()])
        if attempt == 1 and not interrupts and server.returncode and ray_timed_out.wait(2):
            print("summit: Ray's node did not register in time (a busy machine?); starting again", file=sys.stderr)
            continue
        break
    return 0 if interrupts else (server.returncode or 0)


def _serve_run(config: str) -> tuple[subprocess.Popen, threading.Event]:
    """`serve run` of the YAML on a fresh local Ray instance, its stderr passed on; the event: Ray's node timed out."""
    server = subprocess.Popen(["serve", "run", "-a", "local", config], start_new_session=True, stderr=subprocess.PIPE)
    timed_out = threading.Event()

    def pass_on() -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in server.stderr:
            if _RAY_NODE_TIMED_OUT in line:
                timed_out.set()
            if out is not None:
                out.write(line)
                out.flush()

    threading.Thread(target=pass_on, daemon=True).start()
    return server, timed_out


def _run_until_stopped(
    server: subprocess.Popen, known: dict[int, psutil.Process], interrupts: list[float], port: int, started: float
) -> None:
    """Until the server exits, or Ctrl-C: at once with no request in flight, else once they ended (or Ctrl-C again)."""
    draining, looked = False, 0.0
    while server.poll() is None:
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
