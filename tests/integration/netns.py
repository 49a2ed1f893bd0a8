"""A test host in its own network namespace, joined to this one by a veth pair: a link the test can cut.

Addresses are a private /30 that exists only between the two ends of the pair; nothing else is reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

HOST_ADDR, PEER_ADDR = "10.213.7.1", "10.213.7.2"


def _ip(*args: str, tool: str = "ip") -> None:
    if shutil.which(tool) is None:
        raise RuntimeError(f"`{tool}` is not installed: apt-get install -y iproute2")
    subprocess.run([tool, *args], check=True, capture_output=True)


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def can_make_namespaces() -> bool:
    """Whether this process may create a network namespace (root or CAP_NET_ADMIN + CAP_SYS_ADMIN), asked of the
    kernel itself in a child (unshare(CLONE_NEWNET)); independent of which tools are installed."""
    probe = "import ctypes, os; os._exit(0 if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0 else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode == 0


class VethLink:
    """One veth pair: `host_if` here, `peer_if` in the namespace, a private /30 between host_addr and peer_addr."""

    def __init__(self, ns: str, host_if: str, peer_if: str, host_addr: str, peer_addr: str):
        self.ns, self.host_if, self.peer_if, self.host_addr, self.peer_addr = ns, host_if, peer_if, host_addr, peer_addr

    def create(self) -> None:
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
        _ip("link", "set", self.peer_if, "netns", self.ns)
        _ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.peer_addr}/30", "dev", self.peer_if)
        _ip("-n", self.ns, "link", "set", self.peer_if, "up")

    def cut(self) -> None:
        """Drop every packet on the link (no FIN, no RST: only keepalive or a timeout can tell)."""
        _ip("link", "set", self.host_if, "down")

    def restore(self) -> None:
        """Up again, and the neighbours that failed to resolve while it was down forgotten on both ends: the kernel
        would answer "No route to host" from those cached failures for a while after the link is back."""
        _ip("link", "set", self.host_if, "up")
        _ip("neigh", "flush", "dev", self.host_if)
        _ip("-n", self.ns, "neigh", "flush", "dev", self.peer_if)

    def limit_rate(self, rate: str) -> None:
        """Traffic from the namespace at most `rate` (tc's units, e.g. 16mbit): a transfer that lasts seconds."""
        _ip("-n", self.ns, "qdisc", "add", "dev", self.peer_if, "root", "tbf", "rate", rate, "burst", "64kb",
            "latency", "2s", tool="tc")

    def unlimit(self) -> None:
        _ip("-n", self.ns, "qdisc", "del", "dev", self.peer_if, "root", tool="tc")

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)


class LinkedNamespace:
    def __init__(self, name: str, host_addr: str = HOST_ADDR, peer_addr: str = PEER_ADDR):
        self.name = name
        self.host_if, self.peer_if = f"{name[:8]}-h", f"{name[:8]}-p"
        self.link = VethLink(name, self.host_if, self.peer_if, host_addr, peer_addr)
        self.extra: list[VethLink] = []

    def __enter__(self) -> "LinkedNamespace":
        _ip("netns", "add", self.name)
        try:
            self.link.create()
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def add_link(self, tag: str, host_addr: str, peer_addr: str) -> VethLink:
        """A second pair into the same namespace (its own /30): traffic to host_addr takes it, so cutting it cuts
        only that traffic."""
        link = VethLink(self.name, f"{self.name[:8]}-{tag}h", f"{self.name[:8]}-{tag}p", host_addr, peer_addr)
        self.extra.append(link)
        link.create()
        return link

    def cut(self) -> None:
        self.link.cut()

    def restore(self) -> None:
        self.link.restore()

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def __exit__(self, *exc) -> None:
        for link in [*self.extra, self.link]:
            link.delete()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
