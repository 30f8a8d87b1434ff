"""Observability (docs/observability.md): Prometheus metrics and OpenTelemetry spans of the
engine's operations and of the flows, under asyncio and trio; a KV request's spans joined in one
trace across processes; a real Prometheus scraping ``aiote demo --metrics-port``; engines without
``observe=`` running none of it; aiote without the extras installed."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from _util import peer_buffer
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

import aiote
from aiote import kv, moe
from aiote import weights as W
from aiote._spawn import child_env, python_module
from aiote.cli import kvdemo
from aiote.testing import engine_pair, spawn_peer

pytestmark = pytest.mark.anyio

LAYOUT = kv.KVLayout(layers=4, page_tokens=16, token_bytes=512, pool_pages=64)  # 8 KiB pages
TCP = {"same_host": None}
GONE = aiote.RetryPolicy(connect_timeout=0.5)  # a peer that is gone: PeerUnreachable in 0.5 s
RETRY_ONCE = aiote.RetryPolicy(attempts=2, backoff=0.01, connect_timeout=1.0)


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = TracerProvider()
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider, spans


def by_name(spans: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


# ------------------------------------------------------------------ off: nothing runs


async def test_an_engine_without_observe_runs_no_observability_code() -> None:
    """Without ``observe=`` the only observability code an operation runs is the layer's
    ``_attempts`` forwarder (one ``is None`` test, no allocation of its own): a profile hook
    sees no call into _observe.py, _metrics.py or _tracing.py, whatever the operation."""
    files = ("_observe.py", "_metrics.py", "_tracing.py", "_observed.py")
    async with engine_pair(**TCP) as (a, b):
        assert a.observer is None
        mb = await b.register(np.zeros(1 << 16, np.uint8))
        ma = await a.register(np.ones(1 << 16, np.uint8))
        d = mb.descriptor
        await a.write(ma, d, length=4096, imm=1)  # the first of each makes its memo
        await a.write_imm(d, 1)
        calls: Counter[tuple[str, str]] = Counter()

        def profile(frame: Any, event: str, arg: Any) -> None:
            f = Path(frame.f_code.co_filename)
            if event == "call" and f.name in files and f.parent.name == "_core":
                calls[(f.name, frame.f_code.co_name)] += 1

        sys.setprofile(profile)
        try:
            for _ in range(20):
                await a.write(ma, d, length=4096, imm=1)
                await a.write_imm(d, 1)
                await a.post_write(ma, d, length=100)
                batch = a.batch().write(ma, d, length=10)
                await batch.submit()
                await a.write_paged(ma, d, page_size=1024, src_pages=[0, 1], dst_pages=[3, 2])
                await a.send(b.address, b"x")
                await b.recv()
        finally:
            sys.setprofile(None)
    assert set(calls) <= {("_observed.py", "_attempts")}, calls
    # write, write_imm, write_paged; the small send ends in its posting call, before any attempt
    assert calls[("_observed.py", "_attempts")] == 20 * 3


def test_aiote_imports_and_runs_without_the_extras() -> None:
    """With prometheus_client and opentelemetry not importable, aiote imports and moves bytes,
    and asking for metrics or spans raises InvalidArgument naming the extra."""
    code = textwrap.dedent("""
        import sys
        for name in ("prometheus_client", "opentelemetry"):
            sys.modules[name] = None  # importing it raises ImportError
        import anyio, numpy as np, aiote
        from aiote.testing import engine_pair
        async def main():
            async with engine_pair(same_host=None) as (a, b):
                mb = await b.register(np.zeros(64, np.uint8))
                await a.write_imm(mb.descriptor, 3)
                await b.imm_counter(3).wait(1, timeout=10)
            for obs, extra in ((aiote.Observability(), "aiote[metrics]"),
                               (aiote.Observability(metrics=False, tracing=True), "aiote[tracing]")):
                try:
                    async with aiote.open_engine(observe=obs):
                        raise SystemExit("opened")
                except aiote.InvalidArgument as exc:
                    assert extra in str(exc), exc
            print("OK")
        anyio.run(main)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=child_env())
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-2000:]


async def test_observe_is_checked_before_anything_opens() -> None:
    for bad, what in (("yes", "Observability"), (aiote.Observability(spans="some"), "spans"),
                      (aiote.Observability(buckets=(1.0, 0.5)), "buckets"),
                      (aiote.Observability(registry=object()), "registry")):
        with pytest.raises(aiote.InvalidArgument, match=what):
            async with aiote.open_engine(observe=bad):  # type: ignore[arg-type]
                pass


# ------------------------------------------------------------------ metrics


