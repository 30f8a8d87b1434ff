"""The observed layer: every awaited operation goes through ``_attempts``; an engine opened with
``observe=`` observes each one there (see _observe.py), an engine without it goes on to
OpLife's at the cost of one ``is None`` test and a plain call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from ._errors import PeerUnreachable, RemoteAccessError
from ._life import OpLife
from ._observe import Observer, Tries, _OpRecord, check_observe
from ._records import _GROUPS, _check_retry, _end, _GroupTap
from ._retries import Retries, _retryable
from ._retry import RetryPolicy


class Observed(OpLife):
    """OpLife's operations, observed when the engine has an :class:`Observer`."""

    @property
    def observer(self) -> Observer | None:
        """This engine's :class:`Observer` (metrics and spans; the flows record their calls and
        requests through it), or None when it was opened without ``observe``. O(1), raises
        nothing."""
        return self._obs

    def _observe_as(self, observe: Any) -> None:
        """Observes this engine's operations from now on as ``observe`` (an
        :class:`Observability`, or None: not at all) says, through an observer kept per
        ``observe`` object (made and bound the first time, closed with the engine). For the
        benchmarks of what observing costs, which run every setting on the same engines, so
        that the settings differ by nothing but the observation code. Call it only while no
        operation of this engine is in flight and the engine is open. Raises InvalidArgument
        for an unusable ``observe`` (see ``open_engine``)."""
        self._check_open()
        if observe is None:
            self._obs = None
            return
        for obs in self._observers:
            if obs.options is observe:
                self._obs = obs
                return
        check_observe(observe)
        made = Observer(observe, self._rails, self._h)
        made._bind(self._bridge, self._event)
        self._observers.append(made)
        self._obs = made

    def _attempts(  # returns OpLife's coroutine itself: no coroutine of its own
        self,
        attempt: Callable[[float | None], Awaitable[Any]],
        timeout: float | None,
        retry: RetryPolicy | None,
        what: str,
    ) -> Coroutine[Any, Any, None]:
        obs = self._obs
        if obs is None:
            return Retries._attempts(self, attempt, timeout, retry, what)
        outer = _GROUPS.get()  # inside an operation observed already: part of it
        if outer is not None and (type(outer) is _OpRecord or type(outer) is _GroupTap):
            return Retries._attempts(self, attempt, timeout, retry, what)
        return self._observed(obs, attempt, timeout, retry, what)

    async def _observed(
        self,
        obs: Observer,
        attempt: Callable[[float | None], Awaitable[Any]],
        timeout: float | None,
        retry: RetryPolicy | None,
        what: str,
    ) -> None:
        """``Retries._attempts`` as one observed operation: the same steps, around the same
        ``_enter_attempts`` and ``_leave_attempts``, in one coroutine rather than one around the
        other (a coroutine layer is a good share of what observing costs). The record is made
        once the arguments passed their checks (refused arguments are no operation) and is
        ``_GROUPS`` while the operation runs (the groups it begins are its, its re-posts
        retries: see :meth:`Observer._counting`)."""
        _check_retry(retry)
        end = _end(timeout)
        rec = _OpRecord(obs, what)
        token = _GROUPS.set(rec)
        policy = self._enter_attempts(retry)
        try:
            try:
                await self._attempt_retried(attempt, timeout, end, retry, what)
            finally:
                self._leave_attempts(policy)
        except BaseException as failed:
            _GROUPS.reset(token)
            obs._end(rec, failed)
            raise
        _GROUPS.reset(token)
        obs._end(rec, None)

    async def _observed_kept(
        self,
        obs: Observer,
        table: np.ndarray,
        attempt: Callable[[float | None], Awaitable[Any]],
        timeout: float | None,
        retry: RetryPolicy | None,
        what: str,
    ) -> None:
        """``Retries._attempts`` of an operation whose every attempt posts ``table`` as its one
        group (a kept request, a batch), observed without a record when
        :meth:`Observer._plain` said so: its start time and, at its end, its table's run
        (what :meth:`_observed` counts for it, without the record, the ``_GROUPS`` binding and
        the group's tap)."""
        _check_retry(retry)
        end = _end(timeout)
        t0 = obs._kept_start()
        policy = self._enter_attempts(retry)
        tries = None
        try:
            try:
                await attempt(timeout)
            except (PeerUnreachable, RemoteAccessError) as exc:
                if not _retryable(exc):
                    raise
                tries = Tries(attempt)
                await Retries._retry_after(self, exc, tries, end, retry or self._retry, what)
            finally:
                self._leave_attempts(policy)
        except BaseException as failed:
            obs._kept_end(table, what, t0, tries, failed)
            raise
        obs._kept_end(table, what, t0, tries, None)

    def _retry_after(  # the slow path: posting again after a broken connection
        self,
        exc: PeerUnreachable | RemoteAccessError,
        attempt: Callable[[float | None], Awaitable[Any]],
        end: float | None,
        policy: RetryPolicy,
        what: str,
    ) -> Coroutine[Any, Any, None]:
        obs = self._obs
        if obs is not None:  # each re-post counted as a retry of the operation observed
            attempt = obs._counting(attempt)
        return Retries._retry_after(self, exc, attempt, end, policy, what)
