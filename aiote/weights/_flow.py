"""Execution of a plan: :class:`WeightSender` on each trainer rank (the inference ranks'
side: :mod:`._receiver`). Built on aiote's public operations only (``register``,
``post_write``, ``post_write_imm``, ``write_imm``, ``imm_follows_writes``, ``imm_counter``)."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any

import anyio
import numpy as np

from .._core._descriptor import MemoryDescriptor
from .._core._engine import Engine
from .._core._errors import AioteError, InvalidArgument, TransferError, TransferTimeout
from .._core._fabric import usable_cores
from .._core._log import get_logger
from .._core._memory import MemoryRegion
from .._core._observe import observed_call
from .._core._posted import Transfer
from .._core._retry import RetryPolicy
from ._dtypes import cast_into, storage
from ._plan import PlanError, SenderPlan, SourceShard, Write

__all__ = ["VERSION_BITS", "PushFailed", "PushStats", "WeightSender", "version_imm"]

_log = get_logger(component="weights")
VERSION_BITS = 24
_VMASK = (1 << VERSION_BITS) - 1
_ONCE = RetryPolicy(attempts=0)  # a completion immediate must count exactly once
_THREAD_COPY = 1 << 20  # host staging copies of at least this many bytes run in a worker thread
# ... and in up to this many threads at once (one per 4 usable cores, at most 4), by rows, one
# per MiB at least: a host with cores to spare copies (and casts) a chunk at its memory's pace
_COPY_THREADS = max(1, min(4, usable_cores() // 4))


def version_imm(tag: int, version: int) -> int:
    """The immediate that announces ``version`` (modulo 2**24) in a flow of high byte ``tag``:
    each version has its own counter, so a late credit of ``v`` is never counted for another
    version closer than 2**24 updates. Pure; raises :class:`~aiote.InvalidArgument` for a
    negative or non-integer version or a tag outside [0, 256)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgument(f"version must be an int >= 0, not {version!r}")
    if not 0 <= tag < 256:
        raise InvalidArgument(f"tag must be in [0, 256), not {tag!r}")
    return (tag << VERSION_BITS) | (version & _VMASK)


@dataclass
class PushStats:
    """What one :meth:`WeightSender.push` did. Times in seconds: ``wall_s`` the whole push;
    ``staging_wait_s`` spent waiting for room in the staging pool; ``transform_s`` copying and
    casting into the pool (on GPU: launching the kernels); ``write_s`` the writes' durations
    summed (they overlap, so it can exceed ``wall_s``); ``notify_s`` the completion
    immediates' durations summed (for one posted behind the writes, from the end of the
    writes); ``imms_behind_writes`` the receivers whose immediate was posted right behind
    their writes (over the CUDA-IPC rail) rather than after them. ``bytes_by_receiver`` the
    bytes written to each inference rank; ``direct_bytes`` those written straight from
    registered source tensors, of which ``strided_bytes`` as column slices (one strided copy
    per slice, to a receiver reached by same-host direct copies); ``peak_staging_bytes`` the
    most staging memory in use at once."""

    version: int
    wall_s: float = 0.0
    staging_wait_s: float = 0.0
    transform_s: float = 0.0
    write_s: float = 0.0
    notify_s: float = 0.0
    imms_behind_writes: int = 0
    writes: int = 0
    bytes_by_receiver: dict[int, int] = field(default_factory=dict)
    direct_bytes: int = 0
    strided_bytes: int = 0
    peak_staging_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes written in all."""
        return sum(self.bytes_by_receiver.values())


class PushFailed(TransferError):
    """A push did not reach every receiver: ``errors`` maps each failed inference rank to its
    error (e.g. :class:`~aiote.PeerUnreachable`, :class:`~aiote.TransferTimeout`);
    ``completed`` lists the ranks that received every byte and the version's immediate;
    ``stats`` is the push's :class:`PushStats`."""

    def __init__(
        self, version: int, errors: dict[int, BaseException], completed: tuple[int, ...], stats: PushStats
    ) -> None:
        self.version = version
        self.errors = errors
        self.completed = completed
        self.stats = stats
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items()))
        super().__init__(
            f"push of version {version} failed for inference ranks {sorted(errors)} ({detail}); "
            f"completed {list(completed)}"
        )


