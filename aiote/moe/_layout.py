"""Host-side layout of one all-to-all call: pure NumPy over small index arrays (no engine).

Every rank sends its route row (tokens per global expert) to every rank, so after the count
exchange each rank holds the whole count matrix ``C[W, E]`` and computes the same offsets:

- source ``r`` packs its rows sorted by (expert, token); since experts are numbered rank by
  rank, the rows for destination ``d`` are one contiguous block starting at ``sstart[r, d]``;
- destination ``d``'s receive region takes the sources' blocks back to back in source order:
  source ``r``'s block lands at row ``rstart[r, d] = sum_{r' < r} N[r', d]`` (``N[r, d]``:
  rows from ``r`` to ``d``);
- unpacking moves chunk (source ``r``, local expert ``l``) to expert block ``l`` after the
  chunks of lower sources: the canonical order (source rank, then token) of FLOWS.md B4;
- combine sends rows back the same way round: ``d``'s rows from ``r`` land in ``r``'s combine
  region at ``sstart[r, d]``, i.e. in ``r``'s own send order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from .. import InvalidArgument

__all__ = ["Geometry", "RecvPlan", "SendPlan", "plan_recv", "plan_send", "round_up"]


def round_up(a: np.ndarray, pad: int) -> np.ndarray:
    """``a`` rounded up to a multiple of ``pad`` (element-wise; ``a`` itself when ``pad`` is 1).
    O(n)."""
    return a if pad == 1 else (a + (pad - 1)) // pad * pad


@dataclass(frozen=True)
class Geometry:
    """The expert placement of a group: ``world`` ranks, ``num_experts`` experts, ``per_rank``
    = ceil(E / W) experts per rank (expert ``e`` lives on rank ``e // per_rank``; the last ranks
    may hold fewer, or none)."""

    world: int
    num_experts: int

    @property
    def per_rank(self) -> int:
        """ceil(E / W). O(1)."""
        return -(-self.num_experts // self.world)

    def local_range(self, rank: int) -> tuple[int, int]:
        """The global experts ``[first, end)`` held by ``rank`` (empty when it holds none)."""
        first = min(rank * self.per_rank, self.num_experts)
        return first, min(first + self.per_rank, self.num_experts)

    def rank_sums(self, per_expert: np.ndarray) -> np.ndarray:
        """Sums the last axis (one entry per expert) per owning rank: ``[..., E] -> [..., W]``."""
        pad = self.world * self.per_rank - self.num_experts
        a = per_expert.astype(np.int64)
        if pad:  # (np.pad costs tens of microseconds; this is on every call's path)
            a = np.concatenate([a, np.zeros((*a.shape[:-1], pad), dtype=np.int64)], axis=-1)
        return cast(np.ndarray, a.reshape(*per_expert.shape[:-1], self.world, self.per_rank).sum(-1))


@dataclass
class SendPlan:
    """A source's rows: ``route[E]`` (rows per expert, int32: what it tells every rank),
    ``row_token[n]`` and ``row_k[n]`` (the token and the top-k slot of each send row, in
    (expert, token) order), ``pos[m, K]`` (the send row of each (token, slot); -1 for a skipped
    slot: what combine reads back)."""

    route: np.ndarray
    row_token: np.ndarray
    row_k: np.ndarray
    pos: np.ndarray


def plan_send(indices: np.ndarray, bound_m: int, num_experts: int) -> SendPlan:
    """The send rows of ``indices[:bound_m]`` (int, -1 = skip). Raises
    :class:`~aiote.InvalidArgument` for an expert id out of range or repeated within a token.
    O(m K log(m K))."""
    idx = np.ascontiguousarray(indices[:bound_m]).astype(np.int64, copy=False)
    m, k = idx.shape
    if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
        raise InvalidArgument(f"indices must be in [-1, {num_experts}), got [{idx.min()}, {idx.max()}]")
    if k > 1 and idx.size:
        s = np.sort(idx, axis=1)
        if np.any((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)):
            raise InvalidArgument("an expert appears twice in one token's indices")
    flat = idx.ravel()
    valid = np.flatnonzero(flat >= 0)
    order = valid[np.argsort(flat[valid], kind="stable")]  # (expert, token): flat is token-major
    pos = np.full(m * k, -1, dtype=np.int64)
    pos[order] = np.arange(order.size)
    route = np.bincount(flat[valid], minlength=num_experts).astype(np.int32)
    return SendPlan(
        route=route,
        row_token=(order // max(k, 1)).astype(np.int64),
        row_k=(order % max(k, 1)).astype(np.int64),
        pos=pos.reshape(m, k),
    )


@dataclass
class RecvPlan:
    """What one rank needs for a call, from the count matrix ``C[W, E]``.

    ``n[r, d]``: rows from ``r`` to ``d``; ``sstart[d]``: where this rank's block for ``d``
    starts in its send rows; ``dst_row[d]``: where that block lands in ``d``'s receive region;
    ``rstart[r]``/``nrecv``: where source ``r``'s block starts in this rank's receive region,
    rows received in all; ``counts[L]``: rows per local expert; ``offsets[L + 1]``: the padded
    expert blocks; ``dest[nrecv]``: the output row of each received row; ``src_rank`` of every
    output row (-1 for padding)."""

    n: np.ndarray
    sstart: np.ndarray
    dst_row: np.ndarray
    rstart: np.ndarray
    nrecv: int
    counts: np.ndarray
    offsets: np.ndarray
    dest: np.ndarray
    src_rank: np.ndarray


def plan_recv(c: np.ndarray, geo: Geometry, rank: int, pad: int, capacity: int) -> RecvPlan:
    """The plan of ``rank`` for count matrix ``c``. Raises :class:`~aiote.InvalidArgument`
    when some rank would receive more than ``capacity`` rows (every rank sees the same matrix,
    so every rank raises it, before any token is posted). O(W E + rows received)."""
    w = geo.world
    n = geo.rank_sums(c)  # [W src, W dst]
    worst = int(n.sum(0).max()) if w else 0
    if worst > capacity:
        raise InvalidArgument(
            f"rank {int(n.sum(0).argmax())} would receive {worst} rows, past max_recv_tokens={capacity}"
        )
    sstart = np.concatenate([[0], np.cumsum(n[rank])[:-1]]).astype(np.int64)
    dst_row = (np.cumsum(n, axis=0) - n)[rank].astype(np.int64)  # rows of lower sources at each d
    first, end = geo.local_range(rank)
    cd = c[:, first:end].astype(np.int64)  # [W, L]
    counts = cd.sum(0)
    offsets = np.concatenate([[0], np.cumsum(round_up(counts, pad))]).astype(np.int64)
    nrecv = int(cd.sum())
    rstart = np.concatenate([[0], np.cumsum(cd.sum(1))[:-1]]).astype(np.int64)
    recv_chunk = (np.cumsum(cd.ravel()) - cd.ravel()).reshape(cd.shape)  # r-major
    out_chunk = offsets[:-1][None, :] + (np.cumsum(cd, axis=0) - cd)
    shift = np.repeat((out_chunk - recv_chunk).ravel(), cd.ravel())
    dest = shift + np.arange(nrecv, dtype=np.int64)
    src_rank = np.full(int(offsets[-1]), -1, dtype=np.int32)
    src_rank[dest] = np.repeat(np.repeat(np.arange(w, dtype=np.int32), cd.shape[1]), cd.ravel())
    return RecvPlan(
        n=n, sstart=sstart, dst_row=dst_row, rstart=rstart, nrecv=nrecv,
        counts=counts.astype(np.int32), offsets=offsets, dest=dest, src_rank=src_rank,
    )
