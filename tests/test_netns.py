"""Two hosts with two NICs each on this machine (a network namespace joined by two veth
pairs, see tests/_netns.py): striping over real links, mismatched NIC counts, and failover
when a link goes down in the middle of a 1 GiB transfer. Skipped without root/iproute2."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import numpy as np
import pytest
from _netns import Hosts, netns_unavailable, two_hosts
from _util import digest, eventually, pattern

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


async def test_failover_of_paged_writes(hosts: Hosts) -> None:
    async with aiote.open_engine(nics=hosts.local, same_host=None) as e, peer(hosts, e) as p:
        n, ps = 4096, 65536
        d = await p.register("buf", n * ps)
        src = pattern(n * ps, seed=78)
        ms = await e.register(src)
        perm = np.random.default_rng(8).permutation(n)
        await e.write_imm(d, 1)
        await p.wait(imm=1)

        async def transfer() -> None:
            await e.write_paged(
                ms, d, page_size=ps, src_pages=perm, dst_pages=np.arange(n), imm=12, timeout=120
            )

        await _link_down_during(hosts, e, 0, 0.1, transfer)
        await p.wait(imm=12, n=n)
        assert await p.counter(12) == 0  # exactly one credit per page
        want = src.reshape(n, ps)[perm].reshape(-1)
        assert await p.digest("buf") == digest(want)


async def test_every_nic_down_raises(hosts: Hosts) -> None:
    async with aiote.open_engine(nics=hosts.local, same_host=None) as e, peer(hosts, e) as p:
        size = 256 << 20
        d = await p.register("buf", size)
        ms = await e.register(pattern(size, seed=1))
        await e.write_imm(d, 1)
        await p.wait(imm=1)
        errors: list[BaseException] = []
        try:
            async with anyio.create_task_group() as tg:

                async def transfer() -> None:
                    try:
                        await e.write(ms, d, imm=2, timeout=60)
                    except aiote.AioteError as exc:
                        errors.append(exc)

                tg.start_soon(transfer)
                await anyio.sleep(0.1)
                hosts.link(0, False)
                hosts.link(1, False)
                await eventually(lambda: len(e.domains.down) == 2, "both NICs out of rotation")
            assert len(errors) == 1 and isinstance(errors[0], aiote.PeerUnreachable), errors
            with pytest.raises(aiote.PeerUnreachable, match="down"):
                await e.write(ms, d, length=10, timeout=5)  # refused before posting
        finally:
            hosts.link(0, True)
            hosts.link(1, True)
        await eventually(lambda: e.route(d).down == (), "the NICs back in rotation")
