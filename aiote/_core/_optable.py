"""The operation table, sans I/O: the groups of work requests an engine has posted, and the
rules of each one's life, as plain objects with no fabric, no event loop and no threads.

An operation (a write, a paged write, a send...) posts its rows as one group per NIC (and
stream); each group is an :class:`_Op` in the :class:`OpTable` from the moment it is opened
until its completion record arrives. The engine (aiote/_core/_life.py, _completions.py,
_rails.py) feeds the table what it sees and does what the answers say:

- posting (:class:`Posting`): the transport took ``k`` requests (or refused with an error,
  or took none because its queues are full or the peer is still connecting): post more,
  wait and how long, give up because the peer never answered (``connect_timeout``), or
  seal the group because everything is posted;
- a link went down before a group posted anything (:meth:`_Op.move_before_posting`) or while
  it was in flight (:meth:`OpTable.link_down`): which groups must move their rows to the
  peer's other NICs (:func:`reroute`), their first requests staying owned by the transport
  until it lets go of them (stranded: :meth:`OpTable.stranded`);
- its completion record arrived (:meth:`OpTable.complete`), or the engine closed
  (:meth:`OpTable.close`): whom to wake, and what the group's end means
  (:meth:`_Op.outcome`: landed, moved to other NICs, closed, failed);
- the awaiting task was cancelled (:meth:`_Op.must_settle`): whether the buffers must stay
  owned until the transport is done with them (a posted request cannot be taken back);
- several NICs failed differently (:func:`merge_nic_failures`): which one error the caller
  sees.

The waits themselves (deadline, stall bound, every link down) are :class:`GroupWatch` and the
re-posts after a broken connection :class:`RetryPlan` (aiote/_core/_rules.py); the deferred
credits of operations over several routes are aiote/_core/_credits.py. tests/test_optable.py
drives all of them with hypothesis state machines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from ._errors import TransferTimeout

__all__ = [
    "OpTable",
    "Outcome",
    "Posting",
    "Step",
    "merge_nic_failures",
    "reroute",
]

CLOSED_STATUS = -(1 << 30)  # the status of a group whose engine closed before its completion

Outcome = Literal["landed", "moved", "closed", "failed"]
Step = Literal["sealed", "wait", "error", "stalled"]


class _Op:
    """One posted group of work requests, from its opening to its completion record."""

    __slots__ = (
        "alts", "done", "event", "failover", "g", "names", "obs", "path", "posted", "prov_errno", "rails",
        "refs", "status",
    )

    def __init__(self, refs: Any, event: Any) -> None:
        self.event = event  # what wakes its waiter (set by the engine, never read here)
        self.g = -1  # its native group, once one was opened (the stall watch reads its progress)
        self.posted = 0  # requests of the group handed to the transport so far
        self.status = 0
        self.prov_errno = 0
        self.refs = refs  # what must stay alive until the completion (buffers, rows)
        self.done = False  # the group's completion record arrived
        self.rails: set[int] | None = None  # the local rails it posts on, where known
        self.alts: frozenset[int] = frozenset()  # every rail of its peer's path
        self.failover = False  # woken because a rail of it lost its link: its work moved
        # the (rail, fi_addr) pairs its rows name, where known (a connection's opening): the
        # engine may forget other peers while it is pending (see Rails._maybe_sweep)
        self.names: frozenset[tuple[int, int]] | None = None
        self.path: Any = None  # the routes of its one peer, where known (see Rails._shm_peers)
        self.obs: Any = None  # a posted operation's observation, ended by its completion (_drain)

    def complete(self, status: int, prov_errno: int) -> None:
        """Its completion record arrived: the transport let go of every request (and of
        ``refs``)."""
        self.done = True
        self.status = status
        self.prov_errno = prov_errno
        self.refs = None

    def move_before_posting(self, down: set[int]) -> bool:
        """Before anything of it was posted: True (and marked moved) when one of its rails is
        down and the peer has another NIC in rotation; its rows go there instead."""
        rails = self.rails
        if rails and down and rails & down and self.alts - down:
            self.failover = True
            return True
        return False

    def outcome(self) -> Outcome:
        """What its end means, once woken: ``moved`` (a link of it went down before its
        completion: re-post the work on the peer's other NICs; the group stays owned until
        the transport lets go), ``closed`` (the engine closed first), ``failed`` (a request
        failed: ``status``/``prov_errno`` say why) or ``landed``."""
        if self.failover and not self.done:
            return "moved"
        if self.status == CLOSED_STATUS:
            return "closed"
        if self.status:
            return "failed"
        return "landed"

    def landed(self) -> bool:
        """Every request of it landed (completed without error and not moved)."""
        return self.done and self.status == 0 and not self.failover

    def must_settle(self, final: bool = False) -> bool:
        """Its waiter was cancelled (or failed with ``final``: nothing to wait for): True when
        requests of it are still with the transport, so its buffers must stay owned until its
        completion (bounded by ``cancel_grace``). Not after the engine closed: its endpoints
        are gone, and the transport with them."""
        return self.posted > 0 and not self.done and not final and self.status != CLOSED_STATUS


class OpTable:
    """Every group of an engine between its opening and its completion record, by token."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: dict[int, _Op] = {}

    def __len__(self) -> int:
        return len(self.ops)

    def __bool__(self) -> bool:
        return bool(self.ops)

    def __iter__(self) -> Iterator[_Op]:
        return iter(self.ops.values())

    def add(self, token: int, op: _Op) -> None:
        """``op`` opened a native group under ``token``: its completion record will find it."""
        self.ops[token] = op

    def complete(self, token: int, status: int, prov_errno: int) -> _Op | None:
        """The completion record of ``token``: the group to wake, or None (not ours, or
        already ended by a close). O(1)."""
        op = self.ops.pop(token, None)
        if op is not None:
            op.complete(status, prov_errno)
        return op

    def link_down(self, rail: int, down: set[int]) -> list[_Op]:
        """``rail`` lost its link (``down``: every rail out of rotation now, ``rail``
        included): the in-flight groups posted on it whose peer has another NIC in rotation,
        marked moved; wake each (its waiter re-posts the work). Groups with nowhere to go stay:
        their requests wait in the transport for a link. O(pending)."""
        moved = []
        for op in self.ops.values():
            if op.rails is None or rail not in op.rails or op.done or op.failover:
                continue
            if op.alts - down:
                op.failover = True
                moved.append(op)
        return moved

    def stranded(self) -> list[_Op]:
        """Groups a failover moved whose first requests the transport still owns (they may
        still land until their completion)."""
        return [op for op in self.ops.values() if op.failover and not op.done]

    def close(self) -> list[_Op]:
        """The engine closed: every pending group ends with the closed status; wake each."""
        ops = list(self.ops.values())
        for op in ops:
            op.status = CLOSED_STATUS
        self.ops.clear()
        return ops


