"""aiote.membership against real etcd (Debian's etcd-server, started on loopback with free
ports): registration, watches and snapshots; corrupt entries; etcd unreachable, restarted
under a running KV flow, and one member of three killed. The event logic alone is in
test_membership_records.py; decoders on several hosts in test_membership_hosts.py."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import anyio.abc
import numpy as np
import pytest
from _etcd import EtcdCluster, StallingProxy, etcd_cluster, etcd_unavailable, free_port
from _util import eventually

import aiote
from aiote import kv, membership
from aiote.cli import kvdemo

pytestmark = pytest.mark.anyio

_why = etcd_unavailable()
if _why:
    pytest.skip(_why, allow_module_level=True)

TTL = 2.0
LAYOUT = kv.KVLayout(layers=4, page_tokens=16, token_bytes=256, pool_pages=128)  # 4 KiB pages
BLOCK = kvdemo._block(LAYOUT)


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    with etcd_cluster(1) as c:
        yield c


@pytest.fixture(scope="module")
def cluster3() -> Iterator[EtcdCluster]:
    with etcd_cluster(3) as c:
        yield c


@pytest.fixture
async def engine() -> AsyncIterator[aiote.Engine]:
    async with aiote.open_engine(same_host=None) as e:
        yield e


async def test_register_watch_snapshot_and_leave(anyio_backend: str, etcd: EtcdCluster,
                                                 engine: aiote.Engine) -> None:
    group = f"t/basic-{anyio_backend}"
    mr = await engine.register(np.zeros(4096, np.uint8))
    release = anyio.Event()

    async def hold(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with m.register(group, engine.address, name="early", ttl=TTL):
            task_status.started()
            await release.wait()

    async with membership.connect(etcd.url) as m, anyio.create_task_group() as tg:
        await tg.start(hold)
        async with m.watch(group) as w:
            first = await w.next(timeout=5)  # the current member, first
            assert (first.kind, first.member.name) == ("join", "early")
            async with m.register(group, engine.address, descriptors={"buf": mr.descriptor},
                                  meta={"rank": 3}, ttl=TTL) as reg:
                ev = await w.next(timeout=5)
                assert ev.joined and ev.member.name == reg.name
                assert ev.member.address == engine.address
                assert ev.member.descriptors == {"buf": mr.descriptor} and ev.member.meta == {"rank": 3}
                assert [x.name for x in await m.snapshot(group)] == sorted(["early", reg.name])
                with pytest.raises(membership.MemberExists, match=reg.name):
                    async with m.register(group, engine.address, name=reg.name):
                        pass
                assert set(w.members) == {"early", reg.name}
                await reg.leave()
                ev = await w.next(timeout=5)
                assert (ev.kind, ev.member.name, ev.clean) == ("leave", reg.name, True)
            # the end of a block: a clean leave (none for reg: it said so already), key deleted
            release.set()
            ev = await w.next(timeout=5)
            assert (ev.kind, ev.member.name, ev.clean) == ("leave", "early", True)
            assert await m.snapshot(group) == []


async def test_a_lease_lost_while_running_is_registered_again(anyio_backend: str, etcd: EtcdCluster,
                                                              engine: aiote.Engine) -> None:
    group = f"t/relet-{anyio_backend}"
    async with membership.connect(etcd.url) as m, m.watch(group) as w, \
            m.register(group, engine.address, ttl=TTL) as reg:
        assert (await w.next(timeout=5)).joined
        await m.etcd.revoke(reg.lease)  # as if it had expired while etcd was out of reach
        ev = await w.next(timeout=5)
        assert (ev.kind, ev.clean) == ("leave", False)
        ev = await w.next(timeout=TTL + 2)  # the next renewal finds it gone and registers again
        assert ev.joined and ev.member.name == reg.name
        await eventually(lambda: reg.reregistered == 1 and reg.alive, "the registration to notice", 5)


async def test_a_corrupt_value_in_the_group_is_skipped_and_logged(
    anyio_backend: str, etcd: EtcdCluster, engine: aiote.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiote")
    group = f"t/corrupt-{anyio_backend}"
    base = f"/aiote/members/{group}/".encode()
    async with membership.connect(etcd.url) as m:
        await m.etcd.put(base + b"junk", b"\x00not json")  # there before the watch
        async with m.watch(group) as w:
            await m.etcd.put(base + b"half", b'{"aiote": 1, "address": "beef"}')
            await m.etcd.put(base + b"bad name", b"{}")
            async with m.register(group, engine.address, name="good", ttl=TTL):
                ev = await w.next(timeout=5)  # the corrupt ones were skipped, the watch lives on
                assert (ev.kind, ev.member.name) == ("join", "good")
                assert [x.name for x in await m.snapshot(group)] == ["good"]
                # a member's key overwritten with garbage: it left without notice
                await m.etcd.put(base + b"good", b"garbage")
                ev = await w.next(timeout=5)
                assert (ev.kind, ev.member.name, ev.clean) == ("leave", "good", False)
    text = caplog.text
    assert text.count("skipped a corrupt member entry") >= 4
    for why in ("value is not JSON", "engine address", "not a valid member name"):
        assert why in text


async def test_a_watch_stream_stalled_silently_is_noticed_and_reopened(
    anyio_backend: str, etcd: EtcdCluster, engine: aiote.Engine
) -> None:
    """The watch's connection goes through a proxy that stops carrying it without a word (a
    NAT that dropped it); its member still answers every status probe. The probe finds the
    stream behind the member's store, reopens it, and the join is not lost."""
    group = f"t/stall-{anyio_backend}"
    proxy = StallingProxy(etcd.url)
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        async with membership.connect(f"http://127.0.0.1:{port}", timeout=1) as m, \
                m.watch(group, probe_interval=0.2) as w, membership.connect(etcd.url) as direct:
            await eventually(lambda: w.connected, "the watch to open", 5)
            assert proxy.stall_watches() == 1
            async with direct.register(group, engine.address, name="late", ttl=TTL):
                ev = await w.next(timeout=5)
                assert (ev.kind, ev.member.name) == ("join", "late")
                assert w.reconnects == 1
            ev = await w.next(timeout=5)
            assert (ev.kind, ev.member.name, ev.clean) == ("leave", "late", True)
        tg.cancel_scope.cancel()


