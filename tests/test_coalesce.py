"""Combined messages (``combine_messages``, aiote/_core/_coalesce.py): sends that tasks make
to one peer while a send to it is under way travel as one message, split again by the
receiver. The window's life is tested by feeding it events; the engine's, across real
processes on every route a message can take (tcp, tcp between network namespaces, the
default same-host route: the arena route moves messages the same-host way), and in one
process under cancellations and timeouts."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import time
from typing import Any

import anyio
import pytest
from _routes import rig
from _util import fails_after_kill, silent_peer

import aiote
from aiote._core._coalesce import ALONE, LEFT, POSTED, WAITING, Window, opens_window, spans

pytestmark = pytest.mark.anyio


class _Ev:
    def __init__(self) -> None:
        self.set_count = 0

    def set(self) -> None:
        self.set_count += 1


def _mv(data: bytes) -> memoryview:
    return memoryview(data)


# ---------------------------------------------------------------- the window, fed events


def test_window_joins_until_closed_full_or_over_the_limit() -> None:
    w = Window(100, _Ev())
    a = w.join(_mv(b"x" * 40))
    b = w.join(_mv(b"y" * 40))
    assert a is not None and b is not None and a.state == b.state == WAITING
    assert w.nbytes == 88  # each payload behind its 4-byte length
    assert w.join(_mv(b"z" * 9)) is None  # 88 + 4 + 9 > 100: goes by itself
    assert w.join(_mv(b"z" * 8)) is not None  # exactly 100
    assert w.close() == w.members and len(w.members) == 3
    assert w.join(_mv(b"")) is None  # closed: nobody joins any more


def test_a_send_opens_a_window_only_when_two_of_its_size_could_join() -> None:
    assert opens_window(8, 1000)
    assert opens_window(496, 1000)  # 2 x (4 + 496): two messages of its size fit exactly
    w = Window(1000, _Ev())
    assert w.join(_mv(b"x" * 496)) is not None and w.join(_mv(b"y" * 496)) is not None
    assert w.nbytes == 1000
    assert not opens_window(497, 1000)
    assert not opens_window(1 << 19, 1 << 20)  # half the largest message
    assert not opens_window(1 << 20, 1 << 20)


def test_a_member_that_leaves_before_the_flush_is_not_in_the_message() -> None:
    ev = _Ev()
    w = Window(1 << 20, ev)
    a, b, c = (w.join(_mv(bytes([i]) * 10)) for i in range(3))
    assert a and b and c
    assert w.leave(b) and b.state == LEFT and w.nbytes == 28
    assert not w.leave(b)  # once
    members = w.close()
    assert [m.data.tobytes() for m in members] == [b"\x00" * 10, b"\x02" * 10]
    w.posted("op", done=False, at=12.5)  # its completion wakes them: not set here
    assert ev.set_count == 0 and a.state == c.state == POSTED and w.op == "op" and w.posted_at == 12.5
    assert not w.leave(a)  # posted: it cannot leave any more
    assert not w.done(a)
    assert w.done(c)  # the last one out gives the connection's count back


def test_posted_and_done_wakes_at_once_and_alone_wakes_every_member() -> None:
    ev = _Ev()
    w = Window(1 << 20, ev)
    m = w.join(_mv(b"a"))
    w.close()
    w.posted("op", done=True, at=0.0)
    assert ev.set_count == 1 and m is not None and m.state == POSTED
    ev = _Ev()
    w = Window(1 << 20, ev)
    ms = [w.join(_mv(b"a")), w.join(_mv(b"b"))]
    w.close()
    w.alone()
    assert ev.set_count == 1 and all(x is not None and x.state == ALONE for x in ms)


def test_spans_split_a_framed_body_and_malformed_bodies_are_refused() -> None:
    # the layout aio_submit_sendparts writes (its C test checks the bytes): each part behind
    # its length, 4 bytes little-endian
    parts = [b"", b"a", bytes(range(256)) * 3, b"\xff" * 4096]
    wire = b"HEAD" + b"".join(struct.pack("<I", len(p)) + p for p in parts)
    got = spans(wire, 4, len(wire))
    assert got is not None and [wire[a:b] for a, b in got] == parts
    assert spans(wire, 4, len(wire) - 1) is None  # the last length runs past the end
    assert spans(wire, 4, 6) is None  # a length cut short
    assert spans(wire, 4, 4) is None  # nothing in it
    assert spans(struct.pack("<I", 5) + b"abc", 0, 7) is None


# ---------------------------------------------------------------- across processes, per route


def _payload(task: int, seq: int, size: int) -> bytes:
    head = struct.pack("<HI", task, seq)
    rng = random.Random(task * 100003 + seq)
    return (head + rng.randbytes(max(0, size - len(head))))[: max(size, len(head))]


def _key(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


async def _reply(e: aiote.Engine, peer: bytes, rid: int, timeout: float = 60.0) -> dict[str, Any]:
    with anyio.fail_after(timeout):
        while True:
            sender, payload = await e.recv()
            if sender == peer:
                msg = json.loads(payload)
                if msg.get("id") == rid:
                    assert "error" not in msg, msg
                    return dict(msg)


@pytest.mark.parametrize("route", ["tcp", "netns", "same-host"])
@pytest.mark.parametrize("combine", [True, False])
async def test_concurrent_sends_arrive_once_intact_in_each_tasks_order(route: str, combine: bool) -> None:
    """16 tasks send 40 messages each (1 B to 60 KiB) to a peer process at once: the peer
    receives every one exactly once, byte for byte, each task's in the order it sent them.
    With ``combine_messages`` (the default) many went in combined messages, each counted
    once at both ends; without, none did. The route is the one named."""
    tasks, per = 16, 40
    async with rig(route, subnet=219, combine_messages=combine) as r:
        e, p = r.engine, r.peer
        want = "shm" if route == "same-host" else "tcp"
        assert e.route(p.address).provider.split(";")[0] == want
        sizes = [1, 6, 100, 4000, 4096, 16 << 10, 60 << 10]
        msgs = {(t, s): _payload(t, s, sizes[(t + s) % len(sizes)]) for t in range(tasks) for s in range(per)}
        who = {_key(m): k for k, m in msgs.items()}
        before, peer_before = e.stats(), await p.stats()
        rid = 999_001
        await e.send(p.address, json.dumps({"op": "recv_raw", "count": tasks * per, "id": rid}).encode())

        async def one(t: int) -> None:
            for s in range(per):
                await e.send(p.address, msgs[(t, s)], timeout=60)

        async with anyio.create_task_group() as tg:
            for t in range(tasks):
                tg.start_soon(one, t)
        got = (await _reply(e, p.address, rid))["got"]
        order = [who[digest] for _, digest in got]
        assert sorted(order) == sorted(msgs), "a message was lost, duplicated or corrupted"
        for t in range(tasks):
            assert [s for tt, s in order if tt == t] == list(range(per)), f"task {t}'s order"
        st, peer_st = e.stats(), await p.stats()
        sent = st["combined_sent"] - before["combined_sent"]
        received = peer_st["combined_received"] - peer_before["combined_received"]
        if combine:
            assert sent > 0 and st["sends_joined"] - before["sends_joined"] > sent, st
            assert received == sent, (sent, received)
        else:
            assert sent == received == 0 and st["sends_joined"] == 0


async def test_a_receiver_that_holds_back_gets_every_combined_message_later() -> None:
    """A receiver with 4 slots that does not receive while 16 tasks send bursts of 3 small
    messages: the combined messages wait in its slots (and hold back the senders), then
    every message is taken, once, in each task's order; five rounds, so a slot not handed
    back after its last message was taken would stall a later round."""
    async with (
        aiote.open_engine(same_host=None, message_slots=4) as b,
        aiote.open_engine(same_host=None) as a,
    ):
        for rnd in range(5):

            async def one(t: int, rnd: int = rnd) -> None:
                for s in range(3):
                    await a.send(b.address, _payload(t, rnd * 10 + s, 1000), timeout=30)

            async with anyio.create_task_group() as tg:
                for t in range(16):
                    tg.start_soon(one, t)
                await anyio.sleep(0.05)  # the receiver holds back meanwhile (the sends may wait)
                got = [await b.recv(timeout=30) for _ in range(48)]
            seqs: dict[int, list[int]] = {}
            for sender, payload in got:
                assert sender == a.address
                t, s = struct.unpack_from("<HI", payload)
                assert payload == _payload(t, s, 1000)
                seqs.setdefault(t, []).append(s)
            assert seqs == {t: [rnd * 10 + s for s in range(3)] for t in range(16)}
        assert a.stats()["combined_sent"] > 0


@pytest.mark.parametrize("same_host", ["shm", None])
async def test_cancelled_and_timed_out_sends_are_delivered_at_most_once(same_host: str | None) -> None:
    """24 tasks send to one peer under cancel scopes and timeouts that expire at random
    moments (before, while and after their sends joined a window): a send that returned is
    delivered exactly once, a cancelled or timed-out one at most once; every task's messages
    in its order (a cancelled send waits for what it posted, a timed-out one's ``settled()``
    does), and the engine keeps working (each task's end mark, and a lone send after)."""
    kw: dict[str, Any] = {} if same_host else {"same_host": None}
    rng = random.Random(7)
    async with aiote.open_engine(**kw) as b, aiote.open_engine(**kw) as a:
        assert a.route(b.address).provider.split(";")[0] == ("shm" if same_host else "tcp")
        returned: set[tuple[int, int]] = set()
        tasks, per = 24, 60

        async def one(t: int) -> None:
            for s in range(per):
                msg = _payload(t, s, rng.choice([8, 500, 5000]))
                how = rng.random()
                if how < 0.3:
                    with anyio.move_on_after(rng.choice([0, 1e-6, 2e-5, 1e-4])):
                        await a.send(b.address, msg, timeout=30)
                        returned.add((t, s))
                elif how < 0.5:
                    try:
                        await a.send(b.address, msg, timeout=rng.choice([0, 1e-5, 1e-4]))
                        returned.add((t, s))
                    except aiote.TransferTimeout as exc:
                        # posted, it may still land, after a later send (a message larger than
                        # the transport's eager size can be overtaken): wait until it did
                        with anyio.fail_after(30):
                            await exc.settled()
                else:
                    await a.send(b.address, msg, timeout=30)
                    returned.add((t, s))
            await a.send(b.address, _payload(t, per, 8), timeout=30)  # the end mark

        seen: dict[int, list[int]] = {}
        ended: set[int] = set()

        async def receive() -> None:
            while len(ended) < tasks:
                _, payload = await b.recv(timeout=60)
                t, s = struct.unpack_from("<HI", payload)
                assert len(payload) in (8, 500, 5000) and payload == _payload(t, s, len(payload))
                if s == per:
                    ended.add(t)
                else:
                    seen.setdefault(t, []).append(s)

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            for t in range(tasks):
                tg.start_soon(one, t)
        for t in range(tasks):
            got = seen.get(t, [])
            assert got == sorted(set(got)), f"task {t}: duplicated or out of order: {got}"
            assert {(t, s) for s in got} >= {x for x in returned if x[0] == t}, f"task {t} lost a message"
        assert a.stats()["combined_sent"] > 0
        await a.send(b.address, b"after", timeout=30)
        assert await b.recv(timeout=30) == (a.address, b"after")
        # every send is over: no window open, no combined message remembered, nothing counted
        assert not a._windows and not a._in_flight and not a._sends


@pytest.mark.parametrize("same_host", ["shm", None])
async def test_concurrent_sends_to_a_killed_peer_all_fail_within_the_bound(same_host: str | None) -> None:
    """8 tasks send to a peer process at once (joining one another's windows) when it is
    killed: every one of them ends with PeerUnreachable within connect_timeout + 3 s, none
    hangs; the route is the one named."""
    policy = aiote.RetryPolicy(connect_timeout=2.0)
    kw = {} if same_host else {"same_host": None}
    async with silent_peer(same_host) as (proc, addr), aiote.open_engine(retry=policy, **kw) as e:
        assert e.route(addr).provider == ("shm" if same_host else "tcp;ofi_rxm")
        errors: list[tuple[BaseException, float]] = []
        killed: list[float] = []

        async def loop() -> None:
            try:
                with anyio.fail_after(60):
                    while True:
                        await e.send(addr, b"y" * 512)
            except aiote.AioteError as exc:
                errors.append((exc, time.monotonic()))

        def kill() -> None:
            killed.append(time.monotonic())
            proc.kill()

        error, after_kill = await fails_after_kill(
            lambda: e.send(addr, b"x" * 512), kill, after=0.5, beside=[loop] * 7
        )
        assert isinstance(error, aiote.PeerUnreachable), error
        assert after_kill < policy.connect_timeout + 3.0, (after_kill, error)
        assert len(errors) == 7  # (fails_after_kill waited for them)
        assert e.stats()["sends_joined"] > 0  # they did join one another's windows
        for exc, at in errors:
            assert isinstance(exc, aiote.PeerUnreachable), exc
            assert at - killed[0] < policy.connect_timeout + 3.0, (at - killed[0], exc)


async def test_a_refused_send_among_joined_ones_posts_nothing() -> None:
    """Bad arguments are refused before anything is posted, also for a send that would join
    another's window: of 8 sends made at once, the one with a bad retry policy raises
    InvalidArgument and the peer receives the other 7, then the next message."""
    async with aiote.open_engine(same_host=None) as b, aiote.open_engine(same_host=None) as a:
        refused: list[BaseException] = []
        await a.send(b.address, b"warm", timeout=30)  # connected: sends end as they post, and join
        assert await b.recv(timeout=30) == (a.address, b"warm")

        async def one(k: int) -> None:
            try:
                await a.send(b.address, b"m%d" % k, timeout=30, retry=object() if k == 3 else None)  # type: ignore[arg-type]
            except aiote.InvalidArgument as exc:
                refused.append(exc)

        async with anyio.create_task_group() as tg:
            for k in range(8):
                tg.start_soon(one, k)
        assert len(refused) == 1
        assert a.stats()["sends_joined"] > 0  # the others joined windows
        await a.send(b.address, b"next", timeout=30)
        got = [(await b.recv(timeout=30))[1] for _ in range(8)]
        assert sorted(got[:7]) == sorted(b"m%d" % k for k in range(8) if k != 3) and got[7] == b"next"


@pytest.mark.parametrize("same_host", ["shm", None])
@pytest.mark.parametrize("size", ["half", "eighth"])
async def test_sends_too_large_for_two_of_their_size_to_join_open_no_window(
    same_host: str | None, size: str
) -> None:
    """16 tasks send 4 messages each at once. Of half the largest message
    (``max_message_size``, of both engines), no send opens a window, so none joins another:
    each goes by itself. Of an eighth of it, sends open windows and others join them. Every
    message arrives once, intact, either way; on the route named (the default same-host
    route, or tcp)."""
    limit = 256 << 10
    n = limit // 2 if size == "half" else limit // 8
    tasks, per = 16, 4
    async with (
        aiote.open_engine(same_host=same_host, max_message_size=limit) as b,
        aiote.open_engine(same_host=same_host, max_message_size=limit) as a,
    ):
        assert a.route(b.address).provider.split(";")[0] == ("shm" if same_host else "tcp")
        await a.send(b.address, b"warm", timeout=30)  # connected: the next sends post at once
        assert await b.recv(timeout=30) == (a.address, b"warm")
        msgs = {_key(m): m for m in (_payload(t, s, n) for t in range(tasks) for s in range(per))}
        joined = a.stats()["sends_joined"]
        got: list[bytes] = []

        async def one(t: int) -> None:
            for s in range(per):
                await a.send(b.address, _payload(t, s, n), timeout=30)

        async def take() -> None:
            for _ in range(tasks * per):
                got.append((await b.recv(timeout=30))[1])

        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            for t in range(tasks):
                tg.start_soon(one, t)
        assert sorted(_key(m) for m in got) == sorted(msgs)
        if size == "half":
            assert a.stats()["sends_joined"] == joined
        else:
            assert a.stats()["sends_joined"] > joined
