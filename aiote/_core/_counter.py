"""ImmCounter: per-immediate credit counters fed by the C poller."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .._native import lib
from ._errors import EngineClosed, InvalidArgument
from ._util import check_timeout, now, timeout_error, wait_until

__all__ = ["CREDIT_UNIT", "CounterOwner", "ImmCounter", "spin_ns"]

CREDIT_UNIT: int = int(lib.AIO_CREDIT_UNIT)


def spin_ns(loop_spin_us: float) -> int:
    """A wait's ``loop_spin_us`` in nanoseconds; InvalidArgument outside [0, 100000] (the
    bounds of the engine's ``loop_spin_us``)."""
    us = loop_spin_us
    if isinstance(us, bool) or not isinstance(us, (int, float)) or not 0 <= us <= 100_000:
        raise InvalidArgument(f"loop_spin_us must be a number in [0, 100000], not {us!r}")
    return int(us * 1000)


class CounterOwner(Protocol):
    """What a counter needs of its engine (the engine satisfies it; this module never imports
    the engine, which sits above it)."""

    _closed: bool
    _loop_spin_ns: int
    _checkpoint_if_cancelled: Callable[[], Awaitable[None]]
    _checkpoint: Callable[[], Awaitable[None]]
    _event: Any

    def _handle(self) -> Any: ...

    def _forget_counter(self, imm: int) -> bool: ...

    def _spin_until(self, done: Any, spin_ns: int | None = None, until: float | None = None) -> None: ...


class _Waiter:
    __slots__ = ("event", "granted", "units")

    def __init__(self, units: int, event: Any) -> None:
        self.units = units
        self.event = event
        self.granted = False


class ImmCounter:
    """Credits received for one immediate value (``engine.imm_counter(imm)``).

    Every write that carries ``imm`` adds one credit when it has landed, from the first
    immediate on: a waiter that arrives late still sees them (there is nothing to arm before
    peers write). The transport's ordering is not assumed. :meth:`wait` consumes credits;
    waiters are served first come, first served. Holding one costs a Python object: the
    credits are counted in the C core whether or not it exists. Its calls raise
    :class:`~aiote.EngineClosed` once the engine closed.
    """

    def __init__(self, engine: CounterOwner, imm: int) -> None:
        self._engine = engine
        self.imm = imm
        self._waiters: deque[_Waiter] = deque()

    @property
    def available(self) -> int:
        """Whole credits received and not yet consumed by :meth:`wait`. O(1), one native call,
        no I/O. Raises :class:`~aiote.EngineClosed` once the engine closed."""
        return int(lib.aio_counter_available(self._engine._handle(), self.imm)) // CREDIT_UNIT

    @property
    def total(self) -> int:
        """Whole credits received since the engine opened (consumed or not). O(1), one native
        call, no I/O. Raises :class:`~aiote.EngineClosed` once the engine closed."""
        return int(lib.aio_counter_total(self._engine._handle(), self.imm)) // CREDIT_UNIT

    async def wait(
        self, n: int = 1, *, timeout: float | None = None, loop_spin_us: float | None = None
    ) -> None:
        """Waits until ``n`` credits are available and consumes them.

        Cancellable: a cancelled or timed-out wait consumes nothing (credits already granted
        to it are returned), so credits are never lost nor counted twice. By default it never
        spins: the C poller wakes the loop when the counter reaches the first waiter's demand.
        With a spin (``loop_spin_us`` for this wait, or else the engine's ``loop_spin_us``) it
        first drives the completion queues from the loop thread for up to that long (and no
        longer than ``timeout``), blocking the event loop meanwhile: for a wait expected to
        end within microseconds, e.g. a step of a collective. Credits already there are then
        taken without a trip through the event loop. ``loop_spin_us=0`` never spins, whatever
        the engine's setting.

        Raises :class:`~aiote.TransferTimeout` after ``timeout`` seconds,
        :class:`~aiote.EngineClosed` if the engine closes, :class:`~aiote.InvalidArgument`
        for ``n < 0``, a bad ``timeout`` or a ``loop_spin_us`` outside [0, 100000]. Cost:
        credits already there are taken with one native call and one checkpoint (none with a
        spin); otherwise the task sleeps until the poller wakes the loop for it.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"credits to wait for must be an int >= 0, not {n!r}")
        check_timeout(timeout)
        eng = self._engine
        spin = eng._loop_spin_ns if loop_spin_us is None else spin_ns(loop_spin_us)
        h = eng._handle()
        units = n * CREDIT_UNIT
        end = None if timeout is None else now() + timeout  # spins count in the timeout
        await eng._checkpoint_if_cancelled()  # a cancelled caller takes nothing
        if not self._waiters and lib.aio_counter_take(h, self.imm, units):
            if spin:  # spinning (low latency): no trip through the event loop
                return
            try:
                await eng._checkpoint()  # a schedule point (half the cost of a shielded one)
            except BaseException:
                if not eng._closed:  # cancelled right after taking: give the credits back
                    lib.aio_counter_refund(h, self.imm, units)
                    self._serve()
                raise
            return
        if spin and not self._waiters:
            # spinning, nobody queued: spin for the credits without queueing (no waiter, no
            # event); the watch makes the counter push a record when they are in
            imm = self.imm
            if lib.aio_counter_watch(h, imm, units) != 1:
                eng._spin_until(lambda: lib.aio_counter_available(h, imm) >= units, spin, end)
            if not self._waiters and lib.aio_counter_take(h, imm, units):
                return
        w = _Waiter(units, eng._event())
        self._waiters.append(w)
        try:
            if self._waiters[0] is w:
                self._serve()
            if spin and not w.event.is_set():
                eng._spin_until(w.event.is_set, spin, end)
            # a timed wait is a timer on the event, not a cancel scope (see LoopEvent)
            if end is None:
                await w.event.wait()
            elif not await wait_until(w.event, end):
                assert timeout is not None
                raise timeout_error(f"waiting for {n} credits of imm {self.imm}", timeout)
        except BaseException:
            if w.granted and not self._engine._closed:
                lib.aio_counter_refund(h, self.imm, w.units)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(w)
            self._serve()
            raise
        if not w.granted:
            raise EngineClosed("the engine closed while waiting for credits")

    def release(self) -> None:
        """Forgets this counter: its credits and totals, in C and in the engine (an
        application that names each request by its own immediate releases the request's
        counters when it is done, so that the table does not grow). Credits that arrive later
        start the counter again from zero. Raises :class:`~aiote.InvalidArgument` while tasks
        wait on it. O(1)."""
        if self._waiters:
            n = len(self._waiters)
            raise InvalidArgument(f"{n} tasks are waiting on imm {self.imm}; release it after")
        self._engine._forget_counter(self.imm)

    def _serve(self) -> None:
        """Grants credits to waiters in order; arms the C watch for the first unserved one."""
        if self._engine._closed:
            return
        h = self._engine._handle()
        while self._waiters:
            head = self._waiters[0]
            if lib.aio_counter_take(h, self.imm, head.units):
                self._waiters.popleft()
                head.granted = True
                head.event.set()
                continue
            if lib.aio_counter_watch(h, self.imm, head.units) == 1:
                continue
            break

    def _fail_all(self) -> None:
        while self._waiters:
            self._waiters.popleft().event.set()
