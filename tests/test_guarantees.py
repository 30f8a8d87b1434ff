"""The guarantee suite: every promise aiote makes about a transfer, on every route a user can
get between two processes (tests/_routes.py: tcp, tcp between network namespaces, the
default same-host route with ordinary buffers, the same-host route into a host arena). Each
test asserts the route it ran on. docs/cancellation.md shows the route x guarantee table
these tests make up.

Bounds are asserted with margins: this machine has 2 cores."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable

import anyio
import numpy as np
import pytest
from _routes import ROUTES, SAME_HOST, rig, second_peer
from _util import digest, eventually, fails_after_kill, frozen, pattern

import aiote

pytestmark = pytest.mark.anyio

route_param = pytest.mark.parametrize("route", ROUTES)


@route_param
async def test_bytes_exact(route: str) -> None:
    """write, read, paged writes and scatter, 1 B to 64 MiB, at odd offsets, byte for byte."""
    async with rig(route) as r:
        e, p = r.engine, r.peer
        size = (64 << 20) + 8192
        d = await r.buffer("buf", size)
        src = pattern(size, seed=3)
        ms = await e.register(src)
        want = np.zeros(size, np.uint8)
        cases = [(0, 0, 1), (1, 7, 4095), (9, 65536 + 3, 65539), (4096, 3, 4 << 20), (5, 8191, 64 << 20)]
        for i, (soff, doff, n) in enumerate(cases):
            await e.write(ms, d, length=n, src_offset=soff, dst_offset=doff, imm=10 + i, timeout=60)
            want[doff : doff + n] = src[soff : soff + n]
            await p.wait(imm=10 + i)
            assert await p.digest("buf") == digest(want), (route, soff, doff, n)
        back = np.zeros(size, np.uint8)
        mb = await e.register(back)
        for soff, doff, n in cases:
            back[:] = 0xA5
            await e.read(mb, d, length=n, src_offset=doff, dst_offset=soff, timeout=60)
            assert np.array_equal(back[soff : soff + n], want[doff : doff + n]), (route, n)
            assert (back[:soff] == 0xA5).all() and (back[soff + n :] == 0xA5).all()
        pages = np.random.default_rng(5).permutation(256)
        await e.write_paged(ms, d, page_size=4096, src_pages=pages, dst_pages=np.arange(256) * 2, imm=20,
                            timeout=60)
        for k, sp in enumerate(pages):
            want[k * 8192 : k * 8192 + 4096] = src[sp * 4096 : sp * 4096 + 4096]
        await p.wait(imm=20, n=256)
        assert await p.digest("buf") == digest(want)
        # a column slice of a row-major matrix: adjacent destinations, sources one pitch apart;
        # on the same-host routes one strided copy per 4096 rows (core.AIO_MAX_STRIDED)
        rows, piece, pitch, at = 5000, 3000, 7001, (8 << 20) + 1
        copies = e.stats()["direct_copies"]
        await e.write_paged(ms, d, page_size=piece, src_pages=np.arange(rows), dst_pages=np.arange(rows),
                            src_stride=pitch, src_offset=11, dst_offset=at, imm=22, timeout=60)
        assert e.stats()["direct_copies"] - copies == (2 if route in SAME_HOST else 0)
        want[at : at + rows * piece] = np.lib.stride_tricks.as_strided(
            src[11:], shape=(rows, piece), strides=(pitch, 1)
        ).reshape(-1)
        await p.wait(imm=22, n=rows)
        assert await p.digest("buf") == digest(want)
        targets = [aiote.ScatterTarget(d, length=1000 + k, src_offset=k * 7, dst_offset=(5 << 20) + k * 4096)
                   for k in range(8)]
        await e.scatter(ms, targets, imm=21, timeout=60)
        for k in range(8):
            o = (5 << 20) + k * 4096
            want[o : o + 1000 + k] = src[k * 7 : k * 7 + 1000 + k]
        await p.wait(imm=21, n=8)
        assert await p.digest("buf") == digest(want)
        assert await p.counter(20) == 0 and await p.counter(21) == 0 and await p.counter(22) == 0
        r.ran_here()


@route_param
async def test_each_immediate_is_counted_once(route: str) -> None:
    """Credits that arrive before anyone waits are kept; each write counts exactly once, also
    when its caller timed out or was cancelled and the write landed after all."""
    async with rig(route) as r:
        e, p = r.engine, r.peer
        d = await r.buffer("buf", 8 << 20)
        src = pattern(8 << 20, seed=4)
        ms = await e.register(src)
        b = e.batch()
        for k in range(100):
            b.write(ms, d, length=4096 + k, src_offset=k * 4096, dst_offset=k * 65536, imm=30)
        await b.submit(timeout=60)
        await anyio.sleep(0.2)  # every credit in before the waiter
        assert await p.counter(30) == 100
        await p.wait(imm=30, n=100)
        assert await p.counter(30) == 0
        # a cancelled and a timed-out large write: each lands and is counted once
        with anyio.move_on_after(0.002):
            await e.write(ms, d, imm=31)
        try:
            await e.write(ms, d, imm=31, timeout=0.001)
        except aiote.TransferTimeout as exc:
            with anyio.fail_after(30):
                await exc.settled()
        await p.wait(imm=31, n=2, timeout=30)
        await anyio.sleep(0.3)
        assert await p.counter(31) == 0
        assert await p.digest("buf") == digest(src)
        r.ran_here()


@route_param
async def test_killed_peer_fails_pending_work_and_others_go_on(route: str) -> None:
    policy = aiote.RetryPolicy(connect_timeout=1.0)
    async with rig(route, retry=policy) as r, second_peer(r) as other:
        e, victim = r.engine, r.peer
        dv = await r.buffer("buf", 64 << 20)
        do = await other.register("buf", 16 << 20, **({"device": "arena"} if route == "arena" else {}))
        src = pattern(64 << 20, seed=6)
        ms = await e.register(src)
        await e.write(ms, dv, length=1 << 20, imm=1, timeout=30)
        await victim.wait(imm=1)
        outcome: dict[str, object] = {}

        async def to_other() -> None:
            for i in range(16):
                off = i << 20
                await e.write(ms, do, length=1 << 20, src_offset=off, dst_offset=off, imm=3, timeout=60)
            outcome["other"] = "completed"

        error, after_kill = await fails_after_kill(
            lambda: e.write(ms, dv, imm=2), lambda: os.kill(victim.pid, signal.SIGKILL), after=0.3,
            beside=[to_other],
        )
        assert isinstance(error, aiote.PeerUnreachable), error
        assert after_kill < policy.connect_timeout + 3.0, (after_kill, error)
        assert outcome["other"] == "completed"
        await other.wait(imm=3, n=16)
        assert await other.digest("buf") == digest(src[: 16 << 20])
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "nothing left in flight")
        # new work to the dead peer fails within the bound; the engine serves the others
        t0 = time.monotonic()
        with pytest.raises(aiote.PeerUnreachable):
            await e.write(ms, dv, length=4096, imm=4, timeout=30)
        with pytest.raises(aiote.PeerUnreachable):
            await e.write(ms, dv, length=64, imm=4, timeout=30)
        assert time.monotonic() - t0 < 2 * (policy.connect_timeout + 3.0)
        await e.write(ms, do, length=4096, imm=5, timeout=10)
        await other.wait(imm=5)
        r.ran_here()


@route_param
async def test_paused_peer_is_not_declared_dead_and_counts_once(route: str) -> None:
    """A peer stopped (SIGSTOP) for longer than connect_timeout, then resumed: the caller's
    deadline gives TransferTimeout (or the write completes: same-host copies need no help from
    the target), never PeerUnreachable on the same host; no credit counts twice."""
    policy = aiote.RetryPolicy(connect_timeout=1.0)
    async with rig(route, retry=policy) as r:
        e, p = r.engine, r.peer
        d = await r.buffer("buf", 16 << 20)
        src = pattern(16 << 20, seed=7)
        ms = await e.register(src)
        await e.write(ms, d, length=4096, imm=1, timeout=30)
        await p.wait(imm=1)
        async with frozen(p.pid):
            t0 = time.monotonic()
            outcome: object = "completed"
            try:
                await e.write(ms, d, imm=40, timeout=policy.connect_timeout + 1.5)
            except aiote.TransferTimeout as exc:
                outcome = exc
            except aiote.PeerUnreachable as exc:
                outcome = exc
            assert time.monotonic() - t0 < policy.connect_timeout + 6
            assert not isinstance(outcome, aiote.PeerUnreachable), outcome
            if route not in SAME_HOST:  # 16 MiB do not fit in the sockets' buffers
                assert isinstance(outcome, aiote.TransferTimeout), outcome
        if isinstance(outcome, aiote.TransferTimeout):
            with anyio.fail_after(30):
                await outcome.settled()
        if not isinstance(outcome, aiote.PeerUnreachable):
            await p.wait(imm=40, timeout=30)
        await e.write(ms, d, imm=41, timeout=30)
        await p.wait(imm=41, timeout=30)
        await anyio.sleep(0.3)
        assert await p.counter(40) == 0 and await p.counter(41) == 0
        assert await p.digest("buf") == digest(src)
        r.ran_here()


@route_param
async def test_stale_forged_and_wrong_descriptors_never_land(route: str) -> None:
    """A stale descriptor (region unregistered), a range past the region, a wrong key, forged
    access bits: RemoteAccessError (or InvalidArgument before posting), never a silent success,
    never a hang, and the peer's bytes unchanged; the route keeps working after."""
    async with rig(route) as r:
        e, p = r.engine, r.peer
        d = await r.buffer("buf", 1 << 20)
        # a region without remote access has no slot in the owner's table: even on the same
        # host it is reached as a remote one, whose provider refuses it
        arena = {"device": "arena"} if route == "arena" else {}
        hidden = await p.register("hidden", 65536, remote_write=False, remote_read=False, **arena)
        src = pattern(1 << 20, seed=8)
        ms = await e.register(src)
        back = np.zeros(1 << 20, np.uint8)
        mb = await e.register(back)
        await e.write(ms, d, length=4096, imm=1, timeout=30)
        await p.wait(imm=1)
        before = await p.digest("buf")
        refused = (aiote.RemoteAccessError, aiote.InvalidArgument)
        longer = dataclasses.replace(d, length=4 << 20)
        # libfabric's tcp drops the connection when the target refuses a write whose payload is
        # already on the way: then the initiator can only tell a broken connection
        # (docs/cancellation.md); on the same host the owner's table refuses it before a copy
        with pytest.raises(refused if route in SAME_HOST else (*refused, aiote.PeerUnreachable)):
            await e.write(ms, longer, length=1 << 20, dst_offset=1 << 20, timeout=10)
        with pytest.raises(refused):
            await e.read(mb, longer, length=4096, src_offset=2 << 20, timeout=10)
        wrong = dataclasses.replace(d, keys=tuple(dataclasses.replace(k, key=k.key ^ 0x5A5A) for k in d.keys))
        with pytest.raises(refused):
            await e.write(ms, wrong, length=64, timeout=10)
        if route in SAME_HOST:  # libfabric's tcp checks no key for a zero-byte write (docs/cancellation.md)
            with pytest.raises(refused):
                await e.write_imm(wrong, 50, timeout=10)
        with pytest.raises(refused):
            await e.read(mb, wrong, length=64, timeout=10)
        forged = dataclasses.replace(hidden, access=3)
        with pytest.raises(refused):
            await e.write(ms, forged, length=64, timeout=10)
        with pytest.raises(refused):
            await e.read(mb, forged, length=64, timeout=10)
        assert await p.counter(50) == 0
        assert await p.digest("buf") == before
        assert await p.digest("hidden") == digest(np.zeros(65536, np.uint8))
        # stale: the owner unregistered the region; its memory is still there, untouched
        await p.unregister("buf")
        with pytest.raises(refused):
            await e.write(ms, d, length=4096, imm=51, timeout=10)
        with pytest.raises(refused):
            await e.read(mb, d, length=4096, timeout=10)
        assert await p.digest("buf") == before
        assert await p.counter(51) == 0
        assert not back.any()
        # the route still works
        d2 = await r.buffer("buf2", 1 << 20)
        await e.write(ms, d2, imm=52, timeout=30)
        await p.wait(imm=52)
        assert await p.digest("buf2") == digest(src)
        assert e.stats()["ops_in_flight"] == 0
        r.ran_here()