async def test_a_create_retried_after_it_committed_is_its_own(anyio_backend: str, etcd: EtcdCluster) -> None:
    """A create that timed out after etcd committed it, tried again (on the next endpoint),
    finds the key under its own lease: created, not MemberExists."""
    key = f"/aiote/members/t/create-{anyio_backend}/x".encode()
    async with membership.connect(etcd.url) as m:
        mine, _ = await m.etcd.grant(TTL)
        other, _ = await m.etcd.grant(TTL)
        try:
            assert await m.etcd.create(key, b"v", lease=mine)
            assert await m.etcd.create(key, b"v", lease=mine)  # the retry
            assert not await m.etcd.create(key, b"v", lease=other)  # another's: refused
        finally:
            await m.etcd.revoke(mine)
            await m.etcd.revoke(other)


async def test_a_leave_that_failed_can_be_tried_again(anyio_backend: str, etcd: EtcdCluster,
                                                      engine: aiote.Engine) -> None:
    group = f"t/leave-again-{anyio_backend}"
    async with membership.connect(etcd.url) as m, m.watch(group) as w, \
            m.register(group, engine.address, ttl=TTL) as reg:
        assert (await w.next(timeout=5)).joined
        await m.etcd.revoke(reg.lease)  # the lease lost: the announcement is refused
        with pytest.raises(membership.EtcdError):
            await reg.leave()
        assert not reg.leaving  # nothing was announced
        assert (await w.next(timeout=5)).kind == "leave"
        ev = await w.next(timeout=TTL + 2)  # registered again (not as leaving)
        assert ev.joined and ev.member.name == reg.name
        await eventually(lambda: reg.reregistered == 1, "the registration again", 5)
        await reg.leave()  # tried again: announced this time
        ev = await w.next(timeout=5)
        assert (ev.kind, ev.member.name, ev.clean) == ("leave", reg.name, True)


