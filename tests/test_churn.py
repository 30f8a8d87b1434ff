"""Peer churn: an engine that sees hundreds of peer engines come and go (short-lived peers, a
few at a time) keeps what it holds per peer bounded: its address vectors, route caches and same-host
table attachments (PeerBook, Engine.forget_peer), and its RSS and open descriptors come back
to within 5% of where they stood once warm. The last peers' large tcp writes still go through
the poller hand-over (no cliff at 256 peer addresses). The PeerBook's decisions are also
unit-tested by feeding it events."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import numpy as np
import pytest

import aiote
from aiote._core._peers import PeerBook

# A peer process: opens `n` engines one after the other; each registers 1 MiB, sends its
# descriptor to the engine under test, waits for its two writes, checks them and says "ok".
WORKER = r"""
import sys
import anyio
import numpy as np
import aiote

async def main():
    addr = bytes.fromhex(sys.argv[1])
    kw = {} if sys.argv[3] == "same-host" else {"same_host": None}
    for i in range(int(sys.argv[2])):
        async with aiote.open_engine(pollers=1, **kw) as e:
            buf = np.zeros(1 << 20, np.uint8)
            mr = await e.register(buf)
            await e.send(addr, bytes(mr.descriptor), timeout=30)
            await e.imm_counter(5).wait(2, timeout=30)
            assert (buf == 7).all()
            await e.send(addr, b"ok", timeout=30)

