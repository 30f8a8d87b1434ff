"""Immediate counters: credits from the first immediate on, in any order, FIFO waiters,
exact consumption, cancellation and timeouts."""

from __future__ import annotations

import asyncio
import random

import anyio
import numpy as np
import pytest
import sniffio
from _util import anyio_backend_with_uvloop as anyio_backend  # noqa: F401 (the fixture: asyncio, trio, uvloop)
from _util import eventually, landed, pattern, zeros

import aiote
from aiote._core import _util as aiote_util

pytestmark = pytest.mark.anyio

IMMS = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}  # imm -> number of writes carrying it


def _shuffled_imms(seed: int) -> list[int]:
    order = [imm for imm, k in IMMS.items() for _ in range(k)]
    random.Random(seed).shuffle(order)
    return order


async def _late_waiters_see_everything(b: aiote.Engine, seed: int) -> None:
    # every counter already holds its credits, and waiting (in another random order) gets them
    for imm, k in IMMS.items():
        assert b.imm_counter(imm).available == k
    assert b.imm_counter(6).available == 0
    for imm in random.Random(seed + 1).sample(list(IMMS), len(IMMS)):
        await b.imm_counter(imm).wait(IMMS[imm], timeout=10)
        assert b.imm_counter(imm).available == 0
        assert b.imm_counter(imm).total == IMMS[imm]


@pytest.mark.parametrize("seed", [0, 1])
async def test_imms_in_random_order_before_any_waiter(aiote_engine_pair, seed: int) -> None:
    a, b = aiote_engine_pair
    order = _shuffled_imms(seed)
    slot = 256
    src = pattern(slot * len(order), seed=seed)
    dst = zeros(slot * len(order))
    ms = await a.register(src)
    md = await b.register(dst)

    # concurrent writes, each with its own imm: nothing orders their arrival
    async with anyio.create_task_group() as tg:
        for i, imm in enumerate(order):
            tg.start_soon(
                lambda i=i, imm=imm: a.write(
                    ms, md.descriptor, length=slot, src_offset=i * slot, dst_offset=i * slot, imm=imm
                )
            )
    await landed(b, IMMS)
    assert np.array_equal(src, dst)
    await _late_waiters_see_everything(b, seed)


