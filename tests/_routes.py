"""The routes a user can get between two processes, as one rig for the guarantee suite
(tests/test_guarantees.py). Each rig yields the local engine, a peer process, and a way to
register a peer buffer on that route and to assert, after the fact, that the operations ran
on it (a test that silently ran on another route fails).

- ``tcp``: both engines with ``same_host=None`` (libfabric tcp over loopback);
- ``netns``: tcp between this namespace and a network namespace made for the test (two
  "hosts" on a veth pair); skipped without root and iproute2;
- ``same-host``: ``open_engine()``'s defaults, ordinary NumPy buffers: the shm rail, data
  moved by direct copies (process_vm_writev / readv) checked against the owner's table;
- ``arena``: the defaults, the peer's buffers from its host arena (``alloc_host``): the data
  moved by a memcpy into the mapped arena, same checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiote
from aiote.testing import PeerProcess, spawn_peer

ROUTES = ["tcp", "netns", "same-host", "arena"]
SAME_HOST = ("same-host", "arena")


@dataclass
class Rig:
    route: str
    engine: aiote.Engine
    peer: PeerProcess
    hosts: Any = None
    start: dict[str, int] = field(default_factory=dict)

    async def buffer(self, name: str, size: int, **kw: Any) -> aiote.MemoryDescriptor:
        """A peer buffer on this rig's route (from the peer's arena on ``arena``)."""
        if self.route == "arena":
            kw.setdefault("device", "arena")
        d = await self.peer.register(name, size, **kw)
        self.check_route(d)
        return d

    def check_route(self, d: aiote.MemoryDescriptor) -> None:
        want = "shm" if self.route in SAME_HOST else "tcp"
        got = self.engine.route(d).provider
        assert got.split(";")[0] == want, f"route {self.route}: the peer is reached over {got}, not {want}"
        if self.route == "netns":
            pairs = self.engine.route(d).pairs
            assert {p[0] for p in pairs} == set(self.hosts.local[:1]), pairs

    def ran_here(self) -> None:
        """Asserts that the data moved since the rig opened went the rig's way."""
        st = self.engine.stats()
        copies = st["direct_copies"] - self.start["direct_copies"]
        mapped = st["direct_mapped"] - self.start["direct_mapped"]
        if self.route == "same-host":
            assert copies > mapped >= 0, f"no direct copy was made on the same-host route ({st})"
        elif self.route == "arena":
            assert mapped > 0, f"no memcpy into the peer's arena was made ({st})"
        else:
            assert copies == 0, f"direct copies on route {self.route} ({st})"


@contextlib.contextmanager
def _hosts(route: str, subnet: int) -> Iterator[Any]:
    if route != "netns":
        yield None
        return
    import pytest
    from _netns import netns_unavailable, two_hosts

    why = netns_unavailable()
    if why:
        pytest.skip(why)
    with two_hosts(1, subnet=subnet) as h:
        yield h


@asynccontextmanager
async def rig(
    route: str, retry: aiote.RetryPolicy | None = None, subnet: int = 217, **kw: Any
) -> AsyncIterator[Rig]:
    """An engine and a peer process on ``route`` (see the module's docstring); ``netns``
    addresses ``10.{subnet}/16`` (one subnet per test module: modules run side by side)."""
    with _hosts(route, subnet) as h:
        opts: dict[str, Any] = dict(kw)
        if retry is not None:
            opts["retry"] = retry
        peer_kw: dict[str, Any] = {}
        if route in ("tcp", "netns"):
            opts["same_host"] = None
            peer_kw["same_host"] = None
        nics = h.local[:1] if h is not None else None
        if h is not None:
            peer_kw.update(peer_nics=h.remote[:1], prefix=h.prefix)
        async with aiote.open_engine(nics=nics, **opts) as e, spawn_peer(engine=e, **peer_kw) as p:
            st = e.stats()
            start = {k: st[k] for k in ("direct_copies", "direct_mapped")}
            yield Rig(route, e, p, h, start)


@asynccontextmanager
async def second_peer(r: Rig) -> AsyncIterator[PeerProcess]:
    """Another peer process on the same route as ``r``'s."""
    kw: dict[str, Any] = {}
    if r.route in ("tcp", "netns"):
        kw["same_host"] = None
    if r.hosts is not None:
        kw.update(peer_nics=r.hosts.remote[:1], prefix=r.hosts.prefix)
    async with spawn_peer(engine=r.engine, **kw) as p:
        yield p
