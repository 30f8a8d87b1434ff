"""One-sided writes and reads between engines of one process, bytes verified end to end."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from _util import anyio_backend_with_uvloop as anyio_backend  # noqa: F401 (the fixture: asyncio, trio, uvloop)
from _util import counting, digest, nothing_posted, pattern, two_regions, zeros

import aiote
from aiote.testing import engine_pair

pytestmark = pytest.mark.anyio

# (length, src_offset, dst_offset): odd sizes and unaligned offsets around page and
# transport thresholds (inject size 64 B, pages, eager/rendezvous sizes)
CASES = [
    (1, 0, 0),
    (1, 4095, 1),
    (63, 1, 3),
    (64, 0, 64),
    (65, 7, 0),
    (4095, 1, 2),
    (4096, 0, 0),
    (4097, 4095, 13),
    (65537, 3, 5),
    (1 << 20, 0, 1),
    ((3 << 20) + 7, 11, 4093),
    (16 << 20, 1, 0),
]


@pytest.mark.parametrize(("length", "src_offset", "dst_offset"), CASES)
async def test_write_bytes_end_to_end(
    aiote_engine_pair, length: int, src_offset: int, dst_offset: int
) -> None:
    a, b = aiote_engine_pair
    pad = 37
    src = pattern(src_offset + length + pad, seed=length)
    dst = zeros(dst_offset + length + pad)
    ms = await a.register(src, remote_write=False)
    md = await b.register(dst)
    await a.write(ms, md.descriptor, length=length, src_offset=src_offset, dst_offset=dst_offset, imm=1)
    await b.imm_counter(1).wait(1, timeout=30)
    assert digest(dst[dst_offset : dst_offset + length]) == digest(src[src_offset : src_offset + length])
    assert np.array_equal(dst[dst_offset : dst_offset + length], src[src_offset : src_offset + length])
    # nothing written outside the destination range
    assert not dst[:dst_offset].any()
    assert not dst[dst_offset + length :].any()
    assert b.imm_counter(1).available == 0
    assert b.imm_counter(1).total == 1


@pytest.mark.parametrize("same_host", [None, "shm"], ids=["tcp", "shm"])
@pytest.mark.parametrize("length", [8, 4096, 1 << 20, 8 << 20])
async def test_source_reused_as_soon_as_write_returns(same_host: str | None, length: int) -> None:
    """``write`` returns when the source may be reused: overwriting it at once (and writing the
    next round from the same buffer) never shows in what the receiver got."""
    async with engine_pair(same_host=same_host) as (a, b):
        assert a.route(b.address).provider.startswith(same_host or "tcp")
        rounds = 6
        src = zeros(length)
        dst = zeros(rounds * length)
        ms, md = await a.register(src), await b.register(dst)
        for r in range(rounds):
            src[:] = pattern(length, seed=r)
            await a.write(ms, md.descriptor, length=length, dst_offset=r * length, imm=9)
            src.fill(0xFF)  # the caller's next use of its buffer, at once
        await b.imm_counter(9).wait(rounds, timeout=60)
        for r in range(rounds):
            assert digest(dst[r * length : (r + 1) * length]) == digest(pattern(length, seed=r)), r


async def test_write_default_length_is_what_fits(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(1000, seed=3)
    dst = zeros(700)
    ms = await a.register(src)
    md = await b.register(dst)
    # fits the destination: 700 - 100 = 600 bytes from src[50:]
    await a.write(ms, md.descriptor, src_offset=50, dst_offset=100, imm=2)
    await b.imm_counter(2).wait(1, timeout=30)
    assert not dst[:100].any()
    assert np.array_equal(dst[100:], src[50:650])
    # fits the source: the last 10 bytes of src at the start of dst
    dst[:] = 0
    await a.write(ms, md.descriptor, src_offset=990, imm=2)
    await b.imm_counter(2).wait(1, timeout=30)
    assert np.array_equal(dst[:10], src[990:])
    assert not dst[10:].any()


async def test_write_descriptor_as_bytes_and_typed_arrays(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = np.arange(10_000, dtype=np.float64).reshape(100, 100)
    dst = np.zeros((100, 100), np.float64)
    ms = await a.register(src)
    md = await b.register(dst)
    assert ms.nbytes == src.nbytes == md.descriptor.length
    await a.write(ms, bytes(md.descriptor), imm=5)  # the descriptor as it travels: bytes
    await b.imm_counter(5).wait(1, timeout=30)
    assert np.array_equal(src, dst)


async def test_write_from_read_only_source(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(5000, seed=9)
    src.setflags(write=False)
    ms = await a.register(src, remote_write=False, remote_read=False)
    assert not ms.descriptor.remote_write and not ms.descriptor.remote_read
    dst = zeros(5000)
    md = await b.register(dst)
    await a.write(ms, md.descriptor, imm=6)
    await b.imm_counter(6).wait(1, timeout=30)
    assert np.array_equal(src, dst)


async def test_write_imm_only_counts(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    dst = zeros(64)
    md = await b.register(dst)
    for _ in range(3):
        await a.write_imm(md.descriptor, 77)
    src = pattern(64, seed=1)
    ms = await a.register(src)
    await a.write(ms, md.descriptor, length=0, dst_offset=64, imm=77)  # zero bytes at the very end
    await b.imm_counter(77).wait(4, timeout=30)
    assert b.imm_counter(77).total == 4
    assert not dst.any()  # zero-byte writes carry no data


async def test_repeated_identical_writes_send_current_bytes(aiote_engine_pair) -> None:
    # a repeated identical call reuses its validated request: it must still move what the
    # source holds now, to the same place, and a changed argument must go where it says
    a, b = aiote_engine_pair
    src, dst, ms, desc = await two_regions(a, b, 256, 512)
    c = b.imm_counter(78)
    for k in range(1, 6):
        src[:] = k
        await a.write(ms, desc, length=128, src_offset=64, dst_offset=256, imm=78)
        await c.wait(1, timeout=30)
        assert (dst[256:384] == k).all()
        assert not dst[:256].any() and not dst[384:].any()
    await a.write(ms, desc, length=128, src_offset=64, dst_offset=0, imm=78)
    await c.wait(1, timeout=30)
    assert (dst[:128] == 5).all()
    for _ in range(3):
        await a.write_imm(desc, 78)
    await a.write_imm(desc, 79)
    await c.wait(3, timeout=30)
    await b.imm_counter(79).wait(1, timeout=30)
    assert c.total == 9


async def test_interleaved_repeated_writes_each_go_to_their_slot(aiote_engine_pair) -> None:
    # several repeated writes in turn (a ring of slots, each written again and again, from
    # concurrent tasks too): each reused request moves its own slot's current bytes to its own
    # place; more distinct writes than the engine keeps requests for are still right
    a, b = aiote_engine_pair
    slots, size = 8, 64
    src = zeros(slots * size)
    dst = zeros(slots * size)
    ms = await a.register(src)
    md = await b.register(dst)
    desc = md.descriptor
    c = b.imm_counter(80)

    async def one(slot: int) -> None:
        off = slot * size
        await a.write(ms, desc, length=size, src_offset=off, dst_offset=off, imm=80)

    with counting(a, "_rows") as built:  # requests built by full validation
        for round_ in range(1, 5):
            for slot in range(slots):
                src[slot * size : (slot + 1) * size] = round_ * 16 + slot
            async with anyio.create_task_group() as tg:
                for slot in reversed(range(slots)):
                    tg.start_soon(one, slot)
            await c.wait(slots, timeout=30)
            for slot in range(slots):
                assert (dst[slot * size : (slot + 1) * size] == round_ * 16 + slot).all()
            if round_ == 1:
                built_first = built[0]
    assert built_first == slots and built[0] == slots  # rounds 2-4 reused every slot's request
    assert len(ms._memos) == slots
    # 300 distinct one-byte writes (more than are kept), then the slots again
    for i in range(300):
        src[i] = (i % 250) + 1
        await a.write(ms, desc, length=1, src_offset=i, dst_offset=i)
    await a.write_imm(desc, 80)
    await c.wait(1, timeout=30)
    assert (dst[:300] == (np.arange(300) % 250) + 1).all()
    await one(3)
    await c.wait(1, timeout=30)
    assert (dst[3 * size : 4 * size] == src[3 * size : 4 * size]).all()
    await a.unregister(ms)
    assert not ms._memos  # unregistering drops the kept requests


async def test_repeated_write_with_new_immediates_reuses_its_request(aiote_engine_pair) -> None:
    # a flow numbering its immediates (a sequence number in each) repeats the same write with
    # another immediate every time: the kept request is copied with the new one (no full
    # validation), awaited or posted; each immediate is credited once, the bytes land each
    # time; an immediate out of [0, 2**32) or not a plain int is still refused, nothing posted
    a, b = aiote_engine_pair
    src, dst, ms, desc = await two_regions(a, b, 256, 1024)
    with counting(a, "_rows") as built:
        for i in range(40):
            src[:] = i + 1
            if i % 2:
                await a.write(ms, desc, length=256, dst_offset=512, imm=1000 + i)
            else:
                await a.post_write(ms, desc, length=256, dst_offset=512, imm=1000 + i)
            await b.imm_counter(1000 + i).wait(1, timeout=30)
            assert (dst[512:768] == i + 1).all() and not dst[:512].any()
    assert built[0] == 1  # the first write alone was built in full
    for bad in (2**32, -1, True, 5.0):
        with pytest.raises(aiote.InvalidArgument):
            await a.write(ms, desc, length=256, dst_offset=512, imm=bad)  # type: ignore[arg-type]
        with pytest.raises(aiote.InvalidArgument):
            a.post_write(ms, desc, length=256, dst_offset=512, imm=bad)  # type: ignore[arg-type]
    await anyio.sleep(0.05)
    assert [b.imm_counter(1000 + i).total for i in range(40)] == [1] * 40  # each credited once
    assert b.imm_counter(1).total == 0 and b.imm_counter(5).total == 0  # (True, 5.0: refused)


async def test_write_without_imm_is_not_counted(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(4096, seed=2)
    dst = zeros(4096)
    ms = await a.register(src)
    md = await b.register(dst)
    await a.write(ms, md.descriptor, length=2048)
    await a.write(ms, md.descriptor, src_offset=2048, dst_offset=2048, imm=8)
    await b.imm_counter(8).wait(1, timeout=30)
    # the un-notified write is observable only through the bytes; wait until it landed
    with anyio.fail_after(20):
        while not np.array_equal(dst[:2048], src[:2048]):  # noqa: ASYNC110 (polls native state)
            await anyio.sleep(0.002)
    assert np.array_equal(dst, src)
    assert b.imm_counter(8).total == 1
    assert b.imm_counter(0).total == 0


@pytest.mark.parametrize(
    ("length", "src_offset", "dst_offset"), [(1, 0, 0), (4097, 5, 3), ((1 << 20) + 3, 1, 0)]
)
async def test_read_bytes_end_to_end(
    aiote_engine_pair, length: int, src_offset: int, dst_offset: int
) -> None:
    a, b = aiote_engine_pair
    remote = pattern(src_offset + length + 9, seed=length + 1)
    mr_remote = await b.register(remote, remote_write=False, remote_read=True)
    local = zeros(dst_offset + length + 9)
    ml = await a.register(local, remote_write=False, remote_read=False)  # a READ target need not be remote
    await a.read(ml, mr_remote.descriptor, length=length, src_offset=src_offset, dst_offset=dst_offset)
    assert np.array_equal(local[dst_offset : dst_offset + length], remote[src_offset : src_offset + length])
    assert not local[:dst_offset].any()
    assert not local[dst_offset + length :].any()
    assert b.imm_counter(0).total == 0  # a READ does not notify the target


async def test_read_from_region_without_remote_read_is_refused(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    remote = pattern(4096, seed=4)
    mr_remote = await b.register(remote, remote_read=False)
    assert not mr_remote.descriptor.remote_read
    local = zeros(4096)
    ml = await a.register(local)
    before = a.stats()
    with pytest.raises(aiote.InvalidArgument, match="remote_read"):
        await a.read(ml, mr_remote.descriptor)
    with pytest.raises(aiote.InvalidArgument, match="remote_read"):
        a.batch().read(ml, mr_remote.descriptor)
    nothing_posted(a, before)
    assert not local.any()


async def test_write_to_region_without_remote_write_is_refused(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    target = zeros(4096)
    mt = await b.register(target, remote_write=False)
    ms = await a.register(pattern(4096))
    before = a.stats()
    with pytest.raises(aiote.InvalidArgument, match="remote_write"):
        await a.write(ms, mt.descriptor, imm=1)
    with pytest.raises(aiote.InvalidArgument, match="remote_write"):
        await a.write_imm(mt.descriptor, 1)
    nothing_posted(a, before)
    assert not target.any()
    assert b.imm_counter(1).total == 0


async def test_three_engines_in_one_process() -> None:
    n = 3
    size = 100_000
    async with (
        aiote.open_engine() as e0,
        aiote.open_engine() as e1,
        aiote.open_engine() as e2,
    ):
        engines = [e0, e1, e2]
        assert len({e.address for e in engines}) == n
        srcs = [pattern(size, seed=10 + i) for i in range(n)]
        # every engine has one inbox slot per other engine
        dsts = [zeros(size * n) for _ in range(n)]
        src_mrs = [await e.register(s) for e, s in zip(engines, srcs, strict=True)]
        dst_mrs = [await e.register(d) for e, d in zip(engines, dsts, strict=True)]

        async def blast(i: int) -> None:
            for j in range(n):
                if j != i:
                    await engines[i].write(
                        src_mrs[i], dst_mrs[j].descriptor, dst_offset=i * size, imm=100 + i
                    )
                    await engines[i].send(engines[j].address, f"from {i}".encode())

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(blast, i)
        for j in range(n):
            for i in range(n):
                if i != j:
                    await engines[j].imm_counter(100 + i).wait(1, timeout=30)
                    assert np.array_equal(dsts[j][i * size : (i + 1) * size], srcs[i])
            assert not dsts[j][j * size : (j + 1) * size].any()
            got = {await engines[j].recv(timeout=30) for _ in range(n - 1)}
            assert got == {(engines[i].address, f"from {i}".encode()) for i in range(n) if i != j}
            assert engines[j].imm_counter(100 + j).total == 0
