"""Writes over the CUDA-IPC rail: a same-host peer's GPU allocation, opened once through CUDA
IPC, written with device-to-device copies on the writer's IPC lines (``ipc_streams`` per
device, taken in turn); each copy's fence stores its completion, and its credit through the
owner's credit lane when one takes it (else the finish credits it by a message). A write
repeated from the same region to the same descriptor object keeps its lookups
(:meth:`IpcWrites.keep_ipc`, :meth:`IpcWrites.post_kept`). Part of ``GpuSupport``
(``_gpu.py``), which holds the state named below."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ._records import _plain_imm
from ._util import deadline

if TYPE_CHECKING:
    from ._descriptor import MemoryDescriptor
    from ._device import Credit, IpcMaps, _Backend
    from ._gpu import GpuOwner
    from ._gpuwatch import _Line
    from ._memory import MemoryRegion

_Finish = Callable[[float | None, Any], Awaitable[None]]  # (timeout, retry): awaits a started write


class IpcWrites:
    """The CUDA-IPC writes of one engine's ``GpuSupport``."""

    # set by GpuSupport.__init__
    e: GpuOwner
    b: _Backend
    code: int
    ipc_enabled: bool
    ipc_streams: int
    counts: dict[str, int]
    _ipc: IpcMaps
    _out: dict[int, _Line]
    _ipc_out: dict[int, _Line]
    _ipc_turn: itertools.count[int]
    _kept: dict[tuple[int, int, int], _KeptIpc]

    if TYPE_CHECKING:

        def _line(self, table: dict[int, _Line], device: int, key: int | None = None) -> _Line: ...

        def _track_credit(
            self, mr: MemoryRegion, line: _Line, then: Callable[[], None], device: int,
            rdesc: MemoryDescriptor, imm: int | None, weight: int,
        ) -> Credit | None: ...

        async def _credited(
            self, ev: Any, credit: Credit | None, rdesc: MemoryDescriptor, imm: int | None, weight: int,
            device: int, timeout: float | None, retry: Any,
        ) -> None: ...

    def _ipc_line(self, device: int) -> _Line:
        """The line of the next CUDA-IPC write from ``device``: one of ``ipc_streams``, in turn."""
        k = next(self._ipc_turn) % self.ipc_streams
        if k == 0:
            return self._line(self._out, device)
        return self._line(self._ipc_out, device, device * 64 + k)

    def _ipc_ptr(self, rdesc: MemoryDescriptor, device: int) -> int | None:
        """The peer region's address in this process (CUDA IPC), or None to stage."""
        g = rdesc.gpu
        if (
            not self.ipc_enabled
            or g is None
            or not g.ipc_handle
            or g.backend != self.code
            or rdesc.host_id != self.e._address.host_id
        ):
            return None
        base = self._ipc.base(rdesc.host_id, g.ipc_handle, device)
        return None if base is None else base + g.ipc_offset

    def start_ipc(self, mr: MemoryRegion, rdesc: MemoryDescriptor, *args: Any) -> tuple[_Finish, Any] | None:
        """A write over the CUDA-IPC rail started now (``post_write``: the copy and its credit's
        kernel are on the stream before it returns, not when a task first runs), as
        :meth:`_ipc_write` returns it; None when the write does not go over that rail. ``args``:
        as :meth:`_ipc_write`'s."""
        peer = None if mr._dev is None else self._ipc_ptr(rdesc, mr._dev.device)
        return None if peer is None else self._ipc_write(mr, rdesc, peer, *args)

    def ipc_imm_device(self, rdesc: MemoryDescriptor) -> int | None:
        """The device whose first IPC line a ``write_imm`` to ``rdesc`` goes on (the one device
        this engine made IPC writes from, on any of its ``ipc_streams``, when the rail reaches
        ``rdesc`` from it), or None."""
        devices = {line.device for line in self._out.values()}
        devices.update(line.device for line in self._ipc_out.values())
        if len(devices) != 1:
            return None
        (device,) = devices
        return device if self._ipc_ptr(rdesc, device) is not None else None

    def start_ipc_imm(self, rdesc: MemoryDescriptor, imm: int, scratch: MemoryRegion) -> _Finish | None:
        """A ``write_imm`` to a GPU region this engine writes over the CUDA-IPC rail, started now
        on the first IPC line of the device its writes come from: the line first waits for the
        work on the others, so the credit follows every copy this engine put on them, and the
        kernel after it publishes the credit through the owner's credit lane when the lane takes
        it (else the finish sends it by a message once that work is done, and offers the lane).
        To an owner this engine staged bytes to, the credit goes by that message (see
        :meth:`_track_credit`). None: go the host way (no IPC write was made yet, or from several
        devices, or the region is out of the rail's reach). ``imm`` was checked by the caller;
        ``scratch`` (the engine's own small region) counts the fence as its work in flight,
        which closing waits for."""
        device = self.ipc_imm_device(rdesc)
        if device is None:
            return None
        line = self._line(self._out, device)
        for other in self._ipc_out.values():
            if other.device == device and other.busy:
                self.b.wait(line.stream, other.stream)
        line.expect(0, alone=False)
        ev = self.e._event()
        credit = self._track_credit(scratch, line, ev.set, device, rdesc, imm, 1)
        self.counts["gpu_ipc_imm"] += 1

        async def finish(timeout: float | None, retry: Any) -> None:
            with deadline(timeout, "write_imm"):
                await self._credited(ev, credit, rdesc, imm, 1, device, timeout, retry)

        return finish

    def _ipc_write(
        self, mr: MemoryRegion, rdesc: MemoryDescriptor, peer: int, length: int, src_offset: int,
        dst_offset: int, imm: int | None, stream: Any,
    ) -> tuple[_Finish, Any]:
        """Enqueues the copy into the peer's allocation at ``peer`` and the fence that stores
        its completion (and its credit, through a credit lane when there is one); returns what
        awaits it (then credits by a message when no lane took the credit), and the event its
        fence sets when that fence is all there is to wait for (no immediate, or a lane took
        its credit; else None): a posted write then needs no task to finish it."""
        dev = mr._dev
        assert dev is not None
        line = self._ipc_line(dev.device)
        user = None if stream is None else self.b.own_stream(stream, line.device)
        # a lane's entries must be published in order, by one stream (the first IPC line, which
        # paged writes use too): a write on another of ``ipc_streams`` is credited by a message
        first = line is self._line(self._out, dev.device)
        return self._ipc_enqueue(mr, rdesc, peer, length, src_offset, dst_offset, imm, line, user, first)

    def _ipc_enqueue(
        self, mr: MemoryRegion, rdesc: MemoryDescriptor, peer: int, length: int, src_offset: int,
        dst_offset: int, imm: int | None, line: _Line, user: Any, first: bool,
    ) -> tuple[_Finish, Any]:
        """:meth:`_ipc_write` on ``line`` (``first``: the device's first IPC line, whose fence
        may publish the credit through a lane), after the work on ``user`` (the backend's
        stream of the caller's, or None)."""
        dev = mr._dev
        assert dev is not None
        self.counts["gpu_ipc"] += 1
        if user is not None:
            self.b.wait(line.stream, user)
        if length:
            self.b.copy(peer + dst_offset, dev.ptr + src_offset, length, line.stream)
            line.expect(length, alone=user is None)
        ev = self.e._event()
        credit = self._track_credit(mr, line, ev.set, dev.device, rdesc, imm if first else None, 1)

        async def finish(timeout: float | None, retry: Any) -> None:
            await self._credited(ev, credit, rdesc, imm, 1, dev.device, timeout, retry)

        return finish, (ev if imm is None or credit is not None else None)

    def keep_ipc(self, mr: MemoryRegion, rdesc: MemoryDescriptor, stream: Any) -> None:
        """Keeps the lookups of a CUDA-IPC write just started from ``mr`` to the descriptor
        object ``rdesc`` after ``stream``'s work, for :meth:`post_kept` to repeat it: the peer's
        mapped address, the line, the caller's stream as the backend's. Only with one IPC line
        per device (the default: every such write goes on it). At most 256 kept; unregistering
        ``mr`` drops its own (:meth:`forget`)."""
        dev = mr._dev
        if self.ipc_streams != 1 or dev is None:
            return
        peer = self._ipc_ptr(rdesc, dev.device)
        if peer is None:
            return
        user = None if stream is None else self.b.own_stream(stream, dev.device)
        if len(self._kept) >= 256:
            self._kept.clear()
        line = self._line(self._out, dev.device)
        self._kept[(id(mr), id(rdesc), id(stream))] = _KeptIpc(mr, rdesc, stream, user, peer, line)

    def post_kept(
        self, mr: Any, remote: Any, stream: Any, length: Any, src_offset: Any, dst_offset: Any, imm: Any
    ) -> tuple[_Finish, Any] | None:
        """A CUDA-IPC write repeated from the same region to the same descriptor object after
        the same stream's work (:meth:`keep_ipc`), started as :meth:`_ipc_write` starts it;
        None (nothing done: the caller takes the full path, which validates and raises) unless
        the region is still registered and every argument is a plain int in range, with at
        least one byte. Saves the full path's validation layers and lookups (about 20 Python
        calls of an MoE step's post)."""
        k = self._kept.get((id(mr), id(remote), id(stream)))
        if k is None or k.mr is not mr or k.rdesc is not remote or k.stream is not stream:
            return None
        if mr._handle is None:  # unregistered since
            return None
        if type(length) is not int or type(src_offset) is not int or type(dst_offset) is not int:
            return None
        if length <= 0 or src_offset < 0 or dst_offset < 0:
            return None
        if src_offset + length > mr.nbytes or dst_offset + length > remote.length:
            return None
        if not _plain_imm(imm):
            return None
        line, user = k.line, k.user
        return self._ipc_enqueue(mr, remote, k.peer, length, src_offset, dst_offset, imm, line, user, True)


class _KeptIpc:
    """What :meth:`IpcWrites.post_kept` repeats a CUDA-IPC write with: the region, the
    descriptor object and the caller's stream it was made for (held: their ``id`` is the key),
    the caller's stream as the backend's, the peer's mapped address, the line."""

    __slots__ = ("line", "mr", "peer", "rdesc", "stream", "user")

    def __init__(self, mr: MemoryRegion, rdesc: MemoryDescriptor, stream: Any, user: Any, peer: int,
                 line: _Line) -> None:
        self.mr, self.rdesc, self.stream = mr, rdesc, stream
        self.user, self.peer, self.line = user, peer, line
