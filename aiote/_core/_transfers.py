"""One-sided writes and reads, write_imm and the posted (non-awaited) writes, with the
memoized fast path of repeated single-route writes."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

import numpy as np

from .._native import ffi, lib
from ._descriptor import DEVICE_CUDA, MemoryDescriptor
from ._errors import InvalidArgument
from ._memory import MemoryRegion
from ._posted import Transfer
from ._records import _MEMO_MAX, _check_retry, _end, _plain, _plain_imm, _staged
from ._retry import RetryPolicy
from ._rows import Rows
from ._util import check_timeout
from ._wire import _OP_DTYPE, _Credits

_U64 = struct.Struct("<Q")
_DATA_AT = 48  # the immediate's offset in an aio_op_desc row
assert _OP_DTYPE.fields is not None and _OP_DTYPE.fields["data"][1] == _DATA_AT


def _imm_mark(imm: Any) -> Any:
    """What a write's memo key holds of its immediate: None (no immediate) or -1 (one; the
    kept request is copied with the caller's, see :meth:`Transfers._with_imm`)."""
    return None if imm is None else -1


class Transfers(Rows):
    """Writes, reads and write_imm, awaited or posted, with the memoized fast path."""

    async def write(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> None:
        """One-sided write of ``length`` bytes from ``mr[src_offset:]`` to the peer's region
        ``remote`` at ``dst_offset`` (``length`` defaults to what fits in both).

        Returns when the source buffer may be reused (the transport is done with it). With
        ``imm`` (32-bit), the peer's ``imm_counter(imm)`` gains one credit once the data has
        landed; without it the peer is not told.

        Raises :class:`InvalidArgument` before posting anything for bad input (unregistered
        region, ranges past either region, bad imm); :class:`TransferTimeout` after ``timeout``;
        :class:`TransferError` subclasses when the transport reports an error. Cancelled: the
        write may or may not have landed; the cancellation propagates once the transport let
        go of the buffer (bounded by ``cancel_grace``). Cost: one work request, no copy.

        GPU memory on either side (see :meth:`register`): the same call and the same counter
        semantics (the peer is credited once the bytes are in its GPU memory); staged through
        pinned host memory in ``stage_chunk`` pieces, or a device-to-device copy (CUDA IPC)
        for a peer on this host. ``stream`` (a CuPy/torch CUDA stream): the write starts only
        after the work submitted to it so far, without blocking the loop.
        """
        key = (id(remote), length, src_offset, dst_offset, _imm_mark(imm))
        m = self._kept_write(mr, remote, key, stream, imm)
        if m is not None:
            await self._memo_post(m, mr, timeout, retry, "write")
            return
        rdesc = self._remote(remote)
        if self._via_gpu(mr, rdesc, stream):
            mr, rdesc, length, src_offset, dst_offset, _, _ = self._span(
                mr, rdesc, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE
            )
            gpu = self._gpu_support()
            await gpu.write(mr, rdesc, length, src_offset, dst_offset, imm, timeout, retry, stream)
            return
        await self._write_host(
            mr, rdesc, length, src_offset, dst_offset, imm, timeout, retry, key if rdesc is remote else None
        )

    def _kept_write(
        self, mr: Any, remote: Any, key: tuple[Any, ...], stream: Any, imm: Any
    ) -> tuple[Any, ...] | None:
        """The request kept for a write made before from ``mr`` with the same arguments
        ``key`` to the same descriptor object (a loop re-sending its slots, a ping-pong, a
        flow numbering its immediates), if it may be posted again (see :meth:`_memo_post`),
        else None. The immediate is not part of ``key`` (only whether there is one): a kept
        request with another one is copied with ``imm`` in it. Plain ints only: hashable,
        and no True or 1.0 standing in for 1; an ``imm`` outside [0, 2**32) finds nothing
        (the full path raises)."""
        if type(mr) is MemoryRegion and stream is None and _plain(key) and (m := mr._memos.get(key)):
            live = mr._engine is self and mr._handle is not None and not self._router.down
            if m[0] is remote and live:
                return self._with_imm(m, imm)
        return None

    def _with_imm(self, m: tuple[Any, ...], imm: Any) -> tuple[Any, ...] | None:
        """Memo ``m`` (see :meth:`_memo`) carrying ``imm``: itself when it does, else a copy of
        its one row with ``imm`` in it (a new table: the kept one may still be in flight);
        None for an ``imm`` that is not a plain int in [0, 2**32)."""
        if imm is None:
            return m
        table = m[2]
        if not _plain_imm(imm) or len(table) != 1:
            return None
        if _U64.unpack_from(table, _DATA_AT)[0] == imm:
            return m
        raw = bytearray(table)  # (struct on the row's bytes: a third of numpy's field access)
        _U64.pack_into(raw, _DATA_AT, imm)
        table = np.frombuffer(raw, _OP_DTYPE)
        ptr = ffi.from_buffer("aio_op_desc[]", table)
        return (m[0], m[1], table, self._poster(ptr, 1), ptr)

    def _kept_imm(self, remote: Any, imm: Any, stream: Any) -> tuple[Any, ...] | None:
        """The request kept for a ``write_imm`` of ``imm`` to the same descriptor object, if
        it may be posted again, else None."""
        m = self._imm_memos.get((id(remote), imm)) if type(imm) is int else None
        if m is not None and m[0] is remote and stream is None and not self._router.down:
            return m  # type: ignore[no-any-return]
        return None

    @staticmethod
    def _via_gpu(mr: Any, rdesc: MemoryDescriptor, stream: Any) -> bool:
        """Whether a write goes through the GPU support (a stream, or GPU memory either side)."""
        return stream is not None or rdesc.device_kind == DEVICE_CUDA or getattr(mr, "_dev", None) is not None

    def _memo(
        self, memos: dict[Any, Any], key: Any, rdesc: MemoryDescriptor, table: np.ndarray
    ) -> tuple[Any, ...] | None:
        """Keeps in ``memos`` under ``key`` (the arguments, the descriptor's ``id`` first) what
        :meth:`_memo_post` needs to post ``table`` again: (rdesc, key, table, post, items).
        The entry holds ``rdesc``, so its ``id`` names no other object while it lives. At most
        ``_MEMO_MAX`` entries: a full dict starts again empty. None (nothing kept) for
        arguments that are not plain ints."""
        if not _plain(key):
            return None
        ptr = ffi.from_buffer("aio_op_desc[]", table)
        m = (rdesc, key, table, self._poster(ptr, len(table)), ptr)
        if len(memos) >= _MEMO_MAX:
            memos.clear()
        memos[key] = m
        return m

    def _memo_post(
        self, m: tuple[Any, ...], refs: Any, timeout: float | None, retry: Any, what: str
    ) -> Coroutine[Any, Any, None]:
        """Posts a memoized single-route request again. Memos are made only for host regions
        over one route, from arguments that passed validation, and used only while the region
        is registered, the descriptor is the same object and no link is down: the request is
        the one the full path would build (it saves ~10 us of validation and packing)."""
        _, _, table, post, items = m  # _attempts' coroutine itself: no layer of its own
        attempt = partial(self._kept_once, post, len(table), (refs, table), items, what)
        obs = self._obs
        if obs is not None and obs._plain():  # observed as its one group: no record
            return self._observed_kept(obs, table, attempt, timeout, retry, what)
        return self._attempts(attempt, timeout, retry, what)

    async def _write_host(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        imm: int | None,
        timeout: float | None,
        retry: RetryPolicy | None,
        key: Any = None,
    ) -> None:
        """A write between the NIC-registered memories (a GPU region's shadow included).
        ``key``: the caller's arguments, to memoize a host write over one route."""
        credits: _Credits = {}
        rows, full = self._rows(
            mr, remote, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE, credits, gpu_ok=True
        )
        table = self._table(rows)
        if key is not None and len(full) == 1 and mr._dev is None and not self._router.down:
            self._memo(mr._memos, key, remote, table)
        end = _end(timeout)

        async def attempt(t: float | None) -> None:
            if len(full) == 1:  # one NIC each side: the common, fast case
                await self._run_table(table, mr, t, "write")
                return
            await self._then_credit(self._run(table, mr, t, "write", full), credits, end, "write", len(table))

        await self._attempts(attempt, timeout, retry, "write")

    async def write_imm(
        self,
        remote: MemoryDescriptor | bytes,
        imm: int,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> None:
        """Zero-byte write carrying ``imm`` to the owner of ``remote``: its
        ``imm_counter(imm)`` gains one credit. For a GPU region the credit comes after the
        owner's copies of earlier writes into GPU memory; ``stream``: sent only after the work
        submitted to that CUDA stream so far (e.g. the kernel that produced the data). To a GPU
        region this engine has written over the CUDA-IPC rail (same host), the credit goes on
        that rail's stream after every copy this engine put there, awaited or not, and reaches
        the owner through its credit lane (no message; by one once those copies are done when
        the lane is not open yet, or after the owner's own copies when this engine staged bytes
        to it). Raises as :meth:`write`. Cost: one zero-byte work request,
        no payload (a repeat to the same descriptor object reuses the kept request, skipping
        validation); to a staged GPU region, one internal message to its owner instead; over
        the CUDA-IPC rail, one kernel launch and the wait for its completion word."""
        m = self._kept_imm(remote, imm, stream)
        if m is not None:
            await self._memo_post(m, None, timeout, retry, "write_imm")
            return
        if imm is None:
            raise InvalidArgument("write_imm needs an immediate")
        rdesc = self._remote(remote)
        assert self._scratch is not None
        if rdesc.gpu is not None and stream is None:  # after this engine's CUDA-IPC copies
            check_timeout(timeout)
            _check_retry(retry)
            finish = self._start_ipc_imm(rdesc, imm)
            if finish is not None:
                await finish(timeout, retry)
                return
        if stream is not None or _staged(rdesc):
            self._span(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE)
            await self._gpu_support().write(self._scratch, rdesc, 0, 0, 0, imm, timeout, retry, stream)
            return
        rows, full = self._rows(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE, gpu_ok=True)
        table = self._table(rows)
        if len(full) == 1:  # one NIC each side: no failover to arrange
            # (not kept for a GPU region: this engine may reach it over the CUDA-IPC rail later)
            keep = rdesc is remote and not self._router.down and rdesc.gpu is None
            m = self._memo(self._imm_memos, (id(rdesc), imm), rdesc, table) if keep else None
            if m is None:  # bytes, a link down, or an imm that is not a plain int: no memo
                await self._attempts(
                    lambda t: self._run_table(table, None, t, "write_imm"), timeout, retry, "write_imm"
                )
                return
            await self._memo_post(m, None, timeout, retry, "write_imm")
            return
        await self._attempts(
            lambda t: self._run(table, None, t, "write_imm", full), timeout, retry, "write_imm"
        )

    def post_write(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> Transfer:
        """:meth:`write`, posted now and awaited later: returns a :class:`Transfer` to await
        when the source buffer's reuse (or the error) matters, so that a task can post a
        write and go on (wait for the peer's answer, post the next) without an event-loop
        round trip for the write's own completion.

        Guarantees: arguments are validated before this returns (raises :class:`InvalidArgument`,
        :class:`DescriptorError` or :class:`EngineClosed`; nothing posted). Host memory over
        one NIC to the peer (the common case) is handed to the transport before this returns, and
        a write over the CUDA-IPC rail is on its stream (the copy and the fence that reports
        it); other GPU writes, a ``stream`` off that rail, several NICs to the peer, or a
        transport pushing back (full queues, a peer still connecting) continue in a background
        task of the engine, started at once. Either way the write proceeds
        whether or not the :class:`Transfer` is awaited, and the engine keeps the source
        region's request alive until the transport's completion. Errors (and the retries of
        ``retry``, as :meth:`write` does them) surface when the :class:`Transfer` is awaited;
        one never awaited that failed is logged when it is dropped. Must be called in the
        event-loop thread (like every engine method). Cost: as :meth:`write` minus its
        awaits (a kept request: ~5 us of Python here; a CUDA-IPC write repeated from the same
        region to the same descriptor object after the same stream's work keeps its lookups
        too, and checks its plain-int arguments inline)."""
        self._check_open()
        _check_retry(retry)
        gpu = self._gpu
        if gpu is not None and getattr(mr, "_dev", None) is not None:  # a repeated CUDA-IPC write?
            started = gpu.post_kept(mr, remote, stream, length, src_offset, dst_offset, imm)
            if started is not None:
                return self._ipc_started(started, retry)
        key = (id(remote), length, src_offset, dst_offset, _imm_mark(imm))
        m = self._kept_write(mr, remote, key, stream, imm)
        if m is not None:
            return self._post_now(m[2], mr, "write", retry, m)
        rdesc = self._remote(remote)
        if self._via_gpu(mr, rdesc, stream):
            span = self._span(mr, rdesc, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE)
            r, d, n, so, do = span[:5]
            if getattr(r, "_dev", None) is not None:  # over the CUDA-IPC rail: on the stream now
                gpu = self._gpu_support()
                started = gpu.start_ipc(r, d, n, so, do, imm, stream)
                if started is not None:
                    if d is remote:
                        gpu.keep_ipc(r, d, stream)
                    return self._ipc_started(started, retry)
            return self._background(
                lambda: self.write(
                    mr, rdesc, length=length, src_offset=src_offset, dst_offset=dst_offset, imm=imm,
                    retry=retry, stream=stream,
                ),
                "write",
            )
        credits: _Credits = {}
        rows, full = self._rows(
            mr, rdesc, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE, credits, gpu_ok=True
        )
        if len(full) != 1 or self._router.down:  # several NICs: striping, failover, credits
            # the rows above only validated the call: the task builds them again when it
            # starts, so that the transfers posted before it count as in flight (see _rows)
            return self._background(
                lambda: self._write_host(mr, rdesc, length, src_offset, dst_offset, imm, None, retry),
                "write",
            )
        table = self._table(rows)
        m = self._memo(mr._memos, key, remote, table) if rdesc is remote else None
        return self._post_now(table, mr, "write", retry, m)

    def _ipc_started(self, started: tuple[Any, Any], retry: RetryPolicy | None) -> Transfer:
        """The Transfer of a write started on the CUDA-IPC rail (``(finish, fenced)``, see
        :meth:`GpuSupport._ipc_write`)."""
        finish, fenced = started
        if fenced is not None:  # its fence's event is all that is left: no task
            return Transfer._when_set(self, "write", fenced)
        return self._background(lambda: finish(None, retry), "write")

    def post_write_imm(
        self,
        remote: MemoryDescriptor | bytes,
        imm: int,
        *,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> Transfer:
        """:meth:`write_imm`, posted now and awaited later (see :meth:`post_write`): the
        immediate is handed to the transport before this returns (one NIC to the peer, no
        ``stream``, room in the queues; otherwise a background task of the engine posts it at
        once). Where :meth:`imm_follows_writes` is true for ``remote``, its credit is on the
        CUDA-IPC rail's stream before this returns, after every write posted before it.
        Raises :class:`InvalidArgument` (or :class:`DescriptorError`) at once for a bad
        immediate or descriptor, :class:`EngineClosed`. Cost: as :meth:`write_imm` minus its
        awaits; when posted in this call, its completion is quiet (read at the loop's next
        wake-up)."""
        self._check_open()
        _check_retry(retry)
        m = self._kept_imm(remote, imm, stream)
        if m is not None:
            return self._post_now(m[2], None, "write_imm", retry, m)
        if imm is None:
            raise InvalidArgument("write_imm needs an immediate")
        rdesc = self._remote(remote)
        assert self._scratch is not None
        finish = self._start_ipc_imm(rdesc, imm) if stream is None else None
        if finish is not None:  # on the CUDA-IPC rail's stream now, after its copies
            return self._background(lambda: finish(None, retry), "write_imm")
        gpu = stream is not None or _staged(rdesc)
        if gpu:
            self._span(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE)  # validation only
        else:
            rows, full = self._rows(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE, gpu_ok=True)
        if gpu or len(full) != 1 or self._router.down:  # GPU staging, several NICs: as write_imm
            again = partial(self.write_imm, rdesc, imm, retry=retry, stream=stream)
            return self._background(again, "write_imm")
        table = self._table(rows)
        # (not kept for a GPU region: this engine may reach it over the CUDA-IPC rail later)
        keep = rdesc is remote and rdesc.gpu is None
        m = self._memo(self._imm_memos, (id(rdesc), imm), rdesc, table) if keep else None
        return self._post_now(table, None, "write_imm", retry, m)

    def _start_ipc_imm(self, rdesc: MemoryDescriptor, imm: int) -> Any:
        """A ``write_imm`` to ``rdesc`` validated and started on the CUDA-IPC rail's stream now
        (:meth:`GpuSupport.start_ipc_imm`), and what finishes it; None when it does not go that
        way (a host region, no GPU support yet, the rail out of reach)."""
        rail = self._gpu if rdesc.gpu is not None else None
        if rail is None:
            return None
        assert self._scratch is not None
        self._span(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE)
        return rail.start_ipc_imm(rdesc, imm, self._scratch)

    def imm_follows_writes(self, remote: MemoryDescriptor | bytes) -> bool:
        """Whether a :meth:`write_imm` or :meth:`post_write_imm` (no ``stream``) to ``remote``
        made now goes on the CUDA-IPC rail (a GPU region of a same-host engine that this engine
        has written over that rail, from one device; see :meth:`write_imm`), and so is credited
        at its owner only after the bytes of every write this engine already posted over that
        rail, awaited or not. A caller whose writes all went over the rail (GPU memory into GPU
        regions for which this is true) may then post the immediate right after its last write
        instead of awaiting the writes first; a posted IPC copy cannot fail short of a CUDA
        error, which stops the immediate's kernel too. Elsewhere (libfabric routes, host
        memory, staged GPU writes, several NICs) transfers in flight complete in no set order:
        await the writes, then send the immediate. Raises :class:`DescriptorError`
        for corrupt descriptor bytes, :class:`EngineClosed`. Cost: O(1), no I/O (the first
        call for a region may map its IPC handle, as the first write to it does)."""
        self._check_open()
        rdesc = self._remote(remote)
        rail = self._gpu if rdesc.gpu is not None else None
        return rail is not None and rail.ipc_imm_device(rdesc) is not None

    def _post_now(
        self, table: np.ndarray, refs: Any, what: str, retry: RetryPolicy | None, kept: Any = None
    ) -> Transfer:
        """Begins the group of ``table`` (one route, no failover) in this call; when the
        transport did not take all of it at once, a background task finishes it exactly as
        :meth:`_run_group` would (waiting for room, back-off, the stalled-peer check, retries).
        ``kept``: the memo of ``table`` (see :meth:`_memo`), whose poster it reuses."""
        if kept is not None:
            post, items = kept[3], kept[4]
        else:
            items = ffi.from_buffer("aio_op_desc[]", table)
            post = self._poster(items, len(table))
        n = len(table)
        own = (refs, table)

        def again(t: float | None) -> Awaitable[bool]:
            return self._run_group(post, n, own, t, what, None, None, items)

        st = self._begin(n, own, None, None, items, quiet=True)
        rec = None if self._obs is None else self._obs._start(what)
        if rec is not None:
            rec.tap(st.op)
        if st.first == n:  # posted and sealed: only the completion is left (a quiet one)
            st.op.obs = rec  # (observed: ended by the completion, see _drain)
            return Transfer(self, what, st.op, again, retry)
        if st.g >= 0:  # not sealed: the task finishing it waits as usual, woken as usual
            lib.aio_group_quiet(self._h, st.g, 0)
        begun = [st]

        async def attempt(t: float | None) -> None:
            if begun:
                await self._finish(begun.pop(), post, n, _end(t), t, what)
            else:
                await again(t)

        def run() -> Awaitable[None]:
            return self._attempts(attempt, None, retry, what)

        return self._background(run if rec is None else rec.obs._carry(rec, run), what)

    def _background(self, run: Callable[[], Awaitable[Any]], what: str) -> Transfer:
        """A :class:`Transfer` whose work ``run()`` goes on in a background task of the engine."""
        t = Transfer(self, what)
        t._go(run)
        return t

    async def read(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """One-sided READ of ``length`` bytes from the peer's region at ``src_offset`` into
        ``mr[dst_offset:]``. Returns when the bytes are in ``mr``. The peer's region must have
        been registered with ``remote_read``. Raises as :meth:`write`.

        Into a GPU region: read into its shadow, then copied to GPU memory before this
        returns. From a peer's GPU region: only from a peer on this host (CUDA IPC) into a GPU
        region; otherwise :class:`InvalidArgument` (its owner must write it).

        Cost: one work request (one per NIC when at least ``stripe_min`` bytes are striped over
        several), no copy; into a staged GPU region, one more host-to-GPU copy; from a GPU
        region on this host, one device-to-device copy and no work request."""
        rdesc = self._remote(remote)
        if rdesc.device_kind == DEVICE_CUDA or getattr(mr, "_dev", None) is not None:
            mr, rdesc, length, dst_offset, src_offset, _, _ = self._span(
                mr, rdesc, length, src_offset, dst_offset, None, lib.AIO_OP_READ
            )
            await self._gpu_support().read(mr, rdesc, length, src_offset, dst_offset, timeout, retry)
            return
        await self._read_host(mr, rdesc, length, src_offset, dst_offset, timeout, retry)

    async def _read_host(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        timeout: float | None,
        retry: RetryPolicy | None,
    ) -> None:
        rows, full = self._rows(
            mr, remote, length, src_offset, dst_offset, None, lib.AIO_OP_READ, gpu_ok=True
        )
        table = self._table(rows)
        await self._attempts(lambda t: self._run(table, mr, t, "read", full), timeout, retry, "read")