@route_param
async def test_nothing_hangs_by_default_a_stopped_peer_stalls(route: str) -> None:
    """An operation to a peer that takes nothing (stopped) fails with TransferStalled after the
    policy's stall_timeout, with no deadline of the caller's; what it posted lands once the
    peer resumes, counted once."""
    policy = aiote.RetryPolicy(stall_timeout=1.0)
    assert aiote.RetryPolicy().stall_timeout == 30.0  # the default: nothing waits forever
    async with rig(route, retry=policy) as r:
        e, p = r.engine, r.peer
        d = await r.buffer("buf", 16 << 20)
        src = pattern(16 << 20, seed=10)
        ms = await e.register(src)
        await e.write(ms, d, length=4096, imm=1, timeout=30)
        await p.wait(imm=1)
        stalled: list[aiote.TransferStalled] = []
        async with frozen(p.pid):
            t0 = time.monotonic()
            if route not in SAME_HOST:  # on the same host a write needs nothing of the peer
                with pytest.raises(aiote.TransferStalled) as info:
                    await e.write(ms, d, imm=70)
                assert "stall_timeout=1" in str(info.value)
                stalled.append(info.value)
            # a message waits for the peer to take it: 4 of them, more than it has room for
            async with anyio.create_task_group() as tg:
                for k in range(4):
                    tg.start_soon(_send_stalled, e, p.address, k, stalled)
            # every one returned within the bound; over tcp each stalled, while on the same host
            # shm may take a message into the stopped peer's queue without its help
            assert time.monotonic() - t0 < 2 * policy.stall_timeout + 8
            if route not in SAME_HOST:
                assert len(stalled) == 5, stalled
        with anyio.fail_after(30):
            for exc in stalled:
                await exc.settled()
        if route not in SAME_HOST:
            await p.wait(imm=70, timeout=30)
        await anyio.sleep(0.3)
        assert await p.counter(70) == 0
        assert await p.digest("buf") == digest(src) or route in SAME_HOST
        await e.write(ms, d, imm=71, timeout=30)  # the route works on
        await p.wait(imm=71)
        assert await p.digest("buf") == digest(src)


