"""Small helpers shared by the core modules."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import itertools
import math
import operator
import os
import re
import sys
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import anyio

from ._errors import AioteError, InvalidArgument, TransferTimeout


def now() -> float:
    """``anyio.current_time()`` (the running loop's clock), for a fifth of its cost: it is
    read on every timed operation's path."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop.time()
    return _trio_clock()


def _trio_clock() -> float:
    global _trio_clock
    import trio

    _trio_clock = trio.current_time
    return trio.current_time()


def check_timeout(timeout: float | None) -> None:
    """InvalidArgument unless ``timeout`` is None or a number of seconds >= 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout):
        raise InvalidArgument(f"timeout must be a number of seconds or None, not {timeout!r}")
    if timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds, not {timeout!r}")


_NO_DEADLINE: AbstractContextManager[None] = nullcontext()


def deadline(timeout: float | None, what: str) -> AbstractContextManager[None]:
    """Like ``anyio.fail_after`` but raises :class:`TransferTimeout` naming the operation.
    Free when ``timeout`` is None (a shared null context: this is on every operation's path)."""
    if timeout is None:
        return _NO_DEADLINE
    check_timeout(timeout)
    return _deadline(timeout, what)


def deadline_at(end: float | None, timeout: float | None, what: str) -> AbstractContextManager[None]:
    """:func:`deadline` at an absolute time ``end`` (``anyio.current_time()`` + ``timeout``,
    computed once by the caller): for operations that enter a scope only around the awaits they
    actually make, so that one completing without waiting pays no cancel scope or timer."""
    if end is None or timeout is None:
        return _NO_DEADLINE
    return _deadline(timeout, what, end)


@contextmanager
def _deadline(timeout: float, what: str, end: float | None = None) -> Iterator[None]:
    scope = anyio.fail_after(timeout) if end is None else anyio.fail_at(end)
    try:
        with scope:
            yield
    except TimeoutError as exc:
        if isinstance(exc, TransferTimeout):
            raise
        raise timeout_error(what, timeout) from None


def timeout_error(what: str, timeout: float) -> TransferTimeout:
    """The exception of an operation that did not finish within ``timeout`` seconds."""
    return TransferTimeout(f"{what} did not finish within {timeout:g} s")


class _TimedWaits:
    """The timed waits of one event loop, served by one timer: a heap of ``(when, seq,
    waiter)`` and one native timer armed for the earliest deadline. A wait costs a heap push
    (the loop's own timer per wait cost a timer handle and Python-level heap comparisons on
    asyncio, a cancel scope on trio). A waiter that finished before its deadline stays in the
    heap until its time comes or the heap is compacted (when it holds more than twice the
    waiters alive, at least ``_COMPACT_MIN``)."""

    __slots__ = ("_armed", "_heap", "_limit", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._armed = math.inf  # the deadline the native timer is set for
        self._limit = _COMPACT_MIN

    def add(self, when: float, waiter: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), waiter))
        if when < self._armed:
            self._armed = when
            self._arm(when)
        elif len(self._heap) > self._limit:
            self._heap = [e for e in self._heap if not self._done(e[2])]
            heapq.heapify(self._heap)
            self._limit = max(_COMPACT_MIN, 2 * len(self._heap))

    def fire(self, now: float) -> None:
        """Expires every waiter due at ``now`` and sets the timer for the next one."""
        heap = self._heap
        while heap and (heap[0][0] <= now or self._done(heap[0][2])):
            w = heapq.heappop(heap)[2]
            if not self._done(w):
                self._expire(w)
        self._armed = heap[0][0] if heap else math.inf
        if heap:
            self._arm(self._armed)

    def _arm(self, when: float) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @staticmethod
    def _done(waiter: Any) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    @staticmethod
    def _expire(waiter: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


_COMPACT_MIN = 1024


class _LoopTimedWaits(_TimedWaits):
    """asyncio: the waiters are futures (expired with False), the timer a ``call_at``. Used
    only from its loop's thread, and holds no reference to the loop (the registry's key)."""

    __slots__ = ("_handle",)

    def __init__(self) -> None:
        super().__init__()
        self._handle: asyncio.TimerHandle | None = None

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = asyncio.get_running_loop().call_at(when, self._on_timer, when)

    def _on_timer(self, when: float) -> None:
        self._handle = None
        # the loop runs a timer up to its clock resolution early
        self.fire(max(when, asyncio.get_running_loop().time()))

    @staticmethod
    def _done(waiter: Any) -> bool:
        return bool(waiter.done())

    @staticmethod
    def _expire(waiter: Any) -> None:
        waiter.set_result(False)


_LOOP_TIMED_WAITS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopTimedWaits] = (
    weakref.WeakKeyDictionary()
)


def _loop_timed_waits(loop: asyncio.AbstractEventLoop) -> _LoopTimedWaits:
    """The timed-wait service of ``loop`` (made on first use, dropped with the loop). The last
    loop's is kept beside the registry (a weak reference to the loop): every timed wait looks
    it up, and a weak dictionary's lookup costs a few times more."""
    global _LAST_TIMED_WAITS
    ref, last = _LAST_TIMED_WAITS  # one tuple, replaced whole: another thread's loop never mixes in
    if ref() is loop:
        return last  # type: ignore[no-any-return]
    try:
        timers = _LOOP_TIMED_WAITS.get(loop)
        if timers is None:
            timers = _LOOP_TIMED_WAITS[loop] = _LoopTimedWaits()
    except TypeError:  # pragma: no cover - a loop class without weak references: kept for good
        timers = _LOOP_TIMED_WAITS_STRONG.get(loop)
        if timers is None:
            timers = _LOOP_TIMED_WAITS_STRONG[loop] = _LoopTimedWaits()
    with contextlib.suppress(TypeError):  # no weak references: not kept
        _LAST_TIMED_WAITS = (weakref.ref(loop), timers)
    return timers


_LOOP_TIMED_WAITS_STRONG: dict[asyncio.AbstractEventLoop, _LoopTimedWaits] = {}
_LAST_TIMED_WAITS: tuple[Any, Any] = (lambda: None, None)  # (weak reference to a loop, its service)


class _Event:
    """What the engine's two event classes share: a flag and the waiters :meth:`set` wakes
    (``_wake``, one per waiter)."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[Any] = []

    def is_set(self) -> bool:
        """True once :meth:`set` was called."""
        return self._set

    def set(self) -> None:
        """Sets the event and wakes every waiter. Idempotent; never raises."""
        if self._set:
            return
        self._set = True
        wake = self._wake
        for w in self._waiters:
            wake(w)
        self._waiters.clear()

    @staticmethod
    def _wake(waiter: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class LoopEvent(_Event):
    """The engine's event under asyncio: ``asyncio.Event``'s ``set``, ``is_set`` and
    ``wait``, plus :meth:`wait_until`, a wait with a deadline that costs a future and a heap
    push (about 3 µs more than an untimed wait on the development VM) where a cancel scope
    (``anyio.fail_at``) costs about 25 µs: every timed wait of an operation pays it."""

    __slots__ = ()

    @staticmethod
    def _wake(waiter: Any) -> None:
        if not waiter.done():
            waiter.set_result(True)

    async def wait(self) -> None:
        """Returns once the event is set (at once if it is). Cancellable."""
        if self._set:
            return
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if not self._set:
                self._waiters.remove(fut)

    async def wait_until(self, when: float) -> bool:
        """Waits until the event is set or the loop's clock (``anyio.current_time()``)
        reaches ``when``; True when it is set. Cancellable."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(fut)
        _loop_timed_waits(loop).add(when, fut)
        try:
            await fut
        finally:
            if not self._set:
                self._waiters.remove(fut)
        return self._set


class _Trio:
    """trio's pieces, imported on first use (trio is an optional dependency): the run-local
    timed-wait service and the wake-up value (an ``outcome.Value``, unwrapped once each)."""

    timed_waits: Any = None  # trio.lowlevel.RunVar
    value: Any = None
    reschedule: Any = None

    @classmethod
    def load(cls) -> None:
        import outcome
        import trio

        cls.value = outcome.Value
        cls.reschedule = trio.lowlevel.reschedule
        cls.timed_waits = trio.lowlevel.RunVar("aiote_timed_waits")


class _TrioWaiter:
    __slots__ = ("event", "task")

    def __init__(self, task: Any, event: TrioEvent) -> None:
        self.task: Any = task  # None once woken or cancelled
        self.event = event


class _TrioTimedWaits(_TimedWaits):
    """trio: the waiters are parked tasks (rescheduled with False), the timer one system
    task of the run sleeping in a cancel scope whose deadline is moved."""

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        super().__init__()
        self._scope: Any = None

    async def run(self) -> None:
        import trio

        while True:
            with trio.CancelScope(deadline=self._armed) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None
            self.fire(trio.current_time())

    def _arm(self, when: float) -> None:
        if self._scope is not None:
            self._scope.deadline = when

    @staticmethod
    def _done(waiter: Any) -> bool:
        return waiter.task is None

    @staticmethod
    def _expire(waiter: Any) -> None:
        task, waiter.task = waiter.task, None
        waiter.event._waiters.remove(waiter)
        _Trio.reschedule(task, _Trio.value(False))


class TrioEvent(_Event):
    """The engine's event under trio: ``trio.Event``'s ``set``, ``is_set`` and ``wait``
    (a checkpoint when already set, cancellable), plus :meth:`wait_until`, a wait with a
    deadline that costs a heap push where a cancel scope costs 25 to 30 µs on the
    development VM."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__()
        if _Trio.value is None:
            _Trio.load()

    @staticmethod
    def _wake(waiter: Any) -> None:
        task, waiter.task = waiter.task, None
        _Trio.reschedule(task, _Trio.value(True))

    async def wait(self) -> None:
        """Returns once the event is set. Cancellable."""
        await self._park(None)

    async def wait_until(self, when: float) -> bool:
        """Waits until the event is set or trio's clock reaches ``when``; True when it is
        set. Cancellable."""
        return await self._park(when)

    async def _park(self, when: float | None) -> bool:
        import trio

        if self._set:
            await trio.lowlevel.checkpoint()
            return True
        w = _TrioWaiter(trio.lowlevel.current_task(), self)
        self._waiters.append(w)
        if when is not None:
            try:
                timers = _Trio.timed_waits.get()
            except LookupError:
                timers = _TrioTimedWaits()
                _Trio.timed_waits.set(timers)
                trio.lowlevel.spawn_system_task(timers.run, name="aiote-timed-waits")
            timers.add(when, w)

        def abort(_: Any) -> Any:
            if w.task is not None:
                w.task = None
                self._waiters.remove(w)
            return trio.lowlevel.Abort.SUCCEEDED

        return bool(await trio.lowlevel.wait_task_rescheduled(abort))


async def wait_until(event: Any, when: float | None) -> bool:
    """Waits for the engine's ``event`` (a :class:`LoopEvent` or a :class:`TrioEvent`) until
    ``when`` on ``anyio.current_time()``'s clock (None: no deadline); True when it was set.
    One heap push where a ``deadline`` scope costs a cancel scope and a timer."""
    if when is None:
        await event.wait()
        return True
    return bool(await event.wait_until(when))


def as_index(value: Any, name: str, *, lo: int = 0, hi: int | None = None) -> int:
    """An integer argument in ``[lo, hi)``; InvalidArgument otherwise (bools refused)."""
    if type(value) is int and value >= lo and (hi is None or value < hi):
        return value  # the common case, on every operation's path: no further checks
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, not a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an integer, not {type(value).__name__}") from None
    if v < lo or (hi is not None and v >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise InvalidArgument(f"{name}={v} is out of range (must be {bound})")
    return v


_SHM_NAME = re.compile(rb"aiote-([0-9a-f]{16})-[0-9]+")


def shm_peer_gone(address: bytes) -> bool:
    """Whether the engine behind a same-host (shm) peer address is gone: no process holds its
    owner's lock file (aiote-<token>.lock, locked for the owning process's life: see cdeps,
    "Owned shm names"), or the process lives but that engine closed (aiote's own wake-up file
    of the endpoint, <name>.w, is removed when the endpoint is freed; libfabric's endpoint
    file is not evidence: libfabric's signal handler removes it on SIGINT while the process
    may go on). A false answer for names aiote did not give (nothing is known of them).
    Costs an open + non-blocking shared flock + close of the lock file, and a stat; touches
    nothing else."""
    m = _SHM_NAME.fullmatch(address.rstrip(b"\0"))
    if m is None:
        return False
    try:
        fd = os.open(f"/dev/shm/aiote-{m.group(1).decode()}.lock", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True  # its process's last endpoint closed, or the process died and was swept
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        # its process holds it: alive; its engine closed if the endpoint's wake-up file went
        return not os.path.exists(f"/dev/shm/{m.group(0).decode()}.w")
    except OSError:
        return False
    else:
        return True  # nobody holds it: the process died (released as the descriptor closes)
    finally:
        os.close(fd)


if sys.version_info >= (3, 11):
    _Group = BaseExceptionGroup  # noqa: F821
else:  # pragma: no cover - anyio brings the backport on 3.10
    from exceptiongroup import BaseExceptionGroup as _Group


@contextmanager
def first_error() -> Iterator[None]:
    """Around a task group whose tasks are parts of one operation: when they fail with
    aiote's errors only, the operation raises the first of them (chained to the group), as a
    single-part operation would, instead of an exception group."""
    try:
        yield
    except _Group as group:
        leaves: list[BaseException] = []
        todo: list[BaseException] = [group]
        while todo:
            x = todo.pop(0)
            if isinstance(x, _Group):
                todo = list(x.exceptions) + todo
            else:
                leaves.append(x)
        if leaves and all(isinstance(x, AioteError) for x in leaves):
            raise leaves[0] from group
        raise
