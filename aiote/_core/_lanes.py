"""Credit lanes: the credits of CUDA-IPC writes published by the writer's GPU stream into memory
the two processes share, instead of a message per write (see ``aio_lane_add`` in
``cdeps/aiote_core.h``).

Without a lane, a write over the CUDA-IPC rail is credited through the host: the copy, a kernel
storing a signal word, the writer's poller seeing it, its event loop, an internal message to
the owner, the owner's poller and its loop. With a lane, the kernel that follows the copy on the
writer's stream also stores the credit (``(imm << 32) | weight``) into the lane and advances its
head; the owner's poller reads the head at its watch interval and credits the counter itself.

- The writer makes the lane (a file in ``/dev/shm``, mapped, and registered with CUDA so that
  a kernel can store into it), one per (device of its copy stream, owner engine), and offers it
  to the owner in one internal message; until the owner has opened it (its ``OPEN`` word), the
  writer credits by messages as before.
- The owner opens the file, unlinks it (both keep their mappings), writes its pid and watches
  the lane. The writer opens a pidfd on that pid: a lane is used only while the owner lives
  (looked at once every 2 ms of writing at most), so that a write to a dead owner falls back
  to the message, which fails as it always did.
- Credits are published in stream order with sequence numbers the writer assigns in the loop
  thread, so the head only grows; an entry is reused only after the owner has credited it
  (``DONE``); a full lane falls back to the message.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import select
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .._native import ffi, lib
from ._errors import AioteError
from ._log import get_logger

if TYPE_CHECKING:
    from ._descriptor import EngineAddress, MemoryDescriptor
    from ._device import Credit, _Backend

__all__ = ["K_LANE", "LaneIn", "LaneOut", "Lanes", "lane_offer", "parse_offer"]

_log = get_logger(component="gpu")

K_LANE = 3  # internal message kind (1: a GPU staging part, 2: a credit)
_OFFER = struct.Struct("<BI32s")  # kind, entries, the name's random part (hex)
_NAME = re.compile(rb"^[0-9a-f]{32}$")
_DIR = "/dev/shm"
ENTRIES = 256
_CHECK_EVERY = 0.002  # seconds between two looks at whether the owner's process lives
# AIOTE_CREDIT_LANES=0: IPC writes are credited by messages only (for comparisons)
_ENABLED = os.environ.get("AIOTE_CREDIT_LANES", "1") != "0"
HEAD, DONE, OPEN, PID, ENTRY = (
    int(lib.AIO_LANE_HEAD), int(lib.AIO_LANE_DONE), int(lib.AIO_LANE_OPEN), int(lib.AIO_LANE_PID),
    int(lib.AIO_LANE_ENTRY),
)


def _path(tag: bytes) -> str:
    return f"{_DIR}/aiote-lane-{tag.decode()}"


def _size(entries: int) -> int:
    return 8 * (ENTRY + entries)


def lane_offer(lane: LaneOut) -> bytes:
    """The internal message that offers ``lane`` to its owner."""
    return _OFFER.pack(K_LANE, lane.entries, lane.tag)


def parse_offer(payload: bytes) -> tuple[bytes, int] | None:
    """(tag, entries) of an offer, or None when malformed."""
    if len(payload) != _OFFER.size:
        return None
    kind, entries, tag = _OFFER.unpack(payload)
    if kind != K_LANE or not _NAME.match(tag) or not 0 < entries <= int(lib.AIO_LANE_MAX):
        return None
    return tag, entries


class LaneOut:
    """The writer's side of a lane: publishes credits from a GPU stream (see the module)."""

    def __init__(self, backend: _Backend, entries: int = ENTRIES) -> None:
        self.b = backend
        self.entries = entries
        self.tag = secrets.token_hex(16).encode()
        self.seq = 0
        self.offered = False
        self._pidfd = -1
        self._dead = False
        self._checked = 0.0
        size = _size(entries)
        fd = os.open(_path(self.tag), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words: np.ndarray = np.frombuffer(self._mm, dtype=np.uint64)
        self._host = int(self.words.ctypes.data)
        try:
            self._dev = backend.map_host(self._host, size)
        except Exception:
            self.close()
            raise

    def _alive(self) -> bool:
        """Whether the owner reads the lane: it opened it and its process lives (a pidfd)."""
        if self._dead or int(self.words[OPEN]) != 1:
            return False
        if self._pidfd < 0:
            try:
                self._pidfd = os.pidfd_open(int(self.words[PID]))
            except (OSError, AttributeError) as exc:  # no pidfd here: never use the lane
                _log.info("credit lane not used: no pidfd", reason=str(exc))
                self._dead = True
                return False
        t = time.monotonic()
        if t - self._checked < _CHECK_EVERY:
            return True
        self._checked = t
        poll = select.poll()  # (select.select refuses descriptors of 1024 and over)
        poll.register(self._pidfd, select.POLLIN)
        if poll.poll(0):  # the owner's process ended
            self._dead = True
            return False
        return True

    def take(self, imm: int, weight: int) -> tuple[int, int, int, int] | None:
        """Reserves the next credit: (entry's device address, entry, head's device address,
        new head) for the kernel that follows the copy, or None (use a message): the owner has
        not opened the lane, is gone, or has not taken the earlier credits yet."""
        if not self._alive() or not 0 < weight < (1 << 32):
            return None
        s = self.seq
        if s - int(self.words[DONE]) >= self.entries:
            return None
        self.seq = s + 1
        entry = self._dev + 8 * (ENTRY + s % self.entries)
        return entry, ((imm & 0xFFFFFFFF) << 32) | weight, self._dev + 8 * HEAD, s + 1

    def untake(self, credit: tuple[int, int, int, int]) -> None:
        """Gives back the entry of ``credit``, the last one :meth:`take` reserved, whose kernel
        was not launched."""
        if self.seq == credit[3]:
            self.seq -= 1

    def close(self, keep_mapped: bool = False) -> None:
        """Unmaps the lane and removes its file (the owner may keep its own mapping).
        ``keep_mapped``: a kernel may still store into it; the mapping is left for good."""
        with contextlib.suppress(OSError):
            os.unlink(_path(self.tag))
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if keep_mapped:
            return
        if self._mm is not None:
            with contextlib.suppress(Exception):
                self.b.unmap_host(self._host)
            del self.words
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


class LaneIn:
    """The owner's side: an opened lane the poller watches (see the module)."""

    def __init__(self, h: Any, tag: bytes, entries: int) -> None:
        path = _path(tag)
        size = _size(entries)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"credit lane of {os.fstat(fd).st_size} bytes, not {size}")
            self._mm: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        self._h = h
        self.words: np.ndarray = np.frombuffer(self._mm, dtype=np.uint64)
        self.words[PID] = os.getpid()
        self.id = int(lib.aio_lane_add(h, ffi.cast("uint64_t*", int(self.words.ctypes.data)), entries))
        if self.id < 0:
            self.words[PID] = 0
            del self.words
            with contextlib.suppress(BufferError):
                self._mm.close()  # nothing reads it: unmapped now, not when collected
            self._mm = None
            raise ValueError(f"cannot watch a credit lane ({self.id})")

    def close(self) -> None:
        """Stops reading the lane (its writer falls back to messages) and unmaps it."""
        if self.id >= 0:
            lib.aio_watch_remove(self._h, self.id)
            self.id = -1
            self.words[OPEN] = 0
        if self._mm is not None:
            del self.words
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


