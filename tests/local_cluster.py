"""A private Ray cluster on loopback: own temp dir, own ports, stopped by PID. For tests and benchmarks.

Never touches another Ray cluster on the machine (no `ray stop`, no default `/tmp/ray`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from app.clusters.job_env import LOOPBACK, free_port, haproxy_env

SHM = "/dev/shm"
# Ray's worker prestart, which the direct-path environment turns off for a serving node (app/build/options.py): the
# test clusters keep Ray's default, a pool of workers started ahead for the many actors a test creates and replaces on
# a loaded 2-core box. A caller's env may turn it off again (bench/serve_overhead.py measures Summit as shipped).
RAY_WORKER_PRESTART = {"RAY_enable_worker_prestart": "1", "RAY_prestart_worker_first_driver": "1"}


def loopback_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for Ray processes and clients: auth off on loopback, and Ray kept on 127.0.0.1."""
    env = dict(os.environ)
    env.update(
        {
            "RAY_AUTH_MODE": "disabled",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # Ray waits 30 s for its GCS to write its port; a loaded 2-core CI box took longer once
            "RAY_gcs_server_port_wait_time_s": os.environ.get("RAY_gcs_server_port_wait_time_s", "120"),
            # a raylet exits when its GCS has not answered for this long (Ray's default: 60 s); a CI run's head node
            # died a minute after its start on a loaded box
            "RAY_gcs_rpc_server_reconnect_timeout_s": os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", "300"),
        }
    )
    env.update(extra or {})
    return env


class ClusterDied(RuntimeError):
    """The head node's `ray start --block` exited (its raylet, GCS or an agent died)."""


class DeployFailed(RuntimeError):
    """Serve reported DEPLOY_FAILED for an application; the message is Serve's (with the replica's error)."""


