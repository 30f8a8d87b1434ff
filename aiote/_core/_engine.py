"""The engine: rails (NICs) over the C core, memory registration, one-sided and two-sided
operations, all awaitable under asyncio and trio."""

from __future__ import annotations

import collections
import contextvars
import hashlib
import itertools
import math
import operator
import os
import struct
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import numpy as np

from .._native import ffi, lib
from ._arena import Arena
from ._bridge import LoopBridge
from ._counter import ImmCounter
from ._descriptor import (
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    DEVICE_CUDA,
    DEVICE_HOST,
    DirectExtent,
    EngineAddress,
    GpuExtent,
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
    TransferStalled,
    TransferTimeout,
)
from ._gpu import GpuSupport, UvmWatcher
from ._log import get_logger
from ._memory import MemoryRegion, host_buffer
from ._peers import PeerBook
from ._retry import RetryPolicy
from ._routing import DomainGroup, Route, Router, addr_ends
from ._util import as_index, check_timeout, deadline_at, now, shm_peer_gone, timeout_error, wait_until

__all__ = ["Engine", "RailInfo", "ScatterTarget", "Transfer", "TransferBatch", "open_engine"]

# libfabric probes every provider it knows at start-up; the C core restricts that first probe to
# the providers aiote can use (unless FI_PROVIDER is set) without changing os.environ (fab_init).

_log = get_logger(component="engine")

_U32 = 1 << 32
_CREDIT = int(lib.AIO_CREDIT_UNIT)
_SPILL_BYTES = 1 << 20  # see Engine._held: queued copies of messages that were not held
_CREDIT_MSG = struct.Struct("<BQIQ")  # internal credit message: kind, sequence number, imm, units
_K_CREDIT = 2  # (kind 1: a GPU staging part, aiote/_core/_gpu.py)
_K_CREDIT_BYTE = bytes([_K_CREDIT])
_CREDITS_SEEN_MAX = 1 << 16  # credit messages remembered for de-duplication
# deferred credits of multi-route operations: (path, imm, owner's address) -> logical writes
_Credits = dict[tuple[Any, int, EngineAddress], int]
_MSG_HEADER = struct.Struct("<H")  # the sender's address length; the top bit marks internal messages
_INTERNAL = 0x8000
_GPU_COUNTS = ("gpu_ipc", "gpu_staged", "gpu_direct", "gpu_parts_in")

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
_FI_EBUSY = 16
_NO_DIRECT = (0, 0)
_ELSEWHERE = bytes(16)  # a host id no engine has: routes a same-host peer as a remote one (_host_of)
_DIRECT_SLOTS = int(lib.AIO_DIRECT_SLOTS)
_FI_ECANCELED = 125
_ENOENT = 2
_STALLED = -(1 << 29)  # posting made no progress for connect_timeout
# where a caller collects the groups its operations left on a failed link (see collect_stranded)
_STRANDED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("aiote_stranded", default=None)
# where an operation with deferred credits collects the groups its data goes in (see _then_credit)
_GROUPS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("aiote_groups", default=None)
# the retry policy of the operation running in this task (and the tasks it starts)
_POLICY: contextvars.ContextVar[RetryPolicy | None] = contextvars.ContextVar("aiote_retry", default=None)
_CLOSED_STATUS = -(1 << 30)  # an operation failed because the engine closed under it


def _strerror(code: int) -> str:
    text: bytes = ffi.string(lib.aio_strerror(code))
    return text.decode(errors="replace")


def _completion_error(status: int, prov_errno: int, what: str) -> TransferError:
    code = -status
    msg = f"{what} failed: {_strerror(code)} (libfabric error {code}, provider error {prov_errno})"
    if code in _PEER_ERRORS or (code == _FI_ECANCELED and prov_errno in _PEER_ERRORS):
        # tcp cancels what was in flight on a connection that broke (provider error: why)
        return PeerUnreachable(msg + "; the peer is gone or not listening", code, prov_errno)
    if code in _ACCESS_ERRORS or (code == _FI_ECANCELED and prov_errno == _ENOENT):
        # tcp cancels a request the target refused (unknown key, range past the region,
        # no access right) with provider error ENOENT
        return RemoteAccessError(msg + "; check the descriptor's key and bounds", code, prov_errno)
    if code == _FI_ETRUNC:
        return TransferError(msg + "; the receiver's buffer was too small", code, prov_errno)
    return TransferError(msg, code, prov_errno)


def _host_id() -> bytes:
    """Who can share memory with this process: the kernel's boot, its PID namespace (direct
    copies and libfabric's shm name peers by pid) and the file system behind ``/dev/shm``
    (shm's queues are files there). Two engines with the same id get the same-host route;
    processes on one node in other containers (another PID namespace, another ``/dev/shm``)
    get another id, so they are reached over the main provider. An IPC namespace alone does not
    separate them: POSIX shared memory lives in ``/dev/shm``."""
    parts = []
    for p in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(p, "rb") as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    if not parts:
        parts.append(os.uname().nodename.encode())
    for ns in ("/proc/self/ns/pid", "/dev/shm"):
        try:
            st = os.stat(ns)
            parts.append(f"{ns}={st.st_dev}:{st.st_ino}".encode())
        except OSError:
            parts.append(f"{ns}=?".encode())
    return hashlib.blake2b(b"|".join(parts), digest_size=16).digest()


@dataclass(frozen=True)
class RailInfo:
    """What one NIC (rail) of an engine is: its provider, domain and capabilities. A frozen
    record (``engine.rails``): reading it costs nothing and raises nothing."""

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


@dataclass(frozen=True, slots=True)
class ScatterTarget:
    """One destination of :meth:`Engine.scatter`: ``length`` bytes from the source region at
    ``src_offset`` to ``desc``'s region at ``dst_offset`` (``None``: as much as fits in both).
    Building one checks nothing and raises nothing: :meth:`Engine.scatter` validates it
    (:class:`InvalidArgument`)."""

    desc: MemoryDescriptor | bytes
    length: int | None
    src_offset: int = 0
    dst_offset: int = 0


class _Op:
    __slots__ = (
        "alts", "done", "event", "failover", "g", "names", "path", "posted", "prov_errno", "rails", "refs",
        "status",
    )

    def __init__(self, refs: Any, event: Any) -> None:
        self.event = event
        self.g = -1  # its native group, once one was opened (the stall watch reads its progress)
        self.posted = 0  # requests of the group handed to the transport so far
        self.status = 0
        self.prov_errno = 0
        self.refs = refs
        self.done = False  # the group's completion record arrived
        self.rails: set[int] | None = None
        self.alts: frozenset[int] = frozenset()  # every rail of its peer's path
        self.failover = False  # woken because a rail of it lost its link
        # the (rail, fi_addr) pairs its rows name, where known (a connection's opening): the
        # engine may forget other peers while it is pending (see _maybe_sweep)
        self.names: frozenset[tuple[int, int]] | None = None
        self.path: Any = None  # the routes of its one peer, where known (see _peer_gone)


class _Group:
    """A group of work requests begun by :meth:`Engine._begin`: its operation, token, native
    group (``-1``: no slot was free yet) and how many requests ``aio_submit`` posted (None:
    not submitted that way)."""

    __slots__ = ("first", "g", "op", "token")

    def __init__(self, op: _Op, token: int, g: int, first: int | None) -> None:
        self.op = op
        self.token = token
        self.g = g
        self.first = first


class _Held:
    """A received message still in its registered slot: its payload is copied out (and the
    slot handed back to the transport) when :meth:`Engine.recv` takes it."""

    __slots__ = ("end", "rail", "sender", "slot", "start")

    def __init__(self, rail: int, slot: int, sender: bytes, start: int, end: int) -> None:
        self.rail = rail
        self.slot = slot
        self.sender = sender
        self.start = start
        self.end = end


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
        ("direct", "<i4"),
    ]
)
assert _OP_DTYPE.itemsize == ffi.sizeof("aio_op_desc")
_OP_STRUCT = struct.Struct("<QQQQQQQiiii")  # one row of _OP_DTYPE
_PARSED_ADDRESSES: dict[bytes, EngineAddress] = {}  # engine address bytes -> parsed (immutable)
_REC_GROUP = int(lib.AIO_REC_GROUP)  # native constants on hot paths, as plain module ints
_OP_WRITE = int(lib.AIO_OP_WRITE)
_OP_READ = int(lib.AIO_OP_READ)
_F_DATA = int(lib.AIO_F_DATA)
_REC_COUNTER = int(lib.AIO_REC_COUNTER)
assert _OP_STRUCT.size == _OP_DTYPE.itemsize


