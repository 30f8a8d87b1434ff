"""Prometheus metrics of engines and flows, through ``prometheus_client`` (an optional extra,
imported only when an engine is opened with metrics on).

Each engine's :class:`Stats` are plain numbers that only its event-loop thread writes (no lock
on an operation's path); one :class:`Sink` per ``CollectorRegistry`` sums the stats of every
live engine registered with it, plus what closed ones left, when the registry is scraped. So
several engines in one process share one set of series per registry (their sum), and engines
given different registries never collide. Under ``prometheus_client``'s multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` set) the sink also copies what changed into that mode's metric
files (see :class:`_Mirror`), which the process serving ``/metrics`` merges with its
``MultiProcessCollector``.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["DURATION_BUCKETS", "METRICS", "Sink", "Stats", "sink_for"]

DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# name (without the _total of a counter) -> (kind, help, label names)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "aiote_transfer_bytes": (
        "counter", "Bytes of operations' requests that completed without error.", ("op", "route")),
    "aiote_transfer_duration_seconds": (
        "histogram", "Duration of operations that succeeded, from the call to the completion.",
        ("op", "route")),
    "aiote_transfer_errors": (
        "counter", "Operations that raised, by operation and exception class.", ("op", "error")),
    "aiote_retries": ("counter", "Re-posts of an operation after a broken connection.", ("op",)),
    "aiote_failovers": (
        "counter", "Requests moved from a NIC whose link went down to another NIC.", ("from", "to")),
    "aiote_stalls": (
        "counter", "Operations that raised TransferStalled (no progress for stall_timeout).", ("op",)),
    "aiote_operations_in_flight": ("gauge", "Operations started and not yet finished.", ()),
    "aiote_imm_credits": (
        "counter", "Immediates received by this process's engines (remote writes carrying one, "
        "and the credits of deferred credit messages).", ()),
    "aiote_kv_requests": ("counter", "KV requests finished, by side and outcome.", ("side", "outcome")),
    "aiote_kv_transfer_seconds": (
        "histogram", "KV request transfer time: prefill, first layer posted to last write completed; "
        "decode, admission to every layer arrived.", ("side",)),
    "aiote_kv_tail_seconds": (
        "histogram", "KV request tail: from the last layer's send_layer to its write's completion.", ()),
    "aiote_flow_call_seconds": (
        "histogram", "Duration of flow calls (weights push, MoE dispatch/combine), successful or not.",
        ("flow", "call")),
    "aiote_flow_bytes": ("counter", "Bytes moved by the operations of flow calls.", ("flow", "call")),
    "aiote_flow_errors": ("counter", "Flow calls that raised.", ("flow", "call", "error")),
}

Labels = tuple[str, ...]


class Stats:
    """One engine's metrics as plain numbers, written by its event-loop thread only; read (by a
    scrape) with copies made under the GIL. ``counters[name][labels]`` is a one-number list (a
    cell the hot path keeps), ``hists[name][labels]`` is ``[count, sum, bucket counts...]``
    (not cumulative; the last bucket is ``+Inf``).

    ``runs`` hold what the common operations add to ``aiote_transfer_bytes`` and
    ``aiote_transfer_duration_seconds`` at less cost: per (labels, bytes of one operation), the
    total duration in ns and the count per bucket (see :meth:`run`); their bytes and count are
    derived when the runs are merged or folded (a scrape, the engine's close)."""

    __slots__ = ("bounds", "bounds_ns", "counters", "hists", "runs")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.bounds_ns = tuple(_ns_bound(b) for b in bounds)
        kinds = {n: m[0] for n, m in METRICS.items()}
        self.counters: dict[str, dict[Labels, list[float]]] = {
            n: {} for n, k in kinds.items() if k == "counter"
        }
        self.hists: dict[str, dict[Labels, list[float]]] = {
            n: {} for n, k in kinds.items() if k == "histogram"
        }
        self.runs: dict[tuple[Labels, int], list[int]] = {}

    def cell(self, name: str, labels: Labels) -> list[float]:
        """Counter ``name``'s series ``labels`` (made at 0 if new): add to its element 0."""
        c = self.counters[name].get(labels)
        if c is None:
            c = self.counters[name][labels] = [0.0]
        return c

    def hist(self, name: str, labels: Labels) -> list[float]:
        """Histogram ``name``'s series ``labels`` (made empty if new), see :meth:`sample`."""
        h = self.hists[name].get(labels)
        if h is None:
            h = self.hists[name][labels] = [0.0] * (len(self.bounds) + 3)
        return h

    def run(self, labels: Labels, nbytes: int) -> list[int]:
        """The run of the operations of series ``labels`` that succeeded moving ``nbytes``
        each (made empty if new): ``[total ns, count per bucket...]``. One operation of ``ns``
        nanoseconds is ``r[0] += ns; r[1 + bisect_left(stats.bounds_ns, ns)] += 1``: the same
        bucket as :meth:`sample` of ``ns * 1e-9`` (``bounds_ns``: the largest ns in each
        bucket), and two additions instead of five."""
        r = self.runs.get((labels, nbytes))
        if r is None:
            r = self.runs[(labels, nbytes)] = [0] * (len(self.bounds) + 2)
        return r

    def add(self, name: str, labels: Labels, value: float = 1) -> None:
        """Adds ``value`` to counter ``name``'s series ``labels``. O(1)."""
        self.cell(name, labels)[0] += value

    def observe(self, name: str, labels: Labels, value: float) -> None:
        """One sample of histogram ``name``. O(log buckets)."""
        self.sample(self.hist(name, labels), value)

    def sample(self, h: list[float], value: float) -> None:
        """One sample into the series ``h`` (from :meth:`hist`). O(log buckets)."""
        h[0] += 1
        h[1] += value
        h[2 + bisect_left(self.bounds, value)] += 1

    def ran(self) -> int:
        """Operations counted in the runs (not yet folded)."""
        return sum(sum(r) - r[0] for r in self.runs.copy().values())

    def fold(self) -> int:
        """Moves the runs into the series (the runs are forgotten: whoever keeps one must
        drop it); returns how many operations they held. The caller keeps a scrape out."""
        runs, self.runs = self.runs, {}
        n = 0
        for (labels, nbytes), r in runs.items():
            n += self._add_run(labels, nbytes, r)
        return n

    def _add_run(self, labels: Labels, nbytes: int, r: list[int]) -> int:
        count = sum(r) - r[0]
        if count:
            self.cell("aiote_transfer_bytes", labels)[0] += nbytes * count
            h = self.hist("aiote_transfer_duration_seconds", labels)
            h[0] += count
            h[1] += r[0] * 1e-9
            for i, k in enumerate(r[1:]):
                h[2 + i] += k
        return count

    def merge(self, other: Stats) -> None:
        """Adds ``other``'s numbers (its runs folded in) to these (copies of its dicts: safe
        against its writer)."""
        for name, series in other.counters.items():
            mine = self.counters[name]
            for k, cell in series.copy().items():
                mine.setdefault(k, [0.0])[0] += cell[0]
        for name, hs in other.hists.items():
            dst = self.hists[name]
            for k, h in hs.copy().items():
                d = dst.get(k)
                if d is None:
                    dst[k] = list(h)
                else:
                    for i, x in enumerate(list(h)):
                        d[i] += x
        for (labels, nbytes), r in other.runs.copy().items():
            self._add_run(labels, nbytes, list(r))


def _ns_bound(bound: float) -> int:
    """The largest whole number of ns whose value in seconds (``ns * 1e-9``) is <= ``bound``."""
    n = math.floor(bound * 1e9)
    while (n + 1) * 1e-9 <= bound:
        n += 1
    while n * 1e-9 > bound:
        n -= 1
    return n


class Source(Protocol):
    """What a sink reads of an engine's observer at a scrape."""

    def _snapshot(self, into: Stats) -> int:
        """Adds its numbers to ``into``; returns its operations in flight."""
        ...

    def _credits(self) -> int: ...


class Sink:
    """The aiote series of one registry: the live engines' stats summed, plus what closed
    engines left. Registered once in the registry as a custom collector."""

    def __init__(self, registry: Any, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()
        self._retired = Stats(bounds)
        self._retired_credits = 0
        self._mirror = _Mirror(bounds) if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
        registry.register(_Collector(self))
        if self._mirror is not None:  # copied into the mode's files every SYNC_INTERVAL s
            threading.Thread(target=_sync_loop, args=(weakref.ref(self),), name="aiote-metrics",
                             daemon=True).start()

    def attach(self, source: Source) -> None:
        """Counts ``source`` (an engine's observer) in this registry's series from now on."""
        with self._lock:
            self._live.add(source)

    def retire(self, source: Source, final_credits: int) -> None:
        """``source``'s engine closed: its numbers stay in the series (counters never go back)."""
        with self._lock:
            if source in self._live:
                self._live.discard(source)
                source._snapshot(self._retired)
                self._retired_credits += final_credits
        self.sync()

    def totals(self) -> tuple[Stats, int, int]:
        """(every engine's stats summed, operations in flight, immediates received)."""
        out = Stats(self.bounds)
        with self._lock:
            out.merge(self._retired)
            credits = self._retired_credits
            live = list(self._live)
        in_flight = 0
        for s in live:
            in_flight += s._snapshot(out)
            credits += s._credits()
        return out, in_flight, credits

    def sync(self) -> None:
        """Multiprocess mode: copies what changed since the last sync into the mode's files."""
        if self._mirror is not None:
            totals, in_flight, credits = self.totals()
            self._mirror.sync(totals, in_flight, credits)

    def collect(self) -> Iterator[Any]:
        """The metric families (prometheus_client's custom-collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        totals, in_flight, credits = self.totals()
        for name, (kind, doc, labels) in METRICS.items():
            if kind == "gauge":
                g = GaugeMetricFamily(name, doc, labels=labels)
                g.add_metric([], in_flight)
                yield g
            elif kind == "counter":
                c = CounterMetricFamily(name, doc, labels=labels)
                if name == "aiote_imm_credits":
                    c.add_metric([], credits)
                for k, v in sorted(totals.counters[name].items()):
                    c.add_metric(list(k), v[0])
                yield c
            else:
                h = HistogramMetricFamily(name, doc, labels=labels)
                for k, hv in sorted(totals.hists[name].items()):
                    h.add_metric(list(k), _cumulative(self.bounds, hv), sum_value=hv[1])
                yield h


SYNC_INTERVAL = 1.0  # multiprocess mode: seconds between copies into the mode's files


def _sync_loop(ref: weakref.ref[Sink]) -> None:
    while True:
        time.sleep(SYNC_INTERVAL)
        sink = ref()
        if sink is None:
            return
        sink.sync()
        del sink


def _cumulative(bounds: tuple[float, ...], h: list[float]) -> list[tuple[str, float]]:
    out = []
    acc = 0.0
    for i, b in enumerate((*bounds, math.inf)):
        acc += h[2 + i]
        out.append(("+Inf" if b == math.inf else repr(float(b)), acc))
    return out


class _Collector:
    """The custom collector a sink registers (describe() returns nothing: no name checks, so
    the registry accepts it beside anything else)."""

    def __init__(self, sink: Sink) -> None:
        self._sink = weakref.ref(sink)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        sink = self._sink()
        if sink is not None:
            yield from sink.collect()


_SINKS: weakref.WeakKeyDictionary[Any, Sink] = weakref.WeakKeyDictionary()
_SINKS_LOCK = threading.Lock()


def sink_for(registry: Any, bounds: tuple[float, ...]) -> Sink:
    """The sink of ``registry`` (None: ``prometheus_client.REGISTRY``), made and registered on
    first use; its buckets are the first engine's. Raises ImportError without prometheus_client."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    with _SINKS_LOCK:
        sink = _SINKS.get(registry)
        if sink is None:
            sink = _SINKS[registry] = Sink(registry, bounds)
        return sink


class _Mirror:
    """Multiprocess mode: prometheus_client's own metric objects (their values live in the
    mode's files, not in a registry), fed what changed in the sink since the last sync.
    Counters get the difference; a histogram gets one ``observe`` per new sample, each at a
    value inside the sample's bucket chosen so that the sum is the true sum (see
    :func:`_replay`). Costs one ``observe`` per sample at sync time, none per operation."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self._bounds = bounds
        self._metrics: dict[str, Any] = {}
        for name, (kind, doc, labels) in METRICS.items():
            if kind == "counter":
                self._metrics[name] = Counter(name, doc, labels, registry=None)
            elif kind == "histogram":
                self._metrics[name] = Histogram(name, doc, labels, registry=None, buckets=bounds)
            else:
                self._metrics[name] = Gauge(name, doc, labels, registry=None, multiprocess_mode="livesum")
        self._last = Stats(bounds)
        self._last_credits = 0
        self._lock = threading.Lock()

    def sync(self, totals: Stats, in_flight: int, credits: int) -> None:
        with self._lock:
            for name, series in totals.counters.items():
                last = self._last.counters[name]
                for k, cell in series.items():
                    v, before = cell[0], last.get(k, [0.0])[0]
                    if v > before:
                        self._child(name, k).inc(v - before)
                        last[k] = [v]
            if credits > self._last_credits:
                self._metrics["aiote_imm_credits"].inc(credits - self._last_credits)
                self._last_credits = credits
            for name, hs in totals.hists.items():
                last_h = self._last.hists[name]
                for k, h in hs.items():
                    was = last_h.get(k) or [0.0] * len(h)
                    delta = [a - b for a, b in zip(h, was, strict=True)]
                    if delta[0] > 0:
                        child = self._child(name, k)
                        for value in _replay(self._bounds, delta):
                            child.observe(value)
                        last_h[k] = list(h)
            self._metrics["aiote_operations_in_flight"].set(in_flight)

    def _child(self, name: str, labels: Labels) -> Any:
        m = self._metrics[name]
        return m.labels(*labels) if labels else m


def _replay(bounds: tuple[float, ...], delta: list[float]) -> Iterator[float]:
    """Samples that fall in the buckets of ``delta`` ([count, sum, per-bucket counts]) and add
    up to its sum: a value ``lo + lam * (hi - lo)`` in each finite bucket, with one ``lam`` in
    (0, 1] for all (the true samples' sum lies between the buckets' lower and upper totals),
    and the rest of the sum spread over the ``+Inf`` bucket's samples."""
    counts = delta[2:]
    edges = (0.0, *bounds)
    k_inf = counts[-1]
    lo_sum = sum(counts[i] * edges[i] for i in range(len(bounds)))
    width = sum(counts[i] * (edges[i + 1] - edges[i]) for i in range(len(bounds)))
    finite = delta[1] if not k_inf else min(delta[1], lo_sum + width)
    lam = 1.0 if width <= 0 else min(1.0, max(0.0, (finite - lo_sum) / width))
    rest = delta[1] - (lo_sum + lam * width)
    for i in range(len(bounds)):
        for _ in range(round(counts[i])):
            yield edges[i] + lam * (edges[i + 1] - edges[i])
    for _ in range(round(k_inf)):
        yield max(bounds[-1] * (1 + 1e-9), rest / k_inf)
