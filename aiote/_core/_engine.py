"""The engine: rails (NICs) over the C core, memory registration, one-sided and two-sided
operations, all awaitable under asyncio and trio. ``open_engine`` opens one.

The core, top down; a module imports only modules below it:

    _engine        Engine (its start and close) and open_engine
    _paged         paged writes, scatter, barrier, batch()             class Collective
    _batch         TransferBatch
    _transfers     write, read, write_imm, post_write(_imm)            class Transfers
    _rows          the rows of a transfer; opening routes, connect()   class Rows
    _messages      send, internal messages, deferred credits           class Messages
    _inbox         recv: receive slots, the inbox, waiting receivers   class Inbox
    _observed      each operation observed (open_engine(observe=))     class Observed
    _posted        Transfer (a posted write)
    _life          an operation's life: groups, posting, completion,   class OpLife
                   deadline, stalls, cancellation, stranded groups
    _retries       an awaited operation's attempts and re-posts         class Retries
    _completions   the poller's records, on the event-loop thread      class Completions
    _rails         peers, routes, links down and up, failover          class Rails
    _registration  memory registration, the host arena, GPU regions    class Registration
    _state         every field of an engine, the common checks         class EngineState
    _options       open_engine's option objects and their checks
    _observe, _metrics, _tracing: Observability and the Observer (metrics and spans of
                   operations and flows; prometheus_client and OpenTelemetry imported only when on)
    _fabric        opening the native engine (providers, rails, pollers)
    _gpu, _gpuparts, _gpuwatch, _counter, _memory, _bridge, _routing, _peers, _arena, _device
    _records, _wire: small records, native constants, error mapping
    _credits, _rules: sans-I/O rules of an operation's life (credits counted once, re-posting,
                   stalls), unit-tested without an engine
    _descriptor, _retry, _util, _log, _errors

``Engine`` is the classes above stacked, each layer a class over the one below it (its MRO
is the list): a step on the way to objects that each own their state. A layer calls down
freely; the two calls up are declared below as such (``Completions._on_message``, answered
by the messages layer, and the GPU side's ``GpuOwner``, which only the whole Engine is)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import anyio

from .._native import lib
from ._batch import TransferBatch
from ._bridge import LoopBridge
from ._fabric import (
    KNOWN_PROVIDERS,
    _open_native,
    auto_pollers,
    available_providers,
    default_copy_threads,
    default_streams,
    follow_loop_default,
    usable_cores,
)
from ._observe import Observability, check_observe
from ._options import (
    _UNSET,
    GpuOptions,
    PollerOptions,
    SameHostOptions,
    TransportOptions,
    check_options,
    merge_options,
)
from ._paged import Collective
from ._posted import Transfer
from ._records import RailInfo, ScatterTarget, _backend_lowlevel
from ._retry import RetryPolicy
from ._util import now

# the names of the layers below that callers import from here (aiote/__init__.py, aiote/cli, aiote/weights)
__all__ = [
    "KNOWN_PROVIDERS",
    "Engine",
    "RailInfo",
    "ScatterTarget",
    "Transfer",
    "TransferBatch",
    "auto_pollers",
    "follow_loop_default",
    "available_providers",
    "default_copy_threads",
    "default_streams",
    "open_engine",
    "usable_cores",
]


class Engine(Collective):
    """A transfer engine: one or more NICs (rails), a native completion poller, and the
    operations, each an awaitable. Open it with :func:`open_engine`; use it from the event
    loop (task) that opened it. What opening raises and costs, and what an open engine holds
    (a native poller thread, registered message slots per NIC), is in :func:`open_engine`.
    """

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        for i in range(len(self._rails)):
            if not lib.aio_rail_link_up(self._h, i):
                self._router.down.add(i)
                self._down_since[i] = now()
                self._log.warning("link down at start: NIC out of rotation", nic=self._rails[i].domain)
        self._bridge = LoopBridge(int(lib.aio_engine_eventfd(self._h)), self._on_ready)
        self._bridge.start()
        self._event = self._bridge.event_class
        if self._obs is not None:
            self._obs._bind(self._bridge, self._event)
        self._checkpoint_if_cancelled = _backend_lowlevel("checkpoint_if_cancelled")
        self._checkpoint = _backend_lowlevel("checkpoint")
        self._space = self._event()
        self._scratch = await self.register(bytearray(64), remote_write=False, remote_read=False)

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Closes the engine: refuses new work, waits up to ``timeout`` seconds for work in
        flight (not for work to a same-host peer whose process exited or whose engine closed:
        none of it can land), then stops the poller and closes the endpoints before any region
        (so the transport never touches freed memory). Operations still pending fail with
        :class:`EngineClosed`. Idempotent; raises nothing of its own, and is shielded (a
        cancellation does not interrupt it). Costs up to ``timeout`` seconds of waiting for work
        in flight, then the native teardown, run in a worker thread so the loop is not blocked."""
        if self._closed or self._closing:
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(timeout):
                lib.aio_quiet_waiters(self._h, 1)  # posted transfers' completions wake it too
                self._drain()
                try:
                    seen: dict[bytes, bool] = {}  # same-host peers judged gone or not, once each
                    for op in list(self._ops):  # (not those to a same-host peer that is gone)
                        await self._wake_or_gone(op, op.event, seen)
                finally:
                    lib.aio_quiet_waiters(self._h, -1)
                while any(mr._dev_pending for mr in self._regions):  # noqa: ASYNC110 - GPU copies
                    await anyio.sleep(0.001)
            if self._ops:
                self._log.warning("closing with operations in flight", pending=len(self._ops))
            if self._gpu is not None:
                self._gpu.close()
            if self._bridge is not None:
                await self._bridge.stop()
            h = self._h
            self._closed = True
            for obs in self._observers:  # their last native read, before the engine is gone
                obs._close()
            await anyio.to_thread.run_sync(lib.aio_engine_destroy, h)
        for op in self._ops.close():
            op.event.set()
        for c in self._counters.values():
            c._fail_all()
        while self._recv_waiters:
            self._recv_waiters.popleft().event.set()
        for mr in self._regions:
            mr._handle = None
            mr._memos.clear()
        self._regions.clear()


