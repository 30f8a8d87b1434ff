"""Several NICs per engine (two rails on loopback here; tests/test_netns.py does the same on
veth links between network namespaces): striping, round robin that always pairs a local NIC
with its own keys, mismatched NIC counts, one credit per logical write, and the automatic
same-host route (shm) and how to force tcp."""

from __future__ import annotations

import dataclasses

import anyio
import numpy as np
import pytest
from _util import digest, pattern, zeros

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

TCP = {"same_host": None, "streams": 1}  # NICs, not streams (one-NIC engines default to two)


@pytest.mark.parametrize("local,remote", [(2, 2), (2, 1), (1, 2)], ids=["2to2", "2to1", "1to2"])
async def test_striped_write_bytes_and_one_credit(local: int, remote: int) -> None:
    async with (
        aiote.open_engine(nics=["lo"] * local, **TCP) as a,
        aiote.open_engine(nics=["lo"] * remote, **TCP) as b,
    ):
        size = 24 << 20
        src = pattern(size + 4096, seed=local * 10 + remote)
        dst = zeros(size + 8192)
        ms, md = await a.register(src), await b.register(dst)
        r = a.route(md.descriptor)
        assert r.provider.startswith("tcp")
        n = max(local, remote)
        assert len(r.pairs) == n
        assert [p[1] for p in r.pairs] == [i % remote for i in range(n)]
        # above stripe_min: split over every route; the shards add up to one credit
        for i in range(3):
            await a.write(ms, md.descriptor, length=size, src_offset=i, dst_offset=4096 + i, imm=40)
            await b.imm_counter(40).wait(1, timeout=30)
            assert b.imm_counter(40).available == 0
            assert digest(dst[4096 + i : 4096 + i + size]) == digest(src[i : i + size])
        assert b.imm_counter(40).total == 3  # whole units
        # small writes go round robin, each on one route; counts exact
        dst[:] = 0
        for k in range(8):
            await a.write(ms, md.descriptor, length=4096, src_offset=4096 * k, dst_offset=4096 * k, imm=41)
        await b.imm_counter(41).wait(8, timeout=30)
        assert np.array_equal(dst[: 8 * 4096], src[: 8 * 4096])
        # READ striped back the other way
        back = zeros(size)
        mb = await a.register(back)
        await a.read(mb, md.descriptor, length=size, src_offset=0)
        assert np.array_equal(back, dst[:size])


async def test_round_robin_never_mixes_one_nics_key_with_another_nics_queue() -> None:
    # the anchor's defect: with a round-robin start that is not 0, it posted NIC 0's key on
    # NIC 1's queue. Keys differ per NIC here, and tcp completes only once the target placed
    # the bytes (delivery completion), so a mixed key would fail the write.
    async with (
        aiote.open_engine(nics=["lo", "lo"], **TCP) as a,
        aiote.open_engine(nics=["lo", "lo"], **TCP) as b,
    ):
        src = pattern(1 << 16, seed=2)
        dst = zeros(1 << 16)
        ms, md = await a.register(src), await b.register(dst)
        keys = [k.key for k in md.descriptor.keys]
        assert keys[0] != keys[1]
        for start in range(4):  # rotation start 0, 1, 0, 1
            await a.write(ms, md.descriptor, length=1024, src_offset=1024 * start, dst_offset=1024 * start)
            await a.write_paged(
                ms,
                md.descriptor,
                page_size=512,
                src_pages=[8 + 2 * start, 9 + 2 * start],
                dst_pages=[8 + 2 * start, 9 + 2 * start],
                imm=5,
            )
        await b.imm_counter(5).wait(8, timeout=10)
        assert np.array_equal(dst[: 8 * 1024], src[: 8 * 1024])
        # and the check is real: a descriptor whose keys are swapped between NICs fails
        d = md.descriptor
        swapped = aiote.MemoryDescriptor(
            d.length,
            d.access,
            d.device_kind,
            d.device_id,
            d.host_id,
            (
                type(d.keys[0])(d.keys[0].provider, d.keys[0].address, d.keys[0].base, d.keys[1].key),
                type(d.keys[1])(d.keys[1].provider, d.keys[1].address, d.keys[1].base, d.keys[0].key),
            ),
        )
        # (tcp drops the connection over a bad key, so it reads as the peer hanging up)
        with pytest.raises((aiote.TransferError, aiote.PeerUnreachable)):
            await a.write(ms, swapped, length=64, timeout=10)
        # tcp tore that connection down; it is re-established on a later use (a write issued
        # while the teardown is being processed may still see it gone)
        with anyio.fail_after(10):
            while True:
                try:
                    await a.write(ms, md.descriptor, length=64, imm=6)
                    break
                except aiote.PeerUnreachable:
                    await anyio.sleep(0.05)
        await b.imm_counter(6).wait(1, timeout=10)


