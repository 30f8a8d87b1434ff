"""The operation table (aiote/_core/_optable.py), sans I/O: groups opened, posted, completed,
moved by a link going down, stranded, closed, fed as event sequences. No engine, no event
loop, no clock: thousands of cases a second.

What they hold (the races tests/test_guarantees.py, test_resilience.py and test_netns.py found
on real engines):
- a completion record finds its group once; a record for a group already ended (the engine
  closed, or a token not ours) wakes nobody;
- a link going down moves exactly the in-flight groups posted on it whose peer has another
  NIC in rotation, each at most once; the others wait in the transport (bounded by the
  deadline), never reported as moved;
- a moved group stays in the table (stranded: its first requests may still land) until its
  own completion record; its outcome is "moved" until then;
- a link down while a group waited for a slot moves it before anything is posted;
- closing ends every pending group as closed, except moved ones, whose waiter already re-posted;
- posting: never more than the group's requests; sealed exactly when all were posted; the
  peer reported unreachable only when nothing at all went out for connect_timeout; back-off
  from 50 us doubling to 10 ms;
- a cancelled waiter keeps the buffers of a group with requests in the transport;
- rows moved to other NICs keep their remote offsets, land only on live routes, and spread
  evenly over them;
- several NICs failing differently give one error: a timeout (with every NIC's waiter) if any.
"""

from __future__ import annotations

import anyio
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiote import PeerUnreachable, TransferTimeout
from aiote._core._optable import OpTable, Posting, _Op, merge_nic_failures, reroute
from aiote._core._wire import _OP_DTYPE

RAILS = (0, 1, 2)


def new_op(rail: int, alts: frozenset[int]) -> _Op:
    op = _Op(refs=("buffers",), event=None)
    op.rails = {rail}
    op.alts = alts | {rail}
    return op


class OperationsInFlight(RuleBasedStateMachine):
    """An engine's groups on three NICs: opened, posted, completed (with or without error),
    links going down and up, the engine closing. A model beside the table says what must
    happen; the table must agree."""

    @initialize()
    def start(self) -> None:
        self.table = OpTable()
        self.down: set[int] = set()
        self.tokens = 0
        self.model: dict[int, _Op] = {}  # token -> op the table must hold
        self.ended: list[_Op] = []  # completed or closed
        self.moved_count: dict[int, int] = {}  # id(op) -> times link_down returned it
        self.closed = False

    @precondition(lambda self: not self.closed)
    @rule(rail=st.sampled_from(RAILS), alts=st.frozensets(st.sampled_from(RAILS)), posted=st.integers(0, 4))
    def open_group(self, rail: int, alts: frozenset[int], posted: int) -> None:
        self.tokens += 1
        op = new_op(rail, alts)
        if op.move_before_posting(self.down):  # the link went down while it waited for a slot
            assert rail in self.down and op.alts - self.down and op.failover
            return  # sealed empty; its rows go elsewhere, nothing for its completion to find
        assert not op.failover
        op.posted = posted
        self.table.add(self.tokens, op)
        self.model[self.tokens] = op

    @rule(pick=st.integers(0, 50), status=st.sampled_from([0, 0, 0, -5, -103]), errno=st.integers(0, 3))
    def completion_record(self, pick: int, status: int, errno: int) -> None:
        tokens = [*self.model, self.tokens + 1]  # the last: not ours (or already ended)
        token = tokens[pick % len(tokens)]
        op = self.table.complete(token, status, errno)
        expected = self.model.pop(token, None)
        assert op is expected
        if op is not None:
            assert op.done and op.status == status and op.prov_errno == errno and op.refs is None
            self.ended.append(op)
            if not op.failover:
                assert op.outcome() == ("landed" if status == 0 else "failed")
                assert op.landed() == (status == 0)
            else:  # moved, then its first requests ended: no longer stranded, never "landed"
                assert not op.landed()

    @precondition(lambda self: not self.closed)
    @rule(rail=st.sampled_from(RAILS))
    def link_down(self, rail: int) -> None:
        self.down.add(rail)
        # the model's answer, before asking: in flight on that rail, not moved yet, and the
        # peer has a NIC still in rotation
        expected = [
            op for op in self.model.values()
            if op.rails and rail in op.rails and not op.failover and op.alts - self.down
        ]
        moved = self.table.link_down(rail, self.down)
        assert [id(o) for o in moved] == [id(o) for o in expected]
        for op in moved:
            self.moved_count[id(op)] = self.moved_count.get(id(op), 0) + 1
            assert op.outcome() == "moved"

    @rule(rail=st.sampled_from(RAILS))
    def link_up(self, rail: int) -> None:
        self.down.discard(rail)

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        ended = self.table.close()
        assert {id(o) for o in ended} == {id(o) for o in self.model.values()}
        for op in ended:
            assert op.outcome() == ("moved" if op.failover else "closed")
        self.ended.extend(ended)
        self.model.clear()
        self.closed = True

    @invariant()
    def the_table_holds_exactly_the_groups_in_flight(self) -> None:
        if not hasattr(self, "table"):
            return
        assert dict(self.table.ops) == self.model
        assert len(self.table) == len(self.model)
        assert {id(o) for o in self.table.stranded()} == {id(o) for o in self.model.values() if o.failover}
        assert all(n == 1 for n in self.moved_count.values()), "a group moved twice"

    @invariant()
    def a_group_in_flight_keeps_its_buffers_and_a_cancelled_waiter_waits_for_them(self) -> None:
        if not hasattr(self, "table"):
            return
        for op in self.model.values():
            assert op.refs is not None and not op.done
            assert op.must_settle() == (op.posted > 0)
            assert not op.must_settle(final=True)
        for op in self.ended:
            assert not op.must_settle()


