"""What the GPU side of an engine watches: host words the native poller reads (a GPU stream's
completion word, a credit), a stream's ordered completions (a *line*), and the public
:class:`UvmWatcher` (a word GPU kernels store to, awaited from the event loop).

A line's stream stores a growing sequence number into its word after the work enqueued on it
(``fence``); the poller reports each change (``AIO_REC_WATCH``), and the line runs, in order,
the callbacks whose fence the value passed. Nothing blocks the event loop; nothing here
touches CUDA beyond the backend's ``signal`` and ``close_stream``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from .._native import ffi, lib
from ._errors import AioteError, EngineClosed
from ._log import get_logger
from ._util import check_timeout, now, timeout_error, wait_until

if TYPE_CHECKING:
    from ._device import Credit, _Backend
    from ._gpu import GpuOwner, GpuSupport

__all__ = ["UvmWatcher"]

_log = get_logger(component="gpu")


class _Watch:
    """One host word the native poller reads while armed (``AIO_REC_WATCH`` on a change)."""

    __slots__ = ("addr", "engine", "id", "token")

    def __init__(self, engine: GpuOwner, addr: int, token: int) -> None:
        self.engine = engine
        self.addr = addr
        self.token = token
        self.id = -1

    def arm(self, last: int) -> None:
        """Starts watching (a no-op when watching); a value other than ``last`` is reported."""
        if self.id < 0:
            wid = int(lib.aio_watch_add(self.engine._h, ffi.cast("uint64_t*", self.addr), last, self.token))
            if wid < 0:
                raise AioteError(f"cannot watch a word ({wid}): too many watched words")
            self.id = wid

    def disarm(self) -> None:
        if self.id >= 0:
            lib.aio_watch_remove(self.engine._h, self.id)
            self.id = -1


_WORDS_PER_PAGE = 512
_PROBE_BYTES = 64 << 20  # copies this large tell a line its pace (fixed costs well below theirs)


class SignalWords:
    """Words of pinned host memory a GPU stores to and the native poller reads (a line's
    completions, a UVM watcher's value), handed out one at a time from pages of
    ``_WORDS_PER_PAGE``, and taken back for reuse; the pages live as long as the engine."""

    def __init__(self, backend: _Backend) -> None:
        self.b = backend
        self._pages: list[np.ndarray] = []
        self._free: list[tuple[np.ndarray, int, int]] = []

    def take(self) -> tuple[np.ndarray, int, int]:
        """(host view of one word, host address, device address)."""
        if not self._free:
            page = self.b.pinned(8 * _WORDS_PER_PAGE)
            page[:] = 0
            self._pages.append(page)
            words, host = page.view(np.uint64), int(page.ctypes.data)
            for i in range(_WORDS_PER_PAGE):
                self._free.append((words[i : i + 1], host + 8 * i, self.b.word_address(page, i)))
        return self._free.pop()

    def give(self, word: tuple[np.ndarray, int, int]) -> None:
        self._free.append(word)


class _Line:
    """A stream of the engine and the signal word its completions are reported through.

    ``fence(cb)`` enqueues a store of the next sequence number after the work submitted so
    far; the native poller sees the word change and ``cb`` runs in the loop thread."""

    def __init__(self, gpu: GpuSupport, stream: Any, device: int) -> None:
        self.gpu = gpu
        self.stream = stream
        self.device = device
        self.word = gpu.words.take()
        self.token = next(gpu._tokens)
        self.seq = 0
        self.seen = 0
        self.waiters: deque[tuple[int, Callable[[], None]]] = deque()
        self.watch = _Watch(gpu.e, self.word[1], self.token)
        gpu._lines[self.token] = self
        # when the work enqueued so far should end (monotonic ns), at ``rate`` bytes per ns,
        # learned from a large copy enqueued on an idle line (``_probe``: its fence, start, size)
        self.est_end = 0
        self.rate = 300.0
        self._probe: tuple[int, int, int] | None = None

    @property
    def busy(self) -> bool:
        return bool(self.waiters)

    def expect(self, nbytes: int, alone: bool = True) -> None:
        """Tells the poller when the copy of ``nbytes`` just enqueued (its fence comes next)
        should end, after the work already on this stream (``aio_watch_soon``): it reads the
        completion word finely around then instead of every ``watch_interval_us``. ``alone``:
        the copy waits for nothing but this stream (no caller's stream), so its time tells the
        stream's pace."""
        t = time.monotonic_ns()
        idle = not self.waiters
        start = t if idle else max(t, self.est_end)
        self.est_end = start + int(nbytes / self.rate)
        if idle and alone and nbytes >= _PROBE_BYTES:
            self._probe = (self.seq + 1, t, nbytes)
        ahead = self.est_end - t
        lib.aio_watch_soon(self.gpu.e._h, ahead - ahead // 16 - 20_000, 200_000 + ahead // 4)

    def fence(self, cb: Callable[[], None], credit: Credit | None = None) -> None:
        seq = self.seq + 1
        try:
            # raises: no fence enqueued (a kernel's launch failed). The stream's own stores only
            # where IPC copies use one stream per device (the default): see CudaBackend.signal
            self.gpu.b.signal(self.stream, self.word[2], seq, credit, self.gpu.ipc_streams == 1)
        except BaseException:
            self._probe = None  # its fence never comes
            raise
        self.seq = seq
        self.waiters.append((seq, cb))
        self.watch.arm(self.seen)

    async def wait(self) -> None:
        ev = self.gpu.e._event()
        self.fence(ev.set)
        await ev.wait()

    def on_value(self, v: int) -> None:
        if v > self.seen:
            self.seen = v
        p = self._probe
        if p is not None and self.seen >= p[0]:  # a copy that ran alone: the stream's pace
            self._probe = None
            seen = min(max(p[2] / max(time.monotonic_ns() - p[1], 1), 0.5), 2000.0)
            self.rate = (self.rate + seen) / 2  # (one slow copy does not set the pace alone)
        while self.waiters and self.waiters[0][0] <= self.seen:
            _, cb = self.waiters.popleft()
            try:
                cb()
            except Exception:  # pragma: no cover - a bug; the loop must go on
                _log.exception("GPU completion callback failed")
        if not self.waiters:
            self.watch.disarm()

    def close(self) -> None:
        self.watch.disarm()
        self.gpu._lines.pop(self.token, None)
        self.gpu.b.close_stream(self.stream)


class UvmWatcher:
    """A 64-bit word in host-mapped pinned memory that GPU kernels store to (``bump``) and
    tasks await: ``await watcher.wait_for(v)`` returns once the word holds ``v`` or more,
    ``async for value in watcher`` yields each new value the poller observes (values written
    faster than the poller reads them may be skipped; the last one is always seen).

    ``device_pointer`` is the address a kernel stores to (a ``unsigned long long*``; store with
    ``__threadfence_system()`` before, as the kernel that finishes a layer would), ``host``
    the same word as a NumPy view. Costs nothing while nobody waits; while a task waits the
    native poller reads the word every ``watch_interval_us`` (default 100 µs) instead of
    sleeping, about 5 % of a core. Get one with :meth:`aiote.Engine.uvm_watcher`; ``close()``
    when done (the engine closes its watchers on exit)."""

    def __init__(self, gpu: GpuSupport, initial: int) -> None:
        self._gpu = gpu
        self._word = gpu.words.take()
        self.host: np.ndarray = self._word[0]
        self.host[0] = initial
        self.device_pointer: int = self._word[2]
        self._token = next(gpu._tokens)
        self._watch = _Watch(gpu.e, self._word[1], self._token)
        self._seen = initial
        self._waiters: list[tuple[int, Any]] = []
        self._changed: Any = None
        self._closed = False
        gpu._watchers[self._token] = self

    @property
    def value(self) -> int:
        """The word's current value (read from host memory now). One native atomic load, O(1);
        raises nothing."""
        return int(lib.aio_word_load(ffi.cast("uint64_t*", self._word[1])))

    def _arm(self) -> None:
        if self._closed:
            raise EngineClosed("the watcher is closed")
        self._watch.arm(self._seen)

    def _disarm(self) -> None:
        if not self._waiters and self._changed is None:
            self._watch.disarm()

    def _on_value(self, v: int) -> None:
        self._seen = v
        keep = []
        for want, ev in self._waiters:
            if v >= want:
                ev.set()
            else:
                keep.append((want, ev))
        self._waiters = keep
        if self._changed is not None:
            self._changed.set()

    async def wait_for(self, value: int, *, timeout: float | None = None) -> int:
        """Waits until the word holds ``value`` or more; returns the value seen. Cancellable;
        raises :class:`TransferTimeout` after ``timeout`` and :class:`EngineClosed` when the
        watcher or engine closes, :class:`InvalidArgument` for a bad ``timeout``. A value already
        reached returns after one checkpoint; otherwise the poller reads the word every
        ``watch_interval_us`` until it is reached (see the class)."""
        check_timeout(timeout)
        v = self.value
        if v >= value:
            await anyio.lowlevel.checkpoint()
            return v
        ev = self._gpu.e._event()
        entry = (value, ev)
        self._waiters.append(entry)
        try:
            self._arm()
            if not await wait_until(ev, None if timeout is None else now() + timeout):
                assert timeout is not None
                raise timeout_error("UVM watcher wait", timeout)
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
            self._disarm()
        if self._closed:
            raise EngineClosed("the watcher closed while waiting")
        return max(self._seen, self.value)

    async def __aiter__(self) -> AsyncIterator[int]:
        last = self.value
        yield last
        while True:
            self._changed = self._gpu.e._event()
            try:
                self._arm()
                if self.value == last:
                    await self._changed.wait()
            finally:
                self._changed = None
                self._disarm()
            if self._closed:
                return
            v = self.value
            if v != last:
                last = v
                yield v

    def close(self) -> None:
        """Stops watching and wakes every waiter (with :class:`EngineClosed`). Idempotent;
        raises nothing. O(waiters); the word goes back to the engine for reuse."""
        if self._closed:
            return
        self._closed = True
        for _, ev in self._waiters:
            ev.set()
        if self._changed is not None:
            self._changed.set()
        self._waiters = []
        self._changed = None
        self._disarm()
        self._watch.disarm()
        self._gpu._watchers.pop(self._token, None)
        self._gpu.words.give(self._word)
