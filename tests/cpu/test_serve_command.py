"""README command 1 as a user runs it: `bash scripts/serve.sh | tee serve.log` in a terminal. It says when the model
answers, the official client gets an answer, and Ctrl-C (which ends `tee` too) with a stream in flight and another
client's idle keep-alive connection open drains the stream (whole), does not wait for the idle connection, and leaves
no process behind. Killed with SIGKILL, the serving command leaves no process behind either (its guard's
parent-death signal).

The server gets this test's own Ray temp dir (RAY_TMPDIR), HAProxy files and ports (app/clusters/job_env.haproxy_env)
and HTTP port (a copy of the shipped YAML), so that it never shares a port with the other test clusters of the run."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
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
from tests.cpu.engine_apps import REPO, wait_for
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


def server_env(tiny_model_dir, temp: Path) -> tuple[dict[str, str], Path, int]:
    """A user's environment with this test's own Ray temp dir, HAProxy files and ports, and a copy of the shipped YAML
    on a free HTTP port: (env, the YAML, the port)."""
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
    return env, temp / "tiny-cpu.yaml", port


def processes_of(temp: Path) -> list[psutil.Process]:
    """Every live process on this machine whose environment names the server's own Ray temp dir (RAY_TMPDIR): the
    server's, wherever they were re-parented."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RAY_TMPDIR") == str(temp) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def terminal(argv: list[str], env: dict[str, str], temp: Path, cwd: Path = REPO):
    """`argv` in a terminal; whatever a failed test left running is killed after, and the temp dir removed."""
    term = Terminal(argv, env, cwd)
    try:
        yield term
    finally:
        for proc in [*process_tree(term.pid), *processes_of(temp)]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if term.poll() is None:
            os.kill(term.pid, signal.SIGKILL)
            term.wait(30)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """README command 1 with its output through `tee`, as a user keeping a log runs it: Ctrl-C reaches `tee` too."""
    temp = Path(tempfile.mkdtemp(prefix="summit-sc-", dir="/tmp"))  # short: HAProxy's socket path limit
    env, config, port = server_env(tiny_model_dir, temp)
    command = f"bash scripts/serve.sh {config} | tee {temp / 'serve.log'}"
    with terminal(["bash", "-c", command], env, temp) as term:
        yield term, port, temp


def test_serve_command_says_ready_answers_and_ctrl_c_drains_only_requests_in_flight(served):
    """`bash scripts/serve.sh | tee serve.log`, then Ctrl-C with a stream in flight: the terminal's SIGINT ends `tee`
    as well, and the stream must still end whole (the server's output no longer has a reader: written to a closed
    pipe, `serve run` would die of SIGPIPE mid-drain) and nothing the server started may be left, wherever it was
    re-parented (a process with the server's RAY_TMPDIR in its environment), its port free."""
    term, port, temp = served
    processes: dict[int, psutil.Process] = {}
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
    assert term.wait(120) is not None, term.tail()
    assert "summit: drained; stopping" in term.output, term.tail()
    assert "summit: ready" in (temp / "serve.log").read_text()  # through tee
    idle.close()
    left = [p for p in processes.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    left += [p for p in processes_of(temp) if p.pid not in processes]
    assert not left, f"left running after Ctrl-C: {[(p.pid, p.name()) for p in left]}"
    assert port_free(port), f"port {port} still taken after Ctrl-C"


def test_nothing_outlives_a_killed_serve_command(tiny_model_dir):
    """`summit serve-local` (what README command 1 runs) SIGKILLed while its engine starts (every kind of process it
    starts is running then: Ray's daemons and workers, Serve's HAProxy holding the port, the replica and its vLLM
    EngineCore), as an out-of-memory kill or a `kill -9` would: it gets no chance to stop anything, and the kernel's
    parent-death signal to its guard must, and the guard says so on the terminal. Within 60 s no process with the
    server's RAY_TMPDIR is left and its port is free (a bound, not a timing: 10 s was too short on a fresh-clone run
    at a load average of 40, the dying processes queued for the CPU). Fails without the guard: `serve run` and Ray's
    daemons live on, re-parented, holding the port."""
    temp = Path(tempfile.mkdtemp(prefix="summit-sk-", dir="/tmp"))
    env, config, port = server_env(tiny_model_dir, temp)
    with terminal([sys.executable, "-m", "app.cli", "serve-local", str(config)], env, temp) as term:
        starting = lambda: term.poll() is not None or (titled(processes_of(temp), "EngineCore") and not port_free(port))  # noqa: E731
        assert wait_for(starting, 900, 0.5) and term.poll() is None, term.tail()
        before = processes_of(temp)
        assert titled(before, "ServeReplica") and titled(before, "raylet"), [p.name() for p in before]
        os.kill(term.pid, signal.SIGKILL)
        gone = wait_for(lambda: not processes_of(temp) and port_free(port), 60, 0.2)
        left = [(p.pid, p.name()) for p in processes_of(temp)]
        said = f"port {port} free: {port_free(port)}; the terminal said: {term.tail()}"
        assert gone, f"left 60 s after the serving command was killed: {left}; {said}"
        assert "summit: the serving command died; its guard stops the" in term.output, said


def test_a_taken_port_is_said_at_once_naming_who_holds_it(tiny_model_dir):
    """README command 1 whose HTTP port another process holds: it ends at once, before starting Ray, naming the port,
    the YAML key and the holder's PID (without the check, Serve's HAProxy fails a minute later, and a readiness
    check meanwhile gets its answer from the other server)."""
    temp = Path(tempfile.mkdtemp(prefix="summit-sp-", dir="/tmp"))
    env, config, port = server_env(tiny_model_dir, temp)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        served = subprocess.run(
            [sys.executable, "-m", "app.cli", "serve-local", str(config)],
            env=env,
            cwd=temp,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.close()
        shutil.rmtree(temp, ignore_errors=True)
    assert served.returncode == 1, served.stderr[-2000:]
    said = served.stderr
    assert f"port {port} (http_options.port of {config}) is taken by PID {os.getpid()}" in said, said[-2000:]
    assert "Started a local Ray instance" not in said, said[-2000:]


def test_an_engine_that_cannot_start_ends_the_serve_command_with_its_reason(tiny_model_dir):
    """README command 1 serving a checkpoint whose architecture the installed vLLM does not serve: the command ends by
    itself (exit 1, long before its own 600 s wait) with vLLM's words, the fix, and the kept Ray logs, and leaves no
    process and no port behind (without the failure check it ran on until killed)."""
    temp = Path(tempfile.mkdtemp(prefix="summit-sf-", dir="/tmp"))
    env, config, port = server_env(tiny_model_dir, temp)
    model = temp / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text((model / "config.json").read_text().replace("LlamaForCausalLM", "NoSuchLM"))
    command = [sys.executable, "-m", "app.cli", "serve-local", str(config), "--timeout", "600"]
    with terminal(command, {**env, "SUMMIT_TINY_MODEL": str(model)}, temp, cwd=temp) as term:
        code = term.wait(300)
        assert code == 1, term.tail()
        assert "summit: failed after" in term.output, term.tail()
        assert "Model architectures ['NoSuchLM'] are not supported" in term.output, term.tail()
        assert "fix: the installed vLLM does not serve this model's architecture" in term.output, term.tail()
        assert "its Ray logs (replicas, engines, controller): " + str(temp / "logs") in term.output, term.tail()
        assert wait_for(lambda: not processes_of(temp) and port_free(port), 30, 0.2), [
            (p.pid, p.name()) for p in processes_of(temp)
        ]
