"""GPU memory shared as a file descriptor (``Engine.alloc_gpu``).

Theory of operation. ``cudaIpcOpenMemHandle`` maps a peer's ``cudaMalloc`` memory in a way
that makes copies into it from a freshly written source run at about 0.85 of the link
(docs/weights.md). An allocation made with the CUDA virtual-memory API (``cuMemCreate``)
and exported as a POSIX file descriptor does not: the peer imports the descriptor
(``cuMemImportFromShareableHandle``), reserves an address range, maps it and grants its own
GPU access, and copies into it run at the link's pace, fresh or warm.

Such an allocation is a :class:`Shared` record in this process's registry (address ->
record, weakly held: the allocation lives while the array's memory does). Its IPC handle
(:func:`handle`) names this process, the descriptor's number, a random token and the
size. A peer on this host fetches its own copy of the descriptor (:func:`fetch`): first
over this process's descriptor server, one abstract Unix socket per process answering a
known token with the descriptor (``SCM_RIGHTS``, same user only), then, where the socket
is out of reach (another network namespace), with ``pidfd_getfd`` (which needs ptrace
rights over the owner). A peer that gets neither stages, as for memory never exported.

The host GPU emulation (``gpu_backend="host"``) uses the same records, handles and
descriptor passing over a ``memfd``, so machines without CUDA test all of it but the
driver calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import AioteError

_MAGIC = b"AFD1"
# magic, pid, fd, size, token, server nonce, the descriptor's st_dev and st_ino
_HANDLE = struct.Struct("<4sIIQ16s8sQQ")
_NONCE = secrets.token_bytes(8)  # this process's descriptor server: its socket's name


@dataclass(eq=False)
class Shared:
    """One allocation shareable as a descriptor: ``base`` / ``size`` in this process, the
    descriptor ``fd`` (closed by :func:`forget` when the allocation goes), the ``token`` a
    peer presents for it."""

    base: int
    size: int
    fd: int
    token: bytes = field(default_factory=lambda: secrets.token_bytes(16))


def forget(token: bytes, base: int, fd: int) -> None:
    """Withdraws an allocation: its token from the server, its registry entry, its
    descriptor (closed when ``fd >= 0``)."""
    _SERVER.forget(token)
    rec = _REG.get(base)
    if rec is not None and rec.token == token:
        _REG.pop(base, None)
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


_REG: weakref.WeakValueDictionary[int, Shared] = weakref.WeakValueDictionary()


def publish(rec: Shared) -> None:
    """Makes ``rec`` exportable: registry entry, and its token known to the server."""
    _SERVER.offer(rec.token, rec.fd)
    _REG[rec.base] = rec


def lookup(ptr: int) -> Shared | None:
    """The record whose range holds ``ptr``, or None. O(allocations)."""
    for rec in list(_REG.values()):
        if rec.base <= ptr < rec.base + rec.size:
            return rec
    return None


def handle(rec: Shared, ptr: int) -> tuple[bytes, int]:
    """The IPC handle of ``rec`` and ``ptr``'s offset in it."""
    st = os.fstat(rec.fd)
    h = _HANDLE.pack(_MAGIC, os.getpid(), rec.fd, rec.size, rec.token, _NONCE, st.st_dev, st.st_ino)
    return h, ptr - rec.base


def is_handle(h: bytes) -> bool:
    """Whether ``h`` names a descriptor-shared allocation (not a ``cudaIpcMemHandle``)."""
    return len(h) == _HANDLE.size and h[:4] == _MAGIC


def handle_size(h: bytes) -> int:
    """The allocation's size in bytes, from its handle."""
    return int(_HANDLE.unpack(h)[3])


def _sock_name(pid: int, nonce: bytes) -> bytes:
    return b"\0aiote-fd-%d-%s" % (pid, nonce.hex().encode())


# ------------------------------------------------------------------ the descriptor server


class _Server:
    """This process's descriptor server: a thread blocked in ``accept`` (no polling), started
    with the first published allocation, answering each connection from this user that
    presents a known token with a copy of that descriptor."""

    def __init__(self) -> None:
        self._fds: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pid = 0

    def offer(self, token: bytes, fd: int) -> None:
        with self._lock:
            if self._sock is None or self._pid != os.getpid():  # first use, or after a fork
                self._fds.clear()  # (a fork's child: its parent's tokens are not its own)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.bind(_sock_name(os.getpid(), _NONCE))
                    s.listen(64)
                    threading.Thread(target=self._serve, args=(s,), name="aiote-fdshare", daemon=True).start()
                except BaseException:
                    s.close()
                    raise
                self._sock, self._pid = s, os.getpid()
            self._fds[token] = fd

    def forget(self, token: bytes) -> None:
        with self._lock:
            self._fds.pop(token, None)

    def _serve(self, s: socket.socket) -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EINVAL):  # the socket is gone
                    return
                time.sleep(0.01)  # out of descriptors, an aborted connection: go on serving
                continue
            with conn, contextlib.suppress(OSError):
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", cred)
        token = b""
        while len(token) < 16:
            got = conn.recv(16 - len(token))
            if not got:
                return
            token += got
        with self._lock:
            fd = self._fds.get(token) if uid == os.getuid() else None
            if fd is None:
                conn.sendall(b"\0")
                return
            socket.send_fds(conn, [b"\1"], [fd])  # under the lock: a released fd is not sent


