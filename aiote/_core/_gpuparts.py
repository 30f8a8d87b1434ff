"""The staging messages of GPU writes, sans-I/O.

A write into a peer's GPU region over the NICs lands in the region's pinned host shadow; the
writer then sends the owner an internal message naming the ranges that landed (a *part* of the
operation). The owner copies them into GPU memory, and once every part of the operation is
there it credits the operation's immediate. This module is that message and that count, with
no engine, no GPU and no I/O: :func:`pack_part` makes the message, :func:`parse_part` reads one
(None when it is malformed), :func:`part_refused` says why a part may not be copied into a
region (its key, its bounds), and :class:`PartCounts` says when an operation's last part has
landed. ``GpuSupport`` (``_gpu.py``) does the copies and the credit."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

# kind, region id, region key, op, parts, flags, imm, weight, page, count
_PART = struct.Struct("<BQQQIBIIQI")
_K_PART = 1
_F_IMM = 1


@dataclass(frozen=True)
class Part:
    """One part of a staged operation: ``ranges`` are the byte offsets of pages of ``page``
    bytes each (``page`` > 0) or an (n, 2) array of (offset, length) (``page`` 0) in the region
    ``region_id`` (whose key the writer gave: ``key``); the operation ``op`` has ``nparts``
    parts, and its immediate ``imm`` (None: none) counts ``weight`` once they all landed."""

    region_id: int
    key: int
    op: int
    nparts: int
    imm: int | None
    weight: int
    page: int
    ranges: np.ndarray


def pack_part(
    region_id: int, key: int, op: int, nparts: int, imm: int | None, weight: int, page: int,
    ranges: np.ndarray,
) -> bytes:
    """The message for one part: ``ranges`` the byte offsets of pages (``page`` > 0) or flat
    (offset, length) pairs (``page`` 0), as unsigned 64-bit integers."""
    count = len(ranges) if page else len(ranges) // 2
    flags = _F_IMM if imm is not None else 0
    head = _PART.pack(_K_PART, region_id, key, op, nparts, flags, imm or 0, weight, page, count)
    return head + ranges.astype("<u8").tobytes()


def parse_part(payload: bytes) -> Part | None:
    """The part in ``payload``; None when it is not a well-formed part message (too short, of
    another kind, no parts, a body of the wrong length). O(ranges)."""
    if len(payload) < _PART.size:
        return None
    kind, rid, key, op, nparts, flags, imm, weight, page, count = _PART.unpack_from(payload)
    body = payload[_PART.size :]
    if kind != _K_PART or nparts == 0 or len(body) != count * (8 if page else 16):
        return None
    vals = np.frombuffer(body, dtype="<u8")
    ranges = vals if page else vals.reshape(-1, 2)
    return Part(rid, key, op, nparts, imm if flags & _F_IMM else None, weight, page, ranges)


def part_refused(part: Part, *, writable: bool, key: int, nbytes: int) -> str | None:
    """Why ``part`` may not be copied into a registered region that is remotely ``writable``,
    whose key is ``key`` and size ``nbytes`` (a wrong key, a range past its end); None when
    it may."""
    if not writable or part.key != key:
        return "wrong key"
    if len(part.ranges):
        if part.page:
            end = int(part.ranges.max()) + part.page
        else:
            end = int((part.ranges[:, 0] + part.ranges[:, 1]).max())
        if end > nbytes:
            return "past the region"
    return None


class PartCounts:
    """The parts still to come of each operation, per (sender, op)."""

    def __init__(self) -> None:
        self._left: dict[tuple[bytes, int], int] = {}

    def landed(self, sender: bytes, op: int, nparts: int) -> bool:
        """One part of ``sender``'s operation ``op`` (of ``nparts``) is in GPU memory: True
        when it was the last (the operation is then forgotten)."""
        k = (sender, op)
        left = self._left.get(k, nparts) - 1
        if left > 0:
            self._left[k] = left
            return False
        self._left.pop(k, None)
        return True

    def __len__(self) -> int:
        return len(self._left)
