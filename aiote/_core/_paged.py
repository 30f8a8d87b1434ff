"""Paged writes (page tables), scatter and barrier."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np

from .._native import ffi, lib
from ._batch import TransferBatch
from ._descriptor import DEVICE_CUDA, MemoryDescriptor
from ._errors import InvalidArgument
from ._memory import MemoryRegion
from ._rails import _moves
from ._records import ScatterTarget, _direct_hop, _end, _left
from ._retry import RetryPolicy
from ._transfers import Transfers
from ._util import as_index
from ._wire import _NO_DIRECT, _OP_DTYPE, _U32, _Credits


def _paged_desc(
    mr: MemoryRegion,
    rdesc: MemoryDescriptor,
    sp: np.ndarray,
    dp: np.ndarray,
    geometry: tuple[int, int, int, int, int],
    data: int,
    flags: int,
    gather: bool,
    path: tuple[tuple[int, int, int, int], ...],
    first: int,
    direct: int,
) -> Any:
    """The aio_paged_desc of a paged write: pages ``sp`` -> ``dp`` over the routes ``path``
    (starting at ``first``); the arrays must outlive it."""
    page_size, src_stride, dst_stride, src_offset, dst_offset = geometry
    d = ffi.new("aio_paged_desc*")
    d.mr = mr._handle
    d.src_pages = ffi.cast("int64_t*", ffi.from_buffer(sp))
    d.dst_pages = ffi.cast("int64_t*", ffi.from_buffer(dp))
    d.page_size = page_size
    d.src_stride = src_stride
    d.dst_stride = dst_stride
    d.src_offset = src_offset
    d.dst_offset = dst_offset
    d.remote_len = rdesc.length
    d.data = data
    d.flags = flags
    d.gather = int(gather)
    d.nroutes = len(path)
    d.first_route = first
    for i, (rail, fa, base, key) in enumerate(path):
        d.routes[i].rail = rail
        d.routes[i].peer = fa
        d.routes[i].rbase = base
        d.routes[i].rkey = key
        d.routes[i].direct = direct
    return d


def _paged_rows(
    mr: MemoryRegion,
    sp: np.ndarray,
    dp: np.ndarray,
    ps: int,
    ss: int,
    ds: int,
    so: int,
    do: int,
    path: tuple[tuple[int, int, int, int], ...],
    hop: np.ndarray,
) -> np.ndarray:
    """aio_op_desc rows of paged-write pages (vectorized), page i over ``path[hop[i]]``."""
    t = np.zeros(len(sp), _OP_DTYPE)
    hops = np.array(path, dtype=np.uint64)
    t["mr"] = mr._ptr
    t["offset"] = so + sp.astype(np.uint64) * np.uint64(ss)
    t["length"] = ps
    t["rail"] = hops[hop, 0].astype(np.int32)
    t["peer"] = hops[hop, 1]
    t["raddr"] = hops[hop, 2] + np.uint64(do) + dp.astype(np.uint64) * np.uint64(ds)
    t["rkey"] = hops[hop, 3]
    t["op"] = lib.AIO_OP_WRITE
    return t


def _page_indices(v: Any, name: str) -> np.ndarray:
    """A 1-D int64 array of non-negative page indices, or InvalidArgument."""
    try:
        a = np.asarray(v)
    except Exception:
        raise InvalidArgument(f"{name} must be a sequence of integers") from None
    if a.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, not of shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, not {a.dtype}")
    if a.dtype.kind == "i" and int(a.min()) < 0:
        raise InvalidArgument(f"{name}[{int(np.argmin(a))}] = {int(a.min())} is negative")
    if int(a.max()) >= 1 << 62:
        raise InvalidArgument(f"{name} holds an index too large for any region")
    return np.ascontiguousarray(a, dtype=np.int64)


class Collective(Transfers):
    """Paged writes, scatter, barrier and batches."""

    async def write_paged(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        page_size: int,
        src_pages: Any,
        dst_pages: Any,
        src_stride: int | None = None,
        dst_stride: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> None:
        """Paged write: page ``k`` copies ``page_size`` bytes from
        ``mr[src_offset + src_stride*src_pages[k]]`` to the peer's region at
        ``dst_offset + dst_stride*dst_pages[k]`` (strides default to ``page_size``).

        ``src_pages``/``dst_pages``: integer sequences or arrays of the same length (indices
        may repeat and come in any order; the order in which pages land is not defined).
        Every page is checked against both regions before anything is posted; the loop that
        posts the pages runs in C, so the Python cost of a call does not grow with the number
        of pages (numpy checks the index arrays). Pages are spread over the NICs that reach
        the peer, round robin; pages whose destinations are adjacent (``dst_stride ==
        page_size``) go as one request gathering up to the NIC's iov limit of sources (4 on
        tcp and shm), after sorting the pages of the call by destination; to a region reached
        by same-host direct copies (:attr:`Route.direct`), such pages whose sources are evenly
        spaced and ascending (the rows of a column slice) go as one strided copy of up to 4096
        pages, with no staging. With ``imm``, the peer's ``imm_counter(imm)`` gains one credit
        per page, however many NICs carried them.

        Returns when every page's source bytes may be reused. Raises :class:`InvalidArgument`
        (lists of different lengths, negative or non-integer indices, a page past either
        region, ``page_size`` < 1), and as :meth:`write` otherwise (a failure reports the first
        error once every posted page finished).

        GPU memory on either side: the pages are gathered on the GPU into the shadow (one
        kernel) and staged, or, for a GPU peer on this host, copied by one kernel over CUDA IPC;
        the credit (one per page) comes once the pages are in the peer's GPU memory.
        ``stream``: as :meth:`write`."""
        mr, rdesc, sp, dp, geometry, imm = self._paged_args(
            mr, remote, page_size, src_pages, dst_pages, src_stride, dst_stride, src_offset, dst_offset, imm
        )
        if len(sp) == 0:
            await anyio.lowlevel.checkpoint()
            return
        page_size, src_stride, dst_stride, src_offset, dst_offset = geometry
        if stream is not None or mr._dev is not None or rdesc.device_kind == DEVICE_CUDA:

            async def host_write(hi: int | None) -> None:
                await self._write_paged_host(mr, rdesc, sp, dp, geometry, hi, timeout, retry)

            await self._gpu_support().write_paged(
                mr,
                rdesc,
                page_size,
                src_offset + sp * src_stride,
                dst_offset + dp * dst_stride,
                imm,
                timeout,
                retry,
                stream,
                host_write,
            )
            return
        await self._write_paged_host(mr, rdesc, sp, dp, geometry, imm, timeout, retry)

    def _paged_args(
        self, mr: MemoryRegion, remote: MemoryDescriptor | bytes, page_size: int, src_pages: Any,
        dst_pages: Any, src_stride: int | None, dst_stride: int | None, src_offset: int, dst_offset: int,
        imm: int | None,
    ) -> tuple[MemoryRegion, MemoryDescriptor, Any, Any, tuple[int, int, int, int, int], int | None]:
        """Checks a paged write's arguments against both regions (nothing is posted): (region,
        remote descriptor, source and destination page indices, geometry ``(page_size,
        src_stride, dst_stride, src_offset, dst_offset)``, immediate). InvalidArgument as
        :meth:`write_paged` says."""
        self._check_open()
        rdesc = self._remote(remote)
        mr = self._region(mr)
        page_size = as_index(page_size, "page_size", lo=1)
        src_stride = page_size if src_stride is None else as_index(src_stride, "src_stride")
        dst_stride = page_size if dst_stride is None else as_index(dst_stride, "dst_stride")
        src_offset = as_index(src_offset, "src_offset")
        dst_offset = as_index(dst_offset, "dst_offset")
        sp = _page_indices(src_pages, "src_pages")
        dp = _page_indices(dst_pages, "dst_pages")
        if len(sp) != len(dp):
            raise InvalidArgument(f"src_pages has {len(sp)} entries and dst_pages {len(dp)}; they must match")
        if imm is not None:
            imm = as_index(imm, "imm", hi=_U32)
        if not rdesc.remote_write:
            raise InvalidArgument("the remote region was registered without remote_write")
        for idx, stride, off, size, name in (
            (sp, src_stride, src_offset, mr.nbytes, "source"),
            (dp, dst_stride, dst_offset, rdesc.length, "destination"),
        ):
            if len(idx) == 0:
                break
            top = int(idx.max())
            if off + stride * top + page_size > size:
                k = int(np.argmax(idx))
                raise InvalidArgument(
                    f"page {k} ({name} index {top}) ends at {off + stride * top + page_size} B, past the "
                    f"{name} region ({size} B)"
                )
        return mr, rdesc, sp, dp, (page_size, src_stride, dst_stride, src_offset, dst_offset), imm

    async def _write_paged_host(
        self,
        mr: MemoryRegion,
        rdesc: MemoryDescriptor,
        sp: np.ndarray,
        dp: np.ndarray,
        geometry: tuple[int, int, int, int, int],
        imm: int | None,
        timeout: float | None,
        retry: RetryPolicy | None,
    ) -> None:
        """A checked paged write between NIC-registered memories."""
        page_size, src_stride, dst_stride, src_offset, dst_offset = geometry
        n = len(sp)
        data = 0 if imm is None else imm
        flags = 0 if imm is None else lib.AIO_F_DATA
        # pages whose destinations follow each other go as one request gathering their
        # sources: order them by destination first (the order pages land in is not defined)
        gather = dst_stride == page_size and n > 1
        if gather and not bool((dp[1:] >= dp[:-1]).all()):
            order = np.argsort(dp, kind="stable")
            sp, dp = sp[order], dp[order]
        full = self._path(rdesc)
        path = self._router.live(full)
        dcode, dkey = self._direct(rdesc) if rdesc.direct is not None and mr._dev is None else _NO_DIRECT
        dhop = _direct_hop(full, dkey, self._shm_rails) if dcode else None
        if dhop is not None:  # direct copies: one stream, the immediate with the pages (see _rows)
            full = path = (dhop,)
        if len(path) > 1:  # until every connection is open, pages go only over the open ones
            path = self._open_routes(path, lib.AIO_OP_WRITE)
        credits: _Credits = {}
        if flags and len(full) > 1:  # counting rule: the credit follows the data (see _rows)
            credits[(full, data, self._owner_of(full, rdesc))] = n
            data = flags = 0
        first = self._router.start(full) % len(path)
        direct = dcode if dhop is not None else 0
        d = _paged_desc(mr, rdesc, sp, dp, geometry, data, flags, gather, path, first, direct)
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            return int(lib.aio_post_paged(h, g, d, posted, n, budget))

        what = f"write_paged of {n} pages"
        end = _end(timeout)
        rails = {h[0] for h in path}

        async def attempt(t: float | None) -> None:
            await self._paged_attempt(
                post,
                n,
                (mr, sp, dp, d),
                t,
                end,
                what,
                full,
                rails,
                credits,
                mr,
                sp,
                dp,
                (page_size, src_stride, dst_stride, src_offset, dst_offset, first),
            )

        await self._attempts(attempt, timeout, retry, what)

    async def _paged_attempt(
        self,
        post: Callable[[Any, int, int], int],
        n: int,
        refs: Any,
        timeout: float | None,
        end: float | None,
        what: str,
        full: Any,
        rails: set[int],
        credits: _Credits,
        mr: MemoryRegion,
        sp: np.ndarray,
        dp: np.ndarray,
        geometry: tuple[int, int, int, int, int, int],
    ) -> None:
        """One attempt of a paged write: the pages as one group, moved to the NICs still up
        when one loses its link, then the deferred credit."""
        page_size, src_stride, dst_stride, src_offset, dst_offset, first = geometry

        async def data() -> None:
            on = rails if len(full) > 1 else None
            if not await self._run_group(post, n, refs, timeout, what, on, full):
                return
            # a NIC lost its link: the pages went as one group over every NIC, so all of them
            # are written again over the NICs still up (the same bytes; the credit follows)
            live = self._router.live(full)
            rows = _paged_rows(
                mr,
                sp,
                dp,
                page_size,
                src_stride,
                dst_stride,
                src_offset,
                dst_offset,
                live,
                (first + np.arange(n)) % len(live),
            )
            self._failovers += n
            if self._obs is not None:
                d = refs[3]  # the pages' routes: page k went over route (first + k) % nroutes
                hops = np.array([d.routes[i].rail for i in range(d.nroutes)], np.int64)
                self._obs._failover(_moves(hops[(first + np.arange(n)) % len(hops)], rows["rail"]))
            await self._run(rows, refs, _left(end), what, full)

        await self._then_credit(data(), credits, end, what, n)

    async def scatter(
        self,
        mr: MemoryRegion,
        targets: Sequence[ScatterTarget],
        *,
        imm: int | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Writes a slice of ``mr`` to each target (:class:`ScatterTarget`: descriptor, length,
        offsets), all posted by one native call and awaited as one. Targets on different
        peers are spread over the NICs; with ``imm`` each target's owner gains one credit per
        target. Every target is validated before anything is posted. Raises as :meth:`write`."""
        if imm is not None:
            as_index(imm, "imm", hi=_U32)  # checked even when there is no target
        rows: list[tuple[int, ...]] = []
        credits: _Credits = {}
        for i, t in enumerate(targets):
            if not isinstance(t, ScatterTarget):
                raise InvalidArgument(f"targets[{i}] must be an aiote.ScatterTarget, not {type(t).__name__}")
            n = len(rows)  # requests ahead of this one in the call
            rows += self._rows(
                mr, t.desc, t.length, t.src_offset, t.dst_offset, imm, lib.AIO_OP_WRITE, credits, load=n,
                alone=False,
            )[0]
        if not rows:
            await anyio.lowlevel.checkpoint()
            return
        what = f"scatter to {len(targets)} targets"
        end = _end(timeout)
        table = self._table(rows)

        async def attempt(t: float | None) -> None:
            await self._then_credit(self._run(table, mr, t, what), credits, end, what, len(table))

        await self._attempts(attempt, timeout, retry, what)

    async def barrier(
        self,
        peers: Sequence[MemoryDescriptor | bytes],
        *,
        imm: int,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Sends a zero-byte write carrying ``imm`` to the owner of each descriptor in
        ``peers`` (one credit per descriptor given), posted as one group; returns when every
        one has completed. Peers' resolved addresses are cached, so repeated barriers over
        the same set cost one work request per peer. Raises as :meth:`write`."""
        assert self._scratch is not None
        as_index(imm, "imm", hi=_U32)  # checked even when there is no peer
        rows: list[tuple[int, ...]] = []
        for d in peers:
            rows += self._rows(self._scratch, d, 0, 0, 0, imm, lib.AIO_OP_WRITE, alone=False)[0]
        if not rows:
            await anyio.lowlevel.checkpoint()
            return
        table = self._table(rows)
        what = f"barrier of {len(rows)} peers"
        await self._attempts(lambda t: self._run(table, None, t, what), timeout, retry, what)

    def batch(self) -> TransferBatch:
        """A batch of writes/reads validated as they are added and posted by one native call
        on :meth:`TransferBatch.submit`, awaited as one. Costs one small empty table, no native
        call; raises nothing (a closed engine is reported when requests are added)."""
        return TransferBatch(self)
