"""The low-latency setting (loop_spin_us): same results, bounded, validated."""

from __future__ import annotations

import numpy as np
import pytest

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


async def test_loop_spin_wait_still_times_out() -> None:
    async with aiote.open_engine(loop_spin_us=1000) as a:
        with pytest.raises(aiote.TransferTimeout):
            await a.imm_counter(9).wait(1, timeout=0.05)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e6])
async def test_loop_spin_is_validated(bad: float) -> None:
    with pytest.raises(aiote.InvalidArgument):
        async with aiote.open_engine(loop_spin_us=bad):
            pass