async def test_metrics_of_every_kind_of_operation() -> None:
    reg = CollectorRegistry()
    obs = aiote.Observability(registry=reg)
    async with aiote.open_engine(observe=obs, **TCP) as a, aiote.open_engine(**TCP) as b:
        mb = await b.register(np.zeros(1 << 20, np.uint8))
        ma = await a.register(np.ones(1 << 20, np.uint8))
        d = mb.descriptor
        for _ in range(2):  # the second: the kept request (memo)
            await a.write(ma, d, length=65536, imm=1)
        await a.read(ma, d, length=4096)
        await a.write_imm(d, 2)
        await a.post_write(ma, d, length=1000)
        t = a.post_write(ma, d, length=500)  # never awaited: counted when it completes
        batch = a.batch().write(ma, d, length=100).write(ma, d, length=200, dst_offset=4096)
        await batch.submit()
        await a.write_paged(ma, d, page_size=4096, src_pages=[0, 1, 2, 3], dst_pages=[3, 2, 1, 0])
        await a.send(b.address, b"hello")
        await b.recv()
        for _ in range(3):  # immediates a receives
            await b.write_imm(ma.descriptor, 9)
        await a.imm_counter(9).wait(3, timeout=10)
        await t  # (after its completion was counted: the completion counts it, not the await)
        with pytest.raises(aiote.InvalidArgument):  # refused before anything is posted: not counted
            await a.write_imm(d, 2, timeout=-1)
        a.observer.flush()  # type: ignore[union-attr]
        bytes_ = {op: sample(reg, "aiote_transfer_bytes_total", op=op, route="tcp")
                  for op in ("write", "read", "write_imm", "batch", "write_paged", "send")}
        assert bytes_ == {"write": 2 * 65536 + 1000 + 500, "read": 4096, "write_imm": 0, "batch": 300,
                          "write_paged": 4 * 4096, "send": 5}
        counts = {op: sample(reg, "aiote_transfer_duration_seconds_count", op=op, route="tcp")
                  for op in ("write", "read", "write_imm", "batch", "write_paged", "send")}
        assert counts == {"write": 4, "read": 1, "write_imm": 1, "batch": 1, "write_paged": 1, "send": 1}
        assert sample(reg, "aiote_transfer_duration_seconds_bucket", op="write", route="tcp", le="+Inf") == 4
        assert 0 < sample(reg, "aiote_transfer_duration_seconds_sum", op="write", route="tcp") < 10
        assert sample(reg, "aiote_operations_in_flight") == 0
        assert sample(reg, "aiote_imm_credits_total") == 3
        assert sample(reg, "aiote_transfer_errors_total", op="write", error="PeerUnreachable") == 0
        assert sample(reg, "aiote_transfer_errors_total", op="write_imm", error="InvalidArgument") == 0
    # the closed engine's series stay (counters never go back)
    assert sample(reg, "aiote_transfer_bytes_total", op="read", route="tcp") == 4096
    assert sample(reg, "aiote_imm_credits_total") == 3


async def test_errors_after_a_peer_is_gone() -> None:
    reg = CollectorRegistry()
    async with aiote.open_engine(observe=aiote.Observability(registry=reg), **TCP) as a:
        ma = await a.register(np.ones(4096, np.uint8))
        async with aiote.open_engine(**TCP) as b:
            gone = (await b.register(np.zeros(4096, np.uint8))).descriptor
        with pytest.raises(aiote.PeerUnreachable):
            await a.write(ma, gone, imm=1, retry=GONE)
        a.observer.flush()  # type: ignore[union-attr]
        assert sample(reg, "aiote_transfer_errors_total", op="write", error="PeerUnreachable") == 1
        assert sample(reg, "aiote_transfer_bytes_total", op="write", route="tcp") == 0
        assert sample(reg, "aiote_transfer_duration_seconds_count", op="write", route="tcp") == 0
        assert sample(reg, "aiote_operations_in_flight") == 0


async def test_stalls_and_retries_against_a_peer_process() -> None:
    """A peer process stopped: a write raises TransferStalled (``aiote_stalls_total``); the peer
    killed under a write in flight: the write is posted again (``aiote_retries_total``), then
    raises PeerUnreachable."""
    reg = CollectorRegistry()
    async with spawn_peer(observe=aiote.Observability(registry=reg), **TCP) as p:
        e = p.engine
        d, _, ms = await peer_buffer(p, 16 << 20, seed=3)  # (more than the sockets hold)
        os.kill(p.pid, signal.SIGSTOP)
        try:
            with pytest.raises(aiote.TransferStalled) as info:
                await e.write(ms, d, retry=aiote.RetryPolicy(stall_timeout=0.5))

            async def doomed() -> None:
                with pytest.raises(aiote.PeerUnreachable):
                    await e.write(ms, d, retry=RETRY_ONCE)

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                await anyio.sleep(0.2)  # (its requests in flight)
                os.kill(p.pid, signal.SIGKILL)
        finally:
            with suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
        with anyio.fail_after(30):
            await info.value.settled()
        e.observer.flush()  # type: ignore[union-attr]
    assert sample(reg, "aiote_stalls_total", op="write") == 1
    assert sample(reg, "aiote_transfer_errors_total", op="write", error="TransferStalled") == 1
    assert sample(reg, "aiote_transfer_errors_total", op="write", error="PeerUnreachable") == 1
    assert sample(reg, "aiote_retries_total", op="write") == 1