async def test_ranks_names_a_rank_claimed_twice(anyio_backend: str, etcd: EtcdCluster,
                                                engine: aiote.Engine) -> None:
    group = f"t/ranks-{anyio_backend}"
    async with membership.connect(etcd.url) as m, \
            m.register(group, engine.address, name="a", meta={"rank": 0}, ttl=TTL), \
            m.register(group, engine.address, name="b", meta={"rank": 0}, ttl=TTL):
        with pytest.raises(membership.MembershipError,
                           match=r"ranks \[1\] of 2 not there; rank 0 claimed by 2 live members \(a, b\)"):
            await m.group(group).ranks(2, timeout=0.3)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


async def test_etcd_unreachable_at_start_names_the_endpoint(anyio_backend: str, silent_port: int,
                                                            engine: aiote.Engine) -> None:
    refused = f"http://127.0.0.1:{free_port()}"
    with anyio.fail_after(5):
        with pytest.raises(membership.EtcdUnavailable, match=refused):
            async with membership.connect(refused, timeout=2):
                pass
    silent = f"http://127.0.0.1:{silent_port}"
    t0 = anyio.current_time()
    with pytest.raises(membership.EtcdUnavailable, match=f"{refused}, {silent}.*within 0.5 s") as exc:
        async with membership.connect([refused, silent], timeout=0.5):
            pass
    assert exc.value.endpoints == (refused, silent)
    assert anyio.current_time() - t0 < 2
    # a decode worker whose registry cannot be reached fails to enter, naming the endpoint
    m = membership.Membership(silent, timeout=0.5)
    async with m.etcd:
        with pytest.raises(membership.EtcdUnavailable, match=silent):
            async with kv.DecodeWorker(engine, LAYOUT, registry=m.group("kv/decode")):
                pass


