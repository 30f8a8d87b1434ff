"""Transfers with a peer engine in another process (aiote.testing.spawn_peer / the
``aiote_peer`` fixture): bytes verified by digest on the peer's side, counts exact."""

from __future__ import annotations

import json
import random

import anyio
import numpy as np
import pytest
from _util import anyio_backend_with_uvloop as anyio_backend  # noqa: F401 (the fixture: asyncio, trio, uvloop)
from _util import digest, eventually, frozen, landed, nothing_posted, pattern, streams_open, zeros

import aiote
from aiote.testing import PeerProcess, spawn_peer

pytestmark = pytest.mark.anyio

CASES = [(1, 0, 0), (3, 1, 4095), (4096, 0, 0), (4097, 7, 3), (65536 + 1, 1, 1), ((1 << 20) + 5, 3, 4096)]


async def test_write_to_peer_sizes_and_offsets(aiote_peer: PeerProcess) -> None:
    e = aiote_peer.engine
    src = pattern(4 << 20, seed=31)
    ms = await e.register(src, remote_write=False)
    for i, (length, so, do) in enumerate(CASES):
        name = f"dst{i}"
        size = do + length + 100
        desc = await aiote_peer.register(name, size)
        assert desc.length == size and desc.remote_write
        await e.write(ms, desc, length=length, src_offset=so, dst_offset=do, imm=i)
        await aiote_peer.wait(imm=i, n=1)
        assert await aiote_peer.digest(name, do, length) == digest(src[so : so + length])
        # untouched around the destination range
        assert await aiote_peer.digest(name, 0, do) == digest(zeros(do))
        assert await aiote_peer.digest(name, do + length) == digest(zeros(100))
        assert await aiote_peer.counter(i) == 0


async def test_64_mib_write_to_peer(aiote_peer: PeerProcess) -> None:
    e = aiote_peer.engine
    length = 64 << 20
    src = pattern(length + 3, seed=64)
    ms = await e.register(src)
    desc = await aiote_peer.register("big", length + 5)
    await e.write(ms, desc, length=length, src_offset=3, dst_offset=5, imm=64, timeout=120)
    await aiote_peer.wait(imm=64, n=1, timeout=120)
    assert await aiote_peer.digest("big", 5, length) == digest(src[3:])
    assert await aiote_peer.digest("big", 0, 5) == digest(zeros(5))


async def test_peer_writes_into_this_process(aiote_peer: PeerProcess) -> None:
    e = aiote_peer.engine
    size = (1 << 20) + 17
    await aiote_peer.register("pat", size, fill="pattern", seed=8)
    expected = pattern(size, seed=8)  # the same bytes the peer generated
    for i, (length, so, do) in enumerate(CASES):
        dst = zeros(do + length + 33)
        md = await e.register(dst)
        await aiote_peer.write("pat", md.descriptor, length=length, src_offset=so, dst_offset=do, imm=200 + i)
        await e.imm_counter(200 + i).wait(1, timeout=30)
        assert np.array_equal(dst[do : do + length], expected[so : so + length])
        assert not dst[:do].any() and not dst[do + length :].any()
        await e.unregister(md)
    # repeated writes: exact credit count
    md = await e.register(zeros(size))
    await aiote_peer.write("pat", md.descriptor, imm=300, count=5)
    await landed(e, {300: 5})
    assert e.imm_counter(300).available == 5


async def test_read_from_peer(aiote_peer: PeerProcess) -> None:
    e = aiote_peer.engine
    size = (1 << 20) + 3
    desc = await aiote_peer.register("src", size, fill="pattern", seed=12, remote_write=False)
    assert desc.remote_read and not desc.remote_write
    expected = pattern(size, seed=12)
    local = zeros(size + 10)
    ml = await e.register(local)
    for length, so, do in [(1, 0, 0), (4099, 5, 7), (size, 0, 10), (size - 1, 1, 0)]:
        local[:] = 0
        await e.read(ml, desc, length=length, src_offset=so, dst_offset=do, timeout=30)
        assert np.array_equal(local[do : do + length], expected[so : so + length])
        assert not local[:do].any() and not local[do + length :].any()

    closed = await aiote_peer.register("closed", 4096, fill="pattern", seed=1, remote_read=False)
    local[:] = 0
    await streams_open(e)  # (the first read's openings of other streams are done)
    before = e.stats()
    with pytest.raises(aiote.InvalidArgument, match="remote_read"):
        await e.read(ml, closed, length=4096)
    nothing_posted(e, before)
    assert not local.any()
    # and the peer's region is not writable either
    with pytest.raises(aiote.InvalidArgument, match="remote_write"):
        await e.write(ml, desc, length=16, imm=1)
    nothing_posted(e, before)
    assert await aiote_peer.digest("src") == digest(expected)


