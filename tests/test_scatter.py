"""Scatter, barrier and one-sided READ across three processes (this one and two peers), and
peer groups: repeated operations on the same peers resolve their addresses once."""

from __future__ import annotations

import numpy as np
import pytest
from _util import digest, nothing_posted, pattern, snapshot

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("same_host", ["shm", None], ids=["auto", "tcp"])
async def test_scatter_barrier_read_across_three_processes(same_host: str | None) -> None:
    async with (
        aiote.open_engine(same_host=same_host) as e,
        spawn_peer(engine=e, same_host=same_host) as p1,
        spawn_peer(engine=e, same_host=same_host) as p2,
    ):
        size = 1 << 20
        src = pattern(4 * size, seed=21)
        ms = await e.register(src)
        d1 = await p1.register("in", 2 * size)
        d2 = await p2.register("in", 2 * size)
        targets = [
            aiote.ScatterTarget(d1, size, src_offset=0, dst_offset=0),
            aiote.ScatterTarget(d2, size, src_offset=size, dst_offset=7),
            aiote.ScatterTarget(d1, 100, src_offset=2 * size, dst_offset=size),
            aiote.ScatterTarget(bytes(d2), 3, src_offset=3 * size, dst_offset=size + 11),
        ]
        await e.scatter(ms, targets, imm=50)
        await p1.wait(imm=50, n=2)
        await p2.wait(imm=50, n=2)
        assert await p1.counter(50) == 0 and await p2.counter(50) == 0
        assert await p1.digest("in", 0, size) == digest(src[:size])
        assert await p1.digest("in", size, 100) == digest(src[2 * size : 2 * size + 100])
        assert await p2.digest("in", 7, size) == digest(src[size : 2 * size])
        assert await p2.digest("in", size + 11, 3) == digest(src[3 * size : 3 * size + 3])

        # barrier: one zero-byte imm per descriptor; repeated on the same peers, no new
        # address is resolved (the peer group is cached)
        await e.barrier([d1, d2], imm=51)
        peers = e.stats()["peers"]
        for _ in range(10):
            await e.barrier([d1, d2], imm=51)
        assert e.stats()["peers"] == peers
        await p1.wait(imm=51, n=11)
        await p2.wait(imm=51, n=11)
        assert await p1.counter(51) == 0 and await p2.counter(51) == 0

        # READ from each peer (their buffers filled with a known pattern)
        r1 = await p1.register("out", size, fill="pattern", seed=1)
        r2 = await p2.register("out", size, fill="pattern", seed=2)
        got = np.zeros(2 * size, np.uint8)
        mg = await e.register(got)
        await e.read(mg, r1, length=size - 5, src_offset=5, dst_offset=0)
        await e.read(mg, r2, length=size, dst_offset=size)
        assert np.array_equal(got[: size - 5], pattern(size, seed=1)[5:])
        assert np.array_equal(got[size:], pattern(size, seed=2))


async def test_scatter_and_barrier_bad_input_posts_nothing() -> None:
    async with aiote.testing.engine_pair() as (a, b):
        src = pattern(4096)
        dst = np.zeros(4096, np.uint8)
        ms, md = await a.register(src), await b.register(dst)
        ro = await b.register(np.zeros(64, np.uint8), remote_write=False)
        before = snapshot(a)
        good = aiote.ScatterTarget(md.descriptor, 16)
        bad_cases = [
            [good, aiote.ScatterTarget(md.descriptor, 4097)],  # past the destination
            [good, aiote.ScatterTarget(md.descriptor, 16, src_offset=4090)],  # past the source
            [good, aiote.ScatterTarget(ro.descriptor, 16)],  # not remotely writable
            [good, (md.descriptor, 16)],  # not a ScatterTarget
            [good, aiote.ScatterTarget(b"junk", 16)],
        ]
        for targets in bad_cases:
            with pytest.raises((aiote.InvalidArgument, aiote.DescriptorError)):
                await a.scatter(ms, targets, imm=1)  # type: ignore[arg-type]
        with pytest.raises(aiote.InvalidArgument):
            await a.barrier([md.descriptor], imm=-1)
        with pytest.raises(aiote.DescriptorError):
            await a.barrier([md.descriptor, b"\x00" * 40], imm=1)
        nothing_posted(a, before)
        assert not dst.any()
        await a.scatter(ms, [], imm=1)
        await a.barrier([], imm=1)
        nothing_posted(a, before)
        assert b.imm_counter(1).total == 0
