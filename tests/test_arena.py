"""Host arenas (``Engine.alloc_host``, ``open_engine(host_arena=)``): arrays in a shared-memory
file the engine publishes with its region table. A same-host peer maps it, so its writes
(from 4 KiB on) and reads of regions there are a memcpy by its poller, under the same key,
bounds and rights checks as every access. Real processes over the shm provider."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from _util import pattern, zeros

import aiote
from aiote.testing import digest, spawn_peer

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("need_shm")]


async def test_alloc_host_arrays_are_zeroed_shared_and_given_back() -> None:
    async with aiote.open_engine() as e:
        a = e.alloc_host((3, 1000), np.float32)
        assert a.shape == (3, 1000) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        assert not a.any()
        assert e.stats()["arena_bytes"] == 12288  # page-rounded
        a[:] = 1.5
        view = a[1]
        del a
        gc.collect()
        assert e.stats()["arena_bytes"] == 12288, "a view keeps the range"
        assert (view == 1.5).all()
        del view
        gc.collect()
        assert e.stats()["arena_bytes"] == 0
        b = e.alloc_host(4096)  # the range again, zeroed (its pages were given back)
        assert not b.any() and b.dtype == np.uint8
        assert e.alloc_host(0).size == 0


async def test_bad_arguments_are_refused() -> None:
    with pytest.raises(aiote.InvalidArgument):
        async with aiote.open_engine(host_arena=-1):
            pass
    async with aiote.open_engine() as e:
        for shape, dtype in (((-1,), np.uint8), (4, object), ("x", np.uint8), (4, "no such type")):
            with pytest.raises(aiote.InvalidArgument):
                e.alloc_host(shape, dtype)
        assert e.stats()["arena_bytes"] == 0
    with pytest.raises(aiote.EngineClosed):
        e.alloc_host(16)


async def test_without_an_arena_alloc_host_is_ordinary_memory() -> None:
    for kw in ({"host_arena": 0}, {"same_host_direct": False}, {"same_host": None}):
        async with aiote.open_engine(**kw) as e:
            a = e.alloc_host(8192)
            assert not a.any() and a.nbytes == 8192
            assert e.stats()["arena_bytes"] == 0
    async with aiote.open_engine(host_arena=65536) as e:  # full: ordinary memory, logged
        small = e.alloc_host(65536)
        big = e.alloc_host(1 << 20)
        assert e.stats()["arena_bytes"] == 65536 and big.nbytes == 1 << 20 and not big.any()
        del small


@pytest.mark.parametrize("threads", [None, 1, 4])
async def test_large_arena_copies_are_made_in_parts_by_the_copy_threads(threads: int | None) -> None:
    """From 8 MiB on, a copy into or out of a peer's arena is cut in parts of at least 4 MiB,
    one per copying thread (``copy_threads``: poller 0 and its helpers, cdeps/core/copier.c;
    2 by default here): every byte in place, the immediate after every part; below that, with
    one thread, and outside an arena (the kernel's copy), one copy."""
    async with spawn_peer("tcp", copy_threads=threads) as peer:
        e = peer.engine
        size = (17 << 20) + 13  # parts not page-aligned, an odd tail
        d = await peer.register("dst", size + 100, device="arena")
        src = e.alloc_host(size + 3)
        src[:] = pattern(size + 3, seed=81)
        ms = await e.register(src)
        before = e.stats()
        await e.write(ms, d, length=size, src_offset=3, dst_offset=100, imm=82, timeout=30)
        await peer.wait(imm=82)  # credited only once every part is in
        assert await peer.digest("dst", 100, size) == digest(src[3:])
        local = zeros(size)
        ml = await e.register(local)
        await e.read(ml, d, length=size - 1, src_offset=101, dst_offset=1, timeout=30)
        assert np.array_equal(local[1:], src[4:])
        await e.write(ms, d, length=(7 << 20), dst_offset=0, imm=83, timeout=30)  # one memcpy
        await peer.wait(imm=83)
        assert await peer.digest("dst", 0, 7 << 20) == digest(src[: 7 << 20])
        st = e.stats()
        assert st["direct_mapped"] - before["direct_mapped"] == 3  # the route: the arena's memcpy
        split = 0 if threads == 1 else 2  # the 17 MiB write and read
        assert st["direct_split"] - before["direct_split"] == split
        helpers = [t for t in os.listdir("/proc/self/task") if _thread_name(t) == "aiote-copy"]
        assert len(helpers) == {None: aiote.default_copy_threads(), 1: 1, 4: 4}[threads] - 1
        # outside an arena the kernel copies (process_vm_writev), in one piece
        d2 = await peer.register("plain", size, device=None)
        await e.write(ms, d2, length=size, src_offset=3, imm=84, timeout=30)
        await peer.wait(imm=84)
        assert await peer.digest("plain", 0, size) == digest(src[3:])
        st2 = e.stats()
        assert st2["direct_copies"] - st["direct_copies"] == 1 and st2["direct_mapped"] == st["direct_mapped"]
        assert st2["direct_split"] == st["direct_split"]
        assert st2["bytes_in_flight"] == 0  # direct copies count their bytes until they end


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # (the thread ended)
        return ""


async def test_writes_and_reads_into_a_peers_arena_are_memcpys() -> None:
    async with spawn_peer("tcp") as peer:
        e = peer.engine
        size = 4 << 20
        d = await peer.register("dst", size, device="arena")
        assert d.direct is not None and e.route(d).provider == "shm"
        src = e.alloc_host(size)
        src[:] = pattern(size, seed=71)
        ms = await e.register(src)
        before = e.stats()
        # from 4 KiB on: memcpy, the immediate through shm after it
        cases = [(0, 0, 4096), (5, 4099, 65536 + 3), (0, 1 << 20, 3 << 20)]
        for soff, doff, n in cases:
            await e.write(ms, d, length=n, src_offset=soff, dst_offset=doff, imm=72, timeout=30)
            await peer.wait(imm=72)
            assert await peer.digest("dst", doff, n) == digest(src[soff : soff + n])
        mid = e.stats()
        assert mid["direct_mapped"] - before["direct_mapped"] == len(cases)
        # small writes are memcpys as well (checked like the rest), the immediate after them
        await e.write(ms, d, length=100, src_offset=9, dst_offset=7, imm=73, timeout=30)
        await peer.wait(imm=73)
        assert await peer.digest("dst", 7, 100) == digest(src[9:109])
        assert e.stats()["direct_mapped"] == mid["direct_mapped"] + 1
        mid = e.stats()
        # reads out of the arena
        local = zeros(size)
        ml = await e.register(local)
        await e.read(ml, d, length=65536, src_offset=4099, dst_offset=1, timeout=30)
        assert np.array_equal(local[1:65537], src[5 : 65536 + 5])
        assert e.stats()["direct_mapped"] == mid["direct_mapped"] + 1
        # the other way: the peer writes into our arena
        mine = e.alloc_host(1 << 20)
        mm = await e.register(mine)
        await peer.register("src", 1 << 20, fill="pattern", seed=74)
        await peer.write("src", mm.descriptor, imm=75)
        await e.imm_counter(75).wait(1, timeout=30)
        assert np.array_equal(mine, pattern(1 << 20, seed=74))
        assert (await peer.stats())["direct_mapped"] == 1
        assert e.stats()["ops_in_flight"] == 0


async def test_a_stale_arena_descriptor_is_refused_and_nothing_moves() -> None:
    async with spawn_peer("tcp") as peer:
        e = peer.engine
        old = await peer.register("dst", 1 << 20, device="arena")
        src = zeros(1 << 20)
        src[:] = 0x42
        ms = await e.register(src)
        await e.write(ms, old, imm=76, timeout=30)
        await peer.wait(imm=76)
        assert e.stats()["direct_mapped"] == 1  # the arena's path, which the stale write then takes
        # the peer registers anew: the old region is unregistered, its arena range freed and,
        # maybe, handed out again for the new one
        await peer.register("dst", 1 << 20, device="arena")
        clean = await peer.digest("dst")
        src[:] = 0x43
        with pytest.raises(aiote.RemoteAccessError):
            await e.write(ms, old, imm=77, timeout=30)
        with pytest.raises(aiote.RemoteAccessError):
            await e.read(ms, old, timeout=30)
        assert await peer.digest("dst") == clean
        assert (src == 0x43).all()
        assert (await peer.call(op="counter", imm=77))["available"] == 0


async def test_an_arena_owner_reached_without_direct_copies_goes_through_shm() -> None:
    async with spawn_peer("tcp", same_host_direct=False) as peer:
        e = peer.engine
        d = await peer.register("dst", 1 << 20, device="arena")
        src = zeros(1 << 20)
        src[:] = pattern(1 << 20, seed=78)
        ms = await e.register(src)
        await e.write(ms, d, imm=79, timeout=30)
        await peer.wait(imm=79)
        assert await peer.digest("dst") == digest(src)
        assert e.stats()["direct_copies"] == 0


async def test_a_finalizer_freeing_while_the_allocator_holds_its_lock_neither_hangs_nor_corrupts() -> None:
    """The garbage collector runs finalizers on whatever thread allocates, ``alloc`` included:
    a range freed by one while the arena's own (non-reentrant) lock is held used to take the
    lock again on the same thread and hang the process. Run in a worker thread under a
    deadline, so that a regression fails instead of hanging the suite."""
    import anyio

    async with aiote.open_engine() as e:
        arena = e._arena
        assert arena is not None

        def churn() -> None:
            class Cycle:
                pass

            # 1. deterministic: a finalizer runs on this thread while the lock is held
            c = Cycle()
            c.me, c.a = c, e.alloc_host(3 * 4096)  # type: ignore[attr-defined]
            del c
            assert arena.in_use == 3 * 4096
            with arena._lock:
                gc.collect()  # frees the range: queued, not merged (the lock is ours)
            assert arena.in_use == 0
            assert arena._starts == [0] and arena._lens == [arena.size]
            # 2. the collector running inside alloc itself (a threshold of 1: a young collection
            # at nearly every allocation, an older one every 50), with arrays that only a
            # collection frees (full collections of the test process's whole heap are rare:
            # they cost milliseconds each and free nothing more)
            old = gc.get_threshold()
            gc.set_threshold(1, 50, 1000)
            try:
                keep = []
                for i in range(3000):
                    c = Cycle()
                    c.me, c.a = c, e.alloc_host(4096 * (1 + i % 5))  # type: ignore[attr-defined]
                    if i % 7 == 0:
                        keep.append(e.alloc_host(4096))
                    del c
                    if len(keep) > 20:
                        keep.clear()
                keep.clear()
            finally:
                gc.set_threshold(*old)
            gc.collect()

        with anyio.fail_after(60):
            await anyio.to_thread.run_sync(churn, abandon_on_cancel=True)
        assert arena.in_use == 0
        assert arena._starts == [0] and arena._lens == [arena.size], "the free list lost or doubled a range"
        b = e.alloc_host(arena.size)  # the whole arena in one piece again
        # zeroed where the churn's ranges were (first fit: its first MiBs; reading all 4 GiB
        # would fault in every page of the arena, seconds of a test's time)
        assert b is not None and b.size == arena.size and not b[: 64 << 20].any()


async def test_the_arena_benchmark_refuses_ordinary_memory_when_its_arena_is_full() -> None:
    """``aiote bench --arena`` measures the arena's route only: a region the arena has no room
    for raises, rather than ``alloc_host``'s ordinary memory (another route) being measured."""
    from aiote.cli._benchnet import bench_array

    async with aiote.open_engine(host_arena=1 << 20) as e:
        kept = bench_array(e, 512 << 10, True, "this side")
        assert e.stats()["arena_bytes"] >= 512 << 10 and kept.nbytes == 512 << 10
        with pytest.raises(RuntimeError, match="this side's host arena has no room"):
            bench_array(e, 1 << 20, True, "this side")
        assert bench_array(e, 1 << 20, False, "this side").nbytes == 1 << 20  # not asked: any memory
