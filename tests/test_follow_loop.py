"""``open_engine(follow_loop=...)``: poller 0 keeps to the CPU the event loop last read a
completion on (so that the records it hands the loop wake a thread on its own CPU), gives the
pin back once the loop stops reading, and the other pollers are never pinned. Checked on the
threads themselves (their CPU affinity in ``/proc``), with the loop thread moved between CPUs
by the test, against a peer process over tcp."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest
from _util import digest, pattern

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

TCP = {"same_host": None}
CPUS = sorted(os.sched_getaffinity(0))


def _allowed(name: str) -> list[set[int]]:
    """The CPU affinity of each of this process's threads named ``name``."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            out.append(os.sched_getaffinity(int(tid)))
        except (FileNotFoundError, ProcessLookupError):  # (a thread that just ended)
            pass
    return out


@contextmanager
def _loop_on(cpu: int) -> Iterator[None]:
    """Keeps the calling thread (the event loop's) on ``cpu`` for the block."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def _traffic(e: aiote.Engine, src: aiote.MemoryRegion, desc: aiote.MemoryDescriptor,
                   rounds: int = 20) -> None:
    """Awaited 4 KiB WriteImms (the first 4 KiB of ``src``) spread over more than poller 0's
    check interval (2 ms): the loop reads their completions, and the poller looks where it did."""
    for _ in range(rounds):
        await e.write(src, desc, length=4096, imm=7, timeout=30)
        await anyio.sleep(0.001)


@asynccontextmanager
async def _with_peer(
    size: int = 4096, **kw: Any
) -> AsyncIterator[tuple[aiote.Engine, aiote.MemoryRegion, Any, Any]]:
    """An engine (``open_engine(**kw)`` over tcp), a peer process, a registered source of
    ``size`` bytes here (``pattern(size, seed=1)``) and the peer's region ``buf``:
    ``(engine, source, descriptor, peer)``."""
    async with (
        aiote.open_engine(**kw, **TCP) as e,
        spawn_peer(engine=e, same_host=None, peer_streams=kw.get("streams")) as peer,
    ):
        assert {r.provider.split(";")[0] for r in e.rails} == {"tcp"}  # the route: tcp
        ms = await e.register(pattern(size, seed=1))
        yield e, ms, await peer.register("buf", size), peer


async def _pinned_while_writing(e: aiote.Engine, src: aiote.MemoryRegion, desc: aiote.MemoryDescriptor,
                                cpu: int) -> int:
    """Writes as :func:`_traffic` does until poller 0 keeps to ``cpu`` (at most 10 s; the pin
    holds only while the loop reads completions, and on a loaded machine a check may find the
    poller's passes slow and let go until the next one); returns the writes made."""
    k = 0
    with anyio.fail_after(10):
        while e.stats()["poller_cpu"] != cpu:
            await _traffic(e, src, desc, rounds=1)
            k += 1
    return k


async def _until(cond: object, limit: float = 5.0) -> None:
    with anyio.fail_after(limit):
        while not cond():  # type: ignore[operator]  # noqa: ASYNC110 (the poller sends no event)
            await anyio.sleep(0.01)


async def test_poller_0_keeps_to_the_loops_cpu_follows_it_and_the_others_stay_free() -> None:
    async with _with_peer(1 << 16, streams=2, pollers=2, follow_loop=True) as (e, ms, desc, peer):
        assert e.stats()["pollers"] == 2
        writes = 0
        for cpu in CPUS[:2]:  # the loop on one CPU, then on another: poller 0 goes along
            moves = e.stats()["poller_moves"]
            with _loop_on(cpu):
                writes += await _pinned_while_writing(e, ms, desc, cpu)
                assert _allowed("aiote-poll0") == [{cpu}]
            assert e.stats()["poller_moves"] >= moves + (1 if cpu != CPUS[0] else 0)
            assert _allowed("aiote-poll1") == [set(CPUS)]  # never pinned
        await peer.wait(imm=7, n=writes)
        assert await peer.digest("buf", 0, 4096) == digest(pattern(1 << 16, seed=1)[:4096])  # landed


async def test_the_pin_is_given_back_once_the_loop_stops_reading() -> None:
    async with _with_peer(follow_loop=True) as (e, ms, desc, peer):
        with _loop_on(CPUS[-1]):
            writes = await _pinned_while_writing(e, ms, desc, CPUS[-1])
        # nothing more for the loop to read: after 100 ms poller 0 is free again
        await _until(lambda: e.stats()["poller_cpu"] == -1)
        assert _allowed("aiote-poll0") == [set(CPUS)]
        await _traffic(e, ms, desc, rounds=5)  # and it works on as before
        await peer.wait(imm=7, n=writes + 5)


async def test_poller_0_lets_go_while_it_moves_bulk_data_and_keeps_to_the_loop_after() -> None:
    """While 16 MiB writes stream out, poller 0 (copying their bytes into its socket) keeps to
    no CPU, though the loop reads completions all along; small traffic after them pins it
    again."""
    size = 16 << 20
    async with _with_peer(size, follow_loop=True) as (e, ms, desc, peer):
        with _loop_on(CPUS[0]):
            await _pinned_while_writing(e, ms, desc, CPUS[0])
            seen: list[int] = []
            done = anyio.Event()

            async def sample() -> None:
                while not done.is_set():
                    seen.append(e.stats()["poller_cpu"])
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as tg:
                tg.start_soon(sample)
                with anyio.move_on_after(10):
                    while -1 not in seen or len(seen) < 50:  # at least 50 ms of it
                        await e.write(ms, desc, imm=8, timeout=30)
                done.set()
            assert -1 in seen, seen[-20:]  # let go while the bulk moved
            await _pinned_while_writing(e, ms, desc, CPUS[0])  # small writes: pinned again
        assert await peer.digest("buf") == digest(pattern(size, seed=1))


async def test_follow_loop_off_never_pins_a_poller() -> None:
    async with _with_peer(follow_loop=False) as (e, ms, desc, _):
        with _loop_on(CPUS[0]):
            await _traffic(e, ms, desc)
        st = e.stats()
        assert (st["poller_cpu"], st["poller_moves"]) == (-1, 0)
        assert all(a == set(CPUS) for a in _allowed("aiote-poll0"))


async def test_the_default_follows_on_at_most_two_cpus() -> None:
    assert aiote.follow_loop_default() == (len(CPUS) <= 2)
    async with _with_peer() as (e, ms, desc, _):  # the default
        with _loop_on(CPUS[0]):
            if aiote.follow_loop_default():
                await _pinned_while_writing(e, ms, desc, CPUS[0])
            else:
                await _traffic(e, ms, desc)
                await anyio.sleep(0.05)
                assert e.stats()["poller_moves"] == 0


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
async def test_a_bad_follow_loop_raises_before_opening(bad: object) -> None:
    with pytest.raises(aiote.InvalidArgument, match="follow_loop"):
        async with aiote.open_engine(follow_loop=bad, **TCP):  # type: ignore[arg-type]
            pass
