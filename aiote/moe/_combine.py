"""The combine half of an all-to-all: packing the expert outputs in received order and
writing each source's rows back to it, then the float32 reduction in top-k slot order
(steps 3 and 4 of :mod:`._a2a`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import InvalidArgument, Transfer
from .._core._observe import observed_call  # internal: see _dispatch.py
from ._dispatch import Dispatch
from ._handles import CombinePending, DispatchHandle
from ._layout import RecvPlan
from ._trace import mark
from ._util import COMBINE, imm_of, left, reduce_rows

_sum = np.add.reduce

__all__ = ["Combine"]


class Combine(Dispatch):
    """:meth:`combine`, :meth:`combine_send` and the receive half of :class:`CombinePending`."""

    @observed_call("moe", "combine", lambda self: self.engine)
    async def combine(
        self, handle: DispatchHandle, expert_out: Any, *, out: Any = None, accumulate: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Brings the expert outputs back to the tokens' ranks and reduces them there:
        :meth:`combine_send` then :meth:`CombinePending.recv`, under one deadline.

        ``expert_out[rows, H]`` (``out_dtype``'s storage type; rows as ``handle.expert_x``,
        padding rows ignored). Returns ``[num_tokens, H]`` of ``out_dtype`` (into ``out`` when
        given; with ``accumulate`` added to what ``out`` holds). Raises as the two halves;
        costs a pack, one write per peer, a counter wait and the reduction."""
        if isinstance(handle, DispatchHandle):
            self._check_out(out, accumulate, handle.num_tokens)  # before anything is posted
        end = self._end(timeout)
        pending = await self.combine_send(handle, expert_out, timeout=left(end))
        return await pending.recv(out=out, accumulate=accumulate, timeout=left(end))

    @observed_call("moe", "combine_send", lambda self: self.engine)
    async def combine_send(
        self, handle: DispatchHandle, expert_out: Any, *, timeout: float | None = None
    ) -> CombinePending:
        """The send half of :meth:`combine`: packs this rank's expert outputs in received
        order and writes each source's rows to it. Raises :class:`~aiote.InvalidArgument` for a
        handle of another group, one combined already or stale (two calls back), a bad
        ``expert_out``, before anything is posted; :class:`~aiote.TransferTimeout` after
        ``timeout`` (waiting for this rank's previous combine writes)."""
        if not isinstance(handle, DispatchHandle) or handle._a2a is not self:
            raise InvalidArgument("handle must be a DispatchHandle of this all-to-all")
        if handle._state != "dispatched":
            raise InvalidArgument(
                f"handle {handle.seq} is {handle._state}: combine it once, within two calls"
            )
        xp, rows = self.xp, int(handle.offsets[-1])
        if (not isinstance(expert_out, xp.ndarray) or expert_out.ndim != 2 or expert_out.shape[0] < rows
                or expert_out.shape[1] != self.hidden or expert_out.dtype != self.out_dtype.storage):
            raise InvalidArgument(
                f"expert_out must be a [>= {rows}, {self.hidden}] {xp.__name__} array of "
                f"{self.out_dtype.storage} ({self.out_dtype.name})"
            )
        end = self._end(timeout)
        what = f"combine {handle.seq}"
        handle._state = "combine_sent"
        mark("c.start")
        await self._settle(self._csend_busy, end, what, quiet=True)
        mark("c.settle_old")
        plan = handle._plan
        y = xp.ascontiguousarray(expert_out)
        if self._gpu:
            self._pack_back_gpu(handle, y)
        else:
            self._pack_back(handle, y.view(xp.uint8).reshape(expert_out.shape[0], self._yrow))
        mark("c.pack", xp)
        posted = self._post_back(handle.seq, plan)
        mark("c.post")
        self._csend_busy = list(posted)
        return CombinePending(self, handle, posted)

    def _pack_back(self, h: DispatchHandle, yb: Any) -> None:
        """The peers' rows in received order into the send region; this rank's own rows
        straight into its combine region, where its peers' rows land."""
        plan, me, p = h._plan, self.rank, h.seq & 1
        rs, ns = int(plan.rstart[me]), int(plan.n[me, me])
        for lo, hi in ((0, rs), (rs + ns, plan.nrecv)):
            if hi > lo:
                self._csend[lo:hi, : self._yrow] = yb[h._dest[lo:hi]]
        if ns:
            at = int(plan.sstart[me])
            self._crecv[p, at : at + ns, : self._yrow] = yb[h._dest[rs : rs + ns]]

    def _post_back(self, seq: int, plan: RecvPlan) -> list[Transfer]:
        p, st, me = seq & 1, self._cstride, self.rank
        imm = imm_of(self.imm_tag, COMBINE, seq, self.rank)
        at_source = _sum(plan.n[:, :me], 1)  # where each source put my block: its rows to lower ranks
        mark("c.at")
        stream = self._stream()
        posted: list[Transfer] = []
        for r, peer in enumerate(self._peers):
            if r == me:
                continue
            n, first = int(plan.n[r, me]), int(plan.rstart[r])
            if n:
                t = self.engine.post_write(
                    self._csend_mr, peer["crecv"], length=n * st, src_offset=first * st,
                    dst_offset=(p * self._send_cap + int(at_source[r])) * st, imm=imm, stream=stream,
                )
            else:
                t = self.engine.post_write_imm(peer["crecv"], imm, stream=stream)
            posted.append(t)
            self._inflight[p].append(t)
        return posted

    @observed_call("moe", "combine_recv", lambda self: self.engine)
    async def _recv_combine(
        self, pending: CombinePending, out: Any, accumulate: bool, timeout: float | None
    ) -> Any:
        """:meth:`CombinePending.recv`: waits for one COMBINE credit from each peer, settles this
        rank's own writes, reduces (step 4 of :mod:`._a2a`)."""
        h = pending._h
        if h._state != "combine_sent":
            raise InvalidArgument(f"combine {h.seq} was received already or is stale")
        self._check_out(out, accumulate, h.num_tokens)
        end = self._end(timeout)
        h._state = "combining"
        try:
            mark("cr.start")
            dest = self._reduce_dest(h, out)  # while the peers' rows are on their way
            await self._wait_credits(COMBINE, h.seq, end, f"combine {h.seq}", pending._posted)
            mark("cr.wait_rows")
            await self._settle(pending._posted, end, f"combine {h.seq}")
            mark("cr.own_writes")
            out = self._reduce(h, dest, out, accumulate)
            mark("cr.reduce", self.xp)
            return out
        finally:
            h._state = "combined"

    def _check_out(self, out: Any, accumulate: bool, m: int) -> None:
        if accumulate and out is None:
            raise InvalidArgument("accumulate=True needs out")
        if out is not None and (
            not isinstance(out, self.xp.ndarray) or out.ndim != 2 or out.shape[0] < m
            or out.shape[1] != self.hidden or out.dtype != self.out_dtype.storage
            or not out.flags.c_contiguous
        ):
            raise InvalidArgument(
                f"out must be a C-contiguous [>= {m}, {self.hidden}] array of {self.out_dtype.storage}"
            )

    def _reduce_dest(self, h: DispatchHandle, out: Any) -> Any:
        """Where the reduction goes: ``out``'s first rows, or a new array."""
        m, dt = h.num_tokens, self.out_dtype
        return self.xp.empty((m, self.hidden), dtype=dt.storage) if out is None else out[:m]

    def _reduce(self, h: DispatchHandle, dest: Any, out: Any, accumulate: bool) -> Any:
        """The reduction of :func:`._util.reduce_rows` over this call's combine region."""
        xp, p, m, dt = self.xp, h.seq & 1, h.num_tokens, self.out_dtype
        if self._crows_v is not None:
            rows = self._crows_v[p]  # (made once: a view costs microseconds of Python)
        else:
            rows = xp.ascontiguousarray(self._crecv[p][:, : self._yrow]).view(dt.storage)
        reduce_rows(rows, h._pos, h._weights, dt, xp, dest, prev=out[:m] if accumulate else None)
        self._record_fence(p)
        return dest