OperationsInFlight.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestOperationsInFlight = OperationsInFlight.TestCase


class PostingGroup(RuleBasedStateMachine):
    """One group's requests handed to the transport try by try, the transport taking some,
    none (queues full, peer still connecting) or refusing with an error."""

    @initialize(
        n=st.integers(1, 64), connect_timeout=st.floats(0, 5), first=st.one_of(st.none(), st.integers(0, 64))
    )
    def start(self, n: int, connect_timeout: float, first: int | None) -> None:
        self.op = _Op(refs=None, event=None)
        self.posting = Posting(self.op, n, connect_timeout)
        self.n = n
        self.t = 0.0
        self.zero_since: float | None = None  # the model: first try that took nothing, nothing posted
        self.zeros = 0
        self.over: str | None = None
        if first is not None:  # what aio_submit took in the same native call as the opening
            self.take(min(first, n), 0.0)

    def take(self, k: int, gap: float) -> None:
        self.t += gap
        before = self.op.posted
        step = self.posting.on_post(k, self.t)
        if k < 0:
            assert step == "error" and self.posting.error == k and self.op.posted == before
            self.over = step
            return
        assert self.op.posted == before + k <= self.n
        if self.op.posted == self.n:
            assert step == "sealed"
            self.over = step
            return
        self.zeros = self.zeros + 1 if k == 0 else 0
        if self.op.posted == 0 and self.zero_since is None:
            self.zero_since = self.t
        if step == "stalled":
            assert self.op.posted == 0 and self.zero_since is not None
            assert self.t - self.zero_since > self.posting.connect_timeout
            self.over = step
            return
        assert step == "wait"
        if self.op.posted == 0 and self.zero_since is not None:
            assert self.t - self.zero_since <= self.posting.connect_timeout
        assert self.posting.pause == min(0.00005 * 2 ** min(self.zeros, 8), 0.01)
        assert 0.00005 <= self.posting.pause <= 0.01

    @precondition(lambda self: self.over is None)
    @rule(k=st.integers(0, 8), gap=st.floats(0, 2))
    def transport_takes(self, k: int, gap: float) -> None:
        self.take(min(k, self.n - self.op.posted), gap)

    @precondition(lambda self: self.over is None)
    @rule(err=st.integers(-200, -1))
    def transport_refuses(self, err: int) -> None:
        self.take(err, 0.0)

    @precondition(lambda self: self.over is not None)
    @rule()
    def after_the_end(self) -> None:
        """Sealed, failed or stalled: the engine stops posting; what was posted stays counted."""
        assert self.op.posted == self.n or self.over != "sealed"

    @invariant()
    def never_more_than_the_group(self) -> None:
        if hasattr(self, "op"):
            assert 0 <= self.op.posted <= self.n


PostingGroup.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestPostingGroup = PostingGroup.TestCase