class _Pool:
    """First-fit allocator over the staging buffer, plus a per-receiver budget of bytes in
    flight (so one stalled receiver cannot take the whole pool)."""

    def __init__(self, size: int, lane_cap: int) -> None:
        self.size = size
        self.lane_cap = lane_cap
        self.free: list[tuple[int, int]] = [(0, size)]
        self.used = 0
        self.peak = 0
        self.lanes: dict[int, int] = defaultdict(int)
        self.changed = anyio.Event()

    def _alloc(self, n: int) -> int | None:
        for i, (start, size) in enumerate(self.free):
            if size >= n:
                self.free[i] = (start + n, size - n)
                if size == n:
                    del self.free[i]
                return start
        return None

    async def take(self, lane: int, n: int, memory: bool, end: float | None) -> int:
        """Reserves ``n`` bytes of lane budget (and of memory if ``memory``); the offset, -1
        when no memory was asked for. Raises TransferTimeout at ``end``."""
        while True:
            if self.lanes[lane] + n <= self.lane_cap or self.lanes[lane] == 0:
                off = self._alloc(n) if memory else -1
                if off is not None:
                    self.lanes[lane] += n
                    if memory:
                        self.used += n
                        self.peak = max(self.peak, self.used)
                    return off
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise TransferTimeout("no room in the staging pool before the push's deadline")
            with anyio.move_on_after(left if left is not None else float("inf")):
                await self.changed.wait()

    def give(self, lane: int, off: int, n: int) -> None:
        self.lanes[lane] -= n
        if off >= 0:
            self.used -= n
            self.free.append((off, n))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for s, z in self.free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + z)
                else:
                    merged.append((s, z))
            self.free = merged
        changed, self.changed = self.changed, anyio.Event()
        changed.set()


