"""The rules of deferred credits (aiote/_core/_credits.py), sans I/O: event sequences of one
operation over several routes (groups opened, requests posted, links going down and the
rows moving to another group, stranded groups landing late, completions with and without
errors, then cancellation, timeout or completion), and credit messages delivered any number
of times, in any order. No engine, no event loop: thousands of cases a second.

What they hold (the races tests/test_resilience.py and tests/test_imm.py found on real
engines): an operation's credits are sent only when every one of its rows landed; a
cancelled operation whose rows were all posted is counted once they land; one cancelled
before that never is; a failover's stranded group never counts towards "all posted"; a
credit message posted twice counts once."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiote._core._credits import (
    CreditsSeen,
    Never,
    SendAfterTimeout,
    SendNow,
    SendWhenLanded,
    after_data,
    all_landed,
)


@dataclass(eq=False)
class Group:
    """A posted group as the engine's _Op shows it to the rules, plus the rows it carries."""

    rows: list[int]
    posted: int = 0
    done: bool = False
    status: int = 0
    failover: bool = False


class OneOperation(RuleBasedStateMachine):
    """One operation of ``n`` rows, split over groups; the rows of a group whose link went
    down move to a new group, while the stranded group may still land (or fail) later."""

    @initialize(n=st.integers(1, 8), data=st.data())
    def start(self, n: int, data: st.DataObject) -> None:
        """The operation's rows, split over one to three groups (one per NIC or stream)."""
        self.n = n
        self.groups: list[Group] = []
        self.landed: set[int] = set()
        self.ended = False
        cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            self.groups.append(Group(list(range(lo, hi))))

    def live(self) -> list[Group]:
        return [g for g in self.groups if not g.failover]

    @precondition(lambda self: not self.ended)
    @rule(data=st.data())
    def post(self, data: st.DataObject) -> None:
        open_ = [g for g in self.live() if g.posted < len(g.rows)]
        if open_:
            g = data.draw(st.sampled_from(open_))
            g.posted += data.draw(st.integers(1, len(g.rows) - g.posted))

    @rule(data=st.data(), ok=st.booleans())
    def complete(self, data: st.DataObject, ok: bool) -> None:
        """A sealed group's completion (a stranded one's included, landing late)."""
        sealed = [g for g in self.groups if not g.done and (g.failover or g.posted == len(g.rows))]
        if sealed:
            g = data.draw(st.sampled_from(sealed))
            g.done, g.status = True, 0 if ok else -104
            if ok:
                self.landed |= set(g.rows[: g.posted])

    @precondition(lambda self: not self.ended)
    @rule(data=st.data())
    def link_down(self, data: st.DataObject) -> None:
        """The group's NIC lost its link: it is woken as moved (stranded: what it posted may
        still land, or fail), and its rows go to a new group on another NIC."""
        up = [g for g in self.live() if not g.done]
        if up:
            g = data.draw(st.sampled_from(up))
            g.failover = True
            self.groups.append(Group(list(g.rows)))

    def settle(self, groups: tuple[Group, ...], oks: list[bool]) -> None:
        for g, ok in zip(groups, oks, strict=False):
            if not g.done:
                g.posted = len(g.rows)
                g.done, g.status = True, 0 if ok else -104
                if ok:
                    self.landed |= set(g.rows)

    @precondition(lambda self: not self.ended)
    @rule(oks=st.lists(st.booleans(), min_size=8, max_size=8), closed=st.booleans())
    def cancelled(self, oks: list[bool], closed: bool) -> None:
        self.ended = True
        live = self.live()
        all_posted = sum(g.posted for g in live) == self.n and len(live) > 0
        d = after_data("cancelled", self.groups, self.n, closed=closed)
        if not all_posted or closed:
            assert isinstance(d, Never), "a credit for an operation not all posted (or closed)"
            return
        assert isinstance(d, SendWhenLanded)
        assert set(map(id, d.groups)) == set(map(id, live)), "stranded groups count towards the credit"
        self.settle(d.groups, oks)  # what the background task waits for
        if all_landed(d.groups):
            assert self.landed == set(range(self.n)), "a credit sent before every row landed"
        else:
            assert any(g.status for g in d.groups)

    @precondition(lambda self: not self.ended)
    @rule(posted_any=st.booleans())
    def timed_out(self, posted_any: bool) -> None:
        self.ended = True
        d = after_data("timeout", self.groups, self.n, posted_any=posted_any)
        assert isinstance(d, SendAfterTimeout if posted_any else Never)

    @precondition(
        lambda self: not self.ended
        and self.live()
        and sum(len(g.rows) for g in self.live()) == self.n
        and all(g.done and g.status == 0 for g in self.live())
    )
    @rule()
    def completed(self) -> None:
        """The data part returned: every live group completed without error."""
        self.ended = True
        assert self.landed == set(range(self.n))
        assert isinstance(after_data("completed", self.groups, self.n), SendNow)

    @precondition(lambda self: not self.ended)
    @rule()
    def failed(self) -> None:
        self.ended = True
        assert isinstance(after_data("failed", self.groups, self.n), Never)

    @invariant()
    def rows_are_partitioned_among_live_groups(self) -> None:
        if hasattr(self, "groups"):
            carried = [r for g in self.live() for r in g.rows]
            assert len(carried) == len(set(carried))


