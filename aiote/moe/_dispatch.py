"""The dispatch half of an all-to-all: checking the input, the send layout, packing and
posting this rank's tokens (steps 1 and 2 of :mod:`._a2a`), and receiving and unpacking the
peers' tokens into per-expert blocks (the CPU path; the GPU one: :mod:`._gpuflow`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import InvalidArgument, Transfer

# the observability hook is internal: a flow call measured as one (aiote/_core/_observe.py)
from .._core._observe import observed_call
from ._gpuflow import GpuFlow
from ._handles import DispatchHandle, DispatchPending
from ._layout import RecvPlan, SendPlan, plan_recv, plan_send
from ._trace import mark
from ._util import DISPATCH, ROUTE, imm_of, left

__all__ = ["Dispatch"]


class Dispatch(GpuFlow):
    """:meth:`dispatch`, :meth:`dispatch_send` and the receive half of :class:`DispatchPending`."""

    @observed_call("moe", "dispatch", lambda self: self.engine)
    async def dispatch(
        self, x: Any, indices: Any, weights: Any, *, x_scale: Any = None, bound_m: int | None = None,
        out_x: Any = None, timeout: float | None = None,
    ) -> DispatchHandle:
        """Sends each token to the ranks of its experts and returns this rank's share:
        :meth:`dispatch_send` then :meth:`DispatchPending.recv`, under one deadline.

        ``x[T, H]`` (``in_dtype``'s storage type, ``T <= max_tokens``), ``indices[T, K]``
        (integers, -1 = skip, distinct per token), ``weights[T, K]`` (float32, kept for
        combine), ``bound_m`` (tokens used, the first ones; default ``T``), ``out_x`` (where the
        expert rows go: ``[>= max_expert_rows, H]``, C-contiguous, ``in_dtype``'s storage type,
        e.g. one buffer reused every step; its padding rows are then left as they were; default:
        a new zeroed array per call); arrays of the group's ``xp``. Raises
        :class:`~aiote.InvalidArgument` for bad input before anything is posted, otherwise as the
        two halves. Costs the count exchange (W-1 writes of ``4E`` bytes and one
        counter wait), a pack, one write per peer, a counter wait and an unpack."""
        end = self._end(timeout)
        pending = await self.dispatch_send(x, indices, weights, x_scale=x_scale, bound_m=bound_m,
                                           out_x=out_x, timeout=left(end))
        return await pending.recv(timeout=left(end))

    @observed_call("moe", "dispatch_send", lambda self: self.engine)
    async def dispatch_send(
        self, x: Any, indices: Any, weights: Any, *, x_scale: Any = None, bound_m: int | None = None,
        out_x: Any = None, timeout: float | None = None,
    ) -> DispatchPending:
        """The send half of :meth:`dispatch`: exchanges the counts, packs and posts this rank's
        tokens; returns a :class:`DispatchPending` whose ``recv`` completes the call.

        Raises :class:`~aiote.InvalidArgument` for bad input, a closed group, or while this
        rank still reads call ``s - 2`` (its unpack or combine running), before anything is
        posted; :class:`~aiote.TransferTimeout` after ``timeout``; :class:`~aiote.PeerUnreachable`
        for a dead peer; what the writes raise. Costs as :meth:`dispatch` up to the posts."""
        mark("d.start")
        seq = self._seq
        self._seq += 1  # every call is a step of the group, whatever happens below
        self._unreleased.add(seq)
        m, idx_dev, w = self._check_dispatch(x, indices, weights, bound_m)
        srcs = self._sources(x, x_scale)
        self._check_out_x(out_x)
        self._retire(seq)
        end = self._end(timeout)
        what = f"dispatch {seq}"
        p = seq & 1
        mark("d.check")
        if self._gpu:
            gplan, gpos, gposted = await self._send_gpu(seq, m, idx_dev, srcs, end, what)
            pending = DispatchPending(self, seq, gplan, gpos, w, gposted, m, out_x)
            self._pending[seq] = pending
            return pending
        idx = await self._host(idx_dev, end, what)
        mark("d.idx_to_host")
        send = plan_send(idx, m, self.num_experts)
        mark("d.plan_send")
        await self._settle(self._inflight[p], end, what, quiet=True)
        await self._wait_fence(p, end, what)
        mark("d.settle_old")
        posted: list[Transfer] = []
        self._post_route(seq, send.route, posted)
        mark("d.post_route")
        await self._wait_credits(ROUTE, seq, end, what, posted)
        mark("d.wait_route")
        counts = self._route[p].copy()
        self._release_old(seq)
        plan = plan_recv(counts, self.geometry, self.rank, self.expert_padding, self.max_recv_tokens)
        mark("d.plan_recv")
        await self._settle(self._dsend_busy, end, what, quiet=True)
        self._pack(srcs, send, plan)
        mark("d.pack", self.xp)
        data = self._post_rows(seq, plan, posted)
        mark("d.post_rows")
        self._dsend_busy = data
        pending = DispatchPending(self, seq, plan, send.pos, w, posted, m, out_x)
        self._unpack_local(pending, srcs, send)
        mark("d.unpack_local", self.xp)
        self._pending[seq] = pending
        return pending

    def _check_dispatch(
        self, x: Any, indices: Any, weights: Any, bound_m: int | None
    ) -> tuple[int, Any, Any]:
        """Validates a dispatch's input; the tokens used, the indices, the weights (float32)."""
        if self._closed:
            raise InvalidArgument("the all-to-all is closed")
        xp = self.xp
        for name, a in (("x", x), ("indices", indices), ("weights", weights)):
            if not isinstance(a, xp.ndarray):
                raise InvalidArgument(f"{name} must be a {xp.__name__} array, not {type(a).__name__}")
        if x.ndim != 2 or x.shape[1] != self.hidden or x.dtype != self.in_dtype.storage:
            raise InvalidArgument(
                f"x must be [T, {self.hidden}] of {self.in_dtype.storage} ({self.in_dtype.name}), "
                f"not {list(x.shape)} of {x.dtype}"
            )
        t = x.shape[0]
        if t > self.max_tokens:
            raise InvalidArgument(f"x has {t} tokens, more than max_tokens={self.max_tokens}")
        k = self.experts_per_token
        if indices.shape != (t, k) or indices.dtype.kind not in "iu":
            raise InvalidArgument(
                f"indices must be [{t}, {k}] integers, not {list(indices.shape)} {indices.dtype}"
            )
        if weights.shape != (t, k) or weights.dtype != np.float32:
            raise InvalidArgument(
                f"weights must be [{t}, {k}] float32, not {list(weights.shape)} {weights.dtype}"
            )
        m = t if bound_m is None else bound_m
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 0 <= m <= t:
            raise InvalidArgument(f"bound_m must be an int in [0, {t}], not {bound_m!r}")
        if self._receiving is not None and self._receiving <= self._seq - 3:
            raise InvalidArgument("dispatch of two calls back is still being received")
        old = self._handles.get(self._seq - 3)
        if old is not None and old._state == "combining":
            raise InvalidArgument(f"combine {old.seq} is still in flight: at most two calls in flight")
        w = weights if m == t else weights[: int(m)]
        return int(m), indices, w if w.flags.c_contiguous else xp.ascontiguousarray(w)

    def _retire(self, seq: int) -> None:
        """Makes call ``seq - 2``'s handle and pending dispatch stale (they share parity): each
        object is marked itself, so it stays stale however long it is kept."""
        for old in [s for s in self._handles if s <= seq - 2]:
            self._handles.pop(old)._state = "stale"
        for old in [s for s in self._pending if s <= seq - 2]:
            self._pending.pop(old)._done = True  # its recv raises: "received already or is stale"

    def _check_out_x(self, out_x: Any) -> None:
        xp = self.xp
        if out_x is not None and (
            not isinstance(out_x, xp.ndarray) or out_x.ndim != 2 or out_x.shape[0] < self.max_expert_rows
            or out_x.shape[1] != self.hidden or out_x.dtype != self.in_dtype.storage
            or not out_x.flags.c_contiguous
        ):
            raise InvalidArgument(
                f"out_x must be a C-contiguous [>= {self.max_expert_rows}, {self.hidden}] {xp.__name__} "
                f"array of {self.in_dtype.storage}"
            )

    def _sources(self, x: Any, x_scale: Any) -> list[Any]:
        """The bytes of each field of a token's row: ``[T, bytes]`` views of x (and x_scale);
        on the GPU the C-contiguous arrays themselves (the kernels take their pointers)."""
        xp, t = self.xp, x.shape[0]
        if self.scale_block is None:
            if x_scale is not None:
                raise InvalidArgument("x_scale given, but the all-to-all was created without scale_block")
            srcs = [xp.ascontiguousarray(x)]
        else:
            if (not isinstance(x_scale, xp.ndarray) or x_scale.shape != (t, self._nscale)
                    or x_scale.dtype != np.float32):
                raise InvalidArgument(f"x_scale must be a [{t}, {self._nscale}] float32 {xp.__name__} array")
            srcs = [xp.ascontiguousarray(x), xp.ascontiguousarray(x_scale)]
        if self._gpu:
            return srcs
        widths = (self._xrow, 4 * self._nscale)
        return [a.view(xp.uint8).reshape(t, w) for a, w in zip(srcs, widths, strict=False)]

    def _pack(self, srcs: list[Any], send: SendPlan, plan: RecvPlan) -> None:
        """Send rows for the other ranks in (expert, token) order: each field, then the token
        number; this rank's own block is left out (unpacked straight from the sources)."""
        xp = self.xp
        ss, ns = int(plan.sstart[self.rank]), int(plan.n[self.rank, self.rank])
        tokens = self._dev(send.row_token)
        tail = self._toff
        for lo, hi in ((0, ss), (ss + ns, len(send.row_token))):
            if hi > lo:
                tok = tokens[lo:hi]
                for src, (off, width) in zip(srcs, self._fields, strict=False):
                    self._dsend[lo:hi, off : off + width] = src[tok]
                self._dsend[lo:hi, tail : tail + 4] = tok.astype(xp.int32).view(xp.uint8).reshape(hi - lo, 4)

    def _post_rows(self, seq: int, plan: RecvPlan, posted: list[Transfer]) -> list[Transfer]:
        """One write per peer of its block (zero bytes when empty), plus the local block."""
        p, st = seq & 1, self._dstride
        me = self.rank
        imm = imm_of(self.imm_tag, DISPATCH, seq, self.rank)
        stream = self._stream()
        data: list[Transfer] = []
        for d, peer in enumerate(self._peers):
            n = int(plan.n[me, d])
            if d == me:
                continue  # the local block is unpacked from x directly
            src = int(plan.sstart[d]) * st if n else 0
            dst = (p * self.max_recv_tokens + int(plan.dst_row[d])) * st if n else 0  # CPU: p == seq % 2
            if n:
                t = self.engine.post_write(
                    self._dsend_mr, peer["drecv"], length=n * st, src_offset=src, dst_offset=dst, imm=imm,
                    stream=stream,
                )
            else:  # nothing for this peer: the immediate alone, so that it expects one from each
                t = self.engine.post_write_imm(peer["drecv"], imm, stream=stream)
            data.append(t)
            self._inflight[p].append(t)
        posted.extend(data)
        return data

    def _unpack_local(self, pending: DispatchPending, srcs: list[Any], send: SendPlan) -> None:
        """Allocates the call's outputs and moves this rank's own rows there, straight from
        the sources (at send time: x may change once dispatch_send returned)."""
        xp, plan, me = self.xp, pending._plan, self.rank
        rows = int(plan.offsets[-1])
        if pending._out_x is None:
            pending._ex = xp.zeros((rows, self.hidden), dtype=self.in_dtype.storage)
        else:
            pending._ex = pending._out_x[:rows]
        pending._scale = None if self.scale_block is None else xp.zeros((rows, self._nscale), xp.float32)
        pending._src_token = xp.full(rows, -1, dtype=xp.int32)
        pending._dest = dest = self._dev(plan.dest)
        rs, ns, ss = int(plan.rstart[me]), int(plan.n[me, me]), int(plan.sstart[me])
        if ns:
            tok = self._dev(send.row_token[ss : ss + ns])
            for out, src in zip(self._outputs(pending), srcs, strict=True):
                out[dest[rs : rs + ns]] = src[tok]
            pending._src_token[dest[rs : rs + ns]] = tok.astype(xp.int32)

    def _outputs(self, pending: DispatchPending) -> list[Any]:
        """``[rows, bytes]`` views of the call's outputs, one per field of a row."""
        xp = self.xp
        rows = pending._ex.shape[0]
        outs = [pending._ex.view(xp.uint8).reshape(rows, self._xrow)]
        if pending._scale is not None:
            outs.append(pending._scale.view(xp.uint8).reshape(rows, 4 * self._nscale))
        return outs

    @observed_call("moe", "dispatch_recv", lambda self: self.engine)
    async def _recv_dispatch(self, pending: DispatchPending, timeout: float | None) -> DispatchHandle:
        """:meth:`DispatchPending.recv`: waits for one DISPATCH credit from each peer, settles
        this rank's own writes, unpacks (steps 2 of :mod:`._a2a`)."""
        if pending._done:
            raise InvalidArgument(f"dispatch {pending.seq} was received already or is stale")
        pending._done = True
        end = self._end(timeout)
        self._receiving = pending.seq
        try:
            mark("dr.start")
            if self._gpu:
                return await self._recv_gpu(pending, end)
            await self._wait_credits(DISPATCH, pending.seq, end, f"dispatch {pending.seq}", pending._posted)
            mark("dr.wait_rows")
            await self._settle(pending._posted, end, f"dispatch {pending.seq}")
            mark("dr.own_writes")
            h = self._unpack(pending)
            mark("dr.unpack", self.xp)
            return h
        finally:
            self._receiving = None

    def _unpack(self, pending: DispatchPending) -> DispatchHandle:
        """Moves the peers' rows from the receive region into their expert blocks."""
        xp, plan, p, me = self.xp, pending._plan, pending.seq & 1, self.rank
        ex, src_token, dest = pending._ex, pending._src_token, pending._dest
        outs = self._outputs(pending)
        rs, ns = int(plan.rstart[me]), int(plan.n[me, me])
        tail = self._toff
        for lo, hi in ((0, rs), (rs + ns, plan.nrecv)):
            if hi > lo:
                got = self._drecv[p, lo:hi]
                for out, (off, width) in zip(outs, self._fields, strict=False):
                    out[dest[lo:hi]] = got[:, off : off + width]
                src_token[dest[lo:hi]] = xp.ascontiguousarray(got[:, tail : tail + 4]).view(xp.int32).ravel()
        self._record_fence(p)
        h = DispatchHandle(
            seq=pending.seq, expert_x=ex, expert_x_scale=pending._scale, counts=plan.counts,
            offsets=plan.offsets,
            src_rank=self._dev(plan.src_rank), src_token=src_token, num_tokens=pending._m,
            _a2a=self, _plan=plan, _dest=dest, _pos=pending._pos,
            _weights=pending._weights,
        )
        self._pending.pop(pending.seq, None)
        self._handles[pending.seq] = h
        return h