async def test_paged_pages_spread_over_nics_count_once_each() -> None:
    async with aiote.open_engine(nics=["lo", "lo"], **TCP) as a, aiote.open_engine(nics=["lo"], **TCP) as b:
        n, ps = 3001, 1000
        src = pattern(n * ps, seed=4)
        dst = zeros(n * ps)
        ms, md = await a.register(src), await b.register(dst)
        for _ in range(3):  # different round-robin starts
            dst[:] = 0
            perm = np.random.default_rng(n).permutation(n)
            await a.write_paged(
                ms, md.descriptor, page_size=ps, src_pages=np.arange(n), dst_pages=perm, imm=9
            )
            await b.imm_counter(9).wait(n, timeout=30)
            assert b.imm_counter(9).available == 0
            assert np.array_equal(dst.reshape(n, ps)[perm], src.reshape(n, ps))


async def test_same_host_peer_goes_over_shm_and_tcp_can_be_forced() -> None:
    async with aiote.open_engine() as a, aiote.open_engine() as b:
        provs = {r.provider for r in a.rails}
        if "shm" not in provs:
            pytest.skip("libfabric's shm provider is not usable here")
        src = pattern(1 << 20, seed=8)
        dst = zeros(1 << 20)
        ms, md = await a.register(src), await b.register(dst)
        r = a.route(md.descriptor)
        assert r.provider == "shm" and r.same_host and r.direct  # a region: direct copies
        # the engine address routes the same way (it names no region: direct is False)
        assert a.route(b.address) == dataclasses.replace(r, direct=False)
        await a.write(ms, md.descriptor, imm=3)
        await b.imm_counter(3).wait(1, timeout=10)
        assert np.array_equal(src, dst)
        async with aiote.open_engine(same_host=None) as t:  # forced: tcp only
            assert all(x.provider.startswith("tcp") for x in t.rails)
            assert t.route(md.descriptor).provider.startswith("tcp")
            mt = await t.register(src)
            dst[:] = 0
            await t.write(mt, md.descriptor, imm=4)
            await b.imm_counter(4).wait(1, timeout=10)
            assert np.array_equal(src, dst)


async def test_same_host_route_across_processes() -> None:
    async with spawn_peer() as peer:
        e = peer.engine
        if "shm" not in {r.provider for r in e.rails}:
            pytest.skip("libfabric's shm provider is not usable here")
        desc = await peer.register("buf", 4 << 20)
        assert e.route(desc).provider == "shm"
        r = await peer.route(e.address)
        assert r["provider"] == "shm"
        src = pattern(4 << 20, seed=12)
        ms = await e.register(src)
        await e.write(ms, desc, imm=2)
        await peer.wait(imm=2)
        assert await peer.digest("buf") == digest(src)
    async with spawn_peer(same_host=None) as peer:  # forced tcp on both sides
        desc = await peer.register("buf", 1 << 20)
        assert peer.engine.route(desc).provider.startswith("tcp")
        assert (await peer.route(peer.engine.address))["provider"].startswith("tcp")
