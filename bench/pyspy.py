"""py-spy samples of running server processes while a load runs, and where each process's time went.

    python bench/serve_overhead.py --profile /tmp/prof ...   # records every Python process of each peer per load
    python bench/pyspy.py /tmp/prof/summit-r1-c16-*.txt       # the summary again, of any raw files

`record(pids, prefix)` runs one `py-spy record --format raw` per process (50 Hz, non-blocking: the process is not
paused) and stops them with SIGINT when the block ends; `summarize(path)` reads a raw file (one line per distinct
stack, `frame;frame;... count`) and gives the process's busy share (samples not waiting in a poll, select, sleep or
lock) and the functions with the most busy samples (inclusive, and where the sample was taken: self).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

RATE_HZ = 50
# a sample whose innermost frame is one of these is the process waiting, not working
_IDLE = re.compile(
    r"^(select|epoll_wait|poll|_poll|wait|_wait_for_tstate_lock|sleep|acquire|recv|recv_multipart|"
    r"accept|_recv|read|readinto|do_wait|_worker|get)\b"
)


@contextlib.contextmanager
def record(pids: list[int], prefix: Path):
    """py-spy on each of `pids` while the block runs; raw samples in `{prefix}-{pid}.txt`, a summary printed and
    written to `{prefix}-summary.txt`."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for pid in pids:
        out = Path(f"{prefix}-{pid}.txt")
        cmd = [spy, "record", "--nonblocking", "-r", str(RATE_HZ), "-p", str(pid), "-f", "raw", "-o", str(out)]
        procs.append((pid, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    t0 = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - t0
        for _, _, proc in procs:
            proc.send_signal(signal.SIGINT)
        lines = []
        for pid, out, proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            if out.exists():
                lines.append(summarize(out, seconds, title=f"pid {pid}"))
        text = "\n".join(x for x in lines if x)
        Path(f"{prefix}-summary.txt").write_text(text)
        print(text, flush=True)


def _frame(name: str) -> str:
    """`function (path/to/file.py:line)` without the site-packages prefix or the line."""
    name = re.sub(r"\(.*?/(site-packages|lib/python3\.\d+)/", "(", name)
    return re.sub(r":\d+\)$", ")", name)


def summarize(path: Path, seconds: float | None = None, title: str = "", top: int = 25) -> str:
    """Where one process's busy samples went: its busy share of a core, then the functions with the most busy
    samples (inclusive, with the share of them spent in the function itself)."""
    inclusive: Counter = Counter()
    own: Counter = Counter()
    busy = total = 0
    thread_name = ""
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        total += n
        if _IDLE.match(frames[-1]):
            continue
        busy += n
        thread_name = thread_name or frames[0]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    if not total:
        return ""
    share = f", {busy / RATE_HZ / seconds:.0%} of a core" if seconds else ""
    head = f"== {title or Path(path).name}: {busy} busy of {total} samples{share} ({Path(path).name})"
    rows = [
        f"{n:6d} {100 * n / max(busy, 1):5.1f}% self {100 * own[f] / max(busy, 1):5.1f}%  {f[:140]}"
        for f, n in inclusive.most_common(top)
    ]
    return "\n".join([head, *rows])


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
