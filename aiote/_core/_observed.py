"""The observed layer: every awaited operation goes through ``_attempts``; an engine opened with
``observe=`` observes each one there (see _observe.py), an engine without it goes on to
OpLife's at the cost of one ``is None`` test and a plain call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ._errors import PeerUnreachable
from ._life import OpLife
from ._observe import Observer
from ._retry import RetryPolicy


class Observed(OpLife):
    """OpLife's operations, observed when the engine has an :class:`Observer`."""

    @property
    def observer(self) -> Observer | None:
        """This engine's :class:`Observer` (metrics and spans; the flows record their calls and
        requests through it), or None when it was opened without ``observe``. O(1), raises
        nothing."""
        return self._obs

    def _attempts(  # returns OpLife's coroutine itself: no coroutine of its own
        self,
        attempt: Callable[[float | None], Awaitable[Any]],
        timeout: float | None,
        retry: RetryPolicy | None,
        what: str,
    ) -> Coroutine[Any, Any, None]:
        obs = self._obs
        if obs is None:
            return OpLife._attempts(self, attempt, timeout, retry, what)
        return obs._attempts(OpLife._attempts, self, attempt, timeout, retry, what)

    def _retry_after(  # the slow path: posting again after a broken connection
        self,
        exc: PeerUnreachable,
        attempt: Callable[[float | None], Awaitable[Any]],
        end: float | None,
        policy: RetryPolicy,
        what: str,
    ) -> Coroutine[Any, Any, None]:
        obs = self._obs
        if obs is not None:  # each re-post counted as a retry of the operation observed
            attempt = obs._counting(attempt)
        return OpLife._retry_after(self, exc, attempt, end, policy, what)
