"""Hosts of their own on one machine: network namespaces joined by a veth pair (root only).

Each host has its own IP on ``eth0`` and its own loopback, so processes in it talk to the
other host over a link that can be cut without a TCP reset (``ip link set eth0 down``), which
is what a powered-off or partitioned node looks like to its peers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    name: str
    """The network namespace."""
    addr: str

    @property
    def prefix(self) -> list[str]:
        """Run a command in this host's network."""
        return ["nsenter", f"--net=/run/netns/{self.name}"]

    def link(self, state: str) -> None:
        subprocess.run(["ip", "-n", self.name, "link", "set", "eth0", state], check=True)


def can_make_hosts() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"ftm-probe-{os.getpid()}"  # a container's root often lacks CAP_SYS_ADMIN
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def make_two_hosts(tag: str) -> tuple[Host, Host]:
    a, b = Host(f"ftm-{tag}-a", "10.231.0.1"), Host(f"ftm-{tag}-b", "10.231.0.2")
    run = lambda *argv: subprocess.run(["ip", *argv], check=True, capture_output=True)  # noqa: E731
    run("netns", "add", a.name)
    run("netns", "add", b.name)
    run("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
    for host, end in ((a, f"v{tag}a"), (b, f"v{tag}b")):
        run("link", "set", end, "netns", host.name)
        run("-n", host.name, "link", "set", end, "name", "eth0")
        run("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        run("-n", host.name, "link", "set", "eth0", "up")
        run("-n", host.name, "link", "set", "lo", "up")
    return a, b


def remove_hosts(*hosts: Host) -> None:
    for host in hosts:
        subprocess.run(["ip", "netns", "del", host.name], check=False, capture_output=True)
