"""The server's guard (app/clusters/guard.py) on plain processes: what a command starts, even a process that left its
session and parent (as Ray's daemons and HAProxy do), ends when the guard's parent is SIGKILLed, and when the
command exits; the command's output gets through after its reader is gone. The real server's case (README command 1
SIGKILLed) is tests/cpu/test_serve_command.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]


def marked(mark: str) -> list[psutil.Process]:
    """Live processes whose name (argv[0], set with bash's `exec -a`) starts with `mark`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (p.info["cmdline"] or [""])[0].startswith(mark) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("threads", [0, 8])
def test_a_sigkilled_parent_leaves_nothing_of_what_the_guard_started(threads):
    """The parent (standing for `summit serve-local`, which has threads of its own) starts the guard over a shell that
    starts a child and a process in a new session whose parent exits (re-parented: to init without the guard's
    subreaper). SIGKILL the parent: the kernel's parent-death signal reaches the guard (again as each of the parent's
    threads exits), which says so and stops both. Fails with either prctl missing."""
    mark = f"guard-test-{uuid.uuid4().hex}"
    command = f"(setsid bash -c 'exec -a {mark}-orphan sleep 301' &); exec -a {mark}-main sleep 302"
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, threading, time
        for _ in range({threads}):
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        subprocess.Popen([sys.executable, "-m", "app.clusters.guard", str(os.getpid()), "--", "bash", "-c",
                          {command!r}], start_new_session=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert until(lambda: len(marked(mark)) == 2, 30), [p.info["cmdline"] for p in marked(mark)]
        (orphan,) = [p for p in marked(mark) if p.info["cmdline"][0].endswith("-orphan")]
        assert orphan.ppid() != 1, "the guard (a subreaper) should have adopted the process whose parent left"
        proc.kill()
        assert until(lambda: not marked(mark), 10), [p.info["cmdline"] for p in marked(mark)]
        said, _ = proc.communicate(timeout=30)  # the guard's stdout: the parent's, until the guard has gone
        assert "summit: the serving command died; its guard stops the 2 processes it started" in said, said
    finally:
        proc.kill()
        for p in marked(mark):
            p.kill()


def test_the_command_exiting_stops_what_it_left_and_gives_its_code():
    mark = f"guard-test-{uuid.uuid4().hex}"
    shell = (
        f"(setsid bash -c 'exec -a {mark}-orphan sleep 303' &); until pgrep -f ^{mark} >/dev/null; do :; done; exit 3"
    )
    guard = [sys.executable, "-m", "app.clusters.guard", str(os.getpid()), "--", "bash", "-c", shell]
    run = subprocess.run(guard, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert until(lambda: not marked(mark), 10)


def test_output_goes_on_after_its_reader_is_gone():
    """`guard ... | head -1`: the command keeps writing after `head` exits and ends normally (the guard exits 0;
    had it passed the pipe on, the command would have died of SIGPIPE and the guard exited 141)."""
    shell = (
        f"{sys.executable} -m app.clusters.guard $$ -- bash -c "
        "'for i in $(seq 1 20000); do echo line $i; done; echo finished >&2' | head -n 1; echo guard=${PIPESTATUS[0]}"
    )
    run = subprocess.run(["bash", "-c", shell], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.stdout.splitlines() == ["line 1", "guard=0"], run.stdout
    assert "finished" in run.stderr
