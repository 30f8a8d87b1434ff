"""GPU memory on machines without a GPU: the engine's host GPU backend (``gpu_backend="host"``)
runs CUDA's stream semantics on host memory (worker-thread streams, signal words stored the
way a kernel stores them), so the staging pipeline, the chunking, the credit ordering, the IPC
rail and the UVM watcher run here over real libfabric transports and real processes.

The peers' copies into "GPU" memory are slowed down (``host:0.005``: each copy takes 5 ms),
so a credit given before the data is in GPU memory would be caught by the digest that
follows the counter.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from _util import counting, fails_after_kill

import aiote
from aiote.testing import HostDeviceArray, HostStream, digest, pattern, spawn_peer

pytestmark = pytest.mark.anyio

SLOW = "host:0.005"


def _device(n: int, seed: int = 1, **kw: object) -> HostDeviceArray:
    arr = HostDeviceArray(n, **kw)  # type: ignore[arg-type]
    arr.host[:] = pattern(n, seed)
    return arr


async def test_staged_write_cross_process_credit_after_copy() -> None:
    n = (3 << 20) + 12345  # not a multiple of the chunk
    async with spawn_peer(peer_gpu_backend=SLOW, gpu_backend=SLOW, stage_chunk=256 << 10) as peer:
        e = peer.engine
        src = _device(n)
        mr = await e.register(src)
        assert mr.on_gpu and mr.device == 0 and mr.descriptor.on_gpu
        dst = await peer.register("g", n, device="host")
        assert dst.on_gpu and dst.gpu is not None
        await e.write(mr, dst, imm=11)
        await peer.wait(imm=11, n=1, timeout=20)
        assert await peer.digest("g") == digest(src.host)
        # offsets, a second write into the middle
        await e.write(mr, dst, length=100_001, src_offset=7, dst_offset=999_999, imm=12)
        await peer.wait(imm=12, n=1, timeout=20)
        assert await peer.digest("g", 999_999, 100_001) == digest(src.host[7 : 7 + 100_001])
        stats = e.stats()
        assert stats["gpu_staged"] == 2 and stats["gpu_ipc"] == 0
        await e.unregister(mr)


async def test_write_imm_is_ordered_after_earlier_copies() -> None:
    n = 2 << 20
    async with spawn_peer(peer_gpu_backend=SLOW, gpu_backend="host", stage_chunk=128 << 10) as peer:
        e = peer.engine
        src = _device(n, seed=5)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="host")
        await e.write(mr, dst)  # no immediate: the peer learns nothing yet
        await e.write_imm(dst, 3)  # ... until this one, credited after the 16 copies
        await peer.wait(imm=3, n=1, timeout=20)
        assert await peer.digest("g") == digest(src.host)


async def test_host_to_gpu_and_gpu_to_host() -> None:
    n = 1 << 20
    async with spawn_peer(peer_gpu_backend=SLOW, gpu_backend=SLOW) as peer:
        e = peer.engine
        host = pattern(n, 9).copy()
        mh = await e.register(host)
        dst = await peer.register("g", n, device="host")
        await e.write(mh, dst, imm=1)
        await peer.wait(imm=1, n=1, timeout=20)
        assert await peer.digest("g") == digest(host)
        # the peer writes from its GPU region into our host memory
        back = np.zeros(n, np.uint8)
        mb = await e.register(back)
        await peer.call(op="write", name="g", remote=bytes(mb.descriptor).hex(), imm=2)
        await e.imm_counter(2).wait(1, timeout=20)
        assert digest(back) == digest(host)
        # and our GPU region into the peer's host memory
        src = _device(n, seed=4)
        ms = await e.register(src)
        hd = await peer.register("h", n)
        await e.write(ms, hd, imm=3)
        await peer.wait(imm=3, n=1, timeout=20)
        assert await peer.digest("h") == digest(src.host)


async def test_paged_gpu_to_gpu_one_credit_per_page() -> None:
    page = 4096
    npages = 300
    async with spawn_peer(peer_gpu_backend=SLOW, gpu_backend=SLOW, max_message_size=4096) as peer:
        e = peer.engine
        src = _device(page * npages, seed=2)
        mr = await e.register(src)
        dst = await peer.register("g", page * 2 * npages, device="host")
        rng = np.random.default_rng(0)
        sp = rng.permutation(npages)
        dp = rng.permutation(2 * npages)[:npages]
        # max_message_size=4096 on our side: the page list goes in several staging messages
        await e.write_paged(mr, dst, page_size=page, src_pages=sp, dst_pages=dp, imm=21)
        await peer.wait(imm=21, n=npages, timeout=30)
        assert (await peer.call(op="counter", imm=21))["available"] == 0  # exactly one credit per page
        for k in (0, 1, npages // 2, npages - 1):
            got = await peer.digest("g", int(dp[k]) * page, page)
            assert got == digest(src.host[int(sp[k]) * page : (int(sp[k]) + 1) * page])


async def test_ipc_rail_same_host() -> None:
    """A GPU peer on this host is written directly (CUDA IPC, here: a shared segment)."""
    n = 3 << 20
    async with spawn_peer(peer_gpu_backend="host", gpu_backend="host") as peer:
        e = peer.engine
        src = _device(n, seed=8)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="shared")
        assert dst.gpu is not None and dst.gpu.ipc_handle
        await e.write(mr, dst, length=n - 10, src_offset=10, imm=4)
        await peer.wait(imm=4, n=1, timeout=20)
        assert await peer.digest("g", 0, n - 10) == digest(src.host[10:])
        sp = np.array([5, 0, 3])
        dp = np.array([1, 2, 7])
        await e.write_paged(mr, dst, page_size=65536, src_pages=sp, dst_pages=dp, imm=5)
        await peer.wait(imm=5, n=3, timeout=20)
        for s, d in zip(sp, dp, strict=True):
            assert await peer.digest("g", int(d) * 65536, 65536) == digest(
                src.host[s * 65536 : (s + 1) * 65536]
            )
        # READ from the peer's GPU region into ours
        out = HostDeviceArray(1000)
        mo = await e.register(out)
        await e.read(mo, dst, length=1000, src_offset=65536)
        assert digest(out.host) == digest(src.host[5 * 65536 : 5 * 65536 + 1000])
        st = e.stats()
        assert st["gpu_ipc"] == 2 and st["gpu_staged"] == 0
    # gpu_ipc=False: the same peer is staged
    async with spawn_peer(peer_gpu_backend="host", gpu_backend="host", gpu_ipc=False) as peer:
        e = peer.engine
        mr = await e.register(src)
        dst = await peer.register("g", n, device="shared")
        await e.write(mr, dst, imm=4)
        await peer.wait(imm=4, n=1, timeout=20)
        assert await peer.digest("g") == digest(src.host)
        assert e.stats()["gpu_staged"] == 1 and e.stats()["gpu_ipc"] == 0


async def test_repeated_ipc_posts_reuse_their_lookups() -> None:
    """post_write repeated over the CUDA-IPC rail from one region to one descriptor object
    after one stream's work (an MoE step's writes) takes the kept lookups: no validation
    layers (``_span`` is not called again), yet each write still starts after the work on its
    stream, lands at its offsets and is credited once; bad arguments still go the full path
    and are refused with nothing posted; unregistering the region drops what was kept."""
    n, piece = 1 << 20, 8192
    async with spawn_peer(peer_gpu_backend="host", gpu_backend="host") as peer:
        e = peer.engine
        src = HostDeviceArray(n)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="shared")
        s = HostStream()
        posted = []
        with counting(e, "_span") as spans:
            for i in range(24):
                data = pattern(piece, 100 + i)

                def kernel(i: int = i, data: np.ndarray = data) -> None:  # the producer, on the stream
                    time.sleep(0.002)
                    src.host[piece * i : piece * (i + 1)] = data

                s.submit(kernel)
                at = piece * ((7 * i) % 100)
                posted.append((e.post_write(mr, dst, length=piece, src_offset=piece * i, dst_offset=at,
                                            imm=500 + i, stream=s), at, data))
        for t, _, _ in posted:
            await t.wait(timeout=30)
        for i, (_, at, data) in enumerate(posted):
            await peer.wait(imm=500 + i, n=1, timeout=20)
            assert await peer.digest("g", at, piece) == digest(data)
        assert spans[0] == 1, spans  # the first write alone went through validation
        gpu = e._gpu
        assert gpu is not None and len(gpu._kept) == 1
        ipc = e.stats()["gpu_ipc"]
        for kw in ({"src_offset": n}, {"dst_offset": n - 1}, {"imm": 1 << 32}, {"src_offset": True},
                   {"length": piece + 0.0}):
            args = {"length": piece, "src_offset": 0, "dst_offset": 0, "imm": 7, **kw}
            with pytest.raises(aiote.InvalidArgument):
                e.post_write(mr, dst, stream=s, **args)  # type: ignore[arg-type]
        assert e.stats()["gpu_ipc"] == ipc  # nothing posted
        await e.unregister(mr)
        assert not gpu._kept
        with pytest.raises(aiote.InvalidArgument, match="unregistered"):
            e.post_write(mr, dst, length=piece, imm=8, stream=s)
        await anyio.sleep(0.1)
        assert (await peer.call(op="counter", imm=7))["available"] == 0
        for i in range(24):  # each credited once (and taken by its wait)
            assert (await peer.call(op="counter", imm=500 + i))["available"] == 0


@asynccontextmanager
async def _lane_offered(seed: int, imm: int) -> AsyncIterator[tuple[Any, HostDeviceArray, Any, Any]]:
    """A peer process owning a 1 MiB emulated GPU region "g", and this side's registered
    pattern of ``seed``, after a first IPC write (immediate ``imm``) was credited by a message
    and offered the owner a credit lane (slowed copies): (peer, source, its region, the
    owner's descriptor)."""
    n = 1 << 20
    async with spawn_peer(peer_gpu_backend="host", gpu_backend=SLOW) as peer:
        e = peer.engine
        src = _device(n, seed=seed)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="shared")
        await e.write(mr, dst, length=4096, imm=imm)  # by message; offers the lane
        await peer.wait(imm=imm, n=1, timeout=20)
        yield peer, src, mr, dst


