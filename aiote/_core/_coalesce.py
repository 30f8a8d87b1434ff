"""Coalesced sends: messages that several tasks send to one peer at once travel as one.

Theory of operation. A send that posted its message yields once right after (a small
message that ended in the posting call returns from there; a larger one goes on to await
its completion). While it sits at that schedule point, its connection (rail, peer) has an
open :class:`Window`, and sends to the same connection from other tasks join the window
instead of each posting a message of their own. When the first send resumes, it closes the
window and posts what joined as one message (the core's ``aio_submit_sendparts`` lays each
payload behind its length, 4 bytes little-endian, straight into a send slot; a single joined
message goes as it is), before any other task can run. The receiving engine splits it again (:func:`spans`)
and hands out the messages one by one, in order. The window never outlives that schedule
point: a send's completion may wait for the receiver to take earlier messages, and the
joined ones must not wait behind it (the receiver may need them first).

Each joined send then learns what happened to it, from the window alone:

- ``POSTED``: the combined message was posted. The joined send awaits that message's
  completion as if it were its own (each joined send with its own deadline); a failure or a
  fail-over sends its message again by itself, as a retry of a single message would.
- ``ALONE``: nothing was posted (no room on the connection, the transport pushed back, an
  error): the joined send posts its own message the ordinary way.
- ``LEFT``: the joined send timed out or was cancelled while the window was still open: its
  message is not in the combined one.

So a message is posted once, by whichever path, and a lone send (nobody joining) costs what
it did before: its message is posted before its schedule point, not after. Nothing here does
I/O; the engine (``_messages.py``, ``_combined.py``) feeds the events (join, leave, close,
posted, alone, done) and the tests feed them directly.
"""

from __future__ import annotations

import struct
from typing import Any

WAITING, POSTED, ALONE, LEFT = "waiting", "posted", "alone", "left"
_LEN = struct.Struct("<I")
MAX_MEMBERS = 256  # messages in one combined message at most


class Member:
    """One send that joined a :class:`Window`: its payload and what became of it."""

    __slots__ = ("data", "state")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.state = WAITING


def opens_window(nbytes: int, limit: int) -> bool:
    """Whether a send of ``nbytes`` that just went alone opens a window for the sends behind
    it (``limit``: the largest combined message): only when two messages of its own size
    could join. The window costs the send a schedule point; the sends behind a large one are
    likely as large, and one of them alone in the combined message would cost what it costs
    going by itself."""
    return 2 * (_LEN.size + nbytes) <= limit


class Window:
    """The sends joined to one connection while a send to it is at its schedule point.
    ``limit``: the largest combined message (both engines' ``max_message_size``); ``event``:
    set once every member's state is final and, for a posted message, it has completed."""

    __slots__ = ("event", "flight", "limit", "members", "nbytes", "op", "open", "posted_at")

    def __init__(self, limit: int, event: Any) -> None:
        self.limit = limit
        self.event = event
        self.members: list[Member] = []
        self.nbytes = 0  # of the combined message so far: every payload and its length
        self.open = True
        self.op: Any = None  # the posted combined message (POSTED)
        self.posted_at = 0.0
        self.flight = 0  # members of the posted message that have not finished with it

    def join(self, data: memoryview) -> Member | None:
        """A send of ``data`` joins, or None: the window is closed or full (the send goes
        by itself)."""
        size = self.nbytes + _LEN.size + data.nbytes
        if not self.open or size > self.limit or len(self.members) >= MAX_MEMBERS:
            return None
        m = Member(data)
        self.members.append(m)
        self.nbytes = size
        return m

    def leave(self, m: Member) -> bool:
        """``m`` timed out or was cancelled: True when it left before anything was posted
        (its message will not be), False when its state is already final."""
        if m.state != WAITING:
            return False
        self.members.remove(m)
        self.nbytes -= _LEN.size + m.data.nbytes
        m.state = LEFT
        return True

    def close(self) -> list[Member]:
        """The first send resumed: nobody joins any more. Returns the members to post."""
        self.open = False
        return self.members

    def posted(self, op: Any, done: bool, at: float) -> None:
        """The combined message of every member was posted as ``op`` at time ``at``; each
        member reads its outcome as its own. ``done``: it has completed already, so
        ``event`` is set now; else the operation's completion sets it (the caller makes
        ``event`` the operation's), and a member that wakes before (to look for a stall or
        a lost link) goes on awaiting the operation itself, watched from ``at``."""
        self.op = op
        self.posted_at = at
        self.flight = len(self.members)
        self._final(POSTED, done)

    def alone(self) -> None:
        """Nothing was posted: every member sends its own message."""
        self._final(ALONE, True)

    def done(self, m: Member) -> bool:
        """A member of the posted message finished with it (any outcome): True for the last
        one, whose caller then gives the connection's in-flight count back."""
        assert m.state == POSTED
        self.flight -= 1
        return self.flight == 0

    def _final(self, state: str, wake: bool) -> None:
        for m in self.members:
            m.state = state
        self.open = False
        if wake:
            self.event.set()


def spans(buf: Any, start: int, stop: int) -> list[tuple[int, int]] | None:
    """The (start, stop) of each message of the combined body ``buf[start:stop]``, or None
    when it is malformed (a length past its end, or nothing in it)."""
    out: list[tuple[int, int]] = []
    off = start
    unpack = _LEN.unpack_from
    while off < stop:
        if off + _LEN.size > stop:
            return None
        (n,) = unpack(buf, off)
        off += _LEN.size
        if off + n > stop:
            return None
        out.append((off, off + n))
        off += n
    return out or None