OneOperation.TestCase.settings = settings(max_examples=1000, stateful_step_count=12, deadline=None)
TestOneOperation = OneOperation.TestCase


class CreditMessages(RuleBasedStateMachine):
    """Credit messages from a few senders, each delivered any number of times (a re-post
    after a failover, a re-send with the numbers drawn before a cancellation), interleaved."""

    LIMIT = 16

    def __init__(self) -> None:
        super().__init__()
        self.seen = CreditsSeen(self.LIMIT)
        self.sent: list[tuple[bytes, int]] = []  # distinct messages, oldest first
        self.counted = 0

    @rule(sender=st.sampled_from([b"a", b"b", b"c"]), seq=st.integers(0, 1 << 40))
    def deliver_new(self, sender: bytes, seq: int) -> None:
        if (sender, seq) in self.sent:
            return
        self.sent.append((sender, seq))
        assert self.seen.first(sender, seq)
        self.counted += 1

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def deliver_again(self, data: st.DataObject) -> None:
        """A copy of one of the last LIMIT messages: dropped."""
        sender, seq = data.draw(st.sampled_from(self.sent[-self.LIMIT :]))
        assert not self.seen.first(sender, seq), "a credit posted twice counted twice"

    @invariant()
    def bounded_and_counted_once(self) -> None:
        assert len(self.seen) <= self.LIMIT
        assert self.counted == len(self.sent)


# 100 cases of up to 60 deliveries: each of the CreditsSeen bugs tried against it (the window
# one short, the newest copy forgotten instead of the oldest, senders not told apart) was
# caught in each of 30 runs of 100 cases
CreditMessages.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestCreditMessages = CreditMessages.TestCase


@given(
    posted=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    moved=st.lists(st.booleans(), min_size=6, max_size=6),
    extra=st.integers(-2, 2),
)
def test_a_cancelled_operation_counts_only_with_every_row_posted_on_unmoved_groups(
    posted: list[int], moved: list[bool], extra: int
) -> None:
    groups = [Group(rows=list(range(p)), posted=p, failover=m) for p, m in zip(posted, moved, strict=False)]
    rows = sum(g.posted for g in groups if not g.failover) + extra
    d = after_data("cancelled", groups, rows)
    live = [g for g in groups if not g.failover]
    if live and extra == 0:
        assert isinstance(d, SendWhenLanded) and list(d.groups) == live
    else:
        assert isinstance(d, Never)