_SERVER = _Server()


def fetch(h: bytes, *, timeout: float = 2.0) -> int:
    """A descriptor of this process for the allocation ``h`` names (the caller closes it):
    from the owner's server, else, only where no such socket exists here (the owner is in
    another network namespace), with ``pidfd_getfd``, checked to be the same file (device
    and inode) so that a reused descriptor number or pid is never taken for it. Raises
    :class:`AioteError` when the owner refuses (the allocation is gone, or another user
    asks), its server does not answer, or neither way works. Blocks for one local round
    trip, at most ``timeout`` seconds."""
    _m, pid, fd, _size, token, nonce, dev, ino = _HANDLE.unpack(h)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.settimeout(timeout)
        c.connect(_sock_name(pid, nonce))
    except OSError as exc:
        c.close()
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise AioteError(f"cannot fetch the peer's GPU memory descriptor: its socket: {exc}") from None
        try:
            return _same_file(_pidfd_getfd(pid, fd), dev, ino)
        except OSError as exc2:
            raise AioteError(
                f"cannot fetch the peer's GPU memory descriptor: its socket: {exc}; pidfd_getfd: {exc2}"
            ) from None
    with c:
        try:
            c.sendall(token)
            msg, fds, _flags, _addr = socket.recv_fds(c, 1, 1)
        except OSError as exc:
            raise AioteError(f"cannot fetch the peer's GPU memory descriptor: {exc}") from None
    for x in fds:
        os.set_inheritable(x, False)
    if msg == b"\1" and len(fds) == 1:
        try:
            return _same_file(fds[0], dev, ino)
        except OSError as exc:
            raise AioteError(f"cannot fetch the peer's GPU memory descriptor: {exc}") from None
    for x in fds:
        os.close(x)
    raise AioteError("the peer does not offer that GPU memory (freed, or owned by another user)")


def _same_file(fd: int, dev: int, ino: int) -> int:
    """``fd`` if it is the file the handle names, else closed and OSError."""
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino):
        os.close(fd)
        raise OSError(errno.ESTALE, "not the descriptor the handle names (reused)")
    return fd


def _pidfd_getfd(pid: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = int(libc.syscall(438, pidfd, fd, 0))  # SYS_pidfd_getfd (x86-64 and arm64)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return got
    finally:
        os.close(pidfd)


# ------------------------------------------------------------------ host emulation


class HostGpuView:
    """What an emulated GPU array of the host GPU backend shows: ``host`` (its NumPy bytes),
    ``device_id``, and ``__cuda_array_interface__`` over ``host`` (read-only when
    ``_readonly``). Subclasses set the three attributes."""

    host: np.ndarray
    device_id: int
    _readonly: bool = False

    @property
    def nbytes(self) -> int:
        """The size in bytes (0 once a shared ``HostDeviceArray`` is closed). O(1), raises
        nothing."""
        return int(self.host.nbytes)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.host.nbytes,),
            "typestr": "|u1",
            "data": (int(self.host.ctypes.data), self._readonly),
            "strides": None,
            "version": 3,
        }


class HostFdArray(HostGpuView):
    """Emulated GPU memory (``gpu_backend="host"``) in a ``memfd``, shareable with peers of
    this host as :meth:`Engine.alloc_gpu` memory is. ``host`` is its NumPy view."""

    def __init__(self, nbytes: int, device: int) -> None:
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        fd = os.memfd_create("aiote-gpu", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.host: np.ndarray = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)
        self.device_id = device
        self._rec = Shared(int(self.host.ctypes.data), size, fd)
        weakref.finalize(self, forget, self._rec.token, self._rec.base, fd)  # also if publish fails
        publish(self._rec)


_HOST_MAPS: dict[int, mmap.mmap] = {}


