"""The public objects of a call: the group, the dispatch handle, the pending halves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core._descriptor import EngineAddress
from .._core._engine import Transfer
from .._core._errors import InvalidArgument
from .._core._observe import observed_call
from ._trace import mark
from ._util import COMBINE, DISPATCH, MAX_RANKS

if TYPE_CHECKING:
    from ._a2a import AllToAll

__all__ = ["CombinePending", "DispatchHandle", "DispatchPending", "Group"]


@dataclass(frozen=True)
class Group:
    """The ranks of an all-to-all (at most 128): every rank's engine address
    (``engine.address``), in rank order, and this process's ``rank``. Building one checks both
    and raises :class:`~aiote.InvalidArgument` (bad rank, empty, repeated or too many addresses) or
    :class:`~aiote.DescriptorError` (corrupt address bytes); O(W), no I/O."""

    addresses: tuple[bytes, ...]
    rank: int

    def __post_init__(self) -> None:
        addrs = tuple(bytes(a) for a in self.addresses)
        object.__setattr__(self, "addresses", addrs)
        if not addrs:
            raise InvalidArgument("a group needs at least one rank")
        if len(addrs) > MAX_RANKS:
            raise InvalidArgument(f"a group has at most {MAX_RANKS} ranks (its immediates name the source)")
        if len(set(addrs)) != len(addrs):
            raise InvalidArgument("the group lists an engine address twice")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < len(addrs):
            raise InvalidArgument(f"rank must be in [0, {len(addrs)}), not {self.rank!r}")
        for a in addrs:
            EngineAddress.from_bytes(a)

    @property
    def world(self) -> int:
        """The number of ranks. O(1)."""
        return len(self.addresses)


@dataclass(eq=False)
class DispatchHandle:
    """What :meth:`AllToAll.dispatch` returns on a rank: the tokens its local experts must
    process, and what :meth:`AllToAll.combine` needs to bring their outputs back.

    ``expert_x[rows, H]`` (an array of the group's ``xp``, ``in_dtype``'s storage type): local
    expert ``l``'s rows are ``expert_x[offsets[l] : offsets[l] + counts[l]]``, in canonical
    order (source rank, then token); rows up to ``offsets[l + 1]`` are padding (undefined).
    ``counts[L]`` (int32) and ``offsets[L + 1]`` (int64) are NumPy arrays; ``src_rank`` and
    ``src_token`` (int32, of ``xp``, -1 on padding rows) name each row's source. ``seq``: the
    call's sequence number. ``expert_x_scale[rows, ceil(H / scale_block)]`` (float32): the rows'
    block scales, moved with them, for a group created with ``scale_block`` (else None).
    Holding one costs its arrays; it has no methods that do I/O."""

    seq: int
    expert_x: Any
    expert_x_scale: Any
    counts: np.ndarray
    offsets: np.ndarray
    src_rank: Any
    src_token: Any
    num_tokens: int
    _a2a: AllToAll = field(repr=False)
    _plan: Any = field(repr=False)  # a RecvPlan (CPU) or a GpuPlan
    _dest: Any = field(repr=False)
    _pos: Any = field(repr=False)
    _weights: Any = field(repr=False)
    _state: str = field(default="dispatched", repr=False)

    @property
    def local_experts(self) -> int:
        """The number of experts on this rank. O(1)."""
        return len(self.counts)

    def expert_rows(self, local_expert: int) -> Any:
        """The valid rows of ``local_expert`` (a view of ``expert_x``). Raises IndexError for an
        expert not on this rank; O(1)."""
        if not 0 <= local_expert < len(self.counts):
            raise IndexError(f"local expert {local_expert} is not in [0, {len(self.counts)})")
        first = int(self.offsets[local_expert])
        return self.expert_x[first : first + int(self.counts[local_expert])]


class DispatchPending:
    """The receive half of a dispatch whose send half has run (:meth:`AllToAll.dispatch_send`).
    ``await pending.recv()`` completes it; do other work in between."""

    def __init__(self, a2a: AllToAll, seq: int, plan: Any, pos: Any, weights: Any, posted: list[Transfer],
                 m: int, out_x: Any = None) -> None:
        self._a2a, self.seq, self._plan, self._pos = a2a, seq, plan, pos
        self._weights, self._posted, self._m = weights, posted, m
        self._out_x = out_x
        self._ex: Any = None
        self._scale: Any = None
        self._src_token: Any = None
        self._dest: Any = None
        self._done = False

    @observed_call("moe", "dispatch_recv", lambda self: self._a2a.engine)
    async def recv(self, *, timeout: float | None = None) -> DispatchHandle:
        """Waits for every peer's tokens (each peer writes exactly once per call), checks this
        rank's own writes, and unpacks into the handle's expert blocks.

        Raises :class:`~aiote.TransferTimeout` after ``timeout`` (default: the group's),
        :class:`~aiote.PeerUnreachable` when a peer is gone (found within the engine's
        ``connect_timeout`` plus ``probe_interval``: peers are probed while the wait lasts
        longer than that), what the writes raised, :class:`~aiote.InvalidArgument` when called
        twice or after a later call made it stale. Costs one counter wait and an unpack of the
        received rows (one gather: O(rows x row bytes))."""
        a = self._a2a
        if self._done or self.seq in a._stale:
            raise InvalidArgument(f"dispatch {self.seq} was received already or is stale")
        self._done = True
        end = a._end(timeout)
        a._receiving = self.seq
        try:
            mark("dr.start")
            if a._gpu:
                return await a._recv_gpu(self, end)
            await a._wait_credits(DISPATCH, self.seq, end, f"dispatch {self.seq}", self._posted)
            mark("dr.wait_rows")
            await a._settle(self._posted, end, f"dispatch {self.seq}")
            mark("dr.own_writes")
            h = a._unpack(self)
            mark("dr.unpack", a.xp)
            return h
        finally:
            a._receiving = None


class CombinePending:
    """The receive half of a combine whose send half has run (:meth:`AllToAll.combine_send`)."""

    def __init__(self, a2a: AllToAll, handle: DispatchHandle, posted: list[Transfer]) -> None:
        self._a2a, self._h, self._posted = a2a, handle, posted

    @observed_call("moe", "combine_recv", lambda self: self._a2a.engine)
    async def recv(self, *, out: Any = None, accumulate: bool = False, timeout: float | None = None) -> Any:
        """Waits for the expert outputs of this rank's tokens and reduces them: ``out[t] =
        (out[t] if accumulate else 0) + sum_k w[t, k] * y[t, k]``, in float32 in slot order,
        rounded once to ``out_dtype``. Returns ``out[:num_tokens]`` (a new array when ``out``
        is None).

        Raises :class:`~aiote.InvalidArgument` (called twice, ``accumulate`` without ``out``, a
        bad ``out``), otherwise as :meth:`DispatchPending.recv`. Costs one counter wait and the
        reduction (K gathers of ``num_tokens`` rows, float32)."""
        a, h = self._a2a, self._h
        if h._state != "combine_sent":
            raise InvalidArgument(f"combine {h.seq} was received already or is stale")
        a._check_out(out, accumulate, h.num_tokens)
        end = a._end(timeout)
        h._state = "combining"
        try:
            mark("cr.start")
            await a._wait_credits(COMBINE, h.seq, end, f"combine {h.seq}", self._posted)
            mark("cr.wait_rows")
            await a._settle(self._posted, end, f"combine {h.seq}")
            mark("cr.own_writes")
            out = a._reduce(h, out, accumulate)
            mark("cr.reduce", a.xp)
            return out
        finally:
            h._state = "combined"


