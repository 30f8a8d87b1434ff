"""Several native poller threads (``open_engine(pollers=N)``): rail *i* is driven by thread
*i* % N. The default (one per rail, up to the cores, at least two), the validation, and
transfers of every kind on two streams each with its own poller, in this process and to a
peer process, landing whole and counted exactly."""

from __future__ import annotations

import os
from collections.abc import Callable

import anyio
import numpy as np
import pytest
from _util import digest, pattern, zeros

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

TCP = {"same_host": None}


async def test_the_default_is_one_poller_per_rail_and_pollers_caps_it() -> None:
    async with aiote.open_engine(streams=1, **TCP) as e:
        assert e.stats()["pollers"] == 1  # one rail
    async with aiote.open_engine(**TCP) as e:  # two streams by default on tcp, one NIC (4 on 16 cores)
        assert e.stats()["pollers"] == aiote.default_streams("tcp", ["lo"])
    async with aiote.open_engine(streams=2, **TCP) as e:
        assert e.stats()["pollers"] == 2  # every machine gets at least two
    async with aiote.open_engine(streams=2, pollers=1, **TCP) as e:
        assert e.stats()["pollers"] == 1
    async with aiote.open_engine(streams=3, pollers=16, **TCP) as e:
        assert e.stats()["pollers"] == 3  # capped at the rails
    # the same-host rail comes last, on its own poller where there are threads enough
    async with aiote.open_engine(streams=2, pollers=3) as e:
        assert [r.provider.split(";")[0] for r in e.rails][:2] == ["tcp", "tcp"]
        assert e.stats()["pollers"] == len(e.rails)


def _thread_names() -> list[str]:
    """The OS names of this process's threads (what ``top -H`` and ``perf`` show)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # (a thread that just ended)
            pass
    return names


def _aiote_threads() -> list[str]:
    return [n for n in _thread_names() if n.startswith("aiote-")]  # pollers and the copier


async def _gone_from_the_os(still_there: Callable[[], object], limit: float = 5.0) -> None:
    """Waits until ``still_there()`` is falsy, failing after ``limit`` seconds.

    Closing an engine joins its pollers (``pthread_join`` has returned), but the kernel wakes
    the joiner when the thread clears its tid, a step of its exit *before* it is reaped: its
    ``/proc/self/task`` entry and its place in ``Threads:`` can outlive the join by a moment
    on a loaded machine. A thread that never ended would keep the condition true to the limit.
    """
    with anyio.fail_after(limit):
        while still_there():  # noqa: ASYNC110 (the kernel reaping a thread sends no event)
            await anyio.sleep(0.01)


async def test_poller_threads_are_named_by_their_index() -> None:
    """Each poller thread is named ``aiote-poll<i>``, and they end with the engine."""
    async with aiote.open_engine(streams=2, pollers=2, **TCP) as e:
        assert e.stats()["pollers"] == 2
        polls = sorted(n for n in _thread_names() if n.startswith("aiote-poll"))
        assert polls == ["aiote-poll0", "aiote-poll1"]
    await _gone_from_the_os(_aiote_threads)


def _threads() -> int:
    """The threads of this process as the OS counts them (native ones included)."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("Threads:"))


async def test_each_poller_is_a_thread_and_they_end_with_the_engine() -> None:
    async with aiote.open_engine(**TCP):  # anyio's worker thread (opening runs in it) exists now
        pass
    await _gone_from_the_os(_aiote_threads)
    t0 = _threads()
    async with aiote.open_engine(streams=3, pollers=3, **TCP):
        t1 = _threads()
        async with aiote.open_engine(streams=3, pollers=1, **TCP):
            t2 = _threads()
    # two threads more with three pollers than with one; none left once both closed
    assert (t1 - t0) - (t2 - t1) == 2, (t0, t1, t2)
    await _gone_from_the_os(lambda: _threads() > t0)


@pytest.mark.parametrize("bad", [0, 17, True, 1.5, "2"])
async def test_bad_pollers_raise_before_opening(bad: object) -> None:
    with pytest.raises(aiote.InvalidArgument, match="pollers"):
        async with aiote.open_engine(pollers=bad, **TCP):  # type: ignore[arg-type]
            pass