async def test_imms_in_random_order_both_directions(aiote_peer: PeerProcess) -> None:
    e = aiote_peer.engine
    imms = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}
    order = [imm for imm, k in imms.items() for _ in range(k)]
    random.Random(3).shuffle(order)

    # peer -> us, one write per command, in random order, nobody waiting yet
    md = await e.register(zeros(64))
    for imm in order:
        await aiote_peer.write_imm(md.descriptor, imm)
    await landed(e, imms)
    for imm in random.Random(4).sample(list(imms), len(imms)):
        c = e.imm_counter(imm)
        assert c.available == imms[imm]
        await c.wait(imms[imm], timeout=10)
        assert c.available == 0

    # us -> peer, concurrently (any order), then the peer's late waiter sees every credit
    desc = await aiote_peer.register("imm", 64)
    async with anyio.create_task_group() as tg:
        for imm in order:
            tg.start_soon(e.write_imm, desc, imm)
    for imm, k in imms.items():
        with anyio.fail_after(30):
            while await aiote_peer.counter(imm) < k:  # noqa: ASYNC110 (polls native state)
                await anyio.sleep(0.01)
        assert await aiote_peer.counter(imm) == k
    for imm, k in imms.items():
        await aiote_peer.wait(imm=imm, n=k)
        assert await aiote_peer.counter(imm) == 0


async def test_ten_thousand_writes_in_one_batch_to_peer(aiote_peer: PeerProcess) -> None:
    e = aiote_peer.engine
    n, slot = 10_000, 8
    src = pattern(n * slot, seed=10)
    ms = await e.register(src)
    desc = await aiote_peer.register("batch", n * slot)
    batch = e.batch()
    for i in reversed(range(n)):
        batch.write(ms, desc, length=slot, src_offset=i * slot, dst_offset=i * slot, imm=77)
    await batch.submit(timeout=120)
    await aiote_peer.wait(imm=77, n=n, timeout=60)
    assert await aiote_peer.counter(77) == 0
    assert await aiote_peer.digest("batch") == digest(src)


async def test_messages_with_peer(aiote_peer: PeerProcess) -> None:
    # every call is a send to the peer and a recv of its reply, checked to come from it
    text = "x" * 500_000
    r = await aiote_peer.call(op="echo", payload=text)
    assert r["ok"] is True and r["payload"] == text
    with pytest.raises(aiote.testing.PeerError, match="unknown op"):
        await aiote_peer.call(op="nonsense")
    e = aiote_peer.engine
    await e.send(aiote_peer.address, b'{"op": "echo", "payload": 7}', timeout=30)
    sender, payload = await e.recv(timeout=30)
    assert sender == aiote_peer.address
    assert json.loads(payload) == {"ok": True, "payload": 7, "id": None}  # replies echo the id


SIZES = [0, 1, 4096, 65537, 1 << 20]  # 0 B to max_message_size


async def test_send_recv_sizes_both_ways_with_a_peer_process(aiote_peer: PeerProcess) -> None:
    e, peer = aiote_peer.engine, aiote_peer.address
    seeds = list(range(31, 31 + len(SIZES)))
    # to the peer: it takes the next len(SIZES) messages raw and reports what it got
    await e.send(peer, json.dumps({"op": "recv_raw", "count": len(SIZES), "id": 1}).encode(), timeout=30)
    for size, seed in zip(SIZES, seeds, strict=True):
        await e.send(peer, pattern(size, seed).tobytes(), timeout=30)
    sender, payload = await e.recv(timeout=60)
    assert sender == peer
    got = json.loads(payload)["got"]
    assert got == [[size, digest(pattern(size, seed))] for size, seed in zip(SIZES, seeds, strict=True)]
    # from the peer: raw messages of every size, in order, then its reply
    await e.send(peer, json.dumps({"op": "send_raw", "sizes": SIZES, "seeds": seeds, "id": 2}).encode(),
                 timeout=30)
    for size, seed in zip(SIZES, seeds, strict=True):
        sender, payload = await e.recv(timeout=60)
        assert sender == peer and len(payload) == size
        assert payload == pattern(size, seed).tobytes()
    _, payload = await e.recv(timeout=60)
    assert json.loads(payload) == {"ok": True, "id": 2}


# more than the kernel can buffer for a frozen receiver (tcp_wmem + tcp_rmem maxima)
FROZEN = 64 << 20


