"""Property tests of the wire formats (plain sync tests, no engine, no event loop):
parsing arbitrary or mutated bytes raises nothing but aiote.DescriptorError."""

from __future__ import annotations

import struct
import zlib

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import aiote
from aiote._core._descriptor import (  # the per-NIC entry of a descriptor (no public constructor)
    GpuExtent,
    _RemoteKey,
)

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

providers = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=40)
addresses = st.binary(min_size=1, max_size=64)


@st.composite
def descriptors(draw) -> aiote.MemoryDescriptor:
    length = draw(st.integers(1, 2**40))
    nkeys = draw(st.integers(1, 4))
    keys = tuple(
        _RemoteKey(
            draw(providers),
            draw(addresses),
            draw(st.integers(0, 2**64 - 1 - length)),
            draw(st.integers(0, 2**64 - 1)),
        )
        for _ in range(nkeys)
    )
    kind = draw(st.sampled_from([0, 1]))
    gpu = None
    if kind == 1:  # GPU regions carry their id, backend and (maybe) an IPC handle
        gpu = GpuExtent(
            draw(st.integers(0, 2**64 - 1)),
            draw(st.sampled_from([1, 2])),
            draw(st.binary(max_size=64)),
            draw(st.integers(0, 2**64 - 1)),
            draw(st.booleans()),
        )
    return aiote.MemoryDescriptor(
        length=length,
        access=draw(st.integers(0, 3)),
        device_kind=kind,
        device_id=draw(st.integers(-(2**31), 2**31 - 1)),
        host_id=draw(st.binary(min_size=16, max_size=16)),
        keys=keys,
        gpu=gpu,
    )


@st.composite
def engine_addresses(draw) -> aiote.EngineAddress:
    rails = tuple(aiote.RailAddress(draw(providers), draw(addresses)) for _ in range(draw(st.integers(1, 4))))
    return aiote.EngineAddress(rails, draw(st.binary(min_size=16, max_size=16)))


def _reseal(body: bytes) -> bytes:
    """Gives mutated bytes a valid checksum, so that parsing gets past the CRC."""
    return body + struct.pack("<I", zlib.crc32(body))


def _parse_descriptor(data: bytes) -> None:
    try:
        d = aiote.MemoryDescriptor.from_bytes(data)
    except aiote.DescriptorError:
        return
    # whatever parses must serialize back to exactly the same bytes
    assert bytes(d) == bytes(data)
    assert 1 <= len(d.keys) <= 16 and d.length >= 1


def _parse_address(data: bytes) -> None:
    try:
        a = aiote.EngineAddress.from_bytes(data)
    except aiote.DescriptorError:
        return
    assert bytes(a) == bytes(data)


@SETTINGS
@given(st.binary(max_size=300))
@example(b"")
@example(b"AIOD")
@example(b"AIOD\x01")
@example(b"AIOA\x01\x01" + bytes(16))
def test_arbitrary_bytes_raise_only_descriptor_error(data: bytes) -> None:
    _parse_descriptor(data)
    _parse_address(data)
    # with a valid checksum the parser has to look at the fields themselves
    _parse_descriptor(_reseal(data))
    _parse_address(_reseal(data))
    _parse_descriptor(_reseal(b"AIOD\x01" + data))
    _parse_address(_reseal(b"AIOA\x01" + data))


@SETTINGS
@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers(0, 255))))
def test_non_bytes_raise_descriptor_error(value) -> None:
    for parse in (aiote.MemoryDescriptor.from_bytes, aiote.EngineAddress.from_bytes):
        try:
            parse(value)
        except aiote.DescriptorError:
            pass
        else:
            raise AssertionError(f"{parse.__qualname__} accepted {value!r}")


@SETTINGS
@given(descriptors())
def test_valid_descriptors_round_trip(d: aiote.MemoryDescriptor) -> None:
    raw = bytes(d)
    assert aiote.MemoryDescriptor.from_bytes(raw) == d
    assert aiote.MemoryDescriptor.from_bytes(bytearray(raw)) == d
    assert d.remote_write == bool(d.access & 1) and d.remote_read == bool(d.access & 2)
    assert d.address.rails == tuple(aiote.RailAddress(k.provider, k.address) for k in d.keys)


@SETTINGS
@given(engine_addresses())
def test_valid_engine_addresses_round_trip(a: aiote.EngineAddress) -> None:
    assert aiote.EngineAddress.from_bytes(bytes(a)) == a


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
        st.integers(0, 10_000),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)


def _mutate(raw: bytes, ops) -> bytes:
    b = bytearray(raw)
    for kind, pos, value in ops:
        if not b:
            break
        i = pos % len(b)
        if kind == "flip":
            b[i] ^= value or 1
        elif kind == "set":
            b[i] = value
        elif kind == "insert":
            b.insert(i, value)
        elif kind == "delete":
            del b[i]
        else:
            del b[i:]
    return bytes(b)


@SETTINGS
@given(descriptors(), mutations, st.booleans())
def test_mutated_descriptors_round_trip_or_raise_descriptor_error(d, ops, reseal: bool) -> None:
    raw = bytes(d)
    data = _mutate(raw, ops)
    if reseal and len(data) >= 4:
        data = _reseal(data[:-4])
    try:
        parsed = aiote.MemoryDescriptor.from_bytes(data)
    except aiote.DescriptorError:
        return
    assert bytes(parsed) == data
    if data == raw:
        assert parsed == d


@SETTINGS
@given(descriptors(), mutations)
def test_mutations_without_a_new_checksum_are_always_caught(d, ops) -> None:
    raw = bytes(d)
    data = _mutate(raw, ops)
    assume(data != raw)
    try:
        aiote.MemoryDescriptor.from_bytes(data)
    except aiote.DescriptorError:
        return
    # CRC-32 detects every burst of up to 32 bits; anything else getting through is a 2**-32 fluke
    raise AssertionError(f"corrupt descriptor accepted: {data.hex()}")


@SETTINGS
@given(engine_addresses(), mutations, st.booleans())
def test_mutated_engine_addresses_round_trip_or_raise_descriptor_error(a, ops, reseal: bool) -> None:
    data = _mutate(bytes(a), ops)
    if reseal and len(data) >= 4:
        data = _reseal(data[:-4])
    _parse_address(data)