async def test_ipc_credit_lane() -> None:
    """IPC writes after the first to an owner are credited through its credit lane (the
    writer's stream stores the credit, no message): one credit per write, after its bytes (the
    writer's copies are slowed down), paged writes one per page; writes posted faster than the
    owner takes them fill the lane and fall back to messages, every credit still counted once."""
    async with _lane_offered(12, 30) as (peer, src, mr, dst):
        e = peer.engine
        for i in range(40):
            await e.write(mr, dst, length=8192, src_offset=8192 * i, dst_offset=8192 * i, imm=31)
            await peer.wait(imm=31, n=1, timeout=20)
            assert await peer.digest("g", 8192 * i, 8192) == digest(src.host[8192 * i : 8192 * (i + 1)])
        assert e.stats()["gpu_lane_credits"] >= 30, e.stats()["gpu_lane_credits"]
        await e.write_paged(mr, dst, page_size=4096, src_pages=np.array([3, 1]), dst_pages=np.array([0, 9]),
                            imm=32)
        await peer.wait(imm=32, n=2, timeout=20)
        assert await peer.digest("g", 9 * 4096, 4096) == digest(src.host[4096:8192])
        before = e.stats()["gpu_lane_credits"]
        posted = [e.post_write(mr, dst, length=16, imm=33) for _ in range(600)]  # past 256 entries
        for t in posted:
            await t.wait(timeout=60)
        await peer.wait(imm=33, n=600, timeout=30)
        await anyio.sleep(0.2)
        assert (await peer.call(op="counter", imm=33))["available"] == 0  # no credit twice
        assert 0 < e.stats()["gpu_lane_credits"] - before < 600
        # an open lane with nothing awaited keeps no poller awake: once idle the owner sleeps
        # its long steps (its shm rail's short steps after the stats call last 200 ms: about
        # 2,700 sleeps in 2 s, most of them in those 200 ms; with the lane read every 100 us
        # there were about 17,000, some 8,500 a second)
        s0 = (await peer.call(op="stats"))["stats"]
        await anyio.sleep(1.0)
        s1 = (await peer.call(op="stats"))["stats"]
        assert s1["sleeps"] - s0["sleeps"] < 5000, (s0["sleeps"], s1["sleeps"])


