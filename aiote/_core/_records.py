"""The small records of the engine (rails, operations, groups, held messages), the context
variables an operation's tasks share, and the helpers every layer uses."""

from __future__ import annotations

import contextvars
import hashlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ._descriptor import DEVICE_CUDA, EngineAddress, MemoryDescriptor
from ._errors import InvalidArgument
from ._log import get_logger
from ._optable import _Op
from ._retry import RetryPolicy
from ._util import check_timeout, now
from ._wire import _U32

_log = get_logger(component="engine")
# where a caller collects the groups its operations left on a failed link (see collect_stranded)
_STRANDED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("aiote_stranded", default=None)
# where an operation with deferred credits collects the groups its data goes in (see
# _then_credit), and where an observed operation's record is (its `append` taps each group)
_GROUPS: contextvars.ContextVar[Any] = contextvars.ContextVar("aiote_groups", default=None)
# the retry policy of the operation running in this task (and the tasks it starts)
_POLICY: contextvars.ContextVar[RetryPolicy | None] = contextvars.ContextVar("aiote_retry", default=None)


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


class _GroupTap(list[Any]):
    """A ``_GROUPS`` collector that also hands each group, as it begins, to ``tap`` (an observed
    operation's record, see _observe.py); :func:`_groups_list` passes the tap on to the
    collectors of the operation's inner steps."""

    __slots__ = ("tap",)

    def __init__(self, tap: Callable[[Any], None]) -> None:
        super().__init__()
        self.tap = tap

    def append(self, op: Any) -> None:
        super().append(op)
        self.tap(op)


def _groups_list() -> list[Any]:
    """A new collector for ``_GROUPS`` that keeps the enclosing one's tap, if any (an
    observed operation's record, or a ``_GroupTap`` of one)."""
    tap = getattr(_GROUPS.get(), "tap", None)
    return [] if tap is None else _GroupTap(tap)


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
    slot handed back to the transport) when :meth:`Engine.recv` takes it. The messages of one
    combined message (see :mod:`._coalesce`) share their slot: ``share[0]`` counts those not
    taken yet, and the last one taken hands the slot back."""

    __slots__ = ("end", "rail", "sender", "share", "slot", "start")

    def __init__(
        self, rail: int, slot: int, sender: bytes, start: int, end: int, share: list[int] | None = None
    ) -> None:
        self.rail = rail
        self.slot = slot
        self.sender = sender
        self.start = start
        self.end = end
        self.share = share


class _RecvWaiter:
    __slots__ = ("event", "item")

    def __init__(self, event: Any) -> None:
        self.event = event
        self.item: tuple[bytes, bytes] | None = None
_PARSED_ADDRESSES: dict[bytes, EngineAddress] = {}  # engine address bytes -> parsed (immutable)


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


def _backend_lowlevel(name: str) -> Callable[[], Awaitable[None]]:
    """``anyio.lowlevel.<name>`` (``checkpoint``, ``checkpoint_if_cancelled``) of the running
    backend, looked up once per engine: the public function finds the backend (sniffio) on
    every call, a third of its cost on a counter wait's path."""
    try:
        from anyio._core._eventloop import get_async_backend

        fn: Callable[[], Awaitable[None]] = getattr(get_async_backend(), name)
        return fn
    except Exception:  # pragma: no cover - another anyio layout: the public function
        public: Callable[[], Awaitable[None]] = getattr(anyio.lowlevel, name)
        return public


_MEMO_MAX = 256  # memoized requests per region (writes) and per engine (write_imm)


def _plain(key: tuple[Any, ...] | int) -> bool:
    """True when every argument of a memo key is an int (or None): kept requests are found by
    hash and ``==``, which would let ``True`` or ``1.0`` pass for ``1`` (and an unhashable
    argument raise ``TypeError`` instead of failing validation)."""
    if type(key) is int:
        return True
    return type(key) is tuple and _PLAIN_TYPES.issuperset(map(type, key))


_PLAIN_TYPES = frozenset((int, type(None)))


def _plain_imm(imm: Any) -> bool:
    """True for an immediate a kept request may carry without full validation: None, or a
    plain ``int`` (no bool, no NumPy integer) in [0, 2**32)."""
    return imm is None or (type(imm) is int and 0 <= imm < _U32)


def _check_retry(retry: Any) -> None:
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidArgument(f"retry must be an aiote.RetryPolicy, not {type(retry).__name__}")


def _end(timeout: float | None) -> float | None:
    """The deadline of an operation (InvalidArgument for a bad timeout, before any work)."""
    check_timeout(timeout)
    return None if timeout is None else now() + timeout


def _left(end: float | None) -> float | None:
    return None if end is None else max(0.0, end - now())


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