anyio.run(main)
"""

# 300 peers: past the 255 same-host attachments and (tcp under trio) the 256 addresses of the old
# hand-over cliff. tcp under asyncio goes past max_peers instead, given as 200 (its addresses are
# then reused below 256; the bound's logic is the same at the default 1,024, which PeerBook's
# tests below feed; 1,000 peers to pass that took 40 s of CI). The engine's logic is the same
# under both loops.
PEERS = 300
SMALL_BOUND = 200
PER_PROCESS = 50
AT_ONCE = 2
WARM = 50  # peers served before the starting figures are taken (libfabric's pools, caches)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _churn(route: str, peers: int, bound: int | None = None) -> None:
    kw: dict[str, object] = {} if route == "same-host" else {"same_host": None}
    if bound is not None:
        kw["max_peers"] = bound
    else:
        bound = 1024  # max_peers' default
    async with aiote.open_engine(**kw) as e:
        src = np.full(1 << 20, 7, np.uint8)
        mr = await e.register(src)
        served = 0
        start: tuple[int, int] | None = None
        high = 0  # the most peer addresses kept at once
        top_fa = 0  # the highest libfabric address a peer had
        last: dict[str, int] = {}

        async def serve() -> None:
            nonlocal served, start, high, top_fa
            while served < peers:
                _, msg = await e.recv(timeout=120)
                if msg == b"ok":
                    served += 1
                    if served == WARM:
                        start = (_rss_kib(), _fds())
                    continue
                before = e.stats()
                await e.write(mr, msg, imm=5, timeout=30)  # 1 MiB each
                await e.write(mr, msg, imm=5, timeout=30)
                after = e.stats()
                high = max(high, after["peers"])
                top_fa = max(top_fa, max(e._book.fa.values(), default=0))
                last.update(handed=after["posts_handed"] - before["posts_handed"],
                            direct=after["direct_copies"] - before["direct_copies"])

        async def one(n: int) -> None:
            async with lim:
                proc = await anyio.run_process(
                    [sys.executable, "-c", WORKER, e.address.hex(), str(n), route],
                    check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                )
                assert proc.returncode == 0, proc.stderr.decode()[-2000:]

        lim = anyio.Semaphore(AT_ONCE)
        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                for _ in range(peers // PER_PROCESS):
                    tg.start_soon(one, PER_PROCESS)
        st = e.stats()
        assert start is not None
        rss, fds = _rss_kib(), _fds()
        book = e._book
        # the route it ran on: the last peer's writes were direct copies (same host) or
        # tcp writes handed to the poller (each peer's second write: its connection has
        # carried a request), at peer addresses past the old 256 cliff
        if route == "same-host":
            assert last["direct"] == 2 and st["direct_copies"] == 2 * peers
            assert high <= 8, high  # gone peers are forgotten as new ones arrive
        else:
            assert st["direct_copies"] == 0
            assert last["handed"] >= 1, last
            assert st["posts_handed"] >= peers
            if peers > bound:  # past max_peers addresses those unused since the last sweep go
                assert st["peers_forgotten"] > 0
            else:  # (past it, forgotten addresses are reused below 256)
                assert top_fa >= 256, top_fa
            assert high <= bound + bound // 4 + 16, high
        assert len(book) <= bound + bound // 4
        assert rss <= start[0] * 1.05, (start, rss)
        assert fds <= max(start[1] * 1.05, start[1] + 2), (start, fds)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("route", ["same-host", "tcp"])
async def test_hundreds_of_peers_come_and_go(route: str, anyio_backend: str) -> None:
    await _churn(route, PEERS, SMALL_BOUND if anyio_backend != "trio" and route == "tcp" else None)


@pytest.mark.anyio
@pytest.mark.parametrize("route", ["same-host", "tcp"])
async def test_forget_peer_waits_for_work_in_flight_and_the_peer_is_reached_again(route: str) -> None:
    kw = {} if route == "same-host" else {"same_host": None}
    async with aiote.open_engine(**kw) as a, aiote.open_engine(**kw) as b:
        src = np.arange(64 << 20, dtype=np.uint8) % 251
        dst = np.zeros_like(src)
        ma, mb = await a.register(src), await b.register(dst)
        with pytest.raises(aiote.InvalidArgument):
            a.forget_peer(1234)  # type: ignore[arg-type]
        await a.write(ma, mb.descriptor, length=4096, imm=1, timeout=30)
        assert a.stats()["peers"] >= 1
        started = anyio.Event()

        async def write() -> None:
            started.set()  # seen once this task waits in the write, its 64 MiB still moving
            await a.write(ma, mb.descriptor, imm=1, timeout=60)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await started.wait()
            assert a._busy
            a.forget_peer(b.address)  # a write in flight: kept until it is done
            assert a.stats()["peers"] >= 1
        assert a.stats()["peers"] == 0 and a.stats()["peers_forgotten"] >= 1
        await b.imm_counter(1).wait(2, timeout=30)
        assert np.array_equal(dst, src)
        dst[:] = 0
        await a.write(ma, mb.descriptor, imm=1, timeout=30)  # resolved and connected again
        await b.imm_counter(1).wait(1, timeout=30)
        assert np.array_equal(dst, src)
        assert (a.stats()["direct_copies"] > 0) == (route == "same-host")


def test_book_forgets_marked_addresses_unless_busy() -> None:
    b = PeerBook(cap=8)
    b.add((0, b"a"), 1)
    b.add((0, b"b"), 2)
    b.add((1, b"b"), 2)
    b.mark([b"b"])
    assert b.due
    gone, detach = b.sweep(busy={(1, 2)})
    assert gone == [((0, b"b"), 2)] and detach == []
    assert b.get((1, b"b")) == 2 and b.get((0, b"b")) is None
    gone, _ = b.sweep(busy=set())  # the busy one, at the next sweep
    assert gone == [((1, b"b"), 2)] and len(b) == 1 and b.forgotten == 2


def test_book_bounds_addresses_by_second_chance() -> None:
    b = PeerBook(cap=4)
    for i in range(4):
        b.add((0, bytes([i])), i)
    assert not b.due
    b.add((0, b"x"), 10)  # past the cap
    assert b.due
    gone, _ = b.sweep(busy=set())
    assert gone == []  # all were resolved since the last sweep (none before): a second chance
    b.get((0, bytes([3])))  # used again since that sweep
    b.add((0, b"y"), 11)
    gone, _ = b.sweep(busy={(0, 0)})
    # down to 3 of 6: the oldest unused first, the busy one kept, the used ones kept
    assert sorted(k[1] for k, _ in gone) == [bytes([1]), bytes([2]), b"x"]
    assert len(b) == 3 and b.get((0, bytes([0]))) == 0


def test_book_detaches_a_table_once_its_addresses_are_gone() -> None:
    b = PeerBook(cap=16)
    b.add((0, b"p-tcp"), 1)
    b.add((1, b"p-shm"), 1)
    b.attached(3, [b"p-tcp", b"p-shm"])
    b.mark_attached(3)
    gone, detach = b.sweep(busy={(0, 1)})
    assert [k for k, _ in gone] == [(1, b"p-shm")] and detach == []  # one address still named
    gone, detach = b.sweep(busy=set())
    assert [k for k, _ in gone] == [(0, b"p-tcp")] and detach == [3]
    assert b.attachments() == []