async def test_a_spinning_wait_on_an_ipc_write_reads_its_fence() -> None:
    """Posted writes over the (emulated) CUDA-IPC rail whose fence also credits them, awaited
    with a spin (``Transfer.wait(loop_spin_us=)``, as aiote.moe's waits are on the GPU): the
    loop thread reads the fence's word itself (``loop_polls``), and each write's bytes and
    credit are at the owner."""
    async with _lane_offered(14, 40) as (peer, src, mr, dst):
        e = peer.engine
        polls, fenced, part = e.stats()["loop_polls"], 0, 65536
        for i in range(10):
            t = e.post_write(mr, dst, length=part, src_offset=part * i, dst_offset=part * i, imm=41)
            fenced += t._fenced  # a lane took its credit: its fence's event is all there is
            await t.wait(timeout=20, loop_spin_us=20000)
        assert fenced >= 1 and e.stats()["loop_polls"] > polls
        await peer.wait(imm=41, n=10, timeout=20)
        assert await peer.digest("g", 0, 10 * part) == digest(src.host[: 10 * part])


N3, K3 = 3 << 20, 6  # the region and the writes of the tests with three IPC streams


@asynccontextmanager
async def _three_streams(seed: int) -> AsyncIterator[tuple[Any, HostDeviceArray, Any, Any]]:
    """A peer process on slow copies, this engine with ``ipc_streams=3``: (peer, source array,
    its region, the peer's shared "GPU" region of ``N3`` bytes)."""
    async with spawn_peer(peer_gpu_backend=SLOW, gpu_backend=SLOW, ipc_streams=3) as peer:
        src = _device(N3, seed=seed)
        mr = await peer.engine.register(src)
        yield peer, src, mr, await peer.register("g", N3, device="shared")


