"""Paged writes (engine.write_paged): any index lists, page sizes and strides, over tcp and
over the automatic same-host path, striped over two NICs; bad input refused before anything
is posted; one credit per page whatever the number of NICs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
from _util import digest, nothing_posted, pattern, snapshot, streams_open, zeros

import aiote
from aiote.testing import PeerProcess, engine_pair

pytestmark = pytest.mark.anyio

PATHS = {
    "tcp": {"same_host": None},
    "auto": {},  # same host: shm where libfabric has it
    "tcp-2nics": {"same_host": None, "nics": ["lo", "lo"]},
}


@pytest.fixture(params=list(PATHS))
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[aiote.Engine, aiote.Engine]]:
    async with engine_pair(**PATHS[request.param]) as p:
        yield p


def expected_after(
    dst: np.ndarray,
    src: np.ndarray,
    ps: int,
    sp: np.ndarray,
    dp: np.ndarray,
    ss: int,
    ds: int,
    so: int,
    do: int,
) -> np.ndarray:
    """What the destination must hold: pages applied in order (a repeated destination keeps
    the last page written to it)."""
    want = dst.copy()
    for s, d in zip(sp.tolist(), dp.tolist(), strict=True):
        want[do + d * ds : do + d * ds + ps] = src[so + s * ss : so + s * ss + ps]
    return want


CASES = [
    # page size, pages, src stride, dst stride, src offset, dst offset, kind
    (1, 257, 1, 3, 0, 0, "reversed"),
    (7, 100, 7, 7, 5, 11, "random"),
    (4096, 64, 4096, 8192, 0, 4096, "random"),
    (65536, 16, 65536 + 4096, 65536, 1, 0, "reversed"),
    (1 << 20, 4, 1 << 20, 2 << 20, 0, 0, "random"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}B-{c[6]}" for c in CASES])
async def test_paged_pages_land_where_the_indices_say(pair, case) -> None:
    a, b = pair
    ps, n, ss, ds, so, do, kind = case
    rng = np.random.default_rng(ps)
    if kind == "reversed":
        sp = np.arange(n)
        dp = np.arange(n)[::-1].copy()
    else:
        sp = rng.integers(0, n, size=n)  # repeats allowed
        dp = rng.permutation(n)  # destinations unique: the result does not depend on order
    src = pattern(so + ss * n + ps, seed=ps)
    dst = zeros(do + ds * n + ps)
    ms, md = await a.register(src), await b.register(dst)
    imm = 0x900 + ps % 97
    await a.write_paged(
        ms,
        md.descriptor,
        page_size=ps,
        src_pages=sp,
        dst_pages=dp,
        src_stride=ss,
        dst_stride=ds,
        src_offset=so,
        dst_offset=do,
        imm=imm,
    )
    c = b.imm_counter(imm)
    await c.wait(n, timeout=30)
    assert c.available == 0  # exactly one credit per page, whatever the NIC count
    assert np.array_equal(dst, expected_after(zeros(len(dst)), src, ps, sp, dp, ss, ds, so, do))
    assert a.stats()["bytes_in_flight"] == 0  # gathered, striped or copied: every byte given back


async def test_paged_repeated_destination_and_lists(pair) -> None:
    a, b = pair
    src = pattern(64 * 100, seed=3)
    dst = zeros(64 * 10)
    ms, md = await a.register(src), await b.register(dst)
    # python lists, repeated source pages, default strides, no imm
    await a.write_paged(ms, md.descriptor, page_size=64, src_pages=[3, 3, 99], dst_pages=[0, 9, 5])
    assert np.array_equal(dst[:64], src[192:256])
    assert np.array_equal(dst[9 * 64 :], src[192:256])
    assert np.array_equal(dst[5 * 64 : 6 * 64], src[99 * 64 :])
    # zero pages: nothing to do
    await streams_open(a)  # (the first contact's openings of other streams, if any, are done)
    before = snapshot(a)
    await a.write_paged(ms, md.descriptor, page_size=64, src_pages=[], dst_pages=[])
    nothing_posted(a, before)


async def test_paged_10000_pages_in_one_call(pair) -> None:
    a, b = pair
    n, ps = 10_000, 1024
    src = pattern(n * ps, seed=5)
    dst = zeros(n * ps)
    ms, md = await a.register(src), await b.register(dst)
    perm = np.random.default_rng(1).permutation(n)
    await a.write_paged(ms, md.descriptor, page_size=ps, src_pages=perm, dst_pages=perm, imm=77)
    await b.imm_counter(77).wait(n, timeout=60)
    assert digest(dst) == digest(src)
    assert b.imm_counter(77).available == 0
    assert a.stats()["bytes_in_flight"] == 0


BAD = [
    ({"src_pages": [0, 1], "dst_pages": [0]}, "must match"),
    ({"src_pages": [0, -1], "dst_pages": [0, 1]}, "negative"),
    ({"src_pages": [0, 1.5], "dst_pages": [0, 1]}, "integers"),
    ({"src_pages": [True, False], "dst_pages": [0, 1]}, "integers"),
    ({"src_pages": ["a"], "dst_pages": [0]}, "integers"),
    ({"src_pages": [[0, 1]], "dst_pages": [[0, 1]]}, "one-dimensional"),
    ({"src_pages": [0, 16], "dst_pages": [0, 1]}, "past the source"),  # src index past the region
    ({"src_pages": [0, 1], "dst_pages": [0, 8]}, "past the destination"),
    ({"src_pages": [0], "dst_pages": [0], "page_size": 0}, "page_size"),
    ({"src_pages": [0], "dst_pages": [4], "page_size": 2048}, "past the destination"),
    ({"src_pages": [15], "dst_pages": [0], "src_offset": 1}, "past the source"),
    ({"src_pages": [0], "dst_pages": [7], "dst_stride": 1024, "dst_offset": 1}, "past the destination"),
    ({"src_pages": [0], "dst_pages": [0], "imm": 1 << 32}, "imm"),
    ({"src_pages": [0], "dst_pages": [0], "src_stride": -1}, "src_stride"),
    ({"src_pages": [1 << 62], "dst_pages": [0]}, "too large"),
]


@pytest.mark.parametrize("kw,match", BAD, ids=[b[1].replace(" ", "-") + str(i) for i, b in enumerate(BAD)])
async def test_paged_bad_input_raises_before_posting(kw, match) -> None:
    async with engine_pair(same_host=None) as (a, b):
        src = pattern(16 * 1024)  # 16 pages of 1 KiB
        dst = zeros(8 * 1024)  # 8 pages
        ms, md = await a.register(src), await b.register(dst)
        args = {"page_size": 1024, **kw}
        before = snapshot(a)
        with pytest.raises(aiote.InvalidArgument, match=match):
            await a.write_paged(ms, md.descriptor, **args)
        nothing_posted(a, before)
        assert not dst.any()
        # the engine is still usable
        await a.write_paged(ms, md.descriptor, page_size=1024, src_pages=[15], dst_pages=[7], imm=1)
        await b.imm_counter(1).wait(1, timeout=10)
        assert np.array_equal(dst[7 * 1024 :], src[15 * 1024 :])


async def test_paged_from_another_process(aiote_peer: PeerProcess) -> None:
    e = aiote_peer.engine
    ps, n = 4096, 200
    dst = zeros(ps * n)
    md = await e.register(dst)
    await aiote_peer.register("src", ps * n, fill="pattern", seed=9)
    sp = list(range(n))
    dp = list(reversed(range(n)))
    await aiote_peer.write_paged("src", md.descriptor, page_size=ps, src_pages=sp, dst_pages=dp, imm=31)
    await e.imm_counter(31).wait(n, timeout=30)
    src = pattern(ps * n, seed=9)
    want = src.reshape(n, ps)[::-1].reshape(-1)
    assert np.array_equal(dst, want)
