"""The sans-I/O rules of an operation's life (aiote/_core/_rules.py), fed sequences of times
and observations: re-posting after a broken connection (RetryPlan) and watching a posted
group for its deadline, stalls and every link to its peer down (GroupWatch). No engine, no
event loop, no clock: each case is pure arithmetic."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiote import RetryPolicy
from aiote._core._rules import LINK_POLL, GroupWatch, RetryPlan

seconds = st.floats(0, 10, allow_nan=False, allow_infinity=False)
policies = st.builds(
    RetryPolicy,
    attempts=st.integers(0, 6),
    backoff=st.floats(0, 1),
    max_backoff=st.floats(0, 2),
    connect_timeout=st.floats(0, 10),
    stall_timeout=st.one_of(st.none(), st.floats(0.01, 10)),
)


@given(policy=policies, end=st.one_of(st.none(), seconds), gaps=st.lists(seconds, max_size=10))
def test_a_retry_plan_reposts_at_most_attempts_times_within_connect_timeout_and_the_deadline(
    policy: RetryPolicy, end: float | None, gaps: list[float]
) -> None:
    plan = RetryPlan(policy, end, 0.0)
    t, started = 0.0, 0
    for gap in gaps:
        pause = plan.next_pause(False, t)
        if pause is None:
            break
        started += 1
        assert pause == policy.delay(started)
        assert t + pause < policy.connect_timeout, "an attempt started past connect_timeout"
        assert end is None or t + pause < end, "an attempt started past the deadline"
        t += pause + gap  # the attempt ran, and failed again
    assert started <= policy.attempts


@given(policy=policies)
def test_a_final_failure_is_never_retried_and_a_patient_plan_uses_every_attempt(policy: RetryPolicy) -> None:
    assert RetryPlan(policy, None, 0.0).next_pause(True, 0.0) is None
    patient = RetryPolicy(attempts=policy.attempts, backoff=0.0, max_backoff=0.0, connect_timeout=1.0)
    plan = RetryPlan(patient, None, 0.0)
    assert [plan.next_pause(False, 0.0) for _ in range(patient.attempts)] == [0.0] * patient.attempts
    assert plan.next_pause(False, 0.0) is None


class WatchedGroup(RuleBasedStateMachine):
    """A group awaited with a stall bound and/or a deadline while links go down and up and its
    requests complete one by one; the engine wakes when GroupWatch.wake_at says (or earlier,
    when a completion or a link event wakes it)."""

    @initialize(
        stall=st.one_of(st.none(), st.floats(0.05, 5)),
        end=st.one_of(st.none(), st.floats(0.1, 20)),
        connect_timeout=st.floats(0, 5),
        pending=st.integers(1, 20),
    )
    def start(self, stall: float | None, end: float | None, connect_timeout: float, pending: int) -> None:
        self.t = 0.0
        self.pending = pending
        self.progress_at = 0.0  # the model's own record of the last progress
        self.down_since: float | None = None  # every NIC to the peer down since then
        self.watch = GroupWatch(end, stall, connect_timeout, pending, 0.0)
        self.over: str | None = None

    @precondition(lambda self: self.over is None and self.pending > 0)
    @rule(k=st.integers(1, 3))
    def requests_complete(self, k: int) -> None:
        self.pending = max(0, self.pending - k)
        self.progress_at = self.t

    @precondition(lambda self: self.over is None)
    @rule()
    def every_link_goes_down(self) -> None:
        if self.down_since is None:
            self.down_since = self.t

    @rule()
    def a_link_comes_back(self) -> None:
        self.down_since = None

    @precondition(lambda self: self.over is None)
    @rule(early=st.floats(0, 1))
    def wake(self, early: float) -> None:
        """Sleep until wake_at (or a fraction ``early`` of the way, woken by something else),
        then look."""
        w = self.watch
        at = w.wake_at(self.down_since is not None, self.t)
        if self.down_since is not None:
            assert at is not None and at <= self.t + LINK_POLL
        if w.end is not None:
            assert at is not None and at <= max(w.end, self.t)
        if at is None:
            at = self.t + 1.0  # woken by a completion or a link event
        self.t = max(self.t, self.t + (at - self.t) * (1 - early))
        gone = 0.0 if self.down_since is None else self.t - self.down_since
        verdict = w.on_wake(self.t, self.pending == 0, self.pending, gone)
        if verdict == "timeout":
            assert w.end is not None and self.t >= w.end
        elif verdict == "unreachable":
            assert gone > w.connect_timeout and (w.end is None or self.t < w.end)
        elif verdict == "stalled":
            assert w.stall is not None and self.t - self.progress_at >= w.stall, "stalled while it moved"
        else:
            assert verdict == "wait"
            # a stall past its bound with nothing else to say is reported, not slept through
            if w.stall is not None and self.pending == w.last and self.pending > 0:
                assert self.t - self.progress_at < w.stall or self.t - w.moved < w.stall
        if verdict != "wait":
            self.over = verdict
        if self.pending == 0 and verdict == "wait":
            self.over = "done"

    @invariant()
    def the_watch_never_runs_ahead_of_the_model(self) -> None:
        if hasattr(self, "watch"):
            assert self.watch.moved <= self.t + 1e-9
            assert not math.isnan(self.t)


WatchedGroup.TestCase.settings = settings(max_examples=300, stateful_step_count=25, deadline=None)
TestWatchedGroup = WatchedGroup.TestCase