async def test_ipc_rail_several_streams() -> None:
    """``ipc_streams=3``: concurrent CUDA-IPC writes take the streams in turn; each write's
    bytes are in place before its immediate counts, and every byte lands once."""
    k, part = K3, N3 // K3
    async with _three_streams(seed=9) as (peer, src, mr, dst):
        e = peer.engine

        async def write_all(imm: int) -> None:  # k concurrent writes, one part each
            async with anyio.create_task_group() as tg:
                for i in range(k):
                    write = partial(e.write, mr, dst, length=part, src_offset=i * part, dst_offset=i * part)
                    tg.start_soon(partial(write, imm=imm))
            await peer.wait(imm=imm, n=k, timeout=20)

        await write_all(6)
        assert await peer.digest("g", 0, k * part) == digest(src.host[: k * part])
        assert e.stats()["gpu_ipc"] == k
        gpu = e._gpu
        assert gpu is not None and len(gpu._ipc_out) == 2  # lines 1 and 2 beside the first
        # once the owner's credit lane is open: only the first line's writes use it (a lane is
        # published in order by one stream), the others go by message; each counted once
        lanes = e.stats()["gpu_lane_credits"]
        for _ in range(3):
            await write_all(7)
        assert await peer.digest("g", 0, k * part) == digest(src.host[: k * part])
        assert 0 < e.stats()["gpu_lane_credits"] - lanes <= k  # the first line's share
        await anyio.sleep(0.2)
        assert (await peer.call(op="counter", imm=7))["available"] == 0  # no credit twice


async def test_write_imm_after_posted_ipc_writes_on_several_streams() -> None:
    """``write_imm`` to a GPU region this engine writes over the CUDA-IPC rail goes on the rail's
    first stream, which first waits for the others: its credit comes after the bytes of every
    write posted before it, none of them awaited, on any of ``ipc_streams`` (the copies take 5 ms
    each). The first is sent by a message once those copies are done and opens the owner's credit
    lane; the next ones go through the lane (the route asserted); each is counted once."""
    k, part = K3, N3 // K3
    async with _three_streams(seed=21) as (peer, src, mr, dst):
        e = peer.engine
        for v in range(3):
            src.host[:] = pattern(N3, 30 + v)  # (the previous round's copies are all done)
            posted = [
                e.post_write(mr, dst, length=part, src_offset=i * part, dst_offset=i * part) for i in range(k)
            ]
            lanes = e.stats()["gpu_lane_credits"]
            await e.write_imm(dst, 41, timeout=30)
            await peer.wait(imm=41, n=1, timeout=20)
            assert await peer.digest("g", 0, k * part) == digest(src.host[: k * part])
            assert e.stats()["gpu_lane_credits"] - lanes == (1 if v else 0)
            for t in posted:
                await t.wait(timeout=30)
        st = e.stats()
        assert st["gpu_ipc_imm"] == 3 and st["gpu_ipc"] == 3 * k
        await anyio.sleep(0.2)
        assert (await peer.call(op="counter", imm=41))["available"] == 0  # no credit twice


