"""The all-to-all of a group of ranks: MoE dispatch and combine over one-sided writes.

Per call (sequence number ``s``, parity ``p = s % 2``), on every rank:

1. ``dispatch_send``: await this rank's own writes of call ``s - 2`` (they used the same
   parity regions at the peers), then write its route row (rows per global expert) into every
   peer's route region ``[p][rank]`` with immediate ROUTE(s, rank); wait for the route rows of
   the peers (the count exchange); compute the layout (:mod:`._layout`); pack the rows sorted
   by (expert, token) and write each peer's block into that peer's dispatch region ``[p]`` at
   the row the layout gives it (immediate DISPATCH(s), one write per peer, zero bytes when
   empty, so every peer expects exactly one from each peer).
2. ``recv``: wait for one DISPATCH(s, r) credit from each peer r, await its own writes, unpack into per-expert
   padded blocks in canonical order (source rank, then token).
3. ``combine_send``: pack the expert outputs in received order and write each source's rows
   into that source's combine region ``[p]`` at the source's own send layout (COMBINE(s)).
4. ``recv``: wait for one COMBINE(s, r) credit from each peer r, reduce in float32 in top-k slot order.

Why nothing of call ``s`` is ever counted or read for another call: immediates carry the
call's sequence number (15 bits), the sender's rank (so that a write counted twice after a
re-post cannot stand in for another rank's) and a per-group tag; a rank posts its route row for ``s`` only
after its own writes of ``s - 2`` have finished (landed, or failed for good), so once the route
rows of ``s`` from every peer are in, nothing of ``s - 2`` can still land anywhere: the
counters of ``s - 2`` are released then, and the ``[p]`` regions are free. A rank finishes
reading its ``[p]`` regions of ``s - 2`` before posting its route row for ``s`` (a combine of
``s - 2`` still running then is refused), so no peer overwrites them early.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

from .._core._counter import ImmCounter
from .._core._descriptor import MemoryDescriptor
from .._core._engine import Engine, Transfer
from .._core._errors import AioteError, InvalidArgument, TransferTimeout
from .._core._log import get_logger
from .._core._memory import MemoryRegion
from .._core._observe import observed_call
from ._dtypes import DType
from ._handles import CombinePending, DispatchHandle, DispatchPending, Group
from ._layout import Geometry, RecvPlan, SendPlan, plan_recv, plan_send, round_up
from ._trace import mark
from ._util import (
    COMBINE,
    DISPATCH,
    ROUTE,
    TAG,
    TAIL,
    Deadline,
    check_config,
    deadline_at,
    imm_of,
    left,
    parse_hello,
    reduce_rows,
    round16,
)

__all__ = ["AllToAll"]

_log = get_logger(component="moe")


class AllToAll:
    """MoE dispatch and combine among the ranks of a :class:`Group`, created once per shape
    with :meth:`create` on every rank (same arguments).

    Guarantees: dispatch is byte-exact (rows are copied, never converted); combine
    accumulates in float32 in top-k slot order and rounds once; every call of every rank
    waits at most its ``timeout`` (default the group's); a peer that dies makes the calls
    waiting on it raise :class:`~aiote.PeerUnreachable` within the engine's ``connect_timeout``
    plus ``probe_interval``; a call that failed or was cancelled on any rank fails that step
    on the others (by their deadline) and leaves the next call correct. Every call to
    :meth:`dispatch`/:meth:`dispatch_send` is one step of the group, whatever its outcome, so
    every rank must make the same calls in the same order. At most two dispatches are in
    flight: dispatch ``s`` makes handle ``s - 2`` stale.

    Costs (registered, per rank): dispatch regions ``2 x max_recv_tokens`` rows of
    ``round16(H x in) + 16`` bytes, a send region of ``max_tokens x K`` such rows (two on the
    GPU, one per parity: the unpack reads a rank's own rows there), combine regions ``2 x
    max_tokens x K`` rows and a send region of ``max_recv_tokens`` rows of ``round16(H x out)``
    bytes, and the route rows (``2 x W x E`` int32); on the GPU also per-parity layout buffers
    (``O(E + max_tokens x K + max_recv_tokens)`` integers) and a few KiB of pinned memory.
    """

    def __init__(self, engine: Engine, group: Group, geo: Geometry, cfg: dict[str, Any], xp: Any) -> None:
        self.engine, self.group, self.geometry, self.xp = engine, group, geo, xp
        self.rank, self.world = group.rank, group.world
        self.num_experts: int = cfg["num_experts"]
        self.experts_per_token: int = cfg["experts_per_token"]
        self.hidden: int = cfg["hidden"]
        self.max_tokens: int = cfg["max_tokens"]
        self.in_dtype: DType = cfg["in_dtype"]
        self.out_dtype: DType = cfg["out_dtype"]
        self.expert_padding: int = cfg["expert_padding"]
        self.max_recv_tokens: int = cfg["max_recv_tokens"]
        self.timeout: float | None = cfg["timeout"]
        self.probe_interval: float = cfg["probe_interval"]
        self.imm_tag: int = cfg["imm_tag"]
        self._gpu = getattr(xp, "__name__", "") == "cupy"
        self._xrow = self.hidden * self.in_dtype.itemsize
        self.scale_block: int | None = cfg["scale_block"]
        self._nscale = 0 if self.scale_block is None else -(-self.hidden // self.scale_block)
        # a dispatch row: x's bytes | its float32 block scales (if any) | the token number
        self._fields = [(0, self._xrow), (round16(self._xrow), 4 * self._nscale)]
        self._toff = round16(self._xrow) + round16(4 * self._nscale)
        self._dstride = self._toff + TAIL
        self._yrow = self.hidden * self.out_dtype.itemsize
        self._cstride = round16(self._yrow)  # == the row when H x out is a multiple of 16
        self._send_cap = self.max_tokens * self.experts_per_token
        self._seq = 0
        self._stale: set[int] = set()
        self._handles: dict[int, DispatchHandle] = {}
        self._pending: dict[int, DispatchPending] = {}
        self._receiving: int | None = None
        self._inflight: list[list[Transfer]] = [[], []]
        self._dsend_busy: list[Transfer] = []
        self._csend_busy: list[Transfer] = []
        self._fence: list[Any] = [None, None]
        self._unreleased: set[int] = set()
        self._regions: list[MemoryRegion] = []
        self._peers: list[dict[str, MemoryDescriptor]] = []
        self._closed = False
        self._alloc()

    # ------------------------------------------------------------------ creation

    @classmethod
    async def create(
        cls,
        engine: Engine,
        group: Group,
        *,
        num_experts: int,
        experts_per_token: int,
        hidden: int,
        max_tokens: int,
        in_dtype: Any = "bfloat16",
        out_dtype: Any = "bfloat16",
        expert_padding: int = 1,
        max_recv_tokens: int | None = None,
        imm_tag: int = 0xA5,
        timeout: float | None = 60.0,
        probe_interval: float = 0.5,
        scale_block: int | None = None,
        xp: Any = None,
    ) -> AllToAll:
        """Creates the all-to-all on this rank; every rank of ``group`` calls it with the same
        arguments (checked: a rank with others raises :class:`~aiote.InvalidArgument`).

        ``num_experts`` E, ``experts_per_token`` K, ``hidden`` H, ``max_tokens`` (per rank and
        call), ``in_dtype`` (dispatch rows: ``"bfloat16"``, ``"float16"``, ``"float32"``,
        ``"float8_e4m3fn"``; bfloat16 travels as uint16 bit patterns, float8 as uint8),
        ``out_dtype`` (combine: bfloat16, float16 or float32), ``expert_padding`` (each expert's
        block is a multiple of it), ``max_recv_tokens`` (rows a rank can receive per call;
        default the worst case ``W x max_tokens x min(K, ceil(E/W))``; a call that would exceed
        it raises :class:`~aiote.InvalidArgument` on every rank before any token moves),
        ``imm_tag`` (8 bits: the immediates of this group; groups sharing an engine need
        different tags), ``timeout`` (default deadline of every call, and of this one),
        ``probe_interval`` (how often a long wait checks that its peers are alive),
        ``scale_block`` (float8 with block scales: each token also carries ``ceil(H /
        scale_block)`` float32 scales, ``dispatch(x_scale=)``, returned as
        ``handle.expert_x_scale``), ``xp``: ``numpy`` (default) or ``cupy`` (GPU regions:
        same-host peers over CUDA IPC).

        Registers its regions, sends one message to every peer and takes the engine's
        messages until every peer's arrived (messages of others are dropped with a warning:
        create groups one at a time, before other message traffic). Raises
        :class:`~aiote.InvalidArgument` for bad arguments (before anything is registered),
        :class:`~aiote.TransferTimeout` after ``timeout``, what registering and sending raise.
        """
        xp = np if xp is None else xp
        if not isinstance(group, Group):
            raise InvalidArgument(f"group must be an aiote.moe.Group, not {type(group).__name__}")
        cfg = check_config(
            group.world, num_experts, experts_per_token, hidden, max_tokens, in_dtype, out_dtype,
            expert_padding, max_recv_tokens, imm_tag, timeout, probe_interval, scale_block,
        )
        self = cls(engine, group, Geometry(group.world, num_experts), cfg, xp)
        try:
            with Deadline(timeout, "creating the all-to-all"):
                await self._register()
                await self._exchange(cfg)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        _log.info("all-to-all ready", rank=self.rank, world=self.world, experts=num_experts, hidden=hidden)
        return self

    def _alloc(self) -> None:
        xp, w = self.xp, self.world
        # the route rows of both parities, then 4 bytes that probes write (no immediate)
        ns = 2
        self._route_raw = np.zeros(ns * w * self.num_experts + 4, dtype=np.int32)
        self._route = self._route_raw[:-4].reshape(ns, w, self.num_experts)
        self._myroute = np.zeros((ns, self.num_experts), dtype=np.int32)
        # host receive regions come from the engine's host arena: a same-host peer's write
        # into them is one memcpy by the writer's poller (GPU regions: CUDA IPC instead)
        zeros = xp.zeros if self._gpu else self.engine.alloc_host
        self._drecv = zeros((ns, self.max_recv_tokens, self._dstride), dtype=xp.uint8)
        if self._gpu:  # one send region per parity: the unpack reads this rank's own rows there
            self._dsend = xp.zeros((2, self._send_cap, self._dstride), dtype=xp.uint8)
            from ._gpu import Kernels

            self._kern = Kernels(xp)
            pm = xp.cuda.alloc_pinned_memory
            e1 = self.num_experts + 1
            self._hcount = np.frombuffer(pm(2 * 4 * e1), np.int32, 2 * e1).reshape(2, e1)
            lr = self.geometry.per_rank
            self._tabmax = (lr + 1) + lr + lr * (w + 1) + w * lr
            self._htab = np.frombuffer(pm(2 * 8 * self._tabmax), np.int64, 2 * self._tabmax).reshape(2, -1)
            # per parity, reused: call s's are free again once s - 2's reads are fenced
            e1, sc = self.num_experts + 1, max(self._send_cap, 1)
            self._gcounts = xp.empty((2, e1), dtype=xp.int32)
            self._geoff = xp.empty((2, e1), dtype=xp.int64)
            self._gpos = xp.empty((2, sc), dtype=xp.int64)
            self._grow = xp.empty((2, sc), dtype=xp.int32)
            self._gtab = xp.empty((2, self._tabmax), dtype=xp.int64)
            self._gback = xp.empty((2, max(self.max_expert_rows, 1)), dtype=xp.int64)
        else:
            self._dsend = xp.zeros((self._send_cap, self._dstride), dtype=xp.uint8)
        self._crecv = zeros((2, self._send_cap, self._cstride), dtype=xp.uint8)
        self._csend = xp.zeros((self.max_recv_tokens, self._cstride), dtype=xp.uint8)
        if self._gpu:  # views made once (each costs microseconds of Python per call)
            self._dsend_v = [self._dsend[i] for i in range(2)]
            self._drecv_v = [self._drecv[i] for i in range(ns)]
            self._crecv_v = [self._crecv[i] for i in range(2)]
            self._gbufs = [(self._gcounts[i], self._geoff[i], self._gpos[i], self._grow[i], self._gtab[i],
                            self._gback[i]) for i in range(2)]

    async def _register(self) -> None:
        e = self.engine
        self._route_mr = await e.register(self._route_raw)
        self._regions.append(self._route_mr)
        self._myroute_mr = await e.register(self._myroute, remote_write=False)
        self._regions.append(self._myroute_mr)
        self._drecv_mr = await e.register(self._drecv)
        self._regions.append(self._drecv_mr)
        self._dsend_mr = await e.register(self._dsend, remote_write=False)
        self._regions.append(self._dsend_mr)
        self._crecv_mr = await e.register(self._crecv)
        self._regions.append(self._crecv_mr)
        self._csend_mr = await e.register(self._csend, remote_write=False)
        self._regions.append(self._csend_mr)

    async def _exchange(self, cfg: dict[str, Any]) -> None:
        key = json.dumps({k: (v.name if isinstance(v, DType) else v) for k, v in sorted(cfg.items())
                          if k not in ("timeout", "probe_interval")}, separators=(",", ":"))
        mine = {
            "moe": TAG, "rank": self.rank, "key": key, "gpu": self._gpu,
            "route": bytes(self._route_mr.descriptor).hex(),
            "drecv": bytes(self._drecv_mr.descriptor).hex(),
            "crecv": bytes(self._crecv_mr.descriptor).hex(),
        }
        payload = json.dumps(mine).encode()
        peers: dict[int, dict[str, MemoryDescriptor]] = {}
        for r, addr in enumerate(self.group.addresses):
            if r != self.rank:
                await self.engine.send(addr, payload)
        while len(peers) < self.world - 1:
            sender, raw = await self.engine.recv()
            msg = parse_hello(raw)
            if msg is None or sender not in self.group.addresses:
                _log.warning("dropped a message while creating an all-to-all", size=len(raw))
                continue
            r = self.group.addresses.index(sender)
            if msg["key"] != key or msg["rank"] != r:
                raise InvalidArgument(f"rank {r} created its all-to-all with other arguments: {msg['key']}")
            peers[r] = {k: MemoryDescriptor.from_bytes(bytes.fromhex(msg[k]))
                        for k in ("route", "drecv", "crecv")}
        self._peers = [peers.get(r, {}) for r in range(self.world)]
        for r, p in enumerate(self._peers):
            if r != self.rank:
                await self.engine.connect(p["route"])

    async def aclose(self) -> None:
        """Unregisters the regions (waits up to the group's timeout for writes in flight; then
        :class:`~aiote.RegionBusy`). Later calls raise :class:`~aiote.InvalidArgument`.
        Idempotent; costs one unregister per region."""
        self._closed = True
        regions, self._regions = self._regions, []
        for mr in regions:
            if not self.engine.closed:
                await self.engine.unregister(mr, timeout=self.timeout)

    async def __aenter__(self) -> AllToAll:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ dispatch

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
        with deadline_at(end, timeout if timeout is not None else self.timeout, what):
            mark("d.check")
            if self._gpu:
                pending = await self._send_gpu(seq, m, idx_dev, w, srcs, out_x, end, what)
                self._pending[seq] = pending
                return pending
            idx = await self._host(idx_dev)
            mark("d.idx_to_host")
            send = plan_send(idx, m, self.num_experts)
            mark("d.plan_send")
            await self._settle(self._inflight[p], end, what, quiet=True)
            await self._wait_fence(p)
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
        """Makes call ``seq - 2``'s handle and pending dispatch stale (they share parity)."""
        for old in [s for s in self._handles if s <= seq - 2]:
            self._handles.pop(old)._state = "stale"
            self._stale.add(old)
        for old in [s for s in self._pending if s <= seq - 2]:
            self._pending.pop(old)
            self._stale.add(old)
        self._stale = {s for s in self._stale if s > seq - 64}

    def _post_route(self, seq: int, route: np.ndarray, posted: list[Transfer]) -> None:
        p, e4 = seq & 1, self.num_experts * 4
        self._myroute[p] = route
        self._route[p, self.rank] = route
        imm = imm_of(self.imm_tag, ROUTE, seq, self.rank)
        for r, peer in enumerate(self._peers):
            if r != self.rank:
                t = self.engine.post_write(
                    self._myroute_mr, peer["route"], length=e4, src_offset=p * e4,
                    dst_offset=(p * self.world + self.rank) * e4, imm=imm,
                )
                posted.append(t)
                self._inflight[p].append(t)

    @property
    def max_expert_rows(self) -> int:
        """The most rows a dispatch can return on this rank (``max_recv_tokens`` plus the padding
        of its experts): the size an ``out_x`` needs. O(1)."""
        first, end = self.geometry.local_range(self.rank)
        return self.max_recv_tokens + (end - first) * (self.expert_padding - 1)

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
        """The bytes of each field of a token's row: ``[T, bytes]`` views of x (and x_scale)."""
        xp, t = self.xp, x.shape[0]
        if self.scale_block is None:
            if x_scale is not None:
                raise InvalidArgument("x_scale given, but the all-to-all was created without scale_block")
            return [xp.ascontiguousarray(x).view(xp.uint8).reshape(t, self._xrow)]
        if (not isinstance(x_scale, xp.ndarray) or x_scale.shape != (t, self._nscale)
                or x_scale.dtype != np.float32):
            raise InvalidArgument(f"x_scale must be a [{t}, {self._nscale}] float32 {xp.__name__} array")
        return [xp.ascontiguousarray(x).view(xp.uint8).reshape(t, self._xrow),
                xp.ascontiguousarray(x_scale).view(xp.uint8).reshape(t, 4 * self._nscale)]

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

    # ------------------------------------------------------------------ combine

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
        with deadline_at(end, timeout if timeout is not None else self.timeout, what):
            mark("c.start")
            await self._settle(self._csend_busy, end, what, quiet=True)
            mark("c.settle_old")
            plan = handle._plan
            yb = xp.ascontiguousarray(expert_out).view(xp.uint8).reshape(expert_out.shape[0], self._yrow)
            if self._gpu:
                self._pack_back_gpu(handle, yb)
            else:
                self._pack_back(handle, yb)
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
        at_source = (np.cumsum(plan.n, axis=1) - plan.n)[:, me]  # where each source put my block
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

    def _reduce(self, h: DispatchHandle, out: Any, accumulate: bool) -> Any:
        """The reduction of :func:`._util.reduce_rows` over this call's combine region."""
        xp, p, m, dt = self.xp, h.seq & 1, h.num_tokens, self.out_dtype
        region = self._crecv[p]
        if self._cstride == self._yrow:
            rows = region.view(dt.storage)
        else:
            rows = xp.ascontiguousarray(region[:, : self._yrow]).view(dt.storage)
        dest = xp.empty((m, self.hidden), dtype=dt.storage) if out is None else out[:m]
        reduce_rows(rows, h._pos, h._weights, dt, xp, dest, prev=out[:m] if accumulate else None)
        self._record_fence(p)
        return dest

    # ------------------------------------------------------------------ waiting

    def _end(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0):
            raise InvalidArgument(f"timeout must be a number of seconds >= 0 or None, not {t!r}")
        return None if t is None else anyio.current_time() + float(t)

    async def _wait_credits(
        self, kind: int, seq: int, end: float | None, what: str, posted: list[Transfer]
    ) -> None:
        """Waits for one credit of (kind, seq) from each peer; every ``probe_interval`` of waiting,
        checks this call's writes and probes every peer (a 4-byte write, no immediate: a dead
        peer fails it)."""
        if self.world == 1:
            await anyio.lowlevel.checkpoint()
            return
        for r in range(self.world):
            if r != self.rank:
                counter = self.engine.imm_counter(imm_of(self.imm_tag, kind, seq, r))
                await self._wait_one(counter, end, what, posted)

    async def _wait_one(
        self, counter: ImmCounter, end: float | None, what: str, posted: list[Transfer]
    ) -> None:
        """One credit of ``counter`` by ``end``, probing the peers while it lasts."""
        while True:
            remaining = None if end is None else end - anyio.current_time()
            if remaining is not None and remaining <= 0:
                raise TransferTimeout(f"{what}: peers' writes did not all arrive in time")
            step = self.probe_interval if remaining is None else min(self.probe_interval, remaining)
            try:
                await counter.wait(1, timeout=step)
                return
            except TransferTimeout:
                pass
            for t in posted:
                if t.done:
                    await t  # a failed write of ours (a dead peer) raises here
            await self._probe(end, what)

    async def _probe(self, end: float | None, what: str) -> None:
        probes = [
            self.engine.post_write(self._myroute_mr, peer["route"], length=4, dst_offset=self._route.nbytes)
            for r, peer in enumerate(self._peers) if r != self.rank
        ]
        for t in probes:
            await t.wait(timeout=left(end))
        _log.debug("peers probed while waiting", op=what, peers=len(probes))

    async def _settle(
        self, transfers: list[Transfer], end: float | None, what: str, *, quiet: bool = False
    ) -> None:
        """Awaits ``transfers`` (and forgets them); ``quiet``: those of earlier calls, whose
        errors were that call's and are only logged."""
        while transfers:
            t = transfers[0]
            try:
                await t.wait(timeout=left(end))
            except AioteError as exc:
                if not quiet or isinstance(exc, TransferTimeout):
                    raise
                _log.info("an earlier call's write had failed", op=what, error=str(exc))
            transfers.pop(0)
            for lst in self._inflight:
                if t in lst:
                    lst.remove(t)

    def _release_old(self, seq: int) -> None:
        """Every peer has started ``seq``: nothing of ``seq - 2`` or earlier can still land."""
        for s in [s for s in self._unreleased if s <= seq - 2]:
            self._unreleased.discard(s)
            for kind in (ROUTE, DISPATCH, COMBINE):
                for r in range(self.world):
                    if r == self.rank:
                        continue
                    try:
                        self.engine.imm_counter(imm_of(self.imm_tag, kind, s, r)).release()
                    except InvalidArgument:  # a task still waits on it (a call being cancelled)
                        self._unreleased.add(s)

    # ------------------------------------------------------------------ devices

    async def _host(self, a: Any) -> np.ndarray:
        """``a`` as a NumPy array (a device-to-host copy in a worker thread on the GPU)."""
        if not self._gpu:
            return np.asarray(a)
        dev, stream = a.device.id, self.xp.cuda.get_current_stream()  # after the work queued so far

        def get() -> np.ndarray:
            with self.xp.cuda.Device(dev):
                out = a.get(stream=stream)
                stream.synchronize()
                return np.asarray(out)

        return await anyio.to_thread.run_sync(get)

    def _dev(self, a: np.ndarray) -> Any:
        return self.xp.asarray(a) if self._gpu else a

    def _stream(self) -> Any:
        return self.xp.cuda.get_current_stream() if self._gpu else None

    def _record_fence(self, p: int) -> None:
        if self._gpu:
            ev = self.xp.cuda.Event(disable_timing=True)
            ev.record()
            self._fence[p] = ev

    async def _wait_fence(self, p: int) -> None:
        """The kernels that read this parity's regions last (unpack, reduce) have finished."""
        ev = self._fence[p]
        if ev is not None and not ev.done:
            await anyio.to_thread.run_sync(ev.synchronize)
        self._fence[p] = None


    # ------------------------------------------------------------------ the GPU flow

    async def _send_gpu(
        self, seq: int, m: int, idx_dev: Any, w: Any, srcs: list[Any], out_x: Any, end: float | None,
        what: str,
    ) -> DispatchPending:
        """The send half on the GPU: the layout (rows per expert, each slot's send row) and the
        packing are one kernel each on the caller's stream; only the route row (``4E`` bytes,
        and the input checks) comes to the host, through pinned memory, polled without
        blocking the loop; then the count exchange and one write per peer, as on the CPU."""
        xp, p, k, e = self.xp, seq & 1, self.experts_per_token, self.num_experts
        await self._settle(self._inflight[p], end, what, quiet=True)
        await self._wait_fence(p)
        mark("d.settle_old")
        stream = xp.cuda.get_current_stream()
        idx = idx_dev if m == idx_dev.shape[0] else idx_dev[:m]
        if idx.dtype != xp.int64 or not idx.flags.c_contiguous:
            idx = xp.ascontiguousarray(idx, dtype=xp.int64)
        n_slots = m * k
        counts, eoff, pos, row_token = self._gbufs[p][:4]
        kern = self._kern
        kern.layout(idx, k, e, counts, eoff, pos, row_token)
        host = self._hcount[p]
        xp.cuda.runtime.memcpyAsync(host.ctypes.data, counts.data.ptr, counts.nbytes, 2, stream.ptr)
        ev = xp.cuda.Event(disable_timing=True)
        ev.record(stream)
        dsend = self._dsend_v[p]
        if n_slots:
            x0 = srcs[0]
            sc = srcs[1] if len(srcs) > 1 else x0
            kern.pack(
                (n_slots,), (128,),
                (x0, np.int64(self._xrow), sc, np.int64(4 * self._nscale), np.int32(self._xrow),
                 np.int32(self._fields[1][0]), np.int32(4 * self._nscale), row_token, eoff, np.int32(e),
                 dsend, np.int64(self._dstride), np.int32(self._toff)),
            )
        mark("d.layout")
        await self._until(ev)
        mark("d.counts")
        route = host[:e].copy()
        bad = int(host[e])
        if bad:
            dup = "an expert appears twice in one token's indices"
            raise InvalidArgument(f"indices must be in [-1, {e})" if bad & 1 else dup)
        n_me = self.geometry.rank_sums(route[None, :])[0]  # rows to each rank
        sstart = np.cumsum(n_me) - n_me
        posted: list[Transfer] = []
        self._post_route(seq, route, posted)
        mark("d.post_route")
        await self._wait_credits(ROUTE, seq, end, what, posted)
        mark("d.wait_route")
        c = self._route[p].copy()
        self._release_old(seq)
        plan = self._plan_gpu(c)
        self._post_data(seq, n_me, sstart, (p * self.max_recv_tokens + plan.dst_row).tolist(), posted)
        mark("d.post_rows")
        return DispatchPending(self, seq, plan, pos[:n_slots].reshape(m, k), w, posted, m, out_x)

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

    async def _until(self, ev: Any) -> None:
        """Until the CUDA event ``ev`` has happened, without blocking the loop: polled between
        checkpoints for 1 ms (a small copy takes microseconds), then waited in a thread."""
        t0 = time.perf_counter()
        while not ev.done:
            if time.perf_counter() - t0 > 1e-3:
                await anyio.to_thread.run_sync(ev.synchronize)
                return
            await anyio.lowlevel.checkpoint()

    def _plan_gpu(self, c: np.ndarray) -> GpuPlan:
        """The receive layout from the count matrix ``c[W, E]``: small arrays only (O(W E));
        the rows are placed by the unpack kernel. Raises InvalidArgument past the capacity
        (every rank holds the same matrix, so every rank raises it, before any token moves)."""
        geo, me, w = self.geometry, self.rank, self.world
        n = geo.rank_sums(c)  # [W src, W dst]
        worst = int(n.sum(0).max())
        if worst > self.max_recv_tokens:
            raise InvalidArgument(
                f"rank {int(n.sum(0).argmax())} would receive {worst} rows, past "
                f"max_recv_tokens={self.max_recv_tokens}"
            )
        first, last = geo.local_range(me)
        cd = c[:, first:last].astype(np.int64)  # [W, L]
        ll = last - first
        counts = cd.sum(0)
        offsets = np.zeros(ll + 1, dtype=np.int64)
        np.cumsum(round_up(counts, self.expert_padding), out=offsets[1:])
        cum = np.zeros((ll, w + 1), dtype=np.int64)
        np.cumsum(cd.T, axis=1, out=cum[:, 1:])
        within = np.cumsum(cd, axis=1) - cd  # rows of lower experts in source r's block
        rstart = np.cumsum(n[:, me]) - n[:, me]  # source r's block in this rank's regions
        start = rstart[:, None] + within
        start[me] = (np.cumsum(n[me]) - n[me])[me] + within[me]  # this rank's own send rows
        tab = np.concatenate([offsets, counts, cum.ravel(), start.ravel()])
        return GpuPlan(n=n, rstart=rstart, counts=counts.astype(np.int32), offsets=offsets, tab=tab,
                       dst_row=(np.cumsum(n, axis=0) - n)[me])

    async def _recv_gpu(self, pending: DispatchPending, end: float | None) -> DispatchHandle:
        seq, xp = pending.seq, self.xp
        what = f"dispatch {seq}"
        await self._wait_credits(DISPATCH, seq, end, what, pending._posted)
        mark("dr.wait_rows")
        await self._settle(pending._posted, end, what)
        mark("dr.own_writes")
        h = self._unpack_gpu(pending)
        mark("dr.unpack", xp)
        return h

    def _unpack_gpu(self, pending: DispatchPending) -> DispatchHandle:
        """One kernel over the output rows: each takes its row from the dispatch region (a
        peer's token) or from the send region (one of this rank's own), in canonical order."""
        xp, plan, seq, me = self.xp, pending._plan, pending.seq, self.rank
        p = seq & 1
        rows = int(plan.offsets[-1])
        if pending._out_x is None:
            ex = xp.zeros((rows, self.hidden), dtype=self.in_dtype.storage)
        else:
            ex = pending._out_x[:rows]
        scale = None if self.scale_block is None else xp.zeros((rows, self._nscale), xp.float32)
        src_rank = xp.empty(rows, dtype=xp.int32)
        src_token = xp.empty(rows, dtype=xp.int32)
        back = self._gbufs[p][5][:rows]
        if rows:
            stream = xp.cuda.get_current_stream()
            tab = plan.tab
            hbuf = self._htab[p][: tab.size]
            hbuf[...] = tab
            dtab = self._gbufs[p][4]
            xp.cuda.runtime.memcpyAsync(dtab.data.ptr, hbuf.ctypes.data, tab.nbytes, 1, stream.ptr)
            exb = ex.view(xp.uint8)
            sb = exb if scale is None else scale.view(xp.uint8)
            self._kern.unpack(
                (rows,), (128,),
                (dtab, np.int32(len(plan.counts)), np.int32(self.world), np.int32(me), self._drecv_v[p],
                 self._dsend_v[p], np.int64(self._dstride), np.int32(self._xrow),
                 np.int32(self._fields[1][0]),
                 np.int32(4 * self._nscale), np.int32(self._toff), exb, np.int64(self._xrow), sb,
                 np.int64(4 * self._nscale), src_rank, src_token, back),
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

    def _pack_back_gpu(self, h: DispatchHandle, yb: Any) -> None:
        """One kernel over the output rows: the peers' rows into the send region at the rows
        they came in at, this rank's own rows straight into its combine region."""
        rows = int(h.offsets[-1])
        if rows:
            self._kern.back(
                (rows,), (128,),
                (h.src_rank, h._dest, np.int32(self.rank), yb, np.int64(self._yrow), np.int32(self._yrow),
                 self._csend, self._crecv_v[h.seq & 1], np.int64(self._cstride)),
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