async def test_repeated_operations_count_exactly_through_the_runs_and_their_folds() -> None:
    """Repeats of one request (the kept request of a write, a batch re-submitted) are counted
    in runs (Stats.run) rather than in the series; a scrape sees them exactly, also once more
    tables than the runs keep (256) forced a fold, and each duration lands in the bucket its
    seconds would (the bounds in ns)."""
    reg = CollectorRegistry()
    async with aiote.open_engine(observe=aiote.Observability(registry=reg), **TCP) as a, \
            aiote.open_engine(**TCP) as b:
        mb = await b.register(np.zeros(1 << 16, np.uint8))
        ma = await a.register(np.ones(1 << 16, np.uint8))
        d = mb.descriptor
        batch = a.batch().write(ma, d, length=100).write(ma, d, length=200, dst_offset=4096)
        for _ in range(50):
            await a.write(ma, d, length=4096)
            await a.write_imm(d, 1)
            await batch.submit()
        for n in range(1, 301):  # 300 kept requests of as many sizes: more than the runs keep
            await a.write(ma, d, length=n)
        obs = a.observer
        assert obs is not None and 0 < len(obs.stats.runs) < 256  # (folded once, then runs again)
        written = 50 * 4096 + 300 * 301 // 2
        assert sample(reg, "aiote_transfer_bytes_total", op="write", route="tcp") == written
        assert sample(reg, "aiote_transfer_duration_seconds_count", op="write", route="tcp") == 350
        assert sample(reg, "aiote_transfer_duration_seconds_count", op="write_imm", route="tcp") == 50
        assert sample(reg, "aiote_transfer_bytes_total", op="batch", route="tcp") == 50 * 300
        assert sample(reg, "aiote_transfer_duration_seconds_bucket", op="batch", route="tcp", le="+Inf") == 50
        assert 0 < sample(reg, "aiote_transfer_duration_seconds_sum", op="write", route="tcp") < 10
        assert sample(reg, "aiote_operations_in_flight") == 0
        bounds, in_ns = obs.stats.bounds, obs.stats.bounds_ns
        from bisect import bisect_left

        rng = np.random.default_rng(1)
        for ns in [*in_ns, *(x + 1 for x in in_ns), *rng.integers(1, 20_000_000_000, 2000).tolist()]:
            assert bisect_left(in_ns, ns) == bisect_left(bounds, ns * 1e-9), ns
    assert sample(reg, "aiote_transfer_duration_seconds_count", op="write", route="tcp") == 350


@pytest.mark.parametrize("route", ["default", "tcp"])
async def test_repeats_outside_any_span_or_call_count_as_inside_one(route: str) -> None:
    """A repeated request (a kept ``write``/``write_imm``, a batch re-submitted) outside any
    span, flow call or observed operation is observed without a record (its table's run);
    the same repeats inside a sampled span or a flow call are observed with one. Both count
    the same operations and bytes, on the route they ran (the default engines: same host);
    inside the span or the call every repeat has its span, the call has their bytes; a
    repeat that fails is an error, not a duration."""
    reg, (provider, spans) = CollectorRegistry(), tracing()
    opts = TCP if route == "tcp" else {}
    obs = aiote.Observability(registry=reg, tracer_provider=provider)
    async with aiote.open_engine(observe=obs, **opts) as a, aiote.open_engine(**opts) as b:
        mb = await b.register(np.zeros(1 << 16, np.uint8))
        ma = await a.register(np.ones(1 << 16, np.uint8))
        d = mb.descriptor
        batch = a.batch().write(ma, d, length=100).write(ma, d, length=200, dst_offset=4096)
        app = provider.get_tracer("app")
        observer = a.observer
        assert observer is not None
        for _ in range(5):  # outside: the record-less path, no span
            assert observer._plain()
            await a.write(ma, d, length=1000)
            await a.write_imm(d, 1)
            await batch.submit()
        with app.start_as_current_span("request"):
            assert not observer._plain()
            for _ in range(5):
                await a.write(ma, d, length=1000)
                await a.write_imm(d, 1)
                await batch.submit()
        with observer.flow_call("test", "call") as call:
            assert not observer._plain()
            for _ in range(5):
                await a.write(ma, d, length=1000)
        assert call.bytes == 5 * 1000
        assert observer._plain()
        observer.flush()
        (label,) = {s.labels["route"] for m in reg.collect() if m.name == "aiote_transfer_bytes"
                    for s in m.samples if s.labels.get("op") == "write"}
        expect = {"tcp": "tcp", "default": "direct"}[route]
        assert label == expect  # (the route it ran on)
        assert sample(reg, "aiote_transfer_bytes_total", op="write", route=label) == 15 * 1000
        assert sample(reg, "aiote_transfer_duration_seconds_count", op="write", route=label) == 15
        assert sample(reg, "aiote_transfer_duration_seconds_count", op="write_imm", route=label) == 10
        assert sample(reg, "aiote_transfer_duration_seconds_count", op="batch", route=label) == 10
        assert sample(reg, "aiote_transfer_bytes_total", op="batch", route=label) == 10 * 300
        assert sample(reg, "aiote_operations_in_flight") == 0
        got = Counter(x.name for x in spans.get_finished_spans())
        assert got == {"request": 1, "aiote.test.call": 1, "aiote.write": 10, "aiote.write_imm": 5,
                       "aiote.batch": 5}  # (the call's span is the parent of its writes')
        await b.aclose()  # the peer gone: a repeat of the kept request fails
        with pytest.raises(aiote.PeerUnreachable):
            await a.write_imm(d, 1, retry=GONE)
        assert sample(reg, "aiote_transfer_errors_total", op="write_imm", error="PeerUnreachable") == 1
        assert sample(reg, "aiote_transfer_duration_seconds_count", op="write_imm", route=label) == 10
        assert sample(reg, "aiote_operations_in_flight") == 0


