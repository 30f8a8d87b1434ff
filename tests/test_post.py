"""Posted now, awaited later: ``post_write``, ``post_write_imm`` and ``TransferBatch.post``
return a :class:`aiote.Transfer` after handing the work to the transport (or to a background
task of the engine); the work goes on whether or not it is awaited, awaiting only observes."""

from __future__ import annotations

import gc
import logging
import os
import signal
import time

import anyio
import numpy as np
import pytest
from _util import anyio_backend_with_uvloop as anyio_backend  # noqa: F401 (the fixture: asyncio, trio, uvloop)
from _util import digest, eventually, frozen, nothing_posted, pattern, streams_open, zeros

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

TCP = {"same_host": None}


async def test_post_write_is_posted_before_it_returns(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(64 * 4096, seed=5)
    dst = zeros(64 * 4096)
    ms, md = await a.register(src), await b.register(dst)
    before = a.stats()["pending"]
    transfers = [
        a.post_write(ms, md.descriptor, length=4096, src_offset=4096 * k, dst_offset=4096 * k, imm=11)
        for k in range(64)
    ]
    # no await yet: every request is already with the transport (the completions are read by
    # the loop thread, which has not run since)
    assert a.stats()["pending"] == before + 64
    assert all(isinstance(t, aiote.Transfer) for t in transfers)
    # the peer sees all of it although none of the transfers was awaited
    await b.imm_counter(11).wait(64, timeout=30)
    assert np.array_equal(dst, src)
    for t in transfers:
        await t
        assert t.done
    await transfers[0]  # awaiting again: same outcome, at once
    assert a.stats()["pending"] == before


async def test_posted_completions_do_not_wake_the_loop(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    ms, md = await a.register(pattern(8 * 4096, seed=6)), await b.register(zeros(8 * 4096))
    await a.write(ms, md.descriptor, length=64)  # connected: the posts below go out at once
    await streams_open(a)
    # the poller pushes a record, then signals the eventfd (when armed) and counts the wake-up:
    # the loop may read the record in between, so this write's wake-up can be counted after it
    # returned. Two more full polls and the poller is past it.
    polls = a.stats()["polls"]
    await eventually(lambda: a.stats()["polls"] >= polls + 2, "two more polls")
    before = a.stats()
    transfers = [
        a.post_write(ms, md.descriptor, length=4096, src_offset=4096 * k, dst_offset=4096 * k, imm=12)
        for k in range(8)
    ]
    assert all(t._bg is None for t in transfers)  # (internal: posted in the call, no task)
    await b.imm_counter(12).wait(8, timeout=30)
    await eventually(lambda: a.stats()["ops_in_flight"] == 0, "the writes' completions")
    await anyio.sleep(0.05)
    # nobody waited for them: the completions came in quietly, a's loop was not woken and has
    # not read them yet (still pending)
    assert a.stats()["wakeups_sent"] == before["wakeups_sent"]
    assert a.stats()["pending"] == before["pending"] + 8
    assert transfers[0].done  # reading `done` reads them
    assert a.stats()["pending"] == before["pending"]
    for t in transfers:
        await t
    assert a.stats()["wakeups_sent"] == before["wakeups_sent"]  # done already: no wait


async def test_post_write_imm_ping_pong_between_tasks(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    ma, mb = await a.register(zeros(64)), await b.register(zeros(64))
    rounds = 200

    async def pong() -> None:
        prev = None
        for _ in range(rounds):
            await b.imm_counter(21).wait(1, timeout=30)
            if prev is not None:
                await prev
            prev = b.post_write_imm(ma.descriptor, 22)
        assert prev is not None
        await prev

    async with anyio.create_task_group() as tg:
        tg.start_soon(pong)
        for _ in range(rounds):
            t = a.post_write_imm(mb.descriptor, 21)
            await a.imm_counter(22).wait(1, timeout=30)
            await t
    assert a.imm_counter(22).total == rounds
    assert b.imm_counter(21).total == rounds


async def test_batch_post(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(1 << 20, seed=9)
    dst = zeros(1 << 20)
    ms, md = await a.register(src), await b.register(dst)
    batch = a.batch()
    for k in range(16):
        batch.write(ms, md.descriptor, length=65536, src_offset=65536 * k, dst_offset=65536 * k, imm=31)
    t = batch.post()
    await b.imm_counter(31).wait(16, timeout=30)
    await t
    assert digest(dst) == digest(src)
    # posted again (a static schedule), with new bytes
    src[:] = pattern(1 << 20, seed=10)
    await batch.post()
    await b.imm_counter(31).wait(16, timeout=30)
    assert np.array_equal(dst, src)
    empty = a.batch().post()
    assert empty.done
    await empty


async def test_bad_input_raises_at_once_and_posts_nothing(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    ms = await a.register(zeros(4096))
    md = await b.register(zeros(4096))
    before = a.stats()
    with pytest.raises(aiote.InvalidArgument):
        a.post_write(ms, md.descriptor, length=4097)
    with pytest.raises(aiote.InvalidArgument):
        a.post_write(ms, md.descriptor, length=16, dst_offset=4090)
    with pytest.raises(aiote.InvalidArgument):
        a.post_write(ms, md.descriptor, length=16, imm=1 << 32)
    with pytest.raises(aiote.InvalidArgument):
        a.post_write_imm(md.descriptor, -1)
    with pytest.raises(aiote.InvalidArgument):
        a.post_write_imm(md.descriptor, None)  # type: ignore[arg-type]
    with pytest.raises(aiote.DescriptorError):
        a.post_write_imm(bytes(md.descriptor)[:-3], 1)
    with pytest.raises(aiote.InvalidArgument, match="RetryPolicy"):
        a.post_write(ms, md.descriptor, retry=3)  # type: ignore[arg-type]
    gone = await a.register(zeros(4096))
    await a.unregister(gone)
    with pytest.raises(aiote.InvalidArgument):
        a.post_write(gone, md.descriptor, length=16)
    batch = a.batch().write(ms, md.descriptor, length=16)
    other = await a.register(zeros(64))
    batch.write(other, md.descriptor, length=16)
    await a.unregister(other)
    with pytest.raises(aiote.InvalidArgument, match="unregistered"):
        batch.post()
    nothing_posted(a, before)


async def test_awaiting_only_observes(aiote_peer) -> None:
    e = aiote_peer.engine
    size = 64 << 20
    src = pattern(size, seed=12)
    ms = await e.register(src)
    desc = await aiote_peer.register("big", size)
    t = e.post_write(ms, desc, imm=41)
    # a timed wait that runs out, and an await that is cancelled, leave the transfer going
    with pytest.raises(aiote.TransferTimeout):
        await t.wait(timeout=0.0001)
    with anyio.move_on_after(0.001):
        await t
    await t.wait(timeout=120)
    assert t.done
    await aiote_peer.wait(imm=41, n=1, timeout=120)
    assert await aiote_peer.digest("big") == digest(src)


async def test_transport_pushback_goes_on_in_the_background() -> None:
    """16 requests in flight at most, and a target that takes nothing meanwhile (its process
    stopped: tcp completes a write once the target has placed it): of 300 posted at once, 16
    go to the transport and every other one waits for room in a background task of the
    engine; all land, in no particular order, once the target runs again. post_budget_us=0: a
    full queue sends a post to the background at once (with a budget the posting call would
    first drive the rail itself)."""
    async with (
        aiote.open_engine(max_in_flight=16, post_budget_us=0, **TCP) as a,
        spawn_peer(engine=a, **TCP) as b,
    ):
        n, slot = 300, 4096
        src = pattern(n * slot, seed=13)
        ms = await a.register(src)
        d = await b.register("dst", n * slot)
        await a.write(ms, d, length=slot, imm=50, timeout=30)  # connected
        await b.wait(imm=50)
        assert a.route(d).provider.startswith("tcp")
        async with frozen(b.pid):
            transfers = [
                a.post_write(ms, d, length=slot, src_offset=slot * k, dst_offset=slot * k, imm=51)
                for k in range(n)
            ]
            # (internal: the transfers the transport did not take at once went to a background task)
            assert sum(t._bg is not None for t in transfers) >= n - 16
        await b.wait(imm=51, n=n, timeout=60)
        for t in transfers:
            await t.wait(timeout=30)
        assert await b.digest("dst") == digest(src)
        assert await b.counter(51) == 0  # n credits, taken by the wait, and none more


async def test_several_nics_are_posted_by_a_background_task() -> None:
    async with (
        aiote.open_engine(nics=["lo", "lo"], **TCP) as a,
        aiote.open_engine(nics=["lo", "lo"], **TCP) as b,
    ):
        size = 8 << 20  # above stripe_min: split over both NICs, one credit
        src = pattern(size, seed=14)
        dst = zeros(size)
        ms, md = await a.register(src), await b.register(dst)
        t = a.post_write(ms, md.descriptor, imm=61)
        imm = a.post_write_imm(md.descriptor, 62)
        assert t._bg is not None and imm._bg is not None  # (internal: striped, failover: a task)
        await b.imm_counter(61).wait(1, timeout=30)
        await b.imm_counter(62).wait(1, timeout=30)
        await t
        await imm
        assert digest(dst) == digest(src)
        assert b.imm_counter(61).total == 1


async def test_errors_surface_when_awaited_and_unawaited_failures_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with aiote.open_engine(retry=aiote.RetryPolicy(connect_timeout=0.5), **TCP) as e:
        async with aiote.open_engine(**TCP) as gone:
            d = (await gone.register(zeros(4096))).descriptor
        ms = await e.register(pattern(4096))
        t = e.post_write(ms, d, length=64, imm=1)
        with pytest.raises(aiote.PeerUnreachable):
            await t.wait(timeout=10)
        with pytest.raises(aiote.PeerUnreachable):  # the same outcome every time
            await t
        caplog.set_level(logging.WARNING, logger="aiote")
        lost = e.post_write_imm(d, 2)
        with anyio.fail_after(10):
            while not lost.done:  # noqa: ASYNC110 - waits without awaiting the transfer
                await anyio.sleep(0.01)
        del lost
        gc.collect()
        assert "never awaited" in caplog.text
    with pytest.raises(aiote.EngineClosed):
        e.post_write_imm(d, 3)


async def test_post_write_imm_to_a_peer_process() -> None:
    async with aiote.open_engine(**TCP) as e, spawn_peer(engine=e, **TCP) as p:
        desc = await p.register("buf", 4096)
        ts = [e.post_write_imm(desc, 71) for _ in range(100)]
        await p.wait(imm=71, n=100)
        for t in ts:
            await t


async def test_engine_closed_under_a_transfer() -> None:
    async with aiote.open_engine(**TCP) as b:
        dst = await b.register(zeros(256 << 20))
        async with aiote.open_engine(**TCP) as a:
            ms = await a.register(pattern(256 << 20, seed=15))
            t = a.post_write(ms, dst.descriptor, imm=81)
            await a.aclose(timeout=0)  # does not wait for the 256 MiB in flight
            assert t.done
            with pytest.raises(aiote.EngineClosed):
                await t


async def test_a_broken_connection_under_a_posted_write_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aiote")
    async with (
        # one stream: a large post_write over several goes split, from a background task
        aiote.open_engine(retry=aiote.RetryPolicy(connect_timeout=1.0), streams=1, **TCP) as e,
        spawn_peer(engine=e, peer_streams=1, **TCP) as p,
    ):
        size = 256 << 20
        d = await p.register("buf", size)
        ms = await e.register(pattern(size, seed=16))
        await e.write(ms, d, length=64, imm=1)  # connected
        await streams_open(e)
        t = e.post_write(ms, d, imm=1)
        assert t._bg is None  # (internal: posted in the call)
        os.kill(p.pid, signal.SIGKILL)  # the connection breaks under the 256 MiB
        t0 = time.monotonic()
        with pytest.raises(aiote.PeerUnreachable, match="did not answer"):
            await t.wait(timeout=30)
        # the broken connection was answered with a new attempt (the retry policy), which
        # gave up after connect_timeout since nothing listens there any more
        assert "posting again after a broken connection" in caplog.text
        assert time.monotonic() - t0 < 1.0 + 5.0
        with pytest.raises(aiote.PeerUnreachable):
            await t
