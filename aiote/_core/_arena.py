"""The engine's host arena: shared memory that same-host peers map (see ``aio_engine_set_arena``).

An :class:`Arena` is one memfd, mapped here (``MAP_SHARED``) and published in the engine's
direct-copy table. Same-host peers that attach map it as well, so their writes into and reads
out of regions that lie in it are a ``memcpy`` by their poller thread: no system call and no
copy by this process. It is sparse: only the pages handed out and touched take memory, and a
range that is freed gives its pages back (``MADV_REMOVE``).
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

from .._native import ffi

PAGE = 4096


class Arena:
    """A first-fit allocator of page-aligned ranges of one shared-memory file.

    Thread-safe (ranges are given back by finalizers, on whatever thread the garbage collector
    runs). Raises ``OSError`` from the constructor where memfds cannot be created or mapped.

    A finalizer may run on a thread that holds the lock already (the garbage collector runs
    inside any allocation, ``alloc``'s included), and may land in the middle of a change to the
    free lists: so a finalizer never waits for the lock. It queues the range (``_pending``, a
    deque: appends are atomic) and settles the queue only if the lock is free; whoever releases
    the lock settles what was queued meanwhile (``_settle``)."""

    def __init__(self, size: int) -> None:
        self.size = -(-size // PAGE) * PAGE
        fd = os.memfd_create("aiote-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd  # closed by close(); the engine's core keeps its own duplicate
        self._view: Any = ffi.from_buffer("char[]", self._map)
        self.base = int(ffi.cast("uintptr_t", self._view))
        self._lock = threading.Lock()
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._lens: list[int] = [self.size]
        self._pending: collections.deque[tuple[int, int]] = collections.deque()  # freed, not yet merged
        self._in_use = 0

    @property
    def in_use(self) -> int:
        """Bytes handed out and not yet given back."""
        self._settle()
        return self._in_use

    def close(self) -> None:
        """Closes this process's descriptor of the file (the mapping stays while arrays use it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def alloc(self, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray[Any, Any] | None:
        """A zero-filled array of ``shape`` and ``dtype`` (``nbytes`` bytes) in the arena, or
        None when no free range is large enough. The range returns to the arena when the last
        array using it is gone. O(free ranges)."""
        want = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            self._drain()
            for i, ln in enumerate(self._lens):
                if ln >= want:
                    off = self._starts[i]
                    if ln == want:
                        del self._starts[i], self._lens[i]
                    else:
                        self._starts[i] += want
                        self._lens[i] -= want
                    self._in_use += want
                    break
            else:
                off = -1
        self._settle()  # ranges a finalizer queued while the lock was held
        if off < 0:
            return None
        # views of the returned array keep `flat` alive: numpy collapses a view's base to the
        # first array whose base is not an array, which is `flat` (its base is the mapping)
        flat = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=off)
        weakref.finalize(flat, self._free, off, want)
        out: np.ndarray[Any, Any] = flat.view(dtype).reshape(shape)
        return out

    def _free(self, off: int, ln: int) -> None:
        """A finalizer: never waits for the lock (see the class)."""
        try:
            self._map.madvise(mmap.MADV_REMOVE, off, ln)  # zero pages again, memory given back
        except (OSError, ValueError):  # the mapping is closing with the interpreter
            return
        self._pending.append((off, ln))
        self._settle()

    def _settle(self) -> None:
        """Merges the queued ranges if the lock is free (a holder settles them on release)."""
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Merges the queued ranges into the free lists. Caller holds the lock."""
        while self._pending:
            try:
                off, ln = self._pending.popleft()
            except IndexError:
                return
            self._in_use -= ln
            i = bisect.bisect(self._starts, off)
            if i > 0 and self._starts[i - 1] + self._lens[i - 1] == off:  # merge with the one before
                i -= 1
                self._lens[i] += ln
            else:
                self._starts.insert(i, off)
                self._lens.insert(i, ln)
            if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
                self._lens[i] += self._lens[i + 1]
                del self._starts[i + 1], self._lens[i + 1]
