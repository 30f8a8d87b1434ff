"""Small helpers of the MoE flow: immediates, argument checks, deadlines, the reduction."""

from __future__ import annotations

import json
import math
from typing import Any

import anyio
import numpy as np

from .. import InvalidArgument, TransferTimeout

# internal: the core's structured logger (not public API), so that the application's one
# configuration of the stdlib "aiote" logger covers the flow's records too
from .._core._counter import spin_ns
from .._core._log import get_logger
from .._core._util import now  # anyio.current_time() for a fraction of its cost
from ._dtypes import DType, dtype_of, from_f32, to_f32

TAG = "aiote.moe/1"
ROUTE, DISPATCH, COMBINE = 1, 2, 3
SEQ_MASK = (1 << 15) - 1
MAX_RANKS = 128
TAIL = 16  # per dispatch row: the source token (int32), padded to 16 bytes

log = get_logger(component="moe")


def imm_of(tag: int, kind: int, seq: int, src: int) -> int:
    """The immediate of (group tag, message kind, source rank, call sequence number): 8 | 2 | 7 |
    15 bits. The source is in it so that a write counted twice (re-posted after a broken
    connection: at-least-once) can never stand in for another rank's."""
    return (tag << 24) | (kind << 22) | ((src & (MAX_RANKS - 1)) << 15) | (seq & SEQ_MASK)


def round16(n: int) -> int:
    """``n`` rounded up to a multiple of 16."""
    return (n + 15) // 16 * 16


def parse_hello(raw: bytes) -> dict[str, Any] | None:
    try:
        msg = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("moe") != TAG:
        return None
    return msg


def check_config(
    world: int, e: Any, k: Any, h: Any, t: Any, in_dtype: Any, out_dtype: Any, pad: Any, cap: Any, tag: Any,
    timeout: Any, probe: Any, scale_block: Any = None,
) -> dict[str, Any]:
    """The checked arguments of :meth:`AllToAll.create`; raises InvalidArgument."""
    for name, v, lo in (("num_experts", e, 1), ("experts_per_token", k, 1), ("hidden", h, 1),
                        ("max_tokens", t, 1), ("expert_padding", pad, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InvalidArgument(f"{name} must be an int >= {lo}, not {v!r}")
    if k > e:
        raise InvalidArgument(f"experts_per_token={k} exceeds num_experts={e}")
    per = -(-e // world)
    worst = world * t * min(k, per)
    if cap is None:
        cap = worst
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise InvalidArgument(f"max_recv_tokens must be an int >= 1, not {cap!r}")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 256:
        raise InvalidArgument(f"imm_tag must be an int in [0, 256), not {tag!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout < 0):
        raise InvalidArgument(f"timeout must be a finite number of seconds >= 0 or None, not {timeout!r}")
    if isinstance(probe, bool) or not isinstance(probe, (int, float)) or not probe > 0:
        raise InvalidArgument(f"probe_interval must be a number of seconds > 0, not {probe!r}")
    if scale_block is not None and (isinstance(scale_block, bool) or not isinstance(scale_block, int)
                                    or scale_block < 1):
        raise InvalidArgument(f"scale_block must be an int >= 1 or None, not {scale_block!r}")
    odt = dtype_of(out_dtype, "out_dtype")
    if not odt.arith:
        raise InvalidArgument(f"out_dtype {odt.name} cannot be reduced: use bfloat16, float16 or float32")
    return {
        "num_experts": e, "experts_per_token": k, "hidden": h, "max_tokens": t,
        "in_dtype": dtype_of(in_dtype, "in_dtype"), "out_dtype": odt, "expert_padding": pad,
        "max_recv_tokens": cap, "imm_tag": tag, "timeout": timeout, "probe_interval": float(probe),
        "scale_block": scale_block,
    }


def check_spin(us: Any, gpu: bool) -> float | None:
    """:meth:`AllToAll.create`'s ``loop_spin_us``, checked; its default (300 on the GPU, else
    None: the engine's own setting)."""
    if us is None:
        return 300.0 if gpu else None
    spin_ns(us)  # the bounds of ImmCounter.wait's (InvalidArgument), checked at creation
    return float(us)


def left(end: float | None) -> float | None:
    return None if end is None else max(0.0, end - now())


class Deadline:
    """``anyio.fail_after(after)`` raising :class:`~aiote.TransferTimeout` naming the
    operation and its bound (``bound``; default "within ``after`` s")."""

    def __init__(self, after: float | None, what: str, bound: str | None = None) -> None:
        self._what, self._after, self._bound = what, after, bound
        self._scope = anyio.fail_after(after)

    def __enter__(self) -> None:
        self._scope.__enter__()

    def __exit__(self, et: Any, e: Any, tb: Any) -> None:
        try:
            self._scope.__exit__(et, e, tb)
        except TimeoutError:
            bound = f"within {self._after:g} s" if self._bound is None else self._bound
            raise TransferTimeout(f"{self._what} did not finish {bound}") from None


def deadline_at(end: float | None, what: str) -> Deadline:
    """A :class:`Deadline` at the absolute time ``end`` (None: none), its message "by its
    deadline". Costs a cancel scope and a timer (tens of microseconds): for waits that take
    no deadline of their own."""
    return Deadline(left(end), what, "by its deadline")



def reduce_rows(rows: Any, pos: Any, weights: Any, dt: DType, xp: Any, dest: Any, prev: Any = None) -> None:
    """The combine reduction (FLOWS.md B4) into ``dest[m, H]`` (``dt``'s storage type):
    ``acc = +0.0``, then ``acc = acc + w[t, k] * y[pos[t, k]]`` in float32 for k = 0, 1, ...
    (a skipped slot, ``pos < 0``, adds +0.0, which never changes ``acc``), then ``acc =
    prev[t] + acc`` when ``prev`` is given, then one rounding to ``dt`` (nearest even).

    ``rows[N, H]``: the expert outputs (``dt``'s storage type). On the CPU it works on blocks
    of 32 tokens so that the float32 temporaries stay in cache (a gather, a widening and two
    in-place passes per slot); on the GPU, one kernel (:mod:`._gpu`, same arithmetic). ``dest``
    may be ``prev``. Raises nothing of its own; O(m K H)."""
    if xp is not np:
        from ._gpu import reduce_gpu

        reduce_gpu(xp, rows, pos, weights, dt, dest, prev)
        return
    m, hidden = dest.shape
    k_slots = pos.shape[1]
    step = 32
    acc_all = xp.empty((min(step, m), hidden), dtype=xp.float32)
    y_all = xp.empty_like(acc_all)
    raw_all = xp.empty((min(step, m), hidden), dtype=dt.storage)
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        acc, y, raw = acc_all[: hi - lo], y_all[: hi - lo], raw_all[: hi - lo]
        acc.fill(0)
        for k in range(k_slots):
            at = pos[lo:hi, k]
            valid = at >= 0
            xp.take(rows, xp.where(valid, at, 0), axis=0, out=raw)
            if dt.name == "bfloat16":
                xp.left_shift(raw, 16, out=y.view(xp.uint32), dtype=xp.uint32)
            else:
                y[...] = raw
            xp.multiply(y, weights[lo:hi, k, None], out=y)
            if not bool(valid.all()):
                y[~valid] = 0
            xp.add(acc, y, out=acc)
        if prev is not None:
            xp.add(to_f32(prev[lo:hi], dt, xp), acc, out=acc)
        dest[lo:hi] = from_f32(acc, dt, xp)
