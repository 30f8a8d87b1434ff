"""Building rows (aio_op_desc) for writes and reads over a descriptor's routes, and opening
those routes (connect)."""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio

from .._native import ffi, lib
from ._descriptor import DEVICE_CUDA, MemoryDescriptor
from ._errors import InvalidArgument
from ._memory import MemoryRegion
from ._messages import Messages
from ._records import _direct_hop
from ._util import as_index, check_timeout
from ._wire import _F_DATA, _NO_DIRECT, _OP_READ, _OP_WRITE, _U32, _Credits


class Rows(Messages):
    """Rows of writes and reads over a descriptor's routes, and opening those routes.

    Counting rule of an immediate: over a single route it travels with the data. Over several
    routes (NICs) the data rows carry none; the credit is added to ``credits[(path, imm)]``
    and sent by :meth:`_send_credits` once every row has landed, so a row retried on another
    NIC after a link failure is never counted twice. Zero-byte writes are their own credit."""

    async def connect(self, remote: MemoryDescriptor | bytes, *, timeout: float | None = None) -> None:
        """Opens every connection to the owner of ``remote`` (a descriptor of one of its
        regions: one per NIC pair of its route, and per stream of a NIC) and returns once all
        of them are open. Without it, the first transfer to a peer goes over one connection
        while the others open in the background, and transfers are split over all of them
        only after that (see the guide's streams section); after it, the first one already is.

        Guarantees: one zero-byte request (a WRITE, or a READ when the region allows only
        remote reads; no immediate: nothing is counted at the peer, whose region is not
        touched) per connection that no such request of this engine completed on yet, all
        posted at once and awaited together; once every connection was made this way it
        posts nothing. Connections whose local NIC is down are skipped. Cancellation and
        ``timeout`` behave as for :meth:`write` (a posted request stays owned until the
        transport lets go of it).

        Raises :class:`InvalidArgument` when the region allows neither remote writes nor
        reads, :class:`DescriptorError` for corrupt descriptor bytes, :class:`EngineClosed`,
        :class:`PeerUnreachable` when the peer does not answer within the retry policy's
        ``connect_timeout``, :class:`TransferTimeout` after ``timeout``. Costs one native
        posting call and one event-loop wake-up when a connection was to open; a set lookup
        per connection otherwise."""
        self._check_open()
        check_timeout(timeout)
        rdesc = self._remote(remote)
        if rdesc.remote_write:
            op = lib.AIO_OP_WRITE
        elif rdesc.remote_read:
            op = lib.AIO_OP_READ
        else:
            raise InvalidArgument("connect: the region allows neither remote writes nor remote reads")
        full = self._path(rdesc)
        todo = [h for h in self._router.live(full) if (h[0], h[1]) not in self._routes_made]
        if not todo:
            await anyio.lowlevel.checkpoint()
            return
        table = self._table([self._probe(h, op) for h in todo])
        what = f"connect ({len(todo)} connection{'s' if len(todo) > 1 else ''})"
        await self._attempts(lambda t: self._run(table, None, t, what), timeout, None, what)
        made = [(h[0], h[1]) for h in todo]
        self._routes_made.update(made)
        if len(full) > 1:  # the routes transfers to several routes wait for
            self._routes_open.update(made)

    def _span(
        self,
        mr: Any,
        remote: Any,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        imm: int | None,
        op: int,
    ) -> tuple[MemoryRegion, MemoryDescriptor, int, int, int, int, int]:
        """Checks one transfer's arguments against both regions (nothing is posted):
        (region, remote descriptor, length, local offset, remote offset, imm data, flags)."""
        self._check_open()
        rdesc = self._remote(remote)
        mr = self._region(mr)
        src_offset = as_index(src_offset, "src_offset")
        dst_offset = as_index(dst_offset, "dst_offset")
        if op == _OP_WRITE:
            local_name, remote_name, loc_off, rem_off = "source", "destination", src_offset, dst_offset
        else:
            local_name, remote_name, loc_off, rem_off = "destination", "source", dst_offset, src_offset
        if length is None:
            length = min(mr.nbytes - loc_off, rdesc.length - rem_off)
        length = as_index(length, "length")
        if loc_off + length > mr.nbytes:
            raise InvalidArgument(
                f"{local_name} range [{loc_off}, {loc_off + length}) is past the local region ({mr.nbytes} B)"
            )
        if rem_off + length > rdesc.length:
            raise InvalidArgument(
                f"{remote_name} range [{rem_off}, {rem_off + length}) is past the remote region "
                f"({rdesc.length} B)"
            )
        if op == _OP_WRITE and not rdesc.remote_write:
            raise InvalidArgument("the remote region was registered without remote_write")
        if op == _OP_READ:
            if not rdesc.remote_read:
                raise InvalidArgument("the remote region was registered without remote_read")
            if not mr.writable:
                raise InvalidArgument("a READ needs a writable local region; this buffer is read-only")
        flags = 0
        data = 0
        if imm is not None:
            if op != _OP_WRITE:
                raise InvalidArgument("only writes carry an immediate")
            data = as_index(imm, "imm", hi=_U32)
            flags = _F_DATA
        elif length == 0:
            if op == _OP_READ:
                raise InvalidArgument("a READ must move at least one byte")
            raise InvalidArgument("a zero-length write must carry an immediate (imm=...)")
        return mr, rdesc, length, loc_off, rem_off, data, flags

    def _rows(
        self,
        mr: MemoryRegion,
        remote: Any,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        imm: int | None,
        op: int,
        credits: _Credits | None = None,
        gpu_ok: bool = False,
        load: int = 0,
        note: list[bool] | None = None,
        alone: bool = True,
    ) -> tuple[list[tuple[int, ...]], Any]:
        """Validates one transfer and returns its aio_op_desc rows and the full route set to
        the peer. Rows: one, or one shard per route when it is at least ``stripe_min`` bytes
        and the peer is reached over several NICs; over the streams of one NIC only while
        fewer operations are in flight, plus ``load`` (requests already in the caller's
        batch), than streams (otherwise a whole transfer posted ``alone`` takes the least
        loaded stream, :meth:`_pick_stream`, and one of several placed together in one call,
        a batch's, a scatter's or a barrier's, ``alone=False``, the next in turn). Immediates: as
        the class says (``credits``). ``note`` (batches): gets one bool for a peer of several
        routes: True when the rows may be kept for later submissions (every route open; over
        one NIC's streams, below ``stripe_min``: whole), False when their shape depends on
        what was in flight or open (:meth:`TransferBatch._place`)."""
        mr, rdesc, length, loc_off, rem_off, data, flags = self._span(
            mr, remote, length, src_offset, dst_offset, imm, op
        )
        if not gpu_ok and (mr._dev is not None or rdesc.device_kind == DEVICE_CUDA):
            raise InvalidArgument(
                "scatter, barrier and batches take host regions; move GPU regions with write/write_paged/read"
            )
        full = self._path(rdesc)
        path = self._router.live(full)
        n = len(path)
        start = self._router.start(full)
        opened = self._open_routes(path, op) if n > 1 else path
        if note is not None and n > 1:
            streams = self._streams > 1 and length >= self._stripe_min and self._on_one_nic(path)
            note.append(opened is path and not streams)
        ptr = mr._ptr
        # a same-host peer that published the region, over shm: a direct copy by our poller
        # (a memcpy into or out of the peer's arena, else process_vm_writev / readv), checked
        # against the owner's region table; a bare immediate is checked in place (see _host_of)
        dcode, dkey = self._direct(rdesc) if rdesc.direct is not None and mr._dev is None else _NO_DIRECT
        dhop = _direct_hop(full, dkey, self._shm_rails) if dcode else None
        if dhop is not None:
            # every byte is copied by our poller 0 whatever the stream: one row, on the stream
            # to the owner's first shm NIC (whose key the table publishes), the immediate with it.
            # Below this, no row is a direct copy (the rows of a same-host peer without a table
            # never come here: _host_of routes such a peer over the main provider)
            rail, fa, base, _ = dhop
            return [(ptr, loc_off, length, fa, base + rem_off, dkey, data, rail, op, flags, dcode)], (dhop,)
        if self._whole_on_a_stream(path, opened, length, load):
            # a transfer posted by itself takes the least loaded stream; the requests of one
            # call (a batch's, a scatter's, a barrier's) take the streams in turn, since none of
            # them is in flight yet when the next is placed
            hop = self._pick_stream(opened, start) if alone else opened[start % len(opened)]
            rail, fa, base, key = hop
            return [(ptr, loc_off, length, fa, base + rem_off, key, data, rail, op, flags, 0)], (hop,)
        if len(full) > 1 and flags and length:
            if credits is None:
                raise AssertionError("a multi-NIC write with an immediate needs a credit list")
            ckey = (full, data, self._owner_of(full, rdesc))
            credits[ckey] = credits.get(ckey, 0) + 1
            data = flags = 0
        if len(opened) == 1 or length < self._stripe_min:  # (NICs not connected yet take nothing)
            rail, fa, base, key = opened[start % len(opened)]
            return [(ptr, loc_off, length, fa, base + rem_off, key, data, rail, op, flags, 0)], full
        return self._stripes(opened, start, ptr, loc_off, length, rem_off, op), full

    def _whole_on_a_stream(
        self, path: tuple[Any, ...], opened: tuple[Any, ...], length: int, load: int
    ) -> bool:
        """Whether a transfer over ``path`` (its live routes; ``opened``: those connected)
        goes whole on one of the streams of one NIC, as over a single NIC (the immediate
        travels with the data). A link failure takes every stream of the NIC. A large transfer
        is split only once every stream is connected (see _open_routes), and only while fewer
        operations are in flight (plus ``load``, those ahead of it in the caller's batch) than
        streams: with every stream busy, a split adds work requests and a credit message and
        moves nothing faster."""
        n = len(path)
        return (
            n > 1
            and self._streams > 1
            and (
                opened is not path
                or length < self._stripe_min
                or max(len(self._ops), self._opening) + load >= n
            )
            and self._on_one_nic(path)
        )

    def _stripes(
        self, path: tuple[Any, ...], start: int, ptr: int, loc_off: int, length: int, rem_off: int, op: int
    ) -> list[tuple[int, ...]]:
        """The rows of one transfer (local pointer and offset, length, remote offset, op)
        striped over the open routes ``path`` of its peer from route ``start``: 4 KiB aligned
        shards on each in turn, none carrying an immediate (made a credit by then)."""
        n = len(path)
        chunk = -(-length // n)
        chunk = -(-chunk // 4096) * 4096
        rows: list[tuple[int, ...]] = []
        for i, o in enumerate(range(0, length, chunk)):
            rail, fa, base, key = path[(start + i) % n]
            ln = min(chunk, length - o)
            rows.append((ptr, loc_off + o, ln, fa, base + rem_off + o, key, 0, rail, op, 0, 0))
        return rows

    def _pick_stream(self, opened: tuple[Any, ...], start: int) -> Any:
        """The route of ``opened`` (streams of one NIC to one peer) whose rail has the fewest
        bytes of this engine's writes and reads in flight (``aio_least_loaded``), the round
        robin's ``start`` first among equals: a transfer does not queue behind a large one on
        one connection while another is idle (transfers of different sizes, or to several
        peers over the same rails). Costs one native call reading a counter per stream."""
        if self._closed or len(opened) == 1:  # (closed: the native engine may be gone)
            return opened[start % len(opened)]
        known = self._paths_open.get(id(opened))  # every stream open: its rails are kept there
        if known is not None and known[0] is opened:
            rails = known[1]
            if rails is None:
                rails = known[1] = ffi.new("int32_t[]", [h[0] for h in opened])
        else:  # (some streams still opening: a passing tuple)
            rails = ffi.new("int32_t[]", [h[0] for h in opened])
        i = int(lib.aio_least_loaded(self._h, rails, len(opened), start))
        return opened[i if i >= 0 else start % len(opened)]

    def _open_routes(self, path: tuple[tuple[int, int, int, int], ...], op: int) -> tuple[Any, ...]:
        """The routes of ``path`` (several NICs or streams to one peer) whose connections are
        open: ``path`` itself once all are. A connection is opened at its first request, so
        every route not yet open gets a zero-byte request of kind ``op`` (READ or WRITE, so
        that the region's access rights allow it; no immediate, nothing counted) in a
        background task when a transfer first reaches the peer; meanwhile transfers go over
        the open ones (the first: over the first route, which it opens itself). So a transfer
        is never split onto a connection that has yet to be made: a peer that stops answering
        (frozen, overloaded) makes every piece wait on an established connection, instead of
        one piece failing with PeerUnreachable after ``connect_timeout`` (or, timed out, never
        posted). A failed opening is logged and tried again at the next transfer. Costs one
        dict lookup once every route is open."""
        known = self._paths_open.get(id(path))
        all_open = known is not None and known[0] is path
        if all_open:
            return path
        opened = self._routes_open
        if not any((h[0], h[1]) in opened for h in path):
            opened.add((path[0][0], path[0][1]))  # this transfer opens it
        live = tuple(h for h in path if (h[0], h[1]) in opened)
        if len(live) == len(path):
            if len(self._paths_open) >= 1024:
                self._paths_open.clear()
            self._paths_open[id(path)] = [path, None]  # holds path: its id cannot be reused meanwhile
            return path
        for hop in path:
            if (hop[0], hop[1]) not in opened and (hop[0], hop[1]) not in self._routes_opening:
                self._routes_opening.add((hop[0], hop[1]))
                assert self._bridge is not None
                self._bridge.spawn(partial(self._open_route, hop, op))
        return live

    def _probe(self, hop: tuple[int, int, int, int], op: int) -> tuple[int, ...]:
        """The row of a zero-byte request of kind ``op`` (READ or WRITE, no immediate) over one
        route: it makes the connection and touches nothing at the peer."""
        assert self._scratch is not None
        rail, fa, base, key = hop
        return (self._scratch._ptr, 0, 0, fa, base, key, 0, rail, op, 0, 0)

    async def _open_route(self, hop: tuple[int, int, int, int], op: int) -> None:
        """Opens the connection of one route to a peer with a zero-byte request (see
        :meth:`_open_routes`); never raises (a failure is logged, and the next transfer to
        the peer tries again)."""
        rail, fa, _, _ = hop
        table = self._table([self._probe(hop, op)])
        try:
            names = frozenset({(rail, fa)})
            if not await self._run_table(table, None, None, "opening a connection", names=names):
                self._routes_open.add((rail, fa))
                self._routes_made.add((rail, fa))
        except Exception as exc:  # the transfer that needs the peer reports the failure
            self._log.info("a connection to a peer did not open (tried again)", rail=rail, error=str(exc))
        finally:
            self._routes_opening.discard((rail, fa))
            if self._book.due:
                self._maybe_sweep()