async def test_an_engine_switched_between_observers_counts_into_the_one_in_force() -> None:
    """``Engine._observe_as`` (what the cost benchmarks switch settings with): operations count
    into the observer in force when they run, none while off; an observer is kept per
    ``Observability`` object and closed with the engine (its series stay)."""
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    o1, o2 = aiote.Observability(registry=r1), aiote.Observability(registry=r2)
    async with aiote.open_engine(**TCP) as a, aiote.open_engine(**TCP) as b:
        d = (await b.register(np.zeros(64, np.uint8))).descriptor
        await a.write_imm(d, 1)
        for obs, n in ((o1, 2), (None, 3), (o2, 1), (o1, 4)):
            a._observe_as(obs)
            assert (a.observer is None) == (obs is None)
            for _ in range(n):
                await a.write_imm(d, 1)
        assert len(a._observers) == 2
        with pytest.raises(aiote.InvalidArgument):
            a._observe_as(aiote.Observability(spans="some"))
    assert sample(r1, "aiote_transfer_duration_seconds_count", op="write_imm", route="tcp") == 6
    assert sample(r2, "aiote_transfer_duration_seconds_count", op="write_imm", route="tcp") == 1


async def test_engines_sharing_a_registry_add_up_and_separate_ones_do_not_collide() -> None:
    shared, own = CollectorRegistry(), CollectorRegistry()
    async with (
        aiote.open_engine(observe=aiote.Observability(registry=shared), **TCP) as a1,
        aiote.open_engine(observe=aiote.Observability(registry=shared), **TCP) as a2,
        aiote.open_engine(observe=aiote.Observability(registry=own), **TCP) as a3,
        aiote.open_engine(**TCP) as b,
    ):
        d = (await b.register(np.zeros(4096, np.uint8))).descriptor
        for e, n in ((a1, 1), (a2, 2), (a3, 4)):
            m = await e.register(np.ones(4096, np.uint8))
            await e.write(m, d, length=n * 100)
            e.observer.flush()  # type: ignore[union-attr]
    assert sample(shared, "aiote_transfer_bytes_total", op="write", route="tcp") == 300
    assert sample(own, "aiote_transfer_bytes_total", op="write", route="tcp") == 400


async def test_the_default_registry() -> None:
    from prometheus_client import REGISTRY

    before = sample(REGISTRY, "aiote_transfer_bytes_total", op="write_imm", route="tcp")
    async with aiote.open_engine(observe=aiote.Observability(), **TCP) as a, aiote.open_engine(**TCP) as b:
        await a.write_imm((await b.register(np.zeros(64, np.uint8))).descriptor, 1)
    assert sample(REGISTRY, "aiote_transfer_duration_seconds_count", op="write_imm", route="tcp") >= 1
    assert sample(REGISTRY, "aiote_transfer_bytes_total", op="write_imm", route="tcp") == before


def test_multiprocess_mode(tmp_path: Path) -> None:
    """Under prometheus_client's multiprocess mode, a process's engines write their series to
    the mode's files (copied every second and when an engine closes), which another process
    reads with MultiProcessCollector."""
    code = textwrap.dedent("""
        import anyio, numpy as np, aiote
        async def main():
            async with aiote.open_engine(observe=aiote.Observability(), same_host=None) as a, \\
                       aiote.open_engine(same_host=None) as b:
                d = (await b.register(np.zeros(8192, np.uint8))).descriptor
                m = await a.register(np.ones(8192, np.uint8))
                for n in (1000, 2000, 3000):
                    await a.write(m, d, length=n)
        anyio.run(main)
    """)
    env = {**child_env(), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    cmd = [sys.executable, "-c", code]
    kw: dict[str, Any] = {"stderr": subprocess.PIPE, "env": env}
    with started(cmd, **kw) as one, started(cmd, **kw) as two:
        for p in (one, two):  # two processes at once: their series add up
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-2000:]
    from prometheus_client import multiprocess

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    assert sample(reg, "aiote_transfer_bytes_total", op="write", route="tcp") == 2 * 6000
    assert sample(reg, "aiote_transfer_duration_seconds_count", op="write", route="tcp") == 6
    assert sample(reg, "aiote_transfer_duration_seconds_bucket", op="write", route="tcp", le="+Inf") == 6


