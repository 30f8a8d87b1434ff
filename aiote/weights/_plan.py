"""Planning of a weight update, sans I/O: which trainer rank writes which bytes to which
inference rank. Pure functions on plain data (frozen dataclasses and named tuples of ints and
strings), so a controller can compute a plan, pickle it or turn it into JSON, and ship each
rank its part."""

from __future__ import annotations

import bisect
import itertools
import json
import math
import operator
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._core._errors import InvalidArgument
from ._dtypes import cast_supported, check_dtype, itemsize

__all__ = [
    "Piece",
    "PlanError",
    "PlanReport",
    "ReceiverPlan",
    "SenderPlan",
    "SourceShard",
    "TargetShard",
    "Task",
    "WeightPlan",
    "Write",
    "plan",
]

DEFAULT_TAG = 0xA7
DEFAULT_CHUNK = 16 << 20


class PlanError(InvalidArgument):
    """A plan cannot be made or is wrong: a target byte that no source holds, shapes that
    disagree, an unsupported cast, overlapping targets, a task that does not fit. Raised
    before anything is posted (it is an :class:`aiote.InvalidArgument`)."""


def _rows(v: Any, what: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in v)
    except (TypeError, ValueError):
        raise PlanError(f"{what}: rows must be a pair (start, stop), not {v!r}") from None
    if not 0 <= a <= b:
        raise PlanError(f"{what}: rows {v!r} must satisfy 0 <= start <= stop")
    return a, b


@dataclass(frozen=True)
class SourceShard:
    """What one trainer rank holds of one parameter: rows ``rows = (start, stop)`` of dim 0 of
    the parameter of global ``shape`` and element type ``dtype`` (e.g. an FSDP dim-0 shard, or
    the whole parameter after ``full_tensor()``: several ranks may hold the same rows, and
    the planner picks one). Its tensor at push time has shape ``(stop - start, *shape[1:])``.
    Plain data; raises :class:`PlanError` when built with bad fields."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    rank: int
    rows: tuple[int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        object.__setattr__(self, "rows", _rows(self.rows, f"source {self.name!r} of rank {self.rank}"))
        check_dtype(self.dtype, f"source {self.name!r}")
        if not self.shape or any(x < 0 for x in self.shape) or self.rows[1] > self.shape[0]:
            raise PlanError(
                f"source {self.name!r} of rank {self.rank}: rows {self.rows} outside shape {self.shape}"
            )

    @property
    def width(self) -> int:
        """Elements per row (the product of ``shape[1:]``)."""
        return math.prod(self.shape[1:])

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this rank passes to :meth:`WeightSender.push`."""
        return (self.rows[1] - self.rows[0], *self.shape[1:])


@dataclass(frozen=True)
class Piece:
    """One part of a target shard: rows ``rows`` of source parameter ``source``, and of each
    row the elements ``cols = (start, stop)`` of its flattened trailing dims (None: all), in
    row-major order. A fused target (q, k, v -> qkv) is several pieces one after the other."""

    source: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", _rows(self.rows, f"piece of {self.source!r}"))
        if self.cols is not None:
            object.__setattr__(self, "cols", _rows(self.cols, f"piece of {self.source!r} (cols)"))


@dataclass(frozen=True)
class TargetShard:
    """What one inference rank holds of one (possibly fused) parameter: the ``pieces`` laid
    out one after the other from byte ``offset`` of the registered region whose descriptor is
    ``desc`` (``bytes(mr.descriptor)``; empty for a plan that is only computed), in element
    type ``dtype`` (a cast from the source's type if they differ)."""

    name: str
    rank: int
    dtype: str
    pieces: tuple[Piece, ...]
    desc: bytes = b""
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "pieces", tuple(self.pieces))
        check_dtype(self.dtype, f"target {self.name!r}")
        if int(self.offset) < 0 or not self.pieces:
            raise PlanError(f"target {self.name!r} of rank {self.rank}: needs pieces and an offset >= 0")


