"""README command 1 as a user runs it: `bash scripts/serve.sh` in a terminal. It says when the model answers, the
official client gets an answer, and Ctrl-C with a stream in flight and another client's idle keep-alive connection
open drains the stream (whole), does not wait for the idle connection, and leaves no process behind.

The server gets this test's own Ray temp dir (RAY_TMPDIR), HAProxy files and ports (app/clusters/job_env.haproxy_env)
and HTTP port (a copy of the shipped YAML), so that it never shares a port with the other test clusters of the run."""

from __future__ import annotations

import os
import pty
import select
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml

from app.clusters.job_env import free_port, haproxy_env
from app.clusters.local_serve import process_tree
from tests.conftest import TEST_CLUSTER_ENV
from tests.cpu.engine_apps import REPO
from tests.engine_checks import Throttle, titled

MODEL = "tiny-llama"
STREAM_TOKENS = 1500  # well inside the shipped YAML's max_model_len (2,048)


class Terminal:
    """A command under a pseudo-terminal (its own session, as a shell's job): what it prints, and Ctrl-C."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path):
        self.pid, self._fd = pty.fork()
        if self.pid == 0:  # the child
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        self.output = ""
        self._lock = threading.Lock()
        self.returncode: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self._fd], [], [], 0.5)
                chunk = os.read(self._fd, 65536) if ready else b""
            except OSError:  # the child has gone and closed the terminal
                return
            if chunk:
                with self._lock:
                    self.output += chunk.decode(errors="replace")

    def wait_for_text(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.output:
                return True
            if self.poll() is not None:
                return text in self.output
            time.sleep(0.2)
        return False

    def ctrl_c(self) -> None:
        os.write(self._fd, b"\x03")  # the terminal's interrupt character: SIGINT to its foreground process group

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.returncode

    def tail(self, n: int = 3000) -> str:
        return self.output[-n:]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    temp = Path(tempfile.mkdtemp(prefix="summit-sc-", dir="/tmp"))  # short: HAProxy's socket path limit
    config = yaml.safe_load((REPO / "serve_configs/tiny-cpu.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    (temp / "tiny-cpu.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    as_users_run_it = {k: v for k, v in os.environ.items() if k not in TEST_CLUSTER_ENV}
    env = {
        **as_users_run_it,
        **haproxy_env(temp / "h"),
        "RAY_TMPDIR": str(temp),
        "SUMMIT_TINY_MODEL": str(tiny_model_dir),
        "PYTHONUNBUFFERED": "1",
    }
    term = Terminal(["bash", "scripts/serve.sh", str(temp / "tiny-cpu.yaml")], env, REPO)
    processes: dict[int, psutil.Process] = {}
    try:
        yield term, port, processes
    finally:
        for proc in [*processes.values(), *process_tree(term.pid)]:  # what a failed test left running
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if term.poll() is None:
            os.kill(term.pid, signal.SIGKILL)
            term.wait(30)
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_command_says_ready_answers_and_ctrl_c_drains_only_requests_in_flight(served):
    term, port, processes = served
    assert term.wait_for_text("summit: ready", 900), term.tail()
    assert f"http://127.0.0.1:{port}/v1 serves {MODEL}" in term.output, term.tail()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=8).usage.completion_tokens == 8
    processes.update({p.pid: p for p in process_tree(term.pid)})  # Ray's daemons leave the tree when their parent goes
    cores = titled(processes.values(), "EngineCore")
    assert cores, "the server should run a vLLM EngineCore process"

    # another client that asked once and keeps its connection open (keep-alive), as an idle chat window does
    idle = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    assert idle.get("/v1/models").status_code == 200
    stream: dict = {}

    def run_stream():
        chunks = client.completions.create(
            model=MODEL,
            prompt="Go on",
            max_tokens=STREAM_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        stream["first"] = time.monotonic()
        stream["chunks"] = list(chunks)

    thread = threading.Thread(target=run_stream)
    # the engine crawls until the drain has begun, so that the stream is still running when Ctrl-C arrives
    with Throttle(cores):
        thread.start()
        deadline = time.monotonic() + 120
        while "first" not in stream and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "first" in stream, f"the stream did not start; {term.tail()}"
        term.ctrl_c()
        assert term.wait_for_text("summit: draining", 60), term.tail()
    # one request in flight: the idle keep-alive connection is not waited for
    assert "stopping once 1 request(s) in flight end" in term.output, term.tail()
    thread.join(300)
    chunks = stream.get("chunks")
    assert chunks, f"the stream in flight at Ctrl-C should end whole; {term.tail()}"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == STREAM_TOKENS, chunks[-1]
    assert term.wait(120) == 0, term.tail()
    assert "summit: drained; stopping" in term.output, term.tail()
    idle.close()
    left = [p for p in processes.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left running after Ctrl-C: {[(p.pid, p.name()) for p in left]}"