# ------------------------------------------------------------------ spans


async def test_a_span_per_operation_with_its_attributes_and_status() -> None:
    provider, spans = tracing()
    obs = aiote.Observability(metrics=False, tracer_provider=provider, spans="all")
    async with aiote.open_engine(observe=obs, **TCP) as a, aiote.open_engine(**TCP) as b:
        mb = await b.register(np.zeros(1 << 16, np.uint8))
        ma = await a.register(np.ones(1 << 16, np.uint8))
        await a.write(ma, mb.descriptor, length=8192, imm=1)
        await a.read(ma, mb.descriptor, length=100)
        batch = a.batch().write(ma, mb.descriptor, length=10).write(ma, mb.descriptor, length=20)
        await batch.submit()
        async with aiote.open_engine(**TCP) as c:
            gone = (await c.register(np.zeros(64, np.uint8))).descriptor
        with pytest.raises(aiote.PeerUnreachable):
            await a.write(ma, gone, length=64, retry=GONE)
    got = by_name(spans)
    assert [len(got[n]) for n in ("aiote.write", "aiote.read", "aiote.batch")] == [2, 1, 1]
    ok, failed = got["aiote.write"]
    assert dict(ok.attributes or {}) == {
        "aiote.op": "write", "aiote.bytes": 8192, "aiote.route": "tcp", "aiote.nics": ("lo",),
        "aiote.retries": 0, "aiote.outcome": "ok",
    }
    assert ok.status.status_code == StatusCode.OK and ok.parent is None
    assert ok.start_time is not None and ok.end_time is not None and ok.start_time < ok.end_time
    assert (got["aiote.batch"][0].attributes or {})["aiote.bytes"] == 30
    assert failed.status.status_code == StatusCode.ERROR
    assert (failed.attributes or {})["aiote.outcome"] == "PeerUnreachable"
    assert (failed.attributes or {})["aiote.retries"] == 0
    assert any(e.name == "exception" for e in failed.events)


async def test_by_default_only_operations_inside_a_sampled_span_get_one() -> None:
    provider, spans = tracing()
    async with aiote.open_engine(observe=aiote.Observability(metrics=False, tracer_provider=provider),
                                 **TCP) as a, aiote.open_engine(**TCP) as b:
        d = (await b.register(np.zeros(64, np.uint8))).descriptor
        await a.write_imm(d, 1)  # outside any span: none
        with provider.get_tracer("app").start_as_current_span("request") as parent:
            await a.write_imm(d, 1)
            await a.send(b.address, b"x")
        await b.recv()
    got = by_name(spans)
    assert sorted(got) == ["aiote.send", "aiote.write_imm", "request"]
    for name in ("aiote.send", "aiote.write_imm"):
        (s,) = got[name]
        assert s.parent is not None and s.parent.span_id == parent.get_span_context().span_id
        assert s.context.trace_id == parent.get_span_context().trace_id


async def test_flow_calls_weights_push_and_wait_version() -> None:
    """A weights push and wait_version: the push's bytes and time in aiote_flow_*, its span the
    parent of its writes' spans."""
    reg, (provider, spans) = CollectorRegistry(), tracing()
    obs = aiote.Observability(registry=reg, tracer_provider=provider)
    sources = [W.SourceShard("w", (8, 4), "float32", 0, (0, 8))]
    async with aiote.open_engine(observe=obs, **TCP) as a, aiote.open_engine(observe=obs, **TCP) as b:
        tg, n = W.pack_targets(0, [("w", "float32", [W.Piece("w", (0, 8))])], sources)
        mr = await b.register(np.zeros(n, np.uint8))
        p = W.plan(sources, W.with_desc(tg, bytes(mr.descriptor)))
        rx = W.WeightReceiver(b, p.receiver(0))
        async with W.WeightSender(a, p.sender(0)) as tx:
            stats = await tx.push({"w": np.ones((8, 4), np.float32)}, version=1, timeout=10)
        await rx.wait_version(1, timeout=10)
    assert sample(reg, "aiote_flow_bytes_total", flow="weights", call="push") == stats.nbytes == 128
    assert sample(reg, "aiote_flow_call_seconds_count", flow="weights", call="push") == 1
    assert sample(reg, "aiote_flow_call_seconds_count", flow="weights", call="wait_version") == 1
    got = by_name(spans)
    (push,) = got["aiote.weights.push"]
    children = [s for s in spans.get_finished_spans()
                if s.parent is not None and s.parent.span_id == push.context.span_id]
    assert children and {s.name for s in children} <= {"aiote.write", "aiote.write_imm", "aiote.batch"}
    assert (push.attributes or {})["aiote.bytes"] == 128


def moved(reg: CollectorRegistry) -> float:
    """aiote_transfer_bytes_total summed over its series."""
    return sum(s.value for m in reg.collect() if m.name == "aiote_transfer_bytes" for s in m.samples
               if s.name == "aiote_transfer_bytes_total")


