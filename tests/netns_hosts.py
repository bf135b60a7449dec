"""A second "host" on this machine: network and PID namespaces, joined to the root network by a veth pair.

Two Ray nodes that share an address do not look like two nodes to vLLM's Ray executor (it groups workers
by node IP), so multi-node tests run the worker node in a namespace with an address of its own. Only the
project's own test addresses (10.251.x.0/24) are used; nothing is routed anywhere else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def netns_available() -> bool:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    probe = f"summit-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


@dataclass
class NetnsHost:
    subnet: int = 251
    name: str = field(default_factory=lambda: f"summit-w{os.getpid() % 100000}")

    @property
    def root_ip(self) -> str:
        return f"10.{self.subnet}.0.1"

    @property
    def host_ip(self) -> str:
        return f"10.{self.subnet}.0.2"

    @property
    def root_if(self) -> str:
        return f"sv{self.subnet}a"

    @property
    def host_if(self) -> str:
        return f"sv{self.subnet}b"

    @property
    def exec_prefix(self) -> list[str]:
        """Run a command on this host: its own network namespace, and its own PID namespace, so that a Ray
        driver started there (vLLM's engine core calls `ray.init()`) finds only this host's raylet in `ps` and
        joins this node; seeing the head's raylet too, Ray would attach it to the head node."""
        return ["ip", "netns", "exec", self.name, "unshare", "--pid", "--fork", "--mount-proc"]

    def up(self) -> NetnsHost:
        ns, a, b = self.name, self.root_if, self.host_if
        # A run killed before down() leaves its veth pair (same names): remove it, or `ip link add` fails.
        subprocess.run(["ip", "link", "del", a], capture_output=True)
        for cmd in (
            f"ip netns add {ns}",
            f"ip link add {a} type veth peer name {b}",
            f"ip link set {b} netns {ns}",
            f"ip addr add {self.root_ip}/24 dev {a}",
            f"ip link set {a} up",
            f"ip -n {ns} addr add {self.host_ip}/24 dev {b}",
            f"ip -n {ns} link set {b} up",
            f"ip -n {ns} link set lo up",
        ):
            subprocess.run(cmd.split(), check=True, capture_output=True)
        return self

    def down(self) -> None:
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
