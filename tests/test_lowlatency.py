"""The low-latency setting (loop_spin_us): same results, bounded, validated."""

from __future__ import annotations

from functools import partial

import anyio
import numpy as np
import pytest
from _util import eventually

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio


async def test_loop_spin_engine_moves_and_counts_the_same_bytes() -> None:
    async with (
        aiote.open_engine(spin_us=200, loop_spin_us=300) as a,
        aiote.open_engine(spin_us=200, loop_spin_us=300) as b,
    ):
        src = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
        dst = np.zeros(1 << 16, np.uint8)
        ms, md = await a.register(src), await b.register(dst)
        for i in range(50):  # ping-pong: each wait may be served by the loop-side spin
            await a.write(ms, md.descriptor, length=1024, src_offset=i * 1024, dst_offset=i * 1024, imm=5)
            await b.imm_counter(5).wait(1, timeout=10)
            await b.write_imm(ms.descriptor, 6)
            await a.imm_counter(6).wait(1, timeout=10)
        assert np.array_equal(src[: 50 * 1024], dst[: 50 * 1024])
        assert b.imm_counter(5).available == 0 and a.imm_counter(6).total == 50


async def test_loop_spin_waits_are_driven_by_the_loop_thread() -> None:
    """The low-latency setting polls the completion queues from the loop thread (loop_polls);
    the default never does."""
    async with aiote.open_engine(loop_spin_us=500) as fast, aiote.open_engine() as plain:
        for e in (fast, plain):
            mr = await e.register(np.zeros(4096, np.uint8))
            for _ in range(20):
                await e.write(mr, mr.descriptor, length=8, imm=3)
                await e.imm_counter(3).wait(1, timeout=10)
        assert fast.stats()["loop_polls"] > 0
        assert plain.stats()["loop_polls"] == 0


async def test_loop_spin_gives_up_and_the_poller_takes_over() -> None:
    """A wait whose credit comes after the spin budget still wakes (through the poller and the
    eventfd), and posting and completions go on after a given-up spin."""
    async with aiote.open_engine(loop_spin_us=50) as a, aiote.open_engine() as b:
        ma, mb = await a.register(np.zeros(4096, np.uint8)), await b.register(np.zeros(4096, np.uint8))

        async def late() -> None:
            await anyio.sleep(0.05)
            await b.write(mb, ma.descriptor, length=8, imm=11)

        async with anyio.create_task_group() as tg:
            tg.start_soon(late)
            with anyio.fail_after(10):
                await a.imm_counter(11).wait(1)
        for _ in range(5):  # after a given-up spin: posts and completions still flow
            await a.write(ma, mb.descriptor, length=8, imm=12, timeout=10)
        await b.imm_counter(12).wait(5, timeout=10)


@pytest.mark.parametrize("loop_spin_us", [0.0, 500.0])
async def test_cancelled_wait_takes_no_available_credit(loop_spin_us: float) -> None:
    async with aiote.open_engine(loop_spin_us=loop_spin_us) as a:
        mr = await a.register(np.zeros(4096, np.uint8))
        await a.write(mr, mr.descriptor, length=8, imm=13)
        c = a.imm_counter(13)
        await eventually(lambda: c.available >= 1, "the credit to arrive")
        with anyio.CancelScope() as scope:
            scope.cancel()
            await c.wait(1)
        assert scope.cancelled_caught and c.available == 1
        await c.wait(1, timeout=10)
        assert c.available == 0


async def test_loop_spin_wait_still_times_out() -> None:
    async with aiote.open_engine(loop_spin_us=1000) as a:
        with pytest.raises(aiote.TransferTimeout):
            await a.imm_counter(9).wait(1, timeout=0.05)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e6])
async def test_loop_spin_is_validated(bad: float) -> None:
    with pytest.raises(aiote.InvalidArgument):
        async with aiote.open_engine(loop_spin_us=bad):
            pass