async def test_flow_calls_moe_dispatch_and_combine() -> None:
    """Two ranks (engines of this process, each with its registry): dispatch and combine, and
    their halves called on their own, each one flow call in aiote_flow_*, their bytes the bytes
    of the operations inside them; a call that raises is an error of its call; rank 0's calls
    are spans, the parents of their operations' spans."""
    regs, (provider, spans) = [CollectorRegistry(), CollectorRegistry()], tracing()
    t, e, k, h = 8, 4, 2, 16
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((t, h)).astype(np.float32) for _ in range(2)]
    idx = [np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int64) for _ in range(2)]
    ws = [rng.random((t, k)).astype(np.float32) for _ in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(aiote.open_engine(observe=aiote.Observability(
            registry=regs[r], tracer_provider=provider if r == 0 else None), **TCP)) for r in range(2)]
        group = [a.address for a in engines]
        a2a: list[Any] = [None, None]
        outs: list[list[Any]] = [[], []]

        async def rank(r: int) -> None:
            a2a[r] = await moe.AllToAll.create(
                engines[r], moe.Group(group, r), num_experts=e, experts_per_token=k, hidden=h,
                max_tokens=t, in_dtype="float32", out_dtype="float32", timeout=30)

        async def step(r: int) -> None:
            hd = await a2a[r].dispatch(xs[r], idx[r], ws[r], timeout=30)
            outs[r].append(await a2a[r].combine(hd, hd.expert_x, timeout=30))
            pending = await a2a[r].dispatch_send(xs[r], idx[r], ws[r], timeout=30)
            hd = await pending.recv(timeout=30)
            outs[r].append(await (await a2a[r].combine_send(hd, hd.expert_x, timeout=30)).recv(timeout=30))

        created: list[float] = []
        for fn in (rank, step):
            created = [moved(regs[r]) for r in range(2)]  # (after create: what the calls move)
            async with anyio.create_task_group() as tg:
                for r in range(2):
                    tg.start_soon(fn, r)
        with pytest.raises(aiote.InvalidArgument):
            await a2a[0].dispatch(xs[0], np.full((t, k), e, np.int64), ws[0], timeout=30)
    for r in range(2):
        for out in outs[r]:  # the expert returned its rows: the reduction is x times its weights' sum
            np.testing.assert_allclose(out, xs[r] * ws[r].sum(axis=1, keepdims=True), rtol=1e-5)
        calls = {c: sample(regs[r], "aiote_flow_call_seconds_count", flow="moe", call=c)
                 for c in ("dispatch", "combine", "dispatch_send", "dispatch_recv", "combine_send",
                           "combine_recv")}
        assert calls == {"dispatch": 2 if r == 0 else 1, "combine": 1, "dispatch_send": 1,
                         "dispatch_recv": 1, "combine_send": 1, "combine_recv": 1}, calls
        flow = {c: sample(regs[r], "aiote_flow_bytes_total", flow="moe", call=c) for c in calls}
        # (a half's writes complete after it returned: counted then, as the whole call's)
        assert flow["dispatch_send"] == flow["dispatch"] > 0 and flow["combine_send"] == flow["combine"] > 0
        assert sum(flow.values()) == moved(regs[r]) - created[r]
    refused = {"flow": "moe", "call": "dispatch", "error": "InvalidArgument"}
    assert [sample(regs[r], "aiote_flow_errors_total", **refused) for r in range(2)] == [1, 0]
    got = by_name(spans)
    assert len(got["aiote.moe.dispatch"]) == 2 and len(got["aiote.moe.combine"]) == 1
    moe_calls = {s.context.span_id for n in got if n.startswith("aiote.moe.") for s in got[n]}
    ops = [s for s in spans.get_finished_spans() if not s.name.startswith("aiote.moe.")]
    assert ops and all(s.parent is not None and s.parent.span_id in moe_calls for s in ops)
    ok = [s for s in got["aiote.moe.dispatch"] if s.status.status_code == StatusCode.OK]
    assert len(ok) == 1 and (ok[0].attributes or {})["aiote.bytes"] > 0


# ------------------------------------------------------------------ the KV flow


async def kv_request(prefill: kv.PrefillServer, tokens: int) -> kv.PrefillRequest:
    req = await prefill.start(tokens, timeout=30)
    for layer in range(LAYOUT.layers):
        await req.send_layer(layer)
    await req.finish(timeout=30)
    await req.wait_kv_complete(timeout=30)
    return req


