"""A real SLURM cluster of two nodes on this machine, for tests: Debian's munged, slurmctld and two slurmd.

Each node is a host of its own: network and PID namespaces joined by one veth pair (10.252.0.1 = n1, which also
runs slurmctld; 10.252.0.2 = n2). Nothing listens in the machine's own network namespace: slurmctld and slurmd bind
every address of the namespace they run in, which holds only loopback and the pair. Commands for the cluster
(`sbatch`, `squeue`, `scancel`, a client of the job's endpoint) run in n1's namespace (`on_head`). Everything lives
under one short temp dir; `stop()` cancels the jobs and stops the daemons by their PIDs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.netns_hosts import Node, link_pair, unlink_pair

SUBNET = "10.252.0"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")


@dataclass
class SlurmCluster:
    cpus_per_node: int = 2
    memory_mb: int = 8000
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sl-", dir="/tmp")))
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = [
            Node(f"n{i}", f"{SUBNET}.{i}", f"summit-sl{i}-{self.tag}", f"sl{i}{self.tag}"[:15]) for i in (1, 2)
        ]

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- namespaces ---------------------------------------------------------------------------------------------
    def _net_up(self) -> None:
        link_pair(self.nodes)

    def _net_down(self) -> None:
        unlink_pair(self.nodes)

    # -- daemons ------------------------------------------------------------------------------------------------
    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen:
        out = open(self.root / "log" / log, "ab")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _write_conf(self) -> None:
        r = self.root
        nodes = "\n".join(
            f"NodeName={n.name} NodeAddr={n.ip} CPUs={self.cpus_per_node} RealMemory={self.memory_mb} State=UNKNOWN"
            for n in self.nodes
        )
        self.conf.write_text(f"""\
ClusterName=summitci
SlurmctldHost={socket.gethostname()}({self.head.ip})
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={r}/run/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
KillWait=10
{nodes}
PartitionName=ci Nodes={",".join(n.name for n in self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout_s: float = 60) -> SlurmCluster:
        for sub in ("state", "log", "munge", "run", *(f"spool/{n.name}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)  # the key; the socket's directory must be searchable by all
        self.root.chmod(0o755)
        (self.root / "run").chmod(0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._write_conf()
        self._net_up()
        m, run = self.root / "munge", self.root / "run"
        self._spawn(
            [
                "munged",
                "-F",
                f"--key-file={key}",
                f"--socket={run}/munge.socket",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/seed",
            ],
            "munged.out",
        )
        self._wait(lambda: (run / "munge.socket").exists(), 10, "munged's socket")
        self._spawn([*self.head.prefix, "slurmctld", "-D", "-f", str(self.conf)], "slurmctld.out")
        for node in self.nodes:
            self._spawn(
                [*node.prefix, "slurmd", "-D", "-f", str(self.conf), "-N", node.name], f"slurmd-{node.name}.out"
            )
        self._wait(lambda: self.idle_nodes() == len(self.nodes), timeout_s, "both nodes idle in sinfo")
        return self

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in (self.root / "log").glob("*") if p.is_file()}
        raise RuntimeError(f"SLURM test cluster: no {what} after {timeout_s} s; logs: {logs}")

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM client command (or any command) in the head node's network namespace."""
        return subprocess.run(
            [*self.head.net_prefix, *cmd], capture_output=True, text=True, env=self.env, check=check, timeout=timeout
        )

    def idle_nodes(self) -> int:
        try:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10).stdout
        except subprocess.TimeoutExpired:
            return 0
        return sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"])

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i %T %N", check=False).stdout.splitlines()

    def stop(self) -> None:
        try:
            if self.conf.exists():
                self.run("scancel", "--full", "--partition=ci", check=False, timeout=20)
        except Exception:  # noqa: BLE001 — stopping anyway
            pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self._net_down()
        shutil.rmtree(self.root, ignore_errors=True)
