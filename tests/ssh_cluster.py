"""Two SSH hosts on this machine, for the Ray cluster launcher's local provider (`ray up cluster_yaml/onprem.yaml`).

Each host is a network + PID namespace (10.253.0.1 = head, 10.253.0.2 = worker, joined by one veth pair:
tests/netns_hosts.py) running Debian's sshd with a config of its own (host key, address, the test's key only). The
sessions run as root — the machine's Python lives under /root, out of another user's reach — with a home of their
own: in each host's mount namespace the test's home directory is bind-mounted over /root (the Python installation
under /root bind-mounted back into it), so that ssh's own `~` (the passwd home: Ray's autoscaler passes
`-i ~/ray_bootstrap_key.pem`) and $HOME agree, and both hosts share that one home, as on a cluster.
The hosts share one filesystem, and two Ray nodes must not share a temp dir (socket paths), so each sshd
also gives its sessions their own `RAY_TMPDIR`, as separate machines would have separate /tmp. `ray up`, `ray down`
and clients run in the head's network namespace with that home (`on_head`): the head is the login node here.
Every process of the cluster carries the test's `RAY_TMPDIR` (`cluster_processes`); `stop()` stops the sshds by PID,
then anything of the cluster left, and removes the namespaces.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.netns_hosts import Node, link_pair, unlink_pair

SUBNET = "10.253.0"
TOOLS = ("/usr/sbin/sshd", "ssh", "ssh-keygen", "rsync")


@dataclass
class SshCluster:
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lc-", dir="/tmp")))
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = [
            Node(name, f"{SUBNET}.{i}", f"summit-lc{i}-{self.tag}", f"lc{i}{self.tag}"[:15])
            for i, name in ((1, "head"), (2, "worker"))
        ]
        self.user = "root"
        self.home = self.root / "home"
        self.key = self.home / ".ssh" / "summit_cluster"

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def tmpdir(self, node: Node) -> Path:
        return self.root / f"tmp-{node.name}"

    def start(self, timeout_s: float = 30) -> SshCluster:
        self.root.chmod(0o755)
        (self.home / ".ssh").mkdir(mode=0o700, parents=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / "host_key")], check=True)
        shutil.copy(f"{self.key}.pub", self.home / ".ssh" / "authorized_keys")
        for node in self.nodes:
            self.tmpdir(node).mkdir()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        link_pair(self.nodes, default_route=True)  # Ray takes its node IP from the default route
        for node in self.nodes:
            conf = self.root / f"sshd-{node.name}.conf"
            conf.write_text(f"""\
ListenAddress {node.ip}
Port 22
HostKey {self.root}/host_key
PidFile {self.root}/sshd-{node.name}.pid
AuthorizedKeysFile {self.home}/.ssh/authorized_keys
AllowUsers root
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv RAY_TMPDIR={self.tmpdir(node)}
""")
            log = open(self.root / f"sshd-{node.name}.log", "ab")
            # this host's /root is the cluster's home; what of the machine's Python lives under /root stays visible
            binds = "".join(
                f"mount --bind {shlex.quote(kept)} {shlex.quote(str(self.home / rel))}; "
                for kept, rel in self._kept_under_root()
            )
            script = (
                f"set -e; {binds}mount --rbind {shlex.quote(str(self.home))} /root; exec /usr/sbin/sshd -D -e -f {conf}"
            )
            self.procs.append(
                subprocess.Popen(
                    [*node.prefix, "sh", "-c", script], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout_s
        while not all(self._listening(n) for n in self.nodes):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                logs = {p.name: p.read_text()[-1000:] for p in self.root.glob("sshd-*.log")}
                raise RuntimeError(f"sshd not listening on both hosts after {timeout_s} s: {logs}")
            time.sleep(0.3)
        return self

    def _kept_under_root(self) -> list[tuple[str, str]]:
        """(path, path relative to /root) of the top directory under /root holding this Python, if any."""
        parts = Path(sys.base_prefix).resolve().parts
        if parts[:2] != ("/", "root") or len(parts) < 3:
            return []
        top = Path("/root", parts[2])
        (self.home / parts[2]).mkdir(exist_ok=True)
        return [(str(top), parts[2])]

    def _listening(self, node: Node) -> bool:
        probe = f"import socket; socket.create_connection(('{node.ip}', 22), timeout=1).close()"
        return subprocess.run([*node.net_prefix, "python3", "-c", probe], capture_output=True).returncode == 0

    def on_head(
        self, *cmd: str, env: dict[str, str] | None = None, timeout: float = 600, log: Path | None = None
    ) -> subprocess.CompletedProcess:
        """A command on the head's network (the login node) with the cluster's home and a login-like environment."""
        base = {
            "HOME": str(self.home),
            "USER": self.user,
            "LOGNAME": self.user,
            "SHELL": "/bin/bash",
            "PATH": os.environ["PATH"],
            "LANG": "C.UTF-8",
            "RAY_TMPDIR": str(self.root / "tmp-launcher"),
        }
        Path(base["RAY_TMPDIR"]).mkdir(exist_ok=True)
        run = [*self.head.net_prefix, "env", "-i", *(f"{k}={v}" for k, v in {**base, **(env or {})}.items()), *cmd]
        if log is None:
            return subprocess.run(run, capture_output=True, text=True, timeout=timeout, cwd=self.home)
        with open(log, "w") as out:
            rc = subprocess.run(run, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=self.home).returncode
        return subprocess.CompletedProcess(run, rc, log.read_text(errors="replace"), "")

    def cluster_processes(self) -> list[int]:
        """Processes started for the cluster: sessions of its sshds and what they started (Ray's daemons, workers,
        engines) carry its RAY_TMPDIR; the sshds themselves do not."""
        mark = f"RAY_TMPDIR={self.root}/".encode()
        found = []
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and int(pid) != os.getpid() and mark in Path(f"/proc/{pid}/environ").read_bytes():
                    found.append(int(pid))
            except OSError:
                continue
        return found

    def stop(self, keep_logs: Path | None = None) -> None:
        """Stop the hosts; with `keep_logs`, first copy there what the cluster wrote (sshd logs, its Ray logs)."""
        if keep_logs is not None:
            sessions = [p for p in self.root.glob("tmp-*/ray/session_*/logs") if not p.parent.is_symlink()]
            for log in [*self.root.glob("sshd-*.log"), *sessions]:
                to = keep_logs / log.relative_to(self.root)
                try:
                    if log.is_dir():
                        shutil.copytree(log, to, dirs_exist_ok=True, ignore_dangling_symlinks=True)
                    else:
                        to.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy(log, to)
                except OSError:
                    continue
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in self.cluster_processes():  # a Ray left by a failed `ray down`: only this cluster's
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        unlink_pair(self.nodes)
        shutil.rmtree(self.root, ignore_errors=True)