def host_open(h: bytes) -> int:
    """Maps the emulated allocation ``h`` names; returns its address here."""
    fd = fetch(h)
    try:
        m = mmap.mmap(fd, handle_size(h))
    finally:
        os.close(fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    _HOST_MAPS[base] = m
    return base


def host_close(base: int) -> bool:
    """Unmaps what :func:`host_open` mapped at ``base``; False when it did not map it."""
    m = _HOST_MAPS.pop(base, None)
    if m is None:
        return False
    with contextlib.suppress(BufferError):  # a view still exported: unmapped at exit
        m.close()
    return True


# ------------------------------------------------------------------ CUDA (driver API)


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("handle_types", ctypes.c_int),
        ("loc_type", ctypes.c_int),
        ("loc_id", ctypes.c_int),
        ("win32", ctypes.c_void_p),
        ("compression", ctypes.c_ubyte),
        ("rdma", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


_PINNED, _POSIX_FD, _ON_DEVICE, _READWRITE, _RECOMMENDED = 1, 1, 1, 3, 1
_VMM_RDMA_ATTR = 126  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
_U64 = ctypes.c_uint64


class CudaVmm:
    """The driver calls behind :meth:`Engine.alloc_gpu` and the import of its handles.
    Every call needs the device's primary context current (the caller's ``Device``)."""

    def __init__(self, libcuda: Any) -> None:
        self.cu = libcuda
        self._mapped: dict[int, tuple[int, int]] = {}  # base -> (size, handle)

    def _ok(self, name: str, *args: Any) -> None:
        rc = getattr(self.cu, name)(*args)
        if rc != 0:
            raise AioteError(f"{name} failed (CUresult {rc})")

    def _map(self, handle: int, size: int, devices: list[int]) -> int:
        ptr = _U64()
        self._ok(
            "cuMemAddressReserve",
            ctypes.byref(ptr),
            ctypes.c_size_t(size),
            ctypes.c_size_t(0),
            _U64(0),
            _U64(0),
        )
        base = int(ptr.value)
        try:
            self._ok("cuMemMap", _U64(base), ctypes.c_size_t(size), ctypes.c_size_t(0), _U64(handle), _U64(0))
            try:
                acc = (_Access * len(devices))(*(_Access(_ON_DEVICE, d, _READWRITE) for d in devices))
                self._ok(
                    "cuMemSetAccess", _U64(base), ctypes.c_size_t(size), acc, ctypes.c_size_t(len(devices))
                )
            except BaseException:
                self.cu.cuMemUnmap(_U64(base), ctypes.c_size_t(size))
                raise
        except BaseException:
            self.cu.cuMemAddressFree(_U64(base), ctypes.c_size_t(size))
            raise
        self._mapped[base] = (size, handle)
        return base

    def alloc(self, nbytes: int, device: int) -> Shared:
        """``cuMemCreate`` of ``nbytes`` (rounded up to the recommended granularity) on
        ``device``, mapped there and exported as a descriptor."""
        prop = _Prop(_PINNED, _POSIX_FD, _ON_DEVICE, device)
        rdma = ctypes.c_int(0)  # NICs with FI_HMEM may register it (when the GPU allows)
        if self.cu.cuDeviceGetAttribute(ctypes.byref(rdma), _VMM_RDMA_ATTR, device) == 0 and rdma.value:
            prop.rdma = 1
        gran = ctypes.c_size_t()
        self._ok("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), _RECOMMENDED)
        g = max(int(gran.value), 1)
        size = max(g, -(-nbytes // g) * g)
        h = _U64()
        self._ok("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), _U64(0))
        try:
            fd = ctypes.c_int(-1)
            self._ok("cuMemExportToShareableHandle", ctypes.byref(fd), _U64(h.value), _POSIX_FD, _U64(0))
            try:
                os.set_inheritable(fd.value, False)  # a child process must not keep the memory
                base = self._map(int(h.value), size, [device])
            except BaseException:
                os.close(fd.value)
                raise
        finally:
            self.cu.cuMemRelease(_U64(h.value))  # the mapping holds the memory from here
        return Shared(base, size, fd.value)

    def open(self, h: bytes, device: int) -> int:
        """Imports the allocation ``h`` names and maps it for ``device``; returns its address."""
        fd = fetch(h)
        try:
            mh = _U64()
            self._ok("cuMemImportFromShareableHandle", ctypes.byref(mh), ctypes.c_void_p(fd), _POSIX_FD)
        finally:
            os.close(fd)
        try:
            return self._map(int(mh.value), handle_size(h), [device])
        finally:
            self.cu.cuMemRelease(mh)  # the mapping holds the memory from here

    def close(self, base: int) -> bool:
        """Unmaps and frees what :meth:`alloc` or :meth:`open` mapped at ``base``; False when
        this object did not map it."""
        got = self._mapped.pop(base, None)
        if got is None:
            return False
        size = ctypes.c_size_t(got[0])
        self.cu.cuMemUnmap(_U64(base), size)
        self.cu.cuMemAddressFree(_U64(base), size)
        return True
