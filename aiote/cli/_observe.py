"""The long-running commands' observability options: ``--metrics-port`` serves Prometheus's
``/metrics`` while the command runs (``prometheus_client``, the ``metrics`` extra), and
``--trace-dir`` writes each process's OpenTelemetry spans there as JSON lines
(``opentelemetry-sdk``). Also the settings ``aiote bench --observe`` compares."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

import aiote

__all__ = ["VARIANTS", "Exporter", "add_arguments", "child_arguments", "exporting", "variant"]

# aiote bench --observe: no observability; metrics; metrics and tracing (spans for operations
# inside a sampled span: the bench's are not); metrics and a span for every operation
VARIANTS = ("off", "metrics", "tracing", "tracing-all")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--metrics-port``, ``--metrics-addr``, ``--metrics-linger``, ``--trace-dir``."""
    ap.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                    help="serve Prometheus /metrics on this port while it runs (aiote[metrics])")
    ap.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                    help="the address /metrics listens on (default 127.0.0.1; 0.0.0.0: every interface)")
    ap.add_argument("--metrics-linger", type=float, default=0.0, metavar="SECONDS",
                    help="keep serving /metrics this long after the run, for a last scrape")
    ap.add_argument("--trace-dir", default=None, metavar="DIR",
                    help="write OpenTelemetry spans to DIR/<role>-<pid>.jsonl, one JSON object a line "
                         "(pip install opentelemetry-sdk)")


def child_arguments(args: argparse.Namespace) -> list[str]:
    """The options a command passes to the processes it starts (spans; /metrics stays the
    parent's: one port)."""
    trace_dir = getattr(args, "trace_dir", None)
    return ["--trace-dir", str(trace_dir)] if trace_dir else []


class Exporter:
    """``/metrics`` served and spans written for one process of a command, from its options;
    :attr:`observe` is the ``observe=`` of its engines (None when neither option is given).
    Exits with status 2 (a message on stderr) when a package the options need is missing or
    the port is taken. :meth:`close` stops both."""

    def __init__(self, args: argparse.Namespace, role: str) -> None:
        port, trace_dir = getattr(args, "metrics_port", None), getattr(args, "trace_dir", None)
        self._server: Any = None
        self._provider: Any = None
        self._spans: Any = None
        self.observe: aiote.Observability | None = None
        if port is None and not trace_dir:
            return
        registry = None
        try:
            if port is not None:
                from prometheus_client import CollectorRegistry, start_http_server

                registry = CollectorRegistry()
                self._server, _ = start_http_server(port, addr=args.metrics_addr, registry=registry)
            if trace_dir:
                self._provider, self._spans = _span_files(Path(trace_dir), role)
        except (ImportError, OSError) as exc:
            self.close()
            sys.stderr.write(f"aiote: cannot export ({exc}); --metrics-port needs aiote[metrics], "
                             "--trace-dir opentelemetry-sdk\n")
            raise SystemExit(2) from exc
        self.observe = aiote.Observability(metrics=port is not None, registry=registry,
                                           tracer_provider=self._provider)

    @property
    def serving(self) -> bool:
        """Whether ``/metrics`` is served."""
        return self._server is not None

    def close(self) -> None:
        """Stops serving ``/metrics`` and flushes and closes the spans' file. Idempotent."""
        if self._provider is not None:
            self._provider.shutdown()
            self._spans.close()
            self._provider = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@asynccontextmanager
async def exporting(args: argparse.Namespace, role: str) -> AsyncIterator[aiote.Observability | None]:
    """:class:`Exporter` around a block: yields its ``observe``; after the block, keeps
    ``/metrics`` up for ``--metrics-linger`` seconds, then stops."""
    ex = Exporter(args, role)
    try:
        yield ex.observe
        linger = getattr(args, "metrics_linger", 0.0)
        if ex.serving and linger > 0:
            await anyio.sleep(linger)
    finally:
        ex.close()


def _span_files(folder: Path, role: str) -> tuple[Any, Any]:
    """An SDK tracer provider exporting each span as it ends to ``folder/<role>-<pid>.jsonl``,
    and that file."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    folder.mkdir(parents=True, exist_ok=True)
    out = open(folder / f"{role}-{os.getpid()}.jsonl", "a")  # noqa: SIM115 - closed by Exporter.close
    provider = TracerProvider(resource=Resource.create({"service.name": f"aiote-{role}"}))
    exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, out


def variant(name: str | None) -> aiote.Observability | None:
    """The ``observe=`` of one of :data:`VARIANTS` (``aiote bench --observe``): metrics into a
    registry of their own (not served: a scrape's cost is not an operation's), and spans
    through the SDK's batch processor to an exporter that drops them (the cost in this
    process, without a collector's network); ``tracing-all``: a span for every operation.
    Raises SystemExit(2) without the packages."""
    if name in (None, "off"):
        return None
    try:
        from prometheus_client import CollectorRegistry

        if name == "metrics":
            return aiote.Observability(registry=CollectorRegistry())
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    except ImportError as exc:
        sys.stderr.write(f"aiote bench --observe needs prometheus_client and opentelemetry-sdk: {exc}\n")
        raise SystemExit(2) from exc

    class _Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Drop()))
    every = "all" if name == "tracing-all" else "traced"
    return aiote.Observability(registry=CollectorRegistry(), tracer_provider=provider, spans=every)
