"""Two hosts with two NICs each on this machine (a network namespace joined by two veth
pairs, see tests/_netns.py): striping over real links, mismatched NIC counts, and failover
when a link goes down in the middle of a 1 GiB transfer. Skipped without root/iproute2."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import anyio
import numpy as np
import pytest
from _netns import Hosts, netns_unavailable, reap_stale, two_hosts
from _util import digest, eventually, kernel_sndbuf, pattern, peer_buffer, streams_open, tcp_sockets

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

_why = netns_unavailable()
if _why:
    pytest.skip(_why, allow_module_level=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with two_hosts(2) as h:
        yield h


def peer(h: Hosts, engine: aiote.Engine, nics: list[str] | None = None):  # type: ignore[no-untyped-def]
    return spawn_peer(engine=engine, peer_nics=nics or h.remote, same_host=None, prefix=h.prefix)


@pytest.mark.parametrize("local,remote", [(2, 2), (2, 1), (1, 2)], ids=["2to2", "2to1", "1to2"])
async def test_striping_over_veth_links(hosts: Hosts, local: int, remote: int) -> None:
    async with (
        aiote.open_engine(nics=hosts.local[:local], same_host=None) as e,
        peer(hosts, e, hosts.remote[:remote]) as p,
    ):
        size = 64 << 20
        d = await p.register("buf", size + 4096)
        r = e.route(d)
        assert [x[0] for x in r.pairs] == [hosts.local[i % local] for i in range(max(local, remote))]
        src = pattern(size, seed=local + 2 * remote)
        ms = await e.register(src)
        await e.write(ms, d, dst_offset=4096, imm=1)  # striped over every pair
        await p.wait(imm=1, n=1)
        assert await p.counter(1) == 0  # exactly one credit for one logical write
        assert await p.digest("buf", 4096, size) == digest(src)
        pages = np.random.default_rng(3).permutation(1024)
        await e.write_paged(ms, d, page_size=65536, src_pages=pages, dst_pages=np.arange(1024), imm=2)
        await p.wait(imm=2, n=1024)
        assert await p.counter(2) == 0
        want = src.reshape(1024, 65536)[pages].reshape(-1)
        assert await p.digest("buf", 0, size) == digest(want)


async def _link_down_during(h: Hosts, e: aiote.Engine, nic: int, delay: float, transfer) -> None:  # type: ignore[no-untyped-def]
    """Runs ``transfer()`` and takes our end of link ``nic`` down after ``delay`` seconds;
    brings it back afterwards."""
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(transfer)
            await anyio.sleep(delay)
            h.link(nic, False)
    finally:
        h.link(nic, True)


async def test_failover_in_the_middle_of_a_1gib_write(hosts: Hosts) -> None:
    async with aiote.open_engine(nics=hosts.local, same_host=None) as e, peer(hosts, e) as p:
        size = 1 << 30
        d = await p.register("buf", size)
        src = pattern(size, seed=77)
        ms = await e.register(src)
        await e.write(ms, d, length=1 << 20, imm=9)  # connect both pairs first
        await streams_open(e)
        await p.wait(imm=9)
        before = e.stats()["failovers"]

        async def transfer() -> None:
            await e.write(ms, d, imm=10, timeout=120)

        await _link_down_during(hosts, e, 1, 0.3, transfer)
        assert e.stats()["failovers"] > before  # the shard on the failed NIC was moved
        assert e.domains.nics == tuple(hosts.local)
        await p.wait(imm=10, n=1)
        assert await p.counter(10) == 0  # one credit, not two
        assert await p.digest("buf") == digest(src)
        # the NIC comes back into rotation once its link is up again
        await eventually(lambda: e.route(d).down == () == e.domains.down, "the NIC back in rotation")
        # what was stuck on the failed link was delivered after it recovered (tcp retransmits)
        await eventually(lambda: e.stats()["stranded"] == 0, "the stranded shard to complete", 60)
        small = pattern(8 << 20, seed=5)
        mm = await e.register(small)
        await e.write(mm, d, imm=11, timeout=60)
        await p.wait(imm=11)
        assert await p.digest("buf", 0, 8 << 20) == digest(small)


@pytest.mark.parametrize("delay,n", [(0.02, 8192), (0.1, 4096), (0.2, 4096)])
async def test_failover_of_paged_writes(hosts: Hosts, delay: float, n: int) -> None:
    async with aiote.open_engine(nics=hosts.local, same_host=None) as e, peer(hosts, e) as p:
        ps = 65536
        d, src, ms = await peer_buffer(p, n * ps, seed=78)
        perm = np.random.default_rng(8).permutation(n)
        before = e.stats()["failovers"]
        finished: list[float] = []

        async def transfer() -> None:
            await e.write_paged(
                ms, d, page_size=ps, src_pages=perm, dst_pages=np.arange(n), imm=12, timeout=120
            )
            finished.append(anyio.current_time())

        # the link goes down while the pages move (512 MiB: about 0.1 s here), or later, when
        # the data may be done and only the credit in flight: a credit stranded on the failed
        # link is sent again on the other NIC, and the stranded one still lands once the link
        # is back (tcp retransmits); the peer counts it once (a numbered credit message)
        t0 = anyio.current_time()
        await _link_down_during(hosts, e, 0, delay, transfer)
        if delay < 0.1 and finished and finished[0] - t0 > 2 * delay:
            # the link failed while the pages moved: those on the failed NIC were moved
            assert e.stats()["failovers"] > before
        await eventually(lambda: e.stats()["stranded"] == 0, "what was stranded to land", 60)
        await anyio.sleep(0.5)
        await p.wait(imm=12, n=n)
        assert await p.counter(12) == 0  # exactly one credit per page
        want = src.reshape(n, ps)[perm].reshape(-1)
        assert await p.digest("buf") == digest(want)


@pytest.mark.parametrize("nics", [1, 2])
async def test_every_link_down_with_a_deadline_then_back(hosts: Hosts, nics: int) -> None:
    """No NIC left to the peer: nothing to fail over to, so operations wait in the transport
    for a link to return, bounded by their deadline (TransferTimeout, no hang); with the
    links back, the waiting writes complete and new ones work."""
    async with aiote.open_engine(nics=hosts.local[:nics], same_host=None) as e, peer(
        hosts, e, hosts.remote[:nics]
    ) as p:
        d, src, ms = await peer_buffer(p, 64 << 20, seed=1)
        try:
            for i in range(nics):
                hosts.link(i, False)
            await eventually(lambda: len(e.domains.down) == nics, "the NICs out of rotation")
            t0 = anyio.current_time()
            with pytest.raises(aiote.TransferTimeout):
                await e.write(ms, d, imm=2, timeout=1.0)
            assert anyio.current_time() - t0 < 3.0
            with pytest.raises(aiote.TransferTimeout):  # new work is not refused, it waits
                await e.write(ms, d, length=4096, imm=3, timeout=0.5)
        finally:
            for i in range(nics):
                hosts.link(i, True)
        await eventually(lambda: e.domains.down == (), "the NICs back in rotation")
        await e.write(ms, d, imm=4, timeout=60)
        await p.wait(imm=4)
        assert await p.digest("buf") == digest(src)
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "the waiting writes to complete", 60)


@pytest.mark.parametrize("nics", [1, 2])
async def test_every_link_down_without_a_deadline_is_unreachable_after_connect_timeout(
    hosts: Hosts, nics: int
) -> None:
    """No NIC left to the peer and no deadline: PeerUnreachable once every NIC has been down
    for connect_timeout (not after the 30 s stall bound); the writes it posted stay with the
    transport and land once, not posted again, when the links come back."""
    policy = aiote.RetryPolicy(connect_timeout=1.5)
    async with aiote.open_engine(nics=hosts.local[:nics], same_host=None, retry=policy) as e, peer(
        hosts, e, hosts.remote[:nics]
    ) as p:
        # every connection open (each NIC and stream): the 64 MiB write is striped over the
        # streams whatever the timing, as a user's write on an established route is
        d, src, ms = await peer_buffer(p, 64 << 20, seed=2, connect=True)
        try:
            for i in range(nics):
                hosts.link(i, False)
            await eventually(lambda: len(e.domains.down) == nics, "the NICs out of rotation")
            t0 = anyio.current_time()
            with pytest.raises(aiote.PeerUnreachable, match="every NIC that reaches the peer"):
                await e.write(ms, d, imm=5)
            assert anyio.current_time() - t0 < policy.connect_timeout + 3.0
            with pytest.raises(aiote.PeerUnreachable):  # new work: within the same bound
                await e.write(ms, d, length=4096, imm=6)
            assert anyio.current_time() - t0 < 2 * (policy.connect_timeout + 3.0)
        finally:
            for i in range(nics):
                hosts.link(i, True)
        await eventually(lambda: e.domains.down == (), "the NICs back in rotation")
        await eventually(lambda: e.stats()["ops_in_flight"] == 0, "the stranded writes to land", 60)
        await e.write(ms, d, imm=7, timeout=60)
        await p.wait(imm=7)
        await anyio.sleep(0.3)
        # a failed operation's immediate counts at most once: over one route (the 4 KiB write
        # over one NIC) it travels with the data, which landed; over several (the 64 MiB write
        # striped over the streams, or over two NICs) the credit follows only an operation that
        # succeeded
        assert [await p.counter(5), await p.counter(6)] == ([0, 1] if nics == 1 else [0, 0])
        assert await p.digest("buf") == digest(src)


@pytest.mark.parametrize("asked", [None, 96 << 10], ids=["auto", "96KiB"])
async def test_send_buffers_of_connections_to_another_host(hosts: Hosts, asked: int | None) -> None:
    """By default (``tcp_send_buffer=None``) the fixed send buffer is for same-host
    connections only: a connection to another host keeps the kernel's autotuning (a fixed
    buffer would cap it near buffer / round-trip time), and a listener on a real interface,
    which may accept other hosts, is left alone too. An explicit size applies everywhere."""
    async with (
        aiote.open_engine(nics=hosts.local[:1], same_host=None, tcp_send_buffer=asked) as e,
        peer(hosts, e, hosts.remote[:1]) as p,
    ):
        size = 4 << 20
        d = await p.register("buf", size)
        src = pattern(size, seed=81)
        ms = await e.register(src)
        await e.write(ms, d, imm=81)
        await p.wait(imm=81, n=1)
        await streams_open(e)  # every stream's connection, for the send buffers below
        assert await p.digest("buf", 0, size) == digest(src)
        ours = [
            sndbuf
            for local, remote, sndbuf in tcp_sockets()
            if remote is not None and local[0] == "10.213.1.1" and remote[0] == "10.213.1.2"
        ]
        assert ours, "no connection to the other host found"
        if asked is None:
            assert e.stats()["tcp_buffers_set"] == 0
            assert kernel_sndbuf(512 << 10) not in ours
        else:
            assert set(ours) == {kernel_sndbuf(asked)}
            assert e.stats()["tcp_buffers_set"] >= 2  # the listener and the connection


def test_what_a_killed_run_left_is_reaped_and_a_live_runs_is_not() -> None:
    """A test process killed before its cleanup leaves its namespace and its link (with the
    address the next run gives its own link): the next ``two_hosts`` deletes them, and leaves
    a running process's alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(dead.stdout)
    left, mine = f"aiote-{pid}", f"aiote-{os.getpid()}-keep"
    subprocess.run(["ip", "netns", "add", left], check=True)
    subprocess.run(["ip", "netns", "add", mine], check=True)
    subprocess.run(["ip", "link", "add", f"aio{pid}a0", "type", "veth", "peer", "name", f"aio{pid}b0",
                    "netns", left], check=True)
    try:
        reap_stale()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert left not in names and f"aio{pid}a0" not in links
        assert mine in names
    finally:
        subprocess.run(["ip", "netns", "del", mine], capture_output=True)
        subprocess.run(["ip", "netns", "del", left], capture_output=True)
