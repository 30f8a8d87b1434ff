"""Bad input: each is refused with a clear aiote.InvalidArgument (or subclass) before anything
is posted: no work request in flight, no completion, the destination untouched."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest
from _util import nothing_posted, pattern, zeros

import aiote

pytestmark = pytest.mark.anyio

SIZE = 4096


@dataclass
class Setup:
    a: aiote.Engine
    b: aiote.Engine
    src: np.ndarray
    dst: np.ndarray
    ms: aiote.MemoryRegion
    md: aiote.MemoryRegion


@pytest.fixture
async def s(aiote_engine_pair) -> AsyncIterator[Setup]:
    a, b = aiote_engine_pair
    src = pattern(SIZE, seed=99)
    dst = zeros(SIZE)
    ms = await a.register(src)
    md = await b.register(dst)
    yield Setup(a, b, src, dst, ms, md)


async def _refused(s: Setup, exc: type[Exception], coro_fn, match: str | None = None) -> None:
    before = s.a.stats()
    with pytest.raises(exc, match=match):
        await coro_fn()
    nothing_posted(s.a, before)
    assert not s.dst.any(), "the destination was modified"
    assert s.b.imm_counter(1).total == 0


async def test_valid_write_works_on_this_setup(s: Setup) -> None:
    # the control case: the same setup with good arguments transfers
    await s.a.write(s.ms, s.md.descriptor, imm=1)
    await s.b.imm_counter(1).wait(1, timeout=30)
    assert np.array_equal(s.src, s.dst)


async def test_unregistered_source(s: Setup) -> None:
    await s.a.unregister(s.ms)
    assert not s.ms.registered
    await _refused(s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, imm=1), "unregistered")
    with pytest.raises(aiote.InvalidArgument, match=r"unregistered.*register the buffer again"):
        s.a.batch().write(s.ms, s.md.descriptor, imm=1)


async def test_region_of_another_engine(s: Setup) -> None:
    # md belongs to b: a cannot use it as a source, nor a region of a third engine
    await _refused(
        s, aiote.InvalidArgument, lambda: s.a.write(s.md, s.md.descriptor, imm=1), "another engine"
    )
    async with aiote.open_engine() as c:
        mc = await c.register(pattern(SIZE))
        await _refused(
            s, aiote.InvalidArgument, lambda: s.a.write(mc, s.md.descriptor, imm=1), "another engine"
        )
        await _refused(s, aiote.InvalidArgument, lambda: s.a.read(mc, s.md.descriptor), "another engine")
    for not_a_region in (s.src, s.md.descriptor, None):
        await _refused(s, aiote.InvalidArgument, lambda r=not_a_region: s.a.write(r, s.md.descriptor, imm=1))


async def test_repeated_call_is_still_validated(s: Setup) -> None:
    # an engine reuses the request of a repeated identical write (a memo): arguments that only
    # compare equal to the memoized ones, a region unregistered since, or another engine's
    # region must still be refused before anything is posted
    await s.a.write(s.ms, s.md.descriptor, length=0, src_offset=1, imm=2)
    await s.a.write_imm(s.md.descriptor, 2)
    await s.b.imm_counter(2).wait(2, timeout=30)
    await _refused(
        s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, length=0, src_offset=True, imm=2)
    )
    await _refused(
        s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, length=0.0, src_offset=1, imm=2)
    )
    await _refused(s, aiote.InvalidArgument, lambda: s.a.write_imm(s.md.descriptor, 2.0))
    await _refused(
        s, aiote.InvalidArgument, lambda: s.b.write(s.ms, s.md.descriptor, length=0, src_offset=1, imm=2)
    )
    await s.a.unregister(s.ms)
    await _refused(
        s,
        aiote.InvalidArgument,
        lambda: s.a.write(s.ms, s.md.descriptor, length=0, src_offset=1, imm=2),
        "unregistered",
    )
    assert s.b.imm_counter(2).total == 2


RANGES = [
    # (length, src_offset, dst_offset, message)
    (SIZE + 1, 0, 0, "past the local region"),
    (1, SIZE, 0, "past the local region"),
    (SIZE, 1, 0, "past the local region"),
    (2, SIZE - 1, 0, "past the local region"),
    (1, 0, SIZE, "past the remote region"),
    (SIZE, 0, 1, "past the remote region"),
    (2, 0, SIZE - 1, "past the remote region"),
    (1, 2**64, 0, None),
    (1, 0, 2**64, None),
    (None, SIZE + 1, 0, None),  # the default length would be negative
    (None, 0, SIZE + 1, None),
]


async def test_ranges_past_either_region(s: Setup) -> None:
    for length, src_offset, dst_offset, match in RANGES:
        await _refused(
            s,
            aiote.InvalidArgument,
            partial(
                s.a.write,
                s.ms,
                s.md.descriptor,
                length=length,
                src_offset=src_offset,
                dst_offset=dst_offset,
                imm=1,
            ),
            match,
        )
        # the same ranges for a READ (remote side = src_offset, local side = dst_offset)
        await _refused(
            s,
            aiote.InvalidArgument,
            partial(
                s.a.read, s.ms, s.md.descriptor, length=length, src_offset=dst_offset, dst_offset=src_offset
            ),
            None if match is None else "past the",
        )
        with pytest.raises(aiote.InvalidArgument):
            s.a.batch().write(
                s.ms, s.md.descriptor, length=length, src_offset=src_offset, dst_offset=dst_offset
            )


BAD_INTS = [-1, -SIZE, 1.0, 0.5, "8", b"8", True, [8]]


@pytest.mark.parametrize("field", ["src_offset", "dst_offset", "length"])
async def test_bad_offsets_and_lengths(s: Setup, field: str) -> None:
    values = BAD_INTS + ([None] if field != "length" else [])  # length=None is the default: what fits
    for value in values:
        kw = {"length": 8, "src_offset": 0, "dst_offset": 0, field: value}
        await _refused(
            s, aiote.InvalidArgument, lambda kw=kw: s.a.write(s.ms, s.md.descriptor, imm=1, **kw), field
        )
        await _refused(s, aiote.InvalidArgument, lambda kw=kw: s.a.read(s.ms, s.md.descriptor, **kw), field)


async def test_numpy_integers_are_accepted(s: Setup) -> None:
    await s.a.write(
        s.ms,
        s.md.descriptor,
        length=np.int64(8),
        src_offset=np.uint16(8),
        dst_offset=np.int32(16),
        imm=np.uint32(1),
    )
    await s.b.imm_counter(1).wait(1, timeout=30)
    assert np.array_equal(s.dst[16:24], s.src[8:16])
    assert not s.dst[:16].any() and not s.dst[24:].any()
    for imm in (np.int64(0), np.int64(0), 0, np.uint32(0)):  # NumPy imms are never memoized
        await s.a.write_imm(s.md.descriptor, imm)
    await s.b.imm_counter(0).wait(4, timeout=30)


@pytest.mark.parametrize("imm", [-1, 2**32, 2**64, True, False, 1.0, "1"])
async def test_bad_imm(s: Setup, imm) -> None:
    await _refused(
        s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, length=8, imm=imm), "imm"
    )
    await _refused(s, aiote.InvalidArgument, lambda: s.a.write_imm(s.md.descriptor, imm), "imm")


async def test_zero_length_write_without_imm(s: Setup) -> None:
    await _refused(
        s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, length=0), "zero-length"
    )
    # zero by default: the source offset is at the end of the source region
    await _refused(
        s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, src_offset=SIZE), "zero-length"
    )
    await _refused(s, aiote.InvalidArgument, lambda: s.a.write_imm(s.md.descriptor, None), "immediate")


async def test_zero_length_read(s: Setup) -> None:
    await _refused(
        s, aiote.InvalidArgument, lambda: s.a.read(s.ms, s.md.descriptor, length=0), "at least one"
    )


async def test_read_into_read_only_region_is_refused(s: Setup) -> None:
    target = zeros(SIZE)
    target.setflags(write=False)
    mt = await s.a.register(target, remote_write=False)  # fine as a write source...
    remote = await s.b.register(pattern(SIZE, seed=5), remote_write=False)
    before = s.a.stats()
    with pytest.raises(aiote.InvalidArgument, match="read-only"):  # ...but not as a READ target
        await s.a.read(mt, remote.descriptor)
    with pytest.raises(aiote.InvalidArgument, match="read-only"):
        s.a.batch().read(mt, remote.descriptor)
    mb = await s.a.register(bytes(SIZE), remote_write=False)  # immutable bytes
    with pytest.raises(aiote.InvalidArgument, match="read-only"):
        await s.a.read(mb, remote.descriptor)
    nothing_posted(s.a, before)
    assert not target.any(), "a READ wrote into a read-only array"


async def test_register_bad_buffers(s: Setup) -> None:
    before = s.a.stats()
    regions = before["regions"]
    arr = zeros(100)
    with pytest.raises(aiote.InvalidArgument, match="contiguous"):
        await s.a.register(arr[::2])
    with pytest.raises(aiote.InvalidArgument, match="contiguous"):
        await s.a.register(np.zeros((10, 10), np.uint8).T)
    ro = zeros(100)
    ro.setflags(write=False)
    with pytest.raises(aiote.InvalidArgument, match="read-only"):
        await s.a.register(ro)
    with pytest.raises(aiote.InvalidArgument, match="read-only"):
        await s.a.register(b"immutable bytes", remote_write=True)
    with pytest.raises(aiote.InvalidArgument, match="empty"):
        await s.a.register(zeros(0))
    with pytest.raises(aiote.InvalidArgument):
        await s.a.register([1, 2, 3])
    with pytest.raises(aiote.InvalidArgument):
        await s.a.register(None)
    assert s.a.stats()["regions"] == regions
    # read-only memory is fine for a region peers may not write
    mro = await s.a.register(ro, remote_write=False)
    assert mro.registered and not mro.remote_write and not mro.descriptor.remote_write
    mby = await s.a.register(b"immutable bytes", remote_write=False)
    assert mby.nbytes == len(b"immutable bytes")
    assert s.a.stats()["regions"] == regions + 2


async def test_corrupt_descriptor_bytes(s: Setup) -> None:
    good = bytes(s.md.descriptor)
    for pos in range(len(good)):  # every byte: magic, version, fields, rail entries, checksum
        raw = bytearray(good)
        raw[pos] ^= 0x5A
        await _refused(s, aiote.DescriptorError, lambda raw=raw: s.a.write(s.ms, bytes(raw), imm=1))
        with pytest.raises(aiote.DescriptorError):
            aiote.MemoryDescriptor.from_bytes(bytes(raw))


async def test_truncated_descriptor_bytes(s: Setup) -> None:
    raw = bytes(s.md.descriptor)
    for cut in (1, 4, 10, 40, len(raw) - 1):
        await _refused(s, aiote.DescriptorError, lambda cut=cut: s.a.write(s.ms, raw[:-cut], imm=1))
        await _refused(s, aiote.DescriptorError, lambda cut=cut: s.a.write(s.ms, raw[cut:], imm=1))
    await _refused(s, aiote.DescriptorError, lambda: s.a.write(s.ms, raw + b"\x00", imm=1))
    await _refused(s, aiote.DescriptorError, lambda: s.a.write(s.ms, b"", imm=1))
    await _refused(s, aiote.InvalidArgument, lambda: s.a.write(s.ms, raw.hex(), imm=1))  # type: ignore[arg-type]


async def test_descriptor_round_trip(s: Setup) -> None:
    d = s.md.descriptor
    assert aiote.MemoryDescriptor.from_bytes(bytes(d)) == d
    assert aiote.MemoryDescriptor.from_bytes(bytearray(bytes(d))) == d
    assert aiote.MemoryDescriptor.from_bytes(memoryview(bytes(d))) == d
    assert d.length == SIZE
    assert d.remote_write and d.remote_read and not d.on_gpu
    assert bytes(d.address) == s.b.address
    assert not s.md.on_gpu and s.md.buffer is s.dst and s.md.nbytes == SIZE
    with pytest.raises(aiote.DescriptorError):
        aiote.MemoryDescriptor.from_bytes(s.b.address)  # an address is not a descriptor
    with pytest.raises(aiote.DescriptorError):
        aiote.EngineAddress.from_bytes(bytes(d))


async def test_engine_address_round_trip(s: Setup) -> None:
    for e in (s.a, s.b):
        addr = aiote.EngineAddress.from_bytes(e.address)
        assert bytes(addr) == e.address
        assert aiote.EngineAddress.from_bytes(bytes(addr)) == addr
        assert len(addr.rails) == len(e.rails) >= 1
        for ra, rail in zip(addr.rails, e.rails, strict=True):
            assert ra.provider == rail.provider and ra.address == rail.address
    assert s.a.address != s.b.address
    raw = bytearray(s.a.address)
    raw[len(raw) // 2] ^= 1
    with pytest.raises(aiote.DescriptorError):
        aiote.EngineAddress.from_bytes(bytes(raw))
    with pytest.raises(aiote.DescriptorError):
        aiote.EngineAddress.from_bytes(s.a.address[:-1])


async def test_unknown_provider() -> None:
    with pytest.raises(aiote.ProviderError, match="nosuch") as info:
        async with aiote.open_engine(provider="nosuch"):
            pytest.fail("opened an engine on an unknown provider")
    # what to do instead: the providers that work here
    listed = re.search(r"available here: ([a-z_, ]+)", str(info.value))
    assert listed and {"tcp", "shm"} <= set(listed.group(1).replace(" ", "").split(","))
    assert "aiote info" in str(info.value)


async def test_unknown_nic() -> None:
    with pytest.raises(aiote.ProviderError) as info:
        async with aiote.open_engine(nics=["nosuchnic0"]):
            pytest.fail("opened an engine on an unknown NIC")
    assert "nosuchnic0" in str(info.value)


@pytest.mark.parametrize(
    "kw",
    [
        {"provider": ""},
        {"provider": None},
        {"nics": "lo"},
        {"nics": []},
        {"nics": ["lo"] * 17},
        {"max_message_size": -1},
        {"message_slots": 0},
        {"max_in_flight": 1},
        {"spin_us": -1.0},
        {"spin_us": float("nan")},
    ],
)
async def test_bad_open_engine_arguments(kw) -> None:
    with pytest.raises(aiote.InvalidArgument):
        async with aiote.open_engine(**kw):
            pytest.fail(f"opened an engine with {kw}")


@pytest.mark.parametrize("timeout", ["1", float("nan")])
async def test_bad_timeouts_are_invalid_arguments(s: Setup, timeout) -> None:
    await _refused(s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, imm=1, timeout=timeout))
    await _refused(s, aiote.InvalidArgument, lambda: s.a.send(s.b.address, b"x", timeout=timeout))
    with pytest.raises(aiote.InvalidArgument):
        await s.b.recv(timeout=timeout)


async def test_negative_timeout(s: Setup) -> None:
    await _refused(s, aiote.InvalidArgument, lambda: s.a.write(s.ms, s.md.descriptor, imm=1, timeout=-1))
    with pytest.raises(aiote.InvalidArgument):
        await s.b.recv(timeout=-1)
