"""NumPy reference of MoE dispatch and combine: every rank's inputs in one process, outputs
exactly as FLOWS.md B4 defines them (the tests compare the real flow against it).

Written for clarity, independently of the flow's own layout code: one ``np.nonzero`` per
(source, expert).

Dispatch, on rank ``d``, local expert ``l`` (global ``e = d * ceil(E / W) + l``):

- ``counts[l]`` = number of (source ``r``, token ``t < bound_m[r]``, slot ``k``) with
  ``indices_r[t, k] == e`` (``-1`` slots are skipped);
- expert block ``l`` starts at row ``offsets[l] = sum_{j < l} round_up(counts[j], pad)``;
- its rows are ``x_r[t]`` in canonical order: source rank ascending, then token ascending;
  ``src_rank``/``src_token`` name each row's source (-1 for padding rows, whose contents are
  undefined).

Combine, on source ``r``: ``out[t] = (out[t] if accumulate else 0) + sum_k w[t, k] * y[row(r, t,
k)]``, the sum accumulated in float32 in slot order (skipped slots add nothing), the result
rounded once to the output type. With ``accumulate`` the previous ``out`` (as float32) is added
to the finished sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dtypes import DType, dtype_of, from_f32, to_f32

__all__ = ["RefDispatch", "reference_combine", "reference_dispatch"]


@dataclass
class RefDispatch:
    """The reference dispatch output of one rank: ``expert_x[rows, H]``, ``counts[L]``,
    ``offsets[L + 1]``, ``src_rank[rows]``, ``src_token[rows]`` (-1 on padding rows), and
    ``expert_x_scale`` (the rows' block scales, when given)."""

    expert_x: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray
    src_rank: np.ndarray
    src_token: np.ndarray
    expert_x_scale: np.ndarray | None = None


def _per_rank(num_experts: int, world: int) -> int:
    return -(-num_experts // world)


def reference_dispatch(
    xs: list[np.ndarray],
    indices: list[np.ndarray],
    num_experts: int,
    expert_padding: int = 1,
    bound_m: list[int] | None = None,
    x_scales: list[np.ndarray] | None = None,
) -> list[RefDispatch]:
    """Dispatch for all ranks at once: ``xs[r]`` (``[T_r, H]``, any dtype: rows are copied as
    they are) and ``indices[r]`` (``[T_r, K]``, -1 = skip) of every rank ``r``; returns each
    rank's :class:`RefDispatch`. ``x_scales[r]``: block scales that travel with the rows (float8
    with scales). Padding rows are zero here. Costs O(W E T K) comparisons."""
    world = len(xs)
    per = _per_rank(num_experts, world)
    bounds = bound_m if bound_m is not None else [len(i) for i in indices]
    out: list[RefDispatch] = []
    for d in range(world):
        experts = range(min(d * per, num_experts), min((d + 1) * per, num_experts))
        rows: list[np.ndarray] = []
        ranks: list[np.ndarray] = []
        toks: list[np.ndarray] = []
        counts: list[int] = []
        for e in experts:
            n_e = 0
            for r in range(world):
                hit_t, _ = np.nonzero(indices[r][: bounds[r]] == e)  # ascending tokens
                rows.append(xs[r][hit_t])
                ranks.append(np.full(len(hit_t), r, dtype=np.int32))
                toks.append(hit_t.astype(np.int32))
                n_e += len(hit_t)
            pad = (-n_e) % expert_padding
            rows.append(np.zeros((pad, *xs[0].shape[1:]), dtype=xs[0].dtype))
            ranks.append(np.full(pad, -1, dtype=np.int32))
            toks.append(np.full(pad, -1, dtype=np.int32))
            counts.append(n_e)
        padded = [c + (-c) % expert_padding for c in counts]
        offsets = np.concatenate([[0], np.cumsum(padded, dtype=np.int64)]).astype(np.int64)
        empty = np.zeros((0, *xs[0].shape[1:]), dtype=xs[0].dtype)
        scale = None
        if x_scales is not None:
            rr = np.concatenate(ranks) if ranks else np.zeros(0, np.int32)
            tt = np.concatenate(toks) if toks else np.zeros(0, np.int32)
            scale = np.zeros((len(rr), x_scales[0].shape[1]), np.float32)
            for i, (r, t) in enumerate(zip(rr, tt, strict=True)):
                if r >= 0:
                    scale[i] = x_scales[r][t]
        out.append(
            RefDispatch(
                expert_x=np.concatenate(rows) if rows else empty,
                counts=np.asarray(counts, dtype=np.int32),
                offsets=offsets,
                src_rank=np.concatenate(ranks) if ranks else np.zeros(0, np.int32),
                src_token=np.concatenate(toks) if toks else np.zeros(0, np.int32),
                expert_x_scale=scale,
            )
        )
    return out


def reference_combine(
    dispatched: list[RefDispatch],
    expert_out: list[np.ndarray],
    indices: list[np.ndarray],
    weights: list[np.ndarray],
    num_experts: int,
    out_dtype: Any = "float32",
    bound_m: list[int] | None = None,
    out: list[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Combine for all ranks at once: ``expert_out[d]`` holds rank ``d``'s expert outputs in
    the rows of ``dispatched[d]`` (type ``out_dtype``; bfloat16 as uint16 bits); returns each
    source rank's ``[bound_m, H]`` result. ``out``: previous outputs to accumulate into (as
    ``accumulate=True``). O(W T K H)."""
    dt: DType = dtype_of(out_dtype, "out_dtype")
    world = len(dispatched)
    per = _per_rank(num_experts, world)
    bounds = bound_m if bound_m is not None else [len(i) for i in indices]
    row_of: dict[tuple[int, int, int], tuple[int, int]] = {}  # (src, token, expert) -> (d, row)
    for d, ref in enumerate(dispatched):
        for j in range(len(ref.counts)):
            for row in range(int(ref.offsets[j]), int(ref.offsets[j] + ref.counts[j])):
                row_of[(int(ref.src_rank[row]), int(ref.src_token[row]), d * per + j)] = (d, row)
    results: list[np.ndarray] = []
    for r in range(world):
        m = bounds[r]
        idx = indices[r][:m]
        hidden = expert_out[0].shape[1] if expert_out else 0
        acc = np.zeros((m, hidden), dtype=np.float32)
        for k in range(idx.shape[1]):
            y = np.zeros((m, hidden), dtype=np.float32)
            valid = np.zeros(m, dtype=bool)
            for t in range(m):
                e = int(idx[t, k])
                if e < 0:
                    continue
                d, row = row_of[(r, t, e)]
                y[t] = to_f32(expert_out[d][row : row + 1], dt)[0]
                valid[t] = True
            w = weights[r][:m, k].astype(np.float32)
            acc = acc + np.where(valid[:, None], w[:, None] * y, np.float32(0))
        if out is not None:
            acc = to_f32(out[r][:m], dt) + acc
        results.append(from_f32(acc, dt))
    return results