def _xp_of(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return np
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy  # type: ignore[import-not-found,unused-ignore]

        return cupy
    raise InvalidArgument(f"tensors must be NumPy or CuPy arrays, not {type(a).__name__}")


def _end(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidArgument(f"timeout must be a number of seconds >= 0 or None, not {timeout!r}")
    return time.monotonic() + timeout


def _left(end: float | None) -> float | None:
    return None if end is None else max(0.0, end - time.monotonic())


class _Push:
    """The state of one push: errors per receiver, stats, the tensors."""

    def __init__(self, version: int, tensors: dict[str, Any], end: float | None) -> None:
        self.version = version
        self.tensors = tensors
        self.end = end
        self.errors: dict[int, BaseException] = {}
        self.stats = PushStats(version)
        # source name -> (its registered allocation's key, the shard's byte offset in it)
        self.direct: dict[str, tuple[tuple[int, int], int]] = {}
        self.devices: set[int] | None = None  # the GPUs of the tensors and staging (CuPy)


class WeightSender:
    """Executes trainer rank ``plan.rank``'s part of a plan, one version per :meth:`push`.

    ``async with WeightSender(engine, plan.sender(rank), max_tmp_bytes=...) as tx``. Per
    receiver a lane walks its writes in plan order: take room in the staging pool (at most
    ``max_tmp_bytes`` in all, an even share of it per receiver in flight), copy the rows
    (and cast) into it, start the write, go on; the pool's room comes back as writes
    complete, so copies overlap the writes. Once every write to a receiver completed (the
    bytes are in place), one zero-byte write carries the version's immediate to it; over the
    CUDA-IPC rail (:meth:`~aiote.Engine.imm_follows_writes`) it is posted right behind the
    last write instead, and the rail credits it after their bytes. With
    ``register_sources``, tensors that need no cast and no column slice are written from
    directly, with no staging copy: the allocation each is a view of is registered once
    (kept while passed again), and consecutive writes that read adjacent bytes of it and
    land on adjacent bytes of one region go as one write of up to ``coalesce_bytes`` and a
    quarter of a receiver's share of ``max_tmp_bytes`` (0: no merging): parameters laid out
    one after another in one flat buffer then cost a few large writes, not one per tensor.
    Merging takes a receiver's direct writes in the order of what they read. A column slice
    that needs no cast (a row-parallel layer's shard) to a receiver this engine reaches by
    same-host direct copies (:attr:`~aiote.Route.direct`) is not staged either: it goes as one
    paged write whose pages are its rows, which the core makes as one strided copy.

    Raises :class:`~aiote.InvalidArgument` (``PlanError``) for a plan without descriptors, a
    write larger than ``max_tmp_bytes``, bad arguments; :class:`~aiote.DescriptorError` for a
    corrupt descriptor. Costs one staging buffer of ``max_tmp_bytes`` (host or GPU, by the
    type of the first tensors pushed), registered once, freed on exit.
    """

    def __init__(
        self,
        engine: Engine,
        plan: SenderPlan,
        *,
        max_tmp_bytes: int = 256 << 20,
        register_sources: bool = False,
        coalesce_bytes: int = 256 << 20,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not isinstance(plan, SenderPlan):
            raise InvalidArgument(f"plan must be a SenderPlan (plan.sender(rank)), not {type(plan).__name__}")
        if isinstance(max_tmp_bytes, bool) or not isinstance(max_tmp_bytes, int) or max_tmp_bytes < 1:
            raise InvalidArgument(f"max_tmp_bytes must be an int >= 1, not {max_tmp_bytes!r}")
        if isinstance(coalesce_bytes, bool) or not isinstance(coalesce_bytes, int) or coalesce_bytes < 0:
            raise InvalidArgument(f"coalesce_bytes must be an int >= 0, not {coalesce_bytes!r}")
        biggest = max((w.nbytes for w in plan.writes), default=0)
        if biggest > max_tmp_bytes:
            raise PlanError(
                f"a write of {biggest} B does not fit max_tmp_bytes={max_tmp_bytes}: "
                "plan with a smaller chunk_bytes or raise max_tmp_bytes"
            )
        if any(not d for d in plan.descs):
            raise PlanError("the plan was computed without region descriptors; it cannot be executed")
        self.engine = engine
        self.plan = plan
        self.max_tmp_bytes = max_tmp_bytes
        self.register_sources = register_sources
        self.coalesce_bytes = coalesce_bytes
        self._retry = retry
        self._descs = [MemoryDescriptor.from_bytes(d) for d in plan.descs]
        self._lanes: dict[int, list[Write]] = defaultdict(list)
        for w in plan.writes:
            self._lanes[w.dst].append(w)
        self._first_desc = {r: self._descs[ws[0].desc] for r, ws in self._lanes.items()}
        self._imm_descs: dict[int, MemoryDescriptor] = {}
        self._lane_descs = {r: sorted({w.desc for w in ws}) for r, ws in self._lanes.items()}
        # the last push's direct sources (ctx.direct), and per receiver the runs made for them
        self._direct_seen: dict[str, tuple[tuple[int, int], int]] = {}
        self._run_cache: dict[int, tuple[int, dict[str, Any], list[list[Write]]]] = {}
        self._sources = {s.name: s for s in plan.sources}
        self._plain_names = sorted({w.source for w in plan.writes if self._plain(w)})
        self._desc_direct: dict[int, bool] = {}  # desc index -> Route.direct
        self._slice_names: list[str] | None = None  # with NumPy: _plain_names and _strided's sources
        # name -> (the array last passed, (shape, dtype, address), its xp, its 2-D view)
        self._seen: dict[str, tuple[Any, tuple[Any, ...], Any, Any]] = {}
        # name -> (the 2-D view last registered from, its allocation's key, byte offset)
        self._roots: dict[str, tuple[Any, tuple[int, int], int]] = {}
        self._staging: Any = None
        self._staging_mr: MemoryRegion | None = None
        self._xp: Any = None
        # registered allocations: (address, bytes) -> (the flat array, its region)
        self._registered: dict[tuple[int, int], tuple[Any, MemoryRegion]] = {}
        self._busy = False
        # what earlier pushes gave up on while it may still land: each returns once it cannot
        self._unsettled: list[Callable[[], Awaitable[None]]] = []
        self._log = _log.bind(rank=plan.rank)

    async def __aenter__(self) -> WeightSender:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Unregisters the staging buffer and the registered sources (shielded, 30 s at
        most). Idempotent; raises nothing for an engine already closed."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            regions = [mr for _, mr in self._registered.values()]
            if self._staging_mr is not None:
                regions.append(self._staging_mr)
            self._registered.clear()
            self._staging_mr = self._staging = None
            for mr in regions:
                if not self.engine.closed:
                    try:
                        await self.engine.unregister(mr, timeout=10)
                    except AioteError as exc:
                        self._log.warning("unregister failed", error=str(exc))

    # -------------------------------------------------------------- checks

    def _check_tensors(self, tensors: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """The 2-D (rows, width) views of the tensors this rank must push, and their xp. A
        tensor passed again (the same array, shape, type and address) reuses its view."""
        if not isinstance(tensors, Mapping):
            raise InvalidArgument(f"tensors must be a mapping name -> array, not {type(tensors).__name__}")
        views: dict[str, Any] = {}
        xp: Any = None
        for name, s in self._sources.items():
            if name not in tensors:
                raise InvalidArgument(
                    f"push: no tensor for parameter {name!r} (rank {s.rank} holds rows {s.rows})"
                )
            a = tensors[name]
            seen = self._seen.get(name)
            if seen is not None and seen[0] is a and seen[1] == (a.shape, a.dtype, _ptr(a)):
                x, views[name] = seen[2], seen[3]
            else:
                x, views[name] = self._check_one(name, s, a)
                self._seen[name] = (a, (a.shape, a.dtype, _ptr(a)), x, views[name])
            if xp is None:
                xp = x
            elif x is not xp:
                raise InvalidArgument("push: tensors must be all NumPy or all CuPy")
        return views, xp

    def _check_one(self, name: str, s: SourceShard, a: Any) -> tuple[Any, Any]:
        x = _xp_of(a)
        if tuple(a.shape) != s.local_shape:
            raise InvalidArgument(f"push: {name!r} has shape {tuple(a.shape)}, the plan says {s.local_shape}")
        want = storage(s.dtype)
        if a.dtype != want and not (s.dtype == "bfloat16" and str(a.dtype) == "bfloat16"):
            raise InvalidArgument(f"push: {name!r} is {a.dtype}, the plan says {s.dtype}")
        if not a.flags.c_contiguous:
            raise InvalidArgument(f"push: {name!r} must be C-contiguous")
        return x, a.view(want).reshape(s.local_shape[0], s.width)

    # -------------------------------------------------------------- push

    @observed_call("weights", "push", lambda self: self.engine)
    async def push(
        self, tensors: Mapping[str, Any], *, version: int, timeout: float | None = None
    ) -> PushStats:
        """Writes this rank's part of ``version`` from ``tensors`` (name -> this rank's shard,
        NumPy or CuPy, the plan's local shape and type, C-contiguous; do not modify them
        until it returns). Returns once every receiver has every byte and its immediate.

        Raises, before anything is posted, :class:`~aiote.InvalidArgument` for a missing
        tensor, a wrong shape or type, a bad version or timeout, or a push already running.
        If some receivers fail (unreachable, a write error, ``timeout`` passed), the others
        still complete, then it raises :class:`PushFailed` naming each failed rank's error;
        those ranks got no immediate for ``version`` (over the CUDA-IPC rail, a rank whose
        posted writes then timed out gets it once their bytes landed). A write that timed out may still be in
        flight: the next push first waits for it to settle, and raises
        :class:`~aiote.TransferTimeout` (nothing posted) if it has not by its own deadline.
        Cost: ``bytes / link speed`` plus one copy (and cast) of each byte that is not written
        straight from its source."""
        imm = version_imm(self.plan.tag, version)
        end = _end(timeout)
        if self._busy:
            raise InvalidArgument("a push is already running on this sender")
        views, xp = self._check_tensors(tensors)
        self._busy = True
        try:
            await self._settle_earlier(end)
            return await self._push(views, xp, version, imm, end)
        finally:
            self._busy = False

    async def _settle_earlier(self, end: float | None) -> None:
        """Waits until the writes an earlier push gave up on (timed out) can no longer land:
        until then they may read the staging buffer and overwrite the bytes of this version."""
        while self._unsettled:
            settle = self._unsettled[0]
            with anyio.move_on_after(_left(end) if end is not None else float("inf")):
                await settle()
                self._unsettled.pop(0)
                continue
            raise TransferTimeout("writes of an earlier push that timed out are still in flight")

    async def _push(
        self, views: dict[str, Any], xp: Any, version: int, imm: int, end: float | None
    ) -> PushStats:
        t0 = time.monotonic()
        ctx = _Push(version, views, end)
        if self._lanes:
            await self._prepare(xp, views, ctx)
        lanes = len(self._lanes) or 1
        biggest = max((w.nbytes for w in self.plan.writes), default=1)
        pool = _Pool(self.max_tmp_bytes, max(biggest, self.max_tmp_bytes // lanes))
        async with anyio.create_task_group() as tg:
            for r in self._lanes:
                tg.start_soon(self._lane, r, ctx, pool, imm)
        ctx.stats.wall_s = time.monotonic() - t0
        ctx.stats.peak_staging_bytes = pool.peak
        if ctx.errors:
            done = tuple(r for r in sorted(self._lanes) if r not in ctx.errors)
            self._log.warning("push failed", version=version, failed=sorted(ctx.errors))
            raise PushFailed(version, ctx.errors, done, ctx.stats) from next(iter(ctx.errors.values()))
        self._log.debug("pushed", version=version, bytes=ctx.stats.nbytes, wall_s=ctx.stats.wall_s)
        return ctx.stats

    async def _prepare(self, xp: Any, views: dict[str, Any], ctx: _Push) -> None:
        """The staging buffer for ``xp``; with ``register_sources``, the allocations the plain
        sources are views of, registered (kept while passed again), in ``ctx.direct``."""
        if self._xp is not xp:
            if self._staging_mr is not None:
                await self.engine.unregister(self._staging_mr, timeout=30)
                self._staging_mr = None
            self._staging = xp.zeros(self.max_tmp_bytes, xp.uint8)
            self._staging_mr = await self.engine.register(
                self._staging, remote_write=False, remote_read=False
            )
            self._xp = xp
        if not self.register_sources:
            if self._direct_seen:  # (turned off since the last push: no direct source now)
                self._direct_seen = {}
            return
        keep: dict[tuple[int, int], tuple[Any, MemoryRegion]] = {}
        for name in self._direct_names() if xp is np else self._plain_names:
            v = views[name]
            known = self._roots.get(name)
            if known is not None and known[0] is v and (known[1] in keep or known[1] in self._registered):
                key, at = known[1], known[2]
                keep[key] = keep.get(key) or self._registered.pop(key)
            else:
                root, at = _root(xp, v)
                key = (_ptr(root), int(root.nbytes))
                kept = keep.get(key) or self._registered.pop(key, None)
                if kept is None:
                    kept = (root, await self.engine.register(root, remote_write=False, remote_read=False))
                keep[key] = kept
                self._roots[name] = (v, key, at)
            ctx.direct[name] = (key, at)
        if ctx.direct != self._direct_seen:  # the merges of _runs change with it
            self._direct_seen = dict(ctx.direct)
        for _, mr in self._registered.values():  # allocations no longer passed
            await self.engine.unregister(mr, timeout=30)
        self._registered = keep

    def _plain(self, w: Write) -> bool:
        s = self._sources[w.source]
        return w.src_dtype == w.dst_dtype and w.col0 == 0 and w.col1 == s.width

    async def _lane(self, r: int, ctx: _Push, pool: _Pool, imm: int) -> None:
        early: Transfer | None = None
        try:
            async with anyio.create_task_group() as tg:
                for run in self._runs(r, ctx, pool):
                    if r in ctx.errors:
                        break
                    try:
                        await self._issue(tg, r, run, ctx, pool)
                    except AioteError as exc:  # caught here: out of the group it comes wrapped
                        ctx.errors.setdefault(r, exc)
                try:
                    if r not in ctx.errors and self._imm_follows(r, ctx):
                        # every write posted, each over the CUDA-IPC rail: the rail credits
                        # the immediate after their bytes, so it goes now, behind them
                        early = self.engine.post_write_imm(self._imm_desc(r), imm, retry=_ONCE)
                        ctx.stats.imms_behind_writes += 1
                except AioteError as exc:  # (raised in the group's body it would come wrapped)
                    ctx.errors.setdefault(r, exc)
            t = time.monotonic()
            if early is not None:
                await self._await_posted(early, ctx)
            elif r not in ctx.errors:
                await self.engine.write_imm(self._imm_desc(r), imm, timeout=_left(ctx.end), retry=_ONCE)
            else:
                return
            ctx.stats.notify_s += time.monotonic() - t
        except AioteError as exc:
            ctx.errors.setdefault(r, exc)

    def _imm_follows(self, r: int, ctx: _Push) -> bool:
        """Whether receiver ``r``'s immediate may go right behind its writes: GPU tensors and
        staging on one device, and every region of ``r`` one the engine's CUDA-IPC rail
        credits after its writes."""
        if self._xp is np:
            return False
        if ctx.devices is None:
            ctx.devices = {int(v.device.id) for v in ctx.tensors.values()} | {int(self._staging.device.id)}
        if len(ctx.devices) != 1:
            return False
        return all(self.engine.imm_follows_writes(self._descs[d]) for d in self._lane_descs[r])

    def _imm_desc(self, r: int) -> MemoryDescriptor:
        return self._first_desc[r]

    def _src(self, w: Write, ctx: _Push) -> tuple[tuple[int, int], int] | None:
        """Where a direct write reads: (its allocation's key, byte offset), or None (staged)."""
        d = ctx.direct.get(w.source) if self._plain(w) else None
        if d is None:
            return None
        s = self._sources[w.source]
        return d[0], d[1] + w.row0 * s.width * self._itemsize(w.src_dtype)

    def _sliceable(self, w: Write) -> bool:
        """Whether ``w`` is an uncast column slice of one byte or more to a region this engine
        reaches by same-host direct copies (then, from a registered NumPy source, one strided
        copy). The route is asked once per region."""
        if w.src_dtype != w.dst_dtype or w.nbytes == 0 or self._plain(w):
            return False
        direct = self._desc_direct.get(w.desc)
        if direct is None:
            direct = self._desc_direct[w.desc] = self.engine.route(self._descs[w.desc]).direct
        return direct

    def _direct_names(self) -> list[str]:
        """The NumPy sources to register: those of plain writes and of sliceable ones."""
        if self._slice_names is None:
            sliced = {w.source for w in self.plan.writes if self._sliceable(w)}
            self._slice_names = sorted(set(self._plain_names) | sliced)
        return self._slice_names

    def _strided(self, w: Write, ctx: _Push) -> tuple[tuple[int, int], int, int] | None:
        """Where a sliceable write (:meth:`_sliceable`) of a NumPy source reads: (its
        allocation's key, byte offset of its first row piece, row pitch in bytes); else None
        (staged, or a plain write: see _src)."""
        if self._xp is not np or not self._sliceable(w):
            return None
        d = ctx.direct.get(w.source)
        if d is None:
            return None
        s = self._sources[w.source]
        size = self._itemsize(w.src_dtype)
        return d[0], d[1] + (w.row0 * s.width + w.col0) * size, s.width * size

    def _runs(self, r: int, ctx: _Push, pool: _Pool) -> list[list[Write]]:
        """Receiver ``r``'s writes, direct ones merged: taken in the order of what they read
        (allocation, offset), consecutive ones go as one write where they read adjacent bytes
        of one registered allocation and land on adjacent bytes of one region (at most
        ``coalesce_bytes`` and a quarter of the lane's budget a merge: a merge as large as the
        budget would wait for the one before it). Runs in plan order of their first write;
        staged writes stay one each. Kept per receiver while the registered sources and the
        cap stay the same (the next push of the same tensors reuses them)."""
        cap = min(self.coalesce_bytes, pool.lane_cap // 4)  # several in flight, not one at a time
        kept = self._run_cache.get(r)
        if kept is not None and kept[0] == cap and kept[1] is self._direct_seen:
            return kept[2]
        out = _merge_runs([(i, w, self._src(w, ctx)) for i, w in enumerate(self._lanes[r])], cap)
        self._run_cache[r] = (cap, self._direct_seen, out)
        return out

    async def _issue(self, tg: Any, r: int, run: list[Write], ctx: _Push, pool: _Pool) -> None:
        st = ctx.stats
        w = run[0]
        n = sum(x.nbytes for x in run)
        src = self._src(w, ctx)
        strided = self._strided(w, ctx) if src is None else None
        t = time.monotonic()
        off = await pool.take(r, n, src is None and strided is None, ctx.end)
        st.staging_wait_s += time.monotonic() - t
        desc = self._descs[w.desc]
        job: Transfer | Callable[..., Awaitable[None]]
        if strided is not None:  # the rows' pieces, one strided copy (see _strided)
            st.direct_bytes += n
            st.strided_bytes += n
            rows = np.arange(w.row1 - w.row0)
            job = partial(
                self.engine.write_paged, self._registered[strided[0]][1], desc,
                page_size=(w.col1 - w.col0) * self._itemsize(w.src_dtype), src_pages=rows, dst_pages=rows,
                src_stride=strided[2], src_offset=strided[1], dst_offset=w.offset, retry=self._retry,
            )
            tg.start_soon(self._write, r, job, n, off, time.monotonic(), ctx, pool)
            return
        if src is not None:
            mr, src_off = self._registered[src[0]][1], src[1]
            st.direct_bytes += n
        else:  # a staged write is never merged: run == [w]
            t = time.monotonic()
            if self._xp is np and w.nbytes >= _THREAD_COPY:  # NumPy copies release the GIL:
                # off the loop's thread, so completions go on and the lanes copy in parallel
                await self._copy_in_threads(w, ctx.tensors[w.source], off)
            else:
                self._transform(w, ctx.tensors[w.source], off)
            st.transform_s += time.monotonic() - t
            assert self._staging_mr is not None
            mr, src_off = self._staging_mr, off
        t = time.monotonic()
        if self._xp is np:  # awaited as one engine.write: its stall and gone-peer checks
            job = partial(
                self.engine.write, mr, desc, length=n, src_offset=src_off, dst_offset=w.offset,
                retry=self._retry,
            )
        else:  # on the stream now, so that the lane knows when its last write is posted. Should
            # the call fail, the room stays taken (a copy it enqueued may still read the staging)
            job = self.engine.post_write(
                mr, desc, length=n, src_offset=src_off, dst_offset=w.offset, retry=self._retry,
                stream=self._xp.cuda.get_current_stream(),
            )
        tg.start_soon(self._write, r, job, n, off, t, ctx, pool)

    @staticmethod
    def _itemsize(dtype: str) -> int:
        return int(storage(dtype).itemsize)

    def _transform(self, w: Write, src: Any, off: int, part: tuple[int, int] | None = None) -> None:
        """Copies (and casts) ``w``'s rows and columns of ``src`` into the staging pool at
        ``off``; ``part``: only rows ``[a, b)`` of the write."""
        xp = self._xp
        rows, cols = w.row1 - w.row0, w.col1 - w.col0
        out = self._staging[off : off + w.nbytes].view(storage(w.dst_dtype)).reshape(rows, cols)
        a, b = part or (0, rows)
        cast_into(xp, out[a:b], src[w.row0 + a : w.row0 + b, w.col0 : w.col1], w.src_dtype, w.dst_dtype)

    async def _copy_in_threads(self, w: Write, src: Any, off: int) -> None:
        """:meth:`_transform` in worker threads: up to ``_COPY_THREADS`` at once, each a block
        of rows of at least ``_THREAD_COPY`` bytes. Raises the first part's error."""
        rows = w.row1 - w.row0
        k = max(1, min(_COPY_THREADS, rows, w.nbytes // _THREAD_COPY))
        cuts = [rows * i // k for i in range(k + 1)]
        errors: list[BaseException] = []

        async def part(a: int, b: int) -> None:
            try:
                await anyio.to_thread.run_sync(self._transform, w, src, off, (a, b))
            except Exception as exc:  # raised as itself below, not wrapped in a group
                errors.append(exc)

        async with anyio.create_task_group() as g:
            for a, b in itertools.pairwise(cuts):
                g.start_soon(part, a, b)
        if errors:
            raise errors[0]

    async def _write(
        self,
        r: int,
        job: Transfer | Callable[..., Awaitable[None]],
        n: int,
        off: int,
        t: float,
        ctx: _Push,
        pool: _Pool,
    ) -> None:
        """One write of ``n`` bytes to receiver ``r`` (from ``t``): ``job`` a GPU write posted
        already, or the host write to await (``job(timeout=...)``). Then gives its staging room
        back, unless the write may still read it (timed out, or cancelled while going); the next
        push first waits for such a write to settle (see :meth:`_settle_earlier`)."""
        st = ctx.stats
        going = False
        try:
            if isinstance(job, Transfer):
                await self._await_posted(job, ctx)
            elif r in ctx.errors:
                return
            else:
                try:
                    await job(timeout=_left(ctx.end))
                except TransferTimeout as exc:
                    self._unsettled.append(exc.settled)
                    raise
            st.writes += 1
            st.bytes_by_receiver[r] = st.bytes_by_receiver.get(r, 0) + n
        except AioteError as exc:
            ctx.errors.setdefault(r, exc)
            going = isinstance(exc, TransferTimeout)
        finally:
            st.write_s += time.monotonic() - t
            still = going or (isinstance(job, Transfer) and not job.done)
            pool.give(r, -1 if still else off, n)

    async def _await_posted(self, posted: Transfer, ctx: _Push) -> None:
        """Awaits a posted write (or immediate) until the push's deadline; raises its error.
        One that timed out (or stalled), or was still going when the push was cancelled, is
        kept for the next push to wait for first (see :meth:`_settle_earlier`)."""
        try:
            await posted.wait(timeout=_left(ctx.end))
        except BaseException as exc:
            if not posted.done or isinstance(exc, TransferTimeout):
                self._unsettled.append(partial(_settled, posted))
            raise


def _merge_runs(
    lane: list[tuple[int, Write, tuple[tuple[int, int], int] | None]], cap: int
) -> list[list[Write]]:
    """A lane's writes ``(plan index, write, where it reads or None)`` as runs: direct ones
    taken in the order of what they read, consecutive ones merged where they read adjacent
    bytes of one allocation and land on adjacent bytes of one region (at most ``cap`` bytes a
    run); the others one each. Runs in plan order of their first write."""
    direct: list[tuple[tuple[int, int], int, int, Write]] = []
    runs: list[tuple[int, list[Write]]] = []
    for i, w, src in lane:
        if src is None:
            runs.append((i, [w]))
        else:
            direct.append((src[0], src[1], i, w))
    direct.sort(key=lambda d: (d[0], d[1]))
    end: tuple[tuple[int, int], int] | None = None
    size = 0
    for key, at, i, w in direct:
        last = runs[-1][1][-1] if end is not None else None
        if (
            last is not None
            and end == (key, at)
            and last.desc == w.desc
            and last.offset + last.nbytes == w.offset
            and size + w.nbytes <= cap
        ):
            runs[-1][1].append(w)
            runs[-1] = (min(runs[-1][0], i), runs[-1][1])
            size += w.nbytes
        else:
            runs.append((i, [w]))
            size = w.nbytes
        end = (key, at + w.nbytes)
    runs.sort(key=lambda x: x[0])
    return [run for _, run in runs]


async def _settled(posted: Transfer) -> None:
    """Returns once ``posted`` can no longer land (done, or a stalled one let go of)."""
    try:
        await posted.wait()
    except TransferTimeout as exc:  # a stall ended it: its requests may be in the transport
        await exc.settled()
    except AioteError:
        pass


def _ptr(a: Any) -> int:
    """The address of an array's first byte (NumPy or CuPy)."""
    p = getattr(getattr(a, "data", None), "ptr", None)  # CuPy, without building a dict
    if p is not None:
        return int(p)
    if hasattr(a, "__array_interface__"):
        return int(a.__array_interface__["data"][0])
    return int(a.__cuda_array_interface__["data"][0])


def _root(xp: Any, a: Any) -> tuple[Any, int]:
    """The allocation ``a`` is a view of, as a flat byte array, and ``a``'s byte offset in
    it: the last array of ``a``'s ``.base`` chain when that one is C-contiguous and holds
    ``a``'s bytes, else ``a`` itself (offset 0). Registering the allocation once lets writes
    from tensors laid out one after another in it (a trainer's flat parameter buffer) merge."""
    root = a
    while isinstance(getattr(root, "base", None), xp.ndarray):
        root = root.base
    if root is not a and root.flags.c_contiguous:
        at = _ptr(a) - _ptr(root)
        if at >= 0 and at + a.nbytes <= root.nbytes:
            return root.reshape(-1).view(xp.uint8), at
    return a.reshape(-1).view(xp.uint8), 0
