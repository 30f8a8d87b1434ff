"""Rails and routes: the peers this engine resolved (PeerBook), the route of a descriptor
(striping, same-host, direct copies), links going down and coming back, failover."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._native import ffi, lib
from ._descriptor import DEVICE_HOST, EngineAddress, MemoryDescriptor
from ._errors import InvalidArgument
from ._optable import _Op, reroute
from ._records import _STRANDED, _direct_hop, _pairs_of, _rails_of
from ._registration import Registration
from ._routing import Route, addr_ends
from ._util import now, shm_peer_gone
from ._wire import _DIRECT_SLOTS, _ELSEWHERE, _NO_DIRECT, _strerror


class Rails(Registration):
    """Rails and routes: peers, the routes of a descriptor, links down and back, failover."""

    @contextmanager
    def _collect_stranded(self, into: list[Any]) -> Iterator[None]:
        """Within the block, groups that operations of this task leave on a failed link (a
        failover moved their work elsewhere) are appended to ``into``; :meth:`_settle_all`
        waits for them."""
        token = _STRANDED.set(into)
        try:
            yield
        finally:
            _STRANDED.reset(token)

    def _on_link(self, rail: int, up: bool) -> None:
        """A rail's link changed: take it out of rotation (and wake the groups posted on it,
        which re-post their work on the other NICs) or put it back."""
        name = self._rails[rail].domain
        if up:
            self._down_since.pop(rail, None)
            self._router.down.discard(rail)
            self._log.info("link up: NIC back in rotation", nic=name)
            return
        self._router.down.add(rail)
        self._down_since.setdefault(rail, now())
        # groups whose peer another NIC still reaches move their work there; the others'
        # requests wait in the transport for a link
        moved = self._ops.link_down(rail, self._router.down)
        for op in moved:
            op.event.set()
        self._log.warning("link down: NIC out of rotation", nic=name, operations_moved=len(moved))

    def forget_peer(self, peer: bytes | EngineAddress | MemoryDescriptor) -> None:
        """Lets go of what this engine keeps for a peer engine that left (its addresses in
        the NICs' address vectors, its connections, its same-host region table and the route
        caches naming it). Never cancels or fails anything: the peer is forgotten at once if
        nothing is in flight, else at the engine's next quiet moment (no transfer being built,
        posted, retried or awaited), and an address a kept :class:`TransferBatch` names stays
        until the batch is gone. Reaching the peer again later works and costs a new connection.

        The engine also forgets by itself: same-host peers whose process exited or closed its
        engine (noticed when another same-host peer is first reached), and past
        ``open_engine``'s ``max_peers`` addresses, those not used since the previous sweep, so
        what it keeps per peer stays bounded however many peers come and go.

        ``peer``: the peer's address (bytes or :class:`EngineAddress`) or a descriptor of one
        of its regions. Raises :class:`InvalidArgument` for anything else. O(NICs), plus a
        sweep (O(addresses kept)) when the engine is quiet."""
        if isinstance(peer, MemoryDescriptor):
            addr = peer.address
        elif isinstance(peer, (bytes, bytearray, memoryview, EngineAddress)):
            addr = self._engine_address(peer)
        else:
            raise InvalidArgument(
                f"peer must be an engine address or a MemoryDescriptor, not {type(peer).__name__}"
            )
        self._check_open()
        self._book.mark(r.address for r in addr.rails)
        self._maybe_sweep()

    def _named(self) -> set[tuple[int, int]] | None:
        """The (rail, fi_addr) pairs that rows being built, posted, retried or awaited name, or
        None when some of them are not known (a transfer in progress: the engine is not quiet)."""
        if self._opening or self._busy or self._sends:
            return None
        busy = set(self._routes_opening)
        for op in self._ops:
            if op.names is None:
                return None
            busy |= op.names
        for b in self._batches:
            t = b._table[: b._n]
            busy.update(zip(t["rail"].tolist(), t["peer"].tolist(), strict=True))
        return busy

    def _maybe_sweep(self) -> None:
        """Forgets what :class:`PeerBook` says to (see :mod:`._peers`), if the engine is quiet."""
        if self._closed or not self._book.due:
            return
        busy = self._named()
        if busy is None:
            return
        gone, detach = self._book.sweep(busy)
        for (rail, _), fa in gone:
            lib.aio_av_remove(self._h, rail, fa)
            self._routes_open.discard((rail, fa))
            self._routes_made.discard((rail, fa))
        for index in detach:
            lib.aio_direct_detach(self._h, index)
        if detach:
            dropped = set(detach)
            for k in [k for k, v in self._direct_attached.items() if v in dropped]:
                del self._direct_attached[k]
        if gone:
            # every cache that may hold a forgotten fi_addr (or a detached table's code):
            # rebuilt on next use, from the addresses kept or resolved anew
            self._router.forget()
            for cache in (self._desc_paths, self._direct_codes, self._one_nic, self._paths_open,
                          self._owners, self._imm_memos):
                cache.clear()
            for mr in self._regions:
                mr._memos.clear()
            self._log.debug("peers forgotten", addresses=len(gone), tables=len(detach))

    def _direct_sweep_gone(self) -> None:
        """Marks the same-host peers whose process exited or closed its engine (a poll of
        each attached table's pidfd): forgotten at the next sweep."""
        for index in self._book.attachments():
            if lib.aio_direct_gone(self._h, index) == 1:
                self._book.mark_attached(index)

    def _path(self, rdesc: MemoryDescriptor) -> tuple[tuple[int, int, int, int], ...]:
        """Every route to the owner of ``rdesc``, up or down (cached per descriptor key set);
        :meth:`Router.live` filters the ones in rotation. The descriptor objects last used are
        remembered by identity: hashing a descriptor's keys costs a microsecond per write."""
        hit = self._desc_paths.get(id(rdesc))
        if hit is not None and hit[0] is rdesc:
            return hit[1]
        p = self._router.path(rdesc.keys, self._host_of(rdesc))
        if len(self._desc_paths) >= 1024:
            self._desc_paths.clear()
        self._desc_paths[id(rdesc)] = (rdesc, p)  # holds rdesc: its id cannot be reused meanwhile
        return p

    def _host_of(self, rdesc: MemoryDescriptor) -> bytes:
        """The host id to route ``rdesc`` by: its owner's, unless the same-host route cannot
        keep its guarantees for this region. libfabric 1.17's shm checks no key, bounds or
        access right and never fails a request to a process that died, so host memory of a
        same-host peer is reached over shm only through the owner's region table (direct
        copies, checked by the initiator: see :meth:`_direct`); a region without a slot there
        (the owner publishes no table, no remote access, a full table) or an owner this process
        cannot attach to goes over the main provider, as a peer on another host."""
        host = rdesc.host_id
        if host != self._address.host_id or not self._shm_rails or rdesc.device_kind != DEVICE_HOST:
            return host
        if self._router.provider_for([k.provider for k in rdesc.keys], host) != "shm":
            return host
        if rdesc.direct is not None and self._direct(rdesc)[0]:
            return host
        return _ELSEWHERE

    def route(self, peer: bytes | EngineAddress | MemoryDescriptor) -> Route:
        """How this engine reaches ``peer`` (an engine address, or a descriptor of one of its
        regions): the provider (``shm`` for a same-host peer when both engines carry it, else
        the main provider), the (local NIC, remote NIC) pairs transfers are striped over, and,
        for a descriptor, whether host-memory transfers to its region are direct copies.
        Force a provider by opening the engine with ``same_host=None`` (never shm) or with
        ``provider="shm"``. Raises :class:`InvalidArgument` when no provider is common,
        :class:`DescriptorError` for corrupt address bytes. Costs O(NICs): the first call for a
        peer resolves its NIC addresses (one native call each, cached), later ones hit the cache."""
        if isinstance(peer, MemoryDescriptor):
            route = self._router.describe(peer.keys, self._host_of(peer))
            if peer.direct is not None and peer.device_kind == DEVICE_HOST:
                code, key = self._direct(peer)  # as a write of host memory decides (_paged, _rows)
                if code and _direct_hop(self._path(peer), key, self._shm_rails) is not None:
                    return dataclasses.replace(route, direct=True)
            return route
        addr = self._engine_address(peer)
        return self._router.describe(addr_ends(addr), addr.host_id)

    def _direct(self, rdesc: MemoryDescriptor) -> tuple[int, int]:
        """(the rows' ``direct`` code, the key it is good for) of a region published for direct
        same-host copies, or (0, 0): this engine does not copy directly, or cannot reach the
        owner's table (logged once per owner). Attaches on first use (a few system calls),
        then cached per descriptor object."""
        hit = self._direct_codes.get(id(rdesc))
        if hit is not None and hit[0] is rdesc:
            return hit[1]
        x = rdesc.direct
        code = 0
        if x is not None and self._direct_on and rdesc.host_id == self._address.host_id:
            att = self._direct_attached.get((x.pid, x.nonce))
            if att is None:
                self._direct_sweep_gone()
                info = ffi.new(
                    "aio_direct_info*", {"pid": x.pid, "fd": x.fd, "nonce": x.nonce, "table": x.table}
                )
                err = ffi.new("char[512]")
                att = int(lib.aio_direct_attach(self._h, info, err, 512))
                if att < 0:
                    self._log.info(
                        "same-host peer: direct copies unavailable, reads from it go through shm",
                        pid=x.pid,
                        reason=ffi.string(err).decode(errors="replace") or _strerror(-att),
                    )
                self._direct_attached[(x.pid, x.nonce)] = att
                if att >= 0:
                    self._book.attached(att, (k.address for k in rdesc.keys))
            if att >= 0 and 0 <= x.slot < _DIRECT_SLOTS:
                code = ((att + 1) << 16) | x.slot
        if len(self._direct_codes) >= 1024:
            self._direct_codes.clear()
        # the key a direct copy presents: the descriptor's key of the owner's first shm NIC, the
        # one its table publishes (rows on its other shm streams carry the same, so that a
        # forged or stale key is refused on every stream)
        skey = next((k.key for k in rdesc.keys if k.provider == "shm"), 0)
        out = (code, skey) if x is not None and code else _NO_DIRECT
        self._direct_codes[id(rdesc)] = (rdesc, out)  # holds rdesc: its id cannot be reused meanwhile
        return out

    def _on_one_nic(self, path: tuple[tuple[int, int, int, int], ...]) -> bool:
        """Whether every route of ``path`` leaves through the streams of one local NIC."""
        hit = self._one_nic.get(id(path))
        if hit is not None and hit[0] is path:
            return hit[1]
        k = self._streams
        one = len({h[0] // k for h in path}) == 1
        if len(self._one_nic) >= 1024:
            self._one_nic.clear()
        self._one_nic[id(path)] = (path, one)  # holds path: its id cannot be reused meanwhile
        return one

    def _owner_of(self, full: Any, rdesc: MemoryDescriptor) -> EngineAddress:
        """The address of the engine that a multi-route path reaches (its credit messages go
        there), cached per path: building it from the descriptor costs O(NICs)."""
        owner = self._owners.get(full)
        if owner is None:
            if len(self._owners) >= 4096:
                self._owners.clear()
            owner = self._owners[full] = rdesc.address
        return owner

    def _reroute(self, table: np.ndarray, full: Any) -> np.ndarray:
        """The rows of ``table`` moved to the live routes of ``full`` (same remote region:
        the remote offset is kept, the address base and key are the new NIC's)."""
        out = reroute(table, full, self._router.live(full), self._router.start(full))
        self._log.warning("rows moved to other NICs after a link failure", rows=len(out))
        self._failovers += len(out)
        if self._obs is not None:
            self._obs._failover(_moves(table["rail"], out["rail"]))
        return out

    def _shm_peers(self, op: _Op) -> list[bytes]:
        """The shm addresses ``op``'s requests go to (a same-host peer reached through the shm
        provider: messages, bare immediates, staged GPU parts), from the pairs it names; empty
        when none (see :meth:`_gone_peer`)."""
        return [a for r, fa in _pairs_of(op) if r in self._shm_rails and (a := self._book.address(r, fa))]

    def _gone_peer(self, op: _Op, seen: dict[bytes, bool] | None = None) -> bool:
        """True when every request of ``op`` goes to a same-host peer over an shm rail and each
        of those peers is gone (:func:`shm_peer_gone`: its process exited or its engine
        closed): nothing will complete them, and nothing reads their buffers any more. False
        when any request goes elsewhere (a tcp row of a batch, a read from another host) or
        its peer is not known. ``seen``: answers already taken, by address (a close asks
        once per peer). O(rows of op) and a stat and a flock per peer not in ``seen``."""
        pairs = _pairs_of(op)
        if not pairs or not self._shm_rails:
            return False
        addrs = []
        for rail, fa in pairs:
            a = self._book.address(rail, fa) if rail in self._shm_rails else None
            if a is None:
                return False
            addrs.append(a)
        for a in addrs:
            gone = seen.get(a) if seen is not None else None
            if gone is None:
                gone = shm_peer_gone(a)
                if seen is not None:
                    seen[a] = gone
            if not gone:
                return False
        return True

    def _all_down_for(self, op: _Op, t: float) -> float:
        """How long every NIC of ``op``'s peer has been down (0 while one is up)."""
        alts = op.alts or frozenset(op.rails or ()) or _rails_of(op)
        down = self._router.down
        if not alts or not alts <= down:
            return 0.0
        return t - max(self._down_since.get(r, t) for r in alts)

    def _peer_names(self, op: _Op) -> str:
        """The NICs an operation's requests left through, for error messages."""
        rails = sorted(op.rails or op.alts or _rails_of(op))
        return ", ".join(f"{self._rails[i].provider}/{self._rails[i].domain}" for i in rails) or "?"


def _moves(before: np.ndarray, after: np.ndarray) -> dict[tuple[int, int], int]:
    """How many rows went from each rail to each other rail (failover metrics)."""
    pairs = np.stack([before.astype(np.int64), after.astype(np.int64)], axis=1)
    moved, counts = np.unique(pairs, axis=0, return_counts=True)
    return {(int(a), int(b)): int(n) for (a, b), n in zip(moved.tolist(), counts.tolist(), strict=True)}
