"""Observability of an engine and of the flows built on it: Prometheus metrics
(``prometheus_client``, the ``metrics`` extra) and OpenTelemetry spans (the OpenTelemetry API,
the ``tracing`` extra). Off unless ``open_engine(observe=Observability(...))``: an engine
opened without it has no :class:`Observer`, and its operations pay one ``is None`` test each
(no allocation, no call).

How an operation is observed: :class:`Observer` starts a record when an operation begins
(``_attempts``, the one door of every awaited operation, and ``_post_now`` for posted ones),
the record is handed each group the operation begins (through the ``_GROUPS`` collector of
``_records``), and when the operation ends the record is summed up once: bytes of the groups
that completed without error, the route and NICs of their rows, retries, the outcome. A
record started inside another (an operation's internal messages) is part of it."""

from __future__ import annotations

import contextvars
import functools
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio
import anyio.lowlevel
import numpy as np

from .._native import ffi, lib
from ._errors import AioteError, EngineClosed, InvalidArgument
from ._log import get_logger
from ._metrics import DURATION_BUCKETS, Stats, sink_for
from ._optable import CLOSED_STATUS as _CLOSED_STATUS
from ._optable import _Op
from ._records import _GROUPS, RailInfo
from ._wire import _CREDIT, _completion_error

__all__ = ["FlowCall", "KVRequestObs", "Observability", "Observer", "observed_call"]

# the flow call running in this task (its operations' bytes are added to it)
_CALL: contextvars.ContextVar[FlowCall | None] = contextvars.ContextVar("aiote_obs_call", default=None)
_NOOP = nullcontext()
_clock = time.perf_counter_ns  # (one global read per use on the hot path, not two)
_log = get_logger(component="observe")
_OP_NAMES: dict[str, str] = {}  # an operation's `what` -> its bounded label ("batch of 16" -> "batch")


@dataclass(frozen=True, kw_only=True)
class Observability:
    """What an engine exports (``open_engine(observe=Observability(...))``); None, the default,
    exports nothing. Building one checks nothing and costs nothing; ``open_engine`` checks it
    (:class:`InvalidArgument`, also when a package it needs is not installed)."""

    metrics: bool = True
    """Prometheus metrics (``pip install aiote[metrics]``): the series are added to
    ``registry``, which you serve (``prometheus_client.start_http_server(port, registry=...)``).
    Costs the event-loop thread about 0.7 µs per repeated request or batch in isolation (1.5 µs
    for other operations), and 1 to 1.5 µs of a WriteImm's one-way p50 in a real run, with
    both sides observed (docs/observability.md)."""

    registry: Any = None
    """The ``prometheus_client.CollectorRegistry`` the series go to; None: prometheus_client's
    default ``REGISTRY``. Engines given the same registry share one set of series (their sum),
    so several engines in one process never collide; give each its own registry to see them
    apart."""

    tracing: bool = False
    """OpenTelemetry spans (``pip install aiote[tracing]``) through the global tracer provider
    (``opentelemetry.trace.set_tracer_provider``), unless ``tracer_provider`` is given: one span
    per operation, and spans of the flows' requests and calls."""

    tracer_provider: Any = None
    """The ``TracerProvider`` spans go to; giving one turns ``tracing`` on."""

    spans: str = "traced"
    """Which operations get a span. ``"traced"``: those that start while a sampled span is
    current (the application's own, or a flow's: a KV request, a weights push, an MoE call),
    as children of it; the others cost one context lookup. ``"all"``: every operation, those
    outside any trace as new traces (the provider's sampler decides). A span costs tens of
    microseconds of the OpenTelemetry SDK's time on the event-loop thread, made after the
    operation when the loop is next free: per-operation spans of every operation of a busy
    engine take a good share of the loop (see docs/observability.md)."""

    buckets: tuple[float, ...] = DURATION_BUCKETS
    """The duration histograms' upper bounds in seconds (increasing; ``+Inf`` is added). The
    first engine of a registry sets them for that registry."""

    @property
    def traced(self) -> bool:
        """Whether spans are made (``tracing``, or a ``tracer_provider`` given). O(1)."""
        return self.tracing or self.tracer_provider is not None


