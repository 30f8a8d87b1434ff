"""aiote's shipped fixtures (``aiote_engine_pair``, ``aiote_peer`` from aiote/testing/_plugin.py)
under pytest-trio, next to anyio's pytest plugin in the same session (the other modules use
the same fixtures through anyio on asyncio and trio)."""

from __future__ import annotations

import numpy as np
import pytest
import sniffio
import trio
from _util import digest, pattern, zeros

import aiote
from aiote.testing import PeerProcess


def test_both_plugins_are_active(pytestconfig: pytest.Config) -> None:
    pm = pytestconfig.pluginmanager
    assert pm.has_plugin("trio"), "pytest-trio is not loaded"
    assert pm.has_plugin("anyio"), "anyio's pytest plugin is not loaded"
    assert pm.has_plugin("aiote"), "aiote's pytest11 entry point is not loaded"


@pytest.mark.trio
async def test_engine_pair_fixture_under_pytest_trio(
    aiote_engine_pair, request: pytest.FixtureRequest
) -> None:
    assert sniffio.current_async_library() == "trio"
    assert "anyio_backend" not in request.fixturenames  # anyio's plugin is not driving this test
    a, b = aiote_engine_pair
    assert isinstance(a, aiote.Engine) and isinstance(b, aiote.Engine)
    src = pattern(300_001, seed=50)
    dst = zeros(300_001)
    ms = await a.register(src)
    md = await b.register(dst)
    await a.write(ms, md.descriptor, imm=3)
    await b.imm_counter(3).wait(1, timeout=30)
    assert np.array_equal(src, dst)
    await b.send(a.address, b"pong", timeout=30)
    assert await a.recv(timeout=30) == (b.address, b"pong")
    # trio-native cancellation works on aiote's awaitables
    with trio.move_on_after(0.05) as cs:
        await b.imm_counter(4).wait(1)
    assert cs.cancelled_caught
    assert b.imm_counter(4).available == 0


@pytest.mark.trio
async def test_peer_fixture_under_pytest_trio(aiote_peer: PeerProcess) -> None:
    assert sniffio.current_async_library() == "trio"
    e = aiote_peer.engine
    src = pattern(2 << 20, seed=51)
    ms = await e.register(src)
    desc = await aiote_peer.register("buf", 2 << 20)
    await e.write(ms, desc, imm=5)
    await aiote_peer.wait(imm=5)
    assert await aiote_peer.digest("buf") == digest(src)
    back = zeros(2 << 20)
    mb = await e.register(back)
    await e.read(mb, desc)
    assert np.array_equal(back, src)
    md = await e.register(zeros(16))
    await aiote_peer.write_imm(md.descriptor, 6, count=3)
    await e.imm_counter(6).wait(3, timeout=30)
    assert e.imm_counter(6).total == 3


@pytest.mark.trio
async def test_both_fixtures_together_under_pytest_trio(aiote_engine_pair, aiote_peer: PeerProcess) -> None:
    a, b = aiote_engine_pair
    desc = await aiote_peer.register("shared", 4096)
    srcs = [pattern(2048, seed=60), pattern(2048, seed=61)]
    async with trio.open_nursery() as nursery:
        for i, (e, s) in enumerate(zip((a, b), srcs, strict=True)):
            mr = await e.register(s)
            nursery.start_soon(lambda e=e, mr=mr, i=i: e.write(mr, desc, dst_offset=i * 2048, imm=7))
    await aiote_peer.wait(imm=7, n=2)
    assert await aiote_peer.digest("shared") == digest(np.concatenate(srcs))
