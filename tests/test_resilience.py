"""Failures, across real processes on tcp: a peer killed mid-transfer, a peer that never
answers, a peer restarted at the same address, a storm of cancellations, forged
descriptors. Bounds are asserted with margins (this machine has 2 cores)."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from _util import digest, eventually, pattern, peer_buffer, streams_open, zeros

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

TCP = {"same_host": None}


async def test_killed_peer_fails_pending_work_in_bounded_time_and_others_go_on() -> None:
    policy = aiote.RetryPolicy(connect_timeout=1.0)
    async with aiote.open_engine(retry=policy, **TCP) as e, spawn_peer(engine=e, **TCP) as victim, spawn_peer(
        engine=e, **TCP
    ) as other:
        size = 1 << 30
        dv = await victim.register("buf", size)
        do = await other.register("buf", 256 << 20)
        src = pattern(size, seed=41)
        ms = await e.register(src)
        await e.write(ms, dv, length=1 << 20, imm=1)  # connected
        await streams_open(e)
        outcome: dict[str, object] = {}

        async def to_victim() -> None:
            b = e.batch()
            for i in range(16):
                b.write(ms, dv, length=64 << 20, src_offset=i << 26, dst_offset=i << 26, imm=2)
            t0 = time.monotonic()
            try:
                await b.submit(timeout=60)
                outcome["victim"] = "completed"
            except aiote.AioteError as exc:
                outcome["victim"] = exc
            outcome["victim_s"] = time.monotonic() - t0

        async def to_other() -> None:
            for i in range(16):
                off = i << 24
                await e.write(ms, do, length=16 << 20, src_offset=off, dst_offset=off, imm=3, timeout=60)
            outcome["other"] = "completed"

        async with anyio.create_task_group() as tg:
            tg.start_soon(to_victim)
            tg.start_soon(to_other)
            await anyio.sleep(0.15)
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
        assert isinstance(outcome["victim"], aiote.PeerUnreachable), outcome
        # bound: connect_timeout after the break, plus slack for this 2-core machine
        assert time.monotonic() - killed < policy.connect_timeout + 3.0
        assert outcome["other"] == "completed"
        await other.wait(imm=3, n=16)
        assert await other.digest("buf") == digest(src[: 256 << 20])
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "nothing left in flight")
        assert e.stats()["bytes_in_flight"] == 0  # the failed writes' bytes were given back too
        # new work towards the dead peer: refused within connect_timeout, the engine is fine
        t0 = time.monotonic()
        with pytest.raises(aiote.PeerUnreachable):
            await e.write(ms, dv, length=4096, imm=4)
        assert time.monotonic() - t0 < policy.connect_timeout + 3.0
        await e.write(ms, do, length=4096, imm=5, timeout=10)
        await other.wait(imm=5)


async def test_peer_that_never_answers() -> None:
    async with aiote.open_engine(retry=aiote.RetryPolicy(connect_timeout=1.0), **TCP) as e:
        async with aiote.open_engine(**TCP) as gone:
            d = (await gone.register(zeros(4096))).descriptor
            addr = gone.address
        ms = await e.register(pattern(4096))
        t0 = time.monotonic()
        with pytest.raises(aiote.PeerUnreachable, match="did not answer"):
            await e.write(ms, d, length=64, imm=1)
        assert 0.9 < time.monotonic() - t0 < 4.0
        with pytest.raises(aiote.TransferTimeout):  # a shorter deadline wins
            await e.write(ms, d, length=64, imm=1, timeout=0.2)
        with pytest.raises(aiote.PeerUnreachable):
            await e.send(addr, b"hello?")
        # a per-operation policy is in force: its own connect_timeout, checked before posting
        t0 = time.monotonic()
        with pytest.raises(aiote.PeerUnreachable, match=r"connect_timeout=0\.3"):
            await e.write(ms, d, length=64, retry=aiote.RetryPolicy(connect_timeout=0.3))
        assert time.monotonic() - t0 < 2.0
        before = e.stats()["completions"]
        with pytest.raises(aiote.InvalidArgument, match="RetryPolicy"):
            await e.write(ms, d, length=64, retry=5)  # type: ignore[arg-type]
        assert e.stats()["completions"] == before
        # a per-operation policy with a longer patience still gives up at its deadline
        with pytest.raises(aiote.TransferTimeout):
            await e.write(ms, d, length=64, timeout=0.3, retry=aiote.RetryPolicy(connect_timeout=60))
        assert e.stats()["ops_in_flight"] == 0


async def test_restarted_peer_at_the_same_address_is_reached_again() -> None:
    port = 20000 + os.getpid() % 20000
    async with aiote.open_engine(**TCP) as e:
        async with spawn_peer(engine=e, peer_port=port, **TCP) as p1:
            first = p1.address
            assert (await p1.call(op="echo", payload="one"))["payload"] == "one"
            os.kill(p1.pid, signal.SIGKILL)
        async with spawn_peer(engine=e, peer_port=port, **TCP) as p2:
            assert p2.address[:-4] != b"" and aiote.EngineAddress.from_bytes(p2.address).rails[0].address == (
                aiote.EngineAddress.from_bytes(first).rails[0].address
            )
            # the old connection is dead; the retry policy posts again and reaches the new one
            assert (await p2.call(op="echo", payload="two"))["payload"] == "two"
            d = await p2.register("buf", 1 << 20)
            src = pattern(1 << 20, seed=3)
            ms = await e.register(src)
            await e.write(ms, d, imm=1, timeout=30)
            await p2.wait(imm=1)
            assert await p2.digest("buf") == digest(src)


async def test_cancel_storm_leaves_nothing_behind() -> None:
    n, slot, tasks = 10_000, 4096, 64
    async with aiote.open_engine(**TCP) as e, spawn_peer(engine=e, **TCP) as p:
        d = await p.register("buf", n * slot)
        src = pattern(n * slot, seed=9)
        ms = await e.register(src)
        done: set[int] = set()
        rng = random.Random(5)
        todo = list(range(n))

        async def worker() -> None:
            while todo:
                i = todo.pop()
                with anyio.move_on_after(rng.choice((0, 0.00005, 0.0002, 0.001, 1))):
                    if rng.random() < 0.1:
                        await anyio.lowlevel.checkpoint()  # cancelled before posting, sometimes
                    await e.write(ms, d, length=slot, src_offset=i * slot, dst_offset=i * slot)
                    done.add(i)

        async with anyio.create_task_group() as tg:
            for _ in range(tasks):
                tg.start_soon(worker)
        assert 0 < len(done) < n  # some completed, some were cancelled
        await eventually(lambda: e.stats()["ops_in_flight"] == 0 and e.stats()["pending"] == 0, "quiet")
        # every slot holds its bytes or nothing; every completed write landed
        back = zeros(n * slot)
        mb = await e.register(back)
        await e.read(mb, d, timeout=60)
        got = back.reshape(n, slot)
        want = src.reshape(n, slot)
        landed = (got == want).all(axis=1)
        empty = (got == 0).all(axis=1)
        assert (landed | empty).all()
        assert landed[sorted(done)].all()
        # nothing leaked: regions and the in-flight table back to where they were
        await e.unregister(ms, timeout=0)
        await e.unregister(mb, timeout=0)
        st = e.stats()
        assert st["regions"] == 1 and st["ops_in_flight"] == 0 and st["pending"] == 0
        ms = await e.register(src[:slot].copy())
        await e.write(ms, d, length=slot, imm=7, timeout=10)  # still usable
        await p.wait(imm=7)


async def test_a_refusal_is_told_from_a_dead_peer_by_posting_once_more() -> None:
    """libfabric's tcp target closes the connection on a request it refuses (a wrong key here),
    and a peer that dies with nothing unread in its socket closes it the same way: the request
    is cancelled with the same provider error either way. An awaited write (or batch) posts it
    once more after the retry policy's first pause: refused again, the peer lives
    (RemoteAccessError, nothing landed); killed during that pause, the second post finds nobody
    (PeerUnreachable)."""
    policy = aiote.RetryPolicy(backoff=1.0, connect_timeout=2.0)
    async with aiote.open_engine(retry=policy, **TCP) as e, spawn_peer(engine=e, **TCP) as p:
        assert e.route(p.address).provider.startswith("tcp")
        d = await p.register("buf", 1 << 16)
        ms = await e.register(pattern(1 << 16, seed=7))
        await e.write(ms, d, imm=1, timeout=10)  # connected
        await p.wait(imm=1)
        before = await p.digest("buf")
        wrong = dataclasses.replace(d, keys=tuple(dataclasses.replace(k, key=k.key ^ 0x5A5A) for k in d.keys))
        errors = e.stats()["errors"]
        t0 = time.monotonic()
        with pytest.raises(aiote.RemoteAccessError, match="closed the connection") as refused:
            await e.write(ms, wrong, length=4096, imm=2, timeout=30)
        assert time.monotonic() - t0 >= policy.backoff, "refused at once: it was not posted again"
        assert e.stats()["errors"] - errors >= 2, "each post was refused"
        assert refused.value.code == 125  # FI_ECANCELED
        t0 = time.monotonic()
        with pytest.raises(aiote.RemoteAccessError, match="closed the connection"):  # a batch, the same
            await e.batch().write(ms, wrong, length=4096, imm=2).submit(timeout=30)
        assert time.monotonic() - t0 >= policy.backoff, "refused at once: it was not posted again"
        assert await p.counter(2) == 0 and await p.digest("buf") == before

        async def kill_soon() -> None:
            await anyio.sleep(0.4)  # refused by then; posted again at policy.backoff
            os.kill(p.pid, signal.SIGKILL)

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            t0 = time.monotonic()
            with pytest.raises(aiote.PeerUnreachable):
                await e.write(ms, wrong, length=4096, imm=3, timeout=30)
        assert time.monotonic() - t0 < policy.backoff + policy.connect_timeout + 3.0


async def test_forged_descriptors_get_error_completions_never_stray_writes() -> None:
    async with aiote.open_engine(**TCP) as a, aiote.open_engine(**TCP) as b:
        arena = zeros(1 << 20)
        md = await b.register(arena[:4096])  # the real region: the first 4 KiB of the arena
        hidden = await b.register(arena[8192:12288], remote_write=False, remote_read=False)
        src = pattern(1 << 16, seed=1)
        ms = await a.register(src)
        back = zeros(4096)
        mb = await a.register(back)
        d = md.descriptor
        # a region claimed longer than the real one
        longer = dataclasses.replace(d, length=1 << 20)
        with pytest.raises(aiote.RemoteAccessError):
            await a.write(ms, longer, length=8192, timeout=10)
        with pytest.raises(aiote.TransferError):
            await a.read(mb, longer, length=4096, src_offset=4096, timeout=10)
        # a wrong key
        k = d.keys[0]
        wrong = dataclasses.replace(d, keys=(dataclasses.replace(k, key=k.key ^ 0x5A5A), *d.keys[1:]))
        with pytest.raises(aiote.TransferError):
            await a.write(ms, wrong, length=64, timeout=10)
        # a region registered without remote access publishes no key; forging the access
        # bits gets nowhere
        assert all(x.key == 0 and x.base == 0 for x in hidden.descriptor.keys)
        forged = dataclasses.replace(hidden.descriptor, access=3)
        with pytest.raises(aiote.TransferError):
            await a.write(ms, forged, length=64, timeout=10)
        with pytest.raises(aiote.TransferError):
            await a.read(mb, forged, length=64, timeout=10)
        assert not arena[4096:].any()  # nothing landed outside the real region
        # keys are not sequential or small
        keys = [(await b.register(zeros(64))).descriptor.keys[0].key for _ in range(8)]
        assert len(set(keys)) == 8 and min(keys) > 1 << 32


async def test_link_blackholed_with_a_deadline_then_back() -> None:
    """A path that stops delivering while the link stays up (the peer's host routes its
    replies to us into a blackhole): the write times out, nothing hangs; once packets flow
    again, writes work."""
    from _netns import netns_unavailable, two_hosts

    why = netns_unavailable()
    if why:
        pytest.skip(why)
    with two_hosts(1, subnet=214) as h:
        async with aiote.open_engine(nics=h.local, **TCP) as e, spawn_peer(
            engine=e, peer_nics=h.remote, prefix=h.prefix, **TCP
        ) as p:
            d = await p.register("buf", 8 << 20)
            src = pattern(8 << 20, seed=2)
            ms = await e.register(src)
            await e.write(ms, d, imm=1, timeout=30)
            await p.wait(imm=1)
            ours = "10.214.1.1/32"  # our address on the link (see _netns.two_hosts)
            h.ip("-n", h.ns, "route", "add", "blackhole", ours)
            try:
                t0 = time.monotonic()
                with pytest.raises(aiote.TransferTimeout):
                    await e.write(ms, d, imm=2, timeout=1.0)
                assert time.monotonic() - t0 < 3.0
            finally:
                h.ip("-n", h.ns, "route", "del", "blackhole", ours)
            await eventually(lambda: e.stats()["ops_in_flight"] == 0, "the timed-out write to finish", 60)
            await e.write(ms, d, imm=3, timeout=30)
            await p.wait(imm=3)
            await p.wait(imm=2)  # tcp delivered the timed-out write once the path was back
            assert await p.digest("buf") == digest(src)


async def test_outer_deadline_and_native_task_cancel(anyio_backend: str) -> None:
    """Outer scopes cancel an operation like its own timeout does: the posted write cannot
    be taken back, so the cancellation waits (bounded by cancel_grace) and then propagates;
    the engine stays usable and the write lands once the peer runs again."""
    async with spawn_peer(cancel_grace=0.5, **TCP) as p:
        e = p.engine
        # every stream open: the write below is split over them and its immediate follows as a
        # deferred credit, which a cancellation after posting still sends once the data landed
        d, src, ms = await peer_buffer(p, 64 << 20, seed=6, connect=True)
        assert len(e.route(d).pairs) == aiote.default_streams("tcp", ["lo"])
        os.kill(p.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError), anyio.fail_after(0.3):
                await e.write(ms, d, imm=2)
            assert time.monotonic() - t0 < 3.0  # 0.3 s + cancel_grace, with slack
            if anyio_backend == "asyncio":
                import asyncio

                task = asyncio.create_task(e.write(ms, d, imm=3))
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        finally:
            os.kill(p.pid, signal.SIGCONT)
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "the cancelled writes to finish", 60)
        await p.wait(imm=2)  # posted before the cancellation: it landed, counted once
        if anyio_backend == "asyncio":
            await p.wait(imm=3)
        # every credit sent (a cancelled split write's goes from a background task): none twice
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "the credits to land", 60)
        assert await p.counter(2) == 0 and await p.counter(3) == 0
        assert await p.digest("buf") == digest(src)


@pytest.mark.parametrize("how", ["batch", "paged"])
async def test_a_cancelled_split_batch_or_paged_write_is_counted_once_it_landed(how: str) -> None:
    """A batch of one large write, and a paged write, to a peer of two streams go as pieces
    with deferred credits: cancelled after posting (the peer frozen), the credits still
    follow once every piece landed, once."""
    async with spawn_peer(cancel_grace=0.2, **TCP) as p:
        e = p.engine
        size = 32 << 20
        d, src, ms = await peer_buffer(p, size, seed=9, connect=True)
        assert len(e.route(d).pairs) == aiote.default_streams("tcp", ["lo"])
        page = 1 << 20
        os.kill(p.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError), anyio.fail_after(0.3):
                if how == "batch":
                    batch = e.batch()
                    batch.write(ms, d, imm=4)
                    assert batch._credits  # (internal: split over both streams, its credit deferred)
                    await batch.submit()
                else:
                    pages = list(range(size // page))
                    await e.write_paged(ms, d, page_size=page, src_pages=pages, dst_pages=pages, imm=4)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        credits = 1 if how == "batch" else size // page  # a paged write: one per page
        await p.wait(imm=4, n=credits)  # every piece landed: the credit came from a background task
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "the credits to land", 60)
        assert await p.counter(4) == 0  # counted once
        assert await p.digest("buf") == digest(src)


async def times_out_while_frozen(p: Any, op: Callable[[], Awaitable[Any]]) -> None:
    """Freezes the peer process ``p``, checks that ``op()`` raises TransferTimeout and that
    its ``settled()`` does not return while the peer is frozen (its requests still in flight),
    then thaws the peer and checks that ``settled()`` returns and nothing is left in flight."""
    e = p.engine
    os.kill(p.pid, signal.SIGSTOP)
    try:
        with pytest.raises(aiote.TransferTimeout) as info:
            await op()
        with anyio.move_on_after(0.5) as scope:  # the peer is frozen: not settled yet
            await info.value.settled()
        assert scope.cancelled_caught
        assert e.stats()["ops_in_flight"] > 0
    finally:
        os.kill(p.pid, signal.SIGCONT)
    with anyio.fail_after(60):
        await info.value.settled()
    assert e.stats()["ops_in_flight"] == 0


async def test_a_timed_out_write_can_be_awaited_until_the_transport_lets_go() -> None:
    async with spawn_peer(**TCP) as p:
        e = p.engine
        d, _, ms = await peer_buffer(p, 64 << 20, seed=8)
        await times_out_while_frozen(p, lambda: e.write(ms, d, imm=2, timeout=0.3))
        await p.wait(imm=2)  # it landed, once
        # a deadline already past: the write is posted and times out at once. The peer is
        # frozen again so that its completion cannot come first (on a loaded machine the loop
        # thread may lose the CPU for as long as 64 MiB takes over loopback)
        os.kill(p.pid, signal.SIGSTOP)
        try:
            with pytest.raises(aiote.TransferTimeout) as past:
                await e.write(ms, d, imm=3, timeout=0)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        with anyio.fail_after(60):
            await past.value.settled()
        await p.wait(imm=3)


@pytest.mark.parametrize("nics,streams", [(["lo", "lo"], 1), (["lo"], 2)], ids=["2nics", "2streams"])
async def test_a_split_timed_out_write_settles_every_group_and_is_counted_once(
    nics: list[str], streams: int
) -> None:
    """A write split over two NICs or two streams of one NIC (one group each) times out, the
    peer frozen: settling waits for both groups, then the deferred credit follows, once."""
    async with spawn_peer(nics=nics, streams=streams, peer_streams=streams, **TCP) as p:
        e = p.engine
        d, _, ms = await peer_buffer(p, 64 << 20, seed=9)
        await streams_open(e)
        c0 = e.stats()["completions"]
        os.kill(p.pid, signal.SIGSTOP)
        try:
            with pytest.raises(aiote.TransferTimeout) as info:
                await e.write(ms, d, imm=2, timeout=0.3)  # split: an idle engine
            with anyio.move_on_after(0.5) as scope:
                await info.value.settled()
            assert scope.cancelled_caught
        finally:
            os.kill(p.pid, signal.SIGCONT)
        with anyio.fail_after(60):
            await info.value.settled()
        assert e.stats()["ops_in_flight"] == 0  # both groups, not only the first
        # the deferred credit followed once both pieces had landed (settled() waits for it
        # too): counted once, as a write over one connection would be
        assert e.stats()["completions"] - c0 == 3  # two pieces, then the credit
        await p.wait(imm=2)
        assert await p.counter(2) == 0
        assert await p.digest("buf") == digest(ms.buffer)


async def test_a_resubmitted_batch_that_times_out_or_is_cancelled_keeps_its_buffers_and_lands_once() -> None:
    """A batch of whole writes (no deferred credit: the one-call path of TransferBatch.submit)
    submitted again while the peer is frozen: a timeout raises at once and settled() waits for
    the transport; a cancellation waits, shielded, for the completion before it propagates.
    Each submission's writes land once."""
    async with spawn_peer(**TCP) as p:
        e = p.engine
        d, src, ms = await peer_buffer(p, 64 << 20, seed=12)
        await streams_open(e)
        batch = e.batch()
        for i in range(4):
            batch.write(ms, d, length=16 << 20, src_offset=i << 24, dst_offset=i << 24, imm=2)
        await batch.submit(timeout=60)
        # (internal: placed at that submission as whole writes over the streams, no credit)
        assert not batch._credits
        await p.wait(imm=2, n=4)
        await times_out_while_frozen(p, lambda: batch.submit(timeout=0.3))
        await p.wait(imm=2, n=4)
        # cancelled while the peer is frozen: the cancellation waits for the completion
        # (the batch's buffers stay the transport's until then), here until the peer thaws
        os.kill(p.pid, signal.SIGSTOP)
        thawed = anyio.Event()

        async def thaw() -> None:
            await anyio.sleep(1.0)
            os.kill(p.pid, signal.SIGCONT)
            thawed.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(thaw)
                with anyio.move_on_after(0.3) as cancelled:
                    await batch.submit(timeout=60)
                assert cancelled.cancelled_caught
                assert thawed.is_set()  # it returned only after the peer went on
                assert e.stats()["ops_in_flight"] == 0  # ... and its writes completed
        finally:
            os.kill(p.pid, signal.SIGCONT)
        await p.wait(imm=2, n=4)
        assert await p.counter(2) == 0  # three submissions, each counted once
        assert await p.digest("buf") == digest(src)
