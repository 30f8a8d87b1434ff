"""Memory registration: host buffers, the host arena, GPU regions (through GpuSupport)."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, cast

import anyio
import numpy as np

from .._native import ffi, lib
from ._descriptor import (
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    DEVICE_HOST,
    DirectExtent,
    GpuExtent,
    MemoryDescriptor,
    _RemoteKey,
)
from ._errors import InvalidArgument, RegionBusy, RegistrationError
from ._gpu import GpuOwner, GpuSupport, UvmWatcher
from ._memory import MemoryRegion, host_buffer
from ._records import _is_gpu_buffer
from ._state import EngineState
from ._util import as_index, now
from ._wire import _FI_EBUSY, _strerror


class Registration(EngineState):
    """Memory registration: host buffers, the host arena, GPU regions."""

    # ------------------------------------------------------------------ memory

    def alloc_host(self, shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray[Any, Any]:
        """A zero-filled, C-contiguous NumPy array of ``shape`` and ``dtype`` in this engine's
        host arena (``open_engine(host_arena=)``): register it like any array. Same-host peers
        map the arena, so their writes into it and reads out of it are one ``memcpy`` by their
        poller thread (under the same key, bounds and rights checks as every access), instead
        of a cross-process copy (``process_vm_writev`` / ``readv``): the fastest same-host path.
        A bare immediate, and a request that gathers several local pieces, go through shm after
        the same checks. Peers on other hosts, or without ``same_host_direct``, see an ordinary
        region.

        Its memory (page-rounded) returns to the arena when the array and every view of it
        are gone. Where the engine has no arena, or it has no free range that large, returns
        an ordinary ``numpy.zeros`` array (the latter logged once), which works the same,
        through shm. Raises :class:`InvalidArgument` (bad shape or dtype),
        :class:`EngineClosed`. Costs O(free ranges) and no system call; pages are allocated
        when first touched."""
        self._check_open()
        try:
            dt = np.dtype(dtype)
            dims = shape if isinstance(shape, Sequence) else (shape,)
            shp = tuple(operator.index(x) for x in dims)
        except TypeError as e:
            raise InvalidArgument(f"alloc_host: {e}") from None
        if any(x < 0 for x in shp) or dt.itemsize == 0 or dt.hasobject:
            raise InvalidArgument(f"alloc_host: shape {shp} must be >= 0 and dtype {dt} plain data")
        nbytes = math.prod(shp) * dt.itemsize
        if self._arena is None or not nbytes:
            return np.zeros(shp, dt)
        out = self._arena.alloc(nbytes, dt, shp)
        if out is None:
            if not self._arena_full_logged:
                self._arena_full_logged = True
                self._log.warning("host arena full: alloc_host returns ordinary memory", nbytes=nbytes)
            return np.zeros(shp, dt)
        return out

    def alloc_gpu(self, nbytes: int, *, device: int = 0) -> Any:
        """A zero-filled GPU array of ``nbytes`` bytes (``uint8``; a CuPy array, or with
        ``gpu_backend="host"`` an emulated one) on GPU ``device``, made to be written by
        same-host peers: register it like any GPU array, and a peer's CUDA-IPC rail maps it
        through a file descriptor it fetches from this process (the CUDA virtual-memory API)
        instead of ``cudaIpcOpenMemHandle``, so copies into it run at the link's pace even
        from a source the peer has just written (docs/gpu.md). Peers on other hosts, or that
        cannot fetch the descriptor, stage as for any GPU region.

        The memory is freed when the array and every view of it are gone (a registered
        region keeps it); a peer that mapped it keeps its mapping until it closes. Raises
        :class:`InvalidArgument` (``nbytes`` not a positive int), :class:`GpuUnavailable`,
        :class:`AioteError` (the driver refused, e.g. out of memory), :class:`EngineClosed`.
        Costs one ``cuMemCreate`` (the size rounded up to the GPU's granularity, 2 MiB),
        a mapping, a fill, and, for the first such allocation of the process, a thread
        blocked on a Unix socket that hands the descriptor to peers of the same user."""
        self._check_open()
        n = as_index(nbytes, "nbytes", lo=1)
        dev = as_index(device, "device", hi=1 << 16)
        return self._gpu_support().b.alloc(n, dev)

    async def register(
        self, buffer: Any, *, remote_write: bool = True, remote_read: bool = True
    ) -> MemoryRegion:
        """Registers a host or GPU buffer with every NIC of the engine.

        ``buffer``: a C-contiguous NumPy array or buffer-protocol object, or GPU memory (a CuPy
        array, anything with ``__cuda_array_interface__`` or CUDA ``__dlpack__``); it must be
        writable when ``remote_write`` is set. The region keeps a reference to it. Peers may
        write into it only with ``remote_write``, read it only with ``remote_read``.

        GPU memory: the descriptor says which GPU. On providers without CUDA memory support
        (tcp, shm: every provider Debian ships) the engine allocates a pinned host shadow of
        the same size, registers that with the NICs and stages transfers through it, in
        chunks, invisibly (see docs/gpu.md); peers on the same host reach the GPU memory
        directly through CUDA IPC.

        Raises :class:`InvalidArgument` (non-contiguous, read-only for remote write, empty, not
        a buffer), :class:`GpuUnavailable` (GPU memory without CuPy or a GPU),
        :class:`RegistrationError` (the provider refused), :class:`EngineClosed`. Costs one
        provider registration per NIC (pins the pages on RDMA hardware); GPU memory also
        costs a pinned host allocation of its size.
        """
        self._check_open()
        if _is_gpu_buffer(buffer):
            return await self._gpu_support().register(buffer, remote_write, remote_read)
        obj, nbytes = host_buffer(buffer, writable=remote_write)
        mr = await self._register_native(obj, obj, nbytes, remote_write, remote_read, DEVICE_HOST, 0, None)
        mr.writable = not memoryview(obj).readonly
        return mr

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
    ) -> MemoryRegion:
        """Registers host memory ``host`` with every NIC; the region's buffer is ``owner``.
        ``dev``: (address, memory interface) of device memory the NICs register directly."""
        h = self._check_open()
        access = (ACCESS_REMOTE_WRITE if remote_write else 0) | (ACCESS_REMOTE_READ if remote_read else 0)
        out = ffi.new("aio_mr**")
        err = ffi.new("char[512]")
        if dev is None:
            cbuf = ffi.from_buffer("char[]", host, require_writable=remote_write)
            rc = lib.aio_mr_register(h, cbuf, nbytes, access, out, err, 512)
        else:
            cbuf = ffi.cast("void*", dev[0])
            rc = lib.aio_mr_register_dev(h, cbuf, nbytes, access, dev[1], device_id, out, err, 512)
        if rc != 0:
            raise RegistrationError(ffi.string(err).decode(errors="replace") or _strerror(-rc))
        mrh = out[0]
        # a region peers may not access publishes neither its key nor its address
        keys = tuple(
            _RemoteKey(
                r.provider,
                r.address,
                int(lib.aio_mr_remote_base(mrh, i)) if access else 0,
                int(lib.aio_mr_key(mrh, i)) if access else 0,
            )
            for i, r in enumerate(self._rails)
        )
        direct = None
        if self._direct_info is not None and dev is None and device_kind == DEVICE_HOST and access:
            slot = int(lib.aio_mr_direct_slot(mrh))
            if slot >= 0:
                first = min(self._shm_rails)
                direct = DirectExtent(*self._direct_info, slot, keys[first].key)
        host = self._address.host_id
        limit = self._max_message
        desc = MemoryDescriptor(nbytes, access, device_kind, device_id, host, keys, gpu, direct, limit)
        mr = MemoryRegion(self, owner, cbuf, mrh, nbytes, desc, remote_write, remote_read)
        mr._ptr = int(ffi.cast("uintptr_t", mrh))
        self._regions.add(mr)
        await anyio.lowlevel.checkpoint()
        return mr

    def _gpu_support(self) -> GpuSupport:
        if self._gpu is None:
            backend, chunk, ipc, direct, ipc_streams = self._gpu_cfg
            if direct is None:  # register GPU memory with the NICs when every NIC can
                direct = backend == "cuda" and all(lib.aio_rail_hmem(self._h, r.index) for r in self._rails)
            # the GPU side calls up into the messages and transfers layers: only the whole
            # Engine (the one class instantiated) is a GpuOwner
            owner = cast("GpuOwner", self)
            self._gpu = GpuSupport(
                owner, backend, chunk=chunk, ipc=ipc, direct=direct, ipc_streams=ipc_streams
            )
        return self._gpu

    def uvm_watcher(self, *, initial: int = 0) -> UvmWatcher:
        """A new :class:`UvmWatcher`: a 64-bit word in host-mapped pinned memory that GPU
        kernels store to and tasks await. Raises :class:`GpuUnavailable` without CuPy and a
        GPU. Costs one word of a pinned page (512 words per page)."""
        self._check_open()
        return self._gpu_support().watcher(as_index(initial, "initial", hi=1 << 64))

    async def unregister(self, mr: MemoryRegion, *, timeout: float | None = None) -> None:
        """Unregisters a region. Waits while work requests that touch it are in flight (they
        keep the buffer alive); raises :class:`RegionBusy` if they are still in flight after
        ``timeout`` seconds (``timeout=0``: raise at once; without a timeout, once they made no
        progress for the retry policy's ``stall_timeout``), :class:`InvalidArgument` if it is not
        a registered region of this engine, :class:`EngineClosed`. Peers' later accesses fail at
        their side. Costs one native call that closes the provider registration on each NIC
        (O(NICs)); while the region is busy it polls with back-off from 0.5 ms to 20 ms.

        While it waits, same-host peers' new direct copies into or out of the region are refused
        (they fail with :class:`RemoteAccessError` at the peer), so that those in flight drain.
        If it raises :class:`RegionBusy`, nothing changed: the region is still registered and
        fully usable by this engine and by every peer (their copies are admitted again), and a
        later ``unregister`` starts over."""
        h = self._handle()
        if not isinstance(mr, MemoryRegion) or mr._engine is not self:
            raise InvalidArgument("not a memory region of this engine")
        if mr._handle is None:
            raise InvalidArgument("the region is already unregistered (unregister each region once)")
        start = moved = now()
        last: tuple[int, int] | None = None
        delay = 0.0005
        try:
            while True:
                if lib.aio_mr_inflight(mr._handle) == 0 and mr._dev_pending == 0:
                    handle, mr._handle = mr._handle, None
                    rc = lib.aio_mr_close(h, handle)
                    if rc == 0:
                        break
                    mr._handle = handle
                    if rc != -_FI_EBUSY:  # pragma: no cover - the provider refused to close
                        raise RegionBusy(f"unregister failed: {_strerror(-rc)}")
                    # a same-host peer is copying into or out of it directly (new copies are
                    # refused from now on): wait like for our own requests
                busy = (int(lib.aio_mr_inflight(mr._handle)), mr._dev_pending)
                if busy != last:
                    last, moved = busy, now()
                stall = self._retry.stall_timeout
                if timeout is None and stall is not None and now() - moved >= stall:
                    raise RegionBusy(
                        f"{busy[0]} work requests and {busy[1]} GPU copies on the region made no "
                        f"progress for stall_timeout={stall:g} s (a peer stopped or gone that the "
                        "transport still owns them for); the region stays registered and usable"
                    )
                if timeout is not None and now() - start >= timeout:
                    raise RegionBusy(
                        f"{int(lib.aio_mr_inflight(mr._handle))} work requests and {mr._dev_pending} GPU "
                        "copies on the region are still in flight, or a same-host peer is copying into it; "
                        "wait for them or retry unregister later (the region stays registered and usable)"
                    )
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.02)
                h = self._handle()
                if mr._handle is None:
                    raise InvalidArgument("the region was unregistered meanwhile")
        except BaseException:
            # RegionBusy, cancelled, closed: the region stays as it was, fully usable (its
            # direct copies, refused while this call waited, are admitted again)
            if mr._handle is not None and not self._closed:
                lib.aio_mr_reopen(self._h, mr._handle)
            raise
        self._regions.discard(mr)
        mr._memos.clear()
        if self._gpu is not None:
            self._gpu.forget(mr)
        await anyio.lowlevel.checkpoint()