async def test_a_kv_request_is_one_trace_across_both_engines_with_its_metrics() -> None:
    """Prefill and decode engines with tracer providers of their own (as two processes would
    have): each request's spans from both exporters share one trace, the decode side's request
    span a child of the prefill side's, the layer writes children of the prefill side's."""
    (p_tp, p_spans), (d_tp, d_spans) = tracing(), tracing()
    p_reg, d_reg = CollectorRegistry(), CollectorRegistry()
    async with (
        aiote.open_engine(observe=aiote.Observability(registry=p_reg, tracer_provider=p_tp)) as pe,
        aiote.open_engine(observe=aiote.Observability(registry=d_reg, tracer_provider=d_tp)) as de,
        kv.PrefillServer(pe, LAYOUT) as prefill,
        kv.DecodeWorker(de, LAYOUT, pe.address) as worker,
    ):
        await prefill.wait_for_decoders(1, timeout=30)
        for tokens in (40, 100):
            await kv_request(prefill, tokens)
            r = await worker.next_request(timeout=30)
            await r.release()
    roots = by_name(p_spans)["aiote.kv.prefill"]
    assert len(roots) == 2
    for root in roots:
        tid = root.context.trace_id
        decode = [s for s in d_spans.get_finished_spans() if s.context.trace_id == tid]
        (dreq,) = [s for s in decode if s.name == "aiote.kv.decode"]
        assert dreq.parent is not None and dreq.parent.span_id == root.context.span_id
        assert dreq.parent.is_remote
        writes = [s for s in p_spans.get_finished_spans() if s.name == "aiote.write_paged"
                  and s.context.trace_id == tid]
        assert len(writes) == LAYOUT.layers
        assert all(w.parent is not None and w.parent.span_id == root.context.span_id for w in writes)
        pages = LAYOUT.pages_for((root.attributes or {})["aiote.kv.tokens"])
        kv_bytes = LAYOUT.layers * 2 * pages * LAYOUT.page_bytes
        assert sum((w.attributes or {})["aiote.bytes"] for w in writes) == kv_bytes
        assert root.status.status_code == dreq.status.status_code == StatusCode.OK
        assert any(s.name == "aiote.send" for s in decode)  # the decode side's answers, in the trace
    assert sample(p_reg, "aiote_kv_requests_total", side="prefill", outcome="ok") == 2
    assert sample(d_reg, "aiote_kv_requests_total", side="decode", outcome="ok") == 2
    assert sample(p_reg, "aiote_kv_transfer_seconds_count", side="prefill") == 2
    assert sample(p_reg, "aiote_kv_tail_seconds_count") == 2
    assert sample(d_reg, "aiote_kv_transfer_seconds_count", side="decode") == 2


async def test_a_kv_request_is_one_trace_across_processes(anyio_backend: str, tmp_path: Path) -> None:
    """The decode side in its own process (``aiote demo --role decode --trace-dir``) exports
    its spans to a file, the prefill side to the in-memory exporter: joined by trace id."""
    provider, spans = tracing()
    args = argparse.Namespace(
        provider="tcp", backend=anyio_backend, same_host="shm", layers=LAYOUT.layers,
        page_tokens=LAYOUT.page_tokens, token_bytes=LAYOUT.token_bytes, pool_pages=LAYOUT.pool_pages,
        kv_timeout=30.0, trace_dir=str(tmp_path),
    )
    async with (
        aiote.open_engine(observe=aiote.Observability(metrics=False, tracer_provider=provider)) as pe,
        kv.PrefillServer(pe, LAYOUT) as prefill,
    ):
        d = await kvdemo.spawn_decoder(args, pe.address, "traced")
        await prefill.wait_for_decoders(1, timeout=30)
        await kv_request(prefill, 64)
        await d.leave()
        assert (await d.finish())["exit"] == 0
    decode = [json.loads(line) for f in sorted(tmp_path.glob("decode-*.jsonl"))  # noqa: ASYNC240
              for line in f.read_text().splitlines()]
    (root,) = by_name(spans)["aiote.kv.prefill"]
    tid = f"0x{root.context.trace_id:032x}"
    mine = [s for s in decode if s["context"]["trace_id"] == tid]
    (dreq,) = [s for s in mine if s["name"] == "aiote.kv.decode"]
    assert dreq["parent_id"] == f"0x{root.context.span_id:016x}"
    assert dreq["status"]["status_code"] == "OK"
    assert {s["name"] for s in mine} == {"aiote.kv.decode", "aiote.send"}


# ------------------------------------------------------------------ a real Prometheus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def started(cmd: list[str], **kw: Any) -> Iterator[subprocess.Popen[str]]:
    """A child process in a process group of its own (it and whatever it starts are killed
    at the end, whatever happens)."""
    proc = subprocess.Popen(cmd, text=True, start_new_session=True, **kw)
    try:
        yield proc
    finally:
        with suppress(ProcessLookupError):  # (the group, the children it started included)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def query(port: int, promql: str) -> float | None:
    """The value of an instant PromQL query against the Prometheus HTTP API (None: no series)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


KILLED_REQUESTS = 1024  # the second demo's: too many to have ended when its workers die


def prefill_requests(metrics: bytes) -> float:
    """The prefill side's ended requests (any outcome) in a demo's /metrics text."""
    total = 0.0
    for line in metrics.decode().splitlines():
        if line.startswith("aiote_kv_requests_total{") and 'side="prefill"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(port: int) -> bytes:
    """The demo's /metrics (empty until it serves)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return bytes(r.read())
    except OSError:
        return b""


