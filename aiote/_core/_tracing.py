"""OpenTelemetry spans of engines and flows, through the OpenTelemetry API (an optional extra,
imported only when an engine is opened with tracing on).

An operation's span is made after the operation ended, with its start and end times given
explicitly (``start_span(start_time=...)``, ``end(end_time=...)``) and the context that was
current when it started as its parent: nothing is made while the operation is on its way, and
the span itself (tens of microseconds of the SDK) is made by the observer's task when the loop
is next free (see _observe.py), not in the way of the task that awaited the operation. A
flow's span (a KV request, a weights push, an MoE dispatch) is started at once, because the
operations inside it are its children. W3C ``traceparent`` strings carry a span's context to
another process (the KV flow's admission message)."""

from __future__ import annotations

import contextvars
import time
from typing import Any

__all__ = ["Tracer"]


class Tracer:
    """aiote's tracer from ``provider`` (None: the global one, ``trace.get_tracer_provider()``).
    Raises ImportError without opentelemetry-api."""

    def __init__(self, provider: Any, every_operation: bool = False) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        provider = provider if provider is not None else trace.get_tracer_provider()
        self._tracer = provider.get_tracer("aiote")
        self._trace = trace
        self._context = context
        self._ok = Status(StatusCode.OK)
        self._error = StatusCode.ERROR
        self._status = Status
        self._propagator = TraceContextTextMapPropagator()
        # operations' times are read with perf_counter_ns (one clock read per end): epoch ns of
        # a perf_counter_ns reading is that reading plus this offset
        self.offset = time.time_ns() - time.perf_counter_ns()
        # the current Context: the context variable of OpenTelemetry's default runtime context
        # read directly (what its get_current does, minus two Python calls), else get_current
        var = getattr(getattr(context, "_RUNTIME_CONTEXT", None), "_current_context", None)
        self._current = var.get if isinstance(var, contextvars.ContextVar) else context.get_current
        self._span_of = trace.get_current_span
        self._every = every_operation
        self._seen: Any = None  # the Context parent() last looked at, and what it answered
        self._seen_parent: Any = False

    def parent(self) -> Any:
        """The parent of the span of an operation starting now: the current context when a
        sampled span is current in it (or always, ``every_operation``), else False (no span).
        Costs a context variable's read; the span's sampled flag is looked up only when the
        context is not the one of the last call (a Context never changes: a new span makes a
        new one), so operations outside any trace, all in the same empty context, pay no more."""
        ctx = self._current()
        if ctx is self._seen:
            return self._seen_parent
        parent = ctx if self._every or self._span_of(ctx).get_span_context().trace_flags.sampled else False
        self._seen = ctx
        self._seen_parent = parent
        return parent

    def op_span(
        self, rec: Any, op: str, nbytes: int, route: str, nics: list[str], error: BaseException | None,
        outcome: str,
    ) -> None:
        """Makes and ends the span of the operation of ``rec`` (its start and end times, in
        ``perf_counter_ns``, its parent context, its attempts) and what its end found."""
        attrs = {
            "aiote.op": op, "aiote.bytes": nbytes, "aiote.route": route,
            "aiote.nics": list(dict.fromkeys(nics)), "aiote.retries": max(0, rec.attempts - 1),
        }
        span = self._tracer.start_span(
            f"aiote.{op}", context=rec.parent, attributes=attrs, start_time=rec.t0 + self.offset
        )
        self.finish(span, error, outcome, rec.t1 + self.offset)

    def finish(self, span: Any, error: BaseException | None, outcome: str, end_ns: int | None = None) -> None:
        """Sets ``span``'s outcome and status (an error records the exception) and ends it."""
        span.set_attribute("aiote.outcome", outcome)
        if error is None:
            span.set_status(self._ok)
        else:
            span.set_status(self._status(self._error, f"{type(error).__name__}: {error}"))
            if outcome != "cancelled":
                span.record_exception(error)
        span.end(end_time=end_ns)

    def start(self, name: str, parent: Any = None, attributes: dict[str, Any] | None = None) -> Any:
        """A span started now, child of ``parent`` (a Context; None: the current one)."""
        return self._tracer.start_span(name, context=parent, attributes=attributes)

    def attach(self, span: Any) -> Any:
        """Makes ``span`` the current span of this task; returns the token for :meth:`detach`."""
        return self._context.attach(self._trace.set_span_in_context(span))

    def detach(self, token: Any) -> None:
        self._context.detach(token)

    def traceparent(self, span: Any) -> str | None:
        """``span``'s context as a W3C ``traceparent`` string (None if it is not recording)."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def remote(self, traceparent: str | None) -> Any:
        """The context of a remote parent from its ``traceparent`` (None: the current context)."""
        if not traceparent:
            return None
        return self._propagator.extract({"traceparent": traceparent})