_NOT_FIELDS = frozenset(("provider", "nics", "transport", "poller", "local", "gpu", "retry", "observe"))


@asynccontextmanager
async def open_engine(
    provider: str = "tcp",
    nics: Sequence[str] | None = None,
    *,
    transport: TransportOptions | None = None,
    poller: PollerOptions | None = None,
    local: SameHostOptions | None = None,
    gpu: GpuOptions | None = None,
    retry: RetryPolicy | None = None,
    observe: Observability | None = None,
    # each of these is the field of the same name of one of the option objects above (the
    # defaults are theirs); given both ways, InvalidArgument
    max_message_size: int = _UNSET,
    message_slots: int = _UNSET,
    combine_messages: bool = _UNSET,
    spin_us: float = _UNSET,
    loop_spin_us: float = _UNSET,
    sleep_ms: int = _UNSET,
    max_in_flight: int = _UNSET,
    cancel_grace: float = _UNSET,
    post_budget_us: float = _UNSET,
    same_host: str | None = _UNSET,
    stripe_min: int = _UNSET,
    port: int | None = _UNSET,
    stage_chunk: int = _UNSET,
    gpu_ipc: bool = _UNSET,
    watch_interval_us: int = _UNSET,
    ipc_streams: int = _UNSET,
    gpu_backend: str = _UNSET,
    gpu_direct: bool | None = _UNSET,
    streams: int | None = _UNSET,
    same_host_direct: bool = _UNSET,
    tcp_send_buffer: int | None = _UNSET,
    host_arena: int = _UNSET,
    copy_threads: int | None = _UNSET,
    pollers: int | None = _UNSET,
    follow_loop: bool | None = _UNSET,
    max_peers: int = _UNSET,
) -> AsyncIterator[Engine]:
    """Opens an engine: one rail per NIC in ``nics`` on libfabric ``provider``.

    ``provider``: ``"tcp"`` (default; over loopback with the default ``nics=["lo"]``),
    ``"shm"`` (same host), ``"verbs"``, ``"efa"``, or a full libfabric provider name.
    ``nics``: interface/domain names (``["lo"]``, ``["eth0", "eth1"]``, ``["mlx5_0"]``).

    The rest is optional, grouped by what it tunes, each group a frozen option object whose
    fields document what they guarantee and cost: ``transport``
    (:class:`TransportOptions`: connections per NIC, striping, ports, tcp send buffers,
    message slots, in-flight limits, peers kept), ``poller`` (:class:`PollerOptions`: the
    native poller threads' spinning and sleeping, the event loop's low-latency setting),
    ``local`` (:class:`SameHostOptions`: the same-host provider, direct copies, the host
    arena) and ``gpu`` (:class:`GpuOptions`: backend, staging, CUDA IPC, direct
    registration, the UVM watch). ``retry``: the default :class:`RetryPolicy` of the engine's
    operations (each takes ``retry=`` too); ``RetryPolicy()`` by default: 3 re-posts after a
    broken connection, a peer that does not answer for 5 s is unreachable. ``observe``: what
    the engine exports (:class:`Observability`: Prometheus metrics, OpenTelemetry spans); None,
    the default, exports nothing and costs nothing (see docs/observability.md).

    Every field of an option object is also a keyword argument of the same name
    (``open_engine(streams=2)`` is ``open_engine(transport=TransportOptions(streams=2))``);
    giving an option object and a keyword of one of its fields raises
    :class:`InvalidArgument`, as does any field out of its range (before anything is opened).

    Raises :class:`ProviderError` naming what is missing (unknown provider or NIC, no RMA).
    The engine closes when the block exits (see :meth:`Engine.aclose`). Opening costs a few
    milliseconds plus libfabric's one-time start-up.
    """
    # the keyword fields, as given (every parameter but the eight above them; first: nothing else
    # is bound yet), each the field of the same name of one option object
    keywords = {k: v for k, v in locals().items() if k not in _NOT_FIELDS}
    objects = {"transport": transport, "poller": poller, "local": local, "gpu": gpu}
    t, p, s, g = merge_options(objects, keywords)
    nic_list, t, p, s, g = check_options(provider, nics, t, p, s, g, retry)
    check_observe(observe)
    engine = await _open(provider, nic_list, t, p, s, g, retry, observe)
    try:
        yield engine
    finally:
        await engine.aclose()


