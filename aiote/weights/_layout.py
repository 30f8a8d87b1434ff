"""Helpers that build plan metadata for the usual shardings: dim-0 row splits (FSDP, tensor
parallel), fused targets (q, k, v -> qkv; gate, up -> gate_up), and packing an inference
rank's targets into one registered region. Pure functions on plain data."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ._dtypes import itemsize
from ._plan import Piece, PlanError, SourceShard, TargetShard

__all__ = ["fused_tp", "pack_targets", "split_rows", "with_desc"]


def split_rows(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``(start, stop)`` of part ``index`` of ``n`` rows cut into ``parts`` nearly equal
    parts (the first ``n % parts`` parts one row longer). O(1); raises :class:`PlanError` for
    ``parts < 1`` or ``index`` out of range."""
    if parts < 1 or not 0 <= index < parts or n < 0:
        raise PlanError(f"split_rows: part {index} of {parts} of {n} rows")
    q, r = divmod(n, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def fused_tp(parts: Sequence[tuple[str, int]], tp_rank: int, tp_size: int) -> tuple[Piece, ...]:
    """The pieces of a column-parallel fused parameter on tensor-parallel rank ``tp_rank``:
    for each ``(source name, rows)`` of ``parts`` in order (e.g. q, k, v), that source's
    ``tp_rank``-th row block, as vLLM's ``QKVParallelLinear`` lays it out. Raises
    :class:`PlanError` for a bad rank. O(parts)."""
    return tuple(Piece(name, split_rows(rows, tp_size, tp_rank)) for name, rows in parts)


def pack_targets(
    rank: int,
    specs: Iterable[tuple[str, str, Sequence[Piece]]],
    sources: Sequence[SourceShard],
    *,
    align: int = 256,
    offset: int = 0,
) -> tuple[list[TargetShard], int]:
    """Lays out inference ``rank``'s targets, given as ``(name, dtype, pieces)``, one after the
    other in one region from ``offset``, each ``align``-byte aligned; returns them (with an
    empty descriptor: see :func:`with_desc`) and the region size needed. Row widths come
    from ``sources`` (any shard of each parameter). Raises :class:`PlanError` for a piece of
    an unknown parameter. O(pieces)."""
    widths = {s.name: s.width for s in sources}
    out: list[TargetShard] = []
    pos = offset
    for name, dtype, pieces in specs:
        pos = -(-pos // align) * align
        t = TargetShard(name, rank, dtype, tuple(pieces), b"", pos)
        size = 0
        for p in t.pieces:
            if p.source not in widths:
                raise PlanError(f"target {name!r}: no source parameter {p.source!r}")
            c0, c1 = p.cols if p.cols is not None else (0, widths[p.source])
            size += (p.rows[1] - p.rows[0]) * (c1 - c0) * itemsize(dtype)
        out.append(t)
        pos += size
    return out, pos


def with_desc(targets: Iterable[TargetShard], desc: bytes) -> list[TargetShard]:
    """The same targets, in the region whose descriptor bytes are ``desc``. O(targets)."""
    return [dataclasses.replace(t, desc=bytes(desc)) for t in targets]
