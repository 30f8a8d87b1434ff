"""The GPU path of a call (``xp=cupy``): the send layout and the packing as one kernel each
on the caller's stream, the receive layout from the count matrix, the unpack and the
combine packing as one kernel each (the kernels: :mod:`._gpu`, imported only on the GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import InvalidArgument, Transfer
from ._credits import Credits
from ._handles import DispatchHandle, DispatchPending
from ._layout import round_up
from ._trace import mark
from ._util import DISPATCH, ROUTE, imm_of

__all__ = ["GpuFlow", "GpuPlan"]

_acc, _sum, _max = np.add.accumulate, np.add.reduce, np.maximum.reduce


def _before(a: np.ndarray, axis: int = 0) -> np.ndarray:
    """Exclusive prefix sums of ``a`` along ``axis``."""
    out: np.ndarray = _acc(a, axis=axis) - a
    return out


class GpuFlow(Credits):
    """The GPU halves of dispatch and combine (the CPU ones: :mod:`._dispatch`, :mod:`._combine`)."""

    async def _send_gpu(
        self, seq: int, m: int, idx_dev: Any, srcs: list[Any], end: float | None, what: str,
    ) -> tuple[GpuPlan, Any, list[Transfer]]:
        """The send half on the GPU: the layout (rows per expert, each slot's send row) and the
        packing are one kernel each on the caller's stream; only the route row (``4E`` bytes,
        and the input checks) comes to the host, through pinned memory, polled without
        blocking the loop; then the count exchange and one write per peer, as on the CPU.
        Returns the call's receive plan, each (token, slot)'s row ``pos[m, K]``, its writes."""
        xp, p, k, e = self.xp, seq & 1, self.experts_per_token, self.num_experts
        await self._settle(self._inflight[p], end, what, quiet=True)
        await self._wait_fence(p, end, what)
        mark("d.settle_old")
        stream = xp.cuda.get_current_stream()
        idx = idx_dev if m == idx_dev.shape[0] else idx_dev[:m]
        if idx.dtype != xp.int64 or not idx.flags.c_contiguous:
            idx = xp.ascontiguousarray(idx, dtype=xp.int64)
        n_slots = m * k
        counts, eoff, pos, row_token = self._gbufs[p][:4]
        kern, sp = self._kern, stream.ptr
        kern.layout(idx, k, e, counts, eoff, pos, row_token, sp)
        host = self._hcount[p]
        xp.cuda.runtime.memcpyAsync(host.ctypes.data, counts.data.ptr, counts.nbytes, 2, sp)
        ev = self._event("counts", p)
        ev.record(stream)
        if n_slots:
            x0 = srcs[0].data.ptr
            sc = srcs[1].data.ptr if len(srcs) > 1 else x0
            sw = 4 * self._nscale
            kern.pack(
                n_slots, 128, sp, x0, self._xrow, sc, sw, self._xrow, self._fields[1][0], sw,
                row_token.data.ptr, eoff.data.ptr, e, self._gptr[p][0], self._dstride, self._toff,
            )
        mark("d.layout")
        await self._until(ev, end, what)
        mark("d.counts")
        route = host[:e].copy()
        bad = int(host[e])
        if bad:
            dup = "an expert appears twice in one token's indices"
            raise InvalidArgument(f"indices must be in [-1, {e})" if bad & 1 else dup)
        n_me = self.geometry.rank_sums(route[None, :])[0]  # rows to each rank
        sstart = _before(n_me)
        posted: list[Transfer] = []
        mark("d.route_host")
        self._post_route(seq, route, posted)
        mark("d.post_route")
        await self._wait_credits(ROUTE, seq, end, what, posted)
        mark("d.wait_route")
        c = self._route[p].copy()
        self._release_old(seq)
        mark("d.release")
        plan = self._plan_gpu(c)
        mark("d.plan")
        self._post_data(seq, n_me, sstart, (p * self.max_recv_tokens + plan.dst_row).tolist(), posted)
        mark("d.post_rows")
        pm, pv = self._pos_v[p]
        if pm != m:  # (the view of the last token count of each parity is kept)
            pv = pos[:n_slots].reshape(m, k)
            self._pos_v[p] = (m, pv)
        return plan, pv, posted

    def _post_data(
        self, seq: int, n_me: np.ndarray, sstart: np.ndarray, at: list[int], posted: list[Transfer]
    ) -> None:
        """One write per peer of its block of the send region ``seq % 2`` (the immediate alone
        when empty), to row ``at[d]`` of its dispatch region."""
        p, st, me = seq & 1, self._dstride, self.rank
        imm = imm_of(self.imm_tag, DISPATCH, seq, me)
        stream = self._stream()
        base = p * self._send_cap
        for d, peer in enumerate(self._peers):
            if d == me:
                continue
            n = int(n_me[d])
            if n:
                t = self.engine.post_write(
                    self._dsend_mr, peer["drecv"], length=n * st, src_offset=(base + int(sstart[d])) * st,
                    dst_offset=int(at[d]) * st, imm=imm, stream=stream,
                )
            else:
                t = self.engine.post_write_imm(peer["drecv"], imm, stream=stream)
            posted.append(t)
            self._inflight[p].append(t)


    def _plan_gpu(self, c: np.ndarray) -> GpuPlan:
        """The receive layout from the count matrix ``c[W, E]``: small arrays only (O(W E));
        the rows are placed by the unpack kernel. Raises InvalidArgument past the capacity
        (every rank holds the same matrix, so every rank raises it, before any token moves).
        On every call's path: ufunc methods (``np.add.accumulate`` costs a third of
        ``np.cumsum``), the unpack table filled in place."""
        geo, me, w = self.geometry, self.rank, self.world
        n = geo.rank_sums(c)  # [W src, W dst]
        into = _sum(n, 0)
        worst = int(_max(into))
        if worst > self.max_recv_tokens:
            raise InvalidArgument(
                f"rank {int(into.argmax())} would receive {worst} rows, past "
                f"max_recv_tokens={self.max_recv_tokens}"
            )
        first, last = geo.local_range(me)
        cd = c[:, first:last].astype(np.int64)  # [W, L]
        ll = last - first
        counts = _sum(cd, 0)
        # the unpack kernel's table: offsets[L + 1], counts[L], cum[L, W + 1], start[W, L]
        tab = np.empty(2 * ll + 1 + ll * (w + 1) + w * ll, dtype=np.int64)
        offsets = tab[: ll + 1]
        offsets[0] = 0
        _acc(round_up(counts, self.expert_padding), out=offsets[1:])
        tab[ll + 1 : 2 * ll + 1] = counts
        cum = tab[2 * ll + 1 : 2 * ll + 1 + ll * (w + 1)].reshape(ll, w + 1)
        cum[:, 0] = 0
        _acc(cd.T, axis=1, out=cum[:, 1:])  # rows of lower sources, per local expert
        within = _before(cd, 1)  # rows of lower experts in source r's block
        rstart = _before(n[:, me])  # source r's block in this rank's regions
        start = tab[2 * ll + 1 + ll * (w + 1) :].reshape(w, ll)
        np.add(rstart[:, None], within, out=start)
        start[me] = _before(n[me])[me] + within[me]  # this rank's own send rows
        return GpuPlan(n=n, rstart=rstart, counts=counts.astype(np.int32), offsets=offsets, tab=tab,
                       dst_row=_before(n)[me])

    async def _recv_gpu(self, pending: DispatchPending, end: float | None) -> DispatchHandle:
        seq, xp = pending.seq, self.xp
        what = f"dispatch {seq}"
        out = self._unpack_prep(pending)  # while the peers' rows are on their way
        mark("dr.prep")
        await self._wait_credits(DISPATCH, seq, end, what, pending._posted)
        mark("dr.wait_rows")
        await self._settle(pending._posted, end, what)
        mark("dr.own_writes")
        h = self._unpack_gpu(pending, out)
        mark("dr.unpack", xp)
        return h

    def _unpack_prep(self, pending: DispatchPending) -> tuple[Any, Any, Any, Any]:
        """The unpack's outputs and its table (copied to the GPU on the stream), made before
        the rows arrive: (expert_x, scales, src_rank, src_token). Not zeroed here: the unpack
        kernel writes every row (zeros in padding rows, except in a caller's ``out_x``)."""
        xp, plan, p = self.xp, pending._plan, pending.seq & 1
        rows = int(plan.offsets[-1])
        if pending._out_x is None:
            ex = xp.empty((rows, self.hidden), dtype=self.in_dtype.storage)
        else:
            ex = pending._out_x[:rows]
        scale = None if self.scale_block is None else xp.empty((rows, self._nscale), xp.float32)
        src = xp.empty((2, rows), dtype=xp.int32)
        src_rank, src_token = src[0], src[1]
        if rows:
            tab = plan.tab
            hbuf = self._htab[p][: tab.size]
            hbuf[...] = tab
            dtab, stream = self._gbufs[p][4], xp.cuda.get_current_stream()
            xp.cuda.runtime.memcpyAsync(dtab.data.ptr, hbuf.ctypes.data, tab.nbytes, 1, stream.ptr)
        return ex, scale, src_rank, src_token

    def _unpack_gpu(self, pending: DispatchPending, out: tuple[Any, Any, Any, Any]) -> DispatchHandle:
        """One kernel over the output rows: each takes its row from the dispatch region (a
        peer's token) or from the send region (one of this rank's own), in canonical order."""
        xp, plan, seq, me = self.xp, pending._plan, pending.seq, self.rank
        p = seq & 1
        rows = int(plan.offsets[-1])
        ex, scale, src_rank, src_token = out
        back = self._gbufs[p][5][:rows]
        if rows:
            dsend, drecv, tab = self._gptr[p]
            exp = ex.data.ptr
            sw = 4 * self._nscale
            self._kern.unpack(
                rows, 128, xp.cuda.get_current_stream().ptr, tab, len(plan.counts), self.world, me,
                drecv, dsend, self._dstride, self._xrow, self._fields[1][0], sw, self._toff, exp,
                self._xrow, exp if scale is None else scale.data.ptr, sw, src_rank.data.ptr,
                src_token.data.ptr, back.data.ptr, pending._out_x is None,
            )
        self._record_fence(p)
        h = DispatchHandle(
            seq=seq, expert_x=ex, expert_x_scale=scale, counts=plan.counts, offsets=plan.offsets,
            src_rank=src_rank, src_token=src_token, num_tokens=pending._m, _a2a=self, _plan=plan,
            _dest=back, _pos=pending._pos, _weights=pending._weights,
        )
        self._pending.pop(seq, None)
        self._handles[seq] = h
        return h

    def _pack_back_gpu(self, h: DispatchHandle, y: Any) -> None:
        """One kernel over the output rows of ``y`` (C-contiguous expert outputs): the peers'
        rows into the send region at the rows they came in at, this rank's own rows straight
        into its combine region."""
        rows = int(h.offsets[-1])
        if rows:
            self._kern.back(
                rows, 128, self.xp.cuda.get_current_stream().ptr, h.src_rank.data.ptr, h._dest.data.ptr,
                self.rank, y.data.ptr, self._yrow, self._yrow, self._csend_ptr,
                self._crecv_v[h.seq & 1].data.ptr, self._cstride,
            )


@dataclass
class GpuPlan:
    """The receive layout of a GPU call (see :meth:`AllToAll._plan_gpu`): ``n[r, d]`` rows
    from r to d, ``rstart[r]`` where source r's rows start in this rank's regions, ``counts``
    and ``offsets`` of the local experts, ``tab`` (the unpack kernel's table), ``dst_row[d]``
    (where this rank's block lands at d)."""

    n: np.ndarray
    rstart: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray
    tab: np.ndarray
    dst_row: np.ndarray