async def test_post_write_imm_goes_behind_posted_ipc_writes() -> None:
    """``imm_follows_writes`` is true for a GPU region once this engine writes it over the
    CUDA-IPC rail (not before, and never for a host region), and ``post_write_imm`` then puts
    the immediate on the rail's stream before it returns: posted right behind writes still in
    flight, none awaited, it counts only after their bytes, once each round, with the route
    asserted. The writes take the three streams in turn (5 ms copies each) from the second on,
    so the first stream holds one copy and the others two each: only its wait for them keeps
    the credit behind their last bytes."""
    k, part = K3, N3 // K3
    async with _three_streams(seed=23) as (peer, src, mr, dst):
        e = peer.engine
        host = await peer.register("h", 4096)
        assert not e.imm_follows_writes(dst)  # no IPC write made yet: the host way
        for v in range(3):
            src.host[:] = pattern(N3, 40 + v)
            await e.write(mr, dst, length=part, timeout=30)  # part 0, on the first stream
            posted = [  # parts 1-5 on streams 1, 2, 0, 1, 2
                e.post_write(mr, dst, length=part, src_offset=i * part, dst_offset=i * part)
                for i in range(1, k)
            ]
            assert e.imm_follows_writes(dst) and not e.imm_follows_writes(host)
            ipc_imm = e.stats()["gpu_ipc_imm"]
            t = e.post_write_imm(dst, 43)
            assert e.stats()["gpu_ipc_imm"] == ipc_imm + 1  # on the rail before it returned
            assert not any(p.done for p in posted)  # (the copies take 5 ms each)
            await peer.wait(imm=43, n=1, timeout=20)
            assert await peer.digest("g", 0, k * part) == digest(src.host[: k * part]), v
            await t.wait(timeout=30)
            for p in posted:
                await p.wait(timeout=30)
        assert e.stats()["gpu_ipc"] == 3 * k
        await anyio.sleep(0.2)
        assert (await peer.call(op="counter", imm=43))["available"] == 0  # no credit twice


async def test_credits_after_staged_writes_go_after_the_owners_copies() -> None:
    """An engine that staged bytes to an owner (host memory into its GPU region: the owner
    copies them, 5 ms a copy) credits that owner by message, ordered after those copies, even
    though the owner's credit lane is open: an IPC write's immediate and a ``write_imm`` (which
    still goes on the rail's stream, after its copies) both count only once the staged bytes
    are in GPU memory (the routes asserted: no lane credit)."""
    n = 1 << 20
    async with spawn_peer(peer_gpu_backend=SLOW, gpu_backend=SLOW, stage_chunk=128 << 10) as peer:
        e = peer.engine
        mg = await e.register(_device(n, seed=3))
        dst = await peer.register("g", 2 * n, device="shared")
        for _ in range(2):  # over the rail: the first offers the owner's lane, the second uses it
            await e.write(mg, dst, length=4096, imm=50)
            await peer.wait(imm=50, n=1, timeout=20)
        assert e.stats()["gpu_lane_credits"] == 1
        host = pattern(n, 8).copy()
        mh = await e.register(host)
        await e.write(mh, dst, dst_offset=n)  # staged: 8 copies by the owner
        assert e.stats()["gpu_staged"] == 1 and e.stats()["gpu_ipc"] == 2
        await e.write_imm(dst, 51, timeout=30)
        await peer.wait(imm=51, n=1, timeout=20)
        assert await peer.digest("g", n, n) == digest(host)
        host[:] = pattern(n, 9)
        await e.write(mh, dst, dst_offset=n)  # staged again, then an IPC write's immediate
        await e.write(mg, dst, length=4096, imm=52)
        await peer.wait(imm=52, n=1, timeout=20)
        assert await peer.digest("g", n, n) == digest(host)
        st = e.stats()
        assert st["gpu_ipc_imm"] == 1 and st["gpu_ipc"] == 3 and st["gpu_lane_credits"] == 1