async def _open(
    provider: str,
    nic_list: list[str | None],
    t: TransportOptions,
    p: PollerOptions,
    s: SameHostOptions,
    g: GpuOptions,
    retry: RetryPolicy | None,
    observe: Observability | None = None,
) -> Engine:
    """Opens the native engine (in a worker thread: it blocks for milliseconds) and starts
    the Python side over it; options already checked."""
    slot_size = t.max_message_size + 4096  # room for the sender's address
    h, rails, arena = await anyio.to_thread.run_sync(
        partial(
            _open_native,
            provider,
            nic_list,
            slots=t.message_slots,
            slot_size=slot_size,
            spin_ns=int(p.spin_us * 1000),
            sleep_ms=int(p.sleep_ms),
            max_in_flight=t.max_in_flight,
            same_host=s.same_host,
            base_port=0 if t.port is None else t.port,
            watch_us=g.watch_interval_us,
            direct=bool(s.same_host_direct),
            sndbuf=t.tcp_send_buffer,
            arena=s.host_arena,
            pollers=p.pollers,
            follow_loop=follow_loop_default() if p.follow_loop is None else p.follow_loop,
            copy_threads=s.copy_threads,
        )
    )
    try:
        engine = Engine(h, rails, transport=t, poller=p, local=s, gpu=g, retry=retry, arena=arena,
                        observe=observe)
    except BaseException:
        await anyio.to_thread.run_sync(lib.aio_engine_destroy, h)
        raise
    try:
        await engine._start()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await engine.aclose()
        raise
    engine._log.debug("engine open", provider=provider, nics=[r.domain for r in rails])
    return engine
