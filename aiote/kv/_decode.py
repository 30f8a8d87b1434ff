"""The decode side of the KV flow: admits requests into its own pool, tells the prefill side
where to write, and hands out requests whose KV has fully arrived."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import numpy as np

from .._core._descriptor import EngineAddress
from .._core._engine import Engine
from .._core._errors import AioteError, EngineClosed, InvalidArgument, PeerUnreachable, TransferTimeout
from .._core._log import get_logger
from .._core._memory import MemoryRegion
from .._core._observe import KVRequestObs
from .._core._util import deadline
from . import _proto
from ._layout import KVLayout, PageAllocator
from ._members import LAYOUT_META, POOL_DESCRIPTOR, DecoderRegistration, DecoderRegistry

__all__ = ["DecodeRequest", "DecodeWorker", "RequestFailed"]

_log = get_logger(component="kv.decode")


class RequestFailed(AioteError):
    """A KV request did not complete: cancelled, timed out, or its peer is gone."""


class DecodeRequest:
    """A request admitted by a :class:`DecodeWorker`: its pages in the worker's pool, and
    per-layer readiness. Obtained from :meth:`DecodeWorker.next_request` once every layer
    arrived (or from :meth:`DecodeWorker.admitted` to start layer by layer). Holding one costs
    an event per layer; what its methods raise and cost is stated on each."""

    def __init__(
        self, worker: DecodeWorker, prefill: bytes, rid: int, seq: int, tokens: int, pages: np.ndarray
    ) -> None:
        self._w = worker
        self.prefill = prefill  # the prefill engine that routed it here
        self.rid = rid
        self.seq = seq
        self.tokens = tokens
        self.pages = pages
        self.admitted_at = time.monotonic()
        self.ready_at: float | None = None
        self._layers = [anyio.Event() for _ in range(worker.layout.layers)]
        self._ready = anyio.Event()
        self.error: BaseException | None = None
        self._released_by_prefill = False
        self._done_by_user = False
        self._freed = False
        self._watch_scope = anyio.CancelScope()
        self._obs: KVRequestObs | None = None  # its metrics and span (an observed engine)

    @property
    def ready(self) -> bool:
        """Whether every layer has arrived. O(1), raises nothing."""
        return self._ready.is_set() and self.error is None

    async def layer_ready(self, layer: int, *, timeout: float | None = None) -> None:
        """Waits until layer ``layer`` (K and V, every page) has arrived. Raises
        :class:`RequestFailed` if the request failed, :class:`~aiote.TransferTimeout` after
        ``timeout``, :class:`~aiote.InvalidArgument` for a bad ``layer`` or ``timeout``. No I/O:
        it waits on an event the worker sets."""
        if not 0 <= layer < len(self._layers):
            raise InvalidArgument(f"layer {layer} is out of range")
        with deadline(timeout, f"request {self.rid}: layer {layer}"):
            await self._layers[layer].wait()
        if self.error is not None and not self._layers[layer].is_set():
            raise RequestFailed(f"request {self.rid}: {self.error}")

    async def wait_ready(self, *, timeout: float | None = None) -> None:
        """Waits until every layer arrived; raises :class:`RequestFailed` if it failed,
        :class:`~aiote.TransferTimeout` after ``timeout``. No I/O: it waits on an event the
        worker sets."""
        with deadline(timeout, f"request {self.rid}: waiting for its KV"):
            await self._ready.wait()
        if self.error is not None:
            raise RequestFailed(f"request {self.rid}: {self.error}") from self.error

    def page(self, layer: int, kv: int, i: int) -> np.ndarray:
        """The bytes of the request's ``i``-th page of layer ``layer`` (``kv`` 0: K, 1: V). A view,
        no copy, O(1); IndexError for ``i`` past its pages (``layer`` and ``kv`` are not checked)."""
        return self._w.layout.page(self._w.pool, layer, kv, int(self.pages[i]))

    async def release(self) -> None:
        """Done with the request: its pages go back to the pool as soon as the prefill side
        has confirmed that none of its writes can still land (at once when it already has).
        Costs one checkpoint, plus, when the pages are freed now, O(pages) and two native calls
        per layer (its counters are released); that raises :class:`~aiote.EngineClosed` if the
        engine closed first."""
        self._done_by_user = True
        self._w._maybe_free(self)
        await anyio.lowlevel.checkpoint()

    async def cancel(self) -> None:
        """Cancels the request: the prefill side stops writing it, and its pages are freed
        once every write it had posted has completed (no late write can land in them). Costs one
        message to the prefill side (up to 30 s when it does not answer; then it counts as
        gone, no error); freeing raises as in :meth:`release`."""
        if self.error is None:
            self.error = RequestFailed("cancelled by the decode side")
        self._done_by_user = True
        self._wake_all()
        await self._w._tell(self.prefill, _proto.encode("cancel", rid=self.rid))
        self._w._maybe_free(self)

    def _wake_all(self) -> None:
        for ev in self._layers:
            ev.set()
        self._ready.set()
        self._watch_scope.cancel()  # stop waiting for layers that will not come


class DecodeWorker:
    """A decode worker: joins a prefill server, admits the requests it routes here into
    pages of this worker's pool, and yields them once their KV has fully arrived.

    It joins either the prefill server at ``prefill`` (that engine's address: it sends it its
    pool and layout), or, with ``registry`` (an ``aiote.membership`` group, such as
    ``members.group("kv/decode")``), every prefill server watching that group: it registers
    its engine address, its pool's descriptor (``"kv.pool"``) and its layout (meta
    ``"kv.layout"``), and serves whichever prefill server admits a request here. Leaving
    announces it in the registry (and to each prefill server it served), and the registration
    ends once the requests in flight are done; a worker that dies is dropped by the prefill
    side when its lease expires.

    ``pool``: a NumPy or GPU (CuPy) array of ``layout.pool_bytes`` bytes (registered here; a
    layer of a GPU pool is ready once its pages are in GPU memory), or None for a
    new one. ``kv_timeout``: how long a request's KV may take from admission; after that the
    request fails and is cancelled at the prefill side. ``capacity``: how many requests it
    admits at once (pages permitting). ``failed`` counts the requests that failed here (a
    deadline, a cancellation from either side, the prefill side gone).

    The worker owns the engine's messages (``recv``) while it runs. Leaving (the end of its
    ``async with``) tells the prefill side, which routes no new request here; requests in
    flight are finished first (bounded by ``drain_timeout``).

    Building one raises :class:`~aiote.DescriptorError` for a bad ``prefill`` address,
    :class:`~aiote.InvalidArgument` for a ``pool`` of the wrong size or when neither
    ``prefill`` nor ``registry`` is given (no I/O; a new pool costs ``layout.pool_bytes``).
    Entering registers the pool (:meth:`~aiote.Engine.register`'s cost and errors) and sends
    one message to the prefill side, or registers in ``registry`` (what its registration
    raises, e.g. ``aiote.membership.EtcdUnavailable``).
    """

    def __init__(
        self,
        engine: Engine,
        layout: KVLayout,
        prefill: bytes | None = None,
        *,
        registry: DecoderRegistry | None = None,
        pool: Any = None,
        kv_timeout: float = 60.0,
        capacity: int = 1 << 20,
        drain_timeout: float = 60.0,
    ) -> None:
        if prefill is None and registry is None:
            raise InvalidArgument("a DecodeWorker needs a prefill address or a registry")
        if prefill is not None:
            EngineAddress.from_bytes(prefill)  # DescriptorError early
        self.engine = engine
        self.layout = layout
        self.prefill = prefill
        self.registry = registry
        self.registration: DecoderRegistration | None = None
        self.pool = layout.pool_for(pool)
        self.kv_timeout = kv_timeout
        self.capacity = capacity
        self.drain_timeout = drain_timeout
        self._alloc = PageAllocator(layout.pool_pages)
        self._seq = itertools.count(1)
        self._active_seqs: set[int] = set()
        self._requests: dict[tuple[bytes, int], DecodeRequest] = {}  # by (prefill, rid)
        self._admitted: deque[DecodeRequest] = deque()
        self._admitted_ev = anyio.Event()
        self._ready: deque[DecodeRequest] = deque()
        self._ready_ev = anyio.Event()
        self._mr: MemoryRegion | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._prefills: set[bytes] = set() if prefill is None else {prefill}  # those we serve
        self._gone: set[bytes] = set()  # prefill engines found unreachable
        self._leaving = False
        self._left = anyio.Event()
        self._drained = anyio.Event()
        self.completed = 0
        self.failed = 0

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> DecodeWorker:
        self._mr = await self.engine.register(self.pool)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._serve)
        if self.prefill is not None:
            await self._tell(
                self.prefill,
                _proto.encode("hello", pool=bytes(self._mr.descriptor).hex(), layout=self.layout.to_dict()),
            )
        if self.registry is not None:
            reg = self.registry.register(
                self.engine.address,
                {POOL_DESCRIPTOR: self._mr.descriptor},
                {LAYOUT_META: self.layout.to_dict()},
            )
            try:
                await reg.__aenter__()
            except BaseException:
                self._tg.cancel_scope.cancel()
                await self._tg.__aexit__(None, None, None)
                raise
            self.registration = reg
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self.leave()
                with anyio.move_on_after(self.drain_timeout):
                    while self._requests:
                        ev = self._drained = anyio.Event()
                        await ev.wait()
        finally:
            try:
                if self.registration is not None:
                    await self.registration.__aexit__(None, None, None)
            finally:
                self._tg.cancel_scope.cancel()
                await self._tg.__aexit__(None, None, None)
        return None

    # ------------------------------------------------------------------ the application side

    async def next_request(self, *, timeout: float | None = None) -> DecodeRequest:
        """The next request whose KV has fully arrived (in arrival order). Raises
        :class:`~aiote.TransferTimeout` after ``timeout``. No I/O: a ready request returns at
        once, otherwise it waits on an event."""
        with deadline(timeout, "waiting for a request"):
            while not self._ready:
                ev = self._ready_ev
                await ev.wait()
        return self._ready.popleft()

    async def requests(self) -> AsyncIterator[DecodeRequest]:
        """Every request whose KV has fully arrived, in arrival order; ends once the worker
        is leaving (:meth:`leave`) and every request it had admitted has been handed out.
        Raises nothing of its own; no I/O (it waits on an event between requests)."""
        while True:
            while not self._ready:
                if self._leaving and not any(not r._ready.is_set() for r in self._requests.values()):
                    await self._left.wait()  # the prefill sides and the registry were told
                    return
                ev = self._ready_ev
                await ev.wait()
            yield self._ready.popleft()

    async def leave(self) -> None:
        """Tells the prefill side that this worker takes no new request (requests already
        admitted still arrive and are handed out). Leaving the ``async with`` does it too.
        Idempotent; raises nothing (a prefill side that cannot be reached counts as gone; a
        registry that cannot be reached is logged, the registration still ends with the
        block). Costs one message to each prefill side served, sent to all at once, the first
        time (up to 30 s in all when one does not answer), plus the registry's announcement
        (bounded by its timeout)."""
        if self._leaving:
            await self._left.wait()  # announced (or given up) before the registration may end
            return
        self._leaving = True
        self._ready_ev.set()
        self._ready_ev = anyio.Event()
        try:
            if self.registration is not None:
                # shielded (its put is bounded by the registry's timeout): a cancelled leave
                # must not let the registration end before watchers learnt it was clean
                with anyio.CancelScope(shield=True):
                    try:
                        await self.registration.leave()
                    except AioteError as exc:
                        _log.warning("could not announce leaving in the registry", error=str(exc))
            # every prefill side at once, all bounded together (one that does not answer
            # counts as gone after 30 s)
            bye = _proto.encode("bye")
            with anyio.move_on_after(30):
                async with anyio.create_task_group() as tg:
                    for prefill in list(self._prefills):
                        tg.start_soon(self._tell, prefill, bye)
        finally:
            self._left.set()

    async def admitted(self, *, timeout: float | None = None) -> DecodeRequest:
        """The next admitted request, as soon as it is admitted (to start layer by layer with
        :meth:`DecodeRequest.layer_ready`). Requests taken here are not also returned by
        :meth:`next_request`. Raises :class:`~aiote.TransferTimeout` after ``timeout``; no I/O."""
        with deadline(timeout, "waiting for an admission"):
            while not self._admitted:
                await self._admitted_ev.wait()
        r = self._admitted.popleft()
        r._taken_early = True  # type: ignore[attr-defined]
        return r

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet freed. O(requests), raises nothing."""
        return sum(1 for r in self._requests.values() if not r._freed)

    @property
    def free_pages(self) -> int:
        """Pages of the pool free now. O(1), raises nothing."""
        return self._alloc.free

    # ------------------------------------------------------------------ internals

    async def _tell(self, prefill: bytes, payload: bytes) -> None:
        if prefill in self._gone:
            return
        try:
            await self.engine.send(prefill, payload, timeout=30)
        except (PeerUnreachable, TransferTimeout) as exc:
            self._on_prefill_gone(prefill, exc)
        except EngineClosed:
            pass

    def _on_prefill_gone(self, prefill: bytes, exc: BaseException) -> None:
        """A prefill process is gone: its connections are reset, so none of its writes can
        land any more; every request of it still waiting fails and its pages are free again."""
        if prefill in self._gone:
            return
        self._gone.add(prefill)
        self._prefills.discard(prefill)
        _log.warning("prefill side unreachable; failing its requests", error=str(exc))
        for r in list(self._requests.values()):
            if r.prefill != prefill:
                continue
            if not r._ready.is_set():
                r.error = RequestFailed(f"the prefill side is gone: {exc}")
                r._wake_all()
            r._released_by_prefill = True
            if r.error is not None:
                r._done_by_user = True
            self._maybe_free(r)

    def _release_counters(self, r: DecodeRequest) -> None:
        """Forgets the request's per-layer counters (the watcher's, once it has stopped)."""
        for layer in range(self.layout.layers):
            self.engine._forget_counter(_proto.layer_imm(r.seq, layer))

    def _wake_readers(self) -> None:
        self._ready_ev.set()
        self._ready_ev = anyio.Event()

    def _maybe_free(self, r: DecodeRequest) -> None:
        if r._freed or not (r._released_by_prefill and r._done_by_user):
            return
        r._freed = True
        self._alloc.give(r.pages)
        self._release_counters(r)
        self._active_seqs.discard(r.seq)
        if r in self._admitted:
            self._admitted.remove(r)
        self._requests.pop((r.prefill, r.rid), None)
        if not self._requests:
            self._drained.set()
        self._wake_readers()

    async def _serve(self) -> None:
        assert self._tg is not None
        async for sender, msg in _proto.messages(self.engine):
            if sender != self.prefill and self.registry is None:
                continue  # joined one prefill server: only it routes requests here
            # a message proves the sender lives: one counted gone after a send timed out or
            # failed for a while is served again (its requests of then failed and were freed)
            self._gone.discard(sender)
            t = msg["t"]
            if t == "admit":
                self._prefills.add(sender)
                trace = msg.get("trace")
                trace = trace if isinstance(trace, str) else None
                await self._admit(sender, int(msg["rid"]), int(msg["tokens"]), trace)
            elif t == "released":
                r = self._requests.get((sender, int(msg["rid"])))
                if r is not None:
                    r._released_by_prefill = True
                    if not msg.get("ok", True) and not r._ready.is_set():
                        r.error = r.error or RequestFailed(msg.get("why", "failed at the prefill side"))
                        r._done_by_user = True
                        r._wake_all()
                    self._maybe_free(r)
            elif t == "cancel":
                r = self._requests.get((sender, int(msg["rid"])))
                if r is not None and not r._ready.is_set():
                    r.error = RequestFailed("cancelled by the prefill side")
                    r._done_by_user = True
                    r._wake_all()
                    self._maybe_free(r)

    async def _admit(self, prefill: bytes, rid: int, tokens: int, trace: str | None = None) -> None:
        assert self._tg is not None
        n = self.layout.pages_for(tokens)
        if self._leaving:
            await self._tell(prefill, _proto.encode("reject", rid=rid, why="leaving"))
            return
        pages = self._alloc.take(n) if self.in_flight < self.capacity else None
        if pages is None:
            await self._tell(prefill, _proto.encode("reject", rid=rid, why=f"no room for {n} pages"))
            return
        seq = next(self._seq) & 0xFFFFFF
        while seq == 0 or seq in self._active_seqs:  # 24 bits wrap: skip what is still in use
            seq = next(self._seq) & 0xFFFFFF
        self._active_seqs.add(seq)
        r = DecodeRequest(self, prefill, rid, seq, tokens, pages)
        observer = self.engine.observer
        if observer is not None:  # its span joins the prefill side's trace (`trace`)
            r._obs = observer.kv_request("decode", trace)
            r._obs.set(rid=rid, tokens=tokens)
        self._requests[(prefill, rid)] = r
        self._admitted.append(r)
        self._admitted_ev.set()
        self._admitted_ev = anyio.Event()
        self._tg.start_soon(self._watch_scoped, r)
        with _proto.active(r._obs):
            await self._tell(prefill, _proto.encode("pages", rid=rid, imm=seq, pages=pages.tolist()))

    async def _watch_scoped(self, r: DecodeRequest) -> None:
        with r._watch_scope, _proto.active(r._obs):
            try:
                await self._watch(r)
            finally:
                if r._obs is not None:  # its outcome, and the time from admission to every layer
                    ready = r.ready_at if r.error is None else None
                    why = r.error or RequestFailed("cancelled")  # (no error: the worker left first)
                    outcome = "ok" if ready is not None else _proto.outcome(why)
                    spent = None if ready is None else ready - r.admitted_at
                    r._obs.end(outcome, transfer_s=spent, error=r.error)

    async def _watch(self, r: DecodeRequest) -> None:
        """Waits for every layer of ``r`` (one credit per page of K and of V), layer by layer."""
        per_layer = 2 * len(r.pages)
        deadline = r.admitted_at + self.kv_timeout
        try:
            for layer in range(self.layout.layers):
                if r.error is not None:
                    return
                c = self.engine.imm_counter(_proto.layer_imm(r.seq, layer))
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())) as scope:
                    await c.wait(per_layer)
                if scope.cancelled_caught:
                    raise TransferTimeout(
                        f"layer {layer} did not arrive within kv_timeout={self.kv_timeout:g} s"
                    )
                r._layers[layer].set()
        except (TransferTimeout, EngineClosed) as exc:
            if r.error is None:
                r.error = RequestFailed(f"request {r.rid}: {exc}")
                r._wake_all()
                r._done_by_user = True
                await self._tell(r.prefill, _proto.encode("cancel", rid=r.rid))
                self._maybe_free(r)
            return
        finally:
            if r.error is not None:
                self.failed += 1
            if r._freed:  # freed while this watcher still held a counter
                self._release_counters(r)
        if r.error is not None:
            return
        r.ready_at = time.monotonic()
        # report first: once handed out, the request may be released and the worker leave
        await self._tell(r.prefill, _proto.encode("ready", rid=r.rid, at=r.ready_at))
        if r.error is not None:  # the prefill side went away meanwhile: the request failed
            self.failed += 1
            return
        r._ready.set()
        self.completed += 1
        if not getattr(r, "_taken_early", False):
            if r in self._admitted:
                self._admitted.remove(r)
            self._ready.append(r)
            self._ready_ev.set()
            self._ready_ev = anyio.Event()
