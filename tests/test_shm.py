"""The shm provider (same host): writes with immediates, reads and messages, in one process
and across processes. Skipped when libfabric offers no usable shm provider here."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import numpy as np
import pytest
from _util import digest, pattern, zeros

import aiote
from aiote.testing import engine_pair, spawn_peer

pytestmark = pytest.mark.anyio


@pytest.fixture
async def shm_pair(need_shm: None) -> AsyncIterator[tuple[aiote.Engine, aiote.Engine]]:
    async with engine_pair("shm", None) as pair:
        yield pair


async def test_shm_write_imm_read_and_messages(shm_pair) -> None:
    a, b = shm_pair
    assert a.rails[0].provider == "shm" and b.rails[0].provider == "shm"
    size = (1 << 20) + 13
    src = pattern(size, seed=40)
    dst = zeros(size + 7)
    ms = await a.register(src)
    md = await b.register(dst)
    await a.write(ms, md.descriptor, src_offset=0, dst_offset=7, imm=5, timeout=30)
    await b.imm_counter(5).wait(1, timeout=30)
    assert np.array_equal(dst[7:], src)
    assert not dst[:7].any()
    await a.write_imm(md.descriptor, 5, timeout=30)
    await b.imm_counter(5).wait(1, timeout=30)
    assert b.imm_counter(5).total == 2

    back = zeros(size)
    mb = await b.register(back)
    await b.read(mb, ms.descriptor, timeout=30)
    assert np.array_equal(back, src)

    for payload in (b"", b"hello over shm", pattern(1 << 20, seed=41).tobytes()):
        await a.send(b.address, payload, timeout=30)
        assert await b.recv(timeout=30) == (a.address, payload)
        await b.send(a.address, payload[::-1], timeout=30)
        assert await a.recv(timeout=30) == (b.address, payload[::-1])


async def test_shm_engine_cannot_reach_a_tcp_region(shm_pair) -> None:
    a, _ = shm_pair
    async with aiote.open_engine(same_host=None) as t:  # tcp only
        mt = await t.register(zeros(64))
        ms = await a.register(pattern(64))
        before = a.stats()
        with pytest.raises(aiote.InvalidArgument, match="no common provider"):
            await a.write(ms, mt.descriptor, imm=1)
        with pytest.raises(aiote.InvalidArgument, match="no common provider"):
            await a.send(t.address, b"x")
        assert a.stats()["ops_in_flight"] == 0
        assert a.stats()["completions"] == before["completions"]


async def test_shm_across_processes(shm_pair) -> None:
    async with spawn_peer("shm") as peer:
        e = peer.engine
        assert e.rails[0].provider == "shm"
        size = 3 << 20
        src = pattern(size, seed=42)
        ms = await e.register(src)
        desc = await peer.register("buf", size + 1)
        await e.write(ms, desc, dst_offset=1, imm=9, timeout=30)
        await peer.wait(imm=9)
        assert await peer.digest("buf", 1) == digest(src)
        assert await peer.digest("buf", 0, 1) == digest(zeros(1))

        pdesc = await peer.register("pat", size, fill="pattern", seed=43)
        local = zeros(size)
        ml = await e.register(local)
        await e.read(ml, pdesc, timeout=30)
        assert np.array_equal(local, pattern(size, seed=43))
        await peer.write("pat", ms.descriptor, length=4096, imm=10)
        await e.imm_counter(10).wait(1, timeout=30)
        # the peer wrote the head of its pattern over the head of our source buffer
        assert np.array_equal(src[:4096], pattern(size, seed=43)[:4096])
        assert np.array_equal(src[4096:], pattern(size, seed=42)[4096:])


async def test_a_same_host_peer_is_gone_once_its_engine_closed_not_when_its_endpoint_file_goes() -> None:
    """What close, settled() and the stall watch take for a dead same-host peer: its process
    exited (no one holds its lock: tests/test_messages.py kills one) or its engine closed (its
    wake-up file went). libfabric's SIGINT handler removes the endpoint's own file while the
    process may go on serving: that alone is not gone (its buffers may still be read)."""
    from aiote._core._util import shm_peer_gone

    async with aiote.open_engine() as e:
        addr = next(r.address for r in e._rails if r.provider == "shm")
        name = addr.rstrip(b"\0").decode()
        assert not shm_peer_gone(addr)
        os.unlink(f"/dev/shm/{name}")  # as libfabric's signal handler does
        assert not shm_peer_gone(addr)
        assert e.route(e.address).provider == "shm"
    assert shm_peer_gone(addr)
