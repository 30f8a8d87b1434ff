"""Device-memory backends: what the engine needs from CUDA, behind one small interface.

``CudaBackend`` drives CuPy (imported only when a GPU buffer is first registered, so importing
aiote never needs CUDA). ``HostBackend`` runs the same stream semantics on host memory, for
machines without a GPU: its "device" arrays are :class:`aiote.testing.HostDeviceArray`, its
streams are worker threads that execute copies in order, and its signals are plain stores to
host words, exactly what a GPU kernel does to host-mapped memory. The engine's staging
pipeline, its credit ordering and the poller's watched words run unchanged on either.

Every operation a backend offers is asynchronous in stream order (``copy``, ``signal``,
``paged_copy``, ``wait``) and never blocks the event loop; completion is learnt only through
``signal``: a store of a value to a host word that the native poller watches.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _vmm
from ._errors import AioteError, InvalidArgument
from ._log import get_logger

# a credit lane's stores after a copy: (entry address, entry, head address, head)
Credit = tuple[int, int, int, int]

__all__ = ["CudaBackend", "Credit", "DeviceBuffer", "GpuUnavailable", "HostBackend", "device_backend"]


_log = get_logger(component="gpu")


class GpuUnavailable(AioteError):
    """GPU memory was used but CUDA is not usable here (no CuPy, no GPU, or no driver)."""


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """A contiguous device buffer: its address, size, device ordinal and owner object."""

    ptr: int
    nbytes: int
    device: int
    readonly: bool
    owner: Any


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim > 1 and stride != expect:
            return False
        expect *= dim
    return True


def cuda_interface(obj: Any) -> tuple[int, int, bool] | None:
    """(ptr, nbytes, readonly) from ``__cuda_array_interface__``; None if the object has
    none. Raises :class:`InvalidArgument` for non-contiguous or empty arrays."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    ptr, readonly = cai["data"]
    shape = tuple(int(d) for d in cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if not _c_contiguous(shape, None if strides is None else tuple(strides), itemsize):
        raise InvalidArgument(
            "the GPU array is not C-contiguous; register a contiguous array (cupy.ascontiguousarray)"
        )
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        raise InvalidArgument("cannot register an empty buffer")
    return int(ptr), int(nbytes), bool(readonly)


class _Backend:
    """The interface (see the module docstring). ``stream`` objects are opaque."""

    kind = "none"

    def buffer(self, obj: Any) -> DeviceBuffer:
        raise NotImplementedError

    def pinned(self, nbytes: int) -> np.ndarray:
        """Host memory the device can reach (page-locked and mapped), as uint8."""
        raise NotImplementedError

    def word_address(self, arr: np.ndarray, index: int) -> int:
        """The address a device store must use for word ``index`` of pinned ``arr``."""
        return int(arr.ctypes.data) + 8 * index

    def stream(self, device: int) -> Any:
        raise NotImplementedError

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        raise NotImplementedError

    def paged_copy(
        self, dst: int, src: int, dst_offs: np.ndarray, src_offs: np.ndarray, page: int, stream: Any
    ) -> None:
        raise NotImplementedError

    def signal(
        self, stream: Any, word: int, value: int, credit: Credit | None = None, stores: bool = True
    ) -> None:
        """Stores ``value`` into ``word`` after the stream's work so far; with ``credit``
        (entry address, entry, head address, head: a credit lane's, see ``_lanes``), first the
        entry, then the head. ``stores``: the stream may make the stores itself (False: a
        kernel makes them, which does not hold back copies on other streams)."""
        raise NotImplementedError

    def map_host(self, ptr: int, nbytes: int) -> int:
        """Makes host memory (a shared mapping) reachable by device stores; its device address."""
        return ptr

    def unmap_host(self, ptr: int) -> None:
        """Undoes :meth:`map_host`."""

    def wait(self, stream: Any, other: Any) -> None:
        """``stream`` runs nothing more until the work submitted to ``other`` so far is done."""
        raise NotImplementedError

    def alloc(self, nbytes: int, device: int) -> Any:
        """A zero-filled GPU array of ``nbytes`` on ``device`` that same-host peers map
        through a shared descriptor (:mod:`._vmm`)."""
        raise NotImplementedError

    def ipc_export(self, buf: DeviceBuffer) -> tuple[bytes, int]:
        """A handle another process on this host can open, and ``buf``'s offset in it."""
        raise NotImplementedError

    def ipc_open(self, handle: bytes, device: int) -> int:
        raise NotImplementedError

    def ipc_close(self, base: int) -> None:
        raise NotImplementedError

    def own_stream(self, s: Any, device: int) -> Any:
        """Converts a user's stream argument into one of this backend's streams."""
        return s

    def close_stream(self, s: Any) -> None:
        """Releases a stream made by :meth:`stream` (its submitted work still runs)."""


# ---------------------------------------------------------------------------------- CUDA

_CURRENT = contextlib.nullcontext()  # (reusable: see CudaBackend._on)

_SIGNAL_SRC = r"""
extern "C" __global__ void aiote_signal(unsigned long long *word, unsigned long long value) {
    __threadfence_system();
    *((volatile unsigned long long *)word) = value;
    __threadfence_system();
}

extern "C" __global__ void aiote_signal_credit(unsigned long long *word, unsigned long long value,
                                               unsigned long long *entry, unsigned long long ev,
                                               unsigned long long *head, unsigned long long hv) {
    /* a credit lane (aiote/_core/_lanes.py): the entry, then the head the owner's poller reads */
    __threadfence_system();
    *((volatile unsigned long long *)entry) = ev;
    __threadfence_system();
    *((volatile unsigned long long *)head) = hv;
    *((volatile unsigned long long *)word) = value;
    __threadfence_system();
}

extern "C" __global__ void aiote_paged_copy16(const char *src, char *dst, const long long *soff,
                                              const long long *doff, long long n, long long page) {
    /* one block per (page, 32 KiB segment): many independent 16-byte loads in flight per
     * thread, so NVLink/PCIe stay busy */
    const long long seg = 32768;
    long long segs = (page + seg - 1) / seg;
    for (long long b = blockIdx.x; b < n * segs; b += gridDim.x) {
        long long p = b / segs, s0 = (b % segs) * seg;
        long long len = page - s0 < seg ? page - s0 : seg;
        const int4 *s = (const int4 *)(src + soff[p] + s0);
        int4 *d = (int4 *)(dst + doff[p] + s0);
        long long words = len >> 4;
        long long i = threadIdx.x;
        for (; i + 3 * blockDim.x < words; i += 4 * blockDim.x) {
            int4 a0 = s[i], a1 = s[i + blockDim.x], a2 = s[i + 2 * blockDim.x], a3 = s[i + 3 * blockDim.x];
            d[i] = a0; d[i + blockDim.x] = a1; d[i + 2 * blockDim.x] = a2; d[i + 3 * blockDim.x] = a3;
        }
        for (; i < words; i += blockDim.x) d[i] = s[i];
    }
}

extern "C" __global__ void aiote_paged_copy1(const char *src, char *dst, const long long *soff,
                                             const long long *doff, long long n, long long page) {
    for (long long p = blockIdx.x; p < n; p += gridDim.x) {
        const char *s = src + soff[p];
        char *d = dst + doff[p];
        for (long long i = threadIdx.x; i < page; i += blockDim.x) d[i] = s[i];
    }
}
"""


class CudaBackend(_Backend):
    """CUDA through CuPy. Raises :class:`GpuUnavailable` when CuPy or a GPU is missing."""

    kind = "cuda"

    def __init__(self) -> None:
        try:
            import cupy  # type: ignore[import-not-found,unused-ignore]
        except Exception as exc:  # ImportError, or a CUDA library that fails to load
            raise GpuUnavailable(
                f"GPU memory needs CuPy and a CUDA GPU ({exc}); pip install 'aiote[gpu]'"
            ) from None
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise GpuUnavailable(f"no usable CUDA device: {exc}") from None
        if n == 0:
            raise GpuUnavailable("no CUDA device is visible")
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self._streams: dict[int, Any] = {}
        self._mods: dict[int, Any] = {}
        self._fns: dict[tuple[int, str], Any] = {}
        self._wait_events: dict[tuple[int, int], Any] = {}  # (thread, device): see wait
        self._memops: dict[int, Any] = {}  # device -> cuStreamWriteValue64, or None: see signal
        self._libcuda: Any = None
        self._vmm_api: _vmm.CudaVmm | None = None

    def _module(self, device: int) -> Any:
        mod = self._mods.get(device)
        if mod is None:
            with self.cp.cuda.Device(device):
                mod = self.cp.RawModule(code=_SIGNAL_SRC)
                mod.get_function("aiote_signal")  # compile now, not on the first transfer
            self._mods[device] = mod
        return mod

    def _fn(self, device: int, name: str) -> Any:
        key = (device, name)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._module(device).get_function(name)
        return fn

    def buffer(self, obj: Any) -> DeviceBuffer:
        if getattr(obj, "__cuda_array_interface__", None) is None and hasattr(obj, "__dlpack__"):
            obj = self.cp.from_dlpack(obj)
        info = cuda_interface(obj)
        if info is None:
            raise InvalidArgument(f"{type(obj).__name__} is not GPU memory")
        ptr, nbytes, readonly = info
        attrs = self.rt.pointerGetAttributes(ptr)
        if attrs.type != 2:  # cudaMemoryTypeDevice
            raise InvalidArgument(
                "only device memory (cudaMalloc, CuPy's default pool) can be registered as GPU memory; "
                "managed and host memory are not supported"
            )
        return DeviceBuffer(ptr, nbytes, int(attrs.device), readonly, obj)

    def pinned(self, nbytes: int) -> np.ndarray:
        # cudaHostAllocPortable | cudaHostAllocMapped: every device can reach it; the array's
        # base holds the allocation, freed with the last view
        pm = self.cp.cuda.pinned_memory
        mem = pm.PinnedMemory(max(nbytes, 8), 3)
        return np.frombuffer(pm.PinnedMemoryPointer(mem, 0), dtype=np.uint8, count=nbytes)

    # word_address: the host address itself (unified addressing: page-locked memory from
    # cudaHostAlloc has the same address on the device)

    def stream(self, device: int) -> Any:
        with self.cp.cuda.Device(device):
            return self.cp.cuda.Stream(non_blocking=True)

    def _on(self, device: int) -> Any:
        """A context on ``device``: none to enter (the calls of a write's path, each cost
        microseconds) when it is the current device already."""
        return _CURRENT if self.rt.getDevice() == device else self.cp.cuda.Device(device)

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        with self._on(stream.device_id):
            self.rt.memcpyAsync(dst, src, nbytes, 4, stream.ptr)  # cudaMemcpyDefault

    def paged_copy(
        self, dst: int, src: int, dst_offs: np.ndarray, src_offs: np.ndarray, page: int, stream: Any
    ) -> None:
        n = len(dst_offs)
        if n == 0:
            return
        dev = stream.device_id
        aligned = page % 16 == 0 and dst % 16 == 0 and src % 16 == 0
        aligned = aligned and not (np.any(dst_offs % 16) or np.any(src_offs % 16))
        fn = self._fn(dev, "aiote_paged_copy16" if aligned else "aiote_paged_copy1")
        with self.cp.cuda.Device(dev), stream:
            so = self.cp.asarray(src_offs.astype(np.int64, copy=False))
            do = self.cp.asarray(dst_offs.astype(np.int64, copy=False))
            blocks = int(min(n * max(1, -(-page // 32768)), 1 << 20))
            args = (np.uint64(src), np.uint64(dst), so, do, np.int64(n), np.int64(page))
            fn((blocks,), (512,) if aligned else (256,), args)
            # the index arrays may be dropped now: CuPy's pool hands their blocks out again
            # only to later work on this same stream

    def signal(
        self, stream: Any, word: int, value: int, credit: Credit | None = None, stores: bool = True
    ) -> None:
        # stores by the stream itself (cuStreamWriteValue64, each after a system-wide fence
        # over the stream's earlier work: what the kernels below do, for 2 µs of host time
        # where a launch takes 6.5); kernels where the driver refuses them, and where copies
        # run on several streams at once (``stores`` False): a stream's fence then held the
        # others' copies back (2 x H200: a flat 2.18 GB push over 4 streams at 0.80 of the
        # ceiling with stores, 0.92 with kernels; over one stream with stores 0.92-0.95)
        dev = stream.device_id
        with self._on(dev):
            put = self._memop(dev) if stores else None
            if put is not None:
                s = stream.ptr
                rc = 0
                if credit is not None:
                    entry, ev, head, hv = credit
                    rc = put(s, entry, ev, 0) or put(s, head, hv, 0)
                rc = rc or put(s, word, value, 0)
                if not rc:
                    return
                # a store refused (memory the probe did not cover, e.g. a lane's registered
                # file): kernels from now on, and this fence again in full by the kernel (the
                # stores already enqueued repeat the same values, in stream order)
                _log.warning("a stream store was refused; GPU fences use a kernel", device=dev, result=rc)
                self._memops[dev] = None
            if credit is None:
                self._fn(dev, "aiote_signal")((1,), (1,), (np.uint64(word), np.uint64(value)), stream=stream)
            else:
                args = (np.uint64(word), np.uint64(value), *(np.uint64(v) for v in credit))
                self._fn(dev, "aiote_signal_credit")((1,), (1,), args, stream=stream)

    def _memop(self, device: int) -> Any:
        """The driver's ``cuStreamWriteValue64`` when it works on ``device`` (tried once per
        device: a store through a new stream, read back), else None (the kernels then)."""
        put = self._memops.get(device, False)
        if put is not False:
            return put
        put = None
        try:
            fn = self._cuda().cuStreamWriteValue64_v2
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            probe = self.pinned(8)
            with self.cp.cuda.Device(device):
                s = self.cp.cuda.Stream(non_blocking=True)
                rc = fn(s.ptr, probe.ctypes.data, 0x5A5A_0001, 0)
                if rc == 0:
                    s.synchronize()
                    if int(probe.view(np.uint64)[0]) == 0x5A5A_0001:
                        put = fn
                else:
                    _log.info("stream memory operations refused; GPU fences use a kernel", result=rc)
        except Exception as exc:  # no such entry point, or a driver that refuses memory ops
            _log.info("stream memory operations unavailable; GPU fences use a kernel", reason=str(exc))
        self._memops[device] = put
        return put

    def map_host(self, ptr: int, nbytes: int) -> int:
        self.rt.hostRegister(ptr, nbytes, 3)  # cudaHostRegisterPortable | cudaHostRegisterMapped
        out = ctypes.c_uint64()
        rc = self._cuda().cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(ptr), 0)
        if rc != 0:
            self.rt.hostUnregister(ptr)
            raise AioteError(f"cuMemHostGetDevicePointer failed ({rc})")
        return int(out.value)

    def unmap_host(self, ptr: int) -> None:
        self.rt.hostUnregister(ptr)

    def wait(self, stream: Any, other: Any) -> None:
        # one event per thread and current device, recorded again each time: a stream's wait
        # takes the event's state when it is enqueued, so reuse costs no new CUDA event
        key = (threading.get_ident(), self.rt.getDevice())
        ev = self._wait_events.get(key)
        if ev is None:
            ev = self._wait_events[key] = self.cp.cuda.Event(disable_timing=True)
        ev.record(other)
        stream.wait_event(ev)

    def _cuda(self) -> Any:
        if self._libcuda is None:
            self._libcuda = ctypes.CDLL("libcuda.so.1")
        return self._libcuda

    def _driver_vmm(self) -> _vmm.CudaVmm:
        if self._vmm_api is None:
            self._vmm_api = _vmm.CudaVmm(self._cuda())
        return self._vmm_api

    def alloc(self, nbytes: int, device: int) -> Any:
        cp, vmm = self.cp, self._driver_vmm()
        with cp.cuda.Device(device):
            self.rt.free(0)  # the device's primary context, which the driver calls below use
            rec = vmm.alloc(nbytes, device)
            try:
                mem = cp.cuda.UnownedMemory(rec.base, rec.size, rec, device_id=device)
                arr = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
                arr.fill(0)
                cp.cuda.get_current_stream().synchronize()  # zeroed before a peer can write it
                _vmm.publish(rec)
            except BaseException:
                _free_vmm(vmm, rec.base, rec.fd, rec.token, device, cp)
                raise
        weakref.finalize(rec, _free_vmm, vmm, rec.base, rec.fd, rec.token, device, cp)
        return arr

    def ipc_export(self, buf: DeviceBuffer) -> tuple[bytes, int]:
        rec = _vmm.lookup(buf.ptr)
        if rec is not None:
            return _vmm.handle(rec, buf.ptr)
        base = ctypes.c_uint64()
        size = ctypes.c_size_t()
        with self.cp.cuda.Device(buf.device):
            rc = self._cuda().cuMemGetAddressRange_v2(
                ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(buf.ptr)
            )
            if rc != 0:
                raise AioteError(f"cuMemGetAddressRange failed ({rc})")
            handle = bytes(self.rt.ipcGetMemHandle(base.value))
        return handle, buf.ptr - base.value

    def ipc_open(self, handle: bytes, device: int) -> int:
        with self.cp.cuda.Device(device):
            if _vmm.is_handle(handle):
                self.rt.free(0)  # the device's primary context
                return self._driver_vmm().open(handle, device)
            return int(self.rt.ipcOpenMemHandle(handle, 1))  # cudaIpcMemLazyEnablePeerAccess

    def ipc_close(self, base: int) -> None:
        if self._vmm_api is None or not self._vmm_api.close(base):
            self.rt.ipcCloseMemHandle(base)

    def own_stream(self, s: Any, device: int) -> Any:
        if isinstance(s, self.cp.cuda.Stream):
            return s
        ptr = getattr(s, "cuda_stream", None)  # torch.cuda.Stream
        if ptr is None and isinstance(s, int):
            ptr = s
        if ptr is None:
            raise InvalidArgument(
                f"stream must be a cupy.cuda.Stream, a torch stream or a raw handle, not {type(s).__name__}"
            )
        return self.cp.cuda.ExternalStream(int(ptr), device)


# ---------------------------------------------------------------------------------- host


class _HostStream:
    """A stream on host memory: a worker thread executing submitted work in order."""

    def __init__(self, device: int, delay: float) -> None:
        self.device = device
        self.delay = delay
        self.q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.t = threading.Thread(target=self._run, name=f"aiote-hoststream-{device}", daemon=True)
        self.t.start()

    def close(self) -> None:
        self.q.put(None)

    def _run(self) -> None:
        while True:
            fn = self.q.get()
            if fn is None:
                return
            fn()

    def submit(self, fn: Callable[[], None], *, slow: bool = False) -> None:
        if slow and self.delay:
            d = self.delay

            def delayed() -> None:
                time.sleep(d)
                fn()

            self.q.put(delayed)
        else:
            self.q.put(fn)


class HostBackend(_Backend):
    """CUDA's stream semantics on host memory (for machines without a GPU). ``delay``: seconds
    each copy takes, to make ordering bugs visible."""

    kind = "host"

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def buffer(self, obj: Any) -> DeviceBuffer:
        info = cuda_interface(obj)
        if info is None:
            raise InvalidArgument(f"{type(obj).__name__} is not (emulated) GPU memory")
        ptr, nbytes, readonly = info
        return DeviceBuffer(ptr, nbytes, int(getattr(obj, "device_id", 0)), readonly, obj)

    def pinned(self, nbytes: int) -> np.ndarray:
        raw = np.zeros(max(nbytes, 8) + 64, dtype=np.uint8)
        off = (-raw.ctypes.data) % 64
        return raw[off : off + nbytes]

    def stream(self, device: int) -> Any:
        return _HostStream(device, self.delay)

    def close_stream(self, s: Any) -> None:
        s.close()

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        stream.submit(lambda: ctypes.memmove(dst, src, nbytes), slow=True)

    def paged_copy(
        self, dst: int, src: int, dst_offs: np.ndarray, src_offs: np.ndarray, page: int, stream: Any
    ) -> None:
        d = [int(x) for x in dst_offs]
        s = [int(x) for x in src_offs]

        def run() -> None:
            for a, b in zip(d, s, strict=True):
                ctypes.memmove(dst + a, src + b, page)

        stream.submit(run, slow=True)

    def signal(
        self, stream: Any, word: int, value: int, credit: Credit | None = None, stores: bool = True
    ) -> None:
        def store() -> None:  # what the GPU does: plain stores, nobody is kicked
            if credit is not None:
                entry, ev, head, hv = credit
                ctypes.c_uint64.from_address(entry).value = ev
                ctypes.c_uint64.from_address(head).value = hv
            ctypes.c_uint64.from_address(word).value = value

        stream.submit(store)

    def wait(self, stream: Any, other: Any) -> None:
        if stream is other:
            return
        done = threading.Event()
        other.submit(done.set)
        stream.submit(lambda: done.wait(60))

    def alloc(self, nbytes: int, device: int) -> Any:
        return _vmm.HostFdArray(nbytes, device)

    def ipc_export(self, buf: DeviceBuffer) -> tuple[bytes, int]:
        rec = _vmm.lookup(buf.ptr)
        if rec is not None:
            return _vmm.handle(rec, buf.ptr)
        name = getattr(buf.owner, "shm_name", None)
        if not name:
            raise InvalidArgument(
                "this emulated GPU array was not allocated shareable (HostDeviceArray(shared=True))"
            )
        return name.encode().ljust(64, b"\0"), int(getattr(buf.owner, "shm_offset", 0))

    def ipc_open(self, handle: bytes, device: int) -> int:
        from multiprocessing import shared_memory

        if _vmm.is_handle(handle):
            return _vmm.host_open(handle)
        name = handle.rstrip(b"\0").decode()
        shm = shared_memory.SharedMemory(name=name)
        _SHM_OPEN[id(shm)] = shm
        buf: Any = shm.buf
        base = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        _SHM_BY_BASE[base] = shm
        return base

    def ipc_close(self, base: int) -> None:
        if _vmm.host_close(base):
            return
        shm = _SHM_BY_BASE.pop(base, None)
        if shm is not None:
            _SHM_OPEN.pop(id(shm), None)
            with contextlib.suppress(BufferError):  # a view is still exported: unmapped at exit
                shm.close()

    def own_stream(self, s: Any, device: int) -> Any:
        if not isinstance(s, _HostStream):
            raise InvalidArgument(f"stream must be a stream of this backend, not {type(s).__name__}")
        return s


class IpcMaps:
    """Peers' GPU allocations opened in this process (CUDA IPC), one mapping per (host,
    handle, device), kept until :meth:`close`; an allocation that cannot be opened is
    remembered as such (its writes are staged)."""

    def __init__(self, backend: _Backend) -> None:
        self.b = backend
        self._bases: dict[tuple[bytes, bytes, int], int] = {}

    def base(self, host_id: bytes, handle: bytes, device: int) -> int | None:
        """The allocation's address here, opened on first use; None when it cannot be
        opened (logged once)."""
        key = (host_id, handle, device)
        base = self._bases.get(key)
        if base is None:
            try:
                base = self.b.ipc_open(handle, device)
            except Exception as exc:
                _log.info("CUDA IPC open failed; staging instead", reason=str(exc))
                base = 0
            self._bases[key] = base
        return base or None

    def close(self, keep_mapped: bool) -> None:
        """Closes every mapping, unless ``keep_mapped`` (a copy may still write there)."""
        for base in self._bases.values():
            if base and not keep_mapped:
                with contextlib.suppress(Exception):  # best effort at close
                    self.b.ipc_close(base)
        self._bases.clear()


def _free_vmm(vmm: _vmm.CudaVmm, base: int, fd: int, token: bytes, device: int, cp: Any) -> None:
    """Frees an :meth:`CudaBackend.alloc` allocation once its array's memory is gone."""
    with contextlib.suppress(Exception), cp.cuda.Device(device):  # CUDA may be gone at exit
        cp.cuda.runtime.deviceSynchronize()  # no kernel or copy of ours still uses it (cudaFree's wait)
        vmm.close(base)
    _vmm.forget(token, base, fd)


_SHM_OPEN: dict[int, Any] = {}
_SHM_BY_BASE: dict[int, Any] = {}


def device_backend(name: str) -> _Backend:
    """``"cuda"`` or ``"host"`` (emulation). Raises :class:`GpuUnavailable` /
    :class:`InvalidArgument`."""
    if name == "cuda":
        return CudaBackend()
    if name == "host":
        return HostBackend()
    if name.startswith("host:"):
        return HostBackend(delay=float(name.split(":", 1)[1]))
    raise InvalidArgument(f"unknown GPU backend {name!r}: 'cuda' or 'host'")
