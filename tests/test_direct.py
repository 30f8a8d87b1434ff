"""Direct same-host copies (``open_engine(same_host_direct=True)``, the default): READs from a
peer process on this host are copied by the reader's poller (``process_vm_readv``) after it
checked the region's key, bounds and rights in the owner's region table; a stale descriptor is
refused; an owner that opts out is read through shm. Real processes over the shm provider."""

from __future__ import annotations

import numpy as np
import pytest
from _util import digest, pattern, zeros

import aiote
from aiote._core._descriptor import MemoryDescriptor
from aiote.testing import spawn_peer

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("need_shm")]


async def test_reads_from_a_peer_process_are_direct_copies() -> None:
    async with spawn_peer("tcp") as peer:
        e = peer.engine
        size = (3 << 20) + 5
        pdesc = await peer.register("pat", size, fill="pattern", seed=61)
        rd = pdesc
        assert rd.direct is not None and rd.direct.pid == peer.pid
        assert MemoryDescriptor.from_bytes(bytes(rd)) == rd
        assert e.route(pdesc).provider == "shm"
        want = pattern(size, seed=61)
        local = zeros(size + 64)
        ml = await e.register(local)
        before = e.stats()["direct_copies"]
        reads = [(0, 0, 1), (1, 7, 4095), (9, 65536, 65536), (64, 0, size)]
        for loff, roff, n in reads:
            local[:] = 0xAB
            await e.read(ml, pdesc, length=n, src_offset=roff, dst_offset=loff, timeout=30)
            assert np.array_equal(local[loff : loff + n], want[roff : roff + n])
            assert (local[:loff] == 0xAB).all() and (local[loff + n :] == 0xAB).all()
        assert e.stats()["direct_copies"] - before == len(reads)
        # writes are direct copies too (checked against the owner's table), and land with their
        # immediate, which follows the copy through shm
        ddesc = await peer.register("dst", 1 << 20)
        await e.write(ml, ddesc, length=1 << 20, imm=62, timeout=30)
        await peer.wait(imm=62)
        assert e.stats()["direct_copies"] - before == len(reads) + 1
        assert await peer.digest("dst") == digest(local[: 1 << 20])
        assert (await peer.stats())["direct_copies"] == 0


async def test_a_stale_descriptor_is_refused_and_nothing_moves() -> None:
    async with spawn_peer("tcp") as peer:
        e = peer.engine
        old = await peer.register("pat", 1 << 20, fill="pattern", seed=63)
        local = zeros(1 << 20)
        ml = await e.register(local)
        await e.read(ml, old, timeout=30)
        assert np.array_equal(local, pattern(1 << 20, seed=63))
        assert e.stats()["direct_copies"] == 1
        new = await peer.register("pat", 1 << 20, fill="pattern", seed=64)  # unregisters the old one
        local[:] = 0xAB
        with pytest.raises(aiote.RemoteAccessError):
            await e.read(ml, old, timeout=30)
        assert (local == 0xAB).all()
        await e.read(ml, new, timeout=30)
        assert np.array_equal(local, pattern(1 << 20, seed=64))
        assert e.stats()["ops_in_flight"] == 0


async def test_without_direct_copies_a_same_host_peer_is_reached_over_tcp() -> None:
    # libfabric's shm checks no key, bounds or right: without the owner's table (or without
    # one of our own) the same-host route could not keep them, so the peer is reached as a
    # remote one
    async with spawn_peer("tcp", peer_same_host_direct=False) as peer:
        e = peer.engine
        pdesc = await peer.register("pat", 1 << 20, fill="pattern", seed=65)
        assert pdesc.direct is None
        assert e.route(pdesc).provider.startswith("tcp")
        local = zeros(1 << 20)
        ml = await e.register(local)
        await e.read(ml, pdesc, timeout=30)
        assert np.array_equal(local, pattern(1 << 20, seed=65))
        assert e.stats()["direct_copies"] == 0
    # and a reader that opts out reads a publishing owner through shm
    async with spawn_peer("tcp", same_host_direct=False) as peer:
        e = peer.engine
        pdesc = await peer.register("pat", 1 << 20, fill="pattern", seed=66)
        assert pdesc.direct is not None
        assert e.route(pdesc).provider.startswith("tcp")
        local = zeros(1 << 20)
        ml = await e.register(local)
        await e.read(ml, pdesc, timeout=30)
        assert np.array_equal(local, pattern(1 << 20, seed=66))
        assert e.stats()["direct_copies"] == 0
