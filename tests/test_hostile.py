"""Hostile input, property-tested on a live engine pair on each route it can take (tcp, the
same-host route, a host arena): every operation either does
exactly what its arguments say or raises InvalidArgument before anything is posted; and a
time-bounded fuzz run of the wire-format parsers. Plain sync tests: the engines live in an
event loop in a background thread (anyio's blocking portal)."""

from __future__ import annotations

import os
import random
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio.from_thread
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiote
from aiote.testing import engine_pair, pattern

SIZE = 4096
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@dataclass
class Rig:
    portal: Any
    a: aiote.Engine
    b: aiote.Engine
    src: np.ndarray
    dst: np.ndarray
    ms: aiote.MemoryRegion
    md: aiote.MemoryRegion

    def completions(self) -> int:
        return int(self.a.stats()["completions"])


@pytest.fixture(scope="module", params=["tcp", "same-host", "arena"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """The pair on each route of the guarantee suite that an engine pair in one process can
    take: tcp (``same_host=None``), the default same-host route (direct copies checked against
    the owner's table), and the same-host route into the owner's host arena (a memcpy)."""
    route = request.param
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(
        engine_pair(**({"same_host": None} if route == "tcp" else {}))
    ) as (a, b):
        src = pattern(SIZE, seed=1)
        dst = b.alloc_host(SIZE) if route == "arena" else np.zeros(SIZE, np.uint8)
        dst[:] = 0
        ms = portal.call(a.register, src)
        md = portal.call(b.register, dst)
        got = a.route(md.descriptor).provider.split(";")[0]
        assert got == ("tcp" if route == "tcp" else "shm"), (route, got)
        # every connection to b open before the first example: otherwise the first valid write
        # opens the second stream in the background, and that zero-byte request's completion
        # would land during a later example that asserts nothing was posted
        portal.call(partial(a.connect, md.descriptor, timeout=30))
        yield Rig(portal, a, b, src, dst, ms, md)


def _int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _py(v: Any) -> Any:
    """NumPy integers as Python ints (the oracle must not overflow where aiote does not)."""
    return int(v) if isinstance(v, np.integer) else v


values = st.one_of(
    st.integers(-(2**65), 2**65),
    st.sampled_from([0, 1, 7, SIZE - 1, SIZE, SIZE + 1, 2**32 - 1, 2**32, 2**63, -1]),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.builds(np.int64, st.integers(-5, SIZE + 5)),
)


def _refused(rig: Rig, call: Any) -> None:
    before = rig.completions()
    with pytest.raises(aiote.InvalidArgument):
        rig.portal.call(call)
    assert rig.completions() == before  # nothing was posted
    assert rig.a.stats()["ops_in_flight"] == 0


@SETTINGS
@given(length=values, src_offset=values, dst_offset=values, imm=values)
def test_write_arguments(rig: Rig, length: Any, src_offset: Any, dst_offset: Any, imm: Any) -> None:
    kw = {"length": length, "src_offset": src_offset, "dst_offset": dst_offset, "imm": imm}
    length, src_offset, dst_offset, imm = (_py(v) for v in (length, src_offset, dst_offset, imm))
    valid = all(_int(v) and v >= 0 for v in (src_offset, dst_offset))
    valid = valid and (length is None or (_int(length) and length >= 0))
    valid = valid and (imm is None or (_int(imm) and 0 <= imm < 2**32))
    if valid:
        n = min(SIZE - src_offset, SIZE - dst_offset) if length is None else length
        valid = n >= 0 and src_offset + n <= SIZE and dst_offset + n <= SIZE and (n > 0 or imm is not None)

    async def call() -> None:
        await rig.a.write(rig.ms, rig.md.descriptor, timeout=10, **kw)

    if not valid:
        _refused(rig, call)
        return
    rig.dst[:] = 0
    rig.portal.call(call)
    assert np.array_equal(rig.dst[dst_offset : dst_offset + n], rig.src[src_offset : src_offset + n])
    assert not rig.dst[:dst_offset].any() and not rig.dst[dst_offset + n :].any()


@SETTINGS
@given(
    page_size=values,
    src_pages=st.one_of(st.lists(values, max_size=6), values),
    dst_pages=st.one_of(st.lists(values, max_size=6), values),
    src_stride=values,
    dst_stride=values,
)
def test_write_paged_arguments(
    rig: Rig, page_size: Any, src_pages: Any, dst_pages: Any, src_stride: Any, dst_stride: Any
) -> None:
    kw = {"page_size": page_size, "src_pages": src_pages, "dst_pages": dst_pages,
          "src_stride": src_stride, "dst_stride": dst_stride}
    page_size, src_stride, dst_stride = (_py(v) for v in (page_size, src_stride, dst_stride))
    if isinstance(src_pages, list):
        src_pages = [_py(v) for v in src_pages]
    if isinstance(dst_pages, list):
        dst_pages = [_py(v) for v in dst_pages]

    async def call() -> None:
        await rig.a.write_paged(rig.ms, rig.md.descriptor, timeout=10, **kw)

    def ok_list(v: Any) -> bool:
        return isinstance(v, list) and all(_int(x) and 0 <= x < 2**62 for x in v)

    valid = _int(page_size) and page_size >= 1 and ok_list(src_pages) and ok_list(dst_pages)
    valid = valid and len(src_pages) == len(dst_pages)
    valid = valid and all(s is None or (_int(s) and s >= 0) for s in (src_stride, dst_stride))
    if valid and src_pages:
        ss = page_size if src_stride is None else src_stride
        ds = page_size if dst_stride is None else dst_stride
        valid = ss * max(src_pages) + page_size <= SIZE and ds * max(dst_pages) + page_size <= SIZE
    if not valid:
        _refused(rig, call)
        return
    rig.dst[:] = 0
    rig.portal.call(call)
    ss = page_size if src_stride is None else src_stride
    ds = page_size if dst_stride is None else dst_stride
    last = {d: s for s, d in zip(src_pages, dst_pages, strict=True)}
    if len(last) == len(dst_pages):  # no repeated destination: the result is exact
        for d, s in last.items():
            assert np.array_equal(rig.dst[d * ds : d * ds + page_size], rig.src[s * ss : s * ss + page_size])


@SETTINGS
@given(targets=st.lists(st.tuples(values, values, values), max_size=4), imm=values)
def test_scatter_arguments(rig: Rig, targets: list[tuple[Any, Any, Any]], imm: Any) -> None:
    ts = [aiote.ScatterTarget(rig.md.descriptor, n, so, do) for n, so, do in targets]

    async def call() -> None:
        await rig.a.scatter(rig.ms, ts, imm=imm, timeout=10)

    imm = _py(imm)

    def fine(n: Any, so: Any, do: Any) -> bool:
        n, so, do = _py(n), _py(so), _py(do)
        if not (_int(so) and _int(do) and min(so, do) >= 0):
            return False
        if n is None:  # as much as fits, as for write
            n = min(SIZE - so, SIZE - do)
        if not (_int(n) and n >= 0):
            return False
        return so + n <= SIZE and do + n <= SIZE and (n > 0 or imm is not None)

    valid = (imm is None or (_int(imm) and 0 <= imm < 2**32)) and all(fine(*t) for t in targets)
    if not valid:
        _refused(rig, call)
        return
    rig.portal.call(call)


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)) :]
        elif op == 2:
            b[rng.randrange(len(b) + 1) : 0] = os.urandom(rng.randint(1, 8))
        elif op == 3 and len(b) > 8:
            i = rng.randrange(len(b) - 4)
            b[i : i + 4] = struct.pack("<I", rng.choice([0, 1, 255, 2**31, 2**32 - 1]))
        else:
            b = bytearray(os.urandom(rng.randint(0, 120)))
    if rng.random() < 0.5 and len(b) >= 4:  # reseal: get past the checksum to the field checks
        b[-4:] = struct.pack("<I", zlib.crc32(bytes(b[:-4])))
    return bytes(b)


