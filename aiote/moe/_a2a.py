"""The all-to-all of a group of ranks: MoE dispatch and combine over one-sided writes.

Per call (sequence number ``s``, parity ``p = s % 2``), on every rank:

1. ``dispatch_send``: await this rank's own writes of call ``s - 2`` (they used the same
   parity regions at the peers), then write its route row (rows per global expert) into every
   peer's route region ``[p][rank]`` with immediate ROUTE(s, rank); wait for the route rows of
   the peers (the count exchange); compute the layout (:mod:`._layout`); pack the rows sorted
   by (expert, token) and write each peer's block into that peer's dispatch region ``[p]`` at
   the row the layout gives it (immediate DISPATCH(s), one write per peer, zero bytes when
   empty, so every peer expects exactly one from each peer).
2. ``recv``: wait for one DISPATCH(s, r) credit from each peer r, await its own writes, unpack into per-expert
   padded blocks in canonical order (source rank, then token).
3. ``combine_send``: pack the expert outputs in received order and write each source's rows
   into that source's combine region ``[p]`` at the source's own send layout (COMBINE(s)).
4. ``recv``: wait for one COMBINE(s, r) credit from each peer r, reduce in float32 in top-k slot order.

Why nothing of call ``s`` is ever counted or read for another call: immediates carry the
call's sequence number (15 bits), the sender's rank (so that a write counted twice after a
re-post cannot stand in for another rank's) and a per-group tag; a rank posts its route row for ``s`` only
after its own writes of ``s - 2`` have finished (landed, or failed for good), so once the route
rows of ``s`` from every peer are in, nothing of ``s - 2`` can still land anywhere: the
counters of ``s - 2`` are released then, and the ``[p]`` regions are free. A rank finishes
reading its ``[p]`` regions of ``s - 2`` before posting its route row for ``s`` (a combine of
``s - 2`` still running then is refused), so no peer overwrites them early.

:class:`AllToAll` is the top of a stack of classes, each owning one concern over the shared
state and importing only those below it: :mod:`._state` (fields, regions, device helpers),
:mod:`._credits` (route rows, credits, probes, settling), :mod:`._gpuflow` (the GPU path),
:mod:`._dispatch` (steps 1 and 2), :mod:`._combine` (steps 3 and 4), and this module
(creation, the descriptor exchange, closing).
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import numpy as np

from .. import Engine, InvalidArgument, MemoryDescriptor
from ._combine import Combine
from ._dtypes import DType
from ._handles import Group
from ._layout import Geometry
from ._util import TAG, Deadline, check_config, check_spin, parse_hello
from ._util import log as _log

__all__ = ["AllToAll"]


class AllToAll(Combine):
    """MoE dispatch and combine among the ranks of a :class:`Group`, created once per shape
    with :meth:`create` on every rank (same arguments).

    Guarantees: dispatch is byte-exact (rows are copied, never converted); combine
    accumulates in float32 in top-k slot order and rounds once; every call of every rank
    waits at most its ``timeout`` (default the group's); a peer that dies makes the calls
    waiting on it raise :class:`~aiote.PeerUnreachable` within the engine's ``connect_timeout``
    plus ``probe_interval``; a call that failed or was cancelled on any rank fails that step
    on the others (by their deadline) and leaves the next call correct. Every call to
    :meth:`dispatch`/:meth:`dispatch_send` is one step of the group, whatever its outcome, so
    every rank must make the same calls in the same order. At most two dispatches are in
    flight: dispatch ``s`` makes handle ``s - 2`` stale.

    Costs (registered, per rank): dispatch regions ``2 x max_recv_tokens`` rows of
    ``round16(H x in) + 16`` bytes, a send region of ``max_tokens x K`` such rows (two on the
    GPU, one per parity: the unpack reads a rank's own rows there), combine regions ``2 x
    max_tokens x K`` rows and a send region of ``max_recv_tokens`` rows of ``round16(H x out)``
    bytes, and the route rows (``2 x W x E`` int32); on the GPU also per-parity layout buffers
    (``O(E + max_tokens x K + max_recv_tokens)`` integers) and a few KiB of pinned memory.
    """

    # ------------------------------------------------------------------ creation

    @classmethod
    async def create(
        cls,
        engine: Engine,
        group: Group,
        *,
        num_experts: int,
        experts_per_token: int,
        hidden: int,
        max_tokens: int,
        in_dtype: Any = "bfloat16",
        out_dtype: Any = "bfloat16",
        expert_padding: int = 1,
        max_recv_tokens: int | None = None,
        imm_tag: int = 0xA5,
        timeout: float | None = 60.0,
        probe_interval: float = 0.5,
        scale_block: int | None = None,
        xp: Any = None,
        loop_spin_us: float | None = None,
    ) -> AllToAll:
        """Creates the all-to-all on this rank; every rank of ``group`` calls it with the same
        arguments (checked: a rank with others raises :class:`~aiote.InvalidArgument`).

        ``num_experts`` E, ``experts_per_token`` K, ``hidden`` H, ``max_tokens`` (per rank and
        call), ``in_dtype`` (dispatch rows: ``"bfloat16"``, ``"float16"``, ``"float32"``,
        ``"float8_e4m3fn"``; bfloat16 travels as uint16 bit patterns, float8 as uint8),
        ``out_dtype`` (combine: bfloat16, float16 or float32), ``expert_padding`` (each expert's
        block is a multiple of it), ``max_recv_tokens`` (rows a rank can receive per call;
        default the worst case ``W x max_tokens x min(K, ceil(E/W))``; a call that would exceed
        it raises :class:`~aiote.InvalidArgument` on every rank before any token moves),
        ``imm_tag`` (8 bits: the immediates of this group; groups sharing an engine need
        different tags), ``timeout`` (default deadline of every call, and of this one),
        ``probe_interval`` (how often a long wait checks that its peers are alive),
        ``scale_block`` (float8 with block scales: each token also carries ``ceil(H /
        scale_block)`` float32 scales, ``dispatch(x_scale=)``, returned as
        ``handle.expert_x_scale``), ``xp``: ``numpy`` (default) or ``cupy`` (GPU regions:
        same-host peers over CUDA IPC), ``loop_spin_us`` (how long each wait of a call, for the
        peers' credits or this rank's writes, first drives the engine's completion queues from
        the event loop's thread, blocking the loop, before it sleeps: see
        :meth:`aiote.ImmCounter.wait`; default 300 with CuPy, whose calls' waits take tens of
        microseconds and are on every step's path, and with NumPy the engine's own
        ``loop_spin_us``; a choice of this rank alone).

        Registers its regions, sends one message to every peer and takes the engine's
        messages until every peer's arrived (messages of others are dropped with a warning:
        create groups one at a time, before other message traffic). Raises
        :class:`~aiote.InvalidArgument` for bad arguments (before anything is registered),
        :class:`~aiote.TransferTimeout` after ``timeout``, what registering and sending raise.
        """
        xp = np if xp is None else xp
        if not isinstance(group, Group):
            raise InvalidArgument(f"group must be an aiote.moe.Group, not {type(group).__name__}")
        cfg = check_config(
            group.world, num_experts, experts_per_token, hidden, max_tokens, in_dtype, out_dtype,
            expert_padding, max_recv_tokens, imm_tag, timeout, probe_interval, scale_block,
        )
        spin = check_spin(loop_spin_us, getattr(xp, "__name__", "") == "cupy")
        self = cls(engine, group, Geometry(group.world, num_experts), cfg, xp)
        self.loop_spin_us = spin
        try:
            with Deadline(timeout, "creating the all-to-all"):
                await self._register()
                await self._exchange(cfg)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        _log.info("all-to-all ready", rank=self.rank, world=self.world, experts=num_experts, hidden=hidden)
        return self

    async def _exchange(self, cfg: dict[str, Any]) -> None:
        key = json.dumps({k: (v.name if isinstance(v, DType) else v) for k, v in sorted(cfg.items())
                          if k not in ("timeout", "probe_interval")}, separators=(",", ":"))
        mine = {
            "moe": TAG, "rank": self.rank, "key": key, "gpu": self._gpu,
            "route": bytes(self._route_mr.descriptor).hex(),
            "drecv": bytes(self._drecv_mr.descriptor).hex(),
            "crecv": bytes(self._crecv_mr.descriptor).hex(),
        }
        payload = json.dumps(mine).encode()
        peers: dict[int, dict[str, MemoryDescriptor]] = {}
        for r, addr in enumerate(self.group.addresses):
            if r != self.rank:
                await self.engine.send(addr, payload)
        while len(peers) < self.world - 1:
            sender, raw = await self.engine.recv()
            msg = parse_hello(raw)
            if msg is None or sender not in self.group.addresses:
                _log.warning("dropped a message while creating an all-to-all", size=len(raw))
                continue
            r = self.group.addresses.index(sender)
            if msg["key"] != key or msg["rank"] != r:
                raise InvalidArgument(f"rank {r} created its all-to-all with other arguments: {msg['key']}")
            peers[r] = {k: MemoryDescriptor.from_bytes(bytes.fromhex(msg[k]))
                        for k in ("route", "drecv", "crecv")}
        self._peers = [peers.get(r, {}) for r in range(self.world)]
        for r, p in enumerate(self._peers):
            if r != self.rank:
                await self.engine.connect(p["route"])

    async def aclose(self) -> None:
        """Unregisters the regions (waits up to the group's timeout for writes in flight; then
        :class:`~aiote.RegionBusy`). Later calls raise :class:`~aiote.InvalidArgument`.
        Idempotent; costs one unregister per region."""
        self._closed = True
        regions, self._regions = self._regions, []
        for mr in regions:
            if not self.engine.closed:
                await self.engine.unregister(mr, timeout=self.timeout)

    async def __aenter__(self) -> AllToAll:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