def check_observe(observe: Any) -> None:
    """InvalidArgument unless ``observe`` is None or a usable :class:`Observability` (its
    packages importable, its buckets increasing). Imports those packages."""
    if observe is None:
        return
    if not isinstance(observe, Observability):
        raise InvalidArgument(f"observe must be an aiote.Observability, not {type(observe).__name__}")
    b = observe.buckets
    numbers = isinstance(b, tuple) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in b)
    if not numbers or not b or b[0] <= 0 or list(b) != sorted(set(b)):
        raise InvalidArgument("buckets must be a non-empty tuple of increasing positive seconds")
    if observe.spans not in ("traced", "all"):
        raise InvalidArgument(f"spans must be 'traced' or 'all', not {observe.spans!r}")
    if observe.registry is not None and not callable(getattr(observe.registry, "register", None)):
        raise InvalidArgument("registry must be a prometheus_client.CollectorRegistry (or None)")
    if observe.metrics:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise InvalidArgument("metrics need prometheus_client: pip install 'aiote[metrics]'") from None
    if observe.traced:
        try:
            import opentelemetry.trace  # noqa: F401
        except ImportError:
            why = "tracing needs the OpenTelemetry API: pip install 'aiote[tracing]'"
            raise InvalidArgument(why) from None


def _op_name(what: str) -> str:
    name = _OP_NAMES.get(what)
    if name is None:
        if len(_OP_NAMES) >= 1024:
            _OP_NAMES.clear()
        name = _OP_NAMES[what] = what.split(" ", 1)[0]
    return name


def _outcome(exc: BaseException | None) -> str:
    """An exception as a bounded label: "ok", "cancelled", an aiote error class, or "other"."""
    if exc is None:
        return "ok"
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "cancelled"
    return type(exc).__name__ if isinstance(exc, AioteError) else "other"


class _OpRecord:
    """One operation being observed: when it began, the groups it began (each with its refs as
    they were: a group's completion lets go of them), attempts, and where its bytes count.
    Its first group is kept in two slots (``g0``, ``r0``), the others in ``more``: most
    operations begin one, and their end reads it without a list."""

    __slots__ = (
        "attempts", "call", "ended", "exc", "g0", "more", "obs", "parent", "r0", "t0", "t1", "unit", "what",
    )

    # (an observed operation's task has its record as _GROUPS: _begin appends each group to it)
    t1: int  # when it ended, and what it raised: set by Observer._end (not on its fast path)
    exc: BaseException | None
    r0: Any  # (set with g0)

    def __init__(self, obs: Observer, what: str) -> None:
        self.obs = obs
        self.what = what
        self.unit = obs.unit  # bytes of a request of a message (its groups carry no table)
        obs.unit = 0
        obs._started += 1
        self.g0: _Op | None = None
        self.more: list[tuple[_Op, Any]] | None = None
        self.attempts = 1  # (re-posts after a broken connection add to it: Observer.counting)
        self.ended = False
        self.call = _CALL.get()
        tracer = obs._tracer
        self.parent = tracer.parent() if tracer is not None else False  # False: no span
        self.t0 = _clock()

    def tap(self, op: _Op) -> None:
        """A group the operation began (called by ``_begin`` through ``_GROUPS``)."""
        if self.ended:
            return
        if self.g0 is None:
            self.g0 = op
            self.r0 = op.refs
        elif self.more is None:
            self.more = [(op, op.refs)]
        else:
            self.more.append((op, op.refs))

    append = tap

    @property
    def groups(self) -> list[tuple[_Op, Any]]:
        """Every group it began, with its refs as they were, in order."""
        if self.g0 is None:
            return []
        return [(self.g0, self.r0), *(self.more or ())]

    def forget(self) -> None:
        """Lets go of its groups (and their tables, kept until its end was accounted)."""
        self.g0 = self.r0 = self.more = None

    def done(self, op: _Op) -> None:
        """The completion of a posted operation's one group (called by ``_drain``)."""
        err: BaseException | None = None
        if op.status == _CLOSED_STATUS:
            err = EngineClosed(f"{self.what}: the engine closed before the operation completed")
        elif op.status:
            err = _completion_error(op.status, op.prov_errno, self.what)
        self.obs._end(self, err)


