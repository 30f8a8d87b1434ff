"""GPU memory under the engine's API: registration, staging through pinned host memory, the
CUDA-IPC rail for same-host peers, stream ordering, and the UVM watcher.

How GPU bytes move (see docs/gpu.md):

- A GPU region is registered with the NICs through a pinned host *shadow* of the same size
  (providers here have no ``FI_HMEM``). Its descriptor says "CUDA, device d", names the region
  and carries a CUDA IPC handle for peers on the same host.
- Writing from GPU memory: device-to-host copies of chunk ``k+1`` run on the engine's copy
  stream while chunk ``k`` is on the network (each chunk's completion is a signal word the
  native poller watches; nothing blocks the event loop).
- Writing into a peer's GPU region: the bytes land in the peer's shadow; then an internal
  message tells the peer which ranges landed; the peer copies them to GPU memory on its own
  stream and credits the immediate only when every part of the operation is in GPU memory.
  An immediate sent to a GPU region (``write_imm``) goes the same way, so it is ordered after
  the copies of earlier writes.
- Same host, GPU to GPU: the peer's allocation is opened once through CUDA IPC and written
  with device-to-device copies (one kernel for paged writes); the credit follows the copy.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import numpy as np

from .._native import lib
from ._descriptor import DEVICE_CUDA, GPU_BACKEND_CUDA, GPU_BACKEND_HOST, GpuExtent, MemoryDescriptor
from ._device import Credit, IpcMaps, _Backend, device_backend
from ._errors import InvalidArgument
from ._gpuipc import IpcWrites, _KeptIpc
from ._gpuparts import PartCounts, pack_part, parse_part, part_refused
from ._gpuwatch import SignalWords, UvmWatcher, _Line
from ._lanes import K_LANE, Lanes
from ._log import get_logger
from ._util import deadline, first_error
from ._wire import _GPU_COUNTS

if TYPE_CHECKING:
    from ._descriptor import EngineAddress, GpuExtent
    from ._memory import MemoryRegion
    from ._retry import RetryPolicy

__all__ = ["GpuOwner", "GpuSupport", "UvmWatcher"]


class GpuOwner(Protocol):
    """What the GPU side needs of its engine (the engine satisfies it; this module never
    imports the engine, which sits above it)."""

    _h: Any
    _closed: bool
    _address: EngineAddress
    _max_message: int
    _event: Any

    async def _register_native(
        self,
        host: Any,
        owner: Any,
        nbytes: int,
        remote_write: bool,
        remote_read: bool,
        device_kind: int,
        device_id: int,
        gpu: GpuExtent | None,
        dev: tuple[int, int] | None = None,
    ) -> MemoryRegion: ...

    async def _send_msg(
        self,
        peer: Any,
        payload: Any,
        timeout: float | None,
        retry: RetryPolicy | None,
        *,
        internal: bool = False,
    ) -> None: ...

    async def _read_host(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        timeout: float | None,
        retry: RetryPolicy | None,
    ) -> None: ...

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
    ) -> None: ...

    async def write_imm(
        self,
        remote: MemoryDescriptor | bytes,
        imm: int,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> None: ...

_log = get_logger(component="gpu")


def _staged(rdesc: MemoryDescriptor) -> bool:
    """Whether bytes for ``rdesc`` land in a pinned shadow its owner copies to GPU memory."""
    return rdesc.on_gpu and not (rdesc.gpu is not None and rdesc.gpu.direct)


_K_LANE_BYTE = bytes([K_LANE])


class GpuSupport(IpcWrites):
    """The GPU side of one engine (created on first use); its CUDA-IPC writes: :class:`IpcWrites`."""

    def __init__(
        self, engine: GpuOwner, backend: str, *, chunk: int, ipc: bool, direct: bool, ipc_streams: int = 1
    ) -> None:
        self.e = engine
        self.b: _Backend = device_backend(backend)
        self.code = GPU_BACKEND_CUDA if self.b.kind == "cuda" else GPU_BACKEND_HOST
        self.chunk = chunk
        self.ipc_enabled = ipc
        self.direct = direct
        self.words = SignalWords(self.b)
        self._tokens = itertools.count(1)
        self._lines: dict[int, _Line] = {}
        self._watchers: dict[int, UvmWatcher] = {}
        self._out: dict[int, _Line] = {}
        # CUDA-IPC writes: ipc_streams lines per device taken in turn (line 0 is self._out's)
        self.ipc_streams = ipc_streams
        self._ipc_out: dict[int, _Line] = {}
        # owners this engine staged bytes to (their own copies into GPU memory come after the
        # message: a credit to them goes by message too, after those copies; _track_credit)
        self._staged_to: set[EngineAddress] = set()
        self._ipc_turn = itertools.count()
        self._in: dict[int, _Line] = {}
        self._regions: dict[int, MemoryRegion] = {}
        self._parts = PartCounts()  # staged operations' parts still to land here
        self._ipc = IpcMaps(self.b)
        self.lanes = Lanes(engine, self.b)
        self._ops = itertools.count(1)
        self.counts = dict.fromkeys(_GPU_COUNTS, 0)
        # CUDA-IPC writes' lookups kept for their repeats (keep_ipc, post_kept)
        self._kept: dict[tuple[int, int, int], _KeptIpc] = {}

    # ------------------------------------------------------------------ words and lines

    def _line(self, table: dict[int, _Line], device: int, key: int | None = None) -> _Line:
        k = device if key is None else key
        line = table.get(k)
        if line is None:
            line = table[k] = _Line(self, self.b.stream(device), device)
        return line

    def on_watch(self, token: int, value: int) -> None:
        line = self._lines.get(token)
        if line is not None:
            line.on_value(value)
            return
        w = self._watchers.get(token)
        if w is not None:
            w._on_value(value)

    def _track(
        self, mr: MemoryRegion, line: _Line, then: Callable[[], None] | None = None,
        credit: Credit | None = None,
    ) -> None:
        """Counts device work on ``mr`` (``unregister`` waits for it) until ``line``'s fence
        (which also publishes ``credit`` into a credit lane)."""
        mr._dev_pending += 1

        def done() -> None:
            mr._dev_pending -= 1
            if then is not None:
                then()

        try:
            line.fence(done, credit)
        except BaseException:  # the fence was not enqueued: nothing to wait for
            mr._dev_pending -= 1
            raise

    def _track_credit(
        self, mr: MemoryRegion, line: _Line, then: Callable[[], None], device: int, rdesc: MemoryDescriptor,
        imm: int | None, weight: int,
    ) -> Credit | None:
        """:meth:`_track`, the fence also publishing the write's credit through the owner's
        credit lane when one takes it (returned; None: credit it by a message). Not to an owner
        this engine staged bytes to: its own copies of them come before the credit, and its
        message is ordered after them. A fence that could not be launched gives the lane's entry
        back (a later one must not publish past an entry never written)."""
        lane = imm is not None and rdesc.address not in self._staged_to
        credit = self.lanes.take(device, rdesc, imm, weight) if lane else None
        try:
            self._track(mr, line, then, credit)
        except BaseException:
            if credit is not None:
                self.lanes.untake(device, rdesc, credit)
            raise
        if credit is not None:
            self.counts["gpu_lane_credits"] += 1
        return credit

    async def _fenced(self, mr: MemoryRegion, line: _Line, credit: Credit | None = None) -> None:
        ev = self.e._event()
        self._track(mr, line, ev.set, credit)
        await ev.wait()

    async def _credited(
        self, ev: Any, credit: Credit | None, rdesc: MemoryDescriptor, imm: int | None, weight: int,
        device: int, timeout: float | None, retry: Any,
    ) -> None:
        """Waits for an IPC fence (``ev``); then, for an immediate no lane took (``credit``
        None), credits it by a message and offers the owner a lane (once per device and owner)."""
        await ev.wait()
        if imm is not None and credit is None:
            await self.credit(rdesc, imm, weight, timeout, retry)
            await self.lanes.offer(device, rdesc, timeout, retry)

    # ------------------------------------------------------------------ registration

    async def register(self, obj: Any, remote_write: bool, remote_read: bool) -> MemoryRegion:
        buf = self.b.buffer(obj)
        if remote_write and buf.readonly:
            raise InvalidArgument(
                "the GPU array is read-only but was registered for remote write; pass remote_write=False"
            )
        handle, offset = b"", 0
        if self.ipc_enabled:
            try:
                handle, offset = self.b.ipc_export(buf)
            except Exception as exc:  # not exportable (e.g. not cudaMalloc'd): staging only
                _log.info(
                    "GPU region not exported over CUDA IPC; same-host peers use staging", reason=str(exc)
                )
        rid = secrets.randbits(63) + 1
        shadow: np.ndarray | None = None
        dev: tuple[int, int] | None = None
        if self.direct:  # the NICs register the GPU memory itself (FI_HMEM): no shadow
            dev = (buf.ptr, int(lib.AIO_HMEM_CUDA if self.b.kind == "cuda" else lib.AIO_HMEM_SYSTEM))
        else:
            shadow = await anyio.to_thread.run_sync(self.b.pinned, buf.nbytes)
        mr = await self.e._register_native(
            shadow,
            obj,
            buf.nbytes,
            remote_write,
            remote_read,
            DEVICE_CUDA,
            buf.device,
            GpuExtent(rid, self.code, handle, offset, direct=self.direct),
            dev=dev,
        )
        mr._dev = buf
        mr.writable = not buf.readonly
        if shadow is not None:
            mr._shadow = shadow
            self._regions[rid] = mr
        return mr

    def forget(self, mr: MemoryRegion) -> None:
        g = mr.descriptor.gpu
        if g is not None:
            self._regions.pop(g.region_id, None)
        for key in [key for key, k in self._kept.items() if k.mr is mr]:
            del self._kept[key]

    # ------------------------------------------------------------------ routing

    def _user_stream(self, line: _Line, stream: Any) -> None:
        if stream is not None:
            self.b.wait(line.stream, self.b.own_stream(stream, line.device))

    # ------------------------------------------------------------------ writes

    async def write(
        self,
        mr: MemoryRegion,
        rdesc: MemoryDescriptor,
        length: int,
        src_offset: int,
        dst_offset: int,
        imm: int | None,
        timeout: float | None,
        retry: Any,
        stream: Any,
    ) -> None:
        dev = mr._dev
        if dev is not None:
            peer = self._ipc_ptr(rdesc, dev.device)
            if peer is not None:
                finish, _ = self._ipc_write(mr, rdesc, peer, length, src_offset, dst_offset, imm, stream)
                await finish(timeout, retry)
                return
        # the region counts as busy for the whole write, not only while its device copies run:
        # between a copy's fence and the host write that sends its bytes there is no request in
        # flight, and an unregister seeing none there would pull the region from under the write
        mr._dev_pending += 1
        try:
            await self._write_via_host(mr, rdesc, length, src_offset, dst_offset, imm, timeout, retry, stream)
        finally:
            mr._dev_pending -= 1

    async def _write_via_host(
        self, mr: MemoryRegion, rdesc: MemoryDescriptor, length: int, src_offset: int, dst_offset: int,
        imm: int | None, timeout: float | None, retry: Any, stream: Any,
    ) -> None:
        """:meth:`write` off the CUDA-IPC rail: the NICs reach both ends (after ``stream``'s
        work), or the bytes are staged through host memory in chunks, copied and sent in turn."""
        e, dev = self.e, mr._dev
        staged = _staged(rdesc)
        src_direct = dev is not None and mr._shadow is None
        if stream is not None and (dev is None or src_direct):  # start after that stream's work
            line = self._line(self._out, 0 if dev is None else dev.device)
            self._user_stream(line, stream)
            await self._fenced(mr, line)
        if not staged and (dev is None or src_direct) and length:  # the NICs reach both ends
            self.counts["gpu_direct"] += 1
            await e._write_host(mr, rdesc, length, src_offset, dst_offset, imm, timeout, retry)
            return
        if length == 0:
            if imm is not None:
                if staged:
                    await self.credit(rdesc, imm, 1, timeout, retry)
                else:
                    await e.write_imm(rdesc, imm, timeout=timeout, retry=retry)
            return
        self.counts["gpu_staged"] += 1
        parts = [(o, min(self.chunk, length - o)) for o in range(0, length, self.chunk)]
        ready: list[Any] = []
        if dev is not None and not src_direct:
            line = self._line(self._out, dev.device)
            self._user_stream(line, stream)
            shadow = int(mr._shadow.ctypes.data)
            for o, n in parts:
                self.b.copy(shadow + src_offset + o, dev.ptr + src_offset + o, n, line.stream)
                ev = e._event()
                self._track(mr, line, ev.set)
                ready.append(ev)
        op = next(self._ops)

        async def part(o: int, n: int) -> None:
            await e._write_host(mr, rdesc, n, src_offset + o, dst_offset + o, None, timeout, retry)
            if staged:
                ranges = np.array([dst_offset + o, n], dtype=np.uint64)
                await self._send_part(rdesc, op, len(parts), imm, 1, 0, ranges, timeout, retry)

        with deadline(timeout, "write"), first_error():
            async with anyio.create_task_group() as tg:
                for k, (o, n) in enumerate(parts):
                    if ready:
                        await ready[k].wait()
                    tg.start_soon(part, o, n)
        if imm is not None and not staged:
            await e.write_imm(rdesc, imm, timeout=timeout, retry=retry)

    async def write_paged(
        self,
        mr: MemoryRegion,
        rdesc: MemoryDescriptor,
        page: int,
        src_offs: np.ndarray,
        dst_offs: np.ndarray,
        imm: int | None,
        timeout: float | None,
        retry: Any,
        stream: Any,
        host_write: Callable[[int | None], Any],
    ) -> None:
        """``src_offs``/``dst_offs``: byte offsets of every page in each region (checked)."""
        dev = mr._dev
        n = len(src_offs)
        staged = _staged(rdesc)
        if dev is not None:
            line = self._line(self._out, dev.device)
            self._user_stream(line, stream)
            peer = self._ipc_ptr(rdesc, dev.device)
            if peer is not None:
                self.counts["gpu_ipc"] += 1
                self.b.paged_copy(peer, dev.ptr, dst_offs, src_offs, page, line.stream)
                line.expect(n * page, alone=stream is None)
                ev = self.e._event()
                credit = self._track_credit(mr, line, ev.set, dev.device, rdesc, imm, n)
                await self._credited(ev, credit, rdesc, imm, n, dev.device, timeout, retry)
                return
            if mr._shadow is not None:  # gather the pages into the shadow the NICs read
                shadow = int(mr._shadow.ctypes.data)
                self.b.paged_copy(shadow, dev.ptr, src_offs, src_offs, page, line.stream)
            await self._fenced(mr, line)
        elif stream is not None:
            line = self._line(self._out, 0)
            self._user_stream(line, stream)
            await self._fenced(mr, line)
        if not staged:
            self.counts["gpu_direct" if dev is None or mr._shadow is None else "gpu_staged"] += 1
            await host_write(imm)
            return
        self.counts["gpu_staged"] += 1
        await host_write(None)
        op = next(self._ops)
        per = max(1, (self.e._max_message - 256) // 8)
        chunks = [dst_offs[i : i + per] for i in range(0, n, per)]
        with deadline(timeout, "write_paged"), first_error():
            async with anyio.create_task_group() as tg:
                for c in chunks:
                    tg.start_soon(
                        self._send_part,
                        rdesc,
                        op,
                        len(chunks),
                        imm,
                        n,
                        page,
                        c.astype(np.uint64),
                        timeout,
                        retry,
                    )

    async def credit(
        self, rdesc: MemoryDescriptor, imm: int, weight: int, timeout: float | None, retry: Any
    ) -> None:
        """An immediate for a GPU region: credited by its owner after every copy into GPU
        memory it has started before (the message is ordered after earlier parts)."""
        await self._send_part(
            rdesc, next(self._ops), 1, imm, weight, 0, np.empty(0, np.uint64), timeout, retry
        )

    async def _send_part(
        self,
        rdesc: MemoryDescriptor,
        op: int,
        nparts: int,
        imm: int | None,
        weight: int,
        page: int,
        data: np.ndarray,
        timeout: float | None,
        retry: Any,
    ) -> None:
        assert rdesc.gpu is not None
        if len(data):
            self._staged_to.add(rdesc.address)
        msg = pack_part(rdesc.gpu.region_id, rdesc.keys[0].key, op, nparts, imm, weight, page, data)
        await self.e._send_msg(rdesc.address, msg, timeout, retry, internal=True)

    # ------------------------------------------------------------------ reads

    async def read(
        self,
        mr: MemoryRegion,
        rdesc: MemoryDescriptor,
        length: int,
        src_offset: int,
        dst_offset: int,
        timeout: float | None,
        retry: Any,
    ) -> None:
        dev = mr._dev
        if not _staged(rdesc) and (dev is None or mr._shadow is None):  # the NICs reach both ends
            self.counts["gpu_direct"] += 1
            await self.e._read_host(mr, rdesc, length, src_offset, dst_offset, timeout, retry)
            return
        if _staged(rdesc):
            peer = self._ipc_ptr(rdesc, dev.device) if dev is not None else None
            if peer is None or dev is None:
                raise InvalidArgument(
                    "a READ from a peer's GPU memory needs a GPU destination and the peer on this host "
                    "(CUDA IPC); across hosts its owner must write it (or use a provider with FI_HMEM)"
                )
            line = self._line(self._in, dev.device)
            self.b.copy(dev.ptr + dst_offset, peer + src_offset, length, line.stream)
            await self._fenced(mr, line)
            return
        assert dev is not None
        await self.e._read_host(mr, rdesc, length, src_offset, dst_offset, timeout, retry)
        line = self._line(self._in, dev.device)
        self.b.copy(dev.ptr + dst_offset, int(mr._shadow.ctypes.data) + dst_offset, length, line.stream)
        await self._fenced(mr, line)

    # ------------------------------------------------------------------ the receiving side

    def on_part(self, sender: bytes, payload: bytes) -> None:
        """An internal message: bytes of an operation landed in a GPU region's shadow (or a
        peer offers a credit lane)."""
        if payload[:1] == _K_LANE_BYTE:
            self.lanes.open(payload)
            return
        part = parse_part(payload)
        if part is None:
            _log.warning("malformed GPU staging message dropped", length=len(payload))
            return
        mr = self._regions.get(part.region_id)
        if mr is None or not mr.registered:
            _log.warning("GPU staging message for an unknown region dropped", region=part.region_id)
            return
        why = part_refused(part, writable=mr.remote_write, key=mr.descriptor.keys[0].key, nbytes=mr.nbytes)
        if why is not None:
            _log.warning("GPU staging message dropped", reason=why, region=part.region_id)
            return
        dev = mr._dev
        assert dev is not None
        self.counts["gpu_parts_in"] += 1
        line = self._line(self._in, dev.device)
        shadow = int(mr._shadow.ctypes.data)
        if part.page:
            offs = part.ranges.astype(np.int64)
            self.b.paged_copy(dev.ptr, shadow, offs, offs, part.page, line.stream)
        else:
            for off, n in part.ranges.tolist():
                self.b.copy(dev.ptr + off, shadow + off, n, line.stream)

        def landed() -> None:
            last = self._parts.landed(sender, part.op, part.nparts)
            if last and part.imm is not None and not self.e._closed:
                lib.aio_counter_add(self.e._h, part.imm, part.weight * int(lib.AIO_CREDIT_UNIT))

        if len(part.ranges) or line.busy:
            self._track(mr, line, landed)
        else:  # nothing to copy and nothing in flight: credit now
            landed()

    # ------------------------------------------------------------------ lifecycle

    def watcher(self, initial: int) -> UvmWatcher:
        return UvmWatcher(self, initial)

    def close(self) -> None:
        for w in list(self._watchers.values()):
            w.close()
        # a fence still pending (a close that timed out) may yet store into a lane: keep them mapped
        pending = any(line.busy for line in self._lines.values())
        for line in list(self._lines.values()):
            line.close()
        self.lanes.close(keep_mapped=pending)
        self._ipc.close(keep_mapped=pending)  # a copy still under way may write there
