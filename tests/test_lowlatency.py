"""The low-latency setting (loop_spin_us): same results, bounded, validated."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from _util import eventually

import aiote

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
