"""Routing: which local NICs (rails) reach which NICs of a peer, over which provider.

A *path* to a peer is a tuple of routes ``(local rail, fi_addr, remote base, remote key)``,
one per (local NIC, remote NIC) pair of the chosen provider: local NIC ``i % nL`` talks to
remote NIC ``i % nR`` for ``i < max(nL, nR)``, so 2 local NICs reach 1 remote NIC (both
local queues, one remote NIC) and 1 reaches 2. A route always pairs a local rail with the
fi_addr inserted into *that* rail's address vector and the remote key of the remote NIC it
addresses; local keys come from the rail that posts (the C core takes ``mr->desc[rail]``).

The provider is chosen per peer: the same-host provider (``shm``) when the peer runs on this
host and both sides carry it, else the engine's main provider.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._descriptor import EngineAddress, _RemoteKey
from ._errors import InvalidArgument

__all__ = ["DomainGroup", "Route", "Router", "addr_ends"]

# (local rail, fi_addr, remote base, remote key)
_Hop = tuple[int, int, int, int]


_ENDS: dict[EngineAddress, tuple[_RemoteKey, ...]] = {}
_MAX_PATHS = 4096  # cached paths per router (one per peer region descriptor's key set)


def addr_ends(addr: EngineAddress) -> tuple[_RemoteKey, ...]:
    """An engine address's NICs in the form :meth:`Router.path` takes (no region key)."""
    e = _ENDS.get(addr)
    if e is None:
        if len(_ENDS) > 4096:
            _ENDS.clear()
        e = _ENDS[addr] = tuple(_RemoteKey(r.provider, r.address, 0, 0) for r in addr.rails)
    return e


@dataclass(frozen=True, slots=True)
class Route:
    """How this engine reaches a peer (``engine.route(peer)``).

    ``provider``: the libfabric provider used; ``same_host``: whether the peer runs on this
    host; ``pairs``: ``(local NIC, remote NIC index)`` for each route transfers are striped
    over; ``down``: local NICs currently out of rotation (link down or failed); ``direct``
    (the route of a region's descriptor only): whether this engine's writes and reads of host
    memory to that region are same-host direct copies (see docs/same-host.md), where a
    paged write whose sources are evenly spaced goes as one copy with no staging. A frozen
    snapshot: reading it costs nothing and raises nothing."""

    provider: str
    same_host: bool
    pairs: tuple[tuple[str, int], ...]
    down: tuple[str, ...] = ()
    direct: bool = False


@dataclass(frozen=True, slots=True)
class DomainGroup:
    """The NICs of an engine (``engine.domains``): one libfabric domain each, over
    ``provider``, plus ``same_host`` (the provider of the same-host rail, or None).

    Transfers to a peer are striped over every (local NIC, remote NIC) pair of the provider
    that reaches it (:meth:`Engine.route`): a write or read of at least ``stripe_min`` bytes
    is split into one shard per pair, a paged write deals its pages round robin, smaller
    operations take turns. ``down`` lists NICs out of rotation because their link is down;
    they come back when it is up again. ``streams``: connections per NIC (each NIC appears
    that many times in ``nics``). A frozen snapshot: reading it costs nothing and raises
    nothing."""

    provider: str
    nics: tuple[str, ...]
    same_host: str | None
    stripe_min: int
    down: tuple[str, ...]
    streams: int = 1


