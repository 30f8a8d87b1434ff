"""The prefill side of the KV flow: routes requests to live decode workers, and streams each
computed layer of a request to its decoder as one paged write."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import numpy as np

from .._core._descriptor import MemoryDescriptor
from .._core._engine import Engine
from .._core._errors import AioteError, EngineClosed, InvalidArgument, PeerUnreachable, TransferTimeout
from .._core._log import get_logger
from .._core._memory import MemoryRegion
from .._core._observe import KVRequestObs
from .._core._util import deadline
from . import _proto
from ._decode import RequestFailed
from ._layout import KVLayout, PageAllocator
from ._members import LAYOUT_META, POOL_DESCRIPTOR, DecoderEvent, DecoderSource

__all__ = ["DecoderInfo", "LeastLoaded", "PrefillRequest", "PrefillServer", "RoundRobin", "RoutingPolicy"]

_log = get_logger(component="kv.prefill")


class _Expired(RequestFailed):
    """The decoder left the membership without notice."""


@dataclass
class DecoderInfo:
    """A decode worker as the prefill side sees it: ``leaving`` once it announced it leaves
    (its requests in flight finish), ``dead`` once it is found unreachable or dropped from
    the membership without notice (``expired``; its requests in flight fail). A plain
    record: O(1), raises nothing."""

    address: bytes
    desc: MemoryDescriptor
    joined_at: float
    in_flight: set[int] = field(default_factory=set)
    leaving: bool = False
    dead: bool = False
    served: int = 0
    expired: bool = False

    @property
    def live(self) -> bool:
        """Whether new requests may be routed to it. O(1), raises nothing."""
        return not (self.leaving or self.dead)


RoutingPolicy = Callable[[Sequence[DecoderInfo]], DecoderInfo]
"""Picks the decoder of a new request among the live ones (never empty)."""


class RoundRobin:
    """Routing policy: each live decoder in turn. O(1) per pick, raises nothing."""

    def __init__(self) -> None:
        self._n = 0

    def __call__(self, live: Sequence[DecoderInfo]) -> DecoderInfo:
        d = live[self._n % len(live)]
        self._n += 1
        return d


class LeastLoaded:
    """Routing policy: the live decoder with the fewest requests in flight. O(live decoders)
    per pick, raises nothing."""

    def __call__(self, live: Sequence[DecoderInfo]) -> DecoderInfo:
        return min(live, key=lambda d: (len(d.in_flight), d.served))


class PrefillRequest:
    """One request on the prefill side: its pages in the prefill pool (compute the KV into
    them), its decoder, and the layer writes. Obtained from :meth:`PrefillServer.start`.
    What its methods raise and cost is stated on each."""

    def __init__(
        self, server: PrefillServer, rid: int, tokens: int, pages: np.ndarray, decoder: DecoderInfo
    ) -> None:
        self._s = server
        self.rid = rid
        self.tokens = tokens
        self.pages = pages  # in the prefill pool
        self.decoder = decoder
        self.dst_pages: np.ndarray | None = None
        self.seq = 0
        self.started_at = time.monotonic()
        self.granted_at: float | None = None
        self.first_layer_at: float | None = None
        self.last_layer_at: float | None = None
        self.writes_done_at: float | None = None  # when its last layer write completed
        self.kv_complete_at: float | None = None  # reported by the decoder
        self.error: BaseException | None = None
        self.cancelled = False
        self._granted = anyio.Event()
        self._writes = 0
        self._writes_done = anyio.Event()
        self._writes_done.set()
        self._released = False
        self._app_done = False  # finish() or cancel() was called: the prefill pages may go back
        self._pages_back = False
        self._abandoned = False
        self._stranded: list[object] = []  # groups its writes left on a failed link
        self._sent_layers = 0
        self.kv_complete = anyio.Event()
        self._obs: KVRequestObs | None = None  # its metrics and span (an observed engine)

    def page(self, layer: int, kv: int, i: int) -> np.ndarray:
        """The bytes of the request's ``i``-th page of layer ``layer`` in the prefill pool. A
        view, no copy, O(1); IndexError for ``i`` past its pages (``layer`` and ``kv`` are not
        checked)."""
        return self._s.layout.page(self._s.pool, layer, kv, int(self.pages[i]))

    async def send_layer(self, layer: int) -> None:
        """Streams layer ``layer`` (K and V of every page of the request) to the decoder as
        one paged write, and returns once it is posted: the transfer overlaps whatever the
        caller computes next. Raises :class:`RequestFailed` if the request already failed or
        was cancelled (its pages must not be written any more), :class:`~aiote.InvalidArgument`
        for a bad ``layer``. Costs one checkpoint; the paged write
        (:meth:`~aiote.Engine.write_paged`) runs in the server's task group and its errors
        surface in :meth:`finish`."""
        if self.error is not None:
            raise RequestFailed(f"request {self.rid}: {self.error}") from self.error
        if not 0 <= layer < self._s.layout.layers:
            raise InvalidArgument(f"layer {layer} is out of range")
        assert self.dst_pages is not None and self._s._tg is not None
        if self.first_layer_at is None:
            self.first_layer_at = time.monotonic()
        if layer == self._s.layout.layers - 1:
            self.last_layer_at = time.monotonic()
        self._writes += 1
        self._writes_done = anyio.Event()
        self._s._tg.start_soon(self._write_layer, layer)
        await anyio.lowlevel.checkpoint()  # let the write post before the caller computes on

    async def _write_layer(self, layer: int) -> None:
        s = self._s
        lay = s.layout
        assert self.dst_pages is not None and s._mr is not None
        try:
            if self.error is None:
                with s.engine._collect_stranded(self._stranded), _proto.active(self._obs):
                    await s.engine.write_paged(
                        s._mr,
                        self.decoder.desc,
                        page_size=lay.page_bytes,
                        src_pages=lay.layer_indices(self.pages),
                        dst_pages=lay.layer_indices(self.dst_pages),
                        src_offset=layer * lay.layer_bytes,
                        dst_offset=layer * lay.layer_bytes,
                        imm=_proto.layer_imm(self.seq, layer),
                        timeout=s.write_timeout,
                    )
                self._sent_layers += 1
        except PeerUnreachable as exc:
            s._decoder_dead(self.decoder, exc)
        except TransferTimeout as exc:
            if self.error is None:
                self.error = exc
            # the write is still posted: the decoder's pages are not free until it is done
            # (the server's exit may cut this wait short: then nothing is released at all)
            try:
                await exc.settled()
            except BaseException:
                self._abandoned = True
                raise
        except Exception as exc:  # recorded: finish() raises it
            if self.error is None:
                self.error = exc
        finally:
            self._writes -= 1
            if self._writes == 0:
                self.writes_done_at = time.monotonic()
                self._writes_done.set()
                if self.error is not None and not self._abandoned:
                    # the decoder may free its pages; ours wait for finish()/cancel()
                    s._release_soon(self, False)

    async def finish(self, *, timeout: float | None = None) -> None:
        """Waits until every layer write has completed (landed at the decoder), then tells
        the decoder the request's pages can no longer be written. Raises
        :class:`RequestFailed` if a write failed, the decoder left or died, or the request was
        cancelled, :class:`~aiote.TransferTimeout` after ``timeout`` (the request is then
        cancelled). Costs the wait for the posted writes, then one message to the decoder, sent
        in the background."""
        try:
            with deadline(timeout, f"request {self.rid}: finish"):
                await self._writes_done.wait()
        except BaseException:
            # the application gives up on it: released (and pages back) once the writes end
            self._app_done = True
            self.cancelled = True
            if self.error is None:
                self.error = RequestFailed("finish() gave up before the writes completed")
            raise
        if self.error is None and self._sent_layers < self._s.layout.layers:
            self.error = RequestFailed(
                f"finish() after {self._sent_layers} of {self._s.layout.layers} layers; "
                "the request is cancelled"
            )
        self._app_done = True
        if self.error is not None:
            self._s._release_soon(self, False)
            raise RequestFailed(f"request {self.rid}: {self.error}") from self.error
        self._s._release_soon(self, True)

    async def wait_kv_complete(self, *, timeout: float | None = None) -> float:
        """Waits for the decoder's report that the whole KV arrived; returns when it did
        (``time.monotonic()`` of the decoder, the same clock on one host). Raises
        :class:`RequestFailed` if the request failed first, :class:`~aiote.TransferTimeout`
        after ``timeout``. No I/O: it waits on an event."""
        with deadline(timeout, f"request {self.rid}: waiting for the decoder"):
            await self.kv_complete.wait()
        if self.error is not None and self.kv_complete_at is None:
            raise RequestFailed(f"request {self.rid}: {self.error}") from self.error
        assert self.kv_complete_at is not None
        return self.kv_complete_at

    async def cancel(self) -> None:
        """Cancels the request (or, after a failure, declares the application done with it):
        no further layer is written; once the writes already posted completed, the decoder
        is told its pages are free, and the prefill pages go back to the pool. Idempotent;
        does nothing to a request that finished. Raises nothing; costs a shielded wait for the
        writes already posted, then one message to the decoder, sent in the background."""
        if self._app_done and self.error is None:
            return
        self.cancelled = True
        if self.error is None:
            self.error = RequestFailed("cancelled by the prefill side")
        self._app_done = True
        with anyio.CancelScope(shield=True):
            await self._writes_done.wait()
        self._s._release_soon(self, False)

    async def _cancel_from_decoder(self) -> None:
        """The decode side cancelled: stop writing; release once the writes are done (the
        prefill pages wait for the application's finish() or cancel())."""
        with anyio.CancelScope(shield=True):
            await self._writes_done.wait()
        self._s._release_soon(self, False)


class PrefillServer:
    """The prefill side: decode workers join it at run time (``DecodeWorker`` with this
    server's ``engine.address``), and :meth:`start` routes each new request to a live one
    with ``policy`` (:class:`RoundRobin` by default, or :class:`LeastLoaded`, or any callable).

    Decoders join by message (a ``DecodeWorker`` given this server's address), or, with
    ``decoders``, from a membership watch (``aiote.membership``: ``members.watch("kv/decode")``,
    or any :data:`DecoderSource`): a decoder that joins the group starts receiving requests;
    one that announces it leaves gets no new request and finishes those in flight; one that
    vanishes from the group without notice (its lease expired: it crashed or lost etcd for
    longer than its TTL) is never chosen again and its requests in flight fail, as an
    unreachable decoder's do. The watch's own outages change nothing here.

    ``pool``: a NumPy or GPU (CuPy) array of ``layout.pool_bytes`` bytes holding the
    prefill-side KV (registered here), or None for a new host one. ``write_timeout``: the
    deadline of each layer's paged write; ``admit_timeout``: how long a decoder may take to
    answer an admission before the request is routed to another one. The server owns the
    engine's messages while it runs. A decoder that leaves gets no new request; one that dies
    fails its requests in flight (:class:`RequestFailed`), and the others go on.

    Building one raises :class:`~aiote.InvalidArgument` for a ``pool`` of the wrong size (no
    I/O; a new pool costs ``layout.pool_bytes``). Entering registers the pool
    (:meth:`~aiote.Engine.register`'s cost and errors); leaving waits up to 30 s for the writes
    in flight.
    """

    def __init__(
        self,
        engine: Engine,
        layout: KVLayout,
        *,
        pool: Any = None,
        policy: RoutingPolicy | None = None,
        write_timeout: float = 60.0,
        admit_timeout: float = 10.0,
        decoders: DecoderSource | None = None,
    ) -> None:
        self.engine = engine
        self.source = decoders
        self.admit_timeout = admit_timeout
        self.layout = layout
        self.pool = layout.pool_for(pool)
        self.policy: RoutingPolicy = policy if policy is not None else RoundRobin()
        self.write_timeout = write_timeout
        self.decoders: dict[bytes, DecoderInfo] = {}
        self._alloc = PageAllocator(layout.pool_pages)
        self._pages_freed = anyio.Event()
        self._rids = itertools.count(1)
        self._requests: dict[int, PrefillRequest] = {}
        self._joined = anyio.Event()
        self._background = 0  # releases waiting for stranded groups
        self._background_done = anyio.Event()
        self._mr: MemoryRegion | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> PrefillServer:
        self._mr = await self.engine.register(self.pool, remote_write=False, remote_read=False)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._serve)
        if self.source is not None:
            self._tg.start_soon(self._follow, self.source)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            for r in list(self._requests.values()):
                await r._writes_done.wait()
            while self._background:
                ev = self._background_done = anyio.Event()
                await ev.wait()
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        self._tg = None  # later releases skip the messages: the server is gone
        return None

    @property
    def live_decoders(self) -> list[DecoderInfo]:
        """Decoders new requests may go to. A new list, O(decoders); raises nothing."""
        return [d for d in self.decoders.values() if d.live]

    async def wait_for_decoders(self, n: int = 1, *, timeout: float | None = None) -> None:
        """Waits until at least ``n`` decoders are live. Raises :class:`~aiote.TransferTimeout`
        after ``timeout``; no I/O (it waits for join messages the server receives)."""
        with deadline(timeout, f"waiting for {n} decoders"):
            while len(self.live_decoders) < n:
                await self._joined.wait()

    async def start(self, tokens: int, *, timeout: float | None = 30.0) -> PrefillRequest:
        """Admits a request of ``tokens`` tokens: takes pages in the prefill pool (waiting
        for free ones), routes it to a live decoder, which allocates pages in its pool and
        answers where to write. Tries the other decoders when one refuses (no room).
        Raises :class:`RequestFailed` when no decoder could take it before ``timeout``,
        :class:`~aiote.InvalidArgument` for ``tokens`` < 1 or more pages than the pool has.
        Costs one admission message to a decoder and the wait for its answer (at most
        ``admit_timeout``) per try, after waiting for free pages."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InvalidArgument(f"tokens must be an integer >= 1, not {tokens!r}")
        n = self.layout.pages_for(tokens)
        if n > self.layout.pool_pages:
            raise InvalidArgument(f"{tokens} tokens need {n} pages; the pool has {self.layout.pool_pages}")
        observer = self.engine.observer
        obs = observer.kv_request("prefill") if observer is not None else None
        try:
            with anyio.fail_after(timeout) if timeout is not None else nullcontext():
                pages = self._alloc.take(n)
                while pages is None:
                    ev = self._pages_freed
                    await ev.wait()
                    pages = self._alloc.take(n)
                try:
                    return await self._route(tokens, pages, obs)
                except BaseException:
                    self._give(pages)
                    raise
        except BaseException as exc:
            failed = exc
            if isinstance(exc, TimeoutError):
                failed = RequestFailed(f"no decoder took a request of {tokens} tokens within {timeout} s")
            if obs is not None:
                obs.end(_proto.outcome(failed), error=failed)
            if failed is exc:
                raise
            raise failed from None

    async def _route(
        self, tokens: int, pages: np.ndarray, obs: KVRequestObs | None = None
    ) -> PrefillRequest:
        while True:
            live = self.live_decoders
            while not live:
                await self._joined.wait()
                live = self.live_decoders
            d = self.policy(live)
            rid = next(self._rids)
            r = PrefillRequest(self, rid, tokens, pages, d)
            r._obs = obs
            self._requests[rid] = r
            d.in_flight.add(rid)
            granted = False
            try:
                try:
                    trace = obs.traceparent() if obs is not None else None
                    msg = (_proto.encode("admit", rid=rid, tokens=tokens, trace=trace) if trace
                           else _proto.encode("admit", rid=rid, tokens=tokens))
                    with _proto.active(obs):
                        await self.engine.send(d.address, msg, timeout=10)
                except (PeerUnreachable, TransferTimeout) as exc:
                    self._decoder_dead(d, exc)
                with anyio.move_on_after(self.admit_timeout):
                    await r._granted.wait()
                if not r._granted.is_set():  # the decoder does not answer: try another
                    r.error = RequestFailed("the decoder did not answer the admission")
                if r.dst_pages is not None and r.error is None:
                    r.granted_at = time.monotonic()
                    granted = True
                    return r
            finally:
                if not granted:
                    # refused, gone, timed out or cancelled: forget this try (a late answer
                    # is then freed by _forget); the caller gives the pages back once
                    self._requests.pop(rid, None)
                    d.in_flight.discard(rid)
                    if d.leaving and not d.in_flight:
                        self.decoders.pop(d.address, None)
            if isinstance(r.error, RequestFailed) and "no room" in str(r.error):
                await anyio.sleep(0.005)

    def _give(self, pages: np.ndarray) -> None:
        self._alloc.give(pages)
        self._pages_freed.set()
        self._pages_freed = anyio.Event()

    def _release_soon(self, r: PrefillRequest, ok: bool) -> None:
        """Every write of ``r`` completed. Tells the decoder its pages are free and gives the
        prefill pages back (once the application is done with them), after the groups that a
        failover left on a failed link for this request have settled: until then they may
        still land in the decoder's pages, reading ours. That wait runs in the background."""
        if not ok:  # a failed request fails its waiters now, whatever the wait below
            r.kv_complete.set()
        pending = [op for op in r._stranded if not getattr(op, "done", True)]
        if pending and self._tg is not None:
            self._background += 1
            self._tg.start_soon(self._release_after, r, ok, pending)
        else:
            self._release_now(r, ok)

    async def _release_after(self, r: PrefillRequest, ok: bool, ops: list[object]) -> None:
        try:
            await self.engine._settle_all(ops)
            self._release_now(r, ok)
        finally:
            self._background -= 1
            if not self._background:
                self._background_done.set()

    def _release_now(self, r: PrefillRequest, ok: bool) -> None:
        if r._app_done and not r._pages_back:
            r._pages_back = True
            self._give(r.pages)
        if r._released:
            if r.error is not None:  # cancelled at the decode side after a finish: fail waiters
                r.kv_complete.set()
                if r.kv_complete_at is None:
                    self._requests.pop(r.rid, None)
            return
        r._released = True
        if r._obs is not None:
            self._observe_end(r, ok)
        r.decoder.in_flight.discard(r.rid)
        # a decoder dropped by the membership may live on: tell it, so its pages go back
        if r.dst_pages is not None and (r.decoder.expired or not r.decoder.dead) and self._tg is not None:
            why = "" if ok else str(r.error)
            msg = _proto.encode("released", rid=r.rid, ok=ok, why=why)
            self._tg.start_soon(self._tell, r.decoder, msg, r._obs)
        if r.decoder.leaving and not r.decoder.in_flight:
            self.decoders.pop(r.decoder.address, None)
        if r.kv_complete.is_set() or not ok:
            self._requests.pop(r.rid, None)
            r.kv_complete.set()

    def _observe_end(self, r: PrefillRequest, ok: bool) -> None:
        """The request's metrics and span: its outcome, and when every layer was written its
        transfer time (first layer posted to last write completed) and tail (from the last
        layer's send_layer)."""
        assert r._obs is not None
        done, first, last = r.writes_done_at, r.first_layer_at, r.last_layer_at
        transfer = tail = None
        if ok and done is not None and first is not None and last is not None:
            transfer, tail = done - first, done - last
        r._obs.set(rid=r.rid, tokens=r.tokens, layers=r._sent_layers)
        outcome = "ok" if ok else ("cancelled" if r.cancelled else "failed")
        r._obs.end(outcome, transfer_s=transfer, tail_s=tail, error=None if ok else r.error)

    async def _tell(self, d: DecoderInfo, payload: bytes, obs: KVRequestObs | None = None) -> None:
        try:
            with _proto.active(obs):  # the message's span in its request's trace
                await self.engine.send(d.address, payload, timeout=10)
        except (PeerUnreachable, TransferTimeout) as exc:
            self._decoder_dead(d, exc)
        except EngineClosed:
            pass

    async def _forget(self, decoder: bytes, rid: int) -> None:
        """A decoder granted pages to a request already routed elsewhere: free them."""
        with suppress(AioteError):
            msg = _proto.encode("released", rid=rid, ok=False, why="admission timed out")
            await self.engine.send(decoder, msg)

    def _abandoned(self, decoder: bytes, rid: int) -> bool:
        """Whether an admission answer from ``decoder`` for ``rid`` comes for no live try: the
        request was routed elsewhere, or this try already failed (its pages must be freed)."""
        r = self._requests.get(rid)
        return r is None or r.decoder.address != decoder or r.error is not None

    def _decoder_dead(self, d: DecoderInfo, exc: BaseException) -> None:
        if d.dead:
            return
        d.dead = True
        d.expired = isinstance(exc, _Expired)
        _log.warning("decoder unreachable; failing its requests", error=str(exc), in_flight=len(d.in_flight))
        for r in list(self._requests.values()):
            if r.decoder is not d:
                continue
            if r.error is None and not r.kv_complete.is_set():
                r.error = RequestFailed(f"decoder gone: {exc}")
            r._granted.set()
            r.kv_complete.set()
        self.decoders.pop(d.address, None)

    def _add_decoder(self, address: bytes, desc: MemoryDescriptor, layout: KVLayout) -> None:
        if layout != self.layout:
            _log.warning("decoder with another layout refused", layout=str(layout))
            return
        known = self.decoders.get(address)
        if known is not None and known.live and known.desc == desc:
            return  # joined twice (by message and by membership)
        self.decoders[address] = DecoderInfo(address, desc, time.monotonic())
        _log.info("decoder joined", decoders=len(self.live_decoders))
        self._joined.set()
        self._joined = anyio.Event()

    def _decoder_leaving(self, d: DecoderInfo) -> None:
        d.leaving = True
        _log.info("decoder leaving", in_flight=len(d.in_flight))
        for rid in list(d.in_flight):  # admissions it has not answered: route elsewhere
            r = self._requests.get(rid)
            if r is not None and r.dst_pages is None and r.error is None:
                r.error = RequestFailed("decoder leaving")
                r._granted.set()
        if not d.in_flight:
            self.decoders.pop(d.address, None)

    async def _follow(self, source: DecoderSource) -> None:
        """Decoders from a membership watch: joins, announced leaves, and vanished ones."""
        async for ev in source:
            try:
                self._on_member(ev)
            except (KeyError, TypeError, ValueError, AioteError) as exc:  # a bad record: not a decoder
                _log.warning("membership record of a decoder refused", error=f"{type(exc).__name__}: {exc}")

    def _on_member(self, ev: DecoderEvent) -> None:
        m = ev.member
        if ev.joined:
            desc = m.descriptors[POOL_DESCRIPTOR]
            if not isinstance(desc, MemoryDescriptor):
                raise TypeError(f"{POOL_DESCRIPTOR} is not a MemoryDescriptor")
            self._add_decoder(bytes(m.address), desc, KVLayout.from_dict(m.meta[LAYOUT_META]))
            return
        d = self.decoders.get(bytes(m.address))
        if d is None:
            return
        if ev.clean:
            self._decoder_leaving(d)
        else:
            self._decoder_dead(d, _Expired("it left the membership without notice (its lease expired)"))

    async def _serve(self) -> None:
        async for sender, msg in _proto.messages(self.engine):
            t = msg["t"]
            d = self.decoders.get(sender)
            if t == "hello":
                desc = MemoryDescriptor.from_bytes(bytes.fromhex(msg["pool"]))
                self._add_decoder(sender, desc, KVLayout.from_dict(msg["layout"]))
            elif t == "ready":  # also from a decoder already gone from the table (it left)
                r = self._requests.get(int(msg["rid"]))
                if r is not None and r.decoder.address == sender:
                    r.kv_complete_at = float(msg["at"])
                    r.kv_complete.set()
                    r.decoder.served += 1
                    if r._released:
                        self._requests.pop(r.rid, None)
            elif t == "pages" and self._abandoned(sender, int(msg["rid"])):
                # pages granted to a try given up already (admit_timeout, the decoder leaving,
                # or dropped by the membership while it lives on): the decoder must free them
                if self._tg is not None:
                    self._tg.start_soon(self._forget, sender, int(msg["rid"]))
            elif d is None:
                continue
            elif t == "bye":
                self._decoder_leaving(d)
            elif t in ("pages", "reject"):
                r = self._requests.get(int(msg["rid"]))
                if r is None:
                    continue
                if t == "pages":
                    r.dst_pages = np.asarray(msg["pages"], dtype=np.int64)
                    r.seq = int(msg["imm"])
                else:
                    r.error = RequestFailed(f"decoder refused: {msg.get('why')}")
                    if msg.get("why") == "leaving" and not d.leaving:  # its announcement is late
                        self._decoder_leaving(d)
                r._granted.set()
            elif t == "cancel":
                r = self._requests.get(int(msg["rid"]))
                if r is not None:
                    r.cancelled = True
                    if r.error is None:
                        r.error = RequestFailed("cancelled by the decode side")
                    if self._tg is not None:
                        self._tg.start_soon(r._cancel_from_decoder)
