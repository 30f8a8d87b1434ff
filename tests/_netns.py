"""Two "hosts" on this machine: this network namespace and a new one, joined by veth pairs
(one per NIC). Needs root and iproute2; callers skip with the reason otherwise. Nothing here
talks to anything but the links it creates."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Hosts", "Lan", "lan", "netns_unavailable", "reap_stale", "two_hosts"]


@dataclass
class Hosts:
    ns: str  # the peer host's namespace
    local: list[str]  # our NICs (in this namespace)
    remote: list[str]  # the peer's NICs (in ns)
    prefix: list[str]  # runs a command in ns

    def ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def link(self, i: int, up: bool) -> None:
        """Takes our end of link ``i`` down or up (the peer's end loses its carrier)."""
        self.ip("link", "set", self.local[i], "up" if up else "down")


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"aiote-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> None:
    """Deletes what a test process that is gone (killed before its cleanup ran) left: its
    namespaces (``aiote-<pid>...``) and its links in this namespace (``aio<pid>a<i>``), which
    would otherwise hold the addresses the next run gives its own links. Only names these
    helpers make, and only of a pid that no longer runs."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in out.splitlines() if line.strip()):
        m = re.fullmatch(r"aiote-(\d+)(-.*)?", name)
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for m in re.finditer(r"^\d+: (aio(\d+)a\d+)[@:]", out, re.M):
        if not _alive(int(m.group(2))):
            subprocess.run(["ip", "link", "del", m.group(1)], capture_output=True)


@contextmanager
def two_hosts(nlinks: int = 2, subnet: int = 213) -> Iterator[Hosts]:
    reap_stale()
    tag = f"{os.getpid()}"
    ns = f"aiote-{tag}"
    local = [f"aio{tag}a{i}" for i in range(nlinks)]
    remote = [f"aio{tag}b{i}" for i in range(nlinks)]
    h = Hosts(ns, local, remote, ["ip", "netns", "exec", ns])
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    h.ip("netns", "add", ns)
    try:
        h.ip("-n", ns, "link", "set", "lo", "up")
        for i, (a, b) in enumerate(zip(local, remote, strict=True)):
            h.ip("link", "add", a, "type", "veth", "peer", "name", b, "netns", ns)
            h.ip("addr", "add", f"10.{subnet}.{i + 1}.1/24", "dev", a)
            h.ip("-n", ns, "addr", "add", f"10.{subnet}.{i + 1}.2/24", "dev", b)
            h.ip("link", "set", a, "up")
            h.ip("-n", ns, "link", "set", b, "up")
        yield h
    finally:
        for a in local:
            subprocess.run(["ip", "link", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass
class Lan:
    """Hosts on one switched network: each host a namespace with one NIC (``eth0``, address
    ``10.{subnet}.0.{10 + i}``), the switch a bridge in a namespace of its own that also has
    an address (``10.{subnet}.0.1``) for a service every host reaches. Nothing of it is in
    this namespace."""

    switch: str  # the bridge's namespace
    hosts: list[str]  # the hosts' namespaces
    subnet: int

    def prefix(self, ns: str) -> list[str]:
        """Runs a command in namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def addr(self, i: int) -> str:
        """The address of host ``i``."""
        return f"10.{self.subnet}.0.{10 + i}"

    @property
    def switch_addr(self) -> str:
        return f"10.{self.subnet}.0.1"


@contextmanager
def lan(nhosts: int, subnet: int) -> Iterator[Lan]:
    """``nhosts`` hosts and a switch (see :class:`Lan`); every namespace (and with it every
    link) is deleted at the end, also on failure."""
    reap_stale()
    tag = f"{os.getpid()}"
    sw = f"aiote-{tag}-sw"
    hosts = [f"aiote-{tag}-h{i}" for i in range(nhosts)]
    made: list[str] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for ns in (sw, *hosts):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "addr", "add", f"10.{subnet}.0.1/24", "dev", "br0")
        ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(hosts):
            ip("link", "add", "name", f"p{i}", "netns", sw, "type", "veth",
               "peer", "name", "eth0", "netns", ns)
            ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            ip("-n", sw, "link", "set", f"p{i}", "up")
            ip("-n", ns, "addr", "add", f"10.{subnet}.0.{10 + i}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        yield Lan(sw, hosts, subnet)
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
