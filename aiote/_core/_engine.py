"""The engine: rails (NICs) over the C core, memory registration, one-sided and two-sided
operations, all awaitable under asyncio and trio."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import numpy as np

from .._native import ffi, lib
from ._bridge import LoopBridge
from ._counter import ImmCounter
from ._descriptor import (
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    DEVICE_HOST,
    EngineAddress,
    MemoryDescriptor,
    RailAddress,
    _RemoteKey,
)
from ._errors import (
    AioteError,
    EngineClosed,
    InvalidArgument,
    PeerUnreachable,
    ProviderError,
    RegionBusy,
    RegistrationError,
    RemoteAccessError,
    TransferError,
    TransferTimeout,
)
from ._log import get_logger
from ._memory import MemoryRegion, host_buffer
from ._util import as_index, check_timeout, deadline

__all__ = ["Engine", "RailInfo", "TransferBatch", "open_engine"]

# libfabric probes every provider it knows at start-up (0.2-0.5 s of CPU); restrict it to the
# ones aiote can use unless the user chose otherwise.
os.environ.setdefault("FI_PROVIDER", "tcp,ofi_rxm,shm,verbs,efa")

_log = get_logger(component="engine")

_U32 = 1 << 32
_MSG_HEADER = struct.Struct("<H")

# libfabric error numbers (rdma/fi_errno.h)
_FI_EINVAL = 22
_FI_EMSGSIZE = 90
_PEER_ERRORS = {
    111: "connection refused",  # ECONNREFUSED
    104: "connection reset",  # ECONNRESET
    113: "host unreachable",  # EHOSTUNREACH
    103: "connection aborted",  # ECONNABORTED
    107: "not connected",  # ENOTCONN
    110: "timed out",  # ETIMEDOUT
    32: "broken pipe",  # EPIPE
    112: "host down",  # EHOSTDOWN
    101: "network unreachable",  # ENETUNREACH
    100: "network down",  # ENETDOWN
}
# EPERM, EACCES, EFAULT, EREMOTEIO, EKEYREJECTED, FI_ENOKEY: the peer refused the access
_ACCESS_ERRORS = {1, 13, 14, 121, 129, 266}
_FI_ETRUNC = 265
_CLOSED_STATUS = -(1 << 30)  # an operation failed because the engine closed under it


def _strerror(code: int) -> str:
    text: bytes = ffi.string(lib.aio_strerror(code))
    return text.decode(errors="replace")


def _completion_error(status: int, prov_errno: int, what: str) -> TransferError:
    code = -status
    msg = f"{what} failed: {_strerror(code)} (libfabric error {code}, provider error {prov_errno})"
    if code in _PEER_ERRORS:
        return PeerUnreachable(msg + "; the peer is gone or not listening", code, prov_errno)
    if code in _ACCESS_ERRORS:
        return RemoteAccessError(msg + "; check the descriptor's key and bounds", code, prov_errno)
    if code == _FI_ETRUNC:
        return TransferError(msg + "; the receiver's buffer was too small", code, prov_errno)
    return TransferError(msg, code, prov_errno)


def _host_id() -> bytes:
    parts = []
    for p in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(p, "rb") as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    if not parts:
        parts.append(os.uname().nodename.encode())
    return hashlib.blake2b(b"|".join(parts), digest_size=16).digest()


@dataclass(frozen=True)
class RailInfo:
    """What one NIC (rail) of an engine is: its provider, domain and capabilities."""

    index: int
    provider: str
    domain: str
    fabric: str
    address: bytes
    mr_mode: int
    cq_data_size: int
    max_msg_size: int
    inject_size: int
    has_wait_fd: bool
    max_message_size: int


class _Op:
    __slots__ = ("event", "prov_errno", "refs", "status")

    def __init__(self, refs: Any, event: Any) -> None:
        self.event = event
        self.status = 0
        self.prov_errno = 0
        self.refs = refs


class _RecvWaiter:
    __slots__ = ("event", "item")

    def __init__(self, event: Any) -> None:
        self.event = event
        self.item: tuple[bytes, bytes] | None = None


# numpy view of aio_op_desc, for building batches without per-field cffi calls
_OP_DTYPE = np.dtype(
    [
        ("mr", "<u8"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("peer", "<u8"),
        ("raddr", "<u8"),
        ("rkey", "<u8"),
        ("data", "<u8"),
        ("rail", "<i4"),
        ("op", "<i4"),
        ("flags", "<i4"),
        ("pad", "<i4"),
    ]
)
assert _OP_DTYPE.itemsize == ffi.sizeof("aio_op_desc")


class Engine:
    """A transfer engine: one or more NICs (rails), a native completion poller, and the
    operations, each an awaitable. Open it with :func:`open_engine`; use it from the event
    loop (task) that opened it.
    """

    def __init__(
        self,
        handle: Any,
        rails: list[RailInfo],
        *,
        cancel_grace: float,
        post_budget_ns: int,
        max_message_size: int,
        loop_spin_ns: int = 0,
    ) -> None:
        self._h = handle
        self._loop_spin_ns = loop_spin_ns
        self._rails = rails
        self._closed = False
        self._closing = False
        self._cancel_grace = cancel_grace
        self._budget_ns = post_budget_ns
        self._max_message = max_message_size
        self._tokens = itertools.count(1)
        self._pending: dict[int, _Op] = {}
        self._counters: dict[int, ImmCounter] = {}
        self._regions: set[MemoryRegion] = set()
        self._peers: dict[tuple[int, bytes], int] = {}
        self._routes: dict[tuple[Any, ...], tuple[int, int, int, int]] = {}
        self._inbox: deque[tuple[bytes, bytes]] = deque()
        self._recv_waiters: deque[_RecvWaiter] = deque()
        self._recs = ffi.new("aio_record[256]")
        self._address = EngineAddress(tuple(RailAddress(r.provider, r.address) for r in rails), _host_id())
        self._address_bytes = bytes(self._address)
        self._bridge: LoopBridge | None = None
        self._event: Any = anyio.Event  # replaced by the loop's own Event class in _start
        self._scratch: MemoryRegion | None = None
        self._log = _log.bind(engine=self._address_bytes[-4:].hex())

    # ------------------------------------------------------------------ properties

    @property
    def address(self) -> bytes:
        """This engine's address as bytes: hand it to peers out of band (``send`` targets it)."""
        return self._address_bytes

    @property
    def rails(self) -> tuple[RailInfo, ...]:
        """The NICs of this engine, in order."""
        return tuple(self._rails)

    @property
    def closed(self) -> bool:
        """True once the engine is closed."""
        return self._closed

    @property
    def max_message_size(self) -> int:
        """The largest payload :meth:`send` accepts (peers must use the same or larger)."""
        return self._max_message

    def stats(self) -> dict[str, int]:
        """Counters of the native poller (polls, sleeps, wake-ups, completions, errors) and
        the operations and regions in flight. O(1)."""
        st = ffi.new("aio_stats*")
        lib.aio_get_stats(self._handle(), st)
        return {
            "polls": st.polls,
            "sleeps": st.sleeps,
            "wakeups_sent": st.wakeups_sent,
            "completions": st.completions,
            "remote_data": st.remote_data,
            "errors": st.errors,
            "ops_in_flight": int(lib.aio_ops_in_flight(self._h)),
            "pending": len(self._pending),
            "regions": len(self._regions),
        }

    def _handle(self) -> Any:
        if self._closed:
            raise EngineClosed("the engine is closed")
        return self._h

    async def _pause(self, seconds: float) -> Any:
        """Sleeps between retries; returns the native handle, or raises EngineClosed if the
        engine started closing meanwhile (nothing may be posted on a freed handle)."""
        await anyio.sleep(seconds)
        return self._check_open()

    def _seal(self, g: int) -> None:
        if not self._closed:
            lib.aio_group_seal(self._h, g)

    def _check_open(self) -> Any:
        if self._closed or self._closing:
            raise EngineClosed("the engine is closed or closing; nothing more can be posted")
        return self._h

    # ------------------------------------------------------------------ completion dispatch

    def _on_ready(self) -> None:
        if self._closed:
            return
        lib.aio_clear_eventfd(self._h)
        self._drain()

    def _spin_until(self, done: Any) -> None:
        """Low-latency mode (``loop_spin_us``): drains the ring in the loop thread until
        ``done()`` or the spin budget runs out, instead of sleeping until the eventfd wakes
        the loop. Blocks the event loop for at most ``loop_spin_us``."""
        end = time.perf_counter_ns() + self._loop_spin_ns
        while not done() and not self._closed:
            self._drain()
            if done() or time.perf_counter_ns() >= end:
                return
            os.sched_yield()  # the poller or the peer may need this core

    def _drain(self) -> None:
        h = self._h
        recs = self._recs
        while True:
            n = lib.aio_drain(h, recs, 256)
            for i in range(n):
                r = recs[i]
                kind = r.kind
                if kind == lib.AIO_REC_GROUP:
                    op = self._pending.pop(r.token, None)
                    if op is not None:
                        op.status = r.status
                        op.prov_errno = r.prov_errno
                        op.refs = None
                        op.event.set()
                elif kind == lib.AIO_REC_COUNTER:
                    c = self._counters.get(r.token)
                    if c is not None:
                        c._serve()
                elif kind == lib.AIO_REC_RECV:
                    self._on_message(r.rail, r.a, r.b, r.status)
            if n == 256:
                continue
            if lib.aio_arm(h):
                continue
            break

    def _on_message(self, rail: int, slot: int, length: int, status: int) -> None:
        if status == 0:
            raw = bytes(ffi.buffer(lib.aio_recv_slot(self._h, rail, slot), length))
        lib.aio_recv_repost(self._h, rail, slot)
        if status != 0:
            self._log.warning("message dropped", rail=rail, error=_strerror(-status))
            return
        if len(raw) < _MSG_HEADER.size:
            self._log.warning("malformed message dropped", rail=rail, length=length)
            return
        (alen,) = _MSG_HEADER.unpack_from(raw)
        if _MSG_HEADER.size + alen > len(raw):
            self._log.warning("malformed message dropped", rail=rail, length=length)
            return
        item = (raw[2 : 2 + alen], raw[2 + alen :])
        while self._recv_waiters:
            w = self._recv_waiters.popleft()
            w.item = item
            w.event.set()
            return
        self._inbox.append(item)

    # ------------------------------------------------------------------ memory

    async def register(
        self, buffer: Any, *, remote_write: bool = True, remote_read: bool = True
    ) -> MemoryRegion:
        """Registers a host buffer with every NIC of the engine.

        ``buffer``: a C-contiguous NumPy array or buffer-protocol object; it must be writable
        when ``remote_write`` is set. The region keeps a reference to it. Peers may write into
        it only with ``remote_write``, read it only with ``remote_read``.

        Raises :class:`InvalidArgument` (non-contiguous, read-only for remote write, empty, not
        a buffer), :class:`RegistrationError` (the provider refused), :class:`EngineClosed`.
        Costs one provider registration per NIC (pins the pages on RDMA hardware).
        """
        h = self._check_open()
        obj, nbytes = host_buffer(buffer, writable=remote_write)
        cbuf = ffi.from_buffer("char[]", obj, require_writable=remote_write)
        access = (ACCESS_REMOTE_WRITE if remote_write else 0) | (ACCESS_REMOTE_READ if remote_read else 0)
        out = ffi.new("aio_mr**")
        err = ffi.new("char[512]")
        rc = lib.aio_mr_register(h, cbuf, nbytes, access, out, err, 512)
        if rc != 0:
            raise RegistrationError(ffi.string(err).decode(errors="replace") or _strerror(-rc))
        mrh = out[0]
        keys = tuple(
            _RemoteKey(
                r.provider, r.address, int(lib.aio_mr_remote_base(mrh, i)), int(lib.aio_mr_key(mrh, i))
            )
            for i, r in enumerate(self._rails)
        )
        desc = MemoryDescriptor(nbytes, access, DEVICE_HOST, 0, self._address.host_id, keys)
        mr = MemoryRegion(self, obj, cbuf, mrh, nbytes, desc, remote_write, remote_read)
        mr.writable = not memoryview(obj).readonly
        mr._ptr = int(ffi.cast("uintptr_t", mrh))
        self._regions.add(mr)
        await anyio.lowlevel.checkpoint()
        return mr

    async def unregister(self, mr: MemoryRegion, *, timeout: float | None = None) -> None:
        """Unregisters a region. Waits while work requests that touch it are in flight (they
        keep the buffer alive); raises :class:`RegionBusy` if they are still in flight after
        ``timeout`` seconds (``timeout=0``: raise at once), :class:`InvalidArgument` if it is not
        a registered region of this engine. Peers' later accesses fail at their side."""
        h = self._handle()
        if not isinstance(mr, MemoryRegion) or mr._engine is not self:
            raise InvalidArgument("not a memory region of this engine")
        if mr._handle is None:
            raise InvalidArgument("the region is already unregistered")
        start = anyio.current_time()
        delay = 0.0005
        while lib.aio_mr_inflight(mr._handle) > 0:
            if timeout is not None and anyio.current_time() - start >= timeout:
                raise RegionBusy(
                    f"{int(lib.aio_mr_inflight(mr._handle))} work requests on the region are still in "
                    "flight; wait for them or retry unregister later"
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.02)
            h = self._handle()
            if mr._handle is None:
                raise InvalidArgument("the region was unregistered meanwhile")
        handle, mr._handle = mr._handle, None
        rc = lib.aio_mr_close(h, handle)
        if rc != 0:  # pragma: no cover - raced with a new post from another task
            mr._handle = handle
            raise RegionBusy(f"unregister failed: {_strerror(-rc)}")
        self._regions.discard(mr)
        await anyio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ routing

    def _peer(self, rail: int, address: bytes) -> int:
        key = (rail, address)
        fa = self._peers.get(key)
        if fa is None:
            out = ffi.new("uint64_t*")
            rc = lib.aio_av_insert(self._h, rail, address, len(address), out)
            if rc != 0:
                raise InvalidArgument(
                    f"the peer address is not valid for {self._rails[rail].provider}: {_strerror(-rc)}"
                )
            fa = int(out[0])
            self._peers[key] = fa
        return fa

    def _route(self, keys: tuple[_RemoteKey, ...]) -> tuple[int, int, int, int]:
        """(local rail, fi_addr, remote base, remote key) for a descriptor's key set."""
        r = self._routes.get(keys)
        if r is not None:
            return r
        for li, lr in enumerate(self._rails):
            for k in keys:
                if k.provider == lr.provider:
                    r = (li, self._peer(li, k.address), k.base, k.key)
                    self._routes[keys] = r
                    return r
        mine = sorted({x.provider for x in self._rails})
        theirs = sorted({k.provider for k in keys})
        raise InvalidArgument(f"no common provider: this engine has {mine}, the peer has {theirs}")

    def _region(self, mr: Any, name: str = "mr") -> MemoryRegion:
        if not isinstance(mr, MemoryRegion):
            raise InvalidArgument(
                f"{name} must be a MemoryRegion from engine.register, not {type(mr).__name__}"
            )
        if mr._engine is not self:
            raise InvalidArgument(f"{name} is registered with another engine")
        if mr._handle is None:
            raise InvalidArgument(f"{name} was unregistered")
        return mr

    @staticmethod
    def _remote(desc: Any) -> MemoryDescriptor:
        if isinstance(desc, MemoryDescriptor):
            return desc
        if isinstance(desc, (bytes, bytearray, memoryview)):
            return MemoryDescriptor.from_bytes(bytes(desc))
        raise InvalidArgument(f"remote must be a MemoryDescriptor or its bytes, not {type(desc).__name__}")

    def _fill(
        self,
        table: np.ndarray,
        index: int,
        mr: MemoryRegion,
        remote: Any,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        imm: int | None,
        op: int,
    ) -> None:
        """Validates one transfer and fills one aio_op_desc row (numpy record)."""
        self._check_open()
        rdesc = self._remote(remote)
        mr = self._region(mr)
        src_offset = as_index(src_offset, "src_offset")
        dst_offset = as_index(dst_offset, "dst_offset")
        if op == lib.AIO_OP_WRITE:
            local_name, remote_name, loc_off, rem_off = "source", "destination", src_offset, dst_offset
        else:
            local_name, remote_name, loc_off, rem_off = "destination", "source", dst_offset, src_offset
        if length is None:
            length = min(mr.nbytes - loc_off, rdesc.length - rem_off)
        length = as_index(length, "length")
        if loc_off + length > mr.nbytes:
            raise InvalidArgument(
                f"{local_name} range [{loc_off}, {loc_off + length}) is past the local region ({mr.nbytes} B)"
            )
        if rem_off + length > rdesc.length:
            raise InvalidArgument(
                f"{remote_name} range [{rem_off}, {rem_off + length}) is past the remote region "
                f"({rdesc.length} B)"
            )
        if op == lib.AIO_OP_WRITE and not rdesc.remote_write:
            raise InvalidArgument("the remote region was registered without remote_write")
        if op == lib.AIO_OP_READ:
            if not rdesc.remote_read:
                raise InvalidArgument("the remote region was registered without remote_read")
            if not mr.writable:
                raise InvalidArgument("a READ needs a writable local region; this buffer is read-only")
        flags = 0
        data = 0
        if imm is not None:
            if op != lib.AIO_OP_WRITE:
                raise InvalidArgument("only writes carry an immediate")
            data = as_index(imm, "imm", hi=_U32)
            flags = lib.AIO_F_DATA
        elif length == 0:
            if op == lib.AIO_OP_READ:
                raise InvalidArgument("a READ must move at least one byte")
            raise InvalidArgument("a zero-length write must carry an immediate (imm=...)")
        rail, fa, base, key = self._route(rdesc.keys)
        # one assignment of the whole record (field-by-field costs ~10x more)
        table[index] = (mr._ptr, loc_off, length, fa, base + rem_off, key, data, rail, op, flags, 0)

    # ------------------------------------------------------------------ posting

    async def _run(self, table: np.ndarray, refs: Any, timeout: float | None, what: str) -> None:
        """Posts the rows of ``table`` as one group and waits for all of them."""
        ptr = ffi.cast("aio_op_desc*", ffi.from_buffer(table))
        n = len(table)
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            return int(lib.aio_post(h, g, ptr + posted, n - posted, budget))

        await self._run_group(post, n, (refs, table), timeout, what)

    async def _run_group(
        self, post: Callable[[Any, int, int], int], n: int, refs: Any, timeout: float | None, what: str
    ) -> None:
        """The life of one group of ``n`` work requests: open it (waiting while every group
        slot is in flight), post through ``post(handle, group, posted_so_far)`` (returns how
        many it posted, or a negative error) with back-off while the transport pushes back,
        seal, wait for the completion record, and map its status to an exception.

        On cancellation what was posted cannot be taken back: ``refs`` (buffers, tables) stay
        owned until the completion, with a bounded shielded wait before the cancellation
        propagates. On timeout it raises at once and the completion releases ``refs`` later."""
        check_timeout(timeout)
        h = self._check_open()
        op = _Op(refs, self._event())
        token = next(self._tokens)
        g = lib.aio_group_open(h, token)
        attempt = 0
        try:
            with deadline(timeout, what):
                while g < 0:  # every group slot in flight: backpressure
                    attempt += 1
                    h = await self._pause(min(0.0001 * attempt, 0.005))
                    g = lib.aio_group_open(h, token)
        except BaseException:
            if g >= 0:
                self._seal(g)
            raise
        self._pending[token] = op
        posted = 0
        sealed = False
        error = 0
        try:
            with deadline(timeout, what):
                attempt = 0
                while posted < n:
                    k = post(h, g, posted)
                    if k < 0:
                        error = k
                        break
                    posted += k
                    if posted < n:
                        # queue or slots full, or peer still connecting: back off, the poller progresses
                        attempt = attempt + 1 if k == 0 else 0
                        h = await self._pause(min(0.00005 * (1 << min(attempt, 8)), 0.01))
                self._seal(g)
                sealed = True
                if self._loop_spin_ns:
                    self._spin_until(op.event.is_set)
                if not op.event.is_set():
                    await op.event.wait()
        except TransferTimeout:
            if not sealed:
                self._seal(g)
            if posted == 0:
                raise TransferTimeout(f"{what}: nothing could be posted before the deadline") from None
            raise
        except BaseException:
            if not sealed:
                self._seal(g)
            if posted and not op.event.is_set():
                # a posted request cannot be taken back: keep its buffers until the NIC is done
                with anyio.move_on_after(self._cancel_grace, shield=True):
                    await op.event.wait()
            raise
        if error:
            raise _post_error(error, what, posted)
        if op.status == _CLOSED_STATUS:
            raise EngineClosed(f"{what}: the engine closed before the operation completed")
        if op.status:
            raise _completion_error(op.status, op.prov_errno, what)

    async def write(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        timeout: float | None = None,
    ) -> None:
        """One-sided write of ``length`` bytes from ``mr[src_offset:]`` to the peer's region
        ``remote`` at ``dst_offset`` (``length`` defaults to what fits in both).

        Returns when the source buffer may be reused (the transport is done with it). With
        ``imm`` (32-bit), the peer's ``imm_counter(imm)`` gains one credit once the data has
        landed; without it the peer is not told.

        Raises :class:`InvalidArgument` before posting anything for bad input (unregistered
        region, ranges past either region, bad imm); :class:`TransferTimeout` after ``timeout``;
        :class:`TransferError` subclasses when the transport reports an error. Cancelled: the
        write may or may not have landed; the cancellation propagates once the transport let
        go of the buffer (bounded by ``cancel_grace``). Cost: one work request, no copy.
        """
        table = np.zeros(1, _OP_DTYPE)
        self._fill(table, 0, mr, remote, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE)
        await self._run(table, mr, timeout, "write")

    async def write_imm(
        self, remote: MemoryDescriptor | bytes, imm: int, *, timeout: float | None = None
    ) -> None:
        """Zero-byte write carrying ``imm`` to the owner of ``remote``: its
        ``imm_counter(imm)`` gains one credit. Raises as :meth:`write`."""
        if imm is None:
            raise InvalidArgument("write_imm needs an immediate")
        assert self._scratch is not None
        table = np.zeros(1, _OP_DTYPE)
        self._fill(table, 0, self._scratch, remote, 0, 0, 0, imm, lib.AIO_OP_WRITE)
        await self._run(table, None, timeout, "write_imm")

    async def read(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        timeout: float | None = None,
    ) -> None:
        """One-sided READ of ``length`` bytes from the peer's region at ``src_offset`` into
        ``mr[dst_offset:]``. Returns when the bytes are in ``mr``. The peer's region must have
        been registered with ``remote_read``. Raises as :meth:`write`."""
        table = np.zeros(1, _OP_DTYPE)
        self._fill(table, 0, mr, remote, length, src_offset, dst_offset, None, lib.AIO_OP_READ)
        await self._run(table, mr, timeout, "read")

    def batch(self) -> TransferBatch:
        """A batch of writes/reads validated as they are added and posted by one native call
        on :meth:`TransferBatch.submit`, awaited as one."""
        return TransferBatch(self)

    def imm_counter(self, imm: int) -> ImmCounter:
        """The counter of immediate ``imm`` (same object for the same imm). Credits accumulate
        from the engine's start, whether or not anybody waits."""
        imm = as_index(imm, "imm", hi=_U32)
        c = self._counters.get(imm)
        if c is None:
            c = self._counters[imm] = ImmCounter(self, imm)
        return c

    # ------------------------------------------------------------------ messages

    async def send(self, peer: bytes | EngineAddress, payload: Any, *, timeout: float | None = None) -> None:
        """Sends ``payload`` (bytes-like, up to ``max_message_size``) to the engine at
        ``peer`` (its ``address``). Returns once the payload has been handed to the transport
        (it is copied; the caller may reuse its buffer at once). Messages between two engines
        are delivered in order on tcp and shm.

        Raises :class:`InvalidArgument` (bad address, payload too large),
        :class:`TransferTimeout`, :class:`PeerUnreachable`, :class:`EngineClosed`."""
        check_timeout(timeout)
        self._check_open()
        addr = peer if isinstance(peer, EngineAddress) else EngineAddress.from_bytes(_as_bytes(peer, "peer"))
        try:
            data = memoryview(payload).cast("B")
        except TypeError:
            raise InvalidArgument(f"payload must be bytes-like, not {type(payload).__name__}") from None
        if data.nbytes > self._max_message:
            raise InvalidArgument(
                f"payload of {data.nbytes} B exceeds max_message_size={self._max_message} B; "
                "use a one-sided write for bulk data"
            )
        rail, fa = -1, 0
        for li, lr in enumerate(self._rails):
            for ra in addr.rails:
                if ra.provider == lr.provider:
                    rail, fa = li, self._peer(li, ra.address)
                    break
            if rail >= 0:
                break
        if rail < 0:
            raise InvalidArgument("no common provider with the peer")
        me = self._address_bytes
        msg = b"".join((_MSG_HEADER.pack(len(me)), me, data))
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            return int(lib.aio_post_send(h, g, rail, fa, msg, len(msg), budget))

        await self._run_group(post, 1, None, timeout, "send")

    async def recv(self, *, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Receives the next message: ``(sender_address, payload)``. Messages are queued from
        the engine's start, so nothing is lost while nobody waits. Cancel-safe: a cancelled
        receive takes no message. Raises :class:`TransferTimeout`, :class:`EngineClosed`."""
        check_timeout(timeout)
        self._handle()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._inbox:
            item = self._inbox.popleft()  # taken before yielding: no other receiver can race for it
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return item
        w = _RecvWaiter(self._event())
        self._recv_waiters.append(w)
        try:
            with deadline(timeout, "recv"):
                await w.event.wait()
        except BaseException:
            if w.item is not None:
                self._inbox.appendleft(w.item)
            else:
                with suppress(ValueError):
                    self._recv_waiters.remove(w)
            raise
        if w.item is None:
            raise EngineClosed("the engine closed while receiving")
        return w.item

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        self._bridge = LoopBridge(int(lib.aio_engine_eventfd(self._h)), self._on_ready)
        self._bridge.start()
        self._event = self._bridge.event_class
        self._scratch = await self.register(bytearray(64), remote_write=False, remote_read=False)

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Closes the engine: refuses new work, waits up to ``timeout`` seconds for work in
        flight, then stops the poller and closes the endpoints before any region (so the
        transport never touches freed memory). Operations still pending fail with
        :class:`EngineClosed`. Idempotent."""
        if self._closed or self._closing:
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(timeout):
                for op in list(self._pending.values()):
                    await op.event.wait()
            if self._pending:
                self._log.warning("closing with operations in flight", pending=len(self._pending))
            if self._bridge is not None:
                await self._bridge.stop()
            h = self._h
            self._closed = True
            await anyio.to_thread.run_sync(lib.aio_engine_destroy, h)
        for op in self._pending.values():
            op.status = _CLOSED_STATUS
            op.event.set()
        self._pending.clear()
        for c in self._counters.values():
            c._fail_all()
        while self._recv_waiters:
            self._recv_waiters.popleft().event.set()
        for mr in self._regions:
            mr._handle = None
        self._regions.clear()


def _as_bytes(v: Any, name: str) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise InvalidArgument(f"{name} must be bytes, not {type(v).__name__}")


def _post_error(code: int, what: str, posted: int) -> AioteError:
    c = -code
    tail = f" ({posted} requests of it were posted and completed first)" if posted else ""
    if c == _FI_EMSGSIZE:
        return InvalidArgument(f"{what}: message too large for the transport{tail}")
    if c == _FI_EINVAL:
        return InvalidArgument(f"{what}: the transport rejected the request as invalid{tail}")
    if c in _PEER_ERRORS:
        return PeerUnreachable(f"{what}: {_strerror(c)}{tail}", c, 0)
    return TransferError(f"{what}: posting failed: {_strerror(c)}{tail}", c, 0)


class TransferBatch:
    """Writes and reads collected without awaiting, posted by one native call and awaited as
    one (``engine.batch()``). Each ``write``/``read`` validates its arguments at once and raises
    :class:`InvalidArgument` there, so a submitted batch never fails on bad input halfway.
    Costs about a microsecond of Python per request, plus one event-loop round trip per batch.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._table = np.zeros(16, _OP_DTYPE)
        self._n = 0
        self._refs: set[MemoryRegion] = set()

    def __len__(self) -> int:
        return self._n

    def _grow(self) -> np.ndarray:
        if self._n == len(self._table):
            self._table = np.resize(self._table, 2 * len(self._table))
        return self._table

    def write(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
    ) -> TransferBatch:
        """Adds a write (same arguments as :meth:`Engine.write`); returns the batch."""
        self._engine._fill(
            self._grow(), self._n, mr, remote, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE
        )
        self._n += 1
        self._refs.add(mr)
        return self

    def read(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
    ) -> TransferBatch:
        """Adds a READ (same arguments as :meth:`Engine.read`); returns the batch."""
        self._engine._fill(
            self._grow(), self._n, mr, remote, length, src_offset, dst_offset, None, lib.AIO_OP_READ
        )
        self._n += 1
        self._refs.add(mr)
        return self

    async def submit(self, *, timeout: float | None = None) -> None:
        """Posts every request and waits until all completed. Raises the first error
        (after every posted request finished); see :meth:`Engine.write` for cancellation.

        A batch may be submitted again (a static schedule built once); each submission
        re-checks that its regions are still registered (:class:`InvalidArgument` if not)."""
        self._engine._check_open()
        if self._n == 0:
            await anyio.lowlevel.checkpoint()
            return
        for mr in self._refs:
            if mr._handle is None:
                raise InvalidArgument("a region of this batch was unregistered since it was added")
        table = self._table[: self._n]  # rows are never rewritten; growth reallocates
        await self._engine._run(table, self._refs, timeout, f"batch of {self._n}")


def _open_native(
    provider: str,
    nics: Sequence[str | None],
    *,
    slots: int,
    slot_size: int,
    spin_ns: int,
    sleep_ms: int,
    max_in_flight: int,
) -> tuple[Any, list[RailInfo]]:
    cfg = ffi.new(
        "aio_engine_config*",
        {
            "ring_capacity": 1 << 16,
            "max_ops": max_in_flight,
            "max_groups": max_in_flight,
            "spin_ns": spin_ns,
            "sleep_ms": sleep_ms,
        },
    )
    out = ffi.new("aio_engine**")
    err = ffi.new("char[1024]")
    rc = lib.aio_engine_create(cfg, out, err, 1024)
    if rc != 0:
        raise ProviderError(ffi.string(err).decode(errors="replace") or _strerror(-rc))
    h = out[0]
    rails: list[RailInfo] = []
    try:
        for nic in nics:
            rc = lib.aio_engine_add_rail(
                h, provider.encode(), nic.encode() if nic else ffi.NULL, slots, slot_size, err, 1024
            )
            if rc < 0:
                raise ProviderError(ffi.string(err).decode(errors="replace") or _strerror(-rc))
            info = ffi.new("aio_rail_info*")
            lib.aio_rail_get_info(h, rc, info)
            rails.append(
                RailInfo(
                    index=rc,
                    provider=ffi.string(info.provider).decode(),
                    domain=ffi.string(info.domain).decode(),
                    fabric=ffi.string(info.fabric).decode(),
                    address=bytes(ffi.buffer(info.addr, info.addr_len)),
                    mr_mode=int(info.mr_mode),
                    cq_data_size=int(info.cq_data_size),
                    max_msg_size=int(info.max_msg_size),
                    inject_size=int(info.inject_size),
                    has_wait_fd=bool(info.has_wait_fd),
                    max_message_size=int(info.slot_size),
                )
            )
        rc = lib.aio_engine_start(h)
        if rc != 0:
            raise ProviderError(f"could not start the poller thread: {_strerror(-rc)}")
    except BaseException:
        lib.aio_engine_destroy(h)
        raise
    return h, rails


_DEFAULT_NIC = {"tcp": "lo"}


@asynccontextmanager
async def open_engine(
    provider: str = "tcp",
    nics: Sequence[str] | None = None,
    *,
    max_message_size: int = 1 << 20,
    message_slots: int = 16,
    spin_us: float = 50.0,
    loop_spin_us: float = 0.0,
    sleep_ms: int = 100,
    max_in_flight: int = 16384,
    cancel_grace: float = 5.0,
    post_budget_us: float = 200.0,
) -> AsyncIterator[Engine]:
    """Opens an engine: one rail per NIC in ``nics`` on libfabric ``provider``.

    ``provider``: ``"tcp"`` (default; over loopback with the default ``nics=["lo"]``),
    ``"shm"`` (same host), ``"verbs"``, ``"efa"``, or a full libfabric provider name.
    ``nics``: interface/domain names (``["lo"]``, ``["eth0", "eth1"]``, ``["mlx5_0"]``).
    ``max_message_size``/``message_slots``: the size and count of the registered message
    slots for :meth:`Engine.send`/:meth:`Engine.recv`, per NIC, for both directions.
    ``spin_us``: how long the native poller busy-polls after the last activity before it
    sleeps on the provider's wait object; raise it (e.g. ``1000``) for lower latency at the
    price of CPU, ``0`` to never spin. ``loop_spin_us``: the low-latency setting of the event-loop
    side: an operation or counter wait that is not complete right after posting drains the
    completion ring from the loop thread for up to this long before it sleeps (saves the
    eventfd wake-up, about 20-50 us; blocks the loop for at most that long, so keep it small
    and use it where latency matters more than other tasks' fairness; default 0: off).
    ``sleep_ms``: the timed fallback of the sleeping poller.

    Raises :class:`ProviderError` naming what is missing (unknown provider or NIC, no RMA).
    The engine closes when the block exits (see :meth:`Engine.aclose`). Opening costs a few
    milliseconds plus libfabric's one-time start-up.
    """
    if not isinstance(provider, str) or not provider:
        raise InvalidArgument("provider must be a non-empty string such as 'tcp' or 'shm'")
    if nics is None:
        nic_list: list[str | None] = [_DEFAULT_NIC.get(provider)]
    else:
        if isinstance(nics, str):
            raise InvalidArgument("nics must be a list of NIC names, e.g. ['lo']")
        nic_list = list(nics)
        if not nic_list:
            raise InvalidArgument("nics must name at least one NIC")
        if len(nic_list) > 16:
            raise InvalidArgument("at most 16 NICs per engine")
    max_message_size = as_index(max_message_size, "max_message_size", lo=0, hi=1 << 31)
    message_slots = as_index(message_slots, "message_slots", lo=1, hi=1 << 16)
    max_in_flight = as_index(max_in_flight, "max_in_flight", lo=16, hi=1 << 24)
    if not (spin_us >= 0 and math.isfinite(spin_us)):
        raise InvalidArgument("spin_us must be >= 0")
    if not (loop_spin_us >= 0 and math.isfinite(loop_spin_us)) or loop_spin_us > 100_000:
        raise InvalidArgument("loop_spin_us must be between 0 and 100000")
    slot_size = max_message_size + 4096  # room for the sender's address
    h, rails = await anyio.to_thread.run_sync(
        partial(
            _open_native,
            provider,
            nic_list,
            slots=message_slots,
            slot_size=slot_size,
            spin_ns=int(spin_us * 1000),
            sleep_ms=int(sleep_ms),
            max_in_flight=max_in_flight,
        )
    )
    engine = Engine(
        h,
        rails,
        cancel_grace=cancel_grace,
        post_budget_ns=int(post_budget_us * 1000),
        max_message_size=max_message_size,
        loop_spin_ns=int(loop_spin_us * 1000),
    )
    try:
        await engine._start()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await engine.aclose()
        raise
    engine._log.debug("engine open", provider=provider, nics=[r.domain for r in rails])
    try:
        yield engine
    finally:
        await engine.aclose()
