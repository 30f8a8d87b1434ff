"""Wire formats: engine addresses and memory descriptors, both plain bytes.

Both are versioned, length-checked and end in a CRC-32, so corrupt or truncated bytes are
rejected with :class:`~aiote.DescriptorError` before they can reach the transport.

Engine address (``engine.address``)::

    b"AIOA" | u8 version | u8 nrails | 16 B host id | per rail: str provider, bytes addr | u32 crc

Memory descriptor (``bytes(mr.descriptor)``)::

    b"AIOD" | u8 version | u8 access | u8 device kind | u8 nrails | i32 device id | u64 length
    | 16 B host id | per rail: str provider, bytes addr, u64 base, u64 key
    | GPU regions only: u64 region id | u8 backend | bytes IPC handle (may be empty) | u64 offset
    | host regions, optional: u8 1 | i32 pid | i32 fd | u64 nonce | u64 table | u32 slot | u64 key
    | u32 crc

A host region of an engine that takes direct same-host copies (``open_engine(same_host_direct=
True)``, with an shm rail) also names its slot in the owner's region table, and where peers on
the same host find that table (``DirectExtent``).

A GPU region's descriptor also names the region (for the staging protocol: its owner copies
landed bytes from its pinned host shadow into GPU memory before crediting) and, for peers on
the same host, a CUDA IPC handle of the allocation and the region's offset in it.

A descriptor carries one (address, base, key) entry per NIC of its owner. ``base`` is what the
owner's provider expects as the remote address of offset 0 (the virtual address for providers
with ``FI_MR_VIRT_ADDR``, 0 for offset-based ones); no other local pointer is carried.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from ._errors import DescriptorError

__all__ = [
    "ACCESS_REMOTE_READ",
    "ACCESS_REMOTE_WRITE",
    "DirectExtent",
    "EngineAddress",
    "GpuExtent",
    "MemoryDescriptor",
    "RailAddress",
]

ACCESS_REMOTE_WRITE = 1
ACCESS_REMOTE_READ = 2

DEVICE_HOST = 0
DEVICE_CUDA = 1

_ADDR_MAGIC = b"AIOA"
_DESC_MAGIC = b"AIOD"
_VERSION = 1
_MAX_RAILS = 16


@dataclass(frozen=True, slots=True)
class RailAddress:
    """One NIC (rail) of an engine: its provider name and its libfabric endpoint address.
    A frozen record: building one checks nothing and raises nothing."""

    provider: str
    address: bytes


@dataclass(frozen=True, slots=True)
class _RemoteKey:
    provider: str
    address: bytes
    base: int
    key: int


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise DescriptorError(f"{self.what} is truncated ({len(self.data)} bytes)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))

    def string(self) -> str:
        (n,) = self.unpack("<B")
        raw = self.take(n)
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise DescriptorError(f"{self.what} holds a non-ASCII provider name") from None

    def blob(self) -> bytes:
        (n,) = self.unpack("<B")
        if n == 0:
            raise DescriptorError(f"{self.what} holds an empty endpoint address")
        return self.take(n)


def _checked_body(data: bytes, magic: bytes, what: str) -> _Reader:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DescriptorError(f"{what} must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(magic) + 1 + 4:
        raise DescriptorError(f"{what} is truncated ({len(data)} bytes)")
    if data[: len(magic)] != magic:
        raise DescriptorError(f"these bytes are not an aiote {what} (bad magic)")
    body, crc = data[:-4], struct.unpack("<I", data[-4:])[0]
    if zlib.crc32(body) != crc:
        raise DescriptorError(f"{what} is corrupt or truncated (checksum mismatch)")
    r = _Reader(body, what)
    r.take(len(magic))
    (version,) = r.unpack("<B")
    if version != _VERSION:
        raise DescriptorError(f"{what} has version {version}; this aiote reads version {_VERSION}")
    return r


def _seal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _str(s: str) -> bytes:
    raw = s.encode("ascii")
    return struct.pack("<B", len(raw)) + raw


def _blob(b: bytes) -> bytes:
    return struct.pack("<B", len(b)) + b


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """The address of an engine: what a peer needs to send to it. ``bytes(addr)`` to ship it
    (O(NICs) plus one CRC-32; raises nothing). Building one checks nothing; :meth:`from_bytes`
    validates. ``max_message``: the largest message the engine receives (its
    ``max_message_size``), so that a sender refuses a larger one before posting it (0: not
    known, as in the address a descriptor carries)."""

    rails: tuple[RailAddress, ...]
    host_id: bytes
    max_message: int = 0
    # its hash, computed on first use: an address is a dict key on every write's path (routes,
    # credit lanes), and the generated hash walked every rail's dataclass each time
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        h = self._hash
        if not h:
            h = hash((self.rails, self.host_id, self.max_message)) or 1
            object.__setattr__(self, "_hash", h)
        return h

    def __reduce__(self) -> tuple[Any, ...]:
        # (the cached hash is this process's: string hashes differ between processes)
        return (type(self), (self.rails, self.host_id, self.max_message))

    def __bytes__(self) -> bytes:
        body = _ADDR_MAGIC + struct.pack("<BB", _VERSION, len(self.rails)) + self.host_id
        for r in self.rails:
            body += _str(r.provider) + _blob(r.address)
        if self.max_message:
            body += struct.pack("<Q", self.max_message)
        return _seal(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> EngineAddress:
        """Parses engine address bytes; raises :class:`DescriptorError` when they are invalid
        (not bytes, corrupt, truncated, unknown version). Costs one CRC-32 over the bytes and
        O(NICs) parsing in Python; no I/O, no native call."""
        r = _checked_body(data, _ADDR_MAGIC, "engine address")
        (n,) = r.unpack("<B")
        if not 1 <= n <= _MAX_RAILS:
            raise DescriptorError(f"engine address claims {n} NICs (1..{_MAX_RAILS} allowed)")
        host = r.take(16)
        rails = tuple(RailAddress(r.string(), r.blob()) for _ in range(n))
        limit = 0
        if len(r.data) - r.pos == 8:
            (limit,) = r.unpack("<Q")
        if r.pos != len(r.data):
            raise DescriptorError("engine address has trailing bytes")
        return cls(rails, host, limit)


GPU_BACKEND_CUDA = 1
GPU_BACKEND_HOST = 2  # the host-memory emulation (tests on machines without a GPU)
_DIRECT = 0x80  # in the backend byte: registered directly (FI_HMEM), not staged


@dataclass(frozen=True, slots=True)
class GpuExtent:
    """What a GPU region's descriptor adds: the region's id, the owner's GPU backend, the
    IPC handle (empty when not exported) with the region's offset in its allocation, and
    ``direct``: the NICs registered the GPU memory itself (FI_HMEM), so bytes written there
    land in GPU memory with no staging."""

    region_id: int
    backend: int
    ipc_handle: bytes
    ipc_offset: int
    direct: bool = False


_DIRECT_TAG = 1
_MAXMSG_TAG = 2  # the owner's max_message_size (EngineAddress.max_message)
_DIRECT_FMT = "<iiQQIQ"


@dataclass(frozen=True, slots=True)
class DirectExtent:
    """What a host region's descriptor adds when its owner takes direct same-host copies:
    the owner's process id, the file descriptor of its region table (peers open it through
    ``/proc/<pid>/fd``), the table's nonce and address in the owner, the region's slot there
    and the key the slot holds. A frozen record: building one checks nothing."""

    pid: int
    fd: int
    nonce: int
    table: int
    slot: int
    key: int


@dataclass(frozen=True, slots=True)
class MemoryDescriptor:
    """What a peer needs to access a registered region: plain bytes, safe to ship.

    ``bytes(desc)`` serializes; :meth:`from_bytes` parses and validates (raises
    :class:`DescriptorError` on corrupt, truncated or unknown-version bytes). Costs O(NICs).
    """

    length: int
    access: int
    device_kind: int
    device_id: int
    host_id: bytes
    keys: tuple[_RemoteKey, ...]
    gpu: GpuExtent | None = None
    direct: DirectExtent | None = None
    max_message: int = 0  # the owner's max_message_size (0: not known)
    # ``address``, built on first use (a dict key on every GPU write's path)
    _address: EngineAddress | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def remote_write(self) -> bool:
        """Whether peers may write into the region. O(1), raises nothing."""
        return bool(self.access & ACCESS_REMOTE_WRITE)

    @property
    def remote_read(self) -> bool:
        """Whether peers may read from the region. O(1), raises nothing."""
        return bool(self.access & ACCESS_REMOTE_READ)

    @property
    def on_gpu(self) -> bool:
        """Whether the region is GPU memory. O(1), raises nothing."""
        return self.device_kind == DEVICE_CUDA

    @property
    def address(self) -> EngineAddress:
        """The owning engine's address (one rail per NIC of the owner), the same object on
        every call: O(NICs) the first time, then O(1); raises nothing."""
        a = getattr(self, "_address", None)  # (None too in a pickle of an earlier version)
        if a is None:
            a = EngineAddress(
                tuple(RailAddress(k.provider, k.address) for k in self.keys), self.host_id, self.max_message
            )
            object.__setattr__(self, "_address", a)
        return a

    def __bytes__(self) -> bytes:
        body = _DESC_MAGIC + struct.pack(
            "<BBBBiQ", _VERSION, self.access, self.device_kind, len(self.keys), self.device_id, self.length
        )
        body += self.host_id
        for k in self.keys:
            body += _str(k.provider) + _blob(k.address) + struct.pack("<QQ", k.base, k.key)
        if self.device_kind == DEVICE_CUDA:
            g = self.gpu or GpuExtent(0, GPU_BACKEND_CUDA, b"", 0)
            flags = g.backend | (_DIRECT if g.direct else 0)
            body += struct.pack("<QB", g.region_id, flags) + struct.pack("<B", len(g.ipc_handle))
            body += g.ipc_handle + struct.pack("<Q", g.ipc_offset)
        elif self.direct is not None:
            x = self.direct
            body += struct.pack("<B", _DIRECT_TAG)
            body += struct.pack(_DIRECT_FMT, x.pid, x.fd, x.nonce, x.table, x.slot, x.key)
        if self.max_message:
            body += struct.pack("<BQ", _MAXMSG_TAG, self.max_message)
        return _seal(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> MemoryDescriptor:
        """Parses descriptor bytes; raises :class:`DescriptorError` when they are invalid (not
        bytes, corrupt, truncated, unknown version or fields). Costs one CRC-32 over the bytes
        and O(NICs) parsing in Python; no I/O, no native call."""
        r = _checked_body(data, _DESC_MAGIC, "memory descriptor")
        access, kind, n, dev, length = r.unpack("<BBBiQ")
        if access & ~(ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ):
            raise DescriptorError(f"memory descriptor has unknown access bits {access:#x}")
        if kind not in (DEVICE_HOST, DEVICE_CUDA):
            raise DescriptorError(f"memory descriptor has unknown device kind {kind}")
        if not 1 <= n <= _MAX_RAILS:
            raise DescriptorError(f"memory descriptor claims {n} NICs (1..{_MAX_RAILS} allowed)")
        if length == 0:
            raise DescriptorError("memory descriptor describes an empty region")
        host = r.take(16)
        keys = []
        for _ in range(n):
            prov = r.string()
            addr = r.blob()
            base, key = r.unpack("<QQ")
            if base + length > 2**64:
                raise DescriptorError("memory descriptor region wraps the address space")
            keys.append(_RemoteKey(prov, addr, base, key))
        gpu = None
        if kind == DEVICE_CUDA:
            rid, flags = r.unpack("<QB")
            backend = flags & ~_DIRECT
            if backend not in (GPU_BACKEND_CUDA, GPU_BACKEND_HOST):
                raise DescriptorError(f"memory descriptor has unknown GPU backend {backend}")
            (hl,) = r.unpack("<B")
            handle = r.take(hl)
            (ipc_off,) = r.unpack("<Q")
            gpu = GpuExtent(rid, backend, handle, ipc_off, bool(flags & _DIRECT))
        direct = None
        limit = 0
        seen: set[int] = set()
        while r.pos < len(r.data):  # extensions, each once: the direct-copy extent, the message limit
            (tag,) = r.unpack("<B")
            known = tag == _MAXMSG_TAG or (tag == _DIRECT_TAG and kind == DEVICE_HOST)
            if tag in seen or not known:
                raise DescriptorError(f"memory descriptor has an unknown or repeated extension {tag}")
            seen.add(tag)
            if tag == _DIRECT_TAG:
                direct = DirectExtent(*r.unpack(_DIRECT_FMT))
            else:
                (limit,) = r.unpack("<Q")
        return cls(length, access, kind, dev, host, tuple(keys), gpu, direct, limit)