async def test_stream_ordering() -> None:
    """``stream=``: the write starts after the work submitted to that stream (here a slow
    'kernel' that fills the source)."""
    n = 1 << 20
    async with spawn_peer(peer_gpu_backend="host", gpu_backend="host") as peer:
        e = peer.engine
        src = HostDeviceArray(n)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="host")
        data = pattern(n, 77)
        s = HostStream()

        def kernel() -> None:
            time.sleep(0.05)
            src.host[:] = data

        s.submit(kernel)
        await e.write(mr, dst, imm=1, stream=s)
        await peer.wait(imm=1, timeout=20)
        assert await peer.digest("g") == digest(data)
        # a host source produced by stream work, and write_imm after stream work
        host = np.zeros(n, np.uint8)
        mh = await e.register(host)
        s.submit(lambda: (time.sleep(0.05), host.__setitem__(slice(None), data[::-1])))
        await e.write(mh, dst, imm=2, stream=s)
        await peer.wait(imm=2, timeout=20)
        assert await peer.digest("g") == digest(data[::-1].copy())
        flag = []
        s.submit(lambda: (time.sleep(0.05), flag.append(1)))
        await e.write_imm(dst, 3, stream=s)
        assert flag == [1]
        await peer.wait(imm=3, timeout=20)


async def test_uvm_watcher() -> None:
    async with aiote.open_engine(gpu_backend="host", watch_interval_us=50) as e:
        w = e.uvm_watcher()
        assert w.value == 0 and w.device_pointer == int(w.host.ctypes.data)

        def gpu_kernel() -> None:  # a kernel bumping the slot: plain stores, no wake-up call
            for v in range(1, 6):
                time.sleep(0.02)
                w.host[0] = v

        t = threading.Thread(target=gpu_kernel)
        t.start()
        assert await w.wait_for(3, timeout=5) >= 3
        seen = []
        async for v in w:
            seen.append(v)
            if v >= 5:
                break
        t.join()
        assert seen == sorted(seen) and seen[-1] == 5
        assert await w.wait_for(2) == 5  # already there
        with pytest.raises(aiote.TransferTimeout):
            await w.wait_for(6, timeout=0.1)

        # latency from a store to the task resuming: well under 10 ms with a 50 us interval
        lat = []
        for v in range(6, 16):
            ready = threading.Event()
            stamp: list[float] = []

            def store(v: int = v, ready: threading.Event = ready, stamp: list[float] = stamp) -> None:
                ready.wait()
                time.sleep(0.002)
                stamp.append(time.perf_counter())
                w.host[0] = v

            th = threading.Thread(target=store)
            th.start()
            ready.set()
            await w.wait_for(v, timeout=5)
            lat.append(time.perf_counter() - stamp[0])
            th.join()
        assert sorted(lat)[len(lat) // 2] < 0.01, lat

        # close wakes a waiter with EngineClosed
        async def closer() -> None:
            await anyio.sleep(0.05)
            w.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(closer)
            with pytest.raises(aiote.EngineClosed):
                await w.wait_for(100)


async def test_bad_gpu_input() -> None:
    async with spawn_peer(peer_gpu_backend="host", gpu_backend="host") as peer:
        e = peer.engine
        ro = HostDeviceArray(4096, readonly=True)
        with pytest.raises(aiote.InvalidArgument, match="read-only"):
            await e.register(ro)
        await e.register(ro, remote_write=False)  # fine as a source

        class Strided:
            __cuda_array_interface__ = {  # noqa: RUF012
                "shape": (16, 16),
                "typestr": "<f4",
                "data": (4096, False),
                "strides": (128, 4),
                "version": 3,
            }

        with pytest.raises(aiote.InvalidArgument, match="contiguous"):
            await e.register(Strided())
        src = _device(1 << 16)
        mr = await e.register(src)
        dst = await peer.register("g", 1 << 16, device="host")  # not shared: no IPC handle
        with pytest.raises(aiote.InvalidArgument, match="past"):
            await e.write(mr, dst, length=10, dst_offset=(1 << 16) - 5)
        with pytest.raises(aiote.InvalidArgument, match="imm"):
            await e.write(mr, dst, imm=1 << 32)
        out = HostDeviceArray(16)
        mo = await e.register(out)
        with pytest.raises(aiote.InvalidArgument, match="GPU memory needs"):
            await e.read(mo, dst, length=16)
        with pytest.raises(aiote.InvalidArgument, match="host regions"):
            await e.scatter(mr, [aiote.ScatterTarget(dst, length=16)])
        with pytest.raises(aiote.InvalidArgument, match="stream"):
            await e.write(mr, dst, stream=object())
        # nothing was posted: a valid write still lands exactly
        await e.write(mr, dst, imm=9)
        await peer.wait(imm=9, timeout=20)
        assert await peer.digest("g") == digest(src.host)


async def test_cuda_backend_without_cuda_is_a_clear_error() -> None:
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]  # noqa: F401

        pytest.skip("CuPy is installed here; tests/test_gpu.py covers CUDA")
    except ImportError:
        pass
    async with aiote.open_engine() as e:
        with pytest.raises(aiote.GpuUnavailable, match="CuPy"):
            await e.register(HostDeviceArray(16))
        with pytest.raises(aiote.GpuUnavailable):
            e.uvm_watcher()


