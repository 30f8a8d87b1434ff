"""The synchronisation of a call: the route rows (the count exchange), one credit per peer
and kind, probing the peers while a wait lasts, settling this rank's own writes, and
releasing the counters of calls that can no longer be written to (see :mod:`._a2a`)."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import numpy as np

from .. import AioteError, ImmCounter, InvalidArgument, Transfer, TransferTimeout
from .._core._util import now  # internal: anyio.current_time() for a fraction of its cost
from ._state import State
from ._util import COMBINE, DISPATCH, ROUTE, imm_of, left
from ._util import log as _log

__all__ = ["Credits"]


class Credits(State):
    """The route rows, credits and probes, settling writes, releasing counters."""

    def _end(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0):
            raise InvalidArgument(f"timeout must be a number of seconds >= 0 or None, not {t!r}")
        return None if t is None else now() + float(t)

    def _post_route(self, seq: int, route: np.ndarray, posted: list[Transfer]) -> None:
        p, e4 = seq & 1, self.num_experts * 4
        self._myroute[p] = route
        self._route[p, self.rank] = route
        imm = imm_of(self.imm_tag, ROUTE, seq, self.rank)
        for r, peer in enumerate(self._peers):
            if r != self.rank:
                t = self.engine.post_write(
                    self._myroute_mr, peer["route"], length=e4, src_offset=p * e4,
                    dst_offset=(p * self.world + self.rank) * e4, imm=imm,
                )
                posted.append(t)
                self._inflight[p].append(t)

    async def _wait_credits(
        self, kind: int, seq: int, end: float | None, what: str, posted: list[Transfer]
    ) -> None:
        """Waits for one credit of (kind, seq) from each peer; every ``probe_interval`` of waiting,
        checks this call's writes and probes every peer (a 4-byte write, no immediate: a dead
        peer fails it)."""
        if self.world == 1:
            await anyio.lowlevel.checkpoint()
            return
        for r in range(self.world):
            if r != self.rank:
                counter = self.engine.imm_counter(imm_of(self.imm_tag, kind, seq, r))
                await self._wait_one(counter, end, what, posted)

    async def _wait_one(
        self, counter: ImmCounter, end: float | None, what: str, posted: list[Transfer]
    ) -> None:
        """One credit of ``counter`` by ``end``, probing the peers while it lasts."""
        while True:
            remaining = None if end is None else end - now()
            if remaining is not None and remaining <= 0:
                raise TransferTimeout(f"{what}: peers' writes did not all arrive in time")
            step = self.probe_interval if remaining is None else min(self.probe_interval, remaining)
            try:
                await counter.wait(1, timeout=step, loop_spin_us=self.loop_spin_us)
                return
            except TransferTimeout:
                pass
            for t in posted:
                if t.done:
                    await t  # a failed write of ours (a dead peer) raises here
            await self._probe(end, what)

    async def _probe(self, end: float | None, what: str) -> None:
        probes = [
            self.engine.post_write(self._myroute_mr, peer["route"], length=4, dst_offset=self._route.nbytes)
            for r, peer in enumerate(self._peers) if r != self.rank
        ]
        for t in probes:
            try:
                await t.wait(timeout=left(end))
            except TransferTimeout:
                raise TransferTimeout(f"{what}: peers' writes did not all arrive in time") from None
        _log.debug("peers probed while waiting", op=what, peers=len(probes))

    async def _settle(
        self, transfers: list[Transfer], end: float | None, what: str, *, quiet: bool = False
    ) -> None:
        """Awaits ``transfers`` (and forgets them); ``quiet``: those of earlier calls, whose
        errors were that call's and are only logged."""
        while transfers:
            t = transfers[0]
            try:
                await t.wait(timeout=left(end), loop_spin_us=self.loop_spin_us)
            except TransferTimeout:
                raise TransferTimeout(f"{what}: this rank's writes did not finish in time") from None
            except AioteError as exc:
                if not quiet:
                    raise
                _log.info("an earlier call's write had failed", op=what, error=str(exc))
            transfers.pop(0)
            for lst in self._inflight:
                if t in lst:
                    lst.remove(t)

    def _release_old(self, seq: int) -> None:
        """Every peer has started ``seq``: nothing of ``seq - 2`` or earlier can still land."""
        for s in [s for s in self._unreleased if s <= seq - 2]:
            self._unreleased.discard(s)
            for kind in (ROUTE, DISPATCH, COMBINE):
                for r in range(self.world):
                    if r == self.rank:
                        continue
                    try:
                        self.engine.imm_counter(imm_of(self.imm_tag, kind, s, r)).release()
                    except InvalidArgument:  # a task still waits on it (a call being cancelled)
                        self._unreleased.add(s)
