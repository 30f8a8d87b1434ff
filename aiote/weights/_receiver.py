"""The inference rank's side of a plan: :class:`WeightReceiver` learns when a version is
complete from its version counter (``imm_counter``), on aiote's public operations only."""

from __future__ import annotations

import anyio

from .._core._counter import ImmCounter
from .._core._engine import Engine
from .._core._errors import InvalidArgument, TransferTimeout
from .._core._observe import observed_call
from ._flow import _end, _left, version_imm
from ._plan import ReceiverPlan

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """Inference rank ``plan.rank``'s side of a plan: learns when a version is complete. The
    bytes land in memory the application registered itself (the plan's descriptors) and need
    nothing from this object: a receiver that never waits (passive) gets every byte too.

    Completion: each sender writing to this rank sends one immediate per version once all its
    bytes here are in place; :meth:`wait_version` waits for ``len(plan.senders)`` of them on
    the version's own counter. Raises :class:`~aiote.InvalidArgument` for a plan that is not a
    :class:`ReceiverPlan`; costs nothing else."""

    def __init__(self, engine: Engine, plan: ReceiverPlan) -> None:
        if not isinstance(plan, ReceiverPlan):
            raise InvalidArgument(
                f"plan must be a ReceiverPlan (plan.receiver(rank)), not {type(plan).__name__}"
            )
        self.engine = engine
        self.plan = plan
        self._complete: set[int] = set()
        self._waits: dict[int, anyio.Event] = {}

    @property
    def latest(self) -> int | None:
        """The highest version known complete, or None. O(1) amortized, no I/O."""
        return max(self._complete, default=None)

    def is_complete(self, version: int) -> bool:
        """Whether every byte of ``version`` is known to be in place (a successful wait, or a
        :meth:`poll` that saw every sender's immediate). O(1), no I/O."""
        return version in self._complete

    def poll(self, version: int) -> bool:
        """Without waiting: True if every sender's immediate for ``version`` has arrived (it
        is then marked complete), else False. Raises :class:`~aiote.InvalidArgument` for a
        bad version; O(1), one native call."""
        if version in self._complete:
            return True
        c = self.engine.imm_counter(version_imm(self.plan.tag, version))
        if version not in self._waits and c.available >= len(self.plan.senders):
            self._done(version, c)
            return True
        return False

    def _done(self, version: int, c: ImmCounter) -> None:
        self._complete.add(version)
        if len(self._complete) > 64:  # keep the last ones: versions are waited for in order
            self._complete.discard(min(self._complete))
        c.release()  # its credits are spent; a late one starts it again from zero

    @observed_call("weights", "wait_version", lambda self: self.engine)
    async def wait_version(self, version: int, *, timeout: float | None = None) -> None:
        """Returns once every byte of ``version`` is in place on this rank (every sender's
        immediate for it arrived). Immediates of other versions are never counted: a late
        write of ``v`` cannot complete ``v + 1``. Several tasks may wait for the same version.

        Raises :class:`~aiote.TransferTimeout` after ``timeout`` seconds (the version is then
        not marked complete, and the credits that did arrive stay counted for a later wait),
        :class:`~aiote.InvalidArgument` for a bad version or timeout,
        :class:`~aiote.EngineClosed`. Costs nothing while waiting (the engine's poller wakes
        it)."""
        c = self.engine.imm_counter(version_imm(self.plan.tag, version))
        end = _end(timeout)
        if version in self._complete:
            await anyio.lowlevel.checkpoint()
            return
        other = self._waits.get(version)
        if other is not None:  # another task waits for the credits: wait for it to finish
            with anyio.move_on_after(_left(end) if end is not None else float("inf")):
                await other.wait()
            if version in self._complete:
                return
            if other.is_set():  # that wait failed (timed out): take over
                return await self.wait_version(version, timeout=_left(end))
            raise TransferTimeout(f"version {version} did not complete within {timeout:g} s")
        ev = self._waits[version] = anyio.Event()
        try:
            await c.wait(len(self.plan.senders), timeout=timeout)
            self._waits.pop(version, None)
            self._done(version, c)
        finally:
            self._waits.pop(version, None)
            ev.set()
