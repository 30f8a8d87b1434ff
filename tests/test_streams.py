"""Several connections per NIC (``open_engine(streams=N)``): the rails, the validation, small
transfers carrying their own immediate over one stream at a time (as over a single NIC), large
ones split across the streams and counted once, and a peer process on the other end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from _util import digest, frozen, pattern, streams_open, zeros

import aiote
from aiote._core import _fabric
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio

TCP = {"same_host": None}


@asynccontextmanager
async def two_streams() -> AsyncIterator[tuple[aiote.Engine, aiote.Engine]]:
    """Two engines on tcp loopback, two streams each (never shm)."""
    async with aiote.open_engine(streams=2, **TCP) as a, aiote.open_engine(streams=2, **TCP) as b:
        yield a, b


async def regions(a: aiote.Engine, b: aiote.Engine, n: int, *, seed: int) -> tuple[Any, Any, Any, Any]:
    """A patterned source of ``n`` bytes registered with ``a``, a zeroed destination with ``b``."""
    src, dst = pattern(n, seed=seed), zeros(n)
    return src, dst, await a.register(src), await b.register(dst)



async def test_streams_are_rails_of_one_nic() -> None:
    async with aiote.open_engine(nics=["lo"], streams=3, **TCP) as e:
        assert [r.domain for r in e.rails] == ["lo"] * 3
        assert len({r.address for r in e.rails}) == 3  # three endpoints, three connections per peer
        d = e.domains
        assert d.streams == 3 and d.nics == ("lo", "lo", "lo")
    two = 4 if _fabric.usable_cores() >= 16 else 2  # tcp with one NIC: 2 by default (4 on 16 cores)
    async with aiote.open_engine(**TCP) as e:
        assert len(e.rails) == two and e.domains.streams == aiote.default_streams("tcp", ["lo"]) == two
    async with aiote.open_engine(streams=1, **TCP) as e:
        assert len(e.rails) == 1 and e.domains.streams == 1
    async with aiote.open_engine(nics=["lo", "lo"], **TCP) as e:  # several NICs: one each
        assert len(e.rails) == 2 and e.domains.streams == aiote.default_streams("tcp", ["lo", "lo"]) == 1
    assert aiote.default_streams("shm") == aiote.default_streams("verbs", ["mlx5_0"]) == 1
    assert [aiote.default_streams("tcp", ["eth0"], cores=c) for c in (2, 15, 16, 64)] == [2, 2, 4, 4]
    assert aiote.default_streams("tcp", ["eth0", "eth1"], cores=64) == 1


async def test_a_host_of_many_cores_opens_four_tcp_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the process may use 16 cores or more, ``open_engine()`` on tcp with one NIC
    opens four connections per NIC (a poller thread each), and the transfers go over them."""
    monkeypatch.setattr(_fabric, "usable_cores", lambda: 32)
    async with aiote.open_engine(**TCP) as a, aiote.open_engine(**TCP) as b:
        assert a.domains.streams == b.domains.streams == 4 and len(a.rails) == 4
        assert a.stats()["pollers"] == 4
        src = np.arange(1 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        ms, md = await a.register(src), await b.register(dst)
        await a.write(ms, md.descriptor, imm=3)
        await b.imm_counter(3).wait(1, timeout=10)
        assert np.array_equal(src, dst)
        assert len(a.route(md.descriptor).pairs) == 4


@pytest.mark.parametrize("bad", [0, 9, True, 1.5, "2"])
async def test_bad_streams_raise_before_opening(bad: object) -> None:
    with pytest.raises(aiote.InvalidArgument, match="streams"):
        async with aiote.open_engine(streams=bad, **TCP):  # type: ignore[arg-type]
            pass
    with pytest.raises(aiote.InvalidArgument, match="at most 16 rails"):
        async with aiote.open_engine(nics=["lo"] * 5, streams=4, **TCP):
            pass


async def test_small_writes_carry_their_immediate_and_large_ones_are_split_and_counted_once() -> None:
    async with two_streams() as (a, b):
        size = 8 << 20
        src, dst, ms, md = await regions(a, b, size, seed=7)
        assert len(a.route(md.descriptor).pairs) == 2
        # the first transfer to the peer goes whole over the first stream, even a large one
        # (the second connection is not made yet: it opens meanwhile, by a zero-byte write)
        c0 = a.stats()["completions"]
        await a.write(ms, md.descriptor, imm=4)
        await b.imm_counter(4).wait(1, timeout=30)
        assert digest(dst) == digest(src)
        await streams_open(a)
        assert a.stats()["completions"] - c0 == 2  # the write, and the opening of stream 2
        # below stripe_min: one work request each, immediate included (no credit message after
        # it, as a multi-NIC write would send): one completion per write at the writer
        c0 = a.stats()["completions"]
        for k in range(32):
            off = k * 65536
            await a.write(ms, md.descriptor, length=65536, src_offset=off, dst_offset=off, imm=5)
        await b.imm_counter(5).wait(32, timeout=30)
        assert a.stats()["completions"] - c0 == 32
        assert b.imm_counter(5).available == 0 and b.imm_counter(5).total == 32
        assert np.array_equal(dst[: 32 * 65536], src[: 32 * 65536])
        # posted the same way
        t = a.post_write(ms, md.descriptor, length=65536, imm=5)
        await t
        await b.imm_counter(5).wait(1, timeout=30)
        # at or above stripe_min: one piece per stream, then one credit once both landed
        dst[:] = 0
        c0 = a.stats()["completions"]
        await a.write(ms, md.descriptor, length=size, imm=6)
        await b.imm_counter(6).wait(1, timeout=30)
        assert a.stats()["completions"] - c0 == 3  # two pieces and the credit
        assert b.imm_counter(6).available == 0 and b.imm_counter(6).total == 1
        assert digest(dst) == digest(src)
        # a zero-byte immediate, a READ across both streams
        await a.write_imm(md.descriptor, imm=7)
        await b.imm_counter(7).wait(1, timeout=30)
        back = zeros(size)
        mb = await a.register(back)
        await a.read(mb, md.descriptor)
        assert digest(back) == digest(src)


async def test_a_busy_engine_sends_large_writes_whole_over_its_streams() -> None:
    """With as many operations in flight (or ahead in the same batch) as streams, a large
    write is not split: the streams take whole writes in turn, each with its immediate."""
    async with two_streams() as (a, b):
        piece, k = 2 << 20, 8
        src, dst, ms, md = await regions(a, b, piece * k, seed=11)
        await a.write(ms, md.descriptor, length=64)
        await streams_open(a)
        # a batch of k large writes: as many transfers as streams or more, so none is split
        # (not even the first, added while the batch held nothing else): the streams take
        # whole writes in turn, each carrying its immediate, and no credit follows
        c0 = a.stats()["completions"]
        batch = a.batch()
        for i in range(k):
            batch.write(ms, md.descriptor, length=piece, src_offset=i * piece, dst_offset=i * piece, imm=21)
        await batch.submit()
        await b.imm_counter(21).wait(k, timeout=30)
        assert a.stats()["completions"] - c0 == k  # one request each (split: 2 k + credits)
        assert b.imm_counter(21).available == 0 and b.imm_counter(21).total == k
        assert digest(dst) == digest(src)
        # posted one after the other (post_write posts at once): from the third on, both
        # streams are busy and each goes whole
        dst[:] = 0
        c0 = a.stats()["completions"]
        posted = [
            a.post_write(ms, md.descriptor, length=piece, src_offset=i * piece, dst_offset=i * piece, imm=22)
            for i in range(k)
        ]
        for t in posted:
            await t
        await b.imm_counter(22).wait(k, timeout=30)
        assert a.stats()["completions"] - c0 <= 2 * 3 + (k - 2)
        assert b.imm_counter(22).available == 0 and b.imm_counter(22).total == k
        assert digest(dst) == digest(src)


def rails_of(t: aiote.Transfer) -> set[int]:
    """The rails of the requests a posted transfer's group holds (its table's rows)."""
    assert t._op is not None
    return {int(r) for r in t._op.refs[1]["rail"]}


async def test_a_whole_transfer_takes_the_stream_with_the_fewest_bytes_in_flight() -> None:
    """Whole transfers over one NIC's streams go to the stream whose rail has the fewest bytes
    in flight (in turn only among equally loaded ones): with a 32 MiB write held on one stream
    (its peer stopped, so the bytes cannot all leave the socket buffers), the writes after it
    all take the other stream, while the requests of one batch, placed together, take the
    streams in turn; once everything landed, they take the streams in turn again."""
    async with (
        aiote.open_engine(streams=2, stripe_min=64 << 20, **TCP) as e,
        spawn_peer(engine=e, same_host=None, peer_streams=2) as peer,
    ):
        big, small, k = 32 << 20, 4096, 6
        src = pattern(big + k * small, seed=9)
        ms = await e.register(src)
        desc = await peer.register("buf", big + k * small)
        await e.write(ms, desc, length=64)  # the first transfer opens the streams
        await streams_open(e)
        rails = {r.index for r in e.rails}
        assert len(rails) == 2
        async with frozen(peer.pid):
            held = e.post_write(ms, desc, length=big, imm=31)
            (loaded,) = rails_of(held)  # whole, on one stream
            after = [
                e.post_write(ms, desc, length=small, src_offset=big + i * small, dst_offset=big + i * small,
                             imm=32)
                for i in range(k)
            ]
            took = [rails_of(t) for t in after]
            assert all(r == rails - {loaded} for r in took), (loaded, took)
            assert e.stats()["bytes_in_flight"] >= big  # (the counter that placed them)
            # the requests of one batch are placed together, none in flight yet: in turn
            batch = e.batch()
            for i in range(4):
                batch.write(ms, desc, length=small, src_offset=big + i * small, dst_offset=big + i * small,
                            imm=34)
            together = batch.post()
            assert together._op is not None
            dealt = [int(r) for r in together._op.refs[1]["rail"]]
            assert sorted(dealt) == sorted(list(rails) * 2), dealt
        for t in (held, *after, together):
            await t.wait(timeout=60)
        await peer.wait(imm=34, n=4, timeout=30)
        await peer.wait(imm=31, timeout=30)
        await peer.wait(imm=32, n=k, timeout=30)
        assert await peer.digest("buf") == digest(src)
        assert e.stats()["bytes_in_flight"] == 0  # every ended write gave its bytes back
        # nothing in flight now: equal loads, so the streams take transfers in turn
        turn = [e.post_write(ms, desc, length=small, dst_offset=i * small, imm=33) for i in range(2)]
        assert rails_of(turn[0]) | rails_of(turn[1]) == rails
        for t in turn:
            await t.wait(timeout=60)


async def test_streams_to_a_peer_process() -> None:
    async with (
        aiote.open_engine(streams=2, **TCP) as e,
        spawn_peer(engine=e, same_host=None, peer_streams=2) as peer,
    ):
        size = 4 << 20
        src = pattern(size, seed=3)
        ms = await e.register(src)
        desc = await peer.register("buf", size)
        assert len(e.route(desc).pairs) == 2
        assert len((await peer.route(e.address))["pairs"]) == 2
        await e.write(ms, desc, length=64)  # the first transfer opens the streams
        await streams_open(e)
        await e.write(ms, desc, imm=9)  # split across both connections
        await e.write(ms, desc, length=4096, imm=9)  # one of them, immediate included
        await peer.wait(imm=9, n=2)
        assert await peer.digest("buf") == digest(src)



async def test_a_paged_write_as_the_first_contact_opens_the_streams() -> None:
    """A paged write that first reaches the peer goes over one stream while the others open;
    the next one deals its pages over all of them. Data and counts are exact either way."""
    async with two_streams() as (a, b):
        n, ps = 256, 4096
        src, dst, ms, md = await regions(a, b, n * ps, seed=13)
        perm = np.random.default_rng(3).permutation(n)
        # the rails each paged group is posted on (the real attempt runs; this only looks)
        rails_used: list[set[int]] = []
        attempt = a._paged_attempt

        async def looked(*args: Any) -> None:
            rails_used.append(set(args[7]))
            await attempt(*args)

        a._paged_attempt = looked  # type: ignore[method-assign]
        await a.write_paged(ms, md.descriptor, page_size=ps, src_pages=perm, dst_pages=np.arange(n), imm=31)
        assert a.stats()["routes_open"] + a.stats()["routes_opening"] >= 2  # both being opened
        await streams_open(a)
        assert a.stats()["routes_open"] == 2
        await a.write_paged(ms, md.descriptor, page_size=ps, src_pages=perm, dst_pages=np.arange(n), imm=31)
        assert [len(r) for r in rails_used] == [1, 2]  # one stream at first contact, then both
        await b.imm_counter(31).wait(2 * n, timeout=30)
        assert b.imm_counter(31).available == 0
        assert np.array_equal(dst.reshape(n, ps), src.reshape(n, ps)[perm])


async def test_a_batch_settles_how_its_large_writes_go_when_it_is_submitted() -> None:
    """A batch does not know, as a write is added, how many follow: a large write alone in a
    batch is split over the streams (and counted once), but once the batch holds as many
    writes as streams each goes whole, the ones added first included; a batch built while
    the second connection was still opening uses it from the submission after it opened.
    Data and counts are exact each time, and a submission in flight keeps its own rows."""
    async with two_streams() as (a, b):
        piece, k = 2 << 20, 6
        src, dst, ms, md = await regions(a, b, piece * k, seed=17)
        d = md.descriptor

        def rails(batch: aiote.TransferBatch) -> list[int]:
            return [int(r) for r in batch._table[: len(batch)]["rail"]]

        # built at first contact: every write on the one connection open so far
        early = a.batch()
        for i in range(k):
            early.write(ms, d, length=piece, src_offset=i * piece, dst_offset=i * piece, imm=41)
        await early.submit(timeout=30)
        assert len(set(rails(early))) == 1
        await streams_open(a)
        dst[:] = 0
        await early.submit(timeout=30)  # now dealt over both streams, whole writes
        assert sorted(set(rails(early))) == [0, 1] and len(early) == k
        await b.imm_counter(41).wait(2 * k, timeout=30)
        assert b.imm_counter(41).available == 0 and b.imm_counter(41).total == 2 * k
        assert digest(dst) == digest(src)

        # one large write: split over both streams, one credit after it
        grow = a.batch().write(ms, d, length=piece, imm=42)
        c0 = a.stats()["completions"]
        await grow.submit(timeout=30)
        await b.imm_counter(42).wait(1, timeout=30)
        assert len(grow) == 2 and a.stats()["completions"] - c0 == 3  # two pieces, the credit
        # posted (not awaited), then grown: the posted rows stay as they were
        posted = grow.post()
        for i in range(1, k):
            grow.write(ms, d, length=piece, src_offset=i * piece, dst_offset=i * piece, imm=42)
        dst[:] = 0
        await posted
        c0 = a.stats()["completions"]
        await grow.submit(timeout=30)
        assert len(grow) == k and sorted(set(rails(grow))) == [0, 1]
        assert a.stats()["completions"] - c0 == k  # whole writes now, no credit
        await b.imm_counter(42).wait(1 + k, timeout=30)  # the posted one, then k
        assert b.imm_counter(42).available == 0 and b.imm_counter(42).total == 2 + k
        assert digest(dst) == digest(src)


async def test_connect_opens_every_stream_before_the_first_transfer() -> None:
    """``connect`` opens each stream's connection and returns once all are open, touching
    nothing at the peer: the first transfer after it is already split over both."""
    async with two_streams() as (a, b):
        size = 8 << 20
        src, dst, ms, md = await regions(a, b, size, seed=19)
        assert a.stats()["routes_open"] == 0
        c0 = a.stats()["completions"]
        await a.connect(md.descriptor, timeout=30)
        st = a.stats()
        assert st["routes_open"] == 2 and st["routes_opening"] == 0
        assert st["completions"] - c0 == 2  # one zero-byte request per connection
        assert not dst.any() and b.stats()["completions"] == 0  # nothing written, nothing counted
        # the first transfer: one piece per stream and its credit (no connection to wait for)
        c0 = a.stats()["completions"]
        await a.write(ms, bytes(md.descriptor), imm=8)
        await b.imm_counter(8).wait(1, timeout=30)
        assert a.stats()["completions"] - c0 == 3
        assert b.imm_counter(8).total == 1 and digest(dst) == digest(src)
        # everything open: nothing is posted
        c0 = a.stats()["completions"]
        await a.connect(md.descriptor)
        assert a.stats()["completions"] == c0


async def test_connect_to_read_only_regions_and_bad_input() -> None:
    async with two_streams() as (a, b):
        ro = await b.register(pattern(4096, seed=5), remote_write=False)  # reads only: zero-byte READs
        await a.connect(ro.descriptor, timeout=30)
        assert a.stats()["routes_open"] == 2
        sealed = await b.register(zeros(4096), remote_write=False, remote_read=False)
        with pytest.raises(aiote.InvalidArgument, match="neither remote writes nor remote reads"):
            await a.connect(sealed.descriptor)
        with pytest.raises(aiote.DescriptorError):
            await a.connect(b"AIOD" + bytes(8))
        with pytest.raises(aiote.InvalidArgument, match="timeout"):
            await a.connect(ro.descriptor, timeout=-1)
        before = a.stats()["completions"]
        with pytest.raises(aiote.InvalidArgument, match="MemoryDescriptor"):
            await a.connect(42)  # type: ignore[arg-type]
        assert a.stats()["completions"] == before


async def test_connect_to_a_peer_that_never_answers_gives_up_within_connect_timeout() -> None:
    async with aiote.open_engine(retry=aiote.RetryPolicy(connect_timeout=1.0), **TCP) as a:
        async with aiote.open_engine(**TCP) as gone:
            d = (await gone.register(zeros(4096))).descriptor
        with pytest.raises(aiote.PeerUnreachable, match="did not answer"):
            await a.connect(d)
        assert a.stats()["routes_open"] == 0
        with pytest.raises(aiote.TransferTimeout):
            await a.connect(d, timeout=0.2)


async def test_connect_makes_a_connection_that_a_batch_only_took() -> None:
    """A transfer added to a batch at first contact takes the first stream (the batch will
    open it when submitted) and starts opening the second: ``connect`` still makes both."""
    async with two_streams() as (a, b):
        ms, md = await a.register(pattern(4096, seed=23)), await b.register(zeros(4096))
        d = md.descriptor
        batch = a.batch().write(ms, d, length=4096, imm=3)  # not submitted yet
        probed: list[set[int]] = []
        run = a._run

        async def looked(table: Any, refs: Any, timeout: Any, what: str, path: Any = None) -> None:
            if what.startswith("connect"):
                probed.append({int(r) for r in table["rail"]})
            await run(table, refs, timeout, what, path)

        a._run = looked  # type: ignore[method-assign]
        await a.connect(d, timeout=30)
        assert probed and probed[0] == {0, 1}  # both streams, the one the batch took included
        await batch.submit(timeout=30)
        await b.imm_counter(3).wait(1, timeout=30)
        assert b.imm_counter(3).total == 1