class Tries:
    """An operation's attempt, counting its calls (its re-posts after a broken connection:
    ``n`` is 1 plus them), for an operation observed without a record."""

    __slots__ = ("attempt", "n")

    def __init__(self, attempt: Callable[[float | None], Any]) -> None:
        self.attempt = attempt
        self.n = 1

    def __call__(self, t: float | None) -> Any:
        self.n += 1
        return self.attempt(t)


class Observer:
    """What an engine opened with ``observe=`` exports: its operations' metrics and spans, and
    the flows' (:meth:`flow_call`, :meth:`kv_request`). ``engine.observer``; None when the
    engine was opened without ``observe``. Used from the engine's event-loop thread; a scrape
    reads its numbers from any thread."""

    def __init__(self, options: Observability, rails: list[RailInfo], handle: Any) -> None:
        """Raises ImportError when a package the options need is missing (``check_observe``
        has told the caller already)."""
        self.options = options
        self._h = handle
        self._lock = threading.Lock()  # a scrape's native read against the engine's close
        self._routes = tuple(r.provider.split(";")[0] for r in rails)
        self._nics = tuple(r.domain for r in rails)  # (a NIC's streams: its name once each)
        self._tables: dict[int, tuple[np.ndarray, tuple[int, str, tuple[int, ...]]]] = {}
        # a table's (table, the operation's `what`, the run it counts in: see Stats.run)
        self._fast: dict[int, tuple[Any, ...]] = {}
        self._hit_table: Any = None  # the last table counted on the fast path, its `what` and run
        self._hit_what: Any = None
        self._hit_run: Any = None
        self.unit = 0  # the bytes of the message the next send carries (set by _send_msg)
        self._started = 0
        self._ended = 0
        self._msg_credits = 0
        self._final_credits = 0
        self.stats = Stats(options.buckets)
        self._bounds_ns = self.stats.bounds_ns
        self._series: dict[str, dict[str, tuple[list[float], list[float]]]] = {}  # op -> route -> cells
        self._spans: list[tuple[Any, ...]] = []  # operations that ended whose spans are to make
        self._armed = False  # the task of run() was woken for them
        self._ev: Any = None  # what wakes it (None: no such task yet: accounted at once)
        self._event_class: Any = None
        self._sink = sink_for(options.registry, options.buckets) if options.metrics else None
        if self._sink is not None:
            self._sink.attach(self)
        self._tracer: Any = None
        if options.traced:
            from ._tracing import Tracer

            self._tracer = Tracer(options.tracer_provider, every_operation=options.spans == "all")

    @property
    def metrics(self) -> bool:
        """Whether metrics are exported. O(1), raises nothing."""
        return self._sink is not None

    @property
    def tracing(self) -> bool:
        """Whether spans are made. O(1), raises nothing."""
        return self._tracer is not None

    # ------------------------------------------------------------------ the engine's side

    async def _run_as(
        self, rec: _OpRecord, base: Callable[..., Awaitable[Any]], engine: Any = None,
        attempt: Callable[[float | None], Any] | None = None, timeout: float | None = None, retry: Any = None,
    ) -> None:
        """``base(engine, attempt, timeout, retry, what)`` awaited as the operation of ``rec`` (the
        groups it begins are its, and its re-posts: see :meth:`_counting`), which ends with it."""
        token = _GROUPS.set(rec)
        try:
            await base(engine, attempt, timeout, retry, rec.what)
        except BaseException as exc:
            self._leave(rec, token, exc)
            raise
        self._leave(rec, token, None)

    def _enter(self, what: str) -> tuple[_OpRecord, Any]:
        """An operation made in place (a batch's first attempt inline) begins: the groups this
        task begins are its until :meth:`_leave` (give it the token)."""
        rec = _OpRecord(self, what)
        return rec, _GROUPS.set(rec)

    def _leave(self, rec: _OpRecord, token: Any, exc: BaseException | None) -> None:
        """The operation of ``rec`` (:meth:`_enter`, :meth:`_run_as`) ended, raising ``exc``."""
        _GROUPS.reset(token)
        self._end(rec, exc)

    def _start(self, what: str) -> _OpRecord:
        """A record of an operation beginning now."""
        return _OpRecord(self, what)

    def _counting(self, attempt: Callable[[float | None], Any]) -> Callable[[float | None], Any]:
        """``attempt``, to be posted again after a broken connection (``_retry_after``): each
        call counted as a retry of the operation observed in this task, if any."""
        rec = _GROUPS.get()
        if type(rec) is not _OpRecord:
            return attempt

        def again(t: float | None) -> Any:
            rec.attempts += 1
            return attempt(t)

        return again

    def _carry(self, rec: _OpRecord, run: Callable[[], Any]) -> Callable[[], Coroutine[Any, Any, None]]:
        """``run`` (a posted operation's background work) as part of ``rec``, which ends with it."""
        return lambda: self._run_as(rec, lambda *_: run())

    def _end(self, rec: _OpRecord, exc: BaseException | None) -> None:
        """The operation of ``rec`` finished (``exc``: what it raised): its metrics now (well
        under a microsecond for the common case), its span, if it gets one, queued for
        :meth:`_run` to make when the loop is next free (the SDK's tens of microseconds are not
        in the way of the task that awaited it); at once when the engine has no loop task yet."""
        if rec.ended:
            return
        rec.ended = True
        t1 = _clock()
        g = rec.g0
        if exc is None and rec.more is None and rec.parent is False and rec.call is None and g is not None:
            # the common case, kept short: one group of a table seen before, metrics only,
            # counted in the run of its table's series (two additions: see Stats.run); the
            # last table's run at hand (the same request repeated: no lookup)
            refs = rec.r0
            if type(refs) is tuple and len(refs) == 2 and g.status == 0 and g.done:
                table = refs[1]
                if table is self._hit_table and rec.what is self._hit_what:
                    run = self._hit_run
                else:
                    fast = self._fast.get(id(table))
                    run = fast[2] if fast is not None and fast[0] is table and fast[1] is rec.what else None
                    if run is not None:
                        self._hit_table, self._hit_what, self._hit_run = table, rec.what, run
                if run is not None:
                    dt = t1 - rec.t0
                    run[0] += dt
                    run[1 + bisect_left(self._bounds_ns, dt)] += 1
                    if rec.attempts > 1:
                        self.stats.add("aiote_retries", (_op_name(rec.what),), rec.attempts - 1)
                    rec.g0 = None  # (a posted operation's group holds its record: no cycle)
                    return
        rec.t1 = t1
        rec.exc = exc
        self._ended += 1
        nbytes, route, rails = self._summary(rec)
        op = _OP_NAMES.get(rec.what) or _op_name(rec.what)
        if self._sink is not None:
            self._account(rec, op, nbytes, route)
        if rec.call is not None and nbytes:
            rec.call.add(nbytes)
        if rec.parent is not False:  # (False: no span, see Tracer.parent)
            self._spans.append((rec, op, nbytes, route, [self._nics[r] for r in rails]))
            if not self._armed:
                self._armed = True
                if self._ev is None:
                    self.flush()
                else:
                    self._ev.set()
        rec.forget()

    def _plain(self) -> bool:
        """Whether an operation starting now in this task may be observed without a record
        (:meth:`_kept_start`, :meth:`_kept_end`): no observed operation or collector around it,
        no flow call, no span to make. Costs three context variable reads."""
        if _GROUPS.get() is not None or _CALL.get() is not None:
            return False
        tracer = self._tracer
        return tracer is None or tracer.parent() is False

    def _kept_start(self) -> int:
        """An operation of one known table begins, observed without a record (the caller
        checked :meth:`_plain`): its start time, for :meth:`_kept_end`."""
        self._started += 1
        return _clock()

    def _kept_end(
        self, table: np.ndarray, what: str, t0: int, tries: Tries | None, exc: BaseException | None
    ) -> None:
        """The operation begun at ``t0`` (:meth:`_kept_start`) of ``table``'s one group ended,
        raising ``exc``, after ``tries`` (None: its first attempt only): what :meth:`_end`
        counts for it, without a record. A success is two additions to its table's run."""
        dt = _clock() - t0
        if exc is not None:  # an error: counted, no duration (as _end does)
            self._ended += 1
            self._failed(_op_name(what), exc)
        else:
            if table is self._hit_table and what is self._hit_what:
                run = self._hit_run
            else:
                fast = self._fast.get(id(table))
                if fast is None or fast[0] is not table or fast[1] is not what:
                    fast = self._new_run(table, what)
                run = fast[2]
                self._hit_table, self._hit_what, self._hit_run = table, what, run
            run[0] += dt
            run[1 + bisect_left(self._bounds_ns, dt)] += 1
        if tries is not None and tries.n > 1:
            self.stats.add("aiote_retries", (_op_name(what),), tries.n - 1)

    def _new_run(self, table: np.ndarray, what: str) -> tuple[np.ndarray, str, list[int]]:
        """The run the operations of ``table`` named ``what`` count in (made; its series too)."""
        if len(self._fast) >= 256 or len(self.stats.runs) >= 256:
            self._fold()
        op = _op_name(what)
        nbytes, route, _ = self._table_info(table)
        self._series_of(op, route)
        fast = self._fast[id(table)] = (table, what, self.stats.run((op, route), nbytes))
        return fast

    def flush(self) -> None:
        """Makes now the spans of the operations that ended (otherwise made when the loop is
        next free). Raises nothing of its own (a tracer provider's error propagates)."""
        while self._spans:
            self._make_spans(len(self._spans))
        self._armed = False

    def _make_spans(self, n: int) -> None:
        batch, self._spans = self._spans[:n], self._spans[n:]
        for rec, op, nbytes, route, nics in batch:
            self._tracer.op_span(rec, op, nbytes, route, nics, rec.exc, _outcome(rec.exc))

    def _bind(self, bridge: Any, event_class: Any) -> None:
        """The engine started on its loop (``bridge``): spans are made by a task of it
        (:meth:`_run`), woken by an event of ``event_class``."""
        if self._tracer is not None:
            self._event_class = event_class
            self._ev = event_class()
            bridge.spawn(self._run)

    async def _run(self) -> None:
        """Makes the queued spans whenever there are some, 32 at a time with the other tasks
        let run in between, until :meth:`close`. Raises nothing."""
        while True:
            ev = self._ev
            if ev is None:
                return
            await ev.wait()
            if self._ev is not ev:  # closed meanwhile
                return
            self._ev = self._event_class()
            while self._spans:
                try:
                    self._make_spans(32)
                except Exception:  # pragma: no cover - a tracer provider's bug: never the loop's
                    _log.exception("making spans failed")
                if self._spans:
                    await anyio.lowlevel.checkpoint()
            self._armed = False

    def _account(self, rec: _OpRecord, op: str, nbytes: int, route: str) -> None:
        """The metrics of an operation that ended (and, for one group of a table, what
        :meth:`end` needs to count the next one of that table without this)."""
        series = self._series_of(op, route)
        groups = rec.groups
        if len(groups) == 1 and type(refs := groups[0][1]) is tuple and len(refs) == 2:
            table = refs[1]
            if type(table) is np.ndarray and not groups[0][0].failover:
                self._new_run(table, rec.what)
        if nbytes:
            series[0][0] += nbytes
        if rec.exc is None:
            self.stats.sample(series[1], (rec.t1 - rec.t0) * 1e-9)
        else:
            self._failed(op, rec.exc)
        if rec.attempts > 1:
            self.stats.add("aiote_retries", (op,), rec.attempts - 1)

    def _series_of(self, op: str, route: str) -> tuple[list[float], list[float]]:
        """The (bytes cell, duration histogram) of operation ``op`` on ``route`` (made if new)."""
        by_route = self._series.get(op)
        if by_route is None:
            by_route = self._series[op] = {}
        series = by_route.get(route)
        if series is None:
            key = (op, route)
            series = by_route[route] = (
                self.stats.cell("aiote_transfer_bytes", key),
                self.stats.hist("aiote_transfer_duration_seconds", key),
            )
        return series

    def _failed(self, op: str, exc: BaseException) -> None:
        outcome = _outcome(exc)
        self.stats.add("aiote_transfer_errors", (op, outcome))
        if outcome == "TransferStalled":
            self.stats.add("aiote_stalls", (op,))

    def _summary(self, rec: _OpRecord) -> tuple[int, str, tuple[int, ...]]:
        """(bytes of the groups that completed without error, route label, rails) of ``rec``."""
        groups = rec.groups
        if len(groups) == 1:  # the common case: one group of one table
            op, refs = groups[0]
            if type(refs) is tuple and len(refs) == 2 and type(refs[1]) is np.ndarray:
                n, route, rl = self._table_info(refs[1])
                return (n if op.done and op.status == 0 and not op.failover else 0), route, rl
        nbytes = 0
        routes: set[str] = set()
        rails: set[int] = set()
        for op, refs in groups:
            if type(refs) is tuple and len(refs) == 2 and isinstance(refs[1], np.ndarray):
                n, route, rl = self._table_info(refs[1])
            elif type(refs) is tuple and len(refs) == 4:  # a paged write: (mr, src, dst, its desc)
                d = refs[3]
                n = op.posted * int(d.page_size)
                rl = tuple(sorted({int(d.routes[i].rail) for i in range(d.nroutes)}))
                route = "direct" if d.routes[0].direct else self._route(rl)
            else:  # a message: one request to the one (rail, peer) it names
                n = op.posted * rec.unit
                rl = tuple(sorted({r for r, _ in op.names or ()}))
                route = self._route(rl)
            routes.add(route)
            rails.update(rl)
            if op.done and op.status == 0 and not op.failover:
                nbytes += n
        label = "+".join(sorted(routes)) if routes else "none"
        return nbytes, label, tuple(sorted(rails))

    def _route(self, rails: tuple[int, ...]) -> str:
        return "+".join(sorted({self._routes[r] for r in rails})) or "none"

    def _table_info(self, table: np.ndarray) -> tuple[int, str, tuple[int, ...]]:
        """(bytes, route, rails) of a table of rows; kept per table (a batch re-submitted, a
        repeated write's kept request: the same table object)."""
        hit = self._tables.get(id(table))
        if hit is not None and hit[0] is table:
            return hit[1]
        if len(table) == 1:
            row = table[0]
            n, rl, direct = int(row["length"]), (int(row["rail"]),), bool(row["direct"])
        else:
            n = int(table["length"].sum())
            rl = tuple(np.unique(table["rail"]).tolist())
            direct = bool(table["direct"].any())
        info = (n, "direct" if direct else self._route(rl), rl)
        if len(self._tables) >= 256:
            self._tables.clear()
        self._tables[id(table)] = (table, info)
        return info

    def _failover(self, moved: dict[tuple[int, int], int]) -> None:
        """Requests moved after a link failure: count per (from rail, to rail)."""
        if self._sink is not None:
            for (a, b), n in moved.items():
                self.stats.add("aiote_failovers", (self._nics[a], self._nics[b]), n)

    def _credit(self, units: int) -> None:
        """A deferred credit message counted ``units`` (sub-units of a credit) into a counter."""
        self._msg_credits += units // _CREDIT

    def _fold(self) -> None:
        """Moves the runs into the series (a scrape kept out meanwhile) and forgets the
        tables that counted in them."""
        with self._lock:
            self._ended += self.stats.fold()
            self._fast.clear()
            self._hit_table = self._hit_what = self._hit_run = None

    def _snapshot(self, into: Stats) -> int:
        """Adds this engine's numbers to ``into`` (a scrape, from any thread; the engine's
        close); returns its operations started and not finished."""
        with self._lock:
            into.merge(self.stats)
            return max(0, self._started - self._ended - self.stats.ran())

    def _credits(self) -> int:
        """Immediates this engine received (read by a scrape, from any thread)."""
        with self._lock:
            if self._h is None:
                return self._final_credits
            st = ffi.new("aio_stats*")
            lib.aio_get_stats(self._h, st)
            return int(st.remote_data) + self._msg_credits

    def _close(self) -> None:
        """The engine is closing (before its native engine is destroyed): the spans still
        queued are made; no native read after this; its numbers stay in the registry's series."""
        ev, self._ev = self._ev, None
        if ev is not None:
            ev.set()  # run() returns
        self.flush()
        final = self._credits()
        with self._lock:
            self._final_credits = final
            self._h = None
        if self._sink is not None:
            self._sink.retire(self, final)

    # ------------------------------------------------------------------ the flows' side

    def flow_call(self, flow: str, call: str) -> FlowCall:
        """A context manager (``with``) around one call of a flow (``"weights"``, ``"push"``):
        its duration, the bytes of the operations inside it (tasks it starts included) and its
        outcome go to ``aiote_flow_*``, and with tracing its span is the parent of theirs.
        Inside another flow call it records nothing (the outer call counts). ``flow`` and
        ``call`` become label values: keep them to a fixed set. Raises nothing; costs a few
        microseconds (a span: tens)."""
        return FlowCall(self, flow, call)

    def kv_request(self, side: str, traceparent: str | None = None) -> KVRequestObs:
        """The observation of one KV request on ``side`` (``"prefill"`` or ``"decode"``),
        started now; with tracing its span is a child of ``traceparent`` (the W3C string the
        other side sent; None: of the current span). Raises nothing; costs a span's start."""
        return KVRequestObs(self, side, traceparent)


