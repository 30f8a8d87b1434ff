"""An awaited operation's attempts: the retry policy in force while it runs, the engine busy
with it, and the re-posts after a broken connection (or a refusal that may have been a peer's
death) within the policy's attempts, its ``connect_timeout`` and the operation's deadline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ._completions import Completions
from ._errors import PeerUnreachable, RemoteAccessError
from ._records import _POLICY, _check_retry, _end, _left
from ._retry import RetryPolicy
from ._rules import RetryPlan
from ._util import now


def _retryable(exc: BaseException) -> bool:
    """Whether an attempt's failure may be posted again: a broken connection, or a refusal
    that may have been a peer's death (see :meth:`Retries._retry_after`)."""
    return isinstance(exc, PeerUnreachable) or getattr(exc, "_closed_by_peer", False)


class Retries(Completions):
    """An operation's attempts under its retry policy (``OpLife`` posts each attempt)."""

    async def _attempts(
        self,
        attempt: Callable[[float | None], Awaitable[Any]],
        timeout: float | None,
        retry: RetryPolicy | None,
        what: str,
    ) -> None:
        """Runs ``attempt(time_left)``, re-running it after a broken connection as the retry
        policy says (see :class:`RetryPolicy`). The policy is checked before anything is
        posted, and is in force (``connect_timeout`` included) for every group it posts.
        (``Observed._observed`` takes these steps for an observed operation, in one coroutine
        of its own, around the same :meth:`_enter_attempts` and :meth:`_leave_attempts`.)"""
        _check_retry(retry)
        end = _end(timeout)
        token = self._enter_attempts(retry)
        try:
            await self._attempt_retried(attempt, timeout, end, retry, what)
        finally:
            self._leave_attempts(token)

    async def _attempt_retried(
        self,
        attempt: Callable[[float | None], Awaitable[Any]],
        timeout: float | None,
        end: float | None,
        retry: RetryPolicy | None,
        what: str,
    ) -> None:
        """``attempt(timeout)``, posted again as :meth:`_retry_after` says after a failure
        that may be posted again (:func:`_retryable`)."""
        try:
            await attempt(timeout)
        except (PeerUnreachable, RemoteAccessError) as exc:
            if not _retryable(exc):
                raise
            await self._retry_after(exc, attempt, end, retry or self._retry, what)

    def _enter_attempts(self, retry: RetryPolicy | None) -> Any:
        """An awaited operation starts (its arguments checked): ``retry`` in force for every
        group it posts, the engine busy with it. Returns what :meth:`_leave_attempts` takes."""
        token = _POLICY.set(retry) if retry is not None else None
        self._busy += 1
        return token

    def _leave_attempts(self, token: Any) -> None:
        """An awaited operation ends, however: its policy out of force, the engine no longer
        busy with it, and the peers' book swept when a sweep is due."""
        self._busy -= 1
        if token is not None:
            _POLICY.reset(token)
        if self._book.due:
            self._maybe_sweep()

    async def _retry_after(
        self,
        exc: PeerUnreachable | RemoteAccessError,
        attempt: Callable[[float | None], Awaitable[Any]],
        end: float | None,
        policy: RetryPolicy,
        what: str,
    ) -> None:
        """Re-posts after a broken connection: up to ``attempts`` times, within the
        operation's deadline. A new attempt is started only within ``connect_timeout`` of the
        first failure, and an attempt towards a peer that does not answer gives up after
        ``connect_timeout`` (in :meth:`_run_group`), so a dead peer is reported within about
        ``connect_timeout`` plus the pauses; an attempt that is moving data has the
        operation's whole remaining time. ``exc`` may also be a refusal that may have been a
        peer's death (:func:`_retryable`; tcp: the peer closed the connection, see
        ``_wire._completion_error``): the re-post tells them apart, refused again (the peer
        lives and refuses it: that RemoteAccessError propagates) or not reached (the peer is
        gone: PeerUnreachable, retried on under the same plan)."""
        plan = RetryPlan(policy, end, now())
        while True:
            pause = plan.next_pause(getattr(exc, "_final", False), now())
            if pause is None:
                raise exc
            self._log.info("posting again after a broken connection", op=what, attempt=plan.n, error=str(exc))
            await self._pause(pause)
            try:
                await attempt(_left(end))
                return
            except PeerUnreachable as again:
                exc = again
