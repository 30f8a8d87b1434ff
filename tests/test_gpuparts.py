"""The staging messages of GPU writes, fed as bytes (aiote/_core/_gpuparts.py: no engine, no
GPU). The copies and credits they drive are tested end to end in tests/test_gpu_host.py (the
host GPU backend, real processes) and tests/test_gpu.py (CUDA)."""

from __future__ import annotations

import numpy as np

from aiote._core._gpuparts import _PART, PartCounts, pack_part, parse_part, part_refused


def test_a_part_of_pages_and_one_of_ranges_read_back_as_sent() -> None:
    pages = np.array([0, 3 * 4096, 7 * 4096], np.uint64)  # each page's offset in the region
    p = parse_part(pack_part(9, 0xABC, 5, 2, 17, 3, 4096, pages))
    assert p is not None
    assert (p.region_id, p.key, p.op, p.nparts, p.imm, p.weight, p.page) == (9, 0xABC, 5, 2, 17, 3, 4096)
    assert p.ranges.tolist() == [0, 3 * 4096, 7 * 4096]
    pairs = np.array([0, 100, 4096, 8], np.uint64)
    q = parse_part(pack_part(1, 2, 3, 1, None, 1, 0, pairs))
    assert q is not None and q.imm is None and q.page == 0
    assert q.ranges.tolist() == [[0, 100], [4096, 8]]
    bare = parse_part(pack_part(1, 2, 4, 1, 0, 1, 0, np.empty(0, np.uint64)))  # an immediate alone
    assert bare is not None and bare.imm == 0 and len(bare.ranges) == 0


def test_malformed_messages_are_not_parts() -> None:
    good = pack_part(1, 2, 3, 1, None, 1, 0, np.array([0, 8], np.uint64))
    assert parse_part(good[: _PART.size - 1]) is None  # too short for the header
    assert parse_part(good[:-1]) is None  # the body shorter than its count says
    assert parse_part(good + b"\0" * 8) is None  # longer
    assert parse_part(bytes([2]) + good[1:]) is None  # another kind
    assert parse_part(pack_part(1, 2, 3, 0, None, 1, 0, np.array([0, 8], np.uint64))) is None  # no parts


def test_a_part_is_refused_with_a_wrong_key_or_past_the_region() -> None:
    p = parse_part(pack_part(1, 77, 1, 1, None, 1, 4096, np.array([0, 15 * 4096], np.uint64)))  # byte offsets
    assert p is not None
    assert part_refused(p, writable=True, key=77, nbytes=16 * 4096) is None
    assert part_refused(p, writable=True, key=78, nbytes=16 * 4096) == "wrong key"
    assert part_refused(p, writable=False, key=77, nbytes=16 * 4096) == "wrong key"
    assert part_refused(p, writable=True, key=77, nbytes=16 * 4096 - 1) == "past the region"
    r = parse_part(pack_part(1, 77, 1, 1, None, 1, 0, np.array([10, 90, 0, 4], np.uint64)))
    assert r is not None
    assert part_refused(r, writable=True, key=77, nbytes=100) is None
    assert part_refused(r, writable=True, key=77, nbytes=99) == "past the region"
    empty = parse_part(pack_part(1, 77, 1, 1, 5, 1, 0, np.empty(0, np.uint64)))
    assert empty is not None and part_refused(empty, writable=True, key=77, nbytes=0) is None


def test_an_operation_is_complete_at_its_last_part_per_sender() -> None:
    c = PartCounts()
    assert [c.landed(b"a", 1, 3), c.landed(b"b", 1, 2), c.landed(b"a", 1, 3)] == [False, False, False]
    assert len(c) == 2
    assert c.landed(b"a", 1, 3)  # a's third of three
    assert c.landed(b"b", 1, 2)
    assert len(c) == 0  # both forgotten
    assert c.landed(b"a", 2, 1)  # a one-part operation completes at once, leaving nothing
    assert len(c) == 0