class FlowCall:
    """One flow call being observed (see :meth:`Observer.flow_call`): ``bytes`` grows as its
    operations end. Entered once."""

    __slots__ = (
        "_call_token", "_exited", "_obs", "_outer", "_span", "_span_token", "_t0", "bytes", "call", "flow",
    )

    def __init__(self, obs: Observer, flow: str, call: str) -> None:
        self._obs = obs
        self.flow = flow
        self.call = call
        self.bytes = 0
        self._outer = False
        self._exited = False
        self._span: Any = None
        self._span_token: Any = None
        self._call_token: Any = None
        self._t0 = 0

    def __enter__(self) -> FlowCall:
        self._outer = _CALL.get() is not None
        if self._outer:
            return self
        self._t0 = time.perf_counter_ns()
        self._call_token = _CALL.set(self)
        tracer = self._obs._tracer
        if tracer is not None:
            self._span = tracer.start(f"aiote.{self.flow}.{self.call}")
            self._span_token = tracer.attach(self._span)
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._outer:
            return
        dt = (time.perf_counter_ns() - self._t0) * 1e-9
        _CALL.reset(self._call_token)
        self._exited = True
        obs = self._obs
        obs.flush()  # its operations' bytes
        outcome = _outcome(exc)
        key = (self.flow, self.call)
        if obs._sink is not None:
            obs.stats.observe("aiote_flow_call_seconds", key, dt)
            if self.bytes:
                obs.stats.add("aiote_flow_bytes", key, self.bytes)
            if exc is not None:
                obs.stats.add("aiote_flow_errors", (*key, outcome))
        if obs._tracer is not None:
            obs._tracer.detach(self._span_token)
            self._span.set_attribute("aiote.bytes", self.bytes)
            obs._tracer.finish(self._span, exc, outcome)

    def add(self, nbytes: int) -> None:
        """Bytes of an operation made inside the call: part of the call's bytes, or, for one
        that completed after the call returned (a write it posted), straight to the counter."""
        if not self._exited:
            self.bytes += nbytes
        elif self._obs._sink is not None:
            self._obs.stats.add("aiote_flow_bytes", (self.flow, self.call), nbytes)