def test_aiote_imports_and_runs_without_httpx() -> None:
    code = (
        "import sys; sys.modules['httpx'] = None\n"
        "import aiote, aiote.kv, aiote.cli, aiote.membership as m\n"
        "try:\n    m.connect('http://127.0.0.1:1')\nexcept m.MembershipError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'aiote[etcd]'" in out.stdout


@asynccontextmanager
async def kv_flow(url: str, group: str) -> AsyncIterator[tuple[kv.PrefillServer, membership.GroupWatch]]:
    """A prefill server whose decoders come from a watch of ``group`` (its own etcd
    connection and engine)."""
    async with AsyncExitStack() as st:
        m = await st.enter_async_context(membership.connect(url, timeout=1))
        e = await st.enter_async_context(aiote.open_engine(same_host=None))
        w = await st.enter_async_context(m.watch(group, probe_interval=0.5))
        yield await st.enter_async_context(kv.PrefillServer(e, LAYOUT, decoders=w, admit_timeout=5)), w


@asynccontextmanager
async def decoder(url: str, group: str, verified: list[bool]) -> AsyncIterator[kv.DecodeWorker]:
    """A decode worker registered in ``group`` (its own etcd connection and engine) that
    verifies every request it gets."""
    async with AsyncExitStack() as st:
        m = await st.enter_async_context(membership.connect(url, timeout=1))
        e = await st.enter_async_context(aiote.open_engine(same_host=None))
        w = await st.enter_async_context(kv.DecodeWorker(e, LAYOUT, registry=m.group(group, ttl=TTL)))

        async def consume() -> None:
            async for req in w.requests():
                verified.append(kvdemo.verify(req, LAYOUT, BLOCK))
                await req.release()

        tg = await st.enter_async_context(anyio.create_task_group())
        tg.start_soon(consume)
        yield w
        await w.leave()


async def requests(prefill: kv.PrefillServer, stop: anyio.Event, done: dict[str, int]) -> None:
    """Requests one after another until ``stop``; counts ``ok`` and ``failed``."""
    k = 0
    while not stop.is_set():
        k += 1
        req = None
        try:
            req = await prefill.start(16 + k * 37 % 200, timeout=10)
            for layer in range(LAYOUT.layers):
                kvdemo.compute_layer(req, layer, BLOCK)
                await req.send_layer(layer)
            await req.finish(timeout=10)
            await req.wait_kv_complete(timeout=10)
            done["ok"] += 1
        except kv.RequestFailed:
            done["failed"] += 1
            if req is not None:
                await req.cancel()
        await anyio.sleep(0.01)


async def test_a_registered_decoder_serves_two_prefill_servers(anyio_backend: str, etcd: EtcdCluster) -> None:
    group = f"kv/two-{anyio_backend}"
    verified: list[bool] = []
    async with kv_flow(etcd.url, group) as (p1, _), kv_flow(etcd.url, group) as (p2, _), \
            decoder(etcd.url, group, verified) as worker:
        await p1.wait_for_decoders(1, timeout=10)
        await p2.wait_for_decoders(1, timeout=10)
        stop = anyio.Event()
        done = [{"ok": 0, "failed": 0}, {"ok": 0, "failed": 0}]
        async with anyio.create_task_group() as tg:  # both number their requests from 1
            tg.start_soon(requests, p1, stop, done[0])
            tg.start_soon(requests, p2, stop, done[1])
            await eventually(lambda: min(d["ok"] for d in done) >= 5, "requests from both")
            stop.set()
    # the decoder has handed out (and its consumer verified) every request before it left
    assert worker.completed == len(verified) == done[0]["ok"] + done[1]["ok"]
    assert all(verified) and done[0]["failed"] == done[1]["failed"] == 0


async def test_etcd_restarted_mid_run_the_watch_recovers_and_no_transfer_fails(anyio_backend: str) -> None:
    group = "kv/decode"
    done = {"ok": 0, "failed": 0}
    verified: list[bool] = []
    stop = anyio.Event()
    with etcd_cluster(1) as c:
        async with kv_flow(c.url, group) as (prefill, watch), decoder(c.url, group, verified) as d1, \
                anyio.create_task_group() as tg:
            await prefill.wait_for_decoders(1, timeout=10)
            tg.start_soon(requests, prefill, stop, done)
            await eventually(lambda: done["ok"] >= 5, "requests before the restart")
            c.kill(0)  # SIGKILL, down for longer than the decoder's TTL
            before = done["ok"]
            await anyio.sleep(TTL + 0.5)
            assert done["ok"] > before  # transfers do not need etcd
            assert not d1.registration.alive  # type: ignore[attr-defined]
            c.restart(0)
            await anyio.to_thread.run_sync(c.wait_ready)
            await eventually(lambda: watch.connected and watch.reconnects >= 1, "the watch back", 10)
            await eventually(lambda: d1.registration.alive, "the lease renewed", 10)  # type: ignore[attr-defined]
            # the watch works again: a decoder that registers now is found
            async with decoder(c.url, group, verified):
                await prefill.wait_for_decoders(2, timeout=10)
                more = done["ok"]
                await eventually(lambda: done["ok"] >= more + 5, "requests after the restart")
            stop.set()
        assert d1.registration.reregistered == 0  # type: ignore[attr-defined]
    assert done["failed"] == 0 and done["ok"] >= 15
    assert len(verified) == done["ok"] and all(verified)


async def test_one_member_of_three_killed_registration_and_watches_go_on(
    anyio_backend: str, cluster3: EtcdCluster, engine: aiote.Engine
) -> None:
    c = cluster3
    lead = c.leader()
    urls = [c.urls[lead], *(u for i, u in enumerate(c.urls) if i != lead)]  # the leader first
    group = f"ha/{anyio_backend}"
    try:
        async with membership.connect(urls, timeout=3) as regs, \
                membership.connect(urls, timeout=3) as watcher, watcher.watch(group, probe_interval=0.5) as w:
            async with regs.register(group, engine.address, name="a", ttl=TTL) as a:
                assert (await w.next(timeout=5)).member.name == "a"
                c.kill(lead)  # the member both talk to, and the leader
                async with regs.register(group, engine.address, name="b", ttl=TTL):
                    ev = await w.next(timeout=10)
                    assert (ev.kind, ev.member.name) == ("join", "b")
                    await anyio.sleep(TTL + 0.5)  # a's lease renewed through the others, or it expired
                    assert a.alive and a.renewals >= 3
                    assert [x.name for x in await watcher.snapshot(group)] == ["a", "b"]
                ev = await w.next(timeout=10)
                assert (ev.kind, ev.member.name, ev.clean) == ("leave", "b", True)
            ev = await w.next(timeout=10)
            assert (ev.kind, ev.member.name, ev.clean) == ("leave", "a", True)
            assert w.reconnects >= 1 and regs.etcd.endpoint != c.urls[lead]
    finally:
        c.restart(lead)
        await anyio.to_thread.run_sync(c.wait_ready)