async def test_concurrent_transfers_over_two_pollers_land_whole_and_count_exactly() -> None:
    async with (
        aiote.open_engine(streams=2, pollers=2, **TCP) as a,
        aiote.open_engine(streams=2, pollers=2, **TCP) as b,
    ):
        assert a.stats()["pollers"] == b.stats()["pollers"] == 2
        size = 48 << 20
        src = pattern(size, seed=11)
        dst = zeros(size)
        ms, md = await a.register(src), await b.register(dst)
        # 1 MiB writes (split over both streams), 64 KiB ones (one stream each, in turn), and
        # immediates, all at once from many tasks
        big, small = 1 << 20, 64 << 10
        async with anyio.create_task_group() as tg:
            for k in range(32):
                tg.start_soon(lambda k=k: a.write(ms, md.descriptor, length=big, src_offset=k * big,
                                                  dst_offset=k * big, imm=21))
            for k in range(256):
                off = 32 * big + k * small
                tg.start_soon(lambda off=off: a.write(ms, md.descriptor, length=small, src_offset=off,
                                                      dst_offset=off, imm=22))
            for _ in range(64):
                tg.start_soon(lambda: a.write_imm(md.descriptor, imm=23))
        await b.imm_counter(21).wait(32, timeout=30)
        await b.imm_counter(22).wait(256, timeout=30)
        await b.imm_counter(23).wait(64, timeout=30)
        assert [b.imm_counter(i).total for i in (21, 22, 23)] == [32, 256, 64]
        used = 32 * big + 256 * small
        assert np.array_equal(dst[:used], src[:used])
        # reads back on both pollers, and messages both ways meanwhile
        back = zeros(used)
        mb = await a.register(back)
        got: list[bytes] = []

        async def receive() -> None:
            for _ in range(20):
                got.append(bytes((await b.recv())[1]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            for k in range(8):
                n = used // 8
                tg.start_soon(lambda k=k, n=n: a.read(mb, md.descriptor, length=n, src_offset=k * n,
                                                      dst_offset=k * n))
            for i in range(20):
                await a.send(b.address, b"m%d" % i)
        assert digest(back) == digest(src[:used])
        assert sorted(got) == sorted(b"m%d" % i for i in range(20))
        assert a.stats()["ops_in_flight"] == 0


async def test_two_pollers_to_a_peer_process() -> None:
    async with (
        aiote.open_engine(streams=2, pollers=2, **TCP) as e,
        spawn_peer(engine=e, same_host=None, peer_streams=2) as peer,
    ):
        size = 16 << 20
        src = pattern(size, seed=5)
        ms = await e.register(src)
        desc = await peer.register("buf", size)
        async with anyio.create_task_group() as tg:
            for k in range(16):
                tg.start_soon(lambda k=k: e.write(ms, desc, length=1 << 20, src_offset=k << 20,
                                                  dst_offset=k << 20, imm=31))
        await peer.wait(imm=31, n=16)
        assert await peer.digest("buf") == digest(src)


async def test_direct_same_host_copies_over_two_shm_streams_on_two_pollers() -> None:
    # reads (direct copies out of the peer's memory) and writes into the peer's arena (memcpy),
    # striped over two shm rails whose pollers differ: every copy lands whole
    async with (
        aiote.open_engine("shm", streams=2, pollers=2) as a,
        aiote.open_engine("shm", streams=2, pollers=2) as b,
    ):
        assert a.stats()["pollers"] == 2
        size = 16 << 20
        src = b.alloc_host(size)
        src[:] = pattern(size, seed=9)
        ms = await b.register(src)
        back = zeros(size)
        mb = await a.register(back)
        c0 = a.stats()["direct_copies"]
        async with anyio.create_task_group() as tg:
            for k in range(16):
                tg.start_soon(lambda k=k: a.read(mb, ms.descriptor, length=1 << 20, src_offset=k << 20,
                                                 dst_offset=k << 20))
            await a.read(mb, ms.descriptor)  # one large read, split over both streams
        assert digest(back) == digest(src)
        mine = pattern(size, seed=10)
        mm = await a.register(mine)
        async with anyio.create_task_group() as tg:
            for k in range(16):
                tg.start_soon(lambda k=k: a.write(mm, ms.descriptor, length=1 << 20, src_offset=k << 20,
                                                  dst_offset=k << 20, imm=41))
        await b.imm_counter(41).wait(16, timeout=30)
        assert digest(src) == digest(mine)
        # direct copies go over the first shm stream (the region table publishes its key; the
        # other stream's requests go through shm): one piece of each split transfer, and the
        # whole ones (transfers that found both streams busy) that took that stream, about half
        assert a.stats()["direct_copies"] - c0 >= 12
