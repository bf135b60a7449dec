"""A server's guard: `python -m app.clusters.guard PARENT_PID -- COMMAND...` runs COMMAND (e.g. `serve run`) and
makes sure nothing it started outlives the guard's parent (`summit serve-local`), however that parent ends.

- The kernel's parent-death signal (prctl PR_SET_PDEATHSIG): the guard gets SIGHUP when its parent dies, even by
  SIGKILL or a closed terminal, says so on its stdout and stops everything under it. The kernel sends it again as
  each of the dying parent's threads exits: the first one starts the stop, and the stop ignores the rest (one that
  cut it short left the whole server running, seen in CI).
- A child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process under the guard whose parent exits (Ray's daemons when
  `serve run` goes, HAProxy daemonizing itself) is re-parented to the guard instead of to init, so the guard's
  process tree holds every process the server started.
- COMMAND's stdout and stderr are read by the guard and passed on; a reader that went away (`| tee` ended by the same
  Ctrl-C) costs COMMAND nothing: written to a closed pipe, `serve run` (a Ray driver that prints its workers' logs)
  would die of SIGPIPE mid-drain, and the Ray instance with it.

When COMMAND exits, the guard stops what is left under it and exits with COMMAND's code. Linux only (prctl); elsewhere
it runs COMMAND with the stop on exit alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_processes(procs: list[psutil.Process], grace_s: float = 2.0) -> None:
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


def stop_tree(root: psutil.Process, grace_s: float = 2.0) -> None:
    """Every process under `root` (not `root`) stopped, and what started meanwhile (a worker forked during the
    stop)."""
    for _ in range(3):
        try:
            procs = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        if not procs:
            return
        stop_processes(procs, grace_s)


def _pass_on(source, sink) -> None:
    """Copy a child's output to ours; once ours is gone (a closed pipe), keep reading and drop it."""
    sink = getattr(sink, "buffer", sink)
    for line in iter(source.readline, b""):
        if sink is None:
            continue
        try:
            sink.write(line)
            sink.flush()
        except (BrokenPipeError, OSError, ValueError):
            sink = None


class _Stop(Exception):
    """A stop signal while waiting: SIGHUP (the parent died), SIGTERM (the parent stops us), SIGINT."""


STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PARENT_DIED = signal.SIGHUP  # the parent-death signal: the guard has no terminal to send it one


def _ignore_stops() -> None:
    """From here the stop runs to its end: a second signal cannot cut it short."""
    for sig in STOPS:
        signal.signal(sig, signal.SIG_IGN)


def _raise_stop(signum, _frame) -> None:
    _ignore_stops()  # first
    raise _Stop(signum)


def _say(text: str) -> None:
    """A line on the guard's stdout (the user's terminal, where its parent's stderr went with the parent)."""
    try:
        os.write(1, f"summit: {text}\n".encode())
    except OSError:
        pass


def _pass_on_thread(source, sink) -> threading.Thread:
    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # the main thread's: its waitpid wakes for the stop
        _pass_on(source, sink)

    return threading.Thread(target=run, daemon=True)


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[argv.index("--") + 1 :]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, PARENT_DIED)
    me = psutil.Process()
    for sig in STOPS:
        signal.signal(sig, _raise_stop)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    code = None
    try:
        if os.getppid() != parent:  # the parent died before the death signal was armed
            return 1
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for source, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            _pass_on_thread(source, sink).start()
        while code is None:
            try:  # reap every child: COMMAND, and the orphans re-parented to this subreaper
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child.pid:
                code = os.waitstatus_to_exitcode(status)
                child.returncode = code
        _ignore_stops()
    except _Stop as stop:
        if stop.args[0] == PARENT_DIED:
            left = len(me.children(recursive=True))
            _say(f"the serving command died; its guard stops the {left} processes it started")
    for _ in range(2):
        try:
            stop_tree(me)
            break
        except Exception as e:  # noqa: BLE001 — said, then once more: nothing may outlive the guard
            _say(f"stopping the server's processes: {e!r}")
    if code is None:
        return 143
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