async def _send_stalled(e: aiote.Engine, to: bytes, k: int, out: list[aiote.TransferStalled]) -> None:
    try:
        await e.send(to, b'{"op": "echo", "id": -1}' + b" " * (60000 + k))
    except aiote.TransferStalled as exc:
        out.append(exc)


@route_param
async def test_a_message_larger_than_the_receiver_takes_is_refused_at_the_sender(route: str) -> None:
    async with rig(route, max_message_size=4 << 20) as r:  # it could send more than the peer takes
        e, p = r.engine, r.peer
        d = await r.buffer("buf", 4096)
        limit = aiote.EngineAddress.from_bytes(p.address).max_message
        assert limit == d.max_message > 0
        before = e.stats()
        with pytest.raises(aiote.InvalidArgument, match="receiving engine's max_message_size"):
            await e.send(p.address, b"x" * (limit + 1), timeout=10)
        with pytest.raises(aiote.InvalidArgument, match="receiving engine's max_message_size"):
            await e.send(d.address, b"x" * (limit + 1), timeout=10)
        assert e.stats()["completions"] == before["completions"]  # nothing was posted
        assert (await p.call(op="echo", payload="still here"))["payload"] == "still here"


@route_param
async def test_held_back_sends_go_in_line_and_a_cancelled_one_never_goes(route: str) -> None:
    """A peer that takes no message (stopped) holds its sender back: past the connection's
    cap, sends wait in line for a send slot, each freed slot going to the longest waiting.
    Resumed, the peer gets each of them once; sends cancelled while waiting are never
    delivered and hold up nobody behind them; the sender's slot accounting comes back to
    zero."""
    size, n = 512 << 10, 40
    cancelled = {n - 8, n - 6, n - 3}
    async with rig(route) as r:
        e, p = r.engine, r.peer
        want = "shm" if route in SAME_HOST else "tcp"
        assert e.route(p.address).provider.split(";")[0] == want
        outcome: dict[int, str] = {}
        scopes = [anyio.CancelScope() for _ in range(n)]

        async def send(i: int) -> None:
            with scopes[i]:
                await e.send(p.address, pattern(size, seed=i).tobytes(), timeout=120)
                outcome[i] = "sent"
                return
            outcome[i] = "cancelled"

        reply: dict[str, object] = {}

        async def receive() -> None:
            reply.update(await p.call(op="recv_raw", count=n - len(cancelled), timeout=120))

        # the route open first: the command's send then ends before the first message goes
        # (a send still opening the route is in flight with them, and could come after them)
        assert (await p.call(op="echo", payload="open"))["payload"] == "open"
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            async with frozen(p.pid):
                for i in range(n):  # one at a time: each is in flight or in line before the next
                    tg.start_soon(send, i)
                    await anyio.wait_all_tasks_blocked()
                line = [len(q) for q in e._send_room.values()]  # white-box: the sends in line
                assert len(line) == 1 and line[0] >= n - min(cancelled), (route, line, outcome)
                for i in cancelled:
                    scopes[i].cancel()
                await anyio.wait_all_tasks_blocked()
                assert {i: outcome.get(i) for i in cancelled} == dict.fromkeys(cancelled, "cancelled")
                assert sum(len(q) for q in e._send_room.values()) == line[0] - len(cancelled)
        assert outcome == {i: "cancelled" if i in cancelled else "sent" for i in range(n)}
        seeds = {digest(pattern(size, seed=i)): i for i in range(n)}
        got = [seeds.get(h, -1) for _, h in reply["got"]]  # type: ignore[attr-defined]
        # each delivered once (sends in flight together keep no order: docs/messages.md)
        assert sorted(got) == [i for i in range(n) if i not in cancelled], route
        assert not e._sends and not e._send_room  # white-box: no send slot lost or held
        assert (await p.call(op="echo", payload="still here"))["payload"] == "still here"