async def test_unregister_waits_for_a_write_in_flight() -> None:
    # over tcp: a write to a frozen peer stays in flight there (tests/test_guarantees.py
    # covers the same-host route, where it completes)
    async with spawn_peer(cancel_grace=120, same_host=None) as peer:
        e = peer.engine
        desc = await peer.register("buf", FROZEN)
        src = np.full(FROZEN, 0xA5, np.uint8)
        src[::4097] = 7
        ms = await e.register(src)
        await e.write(ms, desc, length=8, imm=1)  # connect while the peer runs
        await streams_open(e)
        await peer.wait(imm=1)
        done = anyio.Event()
        unregistered = anyio.Event()
        async with anyio.create_task_group() as tg:
            async with frozen(peer.pid):

                async def writer() -> None:
                    await e.write(ms, desc, imm=2)
                    done.set()

                tg.start_soon(writer)
                await eventually(lambda: e.stats()["ops_in_flight"] > 0, "the write to be posted")
                with pytest.raises(aiote.RegionBusy):
                    await e.unregister(ms, timeout=0)
                with pytest.raises(aiote.RegionBusy) as info:
                    await e.unregister(ms, timeout=0.05)
                assert isinstance(info.value, aiote.RegistrationError)
                assert ms.registered

                async def unregister() -> None:
                    await e.unregister(ms)
                    unregistered.set()

                tg.start_soon(unregister)
                await anyio.wait_all_tasks_blocked()
                # the peer is frozen: the write cannot have completed, so the region stays
                assert not done.is_set()
                assert not unregistered.is_set()
                assert ms.registered
            with anyio.fail_after(60):
                await done.wait()
                await unregistered.wait()
        assert not ms.registered
        assert e.stats()["ops_in_flight"] == 0
        await peer.wait(imm=2, timeout=60)
        assert await peer.digest("buf") == digest(src)


async def test_write_timeout_and_cancel_while_the_peer_is_frozen() -> None:
    # over tcp (same_host=None): a frozen peer cannot complete even a small write there
    async with spawn_peer(cancel_grace=120, same_host=None) as peer:
        e = peer.engine
        desc = await peer.register("buf", FROZEN)
        small = await peer.register("small", 4096)
        src = pattern(FROZEN, seed=2)
        ms = await e.register(src)
        tail = pattern(4096, seed=3)
        mt = await e.register(tail)
        await e.write(mt, small, imm=1)
        await peer.wait(imm=1)
        finished = anyio.Event()
        async with anyio.create_task_group() as tg:
            async with frozen(peer.pid):
                with pytest.raises(aiote.TransferTimeout) as info:
                    await e.write(ms, desc, imm=2, timeout=0.2)
                assert isinstance(info.value, TimeoutError)
                # the timed-out write was posted: its buffer stays with the transport
                assert e.stats()["ops_in_flight"] >= 1
                with pytest.raises(aiote.RegionBusy):
                    await e.unregister(ms, timeout=0)

                cs = anyio.CancelScope()

                async def cancelled_writer() -> None:
                    with cs:
                        await e.write(mt, small, imm=3)
                    assert cs.cancelled_caught
                    finished.set()

                tg.start_soon(cancelled_writer)
                await eventually(lambda: e.stats()["ops_in_flight"] >= 2, "the second write to be posted")
                cs.cancel()
                await anyio.wait_all_tasks_blocked()
                # cancelled, but the posted request is not taken back while the transport owns it
                assert not finished.is_set()
                assert e.stats()["ops_in_flight"] >= 2
            with anyio.fail_after(60):
                await finished.wait()
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "the transport to let go")
        await e.unregister(ms, timeout=0)
        await e.unregister(mt, timeout=0)
        # tcp delivers what was posted: both writes landed, the credits are exact
        await peer.wait(imm=2, timeout=60)
        await peer.wait(imm=3, timeout=60)
        assert await peer.counter(2) == 0 and await peer.counter(3) == 0
        assert await peer.digest("buf") == digest(src)
        assert await peer.digest("small") == digest(tail)


async def test_closing_the_engine_fails_the_operations_in_flight_with_engine_closed() -> None:
    async with spawn_peer(same_host=None) as peer:  # over tcp: the write stays in flight
        address = peer.address
        desc = await peer.register("buf", FROZEN)
        result: list[BaseException | None] = []
        async with aiote.open_engine(same_host=None) as e:
            ms = await e.register(np.ones(FROZEN, np.uint8))
            await e.write(ms, desc, length=8, imm=1)
            await peer.wait(imm=1)
            async with frozen(peer.pid), anyio.create_task_group() as tg:

                async def writer() -> None:
                    try:
                        await e.write(ms, desc, imm=2)
                        result.append(None)
                    except aiote.AioteError as exc:
                        result.append(exc)

                tg.start_soon(writer)
                await eventually(lambda: e.stats()["ops_in_flight"] > 0, "the write to be posted")
                await e.aclose(timeout=0.2)  # gives up waiting for the frozen peer
            assert e.closed and not ms.registered
        assert len(result) == 1 and isinstance(result[0], aiote.EngineClosed), result
        # the peer (resumed) is still fine: drive it from a new engine, then let it exit
        async with aiote.open_engine(same_host=None) as fresh:
            peer.engine = fresh
            assert await peer.counter(1) == 0
            src = pattern(4096, seed=1)
            mr = await fresh.register(src)
            small = await peer.register("small", 4096)
            await fresh.write(mr, small, imm=3)
            await peer.wait(imm=3)
            assert await peer.digest("small") == digest(src)
            await fresh.send(address, b'{"op": "exit"}', timeout=30)
            with anyio.fail_after(30):
                await peer.process.wait()