def wait_for(what: str, check: Any, timeout: float = 30.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def demo_cmd(port: int, *extra: str) -> list[str]:
    return python_module("aiote", "demo", "--layers", "4", "--pool-pages", "128", "--max-tokens", "512",
                         "--metrics-port", str(port), "--metrics-linger", "60", *extra)


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian's; scripts/bootstrap.sh)")
def test_prometheus_scrapes_the_demo(tmp_path: Path) -> None:
    """Prometheus (1 s scrapes) scrapes two ``aiote demo --metrics-port`` runs: in the first,
    the write_paged bytes counter equals the KV bytes the demo reports; in the second, a decode
    worker is killed mid-run and the error counters move."""
    assert PROMETHEUS is not None
    prom, clean, killed = free_port(), free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(textwrap.dedent(f"""
        global:
          scrape_interval: 1s
          scrape_timeout: 900ms
        scrape_configs:
          - job_name: clean
            static_configs: [{{targets: ["127.0.0.1:{clean}"]}}]
          - job_name: killed
            static_configs: [{{targets: ["127.0.0.1:{killed}"]}}]
    """))
    cmd = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
           f"--web.listen-address=127.0.0.1:{prom}", "--log.level=warn"]
    env = child_env()
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with (
        started(cmd, **quiet),
        started(demo_cmd(killed, "--requests", str(KILLED_REQUESTS), "--layer-ms", "25"), env=env,
                **quiet) as demo2,
        started(demo_cmd(clean, "--requests", "6"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=env) as demo,
    ):
        # the second demo: its decode workers killed once its writes are under way. Every one
        # alive then, so that one holding requests surely dies: which one is newest cannot be
        # told by its pid (pids wrap at 32768 here), and halfway through the demo its first
        # decoder leaves, done with what it held (killing it then fails no request)
        wait_for("the second demo's writes", lambda: b'op="write_paged"' in scrape(killed), 60)
        children = Path(f"/proc/{demo2.pid}/task/{demo2.pid}/children").read_text().split()
        assert children, "the second demo has no decode worker"
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        # what the assertion on failed requests below rests on: the second demo still had
        # requests to run when its workers died (a request whose writes all landed is ok on
        # the prefill side, whatever becomes of its decoder afterwards)
        ended = prefill_requests(scrape(killed))
        assert ended < KILLED_REQUESTS, f"the second demo ended all {ended:.0f} requests before the kill"
        # the first: what it reports, what Prometheus scraped
        assert demo.stdout is not None
        line = wait_for("the demo's summary", demo.stdout.readline, 120)
        reported = json.loads(line)
        assert reported["verified"] and reported["finished"] == 6
        written = 'sum(aiote_transfer_bytes_total{job="clean",op="write_paged"})'
        assert wait_for("the scraped bytes", lambda: query(prom, written) == reported["kv_bytes"])
        assert query(prom, 'aiote_kv_requests_total{job="clean",side="prefill",outcome="ok"}') == 6
        assert query(prom, 'sum(aiote_transfer_errors_total{job="clean"})') in (None, 0.0)
        errors = 'sum(aiote_transfer_errors_total{job="killed"})'
        wait_for("the error counters to move", lambda: (query(prom, errors) or 0) > 0, 30)
        failed = 'sum(aiote_kv_requests_total{job="killed",outcome!="ok"})'
        wait_for("failed requests", lambda: (query(prom, failed) or 0) > 0, 30)
        # every query of the sample dashboard is valid PromQL over these series
        dashboard = json.loads((Path(__file__).parents[1] / "examples" / "grafana-aiote.json").read_text())
        exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
        assert len(exprs) > 10
        for e in exprs:
            query(prom, e.replace("$job", ".*").replace("$__rate_interval", "1m"))


def test_bench_observe_prints_paired_figures(tmp_path: Path) -> None:
    """``aiote bench --observe`` (a tiny run): every setting's figures, paired with "off", on
    stdout and in the ``--json`` file."""
    saved = tmp_path / "observe.json"
    cmd = python_module("aiote", "bench", "write", "--observe", "--sizes", "4KiB", "--total", "1MiB",
                        "--repeats", "1", "--json", str(saved))
    with started(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env()) as bench:
        out, err = bench.communicate(timeout=120)  # (its serving processes: killed with it, if left)
    assert bench.returncode == 0, err[-2000:]
    rows = json.loads(out.splitlines()[-1])["rows"]
    assert json.loads(saved.read_text())["rows"] == rows
    (gbps,) = [row for row in rows if row["mode"] == "write" and row["unit"] == "GB/s"]
    (cpu,) = [row for row in rows if row["mode"] == "write" and row["unit"] == "s/GB"]
    assert gbps["off"]["median"] > 0
    for setting in ("metrics", "tracing", "tracing-all"):
        assert gbps[setting]["median"] > 0 and gbps[setting]["ratio"] > 0
        assert cpu[setting]["added"] is not None