def test_a_group_that_never_went_out_is_not_stalled_while_a_part_of_it_is_posted() -> None:
    op = _Op(None, None)
    p = Posting(op, 4, 1.0)
    assert p.on_post(1, 0.0) == "wait"
    for t in (1.0, 5.0, 100.0):  # something was posted: the peer answers; only the deadline bounds it
        assert p.on_post(0, t) == "wait"
    assert p.on_post(3, 101.0) == "sealed"


def test_a_link_down_while_waiting_for_a_slot_moves_the_group_before_it_posts() -> None:
    op = new_op(0, frozenset({0, 1}))
    assert not op.move_before_posting(set())
    assert not op.move_before_posting({1})  # another rail of the peer down: post as planned
    assert op.move_before_posting({0}) and op.failover and op.outcome() == "moved"
    lone = new_op(0, frozenset())
    assert not lone.move_before_posting({0}), "nowhere to go: post anyway, wait for the link"


def test_a_stranded_group_ends_with_its_own_completion_and_is_waited_for_by_close() -> None:
    table = OpTable()
    a, b = new_op(0, frozenset({1})), new_op(1, frozenset())
    a.posted = b.posted = 2
    table.add(1, a)
    table.add(2, b)
    assert table.link_down(0, {0}) == [a]
    assert table.link_down(1, {0, 1}) == [], "every NIC of b's peer is down: nothing to move to"
    assert table.stranded() == [a] and len(table) == 2
    assert table.link_down(0, {0, 1}) == [], "moved once"
    assert table.complete(1, 0, 0) is a and not a.landed() and table.stranded() == []
    assert table.complete(1, 0, 0) is None, "a record finds its group once"
    assert table.close() == [b] and b.outcome() == "closed" and not table
    assert table.complete(2, 0, 0) is None, "a record after the close wakes nobody"


hops = st.lists(
    st.tuples(st.integers(0, 7), st.integers(0, 1000), st.integers(0, 1 << 40), st.integers(0, 1 << 32)),
    min_size=1,
    max_size=6,
    unique_by=lambda h: (h[0], h[1]),
)


@given(full=hops, data=st.data())
def test_rerouted_rows_keep_their_remote_offsets_and_spread_over_the_live_routes(full, data) -> None:  # type: ignore[no-untyped-def]
    live = data.draw(st.lists(st.sampled_from(full), min_size=1, unique=True))
    n = data.draw(st.integers(1, 40))
    start = data.draw(st.integers(0, 100))
    table = np.zeros(n, _OP_DTYPE)
    offsets = []
    for i in range(n):
        hop = data.draw(st.sampled_from(full))
        off = data.draw(st.integers(0, 1 << 30))
        table[i]["rail"], table[i]["peer"], table[i]["rkey"] = hop[0], hop[1], hop[3]
        table[i]["raddr"] = hop[2] + off
        table[i]["direct"] = 1
        table[i]["length"] = i + 1
        offsets.append(off)
    before = table.copy()
    out = reroute(table, tuple(full), tuple(live), start)
    assert (table == before).all(), "the original rows are not changed (the transport may own them)"
    for i in range(n):
        hop = live[(start + i) % len(live)]  # round-robin over the live routes from `start`
        assert (int(out[i]["rail"]), int(out[i]["peer"])) == (hop[0], hop[1])
        assert int(out[i]["raddr"]) - hop[2] == offsets[i] and int(out[i]["rkey"]) == hop[3]
        assert out[i]["direct"] == 0 and out[i]["length"] == i + 1


def test_several_nics_failing_give_one_error_a_timeout_carrying_every_waiter() -> None:
    broken = PeerUnreachable("nic 1 broke", 111, 0)
    assert merge_nic_failures([broken]) is broken
    waited: list[int] = []

    def timeout(i: int, landed: bool) -> TransferTimeout:
        exc = TransferTimeout(f"nic {i}")

        async def waiter() -> None:
            waited.append(i)

        exc._waiter = waiter
        exc._landed = lambda: landed
        return exc

    t1, t2 = timeout(1, True), timeout(2, True)
    first = merge_nic_failures([t1, t2])
    assert first is t1 and first.__cause__ is None and first._landed is not None and first._landed()
    assert first._waiter is not None
    anyio.run(first._waiter)
    assert waited == [1, 2]
    mixed = merge_nic_failures([broken, timeout(3, True), timeout(4, False)])
    assert isinstance(mixed, TransferTimeout) and mixed.__cause__ is broken
    assert mixed._landed is not None and not mixed._landed(), "another NIC failed: not all landed"