class Router:
    """Chooses and caches paths; tracks which local rails are out of rotation."""

    def __init__(
        self,
        providers: Sequence[str],
        domains: Sequence[str],
        host_id: bytes,
        same_host: str | None,
        insert: Callable[[int, bytes], int],
    ) -> None:
        self._prov = list(providers)  # per local rail
        self._domains = list(domains)
        self._host = host_id
        self._same_host = same_host
        self._insert = insert
        self._order: list[str] = []
        for p in self._prov:
            if p not in self._order:
                self._order.append(p)
        self._paths: dict[tuple[Any, ...], tuple[_Hop, ...]] = {}
        self._by_addr: dict[EngineAddress, tuple[_Hop, ...]] = {}
        self._pairs: dict[tuple[Any, ...], tuple[tuple[int, int], ...]] = {}
        self._rot: dict[int, int] = {}
        self.down: set[int] = set()

    def provider_for(self, theirs: Sequence[str], host_id: bytes) -> str:
        """The provider to reach a peer that offers ``theirs`` (one entry per remote NIC)."""
        same = host_id == self._host
        sh = self._same_host
        if same and sh is not None and sh in theirs and sh in self._order:
            return sh
        for p in self._order:
            if p == sh and not same and p != self._prov[0]:
                continue  # the same-host provider cannot reach another host
            if p in theirs:
                return p
        raise InvalidArgument(
            f"no common provider: this engine has {sorted(set(self._order))}, the peer has "
            f"{sorted(set(theirs))}"
        )

    def path(self, ends: tuple[_RemoteKey, ...], host_id: bytes) -> tuple[_Hop, ...]:
        """Every route to the peer whose NICs are ``ends`` (provider, address, base, key per
        remote NIC); cached, so a peer's addresses are resolved once."""
        ck = (ends, host_id)
        p = self._paths.get(ck)
        if p is not None:
            return p
        if len(self._paths) >= _MAX_PATHS:
            self.forget()
        prov = self.provider_for([e.provider for e in ends], host_id)
        local = [i for i, x in enumerate(self._prov) if x == prov]
        remote = [j for j, e in enumerate(ends) if e.provider == prov]
        n = max(len(local), len(remote))
        hops = []
        pairs = []
        for i in range(n):
            li, rj = local[i % len(local)], remote[i % len(remote)]
            e = ends[rj]
            hops.append((li, self._insert(li, e.address), e.base, e.key))
            pairs.append((li, rj))
        p = self._paths[ck] = tuple(hops)
        self._pairs[ck] = tuple(pairs)
        return p

    def addr_path(self, addr: EngineAddress) -> tuple[_Hop, ...]:
        """:meth:`path` to the engine at ``addr``, looked up by the address alone (its hash
        is cached): a message's path is read on every send."""
        p = self._by_addr.get(addr)
        if p is None:
            if len(self._by_addr) >= _MAX_PATHS:
                self._by_addr.clear()
            p = self._by_addr[addr] = self.path(addr_ends(addr), addr.host_id)
        return p

    def forget(self) -> None:
        """Drops every cached path (the engine forgot peer addresses they name); paths are
        resolved again on next use. Also bounds the caches: they are cleared past _MAX_PATHS."""
        self._paths.clear()
        self._by_addr.clear()
        self._pairs.clear()
        self._rot.clear()

    def live(self, path: tuple[_Hop, ...]) -> tuple[_Hop, ...]:
        """The routes of ``path`` whose local NIC is in rotation. When every one is down, all
        of them: work is then posted anyway and waits in the transport for a link to come
        back (bounded by the operation's deadline)."""
        if not self.down:
            return path
        out = tuple(h for h in path if h[0] not in self.down)
        return out or path

    def start(self, path: tuple[_Hop, ...]) -> int:
        """Round-robin start index for the next transfer on ``path``."""
        if len(path) == 1:
            return 0
        k = id(path)
        r = self._rot.get(k, 0)
        self._rot[k] = r + 1
        return r

    def describe(self, ends: tuple[_RemoteKey, ...], host_id: bytes) -> Route:
        """The public view of the path to a peer."""
        path = self.path(ends, host_id)
        pairs = self._pairs[(ends, host_id)]
        prov = self._prov[path[0][0]]
        return Route(
            provider=prov,
            same_host=host_id == self._host,
            pairs=tuple((self._domains[li], rj) for li, rj in pairs),
            down=tuple(self._domains[li] for li, _ in pairs if li in self.down),
        )