class Engine:
    """A transfer engine: one or more NICs (rails), a native completion poller, and the
    operations, each an awaitable. Open it with :func:`open_engine`; use it from the event
    loop (task) that opened it. What opening raises and costs, and what an open engine holds
    (a native poller thread, registered message slots per NIC), is in :func:`open_engine`.
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
        same_host: str | None = None,
        stripe_min: int = 1 << 20,
        retry: RetryPolicy | None = None,
        gpu_backend: str = "cuda",
        stage_chunk: int = 4 << 20,
        gpu_ipc: bool = True,
        gpu_direct: bool | None = None,
        streams: int = 1,
        same_host_direct: bool = True,
        arena: Arena | None = None,
        message_slots: int = 16,
        max_peers: int = 1024,
    ) -> None:
        self._h = handle
        self._arena = arena
        self._arena_full_logged = False
        self._gpu: GpuSupport | None = None
        self._gpu_cfg = (gpu_backend, stage_chunk, gpu_ipc, gpu_direct)
        self._retry = retry if retry is not None else RetryPolicy()
        self._stripe_min = stripe_min
        # streams > 1: the main provider's rails come in runs of `streams` on one NIC; a
        # transfer that is not striped takes one of them like a single-NIC engine (see _rows)
        self._streams = streams
        self._one_nic: dict[int, tuple[Any, bool]] = {}
        # several routes to a peer: the (rail, peer) connections known to be open, those being
        # opened by a zero-byte request, and the paths whose every route is open (_open_routes)
        self._routes_open: set[tuple[int, int]] = set()
        self._routes_opening: set[tuple[int, int]] = set()
        # connections a zero-byte request of _open_route or connect() completed on (a route
        # in _routes_open may only have been taken by the first transfer, still to be posted)
        self._routes_made: set[tuple[int, int]] = set()
        self._paths_open: dict[int, tuple[tuple[int, int, int, int], ...]] = {}
        self._loop_spin_ns = loop_spin_ns
        self._rails = rails
        self._closed = False
        self._closing = False
        self._cancel_grace = cancel_grace
        self._budget_ns = post_budget_ns
        self._failovers = 0
        self._down_since: dict[int, float] = {}  # rails out of rotation: since when (now())
        self._owners: dict[Any, EngineAddress] = {}  # multi-route paths -> their owner (a cache)
        self._credit_seq = itertools.count(int.from_bytes(os.urandom(6), "little") << 16)
        self._credits_seen: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()
        self._max_message = max_message_size
        self._tokens = itertools.count(1)
        self._pending: dict[int, _Op] = {}
        self._opening = 0  # transfers in _run: seen by _rows before their groups open
        self._counters: dict[int, ImmCounter] = {}
        self._regions: set[MemoryRegion] = set()
        self._book = PeerBook(max_peers)  # resolved peer addresses, forgotten by _sweep
        self._busy = 0  # operations in _attempts (their rows may be posted again after a pause)
        self._batches: weakref.WeakSet[TransferBatch] = weakref.WeakSet()  # rows they keep name peers
        self._desc_paths: dict[int, tuple[MemoryDescriptor, tuple[tuple[int, int, int, int], ...]]] = {}
        self._imm_memos: dict[tuple[int, int], Any] = {}  # single-route write_imms (see _memo_post)
        self._inbox: deque[tuple[bytes, bytes] | _Held] = deque()
        # Messages nobody waits for stay in their slots until recv() takes them (one copy,
        # made then), which also holds back the sender (its transport waits for a slot).
        # A quarter of each rail's slots is kept posted for messages the engine consumes
        # itself (GPU staging): a message that would take one of them is copied out and
        # queued instead, up to _SPILL_BYTES queued that way; past that it is held too.
        self._held = [0] * len(rails)
        self._hold_max = message_slots - max(1, message_slots // 4)
        self._spilled = 0  # bytes of copied-out messages in the inbox
        # sends in flight per (rail, peer), at most _send_cap each: the same three quarters
        # of the slots, on the sending side (see _send_msg)
        self._sends: dict[tuple[int, int], int] = {}
        self._send_room: dict[tuple[int, int], Any] = {}
        self._send_cap = max(1, self._hold_max)
        self._recv_waiters: deque[_RecvWaiter] = deque()
        self._recs = ffi.new("aio_record[256]")
        self._gout = ffi.new("int64_t[1]")  # aio_submit's group (the loop thread only)
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]] = anyio.lowlevel.checkpoint_if_cancelled
        self._address = EngineAddress(
            tuple(RailAddress(r.provider, r.address) for r in rails), _host_id(), max_message_size
        )
        self._address_bytes = bytes(self._address)
        self._router = Router(
            [r.provider for r in rails],
            [r.domain for r in rails],
            self._address.host_id,
            same_host,
            self._peer,
        )
        self._bridge: LoopBridge | None = None
        self._event: Any = anyio.Event  # replaced by the loop's own Event class in _start
        self._space: Any = None  # set when a request completes after aio_want_space
        self._scratch: MemoryRegion | None = None
        self._log = _log.bind(engine=self._address_bytes[-4:].hex())
        # direct same-host copies (see aiote_core.h): this engine's table, if it publishes one,
        # and the peers' tables it copies into (attached on first use; -1: not possible)
        self._shm_rails = frozenset(r.index for r in rails if r.provider == "shm")
        self._direct_on = same_host_direct and bool(self._shm_rails)
        info = ffi.new("aio_direct_info*")
        self._direct_info: tuple[int, int, int, int] | None = (
            (int(info.pid), int(info.fd), int(info.nonce), int(info.table))
            if self._direct_on and lib.aio_direct_info_get(handle, info) == 0
            else None
        )
        self._direct_attached: dict[tuple[int, int], int] = {}
        self._direct_codes: dict[int, tuple[MemoryDescriptor, tuple[int, int]]] = {}

    # ------------------------------------------------------------------ properties

    @property
    def address(self) -> bytes:
        """This engine's address as bytes: hand it to peers out of band (``send`` targets it).
        Built once at open: O(1), raises nothing (also after close)."""
        return self._address_bytes

    @property
    def rails(self) -> tuple[RailInfo, ...]:
        """The NICs of this engine, in order. O(NICs) (a new tuple), no native call; raises nothing."""
        return tuple(self._rails)

    @property
    def domains(self) -> DomainGroup:
        """The engine's NICs as a :class:`DomainGroup` (which are out of rotation now). O(NICs),
        no native call; raises nothing."""
        main = self._rails[0].provider
        return DomainGroup(
            provider=main,
            nics=tuple(r.domain for r in self._rails if r.provider == main),
            same_host=next((r.provider for r in self._rails if r.provider != main), None),
            stripe_min=self._stripe_min,
            # one entry per NIC: its streams go down together
            down=tuple(self._rails[i].domain for i in sorted(self._router.down) if i % self._streams == 0),
            streams=self._streams,
        )

    @property
    def closed(self) -> bool:
        """True once the engine is closed (still False while :meth:`aclose` waits for work in
        flight). O(1), raises nothing."""
        return self._closed

    @property
    def max_message_size(self) -> int:
        """The largest payload :meth:`send` accepts (peers must use the same or larger). O(1),
        raises nothing."""
        return self._max_message

    def stats(self) -> dict[str, int]:
        """Counters of the native poller (polls, sleeps, wake-ups, completions, errors;
        ``loop_polls``: low-latency waits that drove the completion queues from the loop thread;
        ``spin_window_ns``: the poller's adaptive spin window as of its last activity, 0 for the
        base ``spin_us``; ``direct_copies``: same-host copies this engine made directly (reads,
        and writes into peers' arenas), ``direct_mapped``: those of them into or out of a
        peer's arena (``memcpy``); ``arena_bytes``: bytes of this engine's arena handed out by
        :meth:`alloc_host` (page-rounded);
        ``tcp_buffers_set``: tcp sockets whose send buffer the engine set, see ``open_engine``'s
        ``tcp_send_buffer``; ``posts_handed``: tcp writes and reads the loop thread handed to
        the poller to post because the poller was busy on their NIC; ``posts_handed_waited``:
        those of them that found their connection's queue full, its peer slow or stopped), the
        operations and regions in flight (``pending``: groups whose completion record the loop
        has not read yet; a posted transfer's quiet record is read at the next wake-up), and
        ``peers``: peer NIC addresses resolved (each is
        resolved once and cached), ``routes_open`` / ``routes_opening``: connections to peers
        reached over several NICs or ``streams`` known open / being opened by a zero-byte
        request (a transfer to such a peer goes only over open ones), ``failovers``: requests
        re-posted on another NIC after a link failure, ``stranded``: groups left on a failed
        link, still owned by the transport (their bytes land again if the link recovers).
        GPU: ``gpu_ipc`` / ``gpu_staged`` / ``gpu_direct``: operations sent through CUDA IPC /
        staged through pinned host memory / posted on GPU memory the NICs registered (FI_HMEM),
        ``gpu_parts_in``: staged parts this engine copied into its GPU memory;
        ``pollers``: the native poller threads that drive the rails (``open_engine``'s ``pollers``).
        O(1) but ``stranded``: O(pending). Raises :class:`EngineClosed` once the engine closed."""
        st = ffi.new("aio_stats*")
        lib.aio_get_stats(self._handle(), st)
        return {
            "polls": st.polls,
            "sleeps": st.sleeps,
            "wakeups_sent": st.wakeups_sent,
            "completions": st.completions,
            "remote_data": st.remote_data,
            "errors": st.errors,
            "spin_window_ns": st.spin_window_ns,
            "direct_copies": st.direct_ops,
            "direct_mapped": st.direct_mapped,
            "arena_bytes": self._arena.in_use if self._arena is not None else 0,
            "tcp_buffers_set": st.tcp_tuned,
            "posts_handed": st.posts_handed,
            "posts_handed_waited": st.posts_handed_waited,
            "pollers": int(lib.aio_engine_num_pollers(self._h)),
            "loop_polls": int(lib.aio_loop_polls(self._h)),
            "ops_in_flight": int(lib.aio_ops_in_flight(self._h)),
            "pending": len(self._pending),
            "regions": len(self._regions),
            "peers": len(self._book),
            "peers_forgotten": self._book.forgotten,
            "routes_open": len(self._routes_open),
            "routes_opening": len(self._routes_opening),
            "failovers": self._failovers,
            "stranded": sum(1 for op in self._pending.values() if op.failover),
            **(self._gpu.counts if self._gpu is not None else dict.fromkeys(_GPU_COUNTS, 0)),
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

    async def _attempts(
        self,
        attempt: Callable[[float | None], Awaitable[Any]],
        timeout: float | None,
        retry: RetryPolicy | None,
        what: str,
    ) -> None:
        """Runs ``attempt(time_left)``, re-running it after a broken connection as the retry
        policy says (see :class:`RetryPolicy`). The policy is checked before anything is
        posted, and is in force (``connect_timeout`` included) for every group it posts."""
        _check_retry(retry)
        end = _end(timeout)
        token = _POLICY.set(retry) if retry is not None else None
        self._busy += 1
        try:
            try:
                await attempt(timeout)
            except PeerUnreachable as exc:
                await self._retry_after(exc, attempt, end, retry or self._retry, what)
        finally:
            self._busy -= 1
            if token is not None:
                _POLICY.reset(token)
            if self._book.due:
                self._maybe_sweep()

    async def _retry_after(
        self,
        exc: PeerUnreachable,
        attempt: Callable[[float | None], Awaitable[Any]],
        end: float | None,
        policy: RetryPolicy,
        what: str,
    ) -> None:
        """Re-posts after a broken connection: up to ``attempts`` times, within the
        operation's deadline. A new attempt is started only within ``connect_timeout`` of the
        first failure, and an attempt towards a peer that does not answer gives up after
        ``connect_timeout`` (in :meth:`_run_group`), so a dead peer is reported within about
        ``connect_timeout`` plus the pauses; an attempt that is moving data has the
        operation's whole remaining time."""
        peer_end = now() + policy.connect_timeout
        n = 0
        while True:
            if getattr(exc, "_final", False) or n >= policy.attempts:
                raise exc
            n += 1
            pause = policy.delay(n)
            t = now()
            if t + pause >= peer_end or (end is not None and t + pause >= end):
                raise exc
            self._log.info("posting again after a broken connection", op=what, attempt=n, error=str(exc))
            await self._pause(pause)
            try:
                await attempt(_left(end))
                return
            except PeerUnreachable as again:
                exc = again

    @contextmanager
    def _collect_stranded(self, into: list[Any]) -> Iterator[None]:
        """Within the block, groups that operations of this task leave on a failed link (a
        failover moved their work elsewhere) are appended to ``into``; :meth:`_settle_all`
        waits for them."""
        token = _STRANDED.set(into)
        try:
            yield
        finally:
            _STRANDED.reset(token)

    async def _settle_all(self, ops: list[Any]) -> None:
        for op in ops:
            await self._settle(op)

    async def wait_stranded(self) -> None:
        """Waits until no request that a failover left on a failed link is still owned by the
        transport (``stats()["stranded"]`` is 0): after it, none of them can land any more.
        Returns at once when there is none (or the engine is closed); waits as long as the link
        stays down. Raises nothing of its own; cancellable. Costs an O(pending) scan per stranded
        group, no native call; the task sleeps until each one's completion wakes it."""
        while True:
            op = next((o for o in self._pending.values() if o.failover and not o.done), None)
            if op is None or self._closed:
                return
            await self._settle(op)

    def _connect_timeout(self) -> float:
        """The connect_timeout in force: the operation's policy, else the engine's."""
        p = _POLICY.get()
        return (p if p is not None else self._retry).connect_timeout

    async def _settle(self, op: _Op) -> None:
        """Waits until the group of ``op`` has completed (its completion record arrived)."""
        while not op.done and not self._closed:
            ev = op.event
            if ev.is_set():  # set by a failover wake-up, not by the completion
                ev = op.event = self._event()
            await ev.wait()

    async def _wait_space(self, fallback: float, end: float | None = None) -> Any:
        """Waits until half of this engine's requests in flight completed (room in the
        queues) or ``fallback`` seconds pass, or the deadline ``end``; returns the handle
        (EngineClosed if closing meanwhile)."""
        t = now()
        when = t + fallback if end is None else min(t + fallback, end)
        inflight = int(lib.aio_ops_in_flight(self._h))
        if inflight == 0:  # nothing will complete (a peer still connecting): the timer only
            return await self._pause(max(0.0, when - t))
        ev = self._space
        lib.aio_want_space(self._h, inflight // 2)
        await wait_until(ev, when)
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
        """Low-latency mode (``loop_spin_us``): the loop thread drives the completion queues
        itself (``aio_poll_ring``, GIL released: polls for 30 us yielding the CPU, then sleeps
        on the NICs' wait objects) until ``done()`` or the spin budget runs out, instead of a
        hand-off through the ring and the eventfd. Every record is dispatched by
        :meth:`_drain` as usual, which also re-arms the eventfd before the loop may sleep.
        Blocks the event loop for at most ``loop_spin_us``."""
        h = self._h
        left = self._loop_spin_ns
        end = time.perf_counter_ns() + left
        while not self._closed:
            got = lib.aio_poll_ring(h, left)
            self._drain()
            if not got or done():
                return
            left = end - time.perf_counter_ns()
            if left <= 0:
                return

    def _drain(self) -> None:
        h = self._h
        recs = self._recs
        pending = self._pending
        while True:
            n = lib.aio_drain(h, recs, 256)
            for i in range(n):
                r = recs[i]
                kind = r.kind
                if kind == _REC_GROUP:
                    op = pending.pop(r.token, None)
                    if op is not None:
                        op.done = True
                        op.status = r.status
                        op.prov_errno = r.prov_errno
                        op.refs = None
                        op.event.set()
                elif kind == _REC_COUNTER:
                    c = self._counters.get(r.token)
                    if c is not None:
                        c._serve()
                elif kind == lib.AIO_REC_RECV:
                    self._on_message(r.rail, r.a, r.b, r.status)
                elif kind == lib.AIO_REC_SPACE:
                    self._space.set()
                    self._space = self._event()
                elif kind == lib.AIO_REC_LINK:
                    self._on_link(r.rail, bool(r.a))
                elif kind == lib.AIO_REC_WATCH and self._gpu is not None:
                    self._gpu.on_watch(int(r.token), int(r.a))
            if n == 256:
                continue
            if lib.aio_arm(h):
                continue
            break

    def _on_link(self, rail: int, up: bool) -> None:
        """A rail's link changed: take it out of rotation (and wake the groups posted on it,
        which re-post their work on the other NICs) or put it back."""
        name = self._rails[rail].domain
        if up:
            self._down_since.pop(rail, None)
            self._router.down.discard(rail)
            self._log.info("link up: NIC back in rotation", nic=name)
            return
        self._router.down.add(rail)
        self._down_since.setdefault(rail, now())
        woken = 0
        down = self._router.down
        for op in self._pending.values():
            if op.rails is None or rail not in op.rails or op.event.is_set():
                continue
            if op.alts - down:  # another NIC still reaches the peer: move the work there
                op.failover = True
                op.event.set()
                woken += 1
            # else: nothing to move to; the requests wait in the transport for a link
        self._log.warning("link down: NIC out of rotation", nic=name, operations_moved=woken)

    def _on_message(self, rail: int, slot: int, length: int, status: int) -> None:
        """A message arrived in ``slot``. Handed to a waiting receiver (copied out now), or
        queued in its slot (copied out when :meth:`recv` takes it) while the rail holds fewer
        than ``_hold_max`` or the queued copies already reach ``_SPILL_BYTES``, or else copied
        out and queued. Internal messages are consumed here."""
        n = _MSG_HEADER.size
        end = internal = 0
        raw: Any = None
        if status == 0 and length >= n:
            raw = ffi.buffer(lib.aio_recv_slot(self._h, rail, slot), length)
            (alen,) = _MSG_HEADER.unpack_from(raw)
            internal = alen & _INTERNAL
            alen &= ~_INTERNAL
            end = n + alen
        if raw is None or end > length:
            lib.aio_recv_repost(self._h, rail, slot)
            if status != 0:
                self._log.warning("message dropped", rail=rail, error=_strerror(-status))
            else:
                self._log.warning("malformed message dropped", rail=rail, length=length)
            return
        if (
            not internal
            and not self._recv_waiters
            and (self._held[rail] < self._hold_max or self._spilled + length - end > _SPILL_BYTES)
        ):
            self._held[rail] += 1
            self._inbox.append(_Held(rail, slot, raw[n:end], end, length))
            return
        item = (raw[n:end], raw[end:length])  # sender and payload copied out, once each
        lib.aio_recv_repost(self._h, rail, slot)
        if internal:
            if item[1][:1] == _K_CREDIT_BYTE:
                self._on_credit(*item)
            elif self._gpu is None:
                self._log.warning("GPU staging message for an engine without GPU regions dropped")
            else:
                self._gpu.on_part(*item)
            return
        self._deliver(item)

    def _deliver(self, item: tuple[bytes, bytes], first: bool = False) -> None:
        """A copied-out message to the longest-waiting receiver, or else into the inbox (at its
        end, or ``first``: at its front), counted in ``_spilled``."""
        if self._recv_waiters:
            w = self._recv_waiters.popleft()
            w.item = item
            w.event.set()
            return
        self._spilled += len(item[1])
        if first:
            self._inbox.appendleft(item)
        else:
            self._inbox.append(item)

    def _take(self, item: tuple[bytes, bytes] | _Held) -> tuple[bytes, bytes]:
        """``item`` as ``(sender, payload)``; a held one is copied out of its slot, which goes
        back to the transport."""
        if not isinstance(item, _Held):
            self._spilled -= len(item[1])
            return item
        if self._closed:  # after the teardown the slots are gone (closing: still there)
            raise EngineClosed("the engine closed while receiving")
        h = self._h
        payload = ffi.buffer(lib.aio_recv_slot(h, item.rail, item.slot), item.end)[item.start :]
        lib.aio_recv_repost(h, item.rail, item.slot)
        self._held[item.rail] -= 1
        return item.sender, payload

    # ------------------------------------------------------------------ memory

    def alloc_host(self, shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray[Any, Any]:
        """A zero-filled, C-contiguous NumPy array of ``shape`` and ``dtype`` in this engine's
        host arena (``open_engine(host_arena=)``): register it like any array. Same-host peers
        map the arena, so their writes into it and reads out of it are one ``memcpy`` by their
        poller thread (under the same key, bounds and rights checks as every access), instead
        of a copy by this process's shm progress: the fastest same-host path (writes from
        4 KiB on; smaller ones, paged writes and scatters go through shm). Peers on other
        hosts, or without ``same_host_direct``, see an ordinary region.

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
            backend, chunk, ipc, direct = self._gpu_cfg
            if direct is None:  # register GPU memory with the NICs when every NIC can
                direct = backend == "cuda" and all(lib.aio_rail_hmem(self._h, r.index) for r in self._rails)
            self._gpu = GpuSupport(self, backend, chunk=chunk, ipc=ipc, direct=direct)
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

    # ------------------------------------------------------------------ routing

    def _peer(self, rail: int, address: bytes) -> int:
        key = (rail, address)
        fa = self._book.get(key)
        if fa is None:
            out = ffi.new("uint64_t*")
            rc = lib.aio_av_insert(self._h, rail, address, len(address), out)
            if rc != 0:
                raise InvalidArgument(
                    f"the peer address is not valid for {self._rails[rail].provider}: {_strerror(-rc)}"
                )
            fa = int(out[0])
            self._book.add(key, fa)
        return fa

    def forget_peer(self, peer: bytes | EngineAddress | MemoryDescriptor) -> None:
        """Lets go of what this engine keeps for a peer engine that left (its addresses in
        the NICs' address vectors, its connections, its same-host region table and the route
        caches naming it). Never cancels or fails anything: the peer is forgotten at once if
        nothing is in flight, else at the engine's next quiet moment (no transfer being built,
        posted, retried or awaited), and an address a kept :class:`TransferBatch` names stays
        until the batch is gone. Reaching the peer again later works and costs a new connection.

        The engine also forgets by itself: same-host peers whose process exited or closed its
        engine (noticed when another same-host peer is first reached), and past
        ``open_engine``'s ``max_peers`` addresses, those not used since the previous sweep, so
        what it keeps per peer stays bounded however many peers come and go.

        ``peer``: the peer's address (bytes or :class:`EngineAddress`) or a descriptor of one
        of its regions. Raises :class:`InvalidArgument` for anything else. O(NICs), plus a
        sweep (O(addresses kept)) when the engine is quiet."""
        if isinstance(peer, MemoryDescriptor):
            addr = peer.address
        elif isinstance(peer, (bytes, bytearray, memoryview, EngineAddress)):
            addr = self._engine_address(peer)
        else:
            raise InvalidArgument(
                f"peer must be an engine address or a MemoryDescriptor, not {type(peer).__name__}"
            )
        self._check_open()
        self._book.mark(r.address for r in addr.rails)
        self._maybe_sweep()

    def _named(self) -> set[tuple[int, int]] | None:
        """The (rail, fi_addr) pairs that rows being built, posted, retried or awaited name, or
        None when some of them are not known (a transfer in progress: the engine is not quiet)."""
        if self._opening or self._busy or self._sends:
            return None
        busy = set(self._routes_opening)
        for op in self._pending.values():
            if op.names is None:
                return None
            busy |= op.names
        for b in self._batches:
            t = b._table[: b._n]
            busy.update(zip(t["rail"].tolist(), t["peer"].tolist(), strict=True))
        return busy

    def _maybe_sweep(self) -> None:
        """Forgets what :class:`PeerBook` says to (see :mod:`._peers`), if the engine is quiet."""
        if self._closed or not self._book.due:
            return
        busy = self._named()
        if busy is None:
            return
        gone, detach = self._book.sweep(busy)
        for (rail, _), fa in gone:
            lib.aio_av_remove(self._h, rail, fa)
            self._routes_open.discard((rail, fa))
            self._routes_made.discard((rail, fa))
        for index in detach:
            lib.aio_direct_detach(self._h, index)
        if detach:
            dropped = set(detach)
            for k in [k for k, v in self._direct_attached.items() if v in dropped]:
                del self._direct_attached[k]
        if gone:
            # every cache that may hold a forgotten fi_addr (or a detached table's code):
            # rebuilt on next use, from the addresses kept or resolved anew
            self._router.forget()
            for cache in (self._desc_paths, self._direct_codes, self._one_nic, self._paths_open,
                          self._owners, self._imm_memos):
                cache.clear()
            for mr in self._regions:
                mr._memos.clear()
            self._log.debug("peers forgotten", addresses=len(gone), tables=len(detach))

    def _direct_sweep_gone(self) -> None:
        """Marks the same-host peers whose process exited or closed its engine (a poll of
        each attached table's pidfd): forgotten at the next sweep."""
        for index in self._book.attachments():
            if lib.aio_direct_gone(self._h, index) == 1:
                self._book.mark_attached(index)

    def _path(self, rdesc: MemoryDescriptor) -> tuple[tuple[int, int, int, int], ...]:
        """Every route to the owner of ``rdesc``, up or down (cached per descriptor key set);
        :meth:`Router.live` filters the ones in rotation. The descriptor objects last used are
        remembered by identity: hashing a descriptor's keys costs a microsecond per write."""
        hit = self._desc_paths.get(id(rdesc))
        if hit is not None and hit[0] is rdesc:
            return hit[1]
        p = self._router.path(rdesc.keys, self._host_of(rdesc))
        if len(self._desc_paths) >= 1024:
            self._desc_paths.clear()
        self._desc_paths[id(rdesc)] = (rdesc, p)  # holds rdesc: its id cannot be reused meanwhile
        return p

    def _host_of(self, rdesc: MemoryDescriptor) -> bytes:
        """The host id to route ``rdesc`` by: its owner's, unless the same-host route cannot
        keep its guarantees for this region. libfabric 1.17's shm checks no key, bounds or
        access right and never fails a request to a process that died, so host memory of a
        same-host peer is reached over shm only through the owner's region table (direct
        copies, checked by the initiator: see :meth:`_direct`); a region without a slot there
        (the owner publishes no table, no remote access, a full table) or an owner this process
        cannot attach to goes over the main provider, as a peer on another host."""
        host = rdesc.host_id
        if host != self._address.host_id or not self._shm_rails or rdesc.device_kind != DEVICE_HOST:
            return host
        if self._router.provider_for([k.provider for k in rdesc.keys], host) != "shm":
            return host
        if rdesc.direct is not None and self._direct(rdesc)[0]:
            return host
        return _ELSEWHERE

    def route(self, peer: bytes | EngineAddress | MemoryDescriptor) -> Route:
        """How this engine reaches ``peer`` (an engine address, or a descriptor of one of its
        regions): the provider (``shm`` for a same-host peer when both engines carry it, else
        the main provider), and the (local NIC, remote NIC) pairs transfers are striped over.
        Force a provider by opening the engine with ``same_host=None`` (never shm) or with
        ``provider="shm"``. Raises :class:`InvalidArgument` when no provider is common,
        :class:`DescriptorError` for corrupt address bytes. Costs O(NICs): the first call for a
        peer resolves its NIC addresses (one native call each, cached), later ones hit the cache."""
        if isinstance(peer, MemoryDescriptor):
            return self._router.describe(peer.keys, self._host_of(peer))
        addr = self._engine_address(peer)
        return self._router.describe(addr_ends(addr), addr.host_id)

    async def connect(self, remote: MemoryDescriptor | bytes, *, timeout: float | None = None) -> None:
        """Opens every connection to the owner of ``remote`` (a descriptor of one of its
        regions: one per NIC pair of its route, and per stream of a NIC) and returns once all
        of them are open. Without it, the first transfer to a peer goes over one connection
        while the others open in the background, and transfers are split over all of them
        only after that (see the guide's streams section); after it, the first one already is.

        Guarantees: one zero-byte request (a WRITE, or a READ when the region allows only
        remote reads; no immediate: nothing is counted at the peer, whose region is not
        touched) per connection that no such request of this engine completed on yet, all
        posted at once and awaited together; once every connection was made this way it
        posts nothing. Connections whose local NIC is down are skipped. Cancellation and
        ``timeout`` behave as for :meth:`write` (a posted request stays owned until the
        transport lets go of it).

        Raises :class:`InvalidArgument` when the region allows neither remote writes nor
        reads, :class:`DescriptorError` for corrupt descriptor bytes, :class:`EngineClosed`,
        :class:`PeerUnreachable` when the peer does not answer within the retry policy's
        ``connect_timeout``, :class:`TransferTimeout` after ``timeout``. Costs one native
        posting call and one event-loop wake-up when a connection was to open; a set lookup
        per connection otherwise."""
        self._check_open()
        check_timeout(timeout)
        rdesc = self._remote(remote)
        if rdesc.remote_write:
            op = lib.AIO_OP_WRITE
        elif rdesc.remote_read:
            op = lib.AIO_OP_READ
        else:
            raise InvalidArgument("connect: the region allows neither remote writes nor remote reads")
        full = self._path(rdesc)
        todo = [h for h in self._router.live(full) if (h[0], h[1]) not in self._routes_made]
        if not todo:
            await anyio.lowlevel.checkpoint()
            return
        table = self._table([self._probe(h, op) for h in todo])
        what = f"connect ({len(todo)} connection{'s' if len(todo) > 1 else ''})"
        await self._attempts(lambda t: self._run(table, None, t, what), timeout, None, what)
        made = [(h[0], h[1]) for h in todo]
        self._routes_made.update(made)
        if len(full) > 1:  # the routes transfers to several routes wait for
            self._routes_open.update(made)

    @staticmethod
    def _engine_address(peer: Any) -> EngineAddress:
        if isinstance(peer, EngineAddress):
            return peer
        raw = _as_bytes(peer, "peer")
        # parsed once per distinct address (a reply goes to the sender's address bytes that
        # recv returned: parsing and checking them costs microseconds every time)
        addr = _PARSED_ADDRESSES.get(raw)
        if addr is None:
            addr = EngineAddress.from_bytes(raw)
            if len(_PARSED_ADDRESSES) >= 4096:
                _PARSED_ADDRESSES.clear()
            _PARSED_ADDRESSES[raw] = addr
        return addr

    def _region(self, mr: Any, name: str = "mr") -> MemoryRegion:
        if not isinstance(mr, MemoryRegion):
            raise InvalidArgument(
                f"{name} must be a MemoryRegion from engine.register, not {type(mr).__name__}"
            )
        if mr._engine is not self:
            raise InvalidArgument(
                f"{name} is registered with another engine: register the buffer with this one too"
            )
        if mr._handle is None:
            raise InvalidArgument(
                f"{name} was unregistered: register the buffer again (engine.register) to use it"
            )
        return mr

    @staticmethod
    def _remote(desc: Any) -> MemoryDescriptor:
        if isinstance(desc, MemoryDescriptor):
            return desc
        if isinstance(desc, (bytes, bytearray, memoryview)):
            return MemoryDescriptor.from_bytes(bytes(desc))
        raise InvalidArgument(f"remote must be a MemoryDescriptor or its bytes, not {type(desc).__name__}")

    def _span(
        self,
        mr: Any,
        remote: Any,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        imm: int | None,
        op: int,
    ) -> tuple[MemoryRegion, MemoryDescriptor, int, int, int, int, int]:
        """Checks one transfer's arguments against both regions (nothing is posted):
        (region, remote descriptor, length, local offset, remote offset, imm data, flags)."""
        self._check_open()
        rdesc = self._remote(remote)
        mr = self._region(mr)
        src_offset = as_index(src_offset, "src_offset")
        dst_offset = as_index(dst_offset, "dst_offset")
        if op == _OP_WRITE:
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
        if op == _OP_WRITE and not rdesc.remote_write:
            raise InvalidArgument("the remote region was registered without remote_write")
        if op == _OP_READ:
            if not rdesc.remote_read:
                raise InvalidArgument("the remote region was registered without remote_read")
            if not mr.writable:
                raise InvalidArgument("a READ needs a writable local region; this buffer is read-only")
        flags = 0
        data = 0
        if imm is not None:
            if op != _OP_WRITE:
                raise InvalidArgument("only writes carry an immediate")
            data = as_index(imm, "imm", hi=_U32)
            flags = _F_DATA
        elif length == 0:
            if op == _OP_READ:
                raise InvalidArgument("a READ must move at least one byte")
            raise InvalidArgument("a zero-length write must carry an immediate (imm=...)")
        return mr, rdesc, length, loc_off, rem_off, data, flags

    def _rows(
        self,
        mr: MemoryRegion,
        remote: Any,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        imm: int | None,
        op: int,
        credits: _Credits | None = None,
        gpu_ok: bool = False,
        load: int = 0,
        note: list[bool] | None = None,
    ) -> tuple[list[tuple[int, ...]], Any]:
        """Validates one transfer and returns its aio_op_desc rows and the full route set to
        the peer. Rows: one, or one shard per
        route when it is at least ``stripe_min`` bytes and the peer is reached over several
        NICs; over the streams of one NIC only while fewer operations are in flight, plus
        ``load`` (requests already in the caller's batch), than streams (otherwise the
        streams take whole transfers in turn).

        Counting rule: over a single route the immediate travels with the data. Over several
        routes (NICs) the data rows carry none; the credit is added to ``credits[(path, imm)]``
        and sent by :meth:`_send_credits` once every row has landed, so a row retried on
        another NIC after a link failure is never counted twice. Zero-byte writes are their
        own credit.

        ``note`` (a list; batches): gets one bool for a peer of several routes, True when the
        rows would be the same built later (every route was open, and over one NIC's streams
        the transfer is below ``stripe_min``), False when they depend on what was in flight or
        open (see :meth:`TransferBatch._place`)."""
        mr, rdesc, length, loc_off, rem_off, data, flags = self._span(
            mr, remote, length, src_offset, dst_offset, imm, op
        )
        if not gpu_ok and (mr._dev is not None or rdesc.device_kind == DEVICE_CUDA):
            raise InvalidArgument(
                "scatter, barrier and batches take host regions; move GPU regions with write/write_paged/read"
            )
        full = self._path(rdesc)
        path = self._router.live(full)
        n = len(path)
        start = self._router.start(full)
        opened = self._open_routes(path, op) if n > 1 else path
        if note is not None and n > 1:
            streams = self._streams > 1 and length >= self._stripe_min and self._on_one_nic(path)
            note.append(opened is path and not streams)
        ptr = mr._ptr
        # a same-host peer that published the region, over shm: a direct copy by our poller
        # (a memcpy into or out of the peer's arena, else process_vm_writev / readv), checked
        # against the owner's region table; a bare immediate is checked in place (see _host_of)
        dcode, dkey = self._direct(rdesc) if rdesc.direct is not None and mr._dev is None else _NO_DIRECT
        dhop = _direct_hop(full, dkey, self._shm_rails) if dcode else None
        if dhop is not None:
            # every byte is copied by our poller 0 whatever the stream: one row, on the stream
            # to the owner's first shm NIC (whose key the table publishes), the immediate with it.
            # Below this, no row is a direct copy (the rows of a same-host peer without a table
            # never come here: _host_of routes such a peer over the main provider)
            rail, fa, base, _ = dhop
            return [(ptr, loc_off, length, fa, base + rem_off, dkey, data, rail, op, flags, dcode)], (dhop,)
        if (
            n > 1
            and self._streams > 1
            and (
                opened is not path
                or length < self._stripe_min
                or max(len(self._pending), self._opening) + load >= n
            )
            and self._on_one_nic(path)
        ):
            # streams of one NIC, not striped: as over a single NIC (the immediate travels with
            # the data; the streams take turns over the open ones). A link failure takes every
            # stream of the NIC. A large transfer is split only once every stream is connected
            # (see _open_routes), and only while fewer operations are in flight (plus those
            # ahead of it in the caller's batch) than streams: with every stream busy, a split
            # adds work requests and a credit message and moves nothing faster
            hop = opened[start % len(opened)]
            rail, fa, base, key = hop
            return [(ptr, loc_off, length, fa, base + rem_off, key, data, rail, op, flags, 0)], (hop,)
        path, n = opened, len(opened)  # NICs not connected yet take nothing until they are
        if len(full) > 1 and flags and length:
            if credits is None:
                raise AssertionError("a multi-NIC write with an immediate needs a credit list")
            ckey = (full, data, self._owner_of(full, rdesc))
            credits[ckey] = credits.get(ckey, 0) + 1
            data = flags = 0
        if n == 1 or length < self._stripe_min:
            rail, fa, base, key = path[start % n]
            return [(ptr, loc_off, length, fa, base + rem_off, key, data, rail, op, flags, 0)], full
        # striped: n shards, 4 KiB aligned
        chunk = -(-length // n)
        chunk = -(-chunk // 4096) * 4096
        rows: list[tuple[int, ...]] = []
        for i, o in enumerate(range(0, length, chunk)):
            rail, fa, base, key = path[(start + i) % n]
            ln = min(chunk, length - o)
            rows.append((ptr, loc_off + o, ln, fa, base + rem_off + o, key, 0, rail, op, 0, 0))
        return rows, full

    def _direct(self, rdesc: MemoryDescriptor) -> tuple[int, int]:
        """(the rows' ``direct`` code, the key it is good for) of a region published for direct
        same-host copies, or (0, 0): this engine does not copy directly, or cannot reach the
        owner's table (logged once per owner). Attaches on first use (a few system calls),
        then cached per descriptor object."""
        hit = self._direct_codes.get(id(rdesc))
        if hit is not None and hit[0] is rdesc:
            return hit[1]
        x = rdesc.direct
        code = 0
        if x is not None and self._direct_on and rdesc.host_id == self._address.host_id:
            att = self._direct_attached.get((x.pid, x.nonce))
            if att is None:
                self._direct_sweep_gone()
                info = ffi.new(
                    "aio_direct_info*", {"pid": x.pid, "fd": x.fd, "nonce": x.nonce, "table": x.table}
                )
                err = ffi.new("char[512]")
                att = int(lib.aio_direct_attach(self._h, info, err, 512))
                if att < 0:
                    self._log.info(
                        "same-host peer: direct copies unavailable, reads from it go through shm",
                        pid=x.pid,
                        reason=ffi.string(err).decode(errors="replace") or _strerror(-att),
                    )
                self._direct_attached[(x.pid, x.nonce)] = att
                if att >= 0:
                    self._book.attached(att, (k.address for k in rdesc.keys))
            if att >= 0 and 0 <= x.slot < _DIRECT_SLOTS:
                code = ((att + 1) << 16) | x.slot
        if len(self._direct_codes) >= 1024:
            self._direct_codes.clear()
        # the key a direct copy presents: the descriptor's key of the owner's first shm NIC, the
        # one its table publishes (rows on its other shm streams carry the same, so that a
        # forged or stale key is refused on every stream)
        skey = next((k.key for k in rdesc.keys if k.provider == "shm"), 0)
        out = (code, skey) if x is not None and code else _NO_DIRECT
        self._direct_codes[id(rdesc)] = (rdesc, out)  # holds rdesc: its id cannot be reused meanwhile
        return out

    def _on_one_nic(self, path: tuple[tuple[int, int, int, int], ...]) -> bool:
        """Whether every route of ``path`` leaves through the streams of one local NIC."""
        hit = self._one_nic.get(id(path))
        if hit is not None and hit[0] is path:
            return hit[1]
        k = self._streams
        one = len({h[0] // k for h in path}) == 1
        if len(self._one_nic) >= 1024:
            self._one_nic.clear()
        self._one_nic[id(path)] = (path, one)  # holds path: its id cannot be reused meanwhile
        return one

    def _open_routes(self, path: tuple[tuple[int, int, int, int], ...], op: int) -> tuple[Any, ...]:
        """The routes of ``path`` (several NICs or streams to one peer) whose connections are
        open: ``path`` itself once all are. A connection is opened at its first request, so
        every route not yet open gets a zero-byte request of kind ``op`` (READ or WRITE, so
        that the region's access rights allow it; no immediate, nothing counted) in a
        background task when a transfer first reaches the peer; meanwhile transfers go over
        the open ones (the first: over the first route, which it opens itself). So a transfer
        is never split onto a connection that has yet to be made: a peer that stops answering
        (frozen, overloaded) makes every piece wait on an established connection, instead of
        one piece failing with PeerUnreachable after ``connect_timeout`` (or, timed out, never
        posted). A failed opening is logged and tried again at the next transfer. Costs one
        dict lookup once every route is open."""
        if self._paths_open.get(id(path)) is path:
            return path
        opened = self._routes_open
        if not any((h[0], h[1]) in opened for h in path):
            opened.add((path[0][0], path[0][1]))  # this transfer opens it
        live = tuple(h for h in path if (h[0], h[1]) in opened)
        if len(live) == len(path):
            if len(self._paths_open) >= 1024:
                self._paths_open.clear()
            self._paths_open[id(path)] = path  # holds path: its id cannot be reused meanwhile
            return path
        for hop in path:
            if (hop[0], hop[1]) not in opened and (hop[0], hop[1]) not in self._routes_opening:
                self._routes_opening.add((hop[0], hop[1]))
                assert self._bridge is not None
                self._bridge.spawn(partial(self._open_route, hop, op))
        return live

    def _probe(self, hop: tuple[int, int, int, int], op: int) -> tuple[int, ...]:
        """The row of a zero-byte request of kind ``op`` (READ or WRITE, no immediate) over one
        route: it makes the connection and touches nothing at the peer."""
        assert self._scratch is not None
        rail, fa, base, key = hop
        return (self._scratch._ptr, 0, 0, fa, base, key, 0, rail, op, 0, 0)

    async def _open_route(self, hop: tuple[int, int, int, int], op: int) -> None:
        """Opens the connection of one route to a peer with a zero-byte request (see
        :meth:`_open_routes`); never raises (a failure is logged, and the next transfer to
        the peer tries again)."""
        rail, fa, _, _ = hop
        table = self._table([self._probe(hop, op)])
        try:
            names = frozenset({(rail, fa)})
            if not await self._run_table(table, None, None, "opening a connection", names=names):
                self._routes_open.add((rail, fa))
                self._routes_made.add((rail, fa))
        except Exception as exc:  # the transfer that needs the peer reports the failure
            self._log.info("a connection to a peer did not open (tried again)", rail=rail, error=str(exc))
        finally:
            self._routes_opening.discard((rail, fa))
            if self._book.due:
                self._maybe_sweep()

    async def _then_credit(
        self, data: Awaitable[None], credits: _Credits, end: float | None, what: str,
        rows: int,
    ) -> None:
        """Awaits ``data`` (the ``rows`` requests of an operation over several routes), then
        sends its deferred ``credits`` (see :meth:`_rows`). When ``data`` times out after
        posting, a background task sends the credits once every posted request has landed, and
        the :class:`TransferTimeout`'s ``settled()`` waits for that too: a timed-out operation
        is counted once its data is in place, as over a single route (never when a request
        failed or was never posted). A cancelled one likewise, once all ``rows`` requests were
        posted before the cancellation (see :meth:`_credit_after_cancel`)."""
        if not credits:
            await data
            return
        groups: list[_Op] = []
        token = _GROUPS.set(groups)
        try:
            await data
        except BaseException as exc:
            _GROUPS.reset(token)  # (before a background task copies this context)
            if isinstance(exc, TransferTimeout):
                if exc._waiter is not None:
                    self._credit_later(exc, dict(credits), what)
            elif isinstance(exc, anyio.get_cancelled_exc_class()):
                # cancelled after the groups did what they could (a request that failed
                # raises an error instead: its data is not all in place, never counted)
                self._credit_after_cancel(groups, rows, dict(credits), what)
            raise
        _GROUPS.reset(token)
        await self._send_credits(credits, end, what)

    def _credit_after_cancel(
        self, groups: list[_Op], rows: int, credits: _Credits, what: str
    ) -> None:
        """After a cancellation: when the groups of the operation (those not moved to other
        NICs by a failover) had posted all its ``rows`` requests, a background task sends its
        ``credits`` once every group completed without error, so the cancelled operation is
        counted once, as over a single route where the immediate travels with the data. Not
        all posted: never counted (only part of the data may land)."""
        live = [op for op in groups if not op.failover]
        if not live or sum(op.posted for op in live) != rows or self._closed:
            return

        async def landed() -> bool:
            for op in live:
                await self._settle(op)
            return all(op.done and op.status == 0 for op in live)

        self._credits_later(credits, what, "cancellation", landed)

    def _credit_later(self, exc: TransferTimeout, credits: _Credits, what: str) -> None:
        """Sends ``credits`` from a background task once the timed-out operation of ``exc``
        has settled and every request of it landed; ``exc.settled()`` then waits for that task."""
        settle, landed = exc._waiter, exc._landed

        async def all_landed() -> bool:
            await settle()
            return landed is not None and landed()

        exc._waiter = self._credits_later(credits, what, "timeout", all_landed).wait

    async def _send_credits(
        self, credits: _Credits, end: float | None, what: str, seqs: dict[Any, int] | None = None
    ) -> None:
        """Sends deferred credits (see :meth:`_rows`): one internal message per (peer, imm)
        carrying the credits and a sequence number that the peer's engine counts once
        (:meth:`_on_credit`). A message, not a zero-byte write: a write stranded on a NIC that
        lost its link can still land when the link comes back, after its copy was re-posted on
        another NIC, and be counted twice; a message posted twice is still counted once.
        ``seqs`` (credit key -> number) keeps the numbers drawn for these credits: cancelled
        meanwhile, the credits not sent yet go from a background task with the same numbers (a
        message already out counts once), so the operation is still counted once."""
        seqs = {} if seqs is None else seqs
        left = dict(credits)
        try:
            for key, n in credits.items():
                _, imm, owner = key
                seq = seqs.setdefault(key, next(self._credit_seq))
                payload = _CREDIT_MSG.pack(_K_CREDIT, seq, imm, n * _CREDIT)
                await self._send_msg(owner, payload, _left(end), None, internal=True)
                del left[key]
        except BaseException as exc:
            if left and isinstance(exc, anyio.get_cancelled_exc_class()) and not self._closed:
                self._credits_later(left, what, "cancellation", seqs=seqs)
            raise

    def _on_credit(self, sender: bytes, payload: bytes) -> None:
        """An internal credit message (see :meth:`_send_credits`): adds its credits to the
        counter once per (sender, sequence number); a copy of one already counted is dropped."""
        if len(payload) != _CREDIT_MSG.size:
            self._log.warning("malformed credit message dropped", length=len(payload))
            return
        _, seq, imm, units = _CREDIT_MSG.unpack(payload)
        key = (sender, seq)
        if key in self._credits_seen:
            self._log.info("a credit posted twice was counted once", imm=imm)
            return
        self._credits_seen[key] = None
        if len(self._credits_seen) > _CREDITS_SEEN_MAX:
            self._credits_seen.popitem(last=False)
        lib.aio_counter_add(self._h, imm, units)

    def _owner_of(self, full: Any, rdesc: MemoryDescriptor) -> EngineAddress:
        """The address of the engine that a multi-route path reaches (its credit messages go
        there), cached per path: building it from the descriptor costs O(NICs)."""
        owner = self._owners.get(full)
        if owner is None:
            if len(self._owners) >= 4096:
                self._owners.clear()
            owner = self._owners[full] = rdesc.address
        return owner

    def _credits_later(
        self,
        credits: _Credits,
        what: str,
        after: str,
        landed: Callable[[], Awaitable[bool]] | None = None,
        seqs: dict[Any, int] | None = None,
    ) -> Any:
        """Sends the credits of an operation that timed out or was cancelled (``after``) from a
        background task: once ``landed()`` says its data is all in place (None: it is), unless
        the engine closed meanwhile. Returns the event set when that task is done."""
        done = self._event()

        async def later() -> None:
            try:
                if (landed is None or await landed()) and not self._closed:
                    await self._send_credits(credits, None, f"{what} (credit after its {after})", seqs)
            except Exception as err:  # the peer is gone or the engine closed: never counted
                self._log.info("a transfer's credit was not sent", what=what, after=after, error=str(err))
            finally:
                done.set()

        assert self._bridge is not None
        self._bridge.spawn(later)
        return done

    @staticmethod
    def _table(rows: list[tuple[int, ...]]) -> np.ndarray:
        # packed by struct and viewed by numpy: ~3x cheaper than assigning records one by one
        # into np.zeros (this is on every write's path)
        if len(rows) == 1:
            return np.frombuffer(bytearray(_OP_STRUCT.pack(*rows[0])), _OP_DTYPE)
        return np.frombuffer(bytearray(b"".join([_OP_STRUCT.pack(*r) for r in rows])), _OP_DTYPE)

    # ------------------------------------------------------------------ posting

    async def _run(
        self, table: np.ndarray, refs: Any, timeout: float | None, what: str, path: Any = None
    ) -> None:
        """:meth:`_run_routes`, counted in ``_opening`` from its first step (before its groups
        open, so a transfer another task builds meanwhile sees it: see :meth:`_rows`)."""
        self._opening += 1
        try:
            await self._run_routes(table, refs, timeout, what, path)
        finally:
            self._opening -= 1

    async def _run_routes(
        self, table: np.ndarray, refs: Any, timeout: float | None, what: str, path: Any = None
    ) -> None:
        """Posts the rows of ``table`` and waits for all of them.

        ``path``: the full route set of the one peer region every row addresses (single-peer
        operations). With it, rows on several NICs go as one group per NIC, and when a NIC's
        link goes down the rows of its group are posted again over the remaining NICs (the
        original requests stay owned until the transport lets go of them). Without it (scatter,
        batches), one group; a failed link leaves its rows to the operation's deadline."""
        if path is None or len(path) == 1:  # no failover possible: one group
            await self._run_table(table, refs, timeout, what)
            return
        rails = table["rail"]
        end = _end(timeout)
        if len(table) == 1 or bool((rails == rails[0]).all()):
            if await self._run_table(table, refs, timeout, what, {int(rails[0])}, path):
                await self._run_routes(self._reroute(table, path), refs, _left(end), what, path)
            return
        errors: list[BaseException] = []

        async def one(sub: np.ndarray, rail: int) -> None:
            try:
                if await self._run_table(sub, refs, _left(end), what, {rail}, path):
                    await self._run_routes(self._reroute(sub, path), refs, _left(end), what, path)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for rail in np.unique(rails).tolist():
                tg.start_soon(one, table[rails == rail], int(rail))
        if errors:
            timed_out = [e for e in errors if isinstance(e, TransferTimeout)]
            if not timed_out:
                raise errors[0]
            # a group still posted somewhere: raise the timeout (so the caller can settle it),
            # carrying every NIC's waiter, with any other error as its cause
            waiters = [e._waiter for e in timed_out if e._waiter is not None]

            async def all_settled() -> None:
                for w in waiters:
                    await w()

            first = timed_out[0]
            first._waiter = all_settled
            others = [e for e in errors if not isinstance(e, TransferTimeout)]
            landed = [e._landed for e in timed_out]
            first._landed = lambda: not others and all(f is not None and f() for f in landed)
            raise first from (others[0] if others else None)

    async def _run_table(
        self,
        table: np.ndarray,
        refs: Any,
        timeout: float | None,
        what: str,
        rails: set[int] | None = None,
        path: Any = None,
        names: frozenset[tuple[int, int]] | None = None,
    ) -> bool:
        ptr = ffi.from_buffer("aio_op_desc[]", table)
        post = self._poster(ptr, len(table))
        return await self._run_group(post, len(table), (refs, table), timeout, what, rails, path, ptr, names)

    def _poster(self, ptr: Any, n: int) -> Callable[[Any, int, int], int]:
        """The ``post`` of :meth:`_run_group` for the ``n`` rows at ``ptr``."""
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            return int(lib.aio_post(h, g, ptr + posted, n - posted, budget))

        return post

    def _reroute(self, table: np.ndarray, full: Any) -> np.ndarray:
        """The rows of ``table`` moved to the live routes of ``full`` (same remote region:
        the remote offset is kept, the address base and key are the new NIC's)."""
        live = self._router.live(full)
        out = table.copy()
        by_hop = {(h[0], h[1]): h for h in full}
        start = self._router.start(full)
        for i in range(len(out)):
            r = out[i]
            old = by_hop[(int(r["rail"]), int(r["peer"]))]
            rail, fa, base, key = live[(start + i) % len(live)]
            r["raddr"] = base + (int(r["raddr"]) - old[2])
            r["rail"], r["peer"], r["rkey"] = rail, fa, key
            r["direct"] = 0
        self._log.warning("rows moved to other NICs after a link failure", rows=len(out))
        self._failovers += len(out)
        return out

    async def _run_group(
        self,
        post: Callable[[Any, int, int], int],
        n: int,
        refs: Any,
        timeout: float | None,
        what: str,
        rails: set[int] | None = None,
        path: Any = None,
        items: Any = None,
        names: frozenset[tuple[int, int]] | None = None,
    ) -> bool:
        """The life of one group of ``n`` work requests: open it (waiting while every group
        slot is in flight), post through ``post(handle, group, posted_so_far)`` (returns how
        many it posted, or a negative error) with back-off while the transport pushes back,
        seal, wait for the completion record, and map its status to an exception.
        ``items``: the rows as an ``aio_op_desc`` array, when ``post`` posts them with
        ``aio_post``: opening, the first post and sealing then take one native call.

        On cancellation what was posted cannot be taken back: ``refs`` (buffers, tables) stay
        owned until the completion, with a bounded shielded wait before the cancellation
        propagates. On timeout it raises at once and the completion releases ``refs`` later.

        ``rails``: the local rails the group posts on. Returns True when one of them lost its
        link before the group finished: the caller re-posts the work elsewhere, and the group
        keeps ``refs`` until the transport lets go of its requests."""
        # the deadline scope (a cancel scope and a timer: several microseconds) is entered only
        # around the awaits this makes, at the absolute deadline `end`
        end = _end(timeout)
        begun = self._begin(n, refs, rails, path, items, names=names)
        return await self._finish(begun, post, n, end, timeout, what)

    def _begin(
        self,
        n: int,
        refs: Any,
        rails: set[int] | None,
        path: Any,
        items: Any,
        quiet: bool = False,
        names: frozenset[tuple[int, int]] | None = None,
    ) -> _Group:
        """The synchronous start of a group's life (see :meth:`_run_group`): opens the group
        and, with ``items``, posts what the transport takes at once and seals the group if
        that was everything (one native call, ``aio_submit``). The group is in ``_pending``
        (its completion record will find it) unless no group slot was free (``g < 0``).
        ``quiet`` (with ``items``): its completion record wakes nobody (``aio_submit_quiet``);
        who waits for it counts itself in with ``aio_quiet_waiters``."""
        h = self._check_open()
        op = _Op(refs, self._event())
        op.rails = rails
        op.names = names
        op.path = path
        if path is not None:
            op.alts = frozenset(hop[0] for hop in path)
        token = next(self._tokens)
        groups = _GROUPS.get()
        if groups is not None:
            groups.append(op)
        first: int | None = None  # what aio_submit posted (it opened, posted, sealed if all went)
        if items is not None and not self._router.down:
            submit = lib.aio_submit_quiet if quiet else lib.aio_submit
            k = int(submit(h, token, items, n, self._budget_ns, self._gout))
            g = int(self._gout[0])
            if g >= 0:
                first = k
                op.posted = max(k, 0)
        else:
            g = int(lib.aio_group_open(h, token))
        if g >= 0:
            self._pending[token] = op
        op.g = g
        return _Group(op, token, g, first)

    async def _finish(
        self,
        st: _Group,
        post: Callable[[Any, int, int], int],
        n: int,
        end: float | None,
        timeout: float | None,
        what: str,
    ) -> bool:
        """The rest of a group's life after :meth:`_begin`: a free group slot, posting what is
        left, sealing, the completion and its status (see :meth:`_run_group`)."""
        if self._closed:  # begun by post_write, finished by a background task: too late
            raise EngineClosed(f"{what}: the engine closed before the operation was posted")
        op, token, g, first = st.op, st.token, st.g, st.first
        if first == n:  # aio_submit posted every request and sealed the group: only the wait is left
            return await self._await_group(op, end, timeout, what)
        rails = op.rails
        h = self._h
        attempt = 0
        if g < 0:
            try:
                with deadline_at(end, timeout, what):
                    while g < 0:  # every group slot in flight: backpressure
                        attempt += 1
                        h = await self._pause(min(0.0001 * attempt, 0.005))
                        g = op.g = lib.aio_group_open(h, token)
            except BaseException:
                if g >= 0:
                    self._seal(g)
                raise
            self._pending[token] = op
        down = self._router.down
        if rails and down and rails & down and op.alts - down:
            # a link went down before this group posted anything (while it waited for a slot,
            # or since its rows were built): move it at once instead of posting to that NIC
            op.failover = True
            self._seal(g)
            return True
        posted = 0
        sealed = first == n  # aio_submit posted everything and sealed the group
        error = 0
        stalled_since = -1.0
        try:
            attempt = 0
            while posted < n:
                if first is not None:  # aio_submit's post
                    k, first = first, None
                else:
                    k = post(h, g, posted)
                if k < 0:
                    error = k
                    break
                posted += k
                op.posted = posted
                if posted < n:
                    # queue or slots full, or peer still connecting: wait for the next
                    # completion (a timer alone would cost a full millisecond under
                    # asyncio), with a back-off timer as the fallback
                    attempt = attempt + 1 if k == 0 else 0
                    if posted == 0:  # nothing goes out: is the peer answering at all?
                        t = now()
                        if stalled_since < 0:
                            stalled_since = t
                        elif t - stalled_since > self._connect_timeout():
                            error = _STALLED
                            break
                    h = await self._wait_space(min(0.00005 * (1 << min(attempt, 8)), 0.01), end)
                    if end is not None and now() >= end:
                        assert timeout is not None
                        raise timeout_error(what, timeout)
            if not sealed:
                self._seal(g)
                sealed = True
        except TransferTimeout as timed_out:  # while posting: not everything went out
            if not sealed:
                self._seal(g)
            if posted == 0:
                raise TransferTimeout(f"{what}: nothing could be posted before the deadline") from None
            timed_out._waiter = partial(self._settle, op)
            timed_out._landed = lambda: False  # a part was never posted
            raise
        except BaseException:
            if not sealed:
                self._seal(g)
            if posted and not op.done:
                await self._settle_cancelled(op)
            raise
        if error == _STALLED:
            stalled = PeerUnreachable(
                f"{what}: the peer did not answer within connect_timeout={self._connect_timeout():g} s "
                "(nothing listening at its address, or it is gone)",
                111,
                0,
            )
            stalled._final = True  # type: ignore[attr-defined]  # that wait was the retry
            raise stalled
        if error:
            raise _post_error(error, what, posted)
        return await self._await_group(op, end, timeout, what)

    async def _await_group(self, op: _Op, end: float | None, timeout: float | None, what: str) -> bool:
        """The end of a group's life once every request of it was posted and it was sealed:
        waits for its completion record until ``end`` and returns :meth:`_outcome`. On
        timeout raises TransferTimeout at once (the completion releases the buffers later;
        its ``_landed`` says whether everything landed); on cancellation waits, shielded,
        up to ``cancel_grace`` for the completion first (see :meth:`_run_group`)."""
        try:
            if self._loop_spin_ns:
                self._spin_until(op.event.is_set)
            if not op.event.is_set() and not await self._wait_moving(op, end, what):
                assert timeout is not None
                raise timeout_error(what, timeout)
        except TransferTimeout as timed_out:
            timed_out._waiter = partial(self._settle, op)
            # every request posted: all land unless one fails
            timed_out._landed = lambda: op.done is True and op.status == 0 and not op.failover
            raise
        except BaseException as exc:
            if not op.done and not getattr(exc, "_final", False):  # see _wait_moving
                await self._settle_cancelled(op)
            raise
        return self._outcome(op, what)

    async def _wait_moving(self, op: _Op, end: float | None, what: str) -> bool:
        """Waits for ``op``'s completion until ``end``: True once it came, False at ``end``.
        Raises :class:`TransferStalled` when none of its requests completed for the policy's
        ``stall_timeout`` (a request completing is progress: a slow peer that keeps taking
        bytes never trips it; a peer that takes nothing, stopped or wedged, does), and
        :class:`PeerUnreachable` once every NIC that reaches its peer has been down for
        ``connect_timeout`` (its requests stay owned by the transport, and land if a link
        comes back: it is not posted again)."""
        p = _POLICY.get()
        policy = p if p is not None else self._retry
        stall = policy.stall_timeout
        if stall is None and not self._router.down and not (self._shm_rails and self._shm_peers(op)):
            return await wait_until(op.event, end)
        h = self._h
        last = int(lib.aio_group_pending(h, op.g)) if op.g >= 0 else -1
        moved = now()
        shm: list[bytes] | None = None  # the op's same-host peer's shm addresses, once looked up
        while True:
            marks = [x for x in (end, None if stall is None else moved + stall) if x is not None]
            if self._router.down or (shm is None or shm):
                # are all the peer's NICs down, and for how long? has a same-host peer gone?
                marks.append(now() + 0.25)
            if await wait_until(op.event, min(marks) if marks else None):
                return True
            t = now()
            if end is not None and t >= end:
                return False
            pending = int(lib.aio_group_pending(h, op.g)) if op.g >= 0 else -1
            if op.event.is_set() or pending != last:
                last, moved = pending, t
                continue
            if shm is None:
                shm = self._shm_peers(op)
            if shm and any(shm_peer_gone(a) for a in shm):
                exc = PeerUnreachable(
                    f"{what}: the same-host peer ({self._peer_names(op)}) is gone (its process "
                    f"exited or its engine closed); {pending} of its requests stay with the transport",
                    101,
                    0,
                )
                exc._final = True  # type: ignore[attr-defined]  # not posted again
                raise exc
            gone = self._all_down_for(op, t)
            if gone > policy.connect_timeout:
                exc = PeerUnreachable(
                    f"{what}: every NIC that reaches the peer ({self._peer_names(op)}) has been down for "
                    f"{gone:.1f} s (connect_timeout={policy.connect_timeout:g} s); {pending} of its requests "
                    "stay with the transport and land if a link comes back",
                    101,
                    0,
                )
                exc._final = True  # type: ignore[attr-defined]  # not posted again
                raise exc
            if stall is not None and t - moved >= stall:
                raise TransferStalled(
                    f"{what}: no request of it completed for stall_timeout={stall:g} s "
                    f"({pending} of its requests still in flight to the peer through "
                    f"{self._peer_names(op)}); the peer is stopped, wedged or too slow for the bound",
                )

    def _shm_peers(self, op: _Op) -> list[bytes]:
        """The shm addresses ``op``'s requests go to (a same-host peer reached through the shm
        provider: messages, bare immediates), from the pairs it names; empty when none."""
        pairs = _pairs_of(op)
        return [a for r, fa in pairs if r in self._shm_rails and (a := self._book.address(r, fa))]

    def _all_down_for(self, op: _Op, t: float) -> float:
        """How long every NIC of ``op``'s peer has been down (0 while one is up)."""
        alts = op.alts or frozenset(op.rails or ()) or _rails_of(op)
        down = self._router.down
        if not alts or not alts <= down:
            return 0.0
        return t - max(self._down_since.get(r, t) for r in alts)

    def _peer_names(self, op: _Op) -> str:
        """The NICs an operation's requests left through, for error messages."""
        rails = sorted(op.rails or op.alts or _rails_of(op))
        return ", ".join(f"{self._rails[i].provider}/{self._rails[i].domain}" for i in rails) or "?"

    async def _settle_cancelled(self, op: _Op) -> None:
        """A posted request cannot be taken back: keeps its buffers until the NIC is done
        (a failover wake-up is not the completion: :meth:`_settle` waits for that), for at
        most ``cancel_grace``, shielded from the cancellation being raised."""
        with anyio.move_on_after(self._cancel_grace, shield=True):
            await self._settle(op)

    @staticmethod
    def _outcome(op: _Op, what: str) -> bool:
        """What the completed (or failover-woken) group ``op`` means: True when its work must
        be re-posted on other NICs (the group stays owned until the transport lets go),
        False when it succeeded; raises its error."""
        if op.failover and op.done is False:
            stranded = _STRANDED.get()
            if stranded is not None:
                stranded.append(op)
            return True
        if op.status == _CLOSED_STATUS:
            raise EngineClosed(f"{what}: the engine closed before the operation completed")
        if op.status:
            raise _completion_error(op.status, op.prov_errno, what)
        return False

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
        retry: RetryPolicy | None = None,
        stream: Any = None,
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

        GPU memory on either side (see :meth:`register`): the same call and the same counter
        semantics (the peer is credited once the bytes are in its GPU memory); staged through
        pinned host memory in ``stage_chunk`` pieces, or a device-to-device copy (CUDA IPC)
        for a peer on this host. ``stream`` (a CuPy/torch CUDA stream): the write starts only
        after the work submitted to it so far, without blocking the loop.
        """
        key = (id(remote), length, src_offset, dst_offset, imm)
        m = self._kept_write(mr, remote, key, stream)
        if m is not None:
            await self._memo_post(m, mr, timeout, retry, "write")
            return
        rdesc = self._remote(remote)
        if self._via_gpu(mr, rdesc, stream):
            mr, rdesc, length, src_offset, dst_offset, _, _ = self._span(
                mr, rdesc, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE
            )
            gpu = self._gpu_support()
            await gpu.write(mr, rdesc, length, src_offset, dst_offset, imm, timeout, retry, stream)
            return
        await self._write_host(
            mr, rdesc, length, src_offset, dst_offset, imm, timeout, retry, key if rdesc is remote else None
        )

    def _kept_write(self, mr: Any, remote: Any, key: tuple[Any, ...], stream: Any) -> tuple[Any, ...] | None:
        """The request kept for a write made before from ``mr`` with the same arguments
        ``key`` to the same descriptor object (a loop re-sending its slots, a ping-pong), if
        it may be posted again (see :meth:`_memo_post`), else None. Plain ints only: hashable,
        and no True or 1.0 standing in for 1."""
        if type(mr) is MemoryRegion and stream is None and _plain(key) and (m := mr._memos.get(key)):
            live = mr._engine is self and mr._handle is not None and not self._router.down
            if m[0] is remote and live:
                return m  # type: ignore[no-any-return]
        return None

    def _kept_imm(self, remote: Any, imm: Any, stream: Any) -> tuple[Any, ...] | None:
        """The request kept for a ``write_imm`` of ``imm`` to the same descriptor object, if
        it may be posted again, else None."""
        m = self._imm_memos.get((id(remote), imm)) if type(imm) is int else None
        if m is not None and m[0] is remote and stream is None and not self._router.down:
            return m  # type: ignore[no-any-return]
        return None

    @staticmethod
    def _via_gpu(mr: Any, rdesc: MemoryDescriptor, stream: Any) -> bool:
        """Whether a write goes through the GPU support (a stream, or GPU memory either side)."""
        return stream is not None or rdesc.device_kind == DEVICE_CUDA or getattr(mr, "_dev", None) is not None

    def _memo(
        self, memos: dict[Any, Any], key: Any, rdesc: MemoryDescriptor, table: np.ndarray
    ) -> tuple[Any, ...] | None:
        """Keeps in ``memos`` under ``key`` (the arguments, the descriptor's ``id`` first) what
        :meth:`_memo_post` needs to post ``table`` again: (rdesc, key, table, post, items).
        The entry holds ``rdesc``, so its ``id`` names no other object while it lives. At most
        ``_MEMO_MAX`` entries: a full dict starts again empty. None (nothing kept) for
        arguments that are not plain ints."""
        if not _plain(key):
            return None
        ptr = ffi.from_buffer("aio_op_desc[]", table)
        m = (rdesc, key, table, self._poster(ptr, len(table)), ptr)
        if len(memos) >= _MEMO_MAX:
            memos.clear()
        memos[key] = m
        return m

    async def _memo_post(
        self, m: tuple[Any, ...], refs: Any, timeout: float | None, retry: Any, what: str
    ) -> None:
        """Posts a memoized single-route request again. Memos are made only for host regions
        over one route, from arguments that passed validation, and used only while the region
        is registered, the descriptor is the same object and no link is down: the request is
        the one the full path would build (it saves ~10 us of validation and packing)."""
        _, _, table, post, items = m
        await self._attempts(
            lambda t: self._run_group(post, len(table), (refs, table), t, what, None, None, items),
            timeout,
            retry,
            what,
        )

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
    ) -> None:
        """A write between the NIC-registered memories (a GPU region's shadow included).
        ``key``: the caller's arguments, to memoize a host write over one route."""
        credits: _Credits = {}
        rows, full = self._rows(
            mr, remote, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE, credits, gpu_ok=True
        )
        table = self._table(rows)
        if key is not None and len(full) == 1 and mr._dev is None and not self._router.down:
            self._memo(mr._memos, key, remote, table)
        end = _end(timeout)

        async def attempt(t: float | None) -> None:
            if len(full) == 1:  # one NIC each side: the common, fast case
                await self._run_table(table, mr, t, "write")
                return
            await self._then_credit(self._run(table, mr, t, "write", full), credits, end, "write", len(table))

        await self._attempts(attempt, timeout, retry, "write")

    async def write_imm(
        self,
        remote: MemoryDescriptor | bytes,
        imm: int,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> None:
        """Zero-byte write carrying ``imm`` to the owner of ``remote``: its
        ``imm_counter(imm)`` gains one credit. For a GPU region the credit comes after the
        owner's copies of earlier writes into GPU memory; ``stream``: sent only after the work
        submitted to that CUDA stream so far (e.g. the kernel that produced the data). Raises
        as :meth:`write`. Cost: one zero-byte work request, no payload (a repeat to the same
        descriptor object reuses the kept request, skipping validation); to a staged GPU region,
        one internal message to its owner instead."""
        m = self._kept_imm(remote, imm, stream)
        if m is not None:
            await self._memo_post(m, None, timeout, retry, "write_imm")
            return
        if imm is None:
            raise InvalidArgument("write_imm needs an immediate")
        rdesc = self._remote(remote)
        if stream is not None or _staged(rdesc):
            assert self._scratch is not None
            self._span(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE)
            await self._gpu_support().write(self._scratch, rdesc, 0, 0, 0, imm, timeout, retry, stream)
            return
        assert self._scratch is not None
        rows, full = self._rows(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE, gpu_ok=True)
        table = self._table(rows)
        if len(full) == 1:  # one NIC each side: no failover to arrange
            keep = rdesc is remote and not self._router.down
            m = self._memo(self._imm_memos, (id(rdesc), imm), rdesc, table) if keep else None
            if m is None:  # bytes, a link down, or an imm that is not a plain int: no memo
                await self._attempts(
                    lambda t: self._run_table(table, None, t, "write_imm"), timeout, retry, "write_imm"
                )
                return
            await self._memo_post(m, None, timeout, retry, "write_imm")
            return
        await self._attempts(
            lambda t: self._run(table, None, t, "write_imm", full), timeout, retry, "write_imm"
        )

    def post_write(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> Transfer:
        """:meth:`write`, posted now and awaited later: returns a :class:`Transfer` to await
        when the source buffer's reuse (or the error) matters, so that a task can post a
        write and go on (wait for the peer's answer, post the next) without an event-loop
        round trip for the write's own completion.

        Guarantees: arguments are validated before this returns (raises :class:`InvalidArgument`,
        :class:`DescriptorError` or :class:`EngineClosed`; nothing posted). Host memory over
        one NIC to the peer (the common case) is handed to the transport before this returns;
        GPU memory, a ``stream``, several NICs to the peer, or a transport pushing back (full
        queues, a peer still connecting) continue in a background task of the engine, started
        at once. Either way the write proceeds
        whether or not the :class:`Transfer` is awaited, and the engine keeps the source
        region's request alive until the transport's completion. Errors (and the retries of
        ``retry``, as :meth:`write` does them) surface when the :class:`Transfer` is awaited;
        one never awaited that failed is logged when it is dropped. Must be called in the
        event-loop thread (like every engine method). Cost: as :meth:`write` minus its
        awaits (a kept request: ~5 us of Python here)."""
        self._check_open()
        _check_retry(retry)
        key = (id(remote), length, src_offset, dst_offset, imm)
        m = self._kept_write(mr, remote, key, stream)
        if m is not None:
            return self._post_now(m[2], mr, "write", retry, m)
        rdesc = self._remote(remote)
        if self._via_gpu(mr, rdesc, stream):
            self._span(mr, rdesc, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE)
            return self._background(
                lambda: self.write(
                    mr, rdesc, length=length, src_offset=src_offset, dst_offset=dst_offset, imm=imm,
                    retry=retry, stream=stream,
                ),
                "write",
            )
        credits: _Credits = {}
        rows, full = self._rows(
            mr, rdesc, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE, credits, gpu_ok=True
        )
        if len(full) != 1 or self._router.down:  # several NICs: striping, failover, credits
            # the rows above only validated the call: the task builds them again when it
            # starts, so that the transfers posted before it count as in flight (see _rows)
            return self._background(
                lambda: self._write_host(mr, rdesc, length, src_offset, dst_offset, imm, None, retry),
                "write",
            )
        table = self._table(rows)
        m = self._memo(mr._memos, key, remote, table) if rdesc is remote else None
        return self._post_now(table, mr, "write", retry, m)

    def post_write_imm(
        self,
        remote: MemoryDescriptor | bytes,
        imm: int,
        *,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> Transfer:
        """:meth:`write_imm`, posted now and awaited later (see :meth:`post_write`): the
        immediate is handed to the transport before this returns (one NIC to the peer, no
        ``stream``, room in the queues; otherwise a background task of the engine posts it at
        once). Raises :class:`InvalidArgument` (or :class:`DescriptorError`) at once for a bad
        immediate or descriptor, :class:`EngineClosed`. Cost: as :meth:`write_imm` minus its
        awaits; when posted in this call, its completion is quiet (read at the loop's next
        wake-up)."""
        self._check_open()
        _check_retry(retry)
        m = self._kept_imm(remote, imm, stream)
        if m is not None:
            return self._post_now(m[2], None, "write_imm", retry, m)
        if imm is None:
            raise InvalidArgument("write_imm needs an immediate")
        rdesc = self._remote(remote)
        assert self._scratch is not None
        gpu = stream is not None or _staged(rdesc)
        if gpu:
            self._span(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE)  # validation only
        else:
            rows, full = self._rows(self._scratch, rdesc, 0, 0, 0, imm, lib.AIO_OP_WRITE, gpu_ok=True)
        if gpu or len(full) != 1 or self._router.down:  # GPU staging, several NICs: as write_imm
            again = partial(self.write_imm, rdesc, imm, retry=retry, stream=stream)
            return self._background(again, "write_imm")
        table = self._table(rows)
        m = self._memo(self._imm_memos, (id(rdesc), imm), rdesc, table) if rdesc is remote else None
        return self._post_now(table, None, "write_imm", retry, m)

    def _post_now(
        self, table: np.ndarray, refs: Any, what: str, retry: RetryPolicy | None, kept: Any = None
    ) -> Transfer:
        """Begins the group of ``table`` (one route, no failover) in this call; when the
        transport did not take all of it at once, a background task finishes it exactly as
        :meth:`_run_group` would (waiting for room, back-off, the stalled-peer check, retries).
        ``kept``: the memo of ``table`` (see :meth:`_memo`), whose poster it reuses."""
        if kept is not None:
            post, items = kept[3], kept[4]
        else:
            items = ffi.from_buffer("aio_op_desc[]", table)
            post = self._poster(items, len(table))
        n = len(table)
        own = (refs, table)

        def again(t: float | None) -> Awaitable[bool]:
            return self._run_group(post, n, own, t, what, None, None, items)

        st = self._begin(n, own, None, None, items, quiet=True)
        if st.first == n:  # posted and sealed: only the completion is left (a quiet one)
            return Transfer(self, what, st.op, again, retry)
        if st.g >= 0:  # not sealed: the task finishing it waits as usual, woken as usual
            lib.aio_group_quiet(self._h, st.g, 0)
        begun = [st]

        async def attempt(t: float | None) -> None:
            if begun:
                await self._finish(begun.pop(), post, n, _end(t), t, what)
            else:
                await again(t)

        return self._background(lambda: self._attempts(attempt, None, retry, what), what)

    def _background(self, run: Callable[[], Awaitable[Any]], what: str) -> Transfer:
        """A :class:`Transfer` whose work ``run()`` goes on in a background task of the engine."""
        t = Transfer(self, what)
        t._go(run)
        return t

    async def read(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """One-sided READ of ``length`` bytes from the peer's region at ``src_offset`` into
        ``mr[dst_offset:]``. Returns when the bytes are in ``mr``. The peer's region must have
        been registered with ``remote_read``. Raises as :meth:`write`.

        Into a GPU region: read into its shadow, then copied to GPU memory before this
        returns. From a peer's GPU region: only from a peer on this host (CUDA IPC) into a GPU
        region; otherwise :class:`InvalidArgument` (its owner must write it).

        Cost: one work request (one per NIC when at least ``stripe_min`` bytes are striped over
        several), no copy; into a staged GPU region, one more host-to-GPU copy; from a GPU
        region on this host, one device-to-device copy and no work request."""
        rdesc = self._remote(remote)
        if rdesc.device_kind == DEVICE_CUDA or getattr(mr, "_dev", None) is not None:
            mr, rdesc, length, dst_offset, src_offset, _, _ = self._span(
                mr, rdesc, length, src_offset, dst_offset, None, lib.AIO_OP_READ
            )
            await self._gpu_support().read(mr, rdesc, length, src_offset, dst_offset, timeout, retry)
            return
        await self._read_host(mr, rdesc, length, src_offset, dst_offset, timeout, retry)

    async def _read_host(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor,
        length: int | None,
        src_offset: int,
        dst_offset: int,
        timeout: float | None,
        retry: RetryPolicy | None,
    ) -> None:
        rows, full = self._rows(
            mr, remote, length, src_offset, dst_offset, None, lib.AIO_OP_READ, gpu_ok=True
        )
        table = self._table(rows)
        await self._attempts(lambda t: self._run(table, mr, t, "read", full), timeout, retry, "read")

    async def write_paged(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        page_size: int,
        src_pages: Any,
        dst_pages: Any,
        src_stride: int | None = None,
        dst_stride: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        stream: Any = None,
    ) -> None:
        """Paged write: page ``k`` copies ``page_size`` bytes from
        ``mr[src_offset + src_stride*src_pages[k]]`` to the peer's region at
        ``dst_offset + dst_stride*dst_pages[k]`` (strides default to ``page_size``).

        ``src_pages``/``dst_pages``: integer sequences or arrays of the same length (indices
        may repeat and come in any order; the order in which pages land is not defined).
        Every page is checked against both regions before anything is posted; the loop that
        posts the pages runs in C, so the Python cost of a call does not grow with the number
        of pages (numpy checks the index arrays). Pages are spread over the NICs that reach
        the peer, round robin; pages whose destinations are adjacent (``dst_stride ==
        page_size``) go as one request gathering up to the NIC's iov limit of sources (4 on
        tcp and shm), after sorting the pages of the call by destination. With ``imm``, the
        peer's ``imm_counter(imm)`` gains one credit per page, however many NICs carried them.

        Returns when every page's source bytes may be reused. Raises :class:`InvalidArgument`
        (lists of different lengths, negative or non-integer indices, a page past either
        region, ``page_size`` < 1), and as :meth:`write` otherwise (a failure reports the first
        error once every posted page finished).

        GPU memory on either side: the pages are gathered on the GPU into the shadow (one
        kernel) and staged, or, for a GPU peer on this host, copied by one kernel over CUDA IPC;
        the credit (one per page) comes once the pages are in the peer's GPU memory.
        ``stream``: as :meth:`write`."""
        self._check_open()
        rdesc = self._remote(remote)
        mr = self._region(mr)
        page_size = as_index(page_size, "page_size", lo=1)
        src_stride = page_size if src_stride is None else as_index(src_stride, "src_stride")
        dst_stride = page_size if dst_stride is None else as_index(dst_stride, "dst_stride")
        src_offset = as_index(src_offset, "src_offset")
        dst_offset = as_index(dst_offset, "dst_offset")
        sp = _page_indices(src_pages, "src_pages")
        dp = _page_indices(dst_pages, "dst_pages")
        if len(sp) != len(dp):
            raise InvalidArgument(f"src_pages has {len(sp)} entries and dst_pages {len(dp)}; they must match")
        if imm is not None:
            imm = as_index(imm, "imm", hi=_U32)
        if not rdesc.remote_write:
            raise InvalidArgument("the remote region was registered without remote_write")
        n = len(sp)
        if n == 0:
            await anyio.lowlevel.checkpoint()
            return
        for idx, stride, off, size, name in (
            (sp, src_stride, src_offset, mr.nbytes, "source"),
            (dp, dst_stride, dst_offset, rdesc.length, "destination"),
        ):
            top = int(idx.max())
            if off + stride * top + page_size > size:
                k = int(np.argmax(idx))
                raise InvalidArgument(
                    f"page {k} ({name} index {top}) ends at {off + stride * top + page_size} B, past the "
                    f"{name} region ({size} B)"
                )
        geometry = (page_size, src_stride, dst_stride, src_offset, dst_offset)
        if stream is not None or mr._dev is not None or rdesc.device_kind == DEVICE_CUDA:

            async def host_write(hi: int | None) -> None:
                await self._write_paged_host(mr, rdesc, sp, dp, geometry, hi, timeout, retry)

            await self._gpu_support().write_paged(
                mr,
                rdesc,
                page_size,
                src_offset + sp * src_stride,
                dst_offset + dp * dst_stride,
                imm,
                timeout,
                retry,
                stream,
                host_write,
            )
            return
        await self._write_paged_host(mr, rdesc, sp, dp, geometry, imm, timeout, retry)

    async def _write_paged_host(
        self,
        mr: MemoryRegion,
        rdesc: MemoryDescriptor,
        sp: np.ndarray,
        dp: np.ndarray,
        geometry: tuple[int, int, int, int, int],
        imm: int | None,
        timeout: float | None,
        retry: RetryPolicy | None,
    ) -> None:
        """A checked paged write between NIC-registered memories."""
        page_size, src_stride, dst_stride, src_offset, dst_offset = geometry
        n = len(sp)
        data = 0 if imm is None else imm
        flags = 0 if imm is None else lib.AIO_F_DATA
        # pages whose destinations follow each other go as one request gathering their
        # sources: order them by destination first (the order pages land in is not defined)
        gather = dst_stride == page_size and n > 1
        if gather and not bool((dp[1:] >= dp[:-1]).all()):
            order = np.argsort(dp, kind="stable")
            sp, dp = sp[order], dp[order]
        full = self._path(rdesc)
        path = self._router.live(full)
        dcode, dkey = self._direct(rdesc) if rdesc.direct is not None and mr._dev is None else _NO_DIRECT
        dhop = _direct_hop(full, dkey, self._shm_rails) if dcode else None
        if dhop is not None:  # direct copies: one stream, the immediate with the pages (see _rows)
            full = path = (dhop,)
        if len(path) > 1:  # until every connection is open, pages go only over the open ones
            path = self._open_routes(path, lib.AIO_OP_WRITE)
        credits: _Credits = {}
        if flags and len(full) > 1:  # counting rule: the credit follows the data (see _rows)
            credits[(full, data, self._owner_of(full, rdesc))] = n
            data = flags = 0
        d = ffi.new("aio_paged_desc*")
        d.mr = mr._handle
        d.src_pages = ffi.cast("int64_t*", ffi.from_buffer(sp))
        d.dst_pages = ffi.cast("int64_t*", ffi.from_buffer(dp))
        d.page_size = page_size
        d.src_stride = src_stride
        d.dst_stride = dst_stride
        d.src_offset = src_offset
        d.dst_offset = dst_offset
        d.remote_len = rdesc.length
        d.data = data
        d.flags = flags
        d.gather = int(gather)
        d.nroutes = len(path)
        first = d.first_route = self._router.start(full) % len(path)
        for i, (rail, fa, base, key) in enumerate(path):
            d.routes[i].rail = rail
            d.routes[i].peer = fa
            d.routes[i].rbase = base
            d.routes[i].rkey = key
            d.routes[i].direct = dcode if dhop is not None else 0
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            return int(lib.aio_post_paged(h, g, d, posted, n, budget))

        what = f"write_paged of {n} pages"
        end = _end(timeout)
        rails = {h[0] for h in path}

        async def attempt(t: float | None) -> None:
            await self._paged_attempt(
                post,
                n,
                (mr, sp, dp, d),
                t,
                end,
                what,
                full,
                rails,
                credits,
                mr,
                sp,
                dp,
                (page_size, src_stride, dst_stride, src_offset, dst_offset, first),
            )

        await self._attempts(attempt, timeout, retry, what)

    async def _paged_attempt(
        self,
        post: Callable[[Any, int, int], int],
        n: int,
        refs: Any,
        timeout: float | None,
        end: float | None,
        what: str,
        full: Any,
        rails: set[int],
        credits: _Credits,
        mr: MemoryRegion,
        sp: np.ndarray,
        dp: np.ndarray,
        geometry: tuple[int, int, int, int, int, int],
    ) -> None:
        """One attempt of a paged write: the pages as one group, moved to the NICs still up
        when one loses its link, then the deferred credit."""
        page_size, src_stride, dst_stride, src_offset, dst_offset, first = geometry

        async def data() -> None:
            on = rails if len(full) > 1 else None
            if not await self._run_group(post, n, refs, timeout, what, on, full):
                return
            # a NIC lost its link: the pages went as one group over every NIC, so all of them
            # are written again over the NICs still up (the same bytes; the credit follows)
            live = self._router.live(full)
            rows = _paged_rows(
                mr,
                sp,
                dp,
                page_size,
                src_stride,
                dst_stride,
                src_offset,
                dst_offset,
                live,
                (first + np.arange(n)) % len(live),
            )
            self._failovers += n
            await self._run(rows, refs, _left(end), what, full)

        await self._then_credit(data(), credits, end, what, n)

    async def scatter(
        self,
        mr: MemoryRegion,
        targets: Sequence[ScatterTarget],
        *,
        imm: int | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Writes a slice of ``mr`` to each target (:class:`ScatterTarget`: descriptor, length,
        offsets), all posted by one native call and awaited as one. Targets on different
        peers are spread over the NICs; with ``imm`` each target's owner gains one credit per
        target. Every target is validated before anything is posted. Raises as :meth:`write`."""
        if imm is not None:
            as_index(imm, "imm", hi=_U32)  # checked even when there is no target
        rows: list[tuple[int, ...]] = []
        credits: _Credits = {}
        for i, t in enumerate(targets):
            if not isinstance(t, ScatterTarget):
                raise InvalidArgument(f"targets[{i}] must be an aiote.ScatterTarget, not {type(t).__name__}")
            n = len(rows)  # requests ahead of this one in the call
            rows += self._rows(
                mr, t.desc, t.length, t.src_offset, t.dst_offset, imm, lib.AIO_OP_WRITE, credits, load=n
            )[0]
        if not rows:
            await anyio.lowlevel.checkpoint()
            return
        what = f"scatter to {len(targets)} targets"
        end = _end(timeout)
        table = self._table(rows)

        async def attempt(t: float | None) -> None:
            await self._then_credit(self._run(table, mr, t, what), credits, end, what, len(table))

        await self._attempts(attempt, timeout, retry, what)

    async def barrier(
        self,
        peers: Sequence[MemoryDescriptor | bytes],
        *,
        imm: int,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Sends a zero-byte write carrying ``imm`` to the owner of each descriptor in
        ``peers`` (one credit per descriptor given), posted as one group; returns when every
        one has completed. Peers' resolved addresses are cached, so repeated barriers over
        the same set cost one work request per peer. Raises as :meth:`write`."""
        assert self._scratch is not None
        as_index(imm, "imm", hi=_U32)  # checked even when there is no peer
        rows: list[tuple[int, ...]] = []
        for d in peers:
            rows += self._rows(self._scratch, d, 0, 0, 0, imm, lib.AIO_OP_WRITE)[0]
        if not rows:
            await anyio.lowlevel.checkpoint()
            return
        table = self._table(rows)
        what = f"barrier of {len(rows)} peers"
        await self._attempts(lambda t: self._run(table, None, t, what), timeout, retry, what)

    def batch(self) -> TransferBatch:
        """A batch of writes/reads validated as they are added and posted by one native call
        on :meth:`TransferBatch.submit`, awaited as one. Costs one small empty table, no native
        call; raises nothing (a closed engine is reported when requests are added)."""
        return TransferBatch(self)

    def imm_counter(self, imm: int) -> ImmCounter:
        """The counter of immediate ``imm`` (same object for the same imm). Credits accumulate
        from the engine's start, whether or not anybody waits.

        Raises :class:`InvalidArgument` unless ``imm`` is an integer in [0, 2**32); on a closed
        engine the counter's own calls raise :class:`EngineClosed`, not this one. Costs a dict
        lookup, no native call (the first call for an ``imm`` creates the object)."""
        imm = as_index(imm, "imm", hi=_U32)
        c = self._counters.get(imm)
        if c is None:
            c = self._counters[imm] = ImmCounter(self, imm)
        return c

    def _forget_counter(self, imm: int) -> bool:
        """Forgets counter ``imm`` in C and here, whether or not an ImmCounter object exists;
        False (nothing done) while a task waits on it."""
        c = self._counters.get(imm)
        if c is not None and c._waiters:
            return False
        h = self._handle()
        lib.aio_counter_watch(h, imm, 0)  # clears a watch that a cancelled waiter left armed
        lib.aio_counter_release(h, imm)
        self._counters.pop(imm, None)
        return True

    # ------------------------------------------------------------------ messages

    async def send(
        self,
        peer: bytes | EngineAddress,
        payload: Any,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Sends ``payload`` (bytes-like, up to ``max_message_size``) to the engine at
        ``peer`` (its ``address``). Returns once the payload has been handed to the transport
        (it is copied; the caller may reuse its buffer at once). Messages between two engines
        are delivered in order on tcp and shm.

        A peer that does not answer yet is tried until ``timeout`` or the retry policy's
        ``connect_timeout``; after a broken connection the message is sent again as the policy
        says, so a peer whose connection was reset (not restarted) may receive it twice.

        A receiver that does not keep up holds its senders back: its messages wait in its
        receive slots, so once they are all taken, a send waits (up to ``timeout``) until the
        receiver takes one with :meth:`recv` (see there). Sends to one peer take at most three
        quarters of this engine's send slots per NIC; further ones wait here, so messages to
        other engines still go.

        Raises :class:`InvalidArgument` (bad address, payload too large),
        :class:`TransferTimeout`, :class:`PeerUnreachable`, :class:`EngineClosed`. Costs one
        copy of the payload (into a registered send slot, behind the sender's address, made
        without the NIC's lock held) and one send work request, awaited to completion; with no
        send slot free it waits (back-off) instead of failing."""
        check_timeout(timeout)
        self._check_open()
        await self._send_msg(peer, payload, timeout, retry)

    async def _send_msg(
        self,
        peer: Any,
        payload: Any,
        timeout: float | None,
        retry: RetryPolicy | None,
        *,
        internal: bool = False,
    ) -> None:
        """Sends a message; ``internal`` ones (the engine's own protocol, e.g. GPU staging)
        are consumed by the peer's engine and never reach its :meth:`recv`."""
        addr = self._engine_address(peer)
        try:
            data = memoryview(payload).cast("B")
        except TypeError:
            raise InvalidArgument(f"payload must be bytes-like, not {type(payload).__name__}") from None
        if data.nbytes > self._max_message:
            raise InvalidArgument(
                f"payload of {data.nbytes} B exceeds max_message_size={self._max_message} B; "
                "use a one-sided write for bulk data"
            )
        if addr.max_message and data.nbytes > addr.max_message:
            raise InvalidArgument(
                f"payload of {data.nbytes} B exceeds the receiving engine's max_message_size="
                f"{addr.max_message} B: it could not be delivered; use a one-sided write for bulk data"
            )
        end = _end(timeout)
        while True:
            # messages keep to the first live route: they are delivered in order on it
            path = self._router.live(self._router.path(addr_ends(addr), addr.host_id))
            key = (path[0][0], path[0][1])
            n = self._sends.get(key, 0)
            if internal or n < self._send_cap:
                break
            # A receiver holds back its senders (see recv): a send stays in flight, in one of
            # the rail's send slots, until it takes the message. So one peer gets at most
            # _send_cap of them; the rest stay free for other peers and the engine's notices.
            room = self._send_room.get(key)
            if room is None:
                room = self._send_room[key] = self._event()
            if not await wait_until(room, end):
                assert timeout is not None
                raise timeout_error("send", timeout)
        rail, fa = key
        me = self._address_bytes
        head = _MSG_HEADER.pack(len(me) | (_INTERNAL if internal else 0)) + me
        body = ffi.from_buffer(data)  # copied once, by the core, straight into a send slot
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            return int(lib.aio_post_sendv(h, g, rail, fa, head, len(head), body, data.nbytes, budget))

        self._sends[key] = n + 1
        try:
            names = frozenset({key})
            await self._attempts(
                lambda t: self._run_group(post, 1, None, t, "send", names=names), _left(end), retry, "send"
            )
        finally:
            left = self._sends[key] - 1
            if left:
                self._sends[key] = left
            else:
                del self._sends[key]
            room = self._send_room.pop(key, None)
            if room is not None:
                room.set()

    async def recv(self, *, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Receives the next message: ``(sender_address, payload)``. Messages are kept from
        the engine's start, in order, so nothing is lost while nobody waits. Cancel-safe: a
        cancelled receive takes no message.

        Flow control: a message that arrives while nobody waits stays in its receive slot
        (``message_slots`` per NIC) until it is taken; only then is it copied out and the slot
        given back. A quarter of the slots is kept for the engine's own messages (the notices
        of staged GPU writes): messages that would take those are copied out and queued
        instead, up to 1 MiB of them; past that they hold the last slots too, and the sender's
        transport waits. So a backlog costs the receiver its slots and at most 1 MiB more,
        and senders to an engine that never receives stall (their sends time out); staged GPU
        writes into it stall too once large messages hold every slot.

        Raises :class:`TransferTimeout`, :class:`EngineClosed`, :class:`InvalidArgument` (bad
        ``timeout``). Costs one copy of the payload (out of its slot, here or when it arrived
        for a waiting receiver) and no I/O: a queued message returns after one checkpoint,
        otherwise the task sleeps until the next message wakes it."""
        check_timeout(timeout)
        self._handle()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._inbox:
            # taken before yielding: no other receiver can race for it
            item = self._take(self._inbox.popleft())
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return item
        w = _RecvWaiter(self._event())
        self._recv_waiters.append(w)
        lib.aio_waiters_add(self._h, 1)  # a shm rail is polled more often while we wait
        try:
            try:
                if not await wait_until(w.event, _end(timeout)):
                    assert timeout is not None
                    raise timeout_error("recv", timeout)
            finally:
                if not self._closed:
                    lib.aio_waiters_add(self._h, -1)
        except BaseException:
            if w.item is not None:  # delivered, but the receive was cancelled: give it back
                self._deliver(w.item, first=True)
            else:
                with suppress(ValueError):
                    self._recv_waiters.remove(w)
            raise
        if w.item is None:
            raise EngineClosed("the engine closed while receiving")
        return w.item

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        for i in range(len(self._rails)):
            if not lib.aio_rail_link_up(self._h, i):
                self._router.down.add(i)
                self._down_since[i] = now()
                self._log.warning("link down at start: NIC out of rotation", nic=self._rails[i].domain)
        self._bridge = LoopBridge(int(lib.aio_engine_eventfd(self._h)), self._on_ready)
        self._bridge.start()
        self._event = self._bridge.event_class
        self._checkpoint_if_cancelled = _checkpoint_if_cancelled_fn()
        self._space = self._event()
        self._scratch = await self.register(bytearray(64), remote_write=False, remote_read=False)

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Closes the engine: refuses new work, waits up to ``timeout`` seconds for work in
        flight, then stops the poller and closes the endpoints before any region (so the
        transport never touches freed memory). Operations still pending fail with
        :class:`EngineClosed`. Idempotent; raises nothing of its own, and is shielded (a
        cancellation does not interrupt it). Costs up to ``timeout`` seconds of waiting for work
        in flight, then the native teardown, run in a worker thread so the loop is not blocked."""
        if self._closed or self._closing:
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(timeout):
                lib.aio_quiet_waiters(self._h, 1)  # posted transfers' completions wake it too
                self._drain()
                try:
                    for op in list(self._pending.values()):
                        await op.event.wait()
                finally:
                    lib.aio_quiet_waiters(self._h, -1)
                while any(mr._dev_pending for mr in self._regions):  # noqa: ASYNC110 - GPU copies
                    await anyio.sleep(0.001)
            if self._pending:
                self._log.warning("closing with operations in flight", pending=len(self._pending))
            if self._gpu is not None:
                self._gpu.close()
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
            mr._memos.clear()
        self._regions.clear()


def _staged(rdesc: MemoryDescriptor) -> bool:
    """Whether bytes for ``rdesc`` land in a pinned shadow its owner copies to GPU memory."""
    return rdesc.device_kind == DEVICE_CUDA and not (rdesc.gpu is not None and rdesc.gpu.direct)


def _is_gpu_buffer(obj: Any) -> bool:
    """Whether ``obj`` is GPU memory (CUDA array interface, or DLPack on a CUDA device)."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None or isinstance(obj, np.ndarray):
        return False
    try:
        return int(dev()[0]) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
    except Exception:
        return False


def _checkpoint_if_cancelled_fn() -> Callable[[], Awaitable[None]]:
    """``anyio.lowlevel.checkpoint_if_cancelled`` of the running backend, looked up once per
    engine: the public function finds the backend (sniffio) on every call, a third of its cost
    on a counter wait's path."""
    try:
        from anyio._core._eventloop import get_async_backend

        fn: Callable[[], Awaitable[None]] = get_async_backend().checkpoint_if_cancelled
        return fn
    except Exception:  # pragma: no cover - another anyio layout: the public function
        return anyio.lowlevel.checkpoint_if_cancelled


_MEMO_MAX = 256  # memoized requests per region (writes) and per engine (write_imm)


def _plain(key: tuple[Any, ...] | int) -> bool:
    """True when every argument of a memo key is an int (or None): kept requests are found by
    hash and ``==``, which would let ``True`` or ``1.0`` pass for ``1`` (and an unhashable
    argument raise ``TypeError`` instead of failing validation)."""
    if type(key) is int:
        return True
    return type(key) is tuple and _PLAIN_TYPES.issuperset(map(type, key))


_PLAIN_TYPES = frozenset((int, type(None)))


def _check_retry(retry: Any) -> None:
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidArgument(f"retry must be an aiote.RetryPolicy, not {type(retry).__name__}")


def _end(timeout: float | None) -> float | None:
    """The deadline of an operation (InvalidArgument for a bad timeout, before any work)."""
    check_timeout(timeout)
    return None if timeout is None else now() + timeout


def _left(end: float | None) -> float | None:
    return None if end is None else max(0.0, end - now())


def _paged_rows(
    mr: MemoryRegion,
    sp: np.ndarray,
    dp: np.ndarray,
    ps: int,
    ss: int,
    ds: int,
    so: int,
    do: int,
    path: tuple[tuple[int, int, int, int], ...],
    hop: np.ndarray,
) -> np.ndarray:
    """aio_op_desc rows of paged-write pages (vectorized), page i over ``path[hop[i]]``."""
    t = np.zeros(len(sp), _OP_DTYPE)
    hops = np.array(path, dtype=np.uint64)
    t["mr"] = mr._ptr
    t["offset"] = so + sp.astype(np.uint64) * np.uint64(ss)
    t["length"] = ps
    t["rail"] = hops[hop, 0].astype(np.int32)
    t["peer"] = hops[hop, 1]
    t["raddr"] = hops[hop, 2] + np.uint64(do) + dp.astype(np.uint64) * np.uint64(ds)
    t["rkey"] = hops[hop, 3]
    t["op"] = lib.AIO_OP_WRITE
    return t


def _page_indices(v: Any, name: str) -> np.ndarray:
    """A 1-D int64 array of non-negative page indices, or InvalidArgument."""
    try:
        a = np.asarray(v)
    except Exception:
        raise InvalidArgument(f"{name} must be a sequence of integers") from None
    if a.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, not of shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, not {a.dtype}")
    if a.dtype.kind == "i" and int(a.min()) < 0:
        raise InvalidArgument(f"{name}[{int(np.argmin(a))}] = {int(a.min())} is negative")
    if int(a.max()) >= 1 << 62:
        raise InvalidArgument(f"{name} holds an index too large for any region")
    return np.ascontiguousarray(a, dtype=np.int64)


KNOWN_PROVIDERS = ("tcp", "shm", "verbs", "efa")


def available_providers(names: Sequence[str] = KNOWN_PROVIDERS) -> list[str]:
    """Which of ``names`` libfabric offers here with what aiote needs (RDM endpoints, RMA,
    remote CQ data). Costs one provider query each (milliseconds; the first also pays
    libfabric's start-up)."""
    entries = ffi.new("aio_probe_entry[64]")
    return [n for n in names if int(lib.aio_probe(n.encode(), entries, 64)) > 0]


def _as_bytes(v: Any, name: str) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise InvalidArgument(f"{name} must be bytes, not {type(v).__name__}")


def _direct_hop(full: Any, dkey: int, shm: frozenset[int]) -> Any:
    """The route of ``full`` to the owner's first shm NIC (the one whose key ``dkey`` its
    region table publishes), which direct copies take whatever the streams; None if absent."""
    return next((h for h in full if h[3] == dkey and h[0] in shm), None)


def _pairs_of(op: _Op) -> frozenset[tuple[int, int]]:
    """The (rail, fi_addr) pairs an operation's requests name: given when it began (a send,
    a connection's opening), from its peer's routes, or read from its table of rows (its refs
    hold it); empty when not known. For the slow paths (a stall, a gone peer)."""
    if op.names is not None:
        return op.names
    if op.path:
        return frozenset((h[0], h[1]) for h in op.path)
    r = op.refs
    table = r[1] if isinstance(r, tuple) and len(r) == 2 else None
    if isinstance(table, np.ndarray) and "peer" in (table.dtype.names or ()):
        return frozenset(zip(table["rail"].tolist(), table["peer"].tolist(), strict=True))
    return frozenset()


def _rails_of(op: _Op) -> frozenset[int]:
    """The rails of an operation posted from a table of rows (its refs hold the table), for
    the slow paths that need them (a stall, every NIC down); empty when not known."""
    r = op.refs
    table = r[1] if isinstance(r, tuple) and len(r) == 2 else None
    if isinstance(table, np.ndarray) and "rail" in (table.dtype.names or ()):
        return frozenset(int(x) for x in np.unique(table["rail"]))
    return frozenset()


def _post_error(code: int, what: str, posted: int) -> AioteError:
    c = -code
    tail = f" ({posted} requests of it were posted and completed first)" if posted else ""
    if c == _FI_EMSGSIZE:
        return InvalidArgument(f"{what}: message too large for the transport{tail}")
    if c == _FI_EINVAL:
        return InvalidArgument(f"{what}: the transport rejected the request as invalid{tail}")
    if c in _PEER_ERRORS:
        return PeerUnreachable(f"{what}: {_strerror(c)}{tail}", c, 0)
    if c in _ACCESS_ERRORS:  # a same-host peer's table refused it before anything was posted
        return RemoteAccessError(f"{what}: {_strerror(c)}: check the descriptor's key and bounds{tail}", c, 0)
    return TransferError(f"{what}: posting failed: {_strerror(c)}{tail}", c, 0)


class TransferBatch:
    """Writes and reads collected without awaiting, posted by one native call and awaited as
    one (``engine.batch()``). Each ``write``/``read`` validates its arguments at once and raises
    :class:`InvalidArgument` there, so a submitted batch never fails on bad input halfway.
    Costs about a microsecond of Python per request, plus one event-loop round trip per batch.

    To a peer reached over several streams of one NIC, whether a large transfer is split over
    them is settled when the batch is submitted or posted, from how many transfers it holds
    then (as many as streams or more: each goes whole); transfers added while the peer's
    connections were still opening are dealt over all of them from the first submission after
    they opened. A submission in flight keeps its rows and credits whatever is added later.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        engine._batches.add(self)  # the peers its rows name are not forgotten while it lives
        self._table = np.zeros(16, _OP_DTYPE)
        self._n = 0
        self._credits: _Credits = {}  # multi-NIC peers: sent after the data
        self._refs: set[MemoryRegion] = set()
        self._entries = 0  # transfers added (a striped one is several rows)
        # transfers to peers of several routes whose rows depend on the batch's final size or
        # on connections still opening: [first row, rows, arguments, credits], see _place
        self._moving: list[list[Any]] = []
        self._placed = (0, 0)  # (self._entries, connections open) when _place last ran
        # the rows as last submitted, ready to post: (table, n, rows, items, post, what)
        self._ready: tuple[Any, ...] | None = None

    def __len__(self) -> int:
        return self._n

    def _add(self, rows: list[tuple[int, ...]]) -> None:
        need = self._n + len(rows)
        if need > len(self._table):
            self._table = np.resize(self._table, max(need, 2 * len(self._table)))
        t = self._table
        for r in rows:
            t[self._n] = r
            self._n += 1

    def _append(self, mr: MemoryRegion, args: tuple[Any, ...]) -> None:
        """Validates and adds one transfer (``args``: :meth:`Engine._rows`' from ``remote``
        to ``op``), remembering it when its rows may change by :meth:`_place`."""
        credits: _Credits = {}
        rows, settled = self._rows_of((mr, *args), credits, self._n)
        first = self._n
        self._add(rows)
        self._refs.add(mr)
        for key, k in credits.items():
            self._credits[key] = self._credits.get(key, 0) + k
        if not settled:
            self._moving.append([first, len(rows), (mr, *args), credits])
        self._entries += 1

    def _rows_of(
        self, spec: tuple[Any, ...], credits: _Credits, load: int
    ) -> tuple[list[tuple[int, ...]], bool]:
        """The rows of one transfer (``spec``: :meth:`Engine._rows`' arguments from ``mr`` to
        ``op``), and whether they are settled (see :meth:`_place`)."""
        mr, remote, length, src_offset, dst_offset, imm, op = spec
        note: list[bool] = []
        rows = self._engine._rows(
            mr, remote, length, src_offset, dst_offset, imm, op, credits, load=load, note=note
        )[0]
        return rows, not note or note[0]

    def _place(self) -> None:
        """Settles the rows of transfers to peers of several routes before a submission.

        When a transfer is added, the batch does not know how many will follow: over the
        streams of one NIC a large one is split only while the batch (plus what is in flight)
        holds fewer transfers than streams, and a transfer added while a peer's connections
        were still opening goes over the open ones only. Before each submission, those
        transfers are built again if transfers were added since, or while connections were
        opening: a batch of many transfers deals whole ones over every stream (as the C core
        does), a batch of one large transfer splits it. The rows of submissions in flight are
        never rewritten (a new table replaces the old one). Costs nothing once settled;
        otherwise about a microsecond of Python per such transfer."""
        eng = self._engine
        if not self._moving or self._placed == (self._entries, len(eng._routes_open)):
            return
        pieces: list[np.ndarray] = []
        keep: list[list[Any]] = []
        total = self._credits.copy()
        pos = shift = 0
        for first, count, args, old in self._moving:  # built aside: nothing changes if one raises
            credits: _Credits = {}
            rows, settled = self._rows_of(args, credits, self._entries)
            pieces.append(self._table[pos:first])
            pieces.append(eng._table(rows))
            pos = first + count
            for key, k in old.items():
                total[key] -= k
                if not total[key]:
                    del total[key]
            for key, k in credits.items():
                total[key] = total.get(key, 0) + k
            if not settled:
                keep.append([first + shift, len(rows), args, credits])
            shift += len(rows) - count
        pieces.append(self._table[pos : self._n])
        table = np.concatenate(pieces)
        self._table, self._n, self._credits, self._moving = table, len(table), total, keep
        self._placed = (self._entries, len(eng._routes_open))

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
        """Adds a write (same arguments as :meth:`Engine.write`, host regions only); returns
        the batch.

        Checks everything at once: the region is registered with this engine, both ranges fit,
        the peer's region allows remote write, ``imm`` is 32-bit (a zero-length write needs
        one), a provider reaches the peer. Raises :class:`InvalidArgument` when one fails
        or a region is GPU memory, :class:`DescriptorError` (corrupt descriptor bytes), :class:`EngineClosed`;
        nothing is added then. Costs only validating and appending one request (one per NIC
        when striped) to the batch: nothing is posted until :meth:`submit` or :meth:`post`;
        the first request to a new peer resolves its address once (cached)."""
        self._append(mr, (remote, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE))
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
        """Adds a READ (same arguments as :meth:`Engine.read`, host regions only); returns
        the batch.

        Checks everything at once: the local region is registered with this engine and
        writable, both ranges fit, at least one byte moves, the peer's region allows remote
        read, a provider reaches the peer. Raises :class:`InvalidArgument` when one fails
        or a region is GPU memory, :class:`DescriptorError` (corrupt descriptor bytes), :class:`EngineClosed`;
        nothing is added then. Costs only validating and appending one request (one per NIC
        when striped) to the batch: nothing is posted until :meth:`submit` or :meth:`post`;
        the first request to a new peer resolves its address once (cached)."""
        self._append(mr, (remote, length, src_offset, dst_offset, None, lib.AIO_OP_READ))
        return self

    async def submit(self, *, timeout: float | None = None, retry: RetryPolicy | None = None) -> None:
        """Posts every request and waits until all completed. Raises the first error
        (after every posted request finished); see :meth:`Engine.write` for cancellation.

        A batch may be submitted again (a static schedule built once); each submission
        re-checks that its regions are still registered (:class:`InvalidArgument` if not).

        Also raises :class:`EngineClosed`, :class:`TransferTimeout` after ``timeout``, and
        :class:`TransferError` subclasses from the transport. Costs one native posting call for
        all rows (a few when the send queue fills), one completion record and one event-loop
        wake-up for the whole batch, plus the deferred credit writes of multi-NIC peers."""
        self._engine._check_open()
        if self._n == 0:
            await anyio.lowlevel.checkpoint()
            return
        self._check_regions()
        self._place()
        if self._credits:  # multi-NIC peers: credits follow the data
            await self._submit(self._table[: self._n], self._credits.copy(), timeout, retry)
            return
        # one group, posted by aio_submit from the rows as they stand (kept between
        # submissions of an unchanged batch: a static schedule re-submitted in a loop)
        eng = self._engine
        ready = self._ready
        if ready is None or ready[0] is not self._table or ready[1] != self._n:
            rows = self._table[: self._n]
            items = ffi.from_buffer("aio_op_desc[]", rows)
            ready = self._ready = (self._table, self._n, rows, items, eng._poster(items, self._n),
                                   f"batch of {self._n}")
        _, n, rows, items, post, what = ready
        refs = (self._refs, rows)  # (_refs only ever grows: keeps this submission's regions)

        async def attempt(t: float | None) -> None:
            eng._opening += 1  # as _run counts it (see _rows)
            try:
                await eng._run_group(post, n, refs, t, what, None, None, items)
            finally:
                eng._opening -= 1

        if retry is not None:
            await eng._attempts(attempt, timeout, retry, what)
            return
        # the first attempt inline: what _attempts(attempt) does without a policy, minus its
        # coroutine layers (_attempts, attempt, _run_group), which the event loop would step
        # through once per completion of a batch re-submitted in a loop
        end = _end(timeout)
        try:
            eng._opening += 1
            try:
                await eng._finish(eng._begin(n, refs, None, None, items), post, n, end, timeout, what)
            finally:
                eng._opening -= 1
        except PeerUnreachable as exc:
            await eng._retry_after(exc, attempt, end, eng._retry, what)

    async def _submit(
        self,
        table: np.ndarray,
        credits: _Credits,
        timeout: float | None,
        retry: RetryPolicy | None,
    ) -> None:
        """One submission of ``table`` (the batch's rows when it was made: rows are never
        rewritten, growth and :meth:`_place` reallocate) and its ``credits``, so a batch
        that grows meanwhile changes only its later submissions."""
        what = f"batch of {len(table)}"
        end = _end(timeout)
        eng = self._engine
        refs = self._refs  # only ever grows: keeps this submission's regions too

        async def attempt(t: float | None) -> None:
            await eng._then_credit(eng._run(table, refs, t, what), credits, end, what, len(table))

        await eng._attempts(attempt, timeout, retry, what)

    def _check_regions(self) -> None:
        """Raises InvalidArgument if a region of this batch was unregistered since it was added."""
        for mr in self._refs:  # (a loop: cheaper than any() over a generator, on every submission)
            if mr._handle is None:
                raise InvalidArgument(
                    "a region of this batch was unregistered since it was added: build the batch again "
                    "with registered regions"
                )

    def post(self, *, retry: RetryPolicy | None = None) -> Transfer:
        """:meth:`submit`, posted now and awaited later (see :meth:`Engine.post_write`): every
        request is handed to the transport before this returns when it takes them at once
        (otherwise a background task of the engine posts the rest, as :meth:`submit`
        would); the returned :class:`Transfer` completes when all of them did. Raises
        :class:`InvalidArgument` at once if a region of the batch was unregistered,
        :class:`EngineClosed`. Cost: as :meth:`submit` minus its awaits; when posted in this
        call, its completion is quiet (read at the loop's next wake-up)."""
        eng = self._engine
        eng._check_open()
        _check_retry(retry)
        self._check_regions()
        self._place()
        what = f"batch of {self._n}"
        if self._n == 0:
            return Transfer(eng, what)
        table = self._table[: self._n]
        if self._credits:  # multi-NIC peers: credits follow the data
            credits = self._credits.copy()
            return eng._background(lambda: self._submit(table, credits, None, retry), what)
        return eng._post_now(table, self._refs, what, retry)


class Transfer:
    """A write posted by :meth:`Engine.post_write`, :meth:`Engine.post_write_imm` or
    :meth:`TransferBatch.post`: already on its way; ``await transfer`` (or
    :meth:`wait`) returns once the transport is done with the source buffers, or raises the
    operation's error.

    Awaiting only observes: cancelling the awaiting task, or a :meth:`wait` timing out,
    leaves the transfer going (a posted request is never taken back; the engine holds its
    buffers until the completion), and it may be awaited again, from any task of the loop,
    any number of times (each await of a failed transfer raises the same exception). An
    awaited transfer that finished costs no event-loop round trip."""

    __slots__ = ("__weakref__", "_again", "_bg", "_engine", "_exc", "_finished", "_observed", "_op",
                 "_retry", "_what")

    def __init__(
        self,
        engine: Engine,
        what: str,
        op: _Op | None = None,
        again: Callable[[float | None], Awaitable[bool]] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._engine = engine
        self._what = what
        self._op = op  # a group posted in the caller's call: its completion is awaited
        self._again = again  # posts the work anew (a retry after a broken connection)
        self._retry = retry
        self._bg: Any = None  # the event of the background task carrying the work, if any
        self._exc: BaseException | None = None
        self._finished = op is None  # until _go starts a task (an empty batch: done)
        self._observed = False

    def _go(self, run: Callable[[], Awaitable[Any]]) -> None:
        """Hands the rest of the work to a background task of the engine's event loop."""
        self._finished = False
        self._op = None
        ev = self._bg = self._engine._event()

        async def carry() -> None:
            try:
                await run()
            except Exception as exc:
                self._exc = exc
            finally:
                ev.set()

        bridge = self._engine._bridge
        assert bridge is not None
        bridge.spawn(carry)

    @property
    def done(self) -> bool:
        """True once the operation finished, successfully or not: awaiting it then returns
        (or raises) without waiting. Raises nothing; O(1): at most one native call and a read
        of the completion records that came in quietly."""
        if self._finished:
            return True
        op = self._op
        if op is not None:
            eng = self._engine
            if not op.event.is_set() and not eng._closed and lib.aio_quiet_waiters(eng._h, 0):
                eng._drain()  # its completion may have come in quietly
            return op.event.is_set() is True
        return self._bg.is_set() is True

    def __await__(self) -> Any:
        return self.wait().__await__()

    async def wait(self, *, timeout: float | None = None) -> None:
        """Waits until the transfer finished; raises its error (:class:`TransferError`
        subclasses, :class:`EngineClosed`), or :class:`TransferTimeout` when ``timeout``
        seconds pass first (the transfer goes on; await it again), :class:`InvalidArgument` for
        a bad ``timeout``. Cancellable without affecting the transfer. A finished transfer
        returns after one cancellation check, no event-loop round trip; otherwise the task
        sleeps until its completion wakes it."""
        end = _end(timeout)
        eng = self._engine
        waited = False
        while not self._finished:
            op = self._op
            if op is not None:
                if not op.event.is_set():
                    # its completion record wakes the loop only while someone waits for it
                    # (a closing engine sets every pending event itself)
                    h = None if eng._closed else eng._h
                    if h is not None and lib.aio_quiet_waiters(h, 1):
                        eng._drain()  # records (perhaps its own) came in quietly
                    try:
                        if eng._loop_spin_ns and not op.event.is_set():
                            eng._spin_until(op.event.is_set)
                        if not op.event.is_set():
                            waited = True
                            if not await wait_until(op.event, end):
                                assert timeout is not None
                                raise timeout_error(self._what, timeout)
                    finally:
                        if h is not None and not eng._closed:
                            lib.aio_quiet_waiters(h, -1)
                self._op = None
                self._finished = True
                try:
                    eng._outcome(op, self._what)
                except PeerUnreachable as exc:
                    self._retry_later(exc)
                except Exception as exc:
                    self._exc = exc
                continue
            if not self._bg.is_set():
                waited = True
                if not await wait_until(self._bg, end):
                    assert timeout is not None
                    raise timeout_error(self._what, timeout)
            self._finished = True
        if not waited:
            await eng._checkpoint_if_cancelled()
        self._observed = True
        if self._exc is not None:
            raise self._exc

    def _retry_later(self, exc: PeerUnreachable) -> None:
        """The posted group failed with a broken connection: re-post as the retry policy
        says, in a background task (so that the work goes on whoever awaits it)."""
        eng, again, retry, what = self._engine, self._again, self._retry, self._what
        if again is None or getattr(exc, "_final", False):
            self._exc = exc
            return

        async def run() -> None:
            token = _POLICY.set(retry) if retry is not None else None
            try:
                await eng._retry_after(exc, again, None, retry or eng._retry, what)
            finally:
                if token is not None:
                    _POLICY.reset(token)

        self._go(run)

    def __del__(self) -> None:
        try:
            if self._observed:
                return
            op = self._op
            failed = self._exc is not None or (op is not None and op.done and op.status != 0)
            if failed:
                _log.warning("a posted transfer failed and was never awaited", op=self._what)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def auto_pollers(rails: int) -> int:
    """``open_engine``'s default ``pollers`` for an engine of ``rails`` rails: one thread per
    rail, up to the cores this process may run on (at least two)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(rails, max(2, cores)))


def _open_native(
    provider: str,
    nics: Sequence[str | None],
    *,
    slots: int,
    slot_size: int,
    spin_ns: int,
    sleep_ms: int,
    max_in_flight: int,
    same_host: str | None = None,
    base_port: int = 0,
    watch_us: int = 100,
    direct: bool = False,
    sndbuf: int | None = None,
    arena: int = 0,
    pollers: int | None = None,
) -> tuple[Any, list[RailInfo], Arena | None]:
    cfg = ffi.new(
        "aio_engine_config*",
        {
            "ring_capacity": 1 << 16,
            "max_ops": max_in_flight,
            "max_groups": max_in_flight,
            "spin_ns": spin_ns,
            "sleep_ms": sleep_ms,
            "base_port": base_port,
            "watch_us": watch_us,
        },
    )
    out = ffi.new("aio_engine**")
    err = ffi.new("char[1024]")
    rc = lib.aio_engine_create(cfg, out, err, 1024)
    if rc != 0:
        raise ProviderError(ffi.string(err).decode(errors="replace") or _strerror(-rc))
    h = out[0]
    if sndbuf is not None and lib.aio_engine_set_tcp_sndbuf(h, sndbuf, 1) != 0:
        lib.aio_engine_destroy(h)
        raise InvalidArgument(f"tcp_send_buffer: {sndbuf} not accepted")
    rails: list[RailInfo] = []
    wanted: list[tuple[str, str | None, bool]] = [(provider, nic, True) for nic in nics]
    if same_host is not None and same_host != provider:
        wanted.append((same_host, None, False))
    threads = auto_pollers(len(wanted)) if pollers is None else pollers  # the core caps it at the rails
    if lib.aio_engine_set_pollers(h, threads) != 0:  # pragma: no cover - checked by open_engine
        lib.aio_engine_destroy(h)
        raise InvalidArgument(f"pollers: {pollers} not accepted")
    try:
        for prov, nic, required in wanted:
            rc = lib.aio_engine_add_rail(
                h, prov.encode(), nic.encode() if nic else ffi.NULL, slots, slot_size, err, 1024
            )
            if rc < 0:
                why = ffi.string(err).decode(errors="replace") or _strerror(-rc)
                if not required:
                    _log.info(
                        "same-host provider unavailable; same-host peers use the main provider",
                        provider=prov,
                        reason=why,
                    )
                    continue
                if "offers no provider" in why:
                    have = available_providers()
                    why += (
                        f"; available here: {', '.join(have)}" if have else "; no provider is usable here"
                    ) + " (`aiote info` lists them with their NICs)"
                raise ProviderError(why)
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
        host_arena: Arena | None = None
        if direct and any(r.provider == "shm" for r in rails):
            rc = lib.aio_engine_enable_direct(h, err, 1024)
            if rc != 0:
                _log.info(
                    "direct same-host copies unavailable; same-host peers read through shm",
                    reason=ffi.string(err).decode(errors="replace") or _strerror(-rc),
                )
            elif arena:
                host_arena = _open_arena(h, arena)
        rc = lib.aio_engine_start(h)
        if rc != 0:
            raise ProviderError(f"could not start the poller thread: {_strerror(-rc)}")
    except BaseException:
        lib.aio_engine_destroy(h)
        raise
    return h, rails, host_arena


def _open_arena(h: Any, size: int) -> Arena | None:
    """The engine's host arena, published in its direct-copy table, or None (logged)."""
    err = ffi.new("char[1024]")
    try:
        arena = Arena(size)
    except OSError as e:
        why = str(e)
    else:
        try:
            rc = lib.aio_engine_set_arena(h, arena.fd, ffi.cast("void*", arena.base), arena.size, err, 1024)
        finally:
            arena.close()  # the core holds its own duplicate; the mapping stays
        if rc == 0:
            return arena
        why = ffi.string(err).decode(errors="replace") or _strerror(-rc)
    _log.info("host arena unavailable; alloc_host returns ordinary memory", reason=why)
    return None


_DEFAULT_NIC = {"tcp": "lo"}


def default_streams(provider: str = "tcp", nics: Sequence[str] | None = None) -> int:
    """The ``streams`` (connections per NIC) that :func:`open_engine` takes when none is
    given: 2 on the ``tcp`` provider with one NIC, 1 otherwise. One TCP connection moves
    large writes at about one core's copy speed and its receive path is the limit on
    loopback (docs/benchmarks.md); several NICs already give several connections, and shm,
    verbs and efa do not gain from more. Pure; raises nothing; O(NICs)."""
    count = 1 if nics is None or isinstance(nics, str) else len(list(nics))
    return 2 if provider == "tcp" and count == 1 else 1


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
    same_host: str | None = "shm",
    stripe_min: int = 1 << 20,
    retry: RetryPolicy | None = None,
    port: int | None = None,
    stage_chunk: int = 4 << 20,
    gpu_ipc: bool = True,
    watch_interval_us: int = 100,
    gpu_backend: str = "cuda",
    gpu_direct: bool | None = None,
    streams: int | None = None,
    same_host_direct: bool = True,
    tcp_send_buffer: int | None = None,
    host_arena: int = 4 << 30,
    pollers: int | None = None,
    max_peers: int = 1024,
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
    side (default 0: off): an operation or counter wait that is not complete right after
    posting drives the completion queues from the loop thread itself (a native call, GIL
    released: it polls for ~30 us, yielding the core between polls, then sleeps on the NICs'
    wait objects) for up to this long, and only then sleeps on the event loop: no hand-off
    through the ring and the eventfd, and a completed operation or an available credit
    returns without a trip through the event loop (the poller thread works as usual). It
    blocks the loop for at most ``loop_spin_us`` per wait, so use it where latency matters
    more than other tasks' fairness (e.g. ``500``); an idle engine still sleeps.
    ``sleep_ms``: the timed fallback of the sleeping poller.
    ``same_host``: an extra provider (one rail) for peers on this host, chosen automatically
    when both engines carry it (default ``"shm"``: shared memory, about 2.5x tcp loopback here);
    ``None`` keeps every peer on ``provider`` (see :meth:`Engine.route`). Skipped with a log
    line when the provider is not available.
    ``same_host_direct``: READs of host memory between two engines on this host that both
    have an shm rail and this setting are copied by the reader's poller thread straight out
    of the peer's memory (``process_vm_readv``), as UCX does, instead of by the target's shm
    progress (libfabric 1.17's shm copies at the target). The target's checks still hold: the
    engine publishes each host region's key, bounds and access rights in a region table in
    shared memory; the reader checks them before every copy, and unregistering a region
    waits until copies under way finished (new ones are refused). Writes stay with shm
    (``process_vm_writev`` copied slower here: see docs/benchmarks.md), except writes of 4 KiB
    or more into a peer's host arena (``host_arena`` below), which are a ``memcpy``. Falls back to shm,
    with a log line, where the copy is not permitted (ptrace restrictions) or the table
    cannot be opened. ``False``: publish no table and copy nothing directly.
    ``host_arena``: bytes of address space for :meth:`Engine.alloc_host` (default 4 GiB; only
    what is allocated and touched takes memory): a shared-memory file this engine publishes
    with its region table, which same-host peers map, so that their writes into and reads out
    of regions allocated there are a ``memcpy`` by their poller, the fastest same-host path
    (writes into other host memory stay with shm). ``0``: no arena. Needs ``same_host_direct``
    and an shm rail; without them, or where the file cannot be created, ``alloc_host`` returns
    ordinary memory (logged).
    ``stripe_min``: a single write or read of at least this many bytes is split across the
    NICs that reach the peer (several ``nics``); smaller ones go round robin over them.
    ``retry``: the default :class:`RetryPolicy` of the engine's operations (each takes
    ``retry=`` too); ``RetryPolicy()`` by default: 3 re-posts after a broken connection,
    a peer that does not answer for 5 s is unreachable.
    ``port``: tcp only: the first NIC listens on this port, the next on ``port + 1``, and so on,
    so that a restarted process gets the same address (default: any free port).
    ``stage_chunk``: GPU memory on providers without CUDA support is staged through pinned
    host memory in pieces of this size (device-to-host copy of one piece overlaps the
    network transfer of the previous). ``gpu_ipc``: same-host GPU peers are written through
    CUDA IPC (device-to-device); ``False`` stages them like remote ones.
    ``watch_interval_us``: while a GPU completion or a :class:`UvmWatcher` is awaited, the
    poller reads the watched words at least this often (it sleeps otherwise).
    ``gpu_backend``: ``"cuda"`` (CuPy); ``"host"`` emulates a GPU on host memory with the
    same stream semantics (for tests on machines without one, with
    :class:`aiote.testing.HostDeviceArray`). ``gpu_direct``: register GPU memory with the
    NICs themselves (no staging); ``None`` (default): when every NIC's provider has
    ``FI_HMEM`` (verbs/efa built with CUDA; none of Debian's), ``True`` with a provider
    without it fails at registration.
    ``streams``: connections per NIC (1 to 8; each is one more rail on the same NIC, so a
    peer opened with the same ``streams`` is reached over that many connections per NIC).
    ``None`` (default): :func:`default_streams` (2 on tcp with one NIC, else 1). Every
    connection to a peer is opened when a transfer first reaches it (a zero-byte request in
    the background); until then transfers go whole over the open ones.
    A write or read of at least ``stripe_min`` bytes is split across them while fewer
    operations are in flight than streams (its immediate, if any, follows as one credit once
    every piece landed); otherwise, and for smaller ones, the streams take whole transfers in
    turn, each carrying its immediate, as over a single NIC. On tcp two streams move
    large writes faster where one TCP connection's receive path is the limit (loopback here:
    see docs/benchmarks.md); the price is a rail's memory and poller work per stream.
    ``tcp_send_buffer``: the send buffer (``SO_SNDBUF``, bytes; the kernel doubles it) of the
    tcp provider's connections. ``None`` (default): 512 KiB on connections to peers on this
    host (the same IP at both ends, as over loopback), the kernel's autotuning elsewhere.
    Loopback tcp otherwise lets megabytes queue per connection, which the receiver then
    copies from memory rather than cache: 16 MiB writes moved about 40 % faster here with it
    (docs/benchmarks.md). ``0``: the kernel's autotuning everywhere. A positive value: that
    size on every tcp connection of the engine, other hosts included (a fixed buffer caps one
    connection near buffer / round-trip time). libfabric's tcp provider has no setting for
    it, so the core sets it on the provider's own sockets: the rail's listener and, at the
    first posts to a peer, the connection to it (see ``aio_engine_set_tcp_sndbuf``). The
    kernel caps it at ``net.core.wmem_max``.
    ``pollers``: native poller threads (1 to 16). Rail *i* (a NIC, a stream of one, or the
    same-host rail last) is driven by thread *i* % ``pollers``, so an engine with several
    rails moves data on several cores at once: over tcp one thread copies into one
    connection at about one core's speed, so ``streams=2`` needs two pollers to move more than
    one connection does (docs/benchmarks.md). Each thread spins only after activity on its
    own rails, then sleeps. ``None`` (default): one per rail, up to the cores this process may
    use (at least two); more than the rails is capped at the rails. :meth:`stats` reports the
    count.
    ``max_peers``: peer NIC addresses the engine keeps resolved (a peer engine with several
    NICs or streams counts one per NIC); past it, those not used lately are forgotten at a
    quiet moment and cost a new connection when used again (see :meth:`Engine.forget_peer`).

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
    if streams is None:
        streams = default_streams(provider, [str(n) for n in nic_list])
    streams = as_index(streams, "streams", lo=1, hi=9)
    if len(nic_list) * streams > 16:
        raise InvalidArgument(f"at most 16 rails per engine: {len(nic_list)} NICs x {streams} streams")
    nic_list = [nic for nic in nic_list for _ in range(streams)]
    max_message_size = as_index(max_message_size, "max_message_size", lo=0, hi=1 << 31)
    message_slots = as_index(message_slots, "message_slots", lo=1, hi=1 << 16)
    max_peers = as_index(max_peers, "max_peers", lo=1, hi=1 << 20)
    max_in_flight = as_index(max_in_flight, "max_in_flight", lo=16, hi=1 << 24)
    stripe_min = as_index(stripe_min, "stripe_min", lo=1)
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidArgument(f"retry must be an aiote.RetryPolicy, not {type(retry).__name__}")
    base_port = 0 if port is None else as_index(port, "port", lo=1, hi=65536 - len(nic_list))
    if same_host is not None and (not isinstance(same_host, str) or not same_host):
        raise InvalidArgument("same_host must be a provider name such as 'shm', or None")
    if not (spin_us >= 0 and math.isfinite(spin_us)):
        raise InvalidArgument("spin_us must be >= 0")
    if not (loop_spin_us >= 0 and math.isfinite(loop_spin_us)) or loop_spin_us > 100_000:
        raise InvalidArgument("loop_spin_us must be between 0 and 100000")
    stage_chunk = as_index(stage_chunk, "stage_chunk", lo=4096)
    if tcp_send_buffer is not None:
        tcp_send_buffer = as_index(tcp_send_buffer, "tcp_send_buffer", lo=0, hi=1 << 30)
    host_arena = as_index(host_arena, "host_arena", lo=0, hi=1 << 46)
    if pollers is not None:
        pollers = as_index(pollers, "pollers", lo=1, hi=17)
    watch_interval_us = as_index(watch_interval_us, "watch_interval_us", lo=1, hi=1_000_001)
    known = isinstance(gpu_backend, str) and (
        gpu_backend in ("cuda", "host") or gpu_backend.startswith("host:")
    )
    if not known:
        raise InvalidArgument("gpu_backend must be 'cuda' or 'host'")
    slot_size = max_message_size + 4096  # room for the sender's address
    h, rails, arena = await anyio.to_thread.run_sync(
        partial(
            _open_native,
            provider,
            nic_list,
            slots=message_slots,
            slot_size=slot_size,
            spin_ns=int(spin_us * 1000),
            sleep_ms=int(sleep_ms),
            max_in_flight=max_in_flight,
            same_host=same_host,
            base_port=base_port,
            watch_us=watch_interval_us,
            direct=bool(same_host_direct),
            sndbuf=tcp_send_buffer,
            arena=host_arena,
            pollers=pollers,
        )
    )
    engine = Engine(
        h,
        rails,
        cancel_grace=cancel_grace,
        post_budget_ns=int(post_budget_us * 1000),
        max_message_size=max_message_size,
        loop_spin_ns=int(loop_spin_us * 1000),
        same_host=same_host,
        stripe_min=stripe_min,
        retry=retry,
        gpu_backend=gpu_backend,
        stage_chunk=stage_chunk,
        gpu_ipc=bool(gpu_ipc),
        gpu_direct=None if gpu_direct is None else bool(gpu_direct),
        streams=streams,
        same_host_direct=bool(same_host_direct),
        arena=arena,
        message_slots=message_slots,
        max_peers=max_peers,
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
