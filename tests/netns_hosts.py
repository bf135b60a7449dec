"""A second "host" on this machine: network and PID namespaces, joined to the root network by a veth pair.

Two Ray nodes that share an address do not look like two nodes to vLLM's Ray executor (it groups workers
by node IP), so multi-node tests run the worker node in a namespace with an address of its own. Only the
project's own test addresses (10.251.x.0/24) are used; nothing is routed anywhere else.

Built with pyroute2 (netlink from Python, a test dependency) and util-linux's `nsenter`/`unshare`, not iproute2:
the GPU host has no `ip` command, and the same code must run there.

pyroute2 forks (a named namespace is made, and entered, by a child process). A fork of the test process, which may
hold a Ray driver's gRPC threads, can deadlock in the child (one CI run hung there for 15 min): every pyroute2 call
runs in a fresh Python process (`python -m tests.netns_hosts OP ARGS`), single-threaded when it forks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

NETNS_DIR = "/run/netns"  # where pyroute2 (like `ip netns`) bind-mounts a named namespace
REPO = Path(__file__).resolve().parents[1]


def _fresh(op: str, *args) -> None:
    """`op` of `_OPS` with `args` (JSON), in a new Python process; RuntimeError with its stderr if it fails."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.netns_hosts", op, json.dumps(args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if run.returncode != 0:
        raise RuntimeError(f"netns {op} failed: {run.stderr[-3000:]}")


def netns_available() -> bool:
    return netns_problem() is None


def netns_problem() -> str | None:
    """None when a second host can be made here (root, pyroute2, nsenter and unshare, and a namespace really made);
    else what is missing, with the probe's error."""
    if problem := hosts_problem():
        return problem
    try:
        _fresh("probe", f"summit-probe-{os.getpid()}")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return f"a network namespace could not be made here: {e}"
    return None


def _probe(name: str) -> None:
    from pyroute2 import netns

    netns.create(name)
    netns.remove(name)


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
        return ["nsenter", f"--net={NETNS_DIR}/{self.name}", "unshare", "--pid", "--fork", "--mount-proc"]

    def up(self) -> NetnsHost:
        _fresh("host_up", self.subnet, self.name)
        return self

    def down(self) -> None:
        _fresh("host_down", self.subnet, self.name)

    def _up(self) -> None:
        from pyroute2 import IPRoute, NetNS, netns

        self._down()  # a run killed before down() leaves its veth pair (same names): `link add` would fail
        netns.create(self.name)
        with IPRoute() as ip:
            ip.link("add", ifname=self.root_if, kind="veth", peer=self.host_if)
            ip.link("set", index=ip.link_lookup(ifname=self.host_if)[0], net_ns_fd=self.name)
            root = ip.link_lookup(ifname=self.root_if)[0]
            ip.addr("add", index=root, address=self.root_ip, prefixlen=24)
            ip.link("set", index=root, state="up")
        with NetNS(self.name) as ns:
            host = ns.link_lookup(ifname=self.host_if)[0]
            ns.addr("add", index=host, address=self.host_ip, prefixlen=24)
            ns.link("set", index=host, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")

    def _down(self) -> None:
        from pyroute2 import IPRoute, netns

        with IPRoute() as ip:
            for index in ip.link_lookup(ifname=self.root_if):
                ip.link("del", index=index)  # removes its peer in the namespace too
        if self.name in netns.listnetns():
            netns.remove(self.name)


@dataclass
class Node:
    """One of two hosts joined directly by one veth pair (`link_pair`): its name, address, namespace and veth end."""

    name: str
    ip: str
    netns: str
    veth: str

    @property
    def prefix(self) -> list[str]:
        """Run a command on this node: its network namespace and a PID namespace of its own (Ray finds its raylet
        by process name; it must not see another node's)."""
        return ["nsenter", f"--net={NETNS_DIR}/{self.netns}", "unshare", "--pid", "--fork", "--mount-proc"]

    @property
    def net_prefix(self) -> list[str]:
        return ["nsenter", f"--net={NETNS_DIR}/{self.netns}"]


def link_pair(nodes: list[Node], default_route: bool = False) -> None:
    """Two network namespaces joined by one veth pair, each with its address and loopback up. `default_route`: each
    host's default route goes out its veth (to the other host, which drops it: nothing leaves the pair), so that
    software that finds "its" address from the default route (Ray's node IP) finds the pair's, as on a real host."""
    _fresh("link_pair", [dataclasses.asdict(n) for n in nodes], default_route)


def unlink_pair(nodes: list[Node]) -> None:
    _fresh("unlink_pair", [dataclasses.asdict(n) for n in nodes])


def _link_pair(nodes: list[Node], default_route: bool) -> None:
    from pyroute2 import IPRoute, NetNS, netns

    _unlink_pair(nodes)
    for node in nodes:
        netns.create(node.netns)
    a, b = nodes
    with IPRoute() as ip:
        ip.link("add", ifname=a.veth, kind="veth", peer=b.veth)
        ip.link("set", index=ip.link_lookup(ifname=a.veth)[0], net_ns_fd=a.netns)
        ip.link("set", index=ip.link_lookup(ifname=b.veth)[0], net_ns_fd=b.netns)
    for node in nodes:
        with NetNS(node.netns) as ns:
            index = ns.link_lookup(ifname=node.veth)[0]
            ns.addr("add", index=index, address=node.ip, prefixlen=24)
            ns.link("set", index=index, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
            if default_route:
                ns.route("add", dst="0.0.0.0/0", oif=index)


def _unlink_pair(nodes: list[Node]) -> None:
    from pyroute2 import netns

    for node in nodes:
        if node.netns in netns.listnetns():
            netns.remove(node.netns)  # removes the veth end inside it, and so the pair


def hosts_problem(*tools: str) -> str | None:
    """None when two linked hosts with daemons can be made here (root, these programs, util-linux's namespace tools
    and pyroute2); else what is missing and how the test command (scripts/test_packages.sh, as root) provides it."""
    if os.geteuid() != 0:
        return "needs root (network namespaces): run the tests as root"
    missing = [tool for tool in (*tools, "nsenter", "unshare") if not shutil.which(tool)]
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        missing.append("pyroute2 (Python)")
    if missing:
        return f"missing {', '.join(missing)}: scripts/test_packages.sh (run by scripts/test.sh) installs them as root"
    return None


# The official client against a host's endpoint, run on that host's network: the models it lists and 8 tokens.
OPENAI_CHECK = """
import json, os, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=os.environ.get("OPENAI_API_KEY") or "unused", max_retries=0,
                       timeout=120)
models = [m.id for m in client.models.list().data]
r = client.completions.create(model=models[0], prompt="Over the ridge", max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
print(json.dumps({"models": models, "tokens": r.usage.completion_tokens}))
"""


_OPS = {
    "probe": _probe,
    "host_up": lambda subnet, name: NetnsHost(subnet, name)._up(),
    "host_down": lambda subnet, name: NetnsHost(subnet, name)._down(),
    "link_pair": lambda nodes, default_route: _link_pair([Node(**n) for n in nodes], default_route),
    "unlink_pair": lambda nodes: _unlink_pair([Node(**n) for n in nodes]),
}

if __name__ == "__main__":
    _OPS[sys.argv[1]](*json.loads(sys.argv[2]))
