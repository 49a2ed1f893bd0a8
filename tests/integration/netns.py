"""A test host in its own network namespace, joined to this one by a veth pair: a link the test can cut.

Addresses are a private /30 that exists only between the two ends of the pair; nothing else is reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess

HOST_ADDR, PEER_ADDR = "10.213.7.1", "10.213.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


class LinkedNamespace:
    def __init__(self, name: str):
        self.name = name
        self.host_if, self.peer_if = f"{name[:8]}-h", f"{name[:8]}-p"

    def __enter__(self) -> "LinkedNamespace":
        _ip("netns", "add", self.name)
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
        _ip("link", "set", self.peer_if, "netns", self.name)
        _ip("addr", "add", f"{HOST_ADDR}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        _ip("-n", self.name, "addr", "add", f"{PEER_ADDR}/30", "dev", self.peer_if)
        _ip("-n", self.name, "link", "set", self.peer_if, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        return self

    def cut(self) -> None:
        """Drop every packet on the link (no FIN, no RST: only keepalive can tell)."""
        _ip("link", "set", self.host_if, "down")

    def restore(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
