"""Completion handling: the records the native poller pushes (ring + eventfd), drained
on the event loop thread or spun for in the low-latency setting."""

from __future__ import annotations

import time
from typing import Any

from .._native import lib
from ._rails import Rails
from ._util import now
from ._wire import _REC_COUNTER, _REC_GROUP


class Completions(Rails):
    """Completion handling: the poller's records, drained on the loop thread or spun for."""

    # ------------------------------------------------------------------ completion dispatch

    def _on_message(self, rail: int, slot: int, length: int, status: int) -> None:
        """A message arrived in a slot: the messages layer (_inbox.py) takes it."""
        raise NotImplementedError

    def _on_ready(self) -> None:
        if self._closed:
            return
        lib.aio_clear_eventfd(self._h)
        self._drain()

    def _spin_until(self, done: Any, spin_ns: int | None = None, until: float | None = None) -> None:
        """Low-latency mode (``loop_spin_us``, or a wait's own ``spin_ns``): the loop thread
        drives the completion queues itself (``aio_poll_ring``, GIL released: polls for 30 us
        yielding the CPU, then sleeps on the NICs' wait objects) until ``done()`` or the spin
        budget runs out, instead of a hand-off through the ring and the eventfd. Every record
        is dispatched by :meth:`_drain` as usual, which also re-arms the eventfd before the
        loop may sleep. Blocks the event loop for at most the budget, and not past ``until``
        (the wait's deadline on the loop's clock, :func:`now`)."""
        h = self._h
        left = self._loop_spin_ns if spin_ns is None else spin_ns
        if until is not None:
            left = min(left, int((until - now()) * 1e9))
        if left <= 0:
            return
        end = time.perf_counter_ns() + left
        while not self._closed:
            got = lib.aio_poll_ring(h, left)
            self._drain()
            if not got or done():
                return
            left = end - time.perf_counter_ns()
            if left <= 0:
                return

    def _drain(self) -> None:
        h = self._h
        recs = self._recs
        table = self._ops
        while True:
            n = lib.aio_drain(h, recs, 256)
            for i in range(n):
                r = recs[i]
                kind = r.kind
                if kind == _REC_GROUP:
                    op = table.complete(r.token, r.status, r.prov_errno)
                    if op is not None:
                        if op.obs is not None:  # a posted operation observed (see _observe.py)
                            op.obs.done(op)
                        op.event.set()
                elif kind == _REC_COUNTER:
                    c = self._counters.get(r.token)
                    if c is not None:
                        c._serve()
                elif kind == lib.AIO_REC_RECV:
                    self._on_message(r.rail, r.a, r.b, r.status)
                elif kind == lib.AIO_REC_SPACE:
                    self._space.set()
                    self._space = self._event()
                elif kind == lib.AIO_REC_LINK:
                    self._on_link(r.rail, bool(r.a))
                elif kind == lib.AIO_REC_WATCH and self._gpu is not None:
                    self._gpu.on_watch(int(r.token), int(r.a))
            if n == 256:
                continue
            if lib.aio_arm(h):
                continue
            break
