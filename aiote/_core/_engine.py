"""The engine: rails (NICs) over the C core, memory registration, one-sided and two-sided
operations, all awaitable under asyncio and trio. ``Engine`` is the facade over the layers
below (see _state.py); ``open_engine`` opens one."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import anyio

from .._native import lib
from ._batch import TransferBatch
from ._bridge import LoopBridge
from ._errors import InvalidArgument
from ._fabric import (
    _DEFAULT_NIC,
    KNOWN_PROVIDERS,
    _open_native,
    auto_pollers,
    available_providers,
    default_streams,
)
from ._paged import Collective
from ._posted import Transfer
from ._records import RailInfo, ScatterTarget, _checkpoint_if_cancelled_fn
from ._retry import RetryPolicy
from ._util import as_index, now
from ._wire import _CLOSED_STATUS

# the names of the layers below that callers import from here (aiote/__init__.py, aiote/cli, aiote/weights)
__all__ = [
    "KNOWN_PROVIDERS",
    "Engine",
    "RailInfo",
    "ScatterTarget",
    "Transfer",
    "TransferBatch",
    "auto_pollers",
    "available_providers",
    "default_streams",
    "open_engine",
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
        self._checkpoint_if_cancelled = _checkpoint_if_cancelled_fn()
        self._space = self._event()
        self._scratch = await self.register(bytearray(64), remote_write=False, remote_read=False)

    async def aclose(self, *, timeout: float = 10.0) -> None:
        """Closes the engine: refuses new work, waits up to ``timeout`` seconds for work in
        flight, then stops the poller and closes the endpoints before any region (so the
        transport never touches freed memory). Operations still pending fail with
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
                    for op in list(self._pending.values()):
                        await op.event.wait()
                finally:
                    lib.aio_quiet_waiters(self._h, -1)
                while any(mr._dev_pending for mr in self._regions):  # noqa: ASYNC110 - GPU copies
                    await anyio.sleep(0.001)
            if self._pending:
                self._log.warning("closing with operations in flight", pending=len(self._pending))
            if self._gpu is not None:
                self._gpu.close()
            if self._bridge is not None:
                await self._bridge.stop()
            h = self._h
            self._closed = True
            await anyio.to_thread.run_sync(lib.aio_engine_destroy, h)
        for op in self._pending.values():
            op.status = _CLOSED_STATUS
            op.event.set()
        self._pending.clear()
        for c in self._counters.values():
            c._fail_all()
        while self._recv_waiters:
            self._recv_waiters.popleft().event.set()
        for mr in self._regions:
            mr._handle = None
            mr._memos.clear()
        self._regions.clear()


