"""Two-sided messages: send/recv, sizes, ordering, queueing and cancellation."""

from __future__ import annotations

import random

import anyio
import pytest
from _util import anyio_backend_with_uvloop as anyio_backend  # noqa: F401 (the fixture: asyncio, trio, uvloop)
from _util import eventually, fails_after_kill, nothing_posted, pattern, silent_peer

import aiote

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20])
async def test_send_recv_sizes(aiote_engine_pair, size: int) -> None:
    a, b = aiote_engine_pair
    assert a.max_message_size == 1 << 20
    payload = pattern(size, seed=size).tobytes()
    await a.send(b.address, payload, timeout=30)
    sender, got = await b.recv(timeout=30)
    assert sender == a.address
    assert got == payload
    # and back, addressed with the sender address recv returned, from a memoryview
    await b.send(sender, memoryview(payload), timeout=30)
    assert await a.recv(timeout=30) == (b.address, payload)


async def test_send_to_parsed_engine_address(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    await a.send(aiote.EngineAddress.from_bytes(b.address), b"typed address", timeout=30)
    assert await b.recv(timeout=30) == (a.address, b"typed address")


async def test_replies_to_address_bytes_parse_them_once(aiote_engine_pair) -> None:
    """A reply goes to the sender's address bytes that recv returned (a new bytes object each
    time): equal bytes are parsed once, and bytes that differ in one bit are still refused."""
    a, b = aiote_engine_pair
    from aiote._core._engine import Engine

    for i in range(3):
        await a.send(b.address, b"ping %d" % i, timeout=30)
        sender, _ = await b.recv(timeout=30)
        await b.send(sender, b"pong %d" % i, timeout=30)
        assert await a.recv(timeout=30) == (b.address, b"pong %d" % i)
    first, again = Engine._engine_address(bytes(a.address)), Engine._engine_address(bytearray(a.address))
    assert first is again and first == aiote.EngineAddress.from_bytes(a.address)
    flipped = bytearray(a.address)
    flipped[len(flipped) // 2] ^= 1
    with pytest.raises(aiote.DescriptorError):
        await b.send(bytes(flipped), b"x")


async def test_payload_over_max_message_size_is_refused(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    before = a.stats()
    with pytest.raises(aiote.InvalidArgument, match="max_message_size"):
        await a.send(b.address, bytes((1 << 20) + 1))
    with pytest.raises(aiote.InvalidArgument):
        await a.send(b.address, 12345)  # type: ignore[arg-type]
    with pytest.raises(aiote.DescriptorError):
        await a.send(b.address[:-1], b"x")
    with pytest.raises(aiote.DescriptorError):
        await a.send(b"\x00" * len(b.address), b"x")
    nothing_posted(a, before)
    # nothing of the refused sends arrives: the next message b gets is the sentinel
    await a.send(b.address, b"sentinel", timeout=30)
    assert await b.recv(timeout=30) == (a.address, b"sentinel")


async def test_smaller_max_message_size() -> None:
    async with aiote.testing.engine_pair(max_message_size=100) as (a, b):
        assert a.max_message_size == 100
        await a.send(b.address, b"y" * 100, timeout=30)
        with pytest.raises(aiote.InvalidArgument):
            await a.send(b.address, b"y" * 101)
        assert await b.recv(timeout=30) == (a.address, b"y" * 100)


async def test_messages_sent_before_recv_are_kept_in_order(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    n = 40  # more than the 16 receive slots per NIC
    msgs = [f"message {i}".encode() * (i + 1) for i in range(n)]
    for m in msgs:
        await a.send(b.address, m, timeout=30)
    got = [await b.recv(timeout=30) for _ in range(n)]
    assert got == [(a.address, m) for m in msgs]


async def test_recv_waiting_before_send(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    got: list[tuple[bytes, bytes]] = []
    async with anyio.create_task_group() as tg:

        async def receiver() -> None:
            for _ in range(3):
                got.append(await b.recv(timeout=30))

        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        for i in range(3):
            await a.send(b.address, bytes([i]) * 10, timeout=30)
    assert got == [(a.address, bytes([i]) * 10) for i in range(3)]


async def test_cancelled_recv_loses_no_message(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    with anyio.move_on_after(0.05) as scope:
        await b.recv()
    assert scope.cancelled_caught
    with pytest.raises(aiote.TransferTimeout) as info:
        await b.recv(timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    await a.send(b.address, b"first", timeout=30)
    assert await b.recv(timeout=30) == (a.address, b"first")


async def test_recv_cancelled_while_a_message_arrives_loses_and_duplicates_nothing(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    rounds = 30
    received: list[bytes] = []
    for r in range(rounds):
        msg = f"m{r}".encode()
        async with anyio.create_task_group() as tg:
            cs = anyio.CancelScope()

            async def receiver(cs: anyio.CancelScope = cs) -> None:
                with cs:
                    received.append((await b.recv())[1])

            tg.start_soon(receiver)
            await anyio.wait_all_tasks_blocked()
            await a.send(b.address, msg, timeout=30)
            # race the cancellation against the delivery, at varying points
            for _ in range(r % 4):
                await anyio.lowlevel.checkpoint()
            cs.cancel()
        if not received or received[-1] != msg:
            # the receiver was cancelled: the message must still be there
            sender, payload = await b.recv(timeout=30)
            assert sender == a.address
            received.append(payload)
    assert received == [f"m{r}".encode() for r in range(rounds)]
    with pytest.raises(aiote.TransferTimeout):
        await b.recv(timeout=0.05)  # and no duplicate is left over
    assert b._spilled == 0 and not any(b._held)  # white-box: the accounting came back to zero


async def test_recv_in_a_cancelled_scope_takes_no_queued_message(aiote_engine_pair) -> None:
    # recv in a scope cancelled before the call, with messages queued: it raises the
    # cancellation at its one schedule point and takes nothing (a queued message it took out
    # of its slot goes back, first in line)
    a, b = aiote_engine_pair
    for k in range(2):
        await a.send(b.address, f"c{k}".encode(), timeout=30)
    await eventually(lambda: len(b._inbox) == 2, "the messages to be queued")  # white-box
    for _ in range(3):
        with anyio.CancelScope() as cs:
            cs.cancel()
            await b.recv()
            pytest.fail("recv returned in a cancelled scope")
        assert cs.cancelled_caught
    assert [(await b.recv(timeout=30))[1] for _ in range(2)] == [b"c0", b"c1"]
    with pytest.raises(aiote.TransferTimeout):
        await b.recv(timeout=0.05)
    assert b._spilled == 0 and not any(b._held)


async def test_recv_cancelled_after_taking_a_queued_message_gives_it_back(aiote_engine_pair) -> None:
    # a queued message is taken before recv's schedule point: cancelled there, the receive
    # must give it back, first in line, so that the next receive gets it and nothing is doubled
    a, b = aiote_engine_pair
    for r in range(6):
        for k in range(2):
            await a.send(b.address, f"q{r}.{k}".encode(), timeout=30)
        await eventually(lambda: len(b._inbox) == 2, "the messages to be queued")  # white-box
        got: list[bytes] = []
        async with anyio.create_task_group() as tg:
            cs = anyio.CancelScope()

            async def receiver(cs: anyio.CancelScope = cs, got: list[bytes] = got) -> None:
                with cs:
                    got.append((await b.recv())[1])

            tg.start_soon(receiver)
            for _ in range(r % 3):
                await anyio.lowlevel.checkpoint()
            cs.cancel()
        rest = [(await b.recv(timeout=30))[1] for _ in range(2 - len(got))]
        assert got + rest == [f"q{r}.0".encode(), f"q{r}.1".encode()]
    with pytest.raises(aiote.TransferTimeout):
        await b.recv(timeout=0.05)
    assert b._spilled == 0 and not any(b._held)


async def test_two_receivers_racing_for_one_queued_message(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    await a.send(b.address, b"one", timeout=30)
    # the message is queued (recv not called yet); white-box look at the queue to know when
    await eventually(lambda: len(b._inbox) == 1, "the message to be queued")
    got: list[tuple[bytes, bytes]] = []

    async def receiver() -> None:
        got.append(await b.recv(timeout=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        await a.send(b.address, b"two", timeout=30)
    assert sorted(got) == [(a.address, b"one"), (a.address, b"two")]


async def test_concurrent_receivers_each_get_one_message(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    n = 8
    got: list[bytes] = []

    async def receiver() -> None:
        got.append((await b.recv(timeout=30))[1])

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        for i in range(n):
            await a.send(b.address, f"{i}".encode(), timeout=30)
    assert sorted(got) == sorted(f"{i}".encode() for i in range(n))


async def test_a_receiver_that_falls_behind_holds_its_sender_back() -> None:
    """Large messages nobody receives stay in the receiver's slots (after a few copied out):
    the sender's transport waits for a slot, so the backlog does not pile up in the
    receiver's memory. Every message still arrives, whole and in order, once it is taken."""
    size, n = 128 << 10, 48  # 16 slots: 12 held, 8 copied out (1 MiB), 4 more held, then wait
    msgs = [pattern(size, seed=i).tobytes() for i in range(n)]
    async with aiote.testing.engine_pair() as (a, b):
        sent = 0

        async def sender() -> None:
            nonlocal sent
            for m in msgs:
                await a.send(b.address, m, timeout=60)
                sent += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(sender)
            await eventually(lambda: sent >= 16, "the first messages to be sent")
            await anyio.sleep(0.5)
            assert 16 <= sent < n  # held back: nobody took a message yet
            assert len(b._inbox) <= 24 and b._spilled <= 1 << 20  # white-box: what b keeps
            got = [await b.recv(timeout=30) for _ in range(n)]
        assert sent == n
        assert [s for s, _ in got] == [a.address] * n
        assert [p for _, p in got] == msgs
        assert not any(b._held) and b._spilled == 0  # every slot went back to the transport


async def test_engine_messages_pass_while_user_messages_wait() -> None:
    """Small messages nobody receives do not stop the messages the engine consumes itself:
    a staged write into (emulated) GPU memory, whose completion notice is such a message,
    completes while 40 messages wait, and they are all there afterwards."""
    async with aiote.testing.engine_pair(gpu_backend="host", gpu_ipc=False) as (a, b):
        msgs = [f"waiting {i}".encode() * 100 for i in range(40)]
        for m in msgs:
            await a.send(b.address, m, timeout=30)
        dev = aiote.testing.HostDeviceArray(1 << 20)
        dst = await b.register(dev)
        assert dst.on_gpu
        src = pattern(1 << 20, seed=3)
        ms = await a.register(src)
        await a.write(ms, dst.descriptor, imm=9, timeout=30)
        await b.imm_counter(9).wait(1, timeout=30)
        assert bytes(dev.host) == src.tobytes()
        assert a.stats()["gpu_staged"] == 1
        assert [await b.recv(timeout=30) for _ in msgs] == [(a.address, m) for m in msgs]


async def test_a_receiver_that_falls_behind_does_not_hold_up_sends_to_others() -> None:
    """Sends to a receiver that takes nothing stay in flight in the sender's send slots; one
    peer gets at most three quarters of them, so a message to another engine still goes."""
    size, n = 128 << 10, 40
    async with aiote.testing.engine_pair() as (a, b), aiote.open_engine("tcp") as c:
        done = 0

        async def to_b(k: int) -> None:
            nonlocal done
            await a.send(b.address, bytes([k]) * size, timeout=60)
            done += 1

        async with anyio.create_task_group() as tg:
            for k in range(n):
                tg.start_soon(to_b, k)
            await anyio.sleep(0.5)
            assert done < n  # b takes nothing: the sends to it wait
            with anyio.fail_after(5):
                await a.send(c.address, b"to c", timeout=5)
            assert await c.recv(timeout=5) == (a.address, b"to c")
            got = [await b.recv(timeout=30) for _ in range(n)]
        assert done == n
        assert sorted(p[0] for _, p in got) == list(range(n))
        assert all(p == bytes([p[0]]) * size for _, p in got)


async def test_sends_cancelled_in_line_lose_no_slot() -> None:
    """Many sends to one receiver that takes its messages slowly, so that most wait in line
    for a send slot, a third of them cancelled at random moments (in line, as a slot is handed
    to them, joined, or posted): each send that returned is delivered once, a cancelled one at
    most once, none twice, and the sender's slot accounting comes back to zero (a slot lost
    by a cancelled send would leave the last sends waiting to their timeout)."""
    size, n = 64 << 10, 160
    rng = random.Random(7)
    sent: set[int] = set()
    cancelled: set[int] = set()
    got: list[int] = []
    async with aiote.testing.engine_pair() as (a, b):

        async def send(i: int, cancel_after: float | None) -> None:
            with anyio.CancelScope() as cs:
                if cancel_after is not None:
                    cs.deadline = anyio.current_time() + cancel_after
                await a.send(b.address, i.to_bytes(4, "little") + bytes(size - 4), timeout=60)
                sent.add(i)
                return
            cancelled.add(i)

        async def receive() -> None:
            while True:
                _, m = await b.recv()
                got.append(int.from_bytes(m[:4], "little"))
                await anyio.sleep(0.002)

        async with anyio.create_task_group() as outer:
            outer.start_soon(receive)
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(send, i, rng.uniform(0, 0.4) if i % 3 == 0 else None)
            while True:  # what was posted is delivered; then nothing more comes
                try:
                    _, m = await b.recv(timeout=1.0)
                except aiote.TransferTimeout:
                    break
                got.append(int.from_bytes(m[:4], "little"))
            outer.cancel_scope.cancel()
        assert len(sent) + len(cancelled) == n and cancelled, (len(sent), len(cancelled))
        assert len(got) == len(set(got)), "a message was delivered twice"
        assert sent <= set(got) <= sent | cancelled
        assert not a._sends and not a._send_room  # white-box: no send slot lost or held


class _HandedThenCancelled:
    """Stands for a waiting send's event in the line: handing it a slot also cancels it."""

    def __init__(self, event: object, cancel: object) -> None:
        self.event, self.cancel = event, cancel

    def set(self) -> None:
        self.event.set()  # type: ignore[attr-defined]
        self.cancel()  # type: ignore[operator]


@pytest.mark.parametrize("order", ["cancelled, then handed a slot", "handed a slot, then cancelled"])
async def test_a_send_cancelled_as_it_gets_a_slot_hands_it_on(order: str) -> None:
    """White-box, both orders of one step: the first send in line is cancelled and handed the
    slot a completed send frees. Cancelled first, it is never sent; handed first, it posts
    (a posted send is not taken back) and then raises the cancellation. Either way the slot
    goes on to the next in line, every other send is delivered once, and the accounting
    comes back to zero."""
    size = 1 << 20
    done: dict[int, str] = {}
    scopes: dict[int, anyio.CancelScope] = {}
    got: list[int] = []
    async with aiote.testing.engine_pair() as (a, b):

        async def send(i: int) -> None:
            with anyio.CancelScope() as cs:
                scopes[i] = cs
                await a.send(b.address, bytes([i]) * size, timeout=60)
                done[i] = "sent"
                return
            done[i] = "cancelled"

        async with anyio.create_task_group() as tg:
            n = 0
            while sum(len(q) for q in a._send_room.values()) < 3:  # b takes nothing yet
                tg.start_soon(send, n)
                n += 1
                await anyio.wait_all_tasks_blocked()
                assert n < 80, (a._sends, done)
            victim = n - 3
            ((key, line),) = a._send_room.items()
            if order.startswith("cancelled"):
                scopes[victim].cancel()
                a._sent(key)  # a completion hands the victim a slot in the same step
                a._sends[key] += 1  # (the send that completed there is still in flight)
                assert len(line) == 2  # it woke the first in line alone
            else:
                line[0] = _HandedThenCancelled(line[0], scopes[victim].cancel)
            while len(done) < n:  # (a send that fails ends the group, and this loop with it)
                with anyio.move_on_after(0.2):
                    got.append((await b.recv())[1][0])
        while True:
            try:
                got.append((await b.recv(timeout=0.5))[1][0])
            except aiote.TransferTimeout:
                break
        assert done == {i: "cancelled" if i == victim else "sent" for i in range(n)}
        assert len(got) == len(set(got)), "a message was delivered twice"
        others = set(range(n)) - {victim}
        assert set(got) == others if order.startswith("cancelled") else set(got) >= others
        assert not a._sends and not a._send_room  # white-box: no send slot lost or held


@pytest.mark.parametrize("same_host", ["shm", None])
async def test_sends_to_a_killed_peer_fail_within_the_bound(same_host: str | None) -> None:
    """Messages to a peer killed meanwhile: PeerUnreachable within connect_timeout + 3 s on the
    same-host route (shm takes nothing from a dead peer: its death is seen by its lock file)
    and over tcp; the route each ran on is the one named."""
    policy = aiote.RetryPolicy(connect_timeout=2.0)
    kw = {} if same_host else {"same_host": None}
    async with silent_peer(same_host) as (proc, addr), aiote.open_engine(retry=policy, **kw) as e:
        route = e.route(addr)
        assert route.provider == ("shm" if same_host else "tcp;ofi_rxm"), route
        error, after_kill = await fails_after_kill(
            lambda: e.send(addr, b"x" * 4096), proc.kill, after=0.5
        )
        assert isinstance(error, aiote.PeerUnreachable), error
        assert after_kill < policy.connect_timeout + 3.0, (after_kill, error)


_HOLDER = r"""
import sys, anyio, aiote, numpy as np
async def main():
    kw = {} if sys.argv[1] == "direct" else {"provider": "shm", "same_host_direct": False}
    async with aiote.open_engine(**kw) as e:
        mr = await e.register(np.zeros(4096, np.uint8))
        print(e.address.hex(), bytes(mr.descriptor).hex(), flush=True)
        await anyio.sleep(3600)
anyio.run(main)
"""


@pytest.mark.parametrize("direct", [True, False])
async def test_nothing_is_posted_to_a_same_host_peer_whose_process_is_gone(direct: bool) -> None:
    """libfabric's shm provider takes a lock in the target's shared region and spins on it for
    ever if the target was killed holding it. So the core looks at the target's lock file before
    posting (once per call and peer) and refuses requests to a dead one: a message and a bare
    immediate to a killed peer raise PeerUnreachable ("process is gone") long before the retry
    policy's connect_timeout (final: not posted again), counted in ``posts_peer_gone``,
    nothing left in flight; the route is the default same-host one (shm). Between shm engines
    without direct copies (``provider="shm", same_host_direct=False``) a write goes to the shm
    transport too, and is refused the same way."""
    import sys
    import time

    import numpy as np

    policy = aiote.RetryPolicy(connect_timeout=30.0)
    async with await anyio.open_process([sys.executable, "-c", _HOLDER, "direct" if direct else "-"]) as proc:
        assert proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive()
        addr, desc = (bytes.fromhex(x) for x in line.decode().split())
        # without direct copies, an engine reaches a same-host region over shm only on an shm engine
        kw = {} if direct else {"provider": "shm", "same_host_direct": False}
        async with aiote.open_engine(retry=policy, **kw) as e:
            assert e.route(addr).provider == "shm", e.route(addr)
            assert e.route(aiote.MemoryDescriptor.from_bytes(desc)).provider == "shm"
            mine = await e.register(np.ones(4096, np.uint8))
            await e.send(addr, b"hello", timeout=10)
            await e.write_imm(desc, 1, timeout=10)
            await e.write(mine, desc, timeout=10)
            assert (e.stats()["direct_copies"] > 0) == direct
            assert e.stats()["posts_peer_gone"] == 0
            proc.kill()
            await proc.wait()
            for what, call in [("send", lambda: e.send(addr, b"x", timeout=60)),
                               ("write_imm", lambda: e.write_imm(desc, 2, timeout=60)),
                               ("send", lambda: e.send(addr, b"y" * 4096, timeout=60)),
                               *([] if direct else [("write", lambda: e.write(mine, desc, timeout=60))])]:
                before = e.stats()["posts_peer_gone"]
                t0 = time.monotonic()
                with pytest.raises(aiote.PeerUnreachable, match="process is gone"):
                    await call()
                assert time.monotonic() - t0 < 5.0, what
                assert e.stats()["posts_peer_gone"] > before, what
            await eventually(lambda: e.stats()["ops_in_flight"] == 0, "nothing left in flight")


@pytest.mark.parametrize("route", ["same-host", "tcp"])
@pytest.mark.parametrize("size", [8, 3900, 8 << 10, 64 << 10])
async def test_small_sends_end_as_they_are_posted(route: str, size: int) -> None:
    """On the default same-host route the shm provider completes a message of up to 4 KiB (the
    payload and aiote's header: the sender's address, 124 bytes here) as it takes it: the send
    ends in the posting call (no poller wake-up, no completion record waking the loop) and is
    still a schedule point; a larger one completes as before. Over tcp the provider has
    written a message of up to 16 KiB into its socket by then (its buffer has room here), so it
    ends the same way. Every message arrives whole and in order."""
    kw = {} if route == "same-host" else {"same_host": None}
    async with aiote.open_engine(**kw) as a, aiote.open_engine(**kw) as b:
        assert a.route(b.address).provider == ("shm" if route == "same-host" else "tcp;ofi_rxm")
        await a.send(b.address, b"warm", timeout=10)
        assert await b.recv(timeout=10) == (a.address, b"warm")
        ticks = 0
        done = False

        async def other_task() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        n = 100
        msgs = [pattern(size, seed=i).tobytes() for i in range(n)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(other_task)
            await anyio.lowlevel.checkpoint()
            before = a.stats()["wakeups_sent"]
            for m in msgs:
                await a.send(b.address, m, timeout=10)
                assert await b.recv(timeout=10) == (a.address, m)
            woke = a.stats()["wakeups_sent"] - before
            done = True
        assert ticks >= n  # every send (and recv) let the other task run
        if size + len(a._msg_head[0]) <= (4096 if route == "same-host" else 16384):
            assert woke < n // 4, woke  # (before: one wake-up of a's loop per send's completion)
        else:
            assert woke >= n // 2, woke  # each large send's completion wakes the loop


@pytest.mark.parametrize("route", ["same-host", "tcp"])
async def test_a_small_send_with_a_bad_retry_policy_posts_nothing(route: str) -> None:
    """A small send is posted before the retry layers it may need (it usually ends in the
    posting call): its retry policy is still checked first, so a bad one raises and nothing
    goes out; the next good message is the first the peer receives."""
    kw = {} if route == "same-host" else {"same_host": None}
    async with aiote.open_engine(**kw) as a, aiote.open_engine(**kw) as b:
        assert a.route(b.address).provider == ("shm" if route == "same-host" else "tcp;ofi_rxm")
        await a.send(b.address, b"warm", timeout=10)
        assert await b.recv(timeout=10) == (a.address, b"warm")
        before = a.stats()
        with pytest.raises(aiote.InvalidArgument, match=r"retry must be an aiote\.RetryPolicy"):
            await a.send(b.address, b"bad", retry="twice")  # type: ignore[arg-type]
        nothing_posted(a, before)
        await a.send(b.address, b"good", timeout=10)
        assert await b.recv(timeout=10) == (a.address, b"good")


async def test_a_send_in_a_cancelled_scope_is_delivered_then_raises() -> None:
    """A posted message is never taken back: a send in a scope already cancelled (a task that
    cancelled its own scope and then tells its peer, as kv's decode side does) is posted,
    delivered, and raises the cancellation, also when it ended as it was posted. (To a peer
    not reached yet the first post may wait for the connection: cancelled there, nothing went.)"""
    async with aiote.open_engine() as a, aiote.open_engine() as b:
        assert a.route(b.address).provider == "shm"
        await a.send(b.address, b"hello", timeout=10)
        assert await b.recv(timeout=10) == (a.address, b"hello")
        with anyio.CancelScope() as scope:
            scope.cancel()
            await a.send(b.address, b"told", timeout=10)
        assert scope.cancelled_caught
        assert await b.recv(timeout=10) == (a.address, b"told")