@dataclass
class LocalCluster:
    """`ray start --head --block` on loopback with its own temp dir and ports."""

    num_cpus: float = 4
    env: dict[str, str] = field(default_factory=dict)
    node_ip: str = LOOPBACK
    num_gpus: int | None = None
    haproxy: bool = False  # Serve's HAProxy instead of its Python proxy (RAY_SERVE_ENABLE_HA_PROXY, read at ray start)
    # Ray's metrics reach each node's endpoint every 2 s instead of Ray's 10 s, for tests that read them. Only those
    # ask: every Ray process exports on that period, and an idle cluster of two tiny replicas used 13.6 CPU-s a minute
    # at 2 s, 8.3 at 10 s (tests/README.md).
    fast_metrics: bool = False
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="summit-ray-", dir="/tmp")))
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)  # the head node's Prometheus endpoint (Ray's metrics agent)
    proc: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    _shm_before: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.haproxy:  # fixed here: every process of the cluster must see the same HAProxy files and ports
            self.env = {**haproxy_env(self.temp_dir / "h"), **RAY_WORKER_PRESTART, **self.env}

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.node_ip}:{self.dashboard_port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.node_ip}:{self.http_port}"

    def start(self, timeout_s: float = 300, attempts: int = 6) -> LocalCluster:
        """Start the head node; a head that dies while it starts (a loaded 2-core box: its raylet gave up on its GCS
        or agent once; a box at half speed saw the head exit 3 times in a row, its log not kept)
        is started again, on fresh ports, up to `attempts` times."""
        for attempt in range(attempts):
            try:
                self._launch(timeout_s)
                return self
            except ClusterDied:
                if attempt == attempts - 1:
                    raise
                self._relaunch_ports()

    def _relaunch_ports(self) -> None:
        """Kill what the dead start left and take fresh ports (the HTTP port stays: configs carry it)."""
        self._kill_all()
        self.gcs_port, self.dashboard_port, self.metrics_port = free_port(), free_port(), free_port()

    def _launch(self, timeout_s: float) -> None:
        log = open(self.temp_dir / "ray-start.log", "ab")
        if not self._shm_before:
            self._shm_before = _shared_memory()
        ports = {
            "--port": self.gcs_port,
            "--dashboard-port": self.dashboard_port,
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
            "--ray-client-server-port": free_port(),
            "--metrics-export-port": self.metrics_port,
            "--dashboard-agent-listen-port": free_port(),
            "--runtime-env-agent-port": free_port(),
        }
        cmd = [
            "ray",
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            self.node_ip,
            "--dashboard-host",
            self.node_ip,
            "--temp-dir",
            str(self.temp_dir),
            "--num-cpus",
            str(self.num_cpus),
            "--disable-usage-stats",
        ]
        for flag, port in ports.items():
            cmd += [flag, str(port)]
        if self.num_gpus is not None:
            cmd += ["--num-gpus", str(self.num_gpus)]
        self.proc = subprocess.Popen(cmd, env=self._env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # ready: the dashboard answers and the head node is alive in the state API (its raylet registered)
        self._wait(
            lambda: _http_ok(self.dashboard_url + "/api/version") and bool(self.alive_nodes()),
            timeout_s,
            "Ray head node",
        )

    def add_worker(
        self,
        node_ip: str,
        num_cpus: float,
        num_gpus: int = 0,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        timeout_s: float = 120,
    ) -> None:
        """Join a worker node (e.g. inside a network namespace: `prefix=NetnsHost.exec_prefix`)."""
        log = open(self.temp_dir / f"ray-worker-{len(self.workers)}.log", "wb")
        cmd = [
            *(prefix or []),
            "ray",
            "start",
            "--block",
            "--address",
            self.address,
            "--node-ip-address",
            node_ip,
            "--num-cpus",
            str(num_cpus),
            "--num-gpus",
            str(num_gpus),
            "--disable-usage-stats",
        ]
        # Ray gives a starting node 30 s to register with the GCS (fixed in ray/_private/node.py); on a loaded box
        # `ray start` can miss that and exit: it is started again (4 times at most; CI missed it 3 times in a row
        # once), as summit.sbatch does.
        tries = 5
        for attempt in range(tries):
            worker = subprocess.Popen(
                cmd, env=self._env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.workers.append(worker)

            def joined(worker: subprocess.Popen = worker) -> bool:
                if worker.poll() is not None:
                    said = Path(log.name).read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"worker `ray start` exited with {worker.returncode}; {log.name} ends:\n{said}")
                return any(n["node_ip"] == node_ip for n in self.alive_nodes())

            try:
                self._wait(joined, timeout_s, "Ray worker node")
                return
            except RuntimeError:
                if attempt == tries - 1 or worker.poll() is None:
                    raise
                log.write(b"\n--- ray start exited before the node joined; starting it again ---\n")
                log.flush()

    def alive_nodes(self) -> list[dict]:
        """The state API's nodes that are alive (node_id, node_ip, resources_total, ...), read over REST."""
        try:
            nodes = self.dashboard_get("/api/v0/nodes?limit=1000&detail=1")["data"]["result"]["result"]
        except Exception:
            return []
        return [n for n in nodes if n["state"] == "ALIVE"]

    def alive_actors(self) -> list[dict]:
        """The state API's alive actors with details (class_name, node_id, placement_group_id, ...)."""
        actors = self.dashboard_get("/api/v0/actors?limit=10000&detail=1")["data"]["result"]["result"]
        return [a for a in actors if a["state"] == "ALIVE"]

    def placement_groups(self) -> list[dict]:
        """The state API's placement groups with their bundles (unit_resources, node_id)."""
        return self.dashboard_get("/api/v0/placement_groups?limit=10000&detail=1")["data"]["result"]["result"]

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # vLLM's IPC sockets go to the cluster's temp dir (removed by stop()), not /tmp where killed engines leave them.
        # The Batch API's database and files too (serve_configs/tiny-cpu.yaml reads SUMMIT_BATCH_DIR).
        env = loopback_env(
            {
                "VLLM_RPC_BASE_PATH": str(self.temp_dir),
                "SUMMIT_BATCH_DIR": str(self.temp_dir / "batch"),
                **({"RAY_metrics_report_interval_ms": "2000"} if self.fast_metrics else {}),
                **self.env,
                **(extra or {}),
            }
        )
        if self.node_ip != LOOPBACK:
            # Ray refuses to add nodes when this is 0 (which keeps a one-node cluster on 127.0.0.1).
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        return env

    def serve_deploy(
        self, config: dict, timeout_s: float = 600, ready_path: str = "/v1/models", while_waiting=None
    ) -> None:
        """`serve deploy` a Serve config dict (its http_options are pointed at this cluster's port);
        `while_waiting()` is called about once a second until the app is ready."""
        config = dict(config)
        config["http_options"] = {**config.get("http_options", {}), "host": self.node_ip, "port": self.http_port}
        path = self.temp_dir / "serve-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        names = {a.get("name", "default") for a in config.get("applications", [])}
        before = {name: a.get("last_deployed_time_s") for name, a in self.serve_applications().items() if name in names}
        for attempt in range(6):  # the dashboard answers /api/version before its Serve endpoint is ready
            if self.proc is not None and self.proc.poll() is not None and not before and not self.workers:
                # the head died before anything was deployed on it: start it again (once per attempt)
                self._relaunch_ports()
                self.start()
            deploy = subprocess.run(
                ["serve", "deploy", str(path), "-a", self.dashboard_url],
                env=self._env(),
                capture_output=True,
                text=True,
            )
            if deploy.returncode == 0:
                break
            time.sleep(5)
        else:
            raise RuntimeError(
                f"serve deploy failed: {deploy.stderr[-2000:] or deploy.stdout[-2000:]}\n{self._dashboard_story()}"
            )

        # A redeploy keeps answering from the old replicas: wait until Serve has taken this deploy and reports
        # every app RUNNING (or one DEPLOY_FAILED, raised), and the HTTP path answers.
        def ready() -> bool:
            if while_waiting is not None:
                while_waiting()
            return self._apps_running(before) and _http_ok(self.base_url + ready_path)

        self._wait(ready, timeout_s, "Serve application")

    def _dashboard_story(self) -> str:
        """Whether the dashboard still answers, and the end of its logs (a CI run's dashboard stopped answering
        between the cluster's start and the deploy)."""
        logs = self.temp_dir / "session_latest" / "logs"
        tails = [
            f"--- {f.name}:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
            for f in sorted(logs.glob("dashboard*"))
            if f.is_file() and f.stat().st_size
        ]
        answers = _http_ok(self.dashboard_url + "/api/version")
        return f"dashboard {self.dashboard_url} answers: {answers}; ray start exited: {self.proc.poll()}\n" + "\n".join(
            tails
        )

    def serve_applications(self) -> dict:
        """Serve's view of the applications ({} while the dashboard cannot say)."""
        try:
            return self.dashboard_get("/api/serve/applications/").get("applications", {})
        except Exception:
            return {}

    def dashboard_get(self, path: str) -> dict:
        """GET a dashboard REST path (Serve, or the state API `/api/v0/...`): no Ray driver needed. A read that times
        out is asked again, twice (a CI run's dashboard took over 30 s to answer while an engine started beside a
        second cluster); an HTTP error answer is raised at once."""
        import json
        import urllib.error
        import urllib.request

        def read() -> dict:
            with urllib.request.urlopen(self.dashboard_url + path, timeout=60) as r:
                return json.load(r)

        for _ in range(2):
            try:
                return read()
            except (TimeoutError, urllib.error.URLError) as e:  # an HTTPError's reason is its message: raised
                if not isinstance(e, TimeoutError) and not isinstance(e.reason, TimeoutError):
                    raise
        return read()

    def _apps_running(self, before: dict | None = None) -> bool:
        apps = self.serve_applications()
        if any(a.get("last_deployed_time_s") == t for name, t in (before or {}).items() if (a := apps.get(name))):
            return False  # still the previous deploy's state
        failed = {name: a.get("message", "") for name, a in apps.items() if a.get("status") == "DEPLOY_FAILED"}
        if failed:
            raise DeployFailed(
                "; ".join(f"application {name!r} failed to deploy: {msg}" for name, msg in failed.items())
            )
        return bool(apps) and all(a.get("status") == "RUNNING" for a in apps.values())

    def serve_shutdown(self, timeout_s: float = 300) -> None:
        """`serve shutdown`, then wait until Serve's controller has exited: the command gives up waiting after 30 s
        (replicas draining), and a `serve deploy` sent to a controller that is still going down is lost. On a box
        loaded by 4 test workers and 2 busy loops the command itself took over 120 s once: its exit is not waited
        for beyond `timeout_s`, the controller's is. This cluster's replica_probe driver is ended first: its Serve
        handles point at the application going away, and after the next deploy a call through them waited until it
        timed out ("Timed out resolving to ObjectRef", two 3-worker runs) instead of finding the new replicas."""
        from tests.replica_probe import stop_probes

        stop_probes(self.address)
        try:
            subprocess.run(
                ["serve", "shutdown", "-a", self.dashboard_url, "-y"],
                env=self._env(),
                capture_output=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            pass
        self._wait(
            lambda: not any(a.get("class_name") == "ServeController" for a in self.alive_actors()),
            timeout_s,
            "Serve controller exit",
        )

    def stop(self) -> None:
        """Kill every process this cluster started (by PID, SIGKILL: a test cluster's state is thrown away, and
        `serve shutdown` + SIGTERM took ≈ 50 s of each module's teardown), free the shared memory its engines left,
        then remove its temp dir."""
        from tests.replica_probe import stop_probes  # its driver of this cluster

        stop_probes(self.address)
        self._kill_all()
        _free_shared_memory(self._shm_before)
        if keep := os.environ.get("SUMMIT_KEEP_LOGS"):  # a failure's story: the cluster's logs, kept under that folder
            logs = self.temp_dir / "session_latest" / "logs"
            if logs.is_dir():
                shutil.copytree(logs, Path(keep) / self.temp_dir.name, dirs_exist_ok=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _kill_all(self) -> None:
        """SIGKILL the head's and workers' `ray start` and every descendant (Ray's daemons and workers run in
        sessions of their own: collect them all first, then kill)."""
        roots = [r for r in [*self.workers, self.proc] if r is not None]
        procs = []
        for root in roots:
            try:
                procs += [psutil.Process(root.pid)] + psutil.Process(root.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        # a head whose `ray start` exited leaves nothing to walk down from (its agents outlive it): every process
        # of this cluster carries its temp dir in VLLM_RPC_BASE_PATH (see _env)
        procs += [p for p in psutil.process_iter() if _environ(p).get("VLLM_RPC_BASE_PATH") == str(self.temp_dir)]
        procs = [p for p in procs if p.pid != os.getpid()]
        for p in procs:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(procs, timeout=20)
        for root in roots:
            root.poll()  # reap: no zombie `ray start`

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                log = self.temp_dir / "ray-start.log"  # the temp dir goes with the cluster: say how it ended
                said = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
                raise ClusterDied(f"ray start exited with {self.proc.returncode}; {log} ends:\n{said}")
            if ready():
                return
            time.sleep(1)
        raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s (logs under {self.temp_dir}/session_latest/logs)")


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}


def _shared_memory() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def _free_shared_memory(before: set[str]) -> None:
    """Remove the /dev/shm segments that appeared since `before` and that no process maps or holds open any more
    (vLLM's message queues and CPU TP/PP buffers outlive an engine killed with SIGKILL; another cluster's live ones
    stay)."""
    new = sorted(_shared_memory() - before)
    if not new or shutil.which("fuser") is None:
        return
    for name in new:
        path = os.path.join(SHM, name)
        # `fuser -s` exits 0 while some process has the file open or mapped
        if subprocess.run(["fuser", "-s", path], stderr=subprocess.DEVNULL).returncode != 0:
            try:
                os.unlink(path)
            except OSError:
                pass


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except Exception:
        return False


def load_serve_config(path: str | Path) -> dict:
    return yaml.safe_load(Path(path).read_text())