async def test_unregister_waits_for_device_copies() -> None:
    async with aiote.open_engine(gpu_backend="host:0.2") as e:
        src = _device(1 << 16)
        mr = await e.register(src)
        host = np.zeros(1 << 16, np.uint8)
        mh = await e.register(host)
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: e.write(mr, mh.descriptor, imm=1))
            await anyio.sleep(0.02)
            with pytest.raises(aiote.RegionBusy):
                await e.unregister(mr, timeout=0)  # the device-to-host copy is still running
            await e.unregister(mr)  # waits for it
        assert time.perf_counter() - start >= 0.15
        await e.imm_counter(1).wait(1, timeout=5)
        assert digest(host) == digest(src.host)


async def test_unregister_never_pulls_the_region_from_a_staged_write() -> None:
    """An unregister that starts while a staged write is under way waits for the whole write,
    not only for its device copies: between a copy's fence and the host write that sends its
    bytes nothing is in flight, and the region must not go then (before the fix about half of
    these writes failed with "mr was unregistered")."""
    async with aiote.open_engine(gpu_backend="host:0.002") as e:
        host = np.zeros(1 << 16, np.uint8)
        mh = await e.register(host)
        for i in range(20):
            src = _device(1 << 16, seed=i + 1)
            mr = await e.register(src)
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(e.write, mr, mh.descriptor, imm=9))
                while mr._dev_pending == 0:  # the write has begun (its device copy is queued)
                    await anyio.lowlevel.checkpoint()
                await e.unregister(mr)  # must wait for the write, which must not fail
            await e.imm_counter(9).wait(1, timeout=5)
            assert digest(host) == digest(src.host)


async def test_direct_registration_no_staging() -> None:
    """``gpu_direct=True``: the NICs register the (emulated) GPU memory itself, as providers
    with FI_HMEM do: no shadow, the immediate rides with the data, and every mix with a staged
    peer works."""
    n = (1 << 20) + 77
    async with spawn_peer(
        peer_gpu_backend=SLOW, peer_gpu_direct=True, gpu_backend=SLOW, gpu_direct=True
    ) as peer:
        e = peer.engine
        src = _device(n, seed=12)
        mr = await e.register(src)
        assert mr._shadow is None and mr.descriptor.gpu is not None and mr.descriptor.gpu.direct
        dst = await peer.register("g", n, device="host")
        assert dst.gpu is not None and dst.gpu.direct
        await e.write(mr, dst, imm=1)
        await peer.wait(imm=1, timeout=20)
        assert await peer.digest("g") == digest(src.host)
        sp, dp = np.array([3, 0, 2]), np.array([0, 1, 5])
        await e.write_paged(mr, dst, page_size=65536, src_pages=sp, dst_pages=dp, imm=2)
        await peer.wait(imm=2, n=3, timeout=20)
        for s, d in zip(sp, dp, strict=True):
            assert await peer.digest("g", int(d) * 65536, 65536) == digest(
                src.host[s * 65536 : (s + 1) * 65536]
            )
        st = e.stats()
        assert st["gpu_direct"] == 2 and st["gpu_staged"] == 0 and st["gpu_parts_in"] == 0
    # a direct source into a staged destination, and a staged source into a direct one
    async with spawn_peer(
        peer_gpu_backend=SLOW, peer_gpu_direct=False, gpu_backend=SLOW, gpu_direct=True
    ) as peer:
        e = peer.engine
        mr = await e.register(src)
        dst = await peer.register("g", n, device="host")
        assert dst.gpu is not None and not dst.gpu.direct
        await e.write(mr, dst, imm=3)
        await peer.wait(imm=3, timeout=20)
        assert await peer.digest("g") == digest(src.host)
    async with spawn_peer(
        peer_gpu_backend=SLOW, peer_gpu_direct=True, gpu_backend=SLOW, gpu_direct=False
    ) as peer:
        e = peer.engine
        mr = await e.register(src)
        dst = await peer.register("g", n, device="host")
        await e.write(mr, dst, imm=4)
        await peer.wait(imm=4, timeout=20)
        assert await peer.digest("g") == digest(src.host)
        out = HostDeviceArray(4096)
        mo = await e.register(out)
        await e.read(mo, dst, length=4096, src_offset=100)  # a direct region can be READ
        assert digest(out.host) == digest(src.host[100:4196])


