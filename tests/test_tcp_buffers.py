"""Send buffers of the tcp provider's connections (``open_engine(tcp_send_buffer=)``): by
default the engine gives same-host connections a fixed 512 KiB SO_SNDBUF (loopback tcp moves
large writes faster with it, docs/benchmarks.md) and leaves other hosts' connections to the
kernel's autotuning; ``0`` leaves every connection alone; a size applies to every one. Real
processes over tcp loopback (and two network namespaces in tests/test_netns.py)."""

from __future__ import annotations

import pytest
from _util import digest, kernel_sndbuf, pattern, streams_open, tcp_sockets

import aiote
from aiote._core._descriptor import EngineAddress
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

_AUTO = 512 << 10


def port_of(rail_address: bytes) -> int:
    """The port of a tcp rail's address (a sockaddr_in/in6: family, then the port)."""
    return int.from_bytes(rail_address[2:4], "big")


def engine_sockets(e: aiote.Engine, peer_address: bytes) -> tuple[list[int], list[int]]:
    """SO_SNDBUF of (our listener and the connections it accepted, our connections to the
    peer's tcp listener), among this process's sockets."""
    mine = {port_of(r.address) for r in e.rails if r.provider.startswith("tcp")}
    theirs = {port_of(r.address) for r in EngineAddress.from_bytes(peer_address).rails}
    accepted, active = [], []
    for local, remote, sndbuf in tcp_sockets():
        if local[1] in mine:
            accepted.append(sndbuf)
        elif remote is not None and remote[1] in theirs and remote[0] == local[0]:
            active.append(sndbuf)
    return accepted, active


async def _write_and_check(peer, e: aiote.Engine, imm: int, size: int = 4 << 20) -> None:  # type: ignore[no-untyped-def]
    d = await peer.register("dst", size)
    src = pattern(size, seed=imm)
    ms = await e.register(src)
    await e.write(ms, d, imm=imm, timeout=30)
    await peer.wait(imm=imm)
    assert await peer.digest("dst", 0, size) == digest(src)
    await streams_open(e)  # every stream's connection (each gets its send buffer)


async def test_same_host_connections_get_a_fixed_send_buffer() -> None:
    async with spawn_peer("tcp", same_host=None) as peer:
        e = peer.engine
        k = e.domains.streams  # a listener and a connection per stream
        assert e.stats()["tcp_buffers_set"] == k  # the listeners on lo, at open
        await _write_and_check(peer, e, 71)
        await streams_open(e)
        accepted, active = engine_sockets(e, peer.address)
        assert accepted and active, (accepted, active)
        assert set(accepted) == set(active) == {kernel_sndbuf(_AUTO)}
        assert e.stats()["tcp_buffers_set"] == 2 * k  # + the connections to the peer
        # the peer set its own: its listeners (the connections they accepted inherited it)
        assert (await peer.stats())["tcp_buffers_set"] == k
        await _write_and_check(peer, e, 72)
        assert e.stats()["tcp_buffers_set"] == 2 * k  # once per connection


async def test_zero_leaves_the_kernel_autotuning() -> None:
    async with spawn_peer("tcp", same_host=None, tcp_send_buffer=0) as peer:
        e = peer.engine
        await _write_and_check(peer, e, 73)
        _, active = engine_sockets(e, peer.address)
        assert active and kernel_sndbuf(_AUTO) not in active
        assert e.stats()["tcp_buffers_set"] == 0


async def test_a_size_applies_to_every_connection() -> None:
    async with spawn_peer("tcp", same_host=None, tcp_send_buffer=96 << 10) as peer:
        e = peer.engine
        await _write_and_check(peer, e, 74)
        accepted, active = engine_sockets(e, peer.address)
        assert set(accepted) | set(active) == {kernel_sndbuf(96 << 10)}


@pytest.mark.parametrize("bad", [-1, 1 << 30, True, 1.5, "1MiB"])
async def test_bad_sizes_are_refused_before_anything_opens(bad: object) -> None:
    with pytest.raises(aiote.InvalidArgument, match="tcp_send_buffer"):
        async with aiote.open_engine(tcp_send_buffer=bad):  # type: ignore[arg-type]
            pass


async def test_sockets_of_the_application_are_never_tuned() -> None:
    """The engine finds libfabric's sockets by walking this process's descriptors; addresses
    alone do not tell them apart: a socket of the application connected over loopback to the
    peer's tcp listener looked like the engine's connection to it, and got its SO_SNDBUF set.
    Only the rail's own sockets (those libfabric watches for it) are tuned now."""
    import socket

    async with spawn_peer("tcp", same_host=None) as peer:
        e = peer.engine
        theirs = [r.address for r in EngineAddress.from_bytes(peer.address).rails]
        assert theirs and all(int.from_bytes(a[:2], "little") == socket.AF_INET for a in theirs)
        # the application's own connections to the peer engine's listeners, made first
        mine = [socket.create_connection((socket.inet_ntoa(a[4:8]), port_of(a)), timeout=10) for a in theirs]
        try:
            before = [s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for s in mine]
            assert all(b != kernel_sndbuf(_AUTO) for b in before), before
            tuned0 = e.stats()["tcp_buffers_set"]
            await _write_and_check(peer, e, 73)  # the engine connects and tunes its connections
            after = [s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for s in mine]
            assert after == before, f"the application's sockets were tuned: {before} -> {after}"
            # the engine's own connections were tuned, and nothing else was counted
            ours = {s.getsockname()[1] for s in mine}
            active = [
                sndbuf for local, remote, sndbuf in tcp_sockets()
                if remote is not None and remote[1] in {port_of(a) for a in theirs} and local[1] not in ours
            ]
            assert active and set(active) == {kernel_sndbuf(_AUTO)}, active
            assert e.stats()["tcp_buffers_set"] - tuned0 == len(active)
        finally:
            for s in mine:
                s.close()