def test_fuzz_the_wire_format_parsers_for_a_few_seconds(rig: Rig) -> None:
    seed = int(os.environ.get("AIOTE_FUZZ_SEED", time.time_ns() % 2**32))
    budget = float(os.environ.get("AIOTE_FUZZ_SECONDS", "4"))
    rng = random.Random(seed)
    seeds = [bytes(rig.md.descriptor), bytes(rig.ms.descriptor), rig.a.address, rig.b.address]
    end = time.monotonic() + budget
    runs = parsed = 0
    while time.monotonic() < end:
        raw = _mutate(rng, rng.choice(seeds))
        for parse in (aiote.MemoryDescriptor.from_bytes, aiote.EngineAddress.from_bytes):
            runs += 1
            try:
                obj = parse(raw)
            except aiote.DescriptorError:
                continue
            except Exception as exc:  # pragma: no cover - the failure this test exists for
                name = parse.__qualname__
                raise AssertionError(f"seed {seed}: {name} raised {exc!r} on {raw.hex()}") from exc
            parsed += 1
            assert bytes(obj) == raw or parse(bytes(obj)) == obj, f"seed {seed}: {raw.hex()}"
    assert runs > 1000, runs


@SETTINGS
@given(length=values, src_offset=values, dst_offset=values)
def test_read_arguments(rig: Rig, length: Any, src_offset: Any, dst_offset: Any) -> None:
    kw = {"length": length, "src_offset": src_offset, "dst_offset": dst_offset}
    length, src_offset, dst_offset = (_py(v) for v in (length, src_offset, dst_offset))
    valid = all(_int(v) and v >= 0 for v in (src_offset, dst_offset))
    valid = valid and (length is None or (_int(length) and length >= 0))
    if valid:
        n = min(SIZE - src_offset, SIZE - dst_offset) if length is None else length
        valid = n > 0 and src_offset + n <= SIZE and dst_offset + n <= SIZE
    back = np.zeros(SIZE, np.uint8)

    async def call() -> None:
        mb = await rig.a.register(back)
        try:
            # READ from the peer's region (src) into ours (dst)
            await rig.a.read(mb, rig.md.descriptor, timeout=10, **kw)
        finally:
            await rig.a.unregister(mb)

    if not valid:
        before = rig.completions()
        with pytest.raises(aiote.InvalidArgument):
            rig.portal.call(call)
        assert rig.completions() == before
        return
    rig.dst[:] = rig.src  # the peer's region holds known bytes
    rig.portal.call(call)
    assert np.array_equal(back[dst_offset : dst_offset + n], rig.src[src_offset : src_offset + n])
    assert not back[:dst_offset].any() and not back[dst_offset + n :].any()


@SETTINGS
@given(imm=values, n=st.integers(0, 3))
def test_barrier_and_write_imm_arguments(rig: Rig, imm: Any, n: int) -> None:
    descs = [rig.md.descriptor] * n

    async def barrier() -> None:
        await rig.a.barrier(descs, imm=imm, timeout=10)

    async def write_imm() -> None:
        await rig.a.write_imm(rig.md.descriptor, imm, timeout=10)

    imm_py = _py(imm)
    if not (_int(imm_py) and 0 <= imm_py < 2**32):
        _refused(rig, barrier)
        _refused(rig, write_imm)
        return
    async def forget() -> None:  # credits other examples left for this imm (in the loop's thread)
        rig.b.imm_counter(imm_py).release()

    rig.portal.call(forget)
    rig.portal.call(barrier)
    rig.portal.call(write_imm)

    async def take() -> int:
        c = rig.b.imm_counter(imm_py)
        await c.wait(n + 1, timeout=10)  # exactly one credit each
        return c.available

    assert rig.portal.call(take) == 0