async def test_kv_flow_with_gpu_pools() -> None:
    """The KV-cache flow with both pools in (emulated) GPU memory: each layer's credit comes
    once its pages are in the decoder's GPU pool (its copies are slowed down)."""
    from aiote import kv

    layout = kv.KVLayout(layers=3, page_tokens=16, token_bytes=256, pool_pages=32)
    ppool = HostDeviceArray(layout.pool_bytes)
    dpool = HostDeviceArray(layout.pool_bytes)
    async with (
        aiote.open_engine(gpu_backend=SLOW, same_host=None) as pe,
        kv.PrefillServer(pe, layout, pool=ppool) as prefill,
        aiote.open_engine(gpu_backend=SLOW, same_host=None) as de,
        kv.DecodeWorker(de, layout, pe.address, pool=dpool) as worker,
    ):
        await prefill.wait_for_decoders(1, timeout=10)
        req = await prefill.start(100, timeout=10)  # 7 pages
        got = await worker.admitted(timeout=10)
        for layer in range(layout.layers):
            for k in (0, 1):
                for i, p in enumerate(req.pages):
                    layout.page(ppool.host, layer, k, int(p))[:] = (layer * 64 + k * 32 + i) % 251
            await req.send_layer(layer)
            await got.layer_ready(layer, timeout=10)  # the layer is in the GPU pool now
            for k in (0, 1):
                for i, p in enumerate(got.pages):
                    assert (
                        layout.page(dpool.host, layer, k, int(p)) == (layer * 64 + k * 32 + i) % 251
                    ).all()
        await req.finish(timeout=10)
        await got.wait_ready(timeout=10)
        await got.release()


@pytest.mark.parametrize("route", ["staged", "ipc"])
async def test_killed_gpu_peer_fails_pending_work_within_the_bound(route: str) -> None:
    """A GPU peer killed mid-transfer: the writes to it raise PeerUnreachable within
    connect_timeout + 3 s, on the staged route (tcp / shm under the GPU staging) and on the IPC
    rail; the route each write took is the one named."""
    policy = aiote.RetryPolicy(connect_timeout=2.0, stall_timeout=3.0)
    n = 8 << 20
    async with spawn_peer(peer_gpu_backend="host", gpu_backend="host", gpu_ipc=route == "ipc",
                          retry=policy) as peer:
        e = peer.engine
        src = _device(n, seed=9)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="shared" if route == "ipc" else "host")
        await e.write(mr, dst, imm=1)
        await peer.wait(imm=1, n=1, timeout=20)
        assert e.stats()["gpu_ipc" if route == "ipc" else "gpu_staged"] == 1
        error, after_kill = await fails_after_kill(
            lambda: e.write(mr, dst, imm=2), lambda: os.kill(peer.pid, signal.SIGKILL), after=0.3
        )
        assert isinstance(error, aiote.PeerUnreachable), error
        assert after_kill < policy.connect_timeout + 3.0, (after_kill, error)
        # the requests the dead peer's transport still owns keep the region registered, and
        # unregister (no timeout) says so after stall_timeout instead of waiting forever
        if e.stats()["ops_in_flight"]:
            t0 = time.monotonic()
            with pytest.raises(aiote.RegionBusy, match="no progress"):
                await e.unregister(mr)
            assert time.monotonic() - t0 < policy.stall_timeout + 2  # type: ignore[operator]