class Posting:
    """The posting of one group's ``n`` requests after its opening: fed how many the transport
    took at each try, says what to do next. Everything posted: ``sealed``. A native error:
    ``error`` (in :attr:`error`). Nothing taken for more than ``connect_timeout`` since the
    first try that took nothing, while nothing at all was posted: ``stalled`` (the peer never
    answered). Otherwise ``wait`` :attr:`pause` seconds at most (or until the next completion
    frees room) and try again: 50 µs doubling per try that took nothing, up to 10 ms."""

    __slots__ = ("attempt", "connect_timeout", "error", "n", "op", "pause", "since")

    def __init__(self, op: _Op, n: int, connect_timeout: float) -> None:
        self.op = op
        self.n = n
        self.connect_timeout = connect_timeout
        self.attempt = 0  # consecutive tries that took nothing
        self.since = -1.0  # when a try first took nothing while nothing was posted
        self.pause = 0.0
        self.error = 0

    def on_post(self, k: int, t: float) -> Step:
        """The transport took ``k`` more requests at time ``t`` (negative: an error). ``t`` is
        read only when ``k`` is 0 (the caller may pass 0.0 otherwise)."""
        if k < 0:
            self.error = k
            return "error"
        op = self.op
        op.posted += k
        if op.posted >= self.n:
            return "sealed"
        self.attempt = self.attempt + 1 if k == 0 else 0
        if op.posted == 0:  # nothing goes out: is the peer answering at all?
            if self.since < 0:
                self.since = t
            elif t - self.since > self.connect_timeout:
                return "stalled"
        self.pause = min(0.00005 * (1 << min(self.attempt, 8)), 0.01)
        return "wait"


def reroute(table: np.ndarray, full: Any, live: Any, start: int) -> np.ndarray:
    """The rows of ``table`` (one peer region, every row on a route of ``full``) moved onto
    the routes ``live`` (those of ``full`` in rotation), round-robin from ``start``: each
    keeps its offset in the remote region (the address base and key become the new NIC's) and
    loses its direct-copy mark. Returns a new table; ``table`` is not changed."""
    out = table.copy()
    by_hop = {(h[0], h[1]): h for h in full}
    for i in range(len(out)):
        r = out[i]
        old = by_hop[(int(r["rail"]), int(r["peer"]))]
        rail, fa, base, key = live[(start + i) % len(live)]
        r["raddr"] = base + (int(r["raddr"]) - old[2])
        r["rail"], r["peer"], r["rkey"] = rail, fa, key
        r["direct"] = 0
    return out


def merge_nic_failures(errors: list[BaseException]) -> BaseException:
    """The one error of an operation whose groups on several NICs failed (``errors``, one per
    NIC, not empty). Without a timeout among them, the first error. Otherwise the first
    timeout, carrying every timed-out NIC's waiter (its ``settled()`` waits for all of them)
    and landed only if every one landed and nothing else failed; the first other error, if
    any, is given as its cause (``__cause__``)."""
    timed_out = [e for e in errors if isinstance(e, TransferTimeout)]
    if not timed_out:
        return errors[0]
    waiters = [e._waiter for e in timed_out if e._waiter is not None]

    async def all_settled() -> None:
        for w in waiters:
            await w()

    first = timed_out[0]
    first._waiter = all_settled
    others = [e for e in errors if not isinstance(e, TransferTimeout)]
    landed = [e._landed for e in timed_out]
    first._landed = lambda: not others and all(f is not None and f() for f in landed)
    first.__cause__ = others[0] if others else None
    return first
