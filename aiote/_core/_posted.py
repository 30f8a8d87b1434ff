"""Transfer: the handle of a write posted by ``post_write``/``post_write_imm``/``TransferBatch.post``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .._native import lib
from ._counter import spin_ns
from ._errors import PeerUnreachable
from ._life import OpLife
from ._optable import _Op
from ._records import _POLICY, _end, _log
from ._retry import RetryPolicy
from ._util import timeout_error, wait_until


class Transfer:
    """A write posted by :meth:`Engine.post_write`, :meth:`Engine.post_write_imm` or
    :meth:`TransferBatch.post`: already on its way; ``await transfer`` (or
    :meth:`wait`) returns once the transport is done with the source buffers, or raises the
    operation's error.

    Awaiting only observes: cancelling the awaiting task, or a :meth:`wait` timing out,
    leaves the transfer going (a posted request is never taken back; the engine holds its
    buffers until the completion), and it may be awaited again, from any task of the loop,
    any number of times (each await of a failed transfer raises the same exception). An
    awaited transfer that finished costs no event-loop round trip."""

    __slots__ = ("__weakref__", "_again", "_bg", "_engine", "_exc", "_fenced", "_finished", "_observed",
                 "_op", "_retry", "_what")

    def __init__(
        self,
        engine: OpLife,
        what: str,
        op: _Op | None = None,
        again: Callable[[float | None], Awaitable[bool]] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._engine = engine
        self._what = what
        self._op = op  # a group posted in the caller's call: its completion is awaited
        self._again = again  # posts the work anew (a retry after a broken connection)
        self._retry = retry
        self._bg: Any = None  # the event that ends it: its background task's, or a fence's (_when_set)
        self._exc: BaseException | None = None
        self._finished = op is None  # until _go starts a task (an empty batch: done)
        self._observed = False
        self._fenced = False  # _bg is a GPU fence's event (a spin can see it set), not a task's

    @classmethod
    def _when_set(cls, engine: OpLife, what: str, ev: Any) -> Transfer:
        """A transfer that has finished once the engine's event ``ev`` is set (work with
        nothing to do after its end, e.g. a CUDA-IPC copy whose fence also credits it):
        awaited as one carried by a task, without the task."""
        t = cls(engine, what)
        t._finished = False
        t._bg = ev
        t._fenced = True
        return t

    def _go(self, run: Callable[[], Awaitable[Any]]) -> None:
        """Hands the rest of the work to a background task of the engine's event loop."""
        self._finished = False
        self._op = None
        ev = self._bg = self._engine._event()

        async def carry() -> None:
            try:
                await run()
            except Exception as exc:
                self._exc = exc
            finally:
                ev.set()

        bridge = self._engine._bridge
        assert bridge is not None
        bridge.spawn(carry)

    @property
    def done(self) -> bool:
        """True once the operation finished, successfully or not: awaiting it then returns
        (or raises) without waiting. Raises nothing; O(1): at most one native call and a read
        of the completion records that came in quietly."""
        if self._finished:
            return True
        op = self._op
        if op is not None:
            eng = self._engine
            if not op.event.is_set() and not eng._closed and lib.aio_quiet_waiters(eng._h, 0):
                eng._drain()  # its completion may have come in quietly
            return op.event.is_set() is True
        return self._bg.is_set() is True

    def __await__(self) -> Any:
        return self.wait().__await__()

    async def wait(self, *, timeout: float | None = None, loop_spin_us: float | None = None) -> None:
        """Waits until the transfer finished; raises its error (:class:`TransferError`
        subclasses, :class:`EngineClosed`), or :class:`TransferTimeout` when ``timeout``
        seconds pass first (the transfer goes on; await it again), :class:`InvalidArgument` for
        a bad ``timeout`` or a ``loop_spin_us`` outside [0, 100000]. Cancellable without
        affecting the transfer. A finished transfer returns after one cancellation check, no
        event-loop round trip; otherwise the task sleeps until its completion wakes it, after
        a spin as :meth:`ImmCounter.wait` does it (``loop_spin_us`` for this wait, or else the
        engine's: the event loop's thread drives the completion queues and the GPU's
        completion words for up to that long and no longer than ``timeout``, blocking the
        loop)."""
        end = _end(timeout)
        eng = self._engine
        spin = eng._loop_spin_ns if loop_spin_us is None else spin_ns(loop_spin_us)
        waited = False
        while not self._finished:
            op = self._op
            if op is not None:
                if not op.event.is_set():
                    # its completion record wakes the loop only while someone waits for it
                    # (a closing engine sets every pending event itself)
                    h = None if eng._closed else eng._h
                    if h is not None and lib.aio_quiet_waiters(h, 1):
                        eng._drain()  # records (perhaps its own) came in quietly
                    try:
                        if spin and not op.event.is_set():
                            eng._spin_until(op.event.is_set, spin, end)
                        if not op.event.is_set():
                            waited = True
                            if not await wait_until(op.event, end):
                                assert timeout is not None
                                raise timeout_error(self._what, timeout)
                    finally:
                        if h is not None and not eng._closed:
                            lib.aio_quiet_waiters(h, -1)
                self._op = None
                self._finished = True
                try:
                    eng._outcome(op, self._what)
                except PeerUnreachable as exc:
                    self._retry_later(exc)
                except Exception as exc:
                    self._exc = exc
                continue
            # (only a fence's event: a task's needs the loop to run)
            if spin and self._fenced and not self._bg.is_set() and not eng._closed:
                eng._spin_until(self._bg.is_set, spin, end)
            if not self._bg.is_set():
                waited = True
                if not await wait_until(self._bg, end):
                    assert timeout is not None
                    raise timeout_error(self._what, timeout)
            self._finished = True
        if not waited:
            await eng._checkpoint_if_cancelled()
        self._observed = True
        if self._exc is not None:
            raise self._exc

    def _retry_later(self, exc: PeerUnreachable) -> None:
        """The posted group failed with a broken connection: re-post as the retry policy
        says, in a background task (so that the work goes on whoever awaits it)."""
        eng, again, retry, what = self._engine, self._again, self._retry, self._what
        if again is None or getattr(exc, "_final", False):
            self._exc = exc
            return

        async def run() -> None:
            token = _POLICY.set(retry) if retry is not None else None
            try:
                await eng._retry_after(exc, again, None, retry or eng._retry, what)
            finally:
                if token is not None:
                    _POLICY.reset(token)

        obs = eng._obs  # observed: the re-posts are one more operation, its attempts retries
        self._go(run if obs is None else obs._carry(obs._start(what), run))

    def __del__(self) -> None:
        try:
            if self._observed:
                return
            op = self._op
            failed = self._exc is not None or (op is not None and op.done and op.status != 0)
            if failed:
                _log.warning("a posted transfer failed and was never awaited", op=self._what)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
