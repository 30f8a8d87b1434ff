"""Retry policy: what aiote retries on its own, and for how long."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._errors import InvalidArgument

__all__ = ["RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """What an operation does about transient failures (``open_engine(retry=...)`` sets the
    engine's default; every operation takes ``retry=`` to override it).

    - **Backpressure is not an error**: a full queue or work-request table makes posting
      wait for room, whatever the policy.
    - **A peer that does not answer** (nothing listening yet, a restarting process) is tried
      again until the operation's deadline, but for at most ``connect_timeout`` seconds;
      then the operation raises :class:`~aiote.PeerUnreachable`. This is also the bound on
      noticing a dead peer that a connection attempt cannot reach.
    - **A broken connection** (the peer process died or restarted, the connection was reset)
      fails the operation with :class:`~aiote.PeerUnreachable`; the operation is posted again
      up to ``attempts`` more times, ``backoff`` seconds after the first failure, doubling up to
      ``max_backoff``, within its deadline. A write that failed this way may have landed before
      the connection broke; posting it again writes the same bytes. So re-posting is
      at-least-once: a write with an immediate (or ``write_imm``) that landed before the break
      gives the peer's ``imm_counter`` its credit again. Where every credit must count exactly
      once, pass ``RetryPolicy(attempts=0)`` and decide at the application level (the peer's
      counter says what arrived).
    - **A NIC whose link goes down** moves its work to the engine's other NICs (failover; see
      the guide), whatever the policy.
    - **An operation that makes no progress** (none of its requests completed) for
      ``stall_timeout`` seconds raises :class:`~aiote.TransferStalled` (a
      :class:`~aiote.TransferTimeout`), so nothing waits forever by default, deadline or not.
      A request completing is progress: a peer that keeps taking bytes never trips it, but a
      single request larger than the link moves in ``stall_timeout`` does; raise it for such
      links, or pass ``None`` to wait as long as the operation's own deadline says.
    - **Permanent errors are never retried**: a bad key or range (:class:`~aiote.RemoteAccessError`),
      a protection error, invalid arguments, timeouts, cancellation.

    ``RetryPolicy(attempts=0)`` turns re-posting off. Building one checks every field and raises
    :class:`~aiote.InvalidArgument` for a negative, non-finite or non-numeric one (``attempts``: an int;
    ``stall_timeout``: > 0 or None);
    O(1), no I/O.
    """

    attempts: int = 3
    backoff: float = 0.05
    max_backoff: float = 1.0
    connect_timeout: float = 5.0
    stall_timeout: float | None = 30.0

    def __post_init__(self) -> None:
        st = self.stall_timeout
        bad = isinstance(st, bool) or not isinstance(st, (int, float)) or not math.isfinite(st) or st <= 0
        if st is not None and bad:
            raise InvalidArgument(f"stall_timeout must be a finite number of seconds > 0 or None, not {st!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 0:
            raise InvalidArgument(f"attempts must be an integer >= 0, not {self.attempts!r}")
        for name in ("backoff", "max_backoff", "connect_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidArgument(f"{name} must be a finite number of seconds >= 0, not {v!r}")

    def delay(self, attempt: int) -> float:
        """The pause before re-post number ``attempt`` (1-based). Pure arithmetic, O(1); raises
        nothing for ``attempt`` up to 1024 (``OverflowError`` past that)."""
        return float(min(self.max_backoff, self.backoff * (2 ** (attempt - 1))))
