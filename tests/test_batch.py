"""Transfer batches: many requests posted by one native call, awaited as one."""

from __future__ import annotations

import numpy as np
import pytest
from _util import anyio_backend_with_uvloop as anyio_backend  # noqa: F401 (the fixture: asyncio, trio, uvloop)
from _util import landed, nothing_posted, pattern, zeros

import aiote

pytestmark = pytest.mark.anyio

N = 10_000
SLOT = 16


async def test_ten_thousand_small_writes_in_one_batch(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(N * SLOT, seed=21)
    dst = zeros(N * SLOT)
    ms = await a.register(src)
    md = await b.register(dst)
    # write i goes to a permuted slot, so a mixed-up mapping would show in the bytes
    perm = np.random.default_rng(5).permutation(N)
    batch = a.batch()
    for i in range(N):
        batch.write(
            ms, md.descriptor, length=SLOT, src_offset=i * SLOT, dst_offset=int(perm[i]) * SLOT, imm=42
        )
    assert len(batch) == N
    woken = a.stats()["wakeups_sent"]
    await batch.submit(timeout=120)
    assert a.stats()["ops_in_flight"] == 0
    # awaited as one: a few event-loop wake-ups (the group's completion, room in the queues
    # when they fill), not one per write
    assert a.stats()["wakeups_sent"] - woken < N // 100
    await b.imm_counter(42).wait(N, timeout=60)
    c = b.imm_counter(42)
    assert c.available == 0
    assert c.total == N
    expected = zeros(N * SLOT)
    expected.reshape(N, SLOT)[perm] = src.reshape(N, SLOT)
    assert np.array_equal(dst, expected)


async def test_batch_with_reads_and_writes(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    remote_in = pattern(8192, seed=1)
    remote_out = zeros(8192)
    m_in = await b.register(remote_in, remote_write=False, remote_read=True)
    m_out = await b.register(remote_out, remote_read=False)
    local_src = pattern(8192, seed=2)
    local_dst = zeros(8192)
    ms = await a.register(local_src)
    md = await a.register(local_dst)
    batch = a.batch()
    for k in range(8):
        off = k * 1024
        batch.read(md, m_in.descriptor, length=1024, src_offset=off, dst_offset=8192 - off - 1024)
        batch.write(ms, m_out.descriptor, length=1024, src_offset=off, dst_offset=off, imm=3)
    assert len(batch) == 16
    await batch.submit(timeout=30)
    await b.imm_counter(3).wait(8, timeout=30)
    assert np.array_equal(remote_out, local_src)
    assert np.array_equal(local_dst.reshape(8, 1024), remote_in.reshape(8, 1024)[::-1])


async def test_bad_request_is_refused_when_added_and_the_rest_still_submits(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(4096, seed=3)
    dst = zeros(4096)
    ms = await a.register(src)
    md = await b.register(dst)
    batch = a.batch()
    batch.write(ms, md.descriptor, length=1024, imm=4)
    before = a.stats()
    with pytest.raises(aiote.InvalidArgument):
        batch.write(ms, md.descriptor, length=1024, dst_offset=4000, imm=4)  # past the destination
    with pytest.raises(aiote.InvalidArgument):
        batch.write(ms, md.descriptor, length=8, imm=-1)
    with pytest.raises(aiote.InvalidArgument):
        batch.read(ms, md.descriptor, length=0, src_offset=0)  # reads carry no imm, but 0 B and no imm
    with pytest.raises(aiote.DescriptorError):
        batch.write(ms, bytes(md.descriptor)[:-2], length=8, imm=4)
    assert len(batch) == 1
    nothing_posted(a, before)
    assert not dst.any()
    batch.write(ms, md.descriptor, length=1024, src_offset=1024, dst_offset=1024, imm=4)
    await batch.submit(timeout=30)
    await landed(b, {4: 2})
    assert np.array_equal(dst[:2048], src[:2048])
    assert not dst[2048:].any()


async def test_empty_batch_submits_nothing(aiote_engine_pair) -> None:
    a, _ = aiote_engine_pair
    before = a.stats()
    batch = a.batch()
    assert len(batch) == 0
    await batch.submit()
    nothing_posted(a, before)


async def test_a_batch_can_be_submitted_again(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    n = 64
    src = pattern(n * 32, seed=6)
    dst = zeros(n * 32)
    ms = await a.register(src)
    md = await b.register(dst)
    batch = a.batch()
    for i in range(n):
        batch.write(ms, md.descriptor, length=32, src_offset=i * 32, dst_offset=i * 32, imm=9)
    for k in range(1, 4):
        dst[:] = 0
        await batch.submit(timeout=30)
        await b.imm_counter(9).wait(n, timeout=30)
        assert b.imm_counter(9).total == k * n
        assert np.array_equal(src, dst)
    # the batch re-checks its regions on every submission
    await a.unregister(ms)
    before = a.stats()
    with pytest.raises(aiote.InvalidArgument, match="unregistered"):
        await batch.submit()
    nothing_posted(a, before)
    assert b.imm_counter(9).total == 3 * n


async def test_a_batch_that_grew_between_submissions_sends_what_it_holds_now(aiote_engine_pair) -> None:
    # a submitted batch keeps its rows ready for the next submission (a static schedule);
    # writes added since, within the rows' room or past it, go out with the next one
    a, b = aiote_engine_pair
    src = pattern(40 * 64, seed=8)
    dst = zeros(40 * 64)
    ms, md = await a.register(src), await b.register(dst)
    await a.connect(md.descriptor, timeout=30)  # every stream open: rows placed once, at adding
    batch = a.batch()

    def add(i: int) -> None:
        batch.write(ms, md.descriptor, length=64, src_offset=i * 64, dst_offset=i * 64, imm=10)

    add(0)
    sent = 0
    for upto in (1, 2, 5, 17, 40):  # the first rows' room is 16: then it is made anew
        for i in range(len(batch), upto):
            add(i)
        dst[:] = 0
        await batch.submit(timeout=30)
        sent += upto
        await b.imm_counter(10).wait(upto, timeout=30)
        assert b.imm_counter(10).total == sent
        assert np.array_equal(dst[: upto * 64], src[: upto * 64]) and not dst[upto * 64 :].any()