class Task(NamedTuple):
    """One contiguous write of a plan: source rank ``src`` writes rows ``row0:row1`` of piece
    ``piece`` of target ``target`` (an index into ``WeightPlan.targets``), ``nbytes`` bytes at
    byte ``offset`` of the target's region, on inference rank ``dst``."""

    src: int
    dst: int
    target: int
    piece: int
    row0: int
    row1: int
    offset: int
    nbytes: int


class Write(NamedTuple):
    """A sender's view of one task: rows ``row0:row1`` (local to its shard of ``source``),
    elements ``col0:col1`` of each row, cast from ``src_dtype`` to ``dst_dtype``, ``nbytes``
    written at ``offset`` of region ``descs[desc]`` on inference rank ``dst``."""

    dst: int
    desc: int
    offset: int
    nbytes: int
    source: str
    row0: int
    row1: int
    col0: int
    col1: int
    src_dtype: str
    dst_dtype: str


def _enc(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return {"hex": obj.hex()}
    if isinstance(obj, (list, tuple)):
        return [_enc(x) for x in obj]
    return obj


def _dec_bytes(v: Any) -> bytes:
    return bytes.fromhex(v["hex"]) if isinstance(v, dict) else bytes(v)


def _source_from(d: Sequence[Any]) -> SourceShard:
    return SourceShard(d[0], tuple(d[1]), d[2], d[3], (d[4][0], d[4][1]))


def _target_from(d: Sequence[Any]) -> TargetShard:
    pieces = tuple(
        Piece(p[0], (p[1][0], p[1][1]), None if p[2] is None else (p[2][0], p[2][1])) for p in d[3]
    )
    return TargetShard(d[0], d[1], d[2], pieces, _dec_bytes(d[4]), d[5])


def _source_row(s: SourceShard) -> list[Any]:
    return [s.name, list(s.shape), s.dtype, s.rank, list(s.rows)]


def _target_row(t: TargetShard) -> list[Any]:
    pieces = [[p.source, list(p.rows), None if p.cols is None else list(p.cols)] for p in t.pieces]
    return [t.name, t.rank, t.dtype, pieces, _enc(t.desc), t.offset]


@dataclass(frozen=True)
class SenderPlan:
    """Trainer rank ``rank``'s part of a plan: the shards it must pass to ``push``
    (``sources``), the regions it writes (``descs``), and its writes in order (receivers
    interleaved). Plain data: picklable, :meth:`to_json`/:meth:`from_json`."""

    rank: int
    tag: int
    sources: tuple[SourceShard, ...]
    descs: tuple[bytes, ...]
    writes: tuple[Write, ...]

    @property
    def receivers(self) -> tuple[int, ...]:
        """The inference ranks this rank writes to, ascending."""
        return tuple(sorted({w.dst for w in self.writes}))

    @property
    def nbytes(self) -> int:
        """Bytes this rank writes per version."""
        return sum(w.nbytes for w in self.writes)

    def to_json(self) -> str:
        """This part as a JSON string (descriptors in hex). O(writes)."""
        return json.dumps(
            {
                "rank": self.rank,
                "tag": self.tag,
                "sources": [_source_row(s) for s in self.sources],
                "descs": [d.hex() for d in self.descs],
                "writes": [list(w) for w in self.writes],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> SenderPlan:
        """The part :meth:`to_json` wrote. Raises :class:`PlanError` for malformed text."""
        try:
            d = json.loads(text)
            return cls(
                d["rank"],
                d["tag"],
                tuple(_source_from(s) for s in d["sources"]),
                tuple(bytes.fromhex(x) for x in d["descs"]),
                tuple(Write(*w) for w in d["writes"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"not a sender plan: {e}") from None


@dataclass(frozen=True)
class ReceiverPlan:
    """Inference rank ``rank``'s part of a plan: which trainer ranks write to it (each sends
    one immediate per version once its bytes are in place), how many bytes land per version,
    and its target shards. Plain data, JSON as :class:`SenderPlan`."""

    rank: int
    tag: int
    senders: tuple[int, ...]
    nbytes: int
    targets: tuple[TargetShard, ...]

    def to_json(self) -> str:
        """This part as a JSON string. O(targets)."""
        return json.dumps(
            {
                "rank": self.rank,
                "tag": self.tag,
                "senders": list(self.senders),
                "nbytes": self.nbytes,
                "targets": [_target_row(t) for t in self.targets],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ReceiverPlan:
        """The part :meth:`to_json` wrote. Raises :class:`PlanError` for malformed text."""
        try:
            d = json.loads(text)
            return cls(
                d["rank"],
                d["tag"],
                tuple(d["senders"]),
                d["nbytes"],
                tuple(_target_from(t) for t in d["targets"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PlanError(f"not a receiver plan: {e}") from None


def _fmt(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class PlanReport:
    """What :meth:`WeightPlan.validate` proved and measured: bytes out of each trainer rank,
    into each inference rank, and the lower bound ``max(max out/B, max in/B)`` in seconds for
    a link of ``link_bytes_per_s`` per rank (None when no link figure was given). ``str()``
    renders it as a table."""

    out_bytes: dict[int, int]
    in_bytes: dict[int, int]
    total_bytes: int
    tasks: int
    link_bytes_per_s: float | None = None
    bound_s: float | None = field(default=None)

    def __str__(self) -> str:
        lines = [f"plan: {self.tasks} writes, {_fmt(self.total_bytes)} in all"]
        lines.append(
            "  out (trainer rank: bytes): "
            + ", ".join(f"{r}: {_fmt(b)}" for r, b in sorted(self.out_bytes.items()))
        )
        lines.append(
            "  in (inference rank: bytes): "
            + ", ".join(f"{r}: {_fmt(b)}" for r, b in sorted(self.in_bytes.items()))
        )
        if self.bound_s is not None and self.link_bytes_per_s:
            out_max = max(self.out_bytes.values(), default=0)
            in_max = max(self.in_bytes.values(), default=0)
            lines.append(
                f"  bound at {self.link_bytes_per_s / 1e9:.2f} GB/s per rank: max(out {_fmt(out_max)}, "
                f"in {_fmt(in_max)}) / B = {self.bound_s:.6f} s"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class WeightPlan:
    """A static schedule: ``tasks`` over ``sources`` and ``targets``, every target byte
    written exactly once (see :meth:`validate`). ``tag`` (0-255) is the high byte of the
    immediates of this flow. Plain data: picklable, :meth:`to_json`/:meth:`from_json`."""

    sources: tuple[SourceShard, ...]
    targets: tuple[TargetShard, ...]
    tasks: tuple[Task, ...]
    tag: int = DEFAULT_TAG
    chunk_bytes: int = DEFAULT_CHUNK

    # -------------------------------------------------------------- parts

    def sender(self, rank: int) -> SenderPlan:
        """Trainer ``rank``'s part, its writes interleaved over its receivers (round robin,
        starting at a receiver that depends on the rank, so that senders do not all start on
        the same one). O(tasks). A rank with no source shard raises :class:`PlanError`."""
        mine = [s for s in self.sources if s.rank == rank]
        if not mine:
            raise PlanError(f"rank {rank} holds no source shard in this plan")
        held = {s.name: s for s in mine}
        descs: dict[bytes, int] = {}
        lanes: dict[int, list[Write]] = defaultdict(list)
        for t in self.tasks:
            if t.src != rank:
                continue
            tgt = self.targets[t.target]
            p = tgt.pieces[t.piece]
            src = held[p.source]
            c0, c1 = p.cols if p.cols is not None else (0, src.width)
            lanes[t.dst].append(
                Write(
                    t.dst,
                    descs.setdefault(tgt.desc, len(descs)),
                    t.offset,
                    t.nbytes,
                    p.source,
                    t.row0 - src.rows[0],
                    t.row1 - src.rows[0],
                    c0,
                    c1,
                    src.dtype,
                    tgt.dtype,
                )
            )
        order = sorted(lanes)
        if order:
            k = rank % len(order)
            order = order[k:] + order[:k]
        writes: list[Write] = []
        queues = [lanes[r] for r in order]
        for i in range(max((len(q) for q in queues), default=0)):
            writes += [q[i] for q in queues if i < len(q)]
        return SenderPlan(rank, self.tag, tuple(mine), tuple(descs), tuple(writes))

    def receiver(self, rank: int) -> ReceiverPlan:
        """Inference ``rank``'s part. O(tasks). A rank with no target raises :class:`PlanError`."""
        targets = tuple(t for t in self.targets if t.rank == rank)
        if not targets:
            raise PlanError(f"rank {rank} has no target shard in this plan")
        senders = sorted({t.src for t in self.tasks if t.dst == rank})
        nbytes = sum(t.nbytes for t in self.tasks if t.dst == rank)
        return ReceiverPlan(rank, self.tag, tuple(senders), nbytes, targets)

    def expected_imms(self, rank: int) -> int:
        """How many immediates inference ``rank`` receives per version: one from each trainer
        rank that writes to it (what :meth:`WeightReceiver.wait_version` waits for). O(tasks)."""
        return len({t.src for t in self.tasks if t.dst == rank})

    def assignments(self, rank: int) -> list[tuple[str, int, int, int, int, int]]:
        """Inference ``rank``'s tasks as ``(target name, piece, row0, row1, src, nbytes)``,
        sorted: what a re-plan must leave unchanged for a rank that was already there."""
        return sorted(
            (self.targets[t.target].name, t.piece, t.row0, t.row1, t.src, t.nbytes)
            for t in self.tasks
            if t.dst == rank
        )

    # -------------------------------------------------------------- checks

    def validate(self, link_bytes_per_s: float | None = None) -> PlanReport:
        """Proves the plan: every task reads rows its source rank holds and stays inside its
        target piece; the tasks of each piece cover its rows exactly once (no gap, no
        overlap), at the right byte offsets. Returns the per-rank bytes and, given a link
        figure in bytes/s per rank, the lower bound ``max(max_s out(s), max_r in(r)) / B``.
        Raises :class:`PlanError` naming the first fault. O(tasks log tasks)."""
        _check_inputs(self.sources, self.targets)
        holders = {(s.name, s.rank): s.rows for s in self.sources}
        by_piece: dict[tuple[int, int], list[Task]] = defaultdict(list)
        out: dict[int, int] = defaultdict(int)
        inn: dict[int, int] = defaultdict(int)
        for t in self.tasks:
            if not 0 <= t.target < len(self.targets) or not 0 <= t.piece < len(self.targets[t.target].pieces):
                raise PlanError(f"task {t} names no target piece")
            tgt = self.targets[t.target]
            p = tgt.pieces[t.piece]
            held = holders.get((p.source, t.src))
            if held is None or not held[0] <= t.row0 < t.row1 <= held[1]:
                raise PlanError(
                    f"task {t}: rank {t.src} does not hold rows {t.row0}:{t.row1} of {p.source!r}"
                )
            if t.dst != tgt.rank:
                raise PlanError(f"task {t}: target {tgt.name!r} is on rank {tgt.rank}, not {t.dst}")
            by_piece[(t.target, t.piece)].append(t)
            out[t.src] += t.nbytes
            inn[t.dst] += t.nbytes
        widths = {s.name: s.width for s in self.sources}
        for i, tgt in enumerate(self.targets):
            base = tgt.offset
            for j, p in enumerate(tgt.pieces):
                rb = _row_bytes(p, widths[p.source], tgt.dtype)
                pos = p.rows[0]
                for t in sorted(by_piece.get((i, j), []), key=lambda t: t.row0):
                    if t.row0 != pos:
                        what = "overlap" if t.row0 < pos else "gap"
                        raise PlanError(
                            f"target {tgt.name!r} of rank {tgt.rank}, piece {j}: {what} at row {pos}"
                        )
                    if t.offset != base + (t.row0 - p.rows[0]) * rb or t.nbytes != (t.row1 - t.row0) * rb:
                        raise PlanError(f"task {t}: wrong offset or length for its rows")
                    pos = t.row1
                if pos != p.rows[1] and rb > 0:  # (an empty piece has no bytes to write)
                    raise PlanError(
                        f"target {tgt.name!r} of rank {tgt.rank}, piece {j}: rows {pos}: not written"
                    )
                base += (p.rows[1] - p.rows[0]) * rb
        total = sum(out.values())
        bound = None
        if link_bytes_per_s:
            bound = max(max(out.values(), default=0), max(inn.values(), default=0)) / link_bytes_per_s
        return PlanReport(dict(out), dict(inn), total, len(self.tasks), link_bytes_per_s, bound)

    # -------------------------------------------------------------- plain data

    def to_json(self) -> str:
        """The plan as JSON (descriptors as hex). O(size)."""
        return json.dumps(
            {
                "tag": self.tag,
                "chunk_bytes": self.chunk_bytes,
                "sources": [_source_row(s) for s in self.sources],
                "targets": [_target_row(t) for t in self.targets],
                "tasks": [list(t) for t in self.tasks],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> WeightPlan:
        """The plan :meth:`to_json` wrote (not re-validated: call :meth:`validate`). Raises
        :class:`PlanError` for malformed text."""
        try:
            d = json.loads(text)
            return cls(
                tuple(_source_from(s) for s in d["sources"]),
                tuple(_target_from(t) for t in d["targets"]),
                tuple(Task(*t) for t in d["tasks"]),
                d["tag"],
                d["chunk_bytes"],
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PlanError(f"not a weight plan: {e}") from None


def _row_bytes(p: Piece, width: int, dtype: str) -> int:
    c0, c1 = p.cols if p.cols is not None else (0, width)
    return (c1 - c0) * itemsize(dtype)


def target_nbytes(t: TargetShard, widths: dict[str, int]) -> int:
    """Bytes of target shard ``t`` given each source parameter's row width in elements."""
    return sum((p.rows[1] - p.rows[0]) * _row_bytes(p, widths[p.source], t.dtype) for p in t.pieces)


def _check_inputs(sources: Sequence[SourceShard], targets: Sequence[TargetShard]) -> dict[str, SourceShard]:
    """One shard per parameter as reference (shape, dtype); raises PlanError for shards that
    disagree, duplicates, pieces out of range, unsupported casts, overlapping targets."""
    ref: dict[str, SourceShard] = {}
    seen: set[tuple[str, int]] = set()
    for s in sources:
        if not isinstance(s, SourceShard):
            raise PlanError(f"sources must be SourceShard, not {type(s).__name__}")
        r = ref.setdefault(s.name, s)
        if (r.shape, r.dtype) != (s.shape, s.dtype):
            raise PlanError(
                f"source {s.name!r}: rank {s.rank} says {s.shape} {s.dtype}, "
                f"rank {r.rank} says {r.shape} {r.dtype}"
            )
        if (s.name, s.rank) in seen:
            raise PlanError(f"source {s.name!r}: rank {s.rank} holds two shards of it")
        seen.add((s.name, s.rank))
    spans: dict[bytes, list[tuple[int, int, str]]] = defaultdict(list)
    names: set[tuple[str, int]] = set()
    widths = {n: s.width for n, s in ref.items()}
    for t in targets:
        if not isinstance(t, TargetShard):
            raise PlanError(f"targets must be TargetShard, not {type(t).__name__}")
        if (t.name, t.rank) in names:
            raise PlanError(f"target {t.name!r} appears twice on rank {t.rank}")
        names.add((t.name, t.rank))
        for p in t.pieces:
            if p.source not in ref:
                raise PlanError(f"target {t.name!r} of rank {t.rank}: no source holds parameter {p.source!r}")
            s = ref[p.source]
            if p.rows[1] > s.shape[0] or (p.cols is not None and p.cols[1] > s.width):
                raise PlanError(
                    f"target {t.name!r} of rank {t.rank}: piece rows {p.rows} cols {p.cols} "
                    f"outside {p.source!r} of shape {s.shape}"
                )
            if not cast_supported(s.dtype, t.dtype):
                raise PlanError(
                    f"target {t.name!r}: cast {s.dtype} -> {t.dtype} of {p.source!r} is not supported"
                )
        if t.desc:
            spans[t.desc].append((t.offset, t.offset + target_nbytes(t, widths), t.name))
    for desc_spans in spans.values():
        desc_spans.sort()
        for (_, e0, n0), (b1, _, n1) in itertools.pairwise(desc_spans):
            if b1 < e0:
                raise PlanError(f"targets {n0!r} and {n1!r} overlap in one region")
    return ref


def plan(
    sources: Iterable[SourceShard],
    targets: Iterable[TargetShard],
    *,
    chunk_bytes: int = DEFAULT_CHUNK,
    tag: int = DEFAULT_TAG,
    previous: WeightPlan | None = None,
) -> WeightPlan:
    """Computes a static schedule writing every target byte exactly once.

    Each target piece is cut where its source shards begin or end and into chunks of at most
    ``chunk_bytes`` (one row at least); each chunk goes to the rank that holds its rows and
    has the fewest bytes assigned so far, largest chunks first (so ranks holding the same
    rows share the work). With ``previous``, every target that it already had (same name,
    rank, type, pieces, region and offset) keeps its tasks unchanged, and only the others are
    planned, on top of the bytes already assigned: an inference rank joining between
    versions changes nothing for the others.

    Pure and deterministic. Raises :class:`PlanError` (an :class:`aiote.InvalidArgument`)
    for a target byte no source holds, shards that disagree on a parameter's shape or type,
    an unsupported cast, overlapping targets, a bad ``chunk_bytes`` or ``tag``. Costs
    O(chunks x holders) plus a sort of the chunks.
    """
    sources = tuple(sources)
    targets = tuple(targets)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be an int >= 1, not {chunk_bytes!r}")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 256:
        raise PlanError(f"tag must be an int in [0, 256), not {tag!r}")
    ref = _check_inputs(sources, targets)
    ranks = sorted({s.rank for s in sources})
    index = {r: i for i, r in enumerate(ranks)}
    holders = _holders(sources, index)
    load = [0] * len(ranks)  # bytes assigned so far, by rank index
    tasks: list[Task] = []
    kept = _kept(previous, targets) if previous is not None else {}
    for i, tgt in enumerate(targets if kept else ()):
        for t in kept.get((tgt.name, tgt.rank), ()):
            tasks.append(t._replace(target=i))
            if t.src in index:
                load[index[t.src]] += t.nbytes
    work = _chunks(targets, kept, {n: s.width for n, s in ref.items()}, holders, chunk_bytes)
    _assign(work, load, ranks, targets, tasks)
    return WeightPlan(sources, targets, tuple(tasks), tag, chunk_bytes)


# a chunk: bytes, target, piece, rows [r0, r1), offset in the target, holders
_Chunk = tuple[int, int, int, int, int, int, tuple[int, ...]]


def _chunks(
    targets: tuple[TargetShard, ...], kept: dict[tuple[str, int], list[Task]], widths: dict[str, int],
    holders: dict[str, _Holders], chunk_bytes: int,
) -> list[_Chunk]:
    """The chunks of every target not ``kept``, largest first (stable on ties): each piece cut
    where its holders change and into at most ``chunk_bytes`` (one row at least)."""
    work: list[_Chunk] = []
    sizes = {d: itemsize(d) for d in {t.dtype for t in targets}}
    add = work.append
    for i, tgt in enumerate(targets):
        if kept and (tgt.name, tgt.rank) in kept:
            continue
        base = tgt.offset
        isz = sizes[tgt.dtype]
        for j, p in enumerate(tgt.pieces):
            a, b = p.rows
            rb = (p.cols[1] - p.cols[0] if p.cols is not None else widths[p.source]) * isz
            if rb == 0 or b <= a:  # an empty piece (no columns or no rows): nothing to write
                continue
            step = max(1, chunk_bytes // rb)
            h = holders[p.source]
            if len(h.bounds) == 2 and h.bounds[0] <= a and b <= h.bounds[1]:
                segs = [(a, b, h.cands[0])]  # one set of holders for every row: the common case
            else:
                segs = _segments(h, p.rows, tgt, j)
            for x, y, cands in segs:
                if y - x <= step:
                    add(((y - x) * rb, i, j, x, y, base + (x - a) * rb, cands))
                    continue
                for r0 in range(x, y, step):
                    r1 = min(y, r0 + step)
                    work.append(((r1 - r0) * rb, i, j, r0, r1, base + (r0 - a) * rb, cands))
            base += (b - a) * rb
    work.sort(key=operator.itemgetter(0), reverse=True)  # largest first; stable on ties
    return work


def _assign(
    work: list[_Chunk], load: list[int], ranks: list[int], targets: tuple[TargetShard, ...], tasks: list[Task]
) -> None:
    """Appends a task per chunk to ``tasks``, each to its least-loaded holder (``load``: bytes
    by rank index, updated)."""
    new = tuple.__new__  # a Task without its Python-level __new__ (a third of the time here)
    dst = [t.rank for t in targets]
    for nbytes, i, j, r0, r1, off, cands in work:
        # the least-loaded holder, the lowest rank on a tie (cands are sorted)
        n = len(cands)
        if n == 1:
            c = cands[0]
        elif n == 2:
            c = cands[0] if load[cands[0]] <= load[cands[1]] else cands[1]
        else:
            c = min(cands, key=load.__getitem__)
        load[c] += nbytes
        tasks.append(new(Task, (ranks[c], dst[i], i, j, r0, r1, off, nbytes)))


class _Holders(NamedTuple):
    bounds: list[int]  # sorted breakpoints of the shards' rows
    cands: list[tuple[int, ...]]  # indices of the ranks holding the whole of [bounds[k], bounds[k+1])


def _holders(sources: Sequence[SourceShard], index: dict[int, int]) -> dict[str, _Holders]:
    by_name: dict[str, list[SourceShard]] = defaultdict(list)
    for s in sources:
        by_name[s.name].append(s)
    out: dict[str, _Holders] = {}
    interned: dict[tuple[int, ...], tuple[int, ...]] = {}
    for name, shards in by_name.items():
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for s in shards:
            groups[s.rows].append(index[s.rank])
        bounds = sorted({b for rows in groups for b in rows})
        at = {b: k for k, b in enumerate(bounds)}
        held: list[list[int]] = [[] for _ in range(len(bounds) - 1)]
        for (a, b), idx in groups.items():
            for k in range(at[a], at[b]):
                held[k] += idx
        cands = []
        for c in held:
            t = tuple(sorted(c))
            cands.append(interned.setdefault(t, t))
        out[name] = _Holders(bounds, cands)
    return out


def _segments(
    h: _Holders, rows: tuple[int, int], tgt: TargetShard, j: int
) -> list[tuple[int, int, tuple[int, ...]]]:
    """[x, y) sub-ranges of ``rows`` with the ranks holding each whole; PlanError on a gap."""
    a, b = rows
    if a == b:
        return []
    k = max(0, bisect.bisect_right(h.bounds, a) - 1)
    out: list[tuple[int, int, tuple[int, ...]]] = []
    pos = a
    while pos < b:
        if k >= len(h.cands) or h.bounds[k] > pos or not h.cands[k]:
            raise PlanError(
                f"target {tgt.name!r} of rank {tgt.rank}, piece {j}: row {pos} of "
                f"{tgt.pieces[j].source!r} is held by no source rank"
            )
        y = min(b, h.bounds[k + 1])
        if out and out[-1][2] is h.cands[k]:
            out[-1] = (out[-1][0], y, out[-1][2])
        else:
            out.append((pos, y, h.cands[k]))
        pos = y
        k += 1
    return out


def _kept(previous: WeightPlan, targets: Sequence[TargetShard]) -> dict[tuple[str, int], list[Task]]:
    wanted = {(t.name, t.rank): t for t in targets}
    same = {i for i, t in enumerate(previous.targets) if wanted.get((t.name, t.rank)) == t}
    kept: dict[tuple[str, int], list[Task]] = defaultdict(list)
    for t in previous.tasks:
        if t.target in same:
            tgt = previous.targets[t.target]
            kept[(tgt.name, tgt.rank)].append(t)
    return dict(kept)