class Lanes:
    """An engine's credit lanes: those it writes through, per (device of the copy stream,
    owner engine), and those peers write into it."""

    def __init__(self, engine: Any, backend: _Backend) -> None:
        self.e = engine
        self.b = backend
        self._out: dict[tuple[int, EngineAddress], LaneOut | None] = {}
        self._in: list[LaneIn] = []
        self._closed = False

    def take(self, device: int, rdesc: MemoryDescriptor, imm: int | None, weight: int) -> Credit | None:
        """The credit of an IPC write from ``device`` to ``rdesc`` published by the write's own
        stream through the owner's lane, or None: credit it by a message. O(1), one
        non-blocking poll of the owner's pidfd."""
        if imm is None:
            return None
        lane = self._out.get((device, rdesc.address))
        return None if lane is None else lane.take(imm, weight)

    def untake(self, device: int, rdesc: MemoryDescriptor, credit: Credit) -> None:
        """Gives back a credit :meth:`take` returned whose kernel was not launched."""
        lane = self._out.get((device, rdesc.address))
        if lane is not None:
            lane.untake(credit)

    async def offer(self, device: int, rdesc: MemoryDescriptor, timeout: float | None, retry: Any) -> None:
        """Makes a lane to ``rdesc``'s owner and offers it (one internal message), once per
        (device, owner); a failure only leaves the credits on messages."""
        key = (device, rdesc.address)
        if not _ENABLED or key in self._out:
            return
        self._out[key] = None
        try:
            lane = LaneOut(self.b)
        except Exception as exc:  # no /dev/shm, or host memory the device cannot map
            _log.info("no credit lane; IPC writes are credited by messages", reason=str(exc))
            return
        self._out[key] = lane
        try:
            await self.e._send_msg(rdesc.address, lane_offer(lane), timeout, retry, internal=True)
        except AioteError as exc:
            _log.info("credit lane not offered", reason=str(exc))

    def open(self, payload: bytes) -> None:
        """A peer's offer (an internal message): opens and watches its lane (not once
        :meth:`close` ran: an offer arriving while the engine closes is dropped)."""
        if self._closed:
            return
        offer = parse_offer(payload)
        if offer is None:
            _log.warning("malformed credit lane offer dropped", length=len(payload))
            return
        try:
            self._in.append(LaneIn(self.e._h, *offer))
        except (OSError, ValueError) as exc:
            _log.warning("credit lane offer not taken", reason=str(exc))

    def close(self, keep_mapped: bool = False) -> None:
        """Stops reading the peers' lanes and closes this engine's own (``keep_mapped``: a
        kernel of this engine may still store into them, see :meth:`LaneOut.close`)."""
        self._closed = True
        for lane_in in self._in:
            lane_in.close()
        self._in.clear()
        for lane in self._out.values():
            if lane is not None:
                lane.close(keep_mapped)
        self._out.clear()
