"""`summit serve-local CONFIG` (README command 1): `serve run` a Serve YAML on a private Ray instance of this machine,
say when its engines answer, and stop it on Ctrl-C — at once when no client is connected, else once the clients'
connections have closed (their streams ended); a second Ctrl-C stops it at once. Every process it started goes with
it.

`serve run` runs in a session of its own, so that the terminal's Ctrl-C reaches this process only: sent to the whole
process group, it also reached Ray's daemons and workers mid-shutdown, and `serve run` then waited out its 30 s
shutdown timeout for a controller that could no longer finish."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
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


def _tree(pid: int) -> list[psutil.Process]:
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


def serve_local(config: str, timeout_s: float = 1800) -> int:
    url = base_url(config)
    port = urlparse(url).port or 8000
    server = subprocess.Popen(["serve", "run", "-a", "local", config], start_new_session=True)
    known: dict[int, psutil.Process] = {}  # the server's processes seen so far (Ray's daemons outlive their parent)
    interrupts: list[float] = []
    signal.signal(signal.SIGINT, lambda *_: interrupts.append(time.monotonic()))
    signal.signal(signal.SIGTERM, lambda *_: interrupts.append(time.monotonic()))

    stopping = lambda: bool(interrupts) or server.poll() is not None  # noqa: E731
    threading.Thread(target=wait_and_say, args=(url, timeout_s, server.pid, stopping), daemon=True).start()
    draining, looked = False, 0.0
    while server.poll() is None:
        if time.monotonic() - looked > 2:
            known.update({p.pid: p for p in _tree(server.pid)})
            looked = time.monotonic()
        if interrupts and not draining:
            busy = connections_to(port)
            if busy == 0:
                print("summit: stopping (no request in flight)", file=sys.stderr, flush=True)
                break
            print(
                f"summit: draining: stopping once {busy} open connection(s) close; Ctrl-C again stops now",
                file=sys.stderr,
                flush=True,
            )
            draining = True
        elif draining and len(interrupts) > 1:
            print("summit: stopping now", file=sys.stderr, flush=True)
            break
        elif draining and connections_to(port) == 0:
            print("summit: drained; stopping", file=sys.stderr, flush=True)
            break
        time.sleep(0.2)
    known.update({p.pid: p for p in _tree(server.pid)})
    _stop([p for p in known.values() if p.is_running()])
    return 0 if interrupts else (server.returncode or 0)