async def test_imms_in_random_order_in_one_batch(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    order = _shuffled_imms(7)
    src = pattern(len(order), seed=7)
    dst = zeros(len(order))
    ms = await a.register(src)
    md = await b.register(dst)
    batch = a.batch()
    for i, imm in enumerate(order):
        # one byte each, every other write zero-length (imm only)
        batch.write(ms, md.descriptor, length=i % 2, src_offset=i, dst_offset=i, imm=imm)
    assert len(batch) == len(order)
    await batch.submit(timeout=30)
    await landed(b, IMMS)
    assert np.array_equal(dst[1::2], src[1::2])
    assert not dst[0::2].any()
    await _late_waiters_see_everything(b, 7)


async def test_wait_consumes_exactly_n(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    for _ in range(7):
        await a.write_imm(md.descriptor, 9)
    c = b.imm_counter(9)
    await landed(b, {9: 7})
    assert c.available == 7
    await c.wait(0)
    assert c.available == 7
    await c.wait(2, timeout=10)
    assert c.available == 5
    await c.wait()  # n defaults to 1
    assert c.available == 4
    await c.wait(4, timeout=10)
    assert c.available == 0
    assert c.total == 7
    assert b.imm_counter(9) is c  # one counter per imm


async def test_concurrent_waiters_are_served_fifo(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    c = b.imm_counter(11)
    served: list[str] = []
    events = {name: anyio.Event() for name in ("first", "second")}

    async def waiter(name: str, n: int) -> None:
        await c.wait(n, timeout=30)
        served.append(name)
        events[name].set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "first", 2)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(waiter, "second", 1)
        await anyio.wait_all_tasks_blocked()

        # one credit: enough for "second", but "first" came first and wants two
        await a.write_imm(md.descriptor, 11)
        await landed(b, {11: 1})
        await anyio.wait_all_tasks_blocked()
        assert served == []
        assert c.available == 1

        await a.write_imm(md.descriptor, 11)
        await events["first"].wait()
        assert served == ["first"]
        assert c.available == 0

        await a.write_imm(md.descriptor, 11)
        await events["second"].wait()
    assert served == ["first", "second"]
    assert c.available == 0
    assert c.total == 3


async def test_two_waiters_same_demand_fifo(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    c = b.imm_counter(12)
    served: list[int] = []

    async def waiter(i: int) -> None:
        await c.wait(1, timeout=30)
        served.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(waiter, i)
            await anyio.wait_all_tasks_blocked()
        for k in range(1, 5):
            await a.write_imm(md.descriptor, 12)
            with anyio.fail_after(30):
                while len(served) < k:  # noqa: ASYNC110 (polls native state)
                    await anyio.sleep(0.002)
            assert served == list(range(k))
    assert c.available == 0


async def test_cancelled_wait_consumes_nothing(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    c = b.imm_counter(13)
    await a.write_imm(md.descriptor, 13)
    await landed(b, {13: 1})

    # wants more than is there: cancelled by a deadline
    with anyio.move_on_after(0.05) as scope:
        await c.wait(2)
    assert scope.cancelled_caught
    assert c.available == 1

    # cancelled from outside while queued
    async with anyio.create_task_group() as tg:
        cs = anyio.CancelScope()

        async def waiter() -> None:
            with cs:
                await c.wait(3)

        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        cs.cancel()
    assert c.available == 1

    # the credit is still there for a later waiter, and more arrive normally
    await a.write_imm(md.descriptor, 13)
    await c.wait(2, timeout=10)
    assert c.available == 0
    assert c.total == 2


async def test_cancelled_head_waiter_lets_the_next_one_through(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    c = b.imm_counter(14)
    got = anyio.Event()

    async def second() -> None:
        await c.wait(1, timeout=30)
        got.set()

    async with anyio.create_task_group() as tg:
        head = anyio.CancelScope()

        async def first() -> None:
            with head:
                await c.wait(5)

        tg.start_soon(first)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        await a.write_imm(md.descriptor, 14)
        await landed(b, {14: 1})
        assert not got.is_set()  # FIFO: the head wants 5
        head.cancel()
        await got.wait()
    assert c.available == 0
    assert c.total == 1


async def test_cancelled_wait_with_credits_available_consumes_nothing(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    c = b.imm_counter(15)
    await a.write_imm(md.descriptor, 15)
    await landed(b, {15: 1})
    with anyio.CancelScope() as scope:
        scope.cancel()
        await c.wait(1)
    assert scope.cancelled_caught
    assert c.available == 1


async def test_wait_timeout_raises_transfer_timeout(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    c = b.imm_counter(16)
    with pytest.raises(aiote.TransferTimeout) as info:
        await c.wait(1, timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, aiote.AioteError)

    await a.write_imm(md.descriptor, 16)
    await landed(b, {16: 1})
    with pytest.raises(TimeoutError):
        await c.wait(2, timeout=0.05)
    assert c.available == 1  # the timed-out wait consumed nothing
    await c.wait(1, timeout=0)  # available already: no waiting needed even with timeout=0
    assert c.available == 0


async def test_timed_waits_served_cancelled_or_expired(aiote_engine_pair) -> None:
    # a timed wait is a timer on the waiter's event (no cancel scope): a wait cancelled from
    # outside or timed out consumes nothing, and its timer firing later touches nothing
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    c = b.imm_counter(18)
    async with anyio.create_task_group() as tg:
        cs = anyio.CancelScope()

        async def cancelled() -> None:
            with cs:
                await c.wait(1, timeout=0.2)

        tg.start_soon(cancelled)
        await anyio.wait_all_tasks_blocked()
        cs.cancel()
    assert cs.cancelled_caught
    with pytest.raises(aiote.TransferTimeout, match="credits of imm 18"):
        await c.wait(1, timeout=0.05)
    await anyio.sleep(0.3)  # past the cancelled wait's deadline
    served = []

    async def timed(k: int) -> None:
        await c.wait(1, timeout=10)
        served.append(k)

    async with anyio.create_task_group() as tg:
        tg.start_soon(timed, 1)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(timed, 2)
        await anyio.wait_all_tasks_blocked()
        await a.write_imm(md.descriptor, 18)
        # one credit: it goes to the first waiter (both granted in one wake-up would resume in
        # an order trio randomizes, which says nothing about who was served first)
        await eventually(lambda: served == [1], "the first waiter to be served")
        await a.write_imm(md.descriptor, 18)
    assert served == [1, 2]  # FIFO, each before its deadline
    assert c.available == 0
    assert c.total == 2


async def test_timed_waits_share_one_timer(aiote_engine_pair) -> None:
    # every timed wait of a loop is served by one timer set for the earliest deadline: a wait
    # added later with an earlier deadline still expires on time, a long one outlives short
    # ones, and thousands of waits that finished early (timed writes, timed counter waits)
    # leave the timer working and its heap compacted
    a, b = aiote_engine_pair
    src = zeros(64)
    ms = await a.register(src)
    md = await b.register(zeros(64))
    outcome: dict[str, object] = {}

    async def timed(name: str, imm: int, timeout: float) -> None:
        t0 = anyio.current_time()
        try:
            await b.imm_counter(imm).wait(1, timeout=timeout)
            outcome[name] = "served"
        except aiote.TransferTimeout:
            outcome[name] = anyio.current_time() - t0

    async with anyio.create_task_group() as tg:
        tg.start_soon(timed, "long", 40, 20.0)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(timed, "mid", 41, 0.4)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(timed, "short", 42, 0.1)
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(10):
            while "mid" not in outcome:  # noqa: ASYNC110 (waits for the tasks above)
                await anyio.sleep(0.01)
        await a.write_imm(md.descriptor, 40)
    assert outcome["long"] == "served"
    for name, timeout in (("short", 0.1), ("mid", 0.4)):
        elapsed = outcome[name]
        assert isinstance(elapsed, float) and timeout <= elapsed + 0.01 < timeout + 5, (name, elapsed)
    c = b.imm_counter(43)
    for _ in range(3000):  # each a timed write and a timed wait finishing long before its deadline
        await a.write(ms, md.descriptor, length=8, imm=43, timeout=30)
        await c.wait(1, timeout=30)
    # the waits among those that finished early did not stay in the timer's heap: compacted
    assert _timed_wait_entries() <= 2 * aiote_util._COMPACT_MIN
    t0 = anyio.current_time()
    with pytest.raises(aiote.TransferTimeout):
        await c.wait(1, timeout=0.05)
    assert anyio.current_time() - t0 < 5
    assert c.total == 3000


def _timed_wait_entries() -> int:
    """How many entries the running loop's timed-wait heap holds (aiote internals)."""
    if sniffio.current_async_library() == "trio":
        return len(aiote_util._Trio.timed_waits.get()._heap)
    return len(aiote_util._LOOP_TIMED_WAITS[asyncio.get_running_loop()]._heap)


async def test_wait_rejects_bad_arguments(aiote_engine_pair) -> None:
    _, b = aiote_engine_pair
    c = b.imm_counter(17)
    for n in (-1, True, 1.0, "1", None):
        with pytest.raises(aiote.InvalidArgument):
            await c.wait(n)  # type: ignore[arg-type]
    for t in (float("nan"), "1", -1):
        with pytest.raises(aiote.InvalidArgument):
            await c.wait(1, timeout=t)  # type: ignore[arg-type]
    for imm in (-1, 2**32, True, 1.5, "1"):
        with pytest.raises(aiote.InvalidArgument):
            b.imm_counter(imm)  # type: ignore[arg-type]
    assert c.available == 0


async def test_imm_full_32_bit_range(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(zeros(16))
    for imm in (0, 2**31, 2**32 - 1):
        await a.write_imm(md.descriptor, imm)
    await landed(b, {0: 1, 2**31: 1, 2**32 - 1: 1})
    # no aliasing between neighbouring values
    assert b.imm_counter(2**32 - 2).total == 0
    assert b.imm_counter(1).total == 0


async def test_release_forgets_a_counter(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    md = await b.register(np.zeros(64, np.uint8))
    for imm in range(1000, 1100):
        await a.write_imm(md.descriptor, imm)
    for imm in range(1000, 1100):
        c = b.imm_counter(imm)
        await c.wait(1, timeout=10)
        assert c.total == 1
        c.release()
        assert b.imm_counter(imm).total == 0  # a new counter, from zero
        b.imm_counter(imm).release()
    # a waiter blocks release; once it is gone (cancelled) release works
    c = b.imm_counter(7)
    async with anyio.create_task_group() as tg:
        tg.start_soon(c.wait, 1)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(aiote.InvalidArgument):
            c.release()
        tg.cancel_scope.cancel()
    c.release()
    await a.write_imm(md.descriptor, 7)
    await b.imm_counter(7).wait(1, timeout=10)


async def test_a_credit_message_posted_twice_counts_once() -> None:
    """A multi-NIC operation's deferred credit travels as a numbered internal message; one
    that arrives twice (stranded on a failed link, then sent again on another) counts once."""
    from aiote._core._wire import _CREDIT, _CREDIT_MSG, _K_CREDIT

    async with aiote.testing.engine_pair(same_host=None) as (a, b):
        msg = _CREDIT_MSG.pack(_K_CREDIT, 12345, 88, 3 * _CREDIT)
        for _ in range(2):
            await a._send_msg(b.address, msg, 10, None, internal=True)
        other = _CREDIT_MSG.pack(_K_CREDIT, 12346, 88, 1 * _CREDIT)
        await a._send_msg(b.address, other, 10, None, internal=True)
        await b.imm_counter(88).wait(4, timeout=10)
        await anyio.sleep(0.2)
        assert b.imm_counter(88).available == 0
