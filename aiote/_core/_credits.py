"""The rules of deferred credits, sans I/O: plain objects, no fabric, no event loop, no threads.

An operation over several routes (striped, or retried on another NIC after a link failure)
cannot carry its immediate in its data requests: a request stranded on a NIC that lost its
link may still land when the link comes back, after its copy was re-posted elsewhere, and
would count twice. So the immediate is deferred: once the data is in place, the sender sends
the credits in an internal message carrying a sequence number, which the receiver counts once
per (sender, number) (:class:`CreditsSeen`). Whether the credits go at all, and when, depends
on how the data part of the operation ended (:func:`after_data`):

- it completed: send now;
- it timed out after posting something: send once the operation settled and each of its
  requests was posted and landed (the timeout's ``settled()`` waits for that);
- it was cancelled: when the groups that still count (not moved by a failover) had posted
  all of the operation's rows, send once each of them completed without error; otherwise
  never (only part of the data may land), nor once the engine closed;
- it failed: never.

The engine (aiote/_core/_messages.py) feeds these functions what happened and does what they
return; tests/test_credits.py feeds them event sequences, races included.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "CreditsSeen",
    "GroupView",
    "Never",
    "SendAfterTimeout",
    "SendNow",
    "SendWhenLanded",
    "after_data",
    "all_landed",
]


class GroupView(Protocol):
    """What the rules read of one posted group of an operation (the engine's ``_Op``)."""

    @property
    def posted(self) -> int: ...  # requests handed to the transport so far

    @property
    def done(self) -> bool: ...  # its completion arrived

    @property
    def status(self) -> int: ...  # 0: every request of it landed

    @property
    def failover(self) -> bool: ...  # a link of it went down: its work moved to another NIC


@dataclass(frozen=True)
class SendNow:
    """Send the credits now."""


@dataclass(frozen=True)
class SendWhenLanded:
    """Send the credits once every one of ``groups`` settled, if each landed
    (:func:`all_landed`); otherwise never."""

    groups: tuple[GroupView, ...]


@dataclass(frozen=True)
class SendAfterTimeout:
    """Send the credits once the timed-out operation settled, if its data all landed: the
    timeout carries both waits (``settled()`` and whether every part was posted and landed),
    and ``settled()`` then waits for the credits too."""


@dataclass(frozen=True)
class Never:
    """Never send them: the data is not (known to be) all in place. ``why``: for the log."""

    why: str


Decision = SendNow | SendWhenLanded | SendAfterTimeout | Never


def after_data(
    outcome: str, groups: Sequence[GroupView], rows: int, *, closed: bool = False, posted_any: bool = True
) -> Decision:
    """What to do with an operation's deferred credits once its data part ended.

    ``outcome``: ``"completed"``, ``"timeout"``, ``"cancelled"`` or ``"failed"``; ``groups``:
    every group the operation posted, moved ones included; ``rows``: the requests of the
    operation; ``closed``: the engine closed; ``posted_any`` (a timeout): something was posted
    before the deadline (a timeout while nothing went out leaves nothing to wait for).
    O(groups); no I/O."""
    if outcome == "completed":
        return SendNow()
    if outcome == "timeout":
        return SendAfterTimeout() if posted_any else Never("nothing was posted before the deadline")
    if outcome == "cancelled":
        live = tuple(op for op in groups if not op.failover)
        if not live or sum(op.posted for op in live) != rows:
            return Never("cancelled before every request was posted")
        if closed:
            return Never("the engine closed")
        return SendWhenLanded(live)
    return Never("a request failed")


def all_landed(groups: Sequence[GroupView]) -> bool:
    """Every group completed without error (call once each settled)."""
    return all(op.done and op.status == 0 for op in groups)


class CreditsSeen:
    """The receiving side: credit messages counted, by (sender, sequence number), so that a
    message posted twice (re-posted after a failover, or sent again after a cancellation
    with the numbers already drawn) counts once. Remembers the last ``limit`` messages: a
    copy older than that would count again, which the sender's single re-post after a
    failover never comes near."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()

    def first(self, sender: bytes, seq: int) -> bool:
        """True the first time (count it), False for a copy (drop it). O(1)."""
        key = (sender, seq)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._limit:
            self._seen.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._seen)