@asynccontextmanager
async def open_engine(
    provider: str = "tcp",
    nics: Sequence[str] | None = None,
    *,
    max_message_size: int = 1 << 20,
    message_slots: int = 16,
    spin_us: float = 50.0,
    loop_spin_us: float = 0.0,
    sleep_ms: int = 100,
    max_in_flight: int = 16384,
    cancel_grace: float = 5.0,
    post_budget_us: float = 200.0,
    same_host: str | None = "shm",
    stripe_min: int = 1 << 20,
    retry: RetryPolicy | None = None,
    port: int | None = None,
    stage_chunk: int = 4 << 20,
    gpu_ipc: bool = True,
    watch_interval_us: int = 100,
    gpu_backend: str = "cuda",
    gpu_direct: bool | None = None,
    streams: int | None = None,
    same_host_direct: bool = True,
    tcp_send_buffer: int | None = None,
    host_arena: int = 4 << 30,
    pollers: int | None = None,
    max_peers: int = 1024,
) -> AsyncIterator[Engine]:
    """Opens an engine: one rail per NIC in ``nics`` on libfabric ``provider``.

    ``provider``: ``"tcp"`` (default; over loopback with the default ``nics=["lo"]``),
    ``"shm"`` (same host), ``"verbs"``, ``"efa"``, or a full libfabric provider name.
    ``nics``: interface/domain names (``["lo"]``, ``["eth0", "eth1"]``, ``["mlx5_0"]``).
    ``max_message_size``/``message_slots``: the size and count of the registered message
    slots for :meth:`Engine.send`/:meth:`Engine.recv`, per NIC, for both directions.
    ``spin_us``: how long the native poller busy-polls after the last activity before it
    sleeps on the provider's wait object; raise it (e.g. ``1000``) for lower latency at the
    price of CPU, ``0`` to never spin. ``loop_spin_us``: the low-latency setting of the event-loop
    side (default 0: off): an operation or counter wait that is not complete right after
    posting drives the completion queues from the loop thread itself (a native call, GIL
    released: it polls for ~30 us, yielding the core between polls, then sleeps on the NICs'
    wait objects) for up to this long, and only then sleeps on the event loop: no hand-off
    through the ring and the eventfd, and a completed operation or an available credit
    returns without a trip through the event loop (the poller thread works as usual). It
    blocks the loop for at most ``loop_spin_us`` per wait, so use it where latency matters
    more than other tasks' fairness (e.g. ``500``); an idle engine still sleeps.
    ``sleep_ms``: the timed fallback of the sleeping poller.
    ``same_host``: an extra provider (one rail) for peers on this host, chosen automatically
    when both engines carry it (default ``"shm"``: shared memory, about 2.5x tcp loopback here);
    ``None`` keeps every peer on ``provider`` (see :meth:`Engine.route`). Skipped with a log
    line when the provider is not available.
    ``same_host_direct``: READs of host memory between two engines on this host that both
    have an shm rail and this setting are copied by the reader's poller thread straight out
    of the peer's memory (``process_vm_readv``), as UCX does, instead of by the target's shm
    progress (libfabric 1.17's shm copies at the target). The target's checks still hold: the
    engine publishes each host region's key, bounds and access rights in a region table in
    shared memory; the reader checks them before every copy, and unregistering a region
    waits until copies under way finished (new ones are refused). Writes stay with shm
    (``process_vm_writev`` copied slower here: see docs/benchmarks.md), except writes of 4 KiB
    or more into a peer's host arena (``host_arena`` below), which are a ``memcpy``. Falls back to shm,
    with a log line, where the copy is not permitted (ptrace restrictions) or the table
    cannot be opened. ``False``: publish no table and copy nothing directly.
    ``host_arena``: bytes of address space for :meth:`Engine.alloc_host` (default 4 GiB; only
    what is allocated and touched takes memory): a shared-memory file this engine publishes
    with its region table, which same-host peers map, so that their writes into and reads out
    of regions allocated there are a ``memcpy`` by their poller, the fastest same-host path
    (writes into other host memory stay with shm). ``0``: no arena. Needs ``same_host_direct``
    and an shm rail; without them, or where the file cannot be created, ``alloc_host`` returns
    ordinary memory (logged).
    ``stripe_min``: a single write or read of at least this many bytes is split across the
    NICs that reach the peer (several ``nics``); smaller ones go round robin over them.
    ``retry``: the default :class:`RetryPolicy` of the engine's operations (each takes
    ``retry=`` too); ``RetryPolicy()`` by default: 3 re-posts after a broken connection,
    a peer that does not answer for 5 s is unreachable.
    ``port``: tcp only: the first NIC listens on this port, the next on ``port + 1``, and so on,
    so that a restarted process gets the same address (default: any free port).
    ``stage_chunk``: GPU memory on providers without CUDA support is staged through pinned
    host memory in pieces of this size (device-to-host copy of one piece overlaps the
    network transfer of the previous). ``gpu_ipc``: same-host GPU peers are written through
    CUDA IPC (device-to-device); ``False`` stages them like remote ones.
    ``watch_interval_us``: while a GPU completion or a :class:`UvmWatcher` is awaited, the
    poller reads the watched words at least this often (it sleeps otherwise).
    ``gpu_backend``: ``"cuda"`` (CuPy); ``"host"`` emulates a GPU on host memory with the
    same stream semantics (for tests on machines without one, with
    :class:`aiote.testing.HostDeviceArray`). ``gpu_direct``: register GPU memory with the
    NICs themselves (no staging); ``None`` (default): when every NIC's provider has
    ``FI_HMEM`` (verbs/efa built with CUDA; none of Debian's), ``True`` with a provider
    without it fails at registration.
    ``streams``: connections per NIC (1 to 8; each is one more rail on the same NIC, so a
    peer opened with the same ``streams`` is reached over that many connections per NIC).
    ``None`` (default): :func:`default_streams` (2 on tcp with one NIC, else 1). Every
    connection to a peer is opened when a transfer first reaches it (a zero-byte request in
    the background); until then transfers go whole over the open ones.
    A write or read of at least ``stripe_min`` bytes is split across them while fewer
    operations are in flight than streams (its immediate, if any, follows as one credit once
    every piece landed); otherwise, and for smaller ones, the streams take whole transfers in
    turn, each carrying its immediate, as over a single NIC. On tcp two streams move
    large writes faster where one TCP connection's receive path is the limit (loopback here:
    see docs/benchmarks.md); the price is a rail's memory and poller work per stream.
    ``tcp_send_buffer``: the send buffer (``SO_SNDBUF``, bytes; the kernel doubles it) of the
    tcp provider's connections. ``None`` (default): 512 KiB on connections to peers on this
    host (the same IP at both ends, as over loopback), the kernel's autotuning elsewhere.
    Loopback tcp otherwise lets megabytes queue per connection, which the receiver then
    copies from memory rather than cache: 16 MiB writes moved about 40 % faster here with it
    (docs/benchmarks.md). ``0``: the kernel's autotuning everywhere. A positive value: that
    size on every tcp connection of the engine, other hosts included (a fixed buffer caps one
    connection near buffer / round-trip time). libfabric's tcp provider has no setting for
    it, so the core sets it on the provider's own sockets: the rail's listener and, at the
    first posts to a peer, the connection to it (see ``aio_engine_set_tcp_sndbuf``). The
    kernel caps it at ``net.core.wmem_max``.
    ``pollers``: native poller threads (1 to 16). Rail *i* (a NIC, a stream of one, or the
    same-host rail last) is driven by thread *i* % ``pollers``, so an engine with several
    rails moves data on several cores at once: over tcp one thread copies into one
    connection at about one core's speed, so ``streams=2`` needs two pollers to move more than
    one connection does (docs/benchmarks.md). Each thread spins only after activity on its
    own rails, then sleeps. ``None`` (default): one per rail, up to the cores this process may
    use (at least two); more than the rails is capped at the rails. :meth:`stats` reports the
    count.
    ``max_peers``: peer NIC addresses the engine keeps resolved (a peer engine with several
    NICs or streams counts one per NIC); past it, those not used lately are forgotten at a
    quiet moment and cost a new connection when used again (see :meth:`Engine.forget_peer`).

    Raises :class:`ProviderError` naming what is missing (unknown provider or NIC, no RMA).
    The engine closes when the block exits (see :meth:`Engine.aclose`). Opening costs a few
    milliseconds plus libfabric's one-time start-up.
    """
    if not isinstance(provider, str) or not provider:
        raise InvalidArgument("provider must be a non-empty string such as 'tcp' or 'shm'")
    if nics is None:
        nic_list: list[str | None] = [_DEFAULT_NIC.get(provider)]
    else:
        if isinstance(nics, str):
            raise InvalidArgument("nics must be a list of NIC names, e.g. ['lo']")
        nic_list = list(nics)
        if not nic_list:
            raise InvalidArgument("nics must name at least one NIC")
        if len(nic_list) > 16:
            raise InvalidArgument("at most 16 NICs per engine")
    if streams is None:
        streams = default_streams(provider, [str(n) for n in nic_list])
    streams = as_index(streams, "streams", lo=1, hi=9)
    if len(nic_list) * streams > 16:
        raise InvalidArgument(f"at most 16 rails per engine: {len(nic_list)} NICs x {streams} streams")
    nic_list = [nic for nic in nic_list for _ in range(streams)]
    max_message_size = as_index(max_message_size, "max_message_size", lo=0, hi=1 << 31)
    message_slots = as_index(message_slots, "message_slots", lo=1, hi=1 << 16)
    max_peers = as_index(max_peers, "max_peers", lo=1, hi=1 << 20)
    max_in_flight = as_index(max_in_flight, "max_in_flight", lo=16, hi=1 << 24)
    stripe_min = as_index(stripe_min, "stripe_min", lo=1)
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidArgument(f"retry must be an aiote.RetryPolicy, not {type(retry).__name__}")
    base_port = 0 if port is None else as_index(port, "port", lo=1, hi=65536 - len(nic_list))
    if same_host is not None and (not isinstance(same_host, str) or not same_host):
        raise InvalidArgument("same_host must be a provider name such as 'shm', or None")
    if not (spin_us >= 0 and math.isfinite(spin_us)):
        raise InvalidArgument("spin_us must be >= 0")
    if not (loop_spin_us >= 0 and math.isfinite(loop_spin_us)) or loop_spin_us > 100_000:
        raise InvalidArgument("loop_spin_us must be between 0 and 100000")
    stage_chunk = as_index(stage_chunk, "stage_chunk", lo=4096)
    if tcp_send_buffer is not None:
        tcp_send_buffer = as_index(tcp_send_buffer, "tcp_send_buffer", lo=0, hi=1 << 30)
    host_arena = as_index(host_arena, "host_arena", lo=0, hi=1 << 46)
    if pollers is not None:
        pollers = as_index(pollers, "pollers", lo=1, hi=17)
    watch_interval_us = as_index(watch_interval_us, "watch_interval_us", lo=1, hi=1_000_001)
    known = isinstance(gpu_backend, str) and (
        gpu_backend in ("cuda", "host") or gpu_backend.startswith("host:")
    )
    if not known:
        raise InvalidArgument("gpu_backend must be 'cuda' or 'host'")
    slot_size = max_message_size + 4096  # room for the sender's address
    h, rails, arena = await anyio.to_thread.run_sync(
        partial(
            _open_native,
            provider,
            nic_list,
            slots=message_slots,
            slot_size=slot_size,
            spin_ns=int(spin_us * 1000),
            sleep_ms=int(sleep_ms),
            max_in_flight=max_in_flight,
            same_host=same_host,
            base_port=base_port,
            watch_us=watch_interval_us,
            direct=bool(same_host_direct),
            sndbuf=tcp_send_buffer,
            arena=host_arena,
            pollers=pollers,
        )
    )
    engine = Engine(
        h,
        rails,
        cancel_grace=cancel_grace,
        post_budget_ns=int(post_budget_us * 1000),
        max_message_size=max_message_size,
        loop_spin_ns=int(loop_spin_us * 1000),
        same_host=same_host,
        stripe_min=stripe_min,
        retry=retry,
        gpu_backend=gpu_backend,
        stage_chunk=stage_chunk,
        gpu_ipc=bool(gpu_ipc),
        gpu_direct=None if gpu_direct is None else bool(gpu_direct),
        streams=streams,
        same_host_direct=bool(same_host_direct),
        arena=arena,
        message_slots=message_slots,
        max_peers=max_peers,
    )
    try:
        await engine._start()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await engine.aclose()
        raise
    engine._log.debug("engine open", provider=provider, nics=[r.domain for r in rails])
    try:
        yield engine
    finally:
        await engine.aclose()
