"""Rules of an operation's life, sans I/O: plain objects fed the time and what the engine saw,
answering what to do next. No fabric, no event loop, no threads; the engine
(aiote/_core/_life.py) measures, asks and acts, and tests/test_rules.py feeds them sequences
of events. (The credit rules are in _credits.py.)

- :class:`RetryPlan`: after a broken connection, whether to post again and after what pause.
- :class:`GroupWatch`: while a posted group is awaited with a stall bound or with a link
  down, when to look again and what the look means (done waiting, deadline, progress, the
  peer unreachable, the transfer stalled).
"""

from __future__ import annotations

from typing import Literal

from ._retry import RetryPolicy

__all__ = ["LINK_POLL", "GroupWatch", "RetryPlan", "Verdict"]

LINK_POLL = 0.25  # while a link is down, how often a watched group checks its peer's NICs


class RetryPlan:
    """The re-posts of one operation after a broken connection: up to ``policy.attempts``,
    each after ``policy.delay(n)``, none that would start past ``connect_timeout`` after the
    first failure (``t``) or past the operation's deadline ``end``."""

    __slots__ = ("end", "n", "peer_end", "policy")

    def __init__(self, policy: RetryPolicy, end: float | None, t: float) -> None:
        self.policy = policy
        self.end = end
        self.peer_end = t + policy.connect_timeout
        self.n = 0  # attempts started so far

    def next_pause(self, final: bool, t: float) -> float | None:
        """After a failed attempt at time ``t``: the pause before the next one, or None to
        give up (raise the failure). ``final``: the failure says no retry can help."""
        if final or self.n >= self.policy.attempts:
            return None
        self.n += 1
        pause = self.policy.delay(self.n)
        if t + pause >= self.peer_end or (self.end is not None and t + pause >= self.end):
            return None
        return pause


Verdict = Literal["timeout", "wait", "unreachable", "stalled"]


class GroupWatch:
    """One posted group awaited with a stall bound (``stall``: seconds without a request
    completing) or while a link is down. Progress is a change in the count of its requests
    still pending; the peer is unreachable once every NIC that reaches it has been down for
    more than ``connect_timeout``."""

    __slots__ = ("connect_timeout", "end", "last", "moved", "stall")

    def __init__(
        self, end: float | None, stall: float | None, connect_timeout: float, pending: int, t: float
    ) -> None:
        self.end = end
        self.stall = stall
        self.connect_timeout = connect_timeout
        self.last = pending  # requests pending at the last progress
        self.moved = t  # when it last made progress

    def wake_at(self, any_down: bool, t: float) -> float | None:
        """When to look again at the latest (None: only when it completes): the deadline,
        the stall bound, and every LINK_POLL while a link is down."""
        stalled_at = None if self.stall is None else self.moved + self.stall
        marks = [x for x in (self.end, stalled_at) if x is not None]
        if any_down:
            marks.append(t + LINK_POLL)
        return min(marks) if marks else None

    def on_wake(self, t: float, completed: bool, pending: int, all_down_for: float) -> Verdict:
        """Woken at ``t`` without its completion having been seen: ``completed`` (it came
        meanwhile), ``pending`` (its requests still pending), ``all_down_for`` (how long
        every NIC to its peer has been down; 0: one is up)."""
        if self.end is not None and t >= self.end:
            return "timeout"
        if completed or pending != self.last:
            self.last, self.moved = pending, t
            return "wait"
        if all_down_for > self.connect_timeout:
            return "unreachable"
        if self.stall is not None and t - self.moved >= self.stall:
            return "stalled"
        return "wait"
