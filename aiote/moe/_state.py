"""The state of an all-to-all that every layer shares: its fields, its regions (allocating
and registering them), and the device helpers (host copies, streams, fences, CUDA events).

The all-to-all is a stack of classes, each owning one concern over this state (each module
imports only those below it): :class:`State` here; :class:`~._credits.Credits` (the route
rows, credits, probes, settling writes); :class:`~._gpuflow.GpuFlow` (the GPU path);
:class:`~._dispatch.Dispatch`; :class:`~._combine.Combine`; and on top
:class:`~._a2a.AllToAll` (creation, the descriptor exchange, closing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import numpy as np

from .. import Engine, MemoryDescriptor, MemoryRegion, Transfer
from ._dtypes import DType
from ._handles import DispatchHandle, DispatchPending, Group
from ._layout import Geometry
from ._util import TAIL, deadline_at, round16

__all__ = ["State"]

T = TypeVar("T")


class State:
    """Every field of an all-to-all, its regions and the device helpers."""

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
        self.loop_spin_us: float | None = None  # each wait's spin (AllToAll.create sets it)
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
        self._handles: dict[int, DispatchHandle] = {}
        self._pending: dict[int, DispatchPending] = {}
        self._receiving: int | None = None
        self._inflight: list[list[Transfer]] = [[], []]
        self._dsend_busy: list[Transfer] = []
        self._csend_busy: list[Transfer] = []
        self._fence: list[Any] = [None, None]
        # CUDA events, one per parity and use, recorded again each call (no event made per call)
        self._events: dict[tuple[str, int, int], Any] = {}
        self._unreleased: set[int] = set()
        self._regions: list[MemoryRegion] = []
        self._peers: list[dict[str, MemoryDescriptor]] = []
        self._closed = False
        self._alloc()

    def _alloc(self) -> None:
        xp, w = self.xp, self.world
        # the route rows of both parities, then 4 bytes that probes write (no immediate)
        ns = 2
        # (in the host arena: a same-host peer's route write is then one memcpy by its poller)
        self._route_raw = self.engine.alloc_host(ns * w * self.num_experts + 4, dtype=np.int32)
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
        # the combine regions as rows of out_dtype (the reduction's input), when rows are packed
        st = self.out_dtype.storage
        self._crows_v = [self._crecv[i].view(st) for i in range(2)] if self._cstride == self._yrow else None
        if self._gpu:  # views made once (each costs microseconds of Python per call)
            self._dsend_v = [self._dsend[i] for i in range(2)]
            self._drecv_v = [self._drecv[i] for i in range(ns)]
            self._crecv_v = [self._crecv[i] for i in range(2)]
            self._gbufs = [(self._gcounts[i], self._geoff[i], self._gpos[i], self._grow[i], self._gtab[i],
                            self._gback[i]) for i in range(2)]
            # the kernels' pointers of each parity: the send region, the receive region, the table
            self._gptr = [(self._dsend_v[i].data.ptr, self._drecv_v[i].data.ptr, self._gtab[i].data.ptr)
                          for i in range(2)]
            self._csend_ptr = self._csend.data.ptr
            self._pos_v: list[tuple[int, Any]] = [(-1, None), (-1, None)]  # per parity: (m, [m, K] view)

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

    @property
    def max_expert_rows(self) -> int:
        """The most rows a dispatch can return on this rank (``max_recv_tokens`` plus the padding
        of its experts): the size an ``out_x`` needs. O(1)."""
        first, end = self.geometry.local_range(self.rank)
        return self.max_recv_tokens + (end - first) * (self.expert_padding - 1)

    # ------------------------------------------------------------------ devices

    async def _host(self, a: Any, end: float | None, what: str) -> np.ndarray:
        """``a`` as a NumPy array (a device-to-host copy in a worker thread on the GPU, by
        ``end``)."""
        if not self._gpu:
            return np.asarray(a)
        dev, stream = a.device.id, self.xp.cuda.get_current_stream()  # after the work queued so far

        def get() -> np.ndarray:
            with self.xp.cuda.Device(dev):
                out = a.get(stream=stream)
                stream.synchronize()
                return np.asarray(out)

        return await _in_thread(get, end, what)

    def _dev(self, a: np.ndarray) -> Any:
        return self.xp.asarray(a) if self._gpu else a

    def _stream(self) -> Any:
        return self.xp.cuda.get_current_stream() if self._gpu else None

    def _event(self, use: str, p: int) -> Any:
        """The CUDA event of ``use`` for parity ``p`` on the current device (made once). A
        call's events are read before the next call of its parity records them again."""
        key = (use, p, self.xp.cuda.runtime.getDevice())
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self.xp.cuda.Event(disable_timing=True)
        return ev

    def _record_fence(self, p: int) -> None:
        if self._gpu:
            ev = self._event("fence", p)
            ev.record()
            self._fence[p] = ev

    async def _wait_fence(self, p: int, end: float | None, what: str) -> None:
        """The kernels that read this parity's regions last (unpack, reduce) have finished (by
        ``end``)."""
        ev = self._fence[p]
        if ev is not None and not ev.done:
            await _in_thread(ev.synchronize, end, what)
        self._fence[p] = None

    async def _until(self, ev: Any, end: float | None, what: str) -> None:
        """Until the CUDA event ``ev`` has happened, without blocking the loop: polled between
        checkpoints for 1 ms (a small copy takes microseconds), then waited in a thread, by
        ``end``."""
        t0 = time.perf_counter()
        while not ev.done:
            if time.perf_counter() - t0 > 1e-3:
                await _in_thread(ev.synchronize, end, what)
                return
            await anyio.lowlevel.checkpoint()


async def _in_thread(fn: Callable[[], T], end: float | None, what: str) -> T:
    """``fn()`` (a wait on the GPU) in a worker thread, by ``end``: past it raises
    :class:`~aiote.TransferTimeout` naming ``what`` and leaves the thread to finish alone. The
    deadline's cancel scope is made only here, on this slow path: the calls' other waits take
    ``end`` themselves."""
    with deadline_at(end, what):
        return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