async def _wait_before_the_credit(
    waiter: aiote.Engine, writer: aiote.Engine, spin_us: float, imm: int
) -> None:
    """``waiter`` waits for a credit of ``imm`` (its ``loop_spin_us``: ``spin_us``) that
    ``writer`` (on the same event loop) sends only once the wait has begun (and given up its
    spin)."""
    mw = await waiter.register(np.zeros(4096, np.uint8))
    src = await writer.register(np.zeros(4096, np.uint8))

    async def wait(started: anyio.Event) -> None:
        started.set()
        await waiter.imm_counter(imm).wait(1, timeout=10, loop_spin_us=spin_us)

    for _ in range(10):
        async with anyio.create_task_group() as tg:
            started = anyio.Event()
            tg.start_soon(wait, started)
            await started.wait()
            await writer.write(src, mw.descriptor, length=8, imm=imm, timeout=10)
    assert waiter.imm_counter(imm).available == 0 and waiter.imm_counter(imm).total == 10


async def test_one_wait_spins_on_a_default_engine() -> None:
    """``loop_spin_us`` on one wait: the loop thread drives the completion queues for it
    (``loop_polls``) on an engine that never spins otherwise, and the credit is taken."""
    async with aiote.open_engine() as plain, aiote.open_engine() as peer:
        assert plain.stats()["loop_polls"] == 0
        await _wait_before_the_credit(plain, peer, 500.0, 21)
        assert plain.stats()["loop_polls"] > 0


async def test_one_wait_does_not_spin_on_a_spinning_engine() -> None:
    """``loop_spin_us=0`` turns the engine's setting off for that wait: it sleeps until the
    poller wakes the loop (no loop-thread poll), and the credit is taken."""
    async with aiote.open_engine(loop_spin_us=500) as fast, aiote.open_engine() as peer:
        await _wait_before_the_credit(fast, peer, 0.0, 22)
        assert fast.stats()["loop_polls"] == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e6, True, "10"])
async def test_a_wait_spin_is_validated(bad: object) -> None:
    async with aiote.open_engine() as a:
        mr = await a.register(np.zeros(4096, np.uint8))
        await a.write(mr, mr.descriptor, length=8, imm=23)
        await eventually(lambda: a.imm_counter(23).available == 1, "the credit to arrive")
        with pytest.raises(aiote.InvalidArgument):
            await a.imm_counter(23).wait(1, loop_spin_us=bad)  # type: ignore[arg-type]
        assert a.imm_counter(23).available == 1  # nothing taken


async def test_one_transfer_wait_spins_on_a_default_engine() -> None:
    """``Transfer.wait(loop_spin_us=)``: the loop thread drives the completion queues for that wait
    (``loop_polls``) on an engine that never spins otherwise; the bytes arrive as without."""
    async with aiote.open_engine(same_host=None) as a, aiote.open_engine(same_host=None) as b:
        src = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, np.uint8)
        ms, md = await a.register(src), await b.register(dst)
        for _ in range(5):
            await a.post_write(ms, md.descriptor, imm=24).wait(timeout=10, loop_spin_us=2000)
        await b.imm_counter(24).wait(5, timeout=10)
        assert np.array_equal(src, dst)
        assert a.stats()["loop_polls"] > 0
        with pytest.raises(aiote.InvalidArgument):
            await a.post_write(ms, md.descriptor).wait(loop_spin_us=-1)


async def test_a_spinning_wait_takes_a_peer_processs_credit_without_a_wake_up() -> None:
    """A peer process answers each ping immediate with a pong: a wait for the pong with a
    spin takes it while it spins (the poller does not wake the loop for it: fewer
    ``wakeups_sent``), a wait without sleeps until the poller wakes the loop; every pong is
    taken either way."""
    async with spawn_peer() as peer:
        e = peer.engine
        d = await peer.register("buf", 4096)
        mine = await e.register(np.zeros(4096, np.uint8))
        n = 40
        wakes: dict[float, int] = {}
        for spin, ping, pong in ((0.0, 31, 32), (20000.0, 33, 34)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(peer.call, op="pong", remote=bytes(mine.descriptor).hex(), ping=ping,
                                      pong=pong, iters=n))
                before = e.stats()["wakeups_sent"]
                for _ in range(n):
                    await e.write_imm(d, ping, timeout=10)
                    await e.imm_counter(pong).wait(1, timeout=10, loop_spin_us=spin)
                wakes[spin] = e.stats()["wakeups_sent"] - before
            assert e.imm_counter(pong).available == 0 and e.imm_counter(pong).total == n
        assert wakes[20000.0] < wakes[0.0], wakes
