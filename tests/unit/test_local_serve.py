"""`summit serve`'s count of requests in flight when HAProxy was reloaded: the connections the replaced HAProxy still
holds count, the serving one's do not (its admin socket counts those). The HAProxy processes are fakes: a copy of
this Python named `haproxy` that accepts one connection and holds it, with the state folder in its arguments as
Serve's HAProxy has."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time

import psutil

from app.clusters.local_serve import soft_stopping_connections

HOLD = """
import socket, sys, time
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
print("listening", flush=True)
conn, _ = server.accept()
time.sleep(120)
"""


def fake_haproxy(binary, port: int, folder) -> subprocess.Popen:
    proc = subprocess.Popen(
        [str(binary), "-c", HOLD, str(port), "-f", str(folder / "haproxy.cfg")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "listening"
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_the_replaced_haproxys_connections_count(tmp_path):
    binary = tmp_path / "haproxy"
    shutil.copy(sys.executable, binary)
    folder = tmp_path / "state"
    folder.mkdir()
    old_port, new_port = free_port(), free_port()
    old = fake_haproxy(binary, old_port, folder)
    time.sleep(0.05)  # created later: the serving one
    new = fake_haproxy(binary, new_port, folder)
    clients = []
    try:
        assert psutil.Process(old.pid).name() == "haproxy"
        assert soft_stopping_connections(folder / "admin.sock", old_port) == 0  # nothing held yet
        clients.append(socket.create_connection(("127.0.0.1", old_port)))
        clients.append(socket.create_connection(("127.0.0.1", new_port)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and soft_stopping_connections(folder / "admin.sock", old_port) == 0:
            time.sleep(0.05)
        # the old process's stream counts; the newest one's connection is not counted here (its socket counts it)
        assert soft_stopping_connections(folder / "admin.sock", old_port) == 1
        assert soft_stopping_connections(folder / "admin.sock", new_port) == 0
        # another state folder's HAProxy is not this server's
        assert soft_stopping_connections(tmp_path / "other" / "admin.sock", old_port) == 0
    finally:
        for c in clients:
            c.close()
        for p in (old, new):
            p.kill()
            p.wait()


FAKE_SERVE = """#!/bin/sh
# a fake `serve`: each call appends a line; the first says what Ray says when its node did not register in time
echo call >> "$CALLS"
if [ "$(wc -l < "$CALLS")" -eq 1 ] && [ -n "$RAY_TIMES_OUT" ]; then
  echo "Exception: The current node timed out during startup. This could happen because ..." >&2
  exit 1
fi
echo "some other failure" >&2
exit 3
"""


def _serve_local_with_fake(tmp_path, monkeypatch, times_out: bool) -> tuple[int, int]:
    import signal

    from app.clusters import local_serve

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "serve").write_text(FAKE_SERVE)
    (bin_dir / "serve").chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setattr(local_serve, "serve_command", lambda: str(bin_dir / "serve"))
    monkeypatch.chdir(tmp_path)  # a failed server's logs are kept under ./logs
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("RAY_TIMES_OUT", "1" if times_out else "")
    config = tmp_path / "c.yaml"
    config.write_text("http_options: {host: 127.0.0.1, port: 1}\napplications: []\n")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        code = local_serve.serve_local(str(config), timeout_s=5)
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    return code, len(calls.read_text().splitlines())


def test_serve_starts_again_once_when_rays_node_did_not_register_in_time(tmp_path, monkeypatch):
    """Ray gives its node 30 s to register; on a loaded machine `serve run` then fails at start. `summit serve`
    starts it again, once, for that failure only."""
    assert _serve_local_with_fake(tmp_path / "a", monkeypatch, times_out=True) == (3, 2)
    assert _serve_local_with_fake(tmp_path / "b", monkeypatch, times_out=False) == (3, 1)