@route_param
async def test_a_bytes_message_goes_in_place_and_outlives_its_sender(route: str) -> None:
    """A ``bytes`` payload over 16 KiB is sent from where it lies (no copy into a send slot);
    any other payload is copied. Each arrives byte for byte. One that times out in flight
    (the peer stopped) stays owned by the engine: the caller drops it and the allocator reuses
    its memory, and the peer, resumed, still receives the bytes it was sent."""
    size = (512 << 10) + 3
    async with rig(route) as r:
        e, p = r.engine, r.peer
        want = "shm" if route in SAME_HOST else "tcp"
        assert e.route(p.address).provider.split(";")[0] == want
        assert (await p.call(op="echo", payload="open"))["payload"] == "open"
        src = pattern(size, seed=41)
        sent = [
            (src.tobytes(), 1),                 # bytes over 16 KiB: in place
            (bytearray(src.tobytes()), 0),      # mutable: copied
            (memoryview(src), 0),               # a view of a NumPy array: copied
            (src[: 16 << 10].tobytes(), 0),     # 16 KiB: copied (the threshold)
            (src[: (16 << 10) + 1].tobytes(), 1),
        ]
        reply: dict[str, object] = {}

        async def take() -> None:
            reply.update(await p.call(op="recv_raw", count=1, timeout=60))

        for payload, in_place in sent:
            before = e.stats()["sends_in_place"]
            reply.clear()
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                await anyio.wait_all_tasks_blocked()  # the command went first
                await e.send(p.address, payload, timeout=60)
            n = len(bytes(payload))
            assert reply["got"] == [[n, digest(src[:n])]], (route, n)
            assert e.stats()["sends_in_place"] - before == in_place, (route, type(payload), n)

        timed_out: list[Callable[[], Awaitable[None]]] = []

        async def send_and_forget(seed: int) -> None:
            try:  # the payload is referenced by this call's frames only, and by the engine
                await e.send(p.address, pattern(size, seed=seed).tobytes(), timeout=1.0)
            except aiote.TransferTimeout as exc:
                # white-box: its waiter alone, not the exception (its traceback holds the
                # frames that hold the payload; exc.settled is bound to it)
                timed_out.append(exc._waiter)

        got: dict[str, object] = {}

        async def receive() -> None:
            got.update(await p.call(op="recv_raw", count=4, timeout=120))

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)  # the peer waits in recv before it stops
            await anyio.wait_all_tasks_blocked()
            async with frozen(p.pid):
                for k in range(4):  # more than the stopped peer takes in without its poller
                    await send_and_forget(50 + k)
                # white-box: the engine's groups hold the 4 payloads, nothing else does
                assert sum(type(op.refs) is bytes for op in e._ops) == 4, route
                gc.collect()
                churn = [pattern(size, seed=99).tobytes() for _ in range(16)]  # reuses freed memory
                del churn
            assert len(timed_out) == 4, route  # a 512 KiB message waits for the peer's poller
            with anyio.fail_after(30):
                for settled in timed_out:
                    await settled()
        assert got["got"] == [[size, digest(pattern(size, seed=50 + k))] for k in range(4)], route
        assert not e._sends and not e._send_room  # white-box: no send slot lost or held