class KVRequestObs:
    """One KV request being observed (see :meth:`Observer.kv_request`)."""

    __slots__ = ("_obs", "_span", "_t0", "ended", "side")

    def __init__(self, obs: Observer, side: str, traceparent: str | None) -> None:
        self._obs = obs
        self.side = side
        self.ended = False
        self._t0 = time.perf_counter_ns()
        tracer = obs._tracer
        self._span = (
            tracer.start(f"aiote.kv.{side}", tracer.remote(traceparent), {"aiote.kv.side": side})
            if tracer is not None else None
        )

    def traceparent(self) -> str | None:
        """The request span's context for the other side (W3C ``traceparent``), or None
        without tracing. O(1)."""
        tracer = self._obs._tracer
        return None if tracer is None else tracer.traceparent(self._span)

    def active(self) -> Any:
        """A context manager (``with``) making the request's span the parent of the
        operations started inside it (no-op without tracing). Raises nothing."""
        if self._span is None:
            return _NOOP
        return _Active(self._obs._tracer, self._span)

    def set(self, **attributes: Any) -> None:
        """Adds ``aiote.kv.<name>`` attributes to the request's span (none without tracing)."""
        if self._span is not None:
            for k, v in attributes.items():
                self._span.set_attribute(f"aiote.kv.{k}", v)

    def end(
        self, outcome: str, *, transfer_s: float | None = None, tail_s: float | None = None,
        error: BaseException | None = None,
    ) -> None:
        """The request finished with ``outcome`` (``"ok"``, ``"failed"``, ``"cancelled"``):
        counted, its transfer time and tail observed (when given), its span ended. Only the
        first call counts."""
        if self.ended:
            return
        self.ended = True
        obs = self._obs
        if obs._sink is not None:
            obs.stats.add("aiote_kv_requests", (self.side, outcome))
            if transfer_s is not None:
                obs.stats.observe("aiote_kv_transfer_seconds", (self.side,), transfer_s)
            if tail_s is not None:
                obs.stats.observe("aiote_kv_tail_seconds", (), tail_s)
        if self._span is not None:
            if transfer_s is not None:
                self._span.set_attribute("aiote.kv.transfer_s", transfer_s)
            if tail_s is not None:
                self._span.set_attribute("aiote.kv.tail_s", tail_s)
            if error is None and outcome != "ok":
                error = RuntimeError(outcome)
            obs._tracer.finish(self._span, error, outcome)


class _Active:
    __slots__ = ("_span", "_token", "_tracer")

    def __init__(self, tracer: Any, span: Any) -> None:
        self._tracer = tracer
        self._span = span

    def __enter__(self) -> None:
        self._token = self._tracer.attach(self._span)

    def __exit__(self, *exc: object) -> None:
        self._tracer.detach(self._token)


P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S")
_Method = Callable[Concatenate[S, P], Coroutine[Any, Any, T]]


def observed_call(
    flow: str, call: str, engine_of: Callable[[Any], Any]
) -> Callable[[_Method[S, P, T]], _Method[S, P, T]]:
    """Decorates a flow's async method as one :meth:`Observer.flow_call` of its engine
    (``engine_of(self)``). Without an observer the method's own coroutine is returned: no
    allocation beyond the call's."""

    def deco(fn: _Method[S, P, T]) -> _Method[S, P, T]:
        @functools.wraps(fn)
        def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]:
            obs = engine_of(self)._obs
            if obs is None:
                return fn(self, *args, **kwargs)
            return _within(obs.flow_call(flow, call), fn(self, *args, **kwargs))

        return wrapper

    return deco


async def _within(call: FlowCall, coro: Coroutine[Any, Any, T]) -> T:
    with call:
        return await coro
