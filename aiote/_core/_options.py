"""The options of :func:`open_engine`, grouped by what they tune: the transport (connections,
message slots, posting), the native poller, peers on the same host, and GPU memory.

Each is a frozen dataclass whose fields are :func:`open_engine`'s keyword arguments of the
same name, with the same defaults: ``open_engine(spin_us=0)`` and
``open_engine(poller=PollerOptions(spin_us=0))`` open the same engine. Building one checks
nothing and costs nothing; :func:`open_engine` checks every field (:class:`InvalidArgument`)
before anything is opened. A field given both in an option object and as a keyword is an
error (:class:`InvalidArgument`), so that no setting silently wins over another.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ._errors import InvalidArgument
from ._fabric import _DEFAULT_NIC, default_streams
from ._retry import RetryPolicy
from ._util import as_index

__all__ = ["GpuOptions", "PollerOptions", "SameHostOptions", "TransportOptions"]


class _Unset:
    """The default of open_engine's keyword arguments: "not given" (the option object's, or
    the field's default, holds)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()


@dataclass(frozen=True, kw_only=True)
class TransportOptions:
    """Connections, message slots and posting (``open_engine(transport=...)``)."""

    streams: int | None = None
    """Connections per NIC (1 to 8; each is one more rail on the same NIC, so a peer opened with
    the same ``streams`` is reached over that many connections per NIC). ``None``:
    :func:`default_streams` (2 on tcp with one NIC, 4 there on 16 cores or more, else 1). Every
    connection to a peer is opened when a transfer first reaches it (a zero-byte request in the
    background); until then transfers go whole over the open ones. A write or read of at least
    ``stripe_min`` bytes is split across them while fewer operations are in flight than streams
    (its immediate, if any, follows as one credit once every piece landed); otherwise, and for
    smaller ones, each whole transfer posted by itself takes the stream whose rail has the
    fewest bytes of this engine's writes and reads in flight, to any peer (in turn among equal
    ones; the transfers of one batch, scatter or barrier take the streams in turn, and a write
    repeated with the same arguments reuses its first placement), carrying its immediate, as
    over a single NIC. On tcp two streams move large writes faster where one TCP connection's
    receive path is the limit (loopback); the price is a rail's memory and poller work per
    stream. At most 16 rails (NICs x streams) per engine."""

    stripe_min: int = 1 << 20
    """A single write or read of at least this many bytes is split across the NICs (and
    streams) that reach the peer; smaller ones go round robin over them."""

    port: int | None = None
    """tcp only: the first NIC listens on this port, the next on ``port + 1``, and so on, so
    that a restarted process gets the same address. ``None``: any free port."""

    tcp_send_buffer: int | None = None
    """The send buffer (``SO_SNDBUF``, bytes; the kernel doubles it) of the tcp provider's
    connections. ``None``: 512 KiB on connections to peers on this host (the same IP at both
    ends, as over loopback), the kernel's autotuning elsewhere: loopback tcp otherwise lets
    megabytes queue per connection, which the receiver then copies from memory rather than
    cache (16 MiB writes moved about 40 % faster with it). ``0``: the kernel's autotuning
    everywhere. A positive value: that size on every tcp connection of the engine, other hosts
    included (a fixed buffer caps one connection near buffer / round-trip time). libfabric's
    tcp provider has no setting for it, so the core sets it on the provider's own sockets
    (``aio_engine_set_tcp_sndbuf``). The kernel caps it at ``net.core.wmem_max``."""

    max_message_size: int = 1 << 20
    """The size of the registered message slots for :meth:`Engine.send`/:meth:`Engine.recv`
    (0 to 2 GiB). Costs ``message_slots`` x (this + 4 KiB) of registered memory per NIC."""

    combine_messages: bool = True
    """Sends to one peer that other tasks make while a send to it sits at its schedule point
    right after posting travel as one message, which the receiving engine splits again
    (each still delivered once, in order, as its own message; see :meth:`Engine.send`). It
    moves many small concurrent messages for a fraction of the per-message cost, and costs
    a lone send nothing. ``False``: every send posts a message of its own (what a peer
    running an aiote without combined messages needs: it drops them as malformed)."""

    message_slots: int = 16
    """The count of message slots per NIC, for both directions (1 to 65536): a quarter is
    kept for the engine's own messages, the rest holds messages ``recv`` has not taken (which
    also holds back their senders)."""

    max_in_flight: int = 16384
    """Work requests and groups the native engine can have in flight (16 to 2**24); past it,
    posting waits for completions (backpressure)."""

    post_budget_us: float = 200.0
    """How long one posting call may hold the event loop before it yields to other tasks
    (a large batch is posted in slices of this)."""

    cancel_grace: float = 5.0
    """Seconds a cancelled operation waits for what it already posted to complete before the
    engine gives up on it (its buffers stay held by the engine until then)."""

    max_peers: int = 1024
    """Peer NIC addresses the engine keeps resolved (a peer engine with several NICs or
    streams counts one per NIC; 1 to 2**20); past it, those not used lately are forgotten at
    a quiet moment and cost a new connection when used again (see
    :meth:`Engine.forget_peer`)."""


@dataclass(frozen=True, kw_only=True)
class PollerOptions:
    """The native poller threads and the event-loop side of completions
    (``open_engine(poller=...)``)."""

    spin_us: float = 50.0
    """How long the native poller busy-polls after the last activity before it sleeps on the
    provider's wait object; raise it (e.g. ``1000``) for lower latency at the price of CPU,
    ``0`` to never spin."""

    loop_spin_us: float = 0.0
    """The low-latency setting of the event-loop side (0: off; at most 100000): an operation
    or counter wait that is not complete right after posting drives the completion queues
    from the loop thread itself (a native call, GIL released: it polls for ~30 us, yielding
    the core between polls, then sleeps on the NICs' wait objects) for up to this long, and
    only then sleeps on the event loop: no hand-off through the ring and the eventfd, and a
    completed operation or an available credit returns without a trip through the event loop
    (the poller thread works as usual). It blocks the loop for at most this long per wait, so
    use it where latency matters more than other tasks' fairness (e.g. ``500``); an idle
    engine still sleeps."""

    sleep_ms: int = 100
    """The timed fallback of the sleeping poller."""

    pollers: int | None = None
    """Native poller threads (1 to 16). Rail *i* (a NIC, a stream of one, or the same-host
    rail last) is driven by thread *i* % ``pollers``, so an engine with several rails moves
    data on several cores at once: over tcp one thread copies into one connection at about
    one core's speed, so ``streams=2`` needs two pollers to move more than one connection
    does. Each thread spins only after activity on its own rails, then sleeps. ``None``: one
    per rail, up to the cores this process may use (at least two); more than the rails is
    capped at the rails. :meth:`Engine.stats` reports the count."""

    follow_loop: bool | None = None
    """Poller 0 (the first rail's: messages, the immediates of small transfers, same-host
    copies) keeps to the CPU the event loop last ran on: it pins itself there (looked at every
    2 ms) and gives the pin back once the loop has not read a completion for 100 ms. Each record
    it hands the loop then wakes a thread on its own CPU rather than another, possibly halted,
    CPU: on a 2-vCPU VM two processes' WriteImm ping-pong ran at 36 µs one way in that placement
    and at 71 to 98 µs in the others, which the scheduler otherwise keeps for seconds. While
    poller 0 moves bulk data it keeps to no CPU (such data wants a CPU of its own). The other
    pollers are never pinned. ``None``: on where this process may use at most 2 CPUs
    (:func:`follow_loop_default`), where every thread shares a CPU anyway; off on larger hosts,
    where bulk transfers want poller 0 beside, not on, a busy loop's CPU. Costs a
    ``sched_getcpu`` and a clock read each time the loop drains the completion ring, a clock
    read per poller pass, and an affinity call when the loop moves.
    :meth:`Engine.stats` reports ``poller_cpu`` and ``poller_moves``."""


@dataclass(frozen=True, kw_only=True)
class SameHostOptions:
    """How peers on this host are reached (``open_engine(local=...)``)."""

    same_host: str | None = "shm"
    """An extra provider (one rail) for peers on this host, chosen automatically when both
    engines carry it (``"shm"``: shared memory, about 2.5x tcp loopback); ``None`` keeps
    every peer on the main provider (see :meth:`Engine.route`). Skipped with a log line when
    the provider is not available."""

    same_host_direct: bool = True
    """READs of host memory between two engines on this host that both have an shm rail and
    this setting are copied by the reader's poller thread straight out of the peer's memory
    (``process_vm_readv``), as UCX does, instead of by the target's shm progress. The
    target's checks still hold: the engine publishes each host region's key, bounds and
    access rights in a region table in shared memory; the reader checks them before every
    copy, and unregistering a region waits until copies under way finished (new ones are
    refused). Writes are copied the same way by the writer's poller (``process_vm_writev``),
    or by one ``memcpy`` into a peer's host arena (``host_arena``); a bare immediate, and a
    request that gathers several local pieces, are checked the same way and then go through
    shm. Falls back to shm, with a log line, where the copy is not permitted (ptrace
    restrictions) or the table cannot be opened. ``False``: publish no table and copy nothing
    directly."""

    host_arena: int = 4 << 30
    """Bytes of address space for :meth:`Engine.alloc_host` (only what is allocated and
    touched takes memory): a shared-memory file this engine publishes with its region table,
    which same-host peers map, so that their writes into and reads out of regions allocated
    there are a ``memcpy`` by their poller, the fastest same-host path. ``0``: no arena. Needs
    ``same_host_direct`` and an shm rail; without them, or where the file cannot be created,
    ``alloc_host`` returns ordinary memory (logged)."""

    copy_threads: int | None = None
    """Threads that make one large copy into or out of a same-host peer's host arena (a
    ``memcpy`` of 8 MiB or more, cut in parts of at least 4 MiB): poller 0 and
    ``copy_threads - 1`` helper threads (named ``aiote-copy``), started at the first such
    copy and asleep between copies (1: poller 0 alone). One core's ``memcpy`` leaves memory
    bandwidth unused past the caches, so a host with cores to spare copies faster with more.
    ``None``: :func:`aiote.default_copy_threads` (2; 4 where this process may use 16 cores or
    more). 1 to 8."""


@dataclass(frozen=True, kw_only=True)
class GpuOptions:
    """GPU memory: staging, CUDA IPC, direct registration, the UVM watch
    (``open_engine(gpu=...)``). Nothing GPU-side starts before the first GPU region."""

    gpu_backend: str = "cuda"
    """``"cuda"`` (CuPy); ``"host"`` emulates a GPU on host memory with the same stream
    semantics (for tests on machines without one, with :class:`aiote.testing.HostDeviceArray`)."""

    stage_chunk: int = 4 << 20
    """GPU memory on providers without CUDA support is staged through pinned host memory in
    pieces of this size (at least 4096; the device-to-host copy of one piece overlaps the
    network transfer of the previous)."""

    gpu_ipc: bool = True
    """Same-host GPU peers are written through CUDA IPC (device-to-device); ``False`` stages
    them like remote ones."""

    gpu_direct: bool | None = None
    """Register GPU memory with the NICs themselves (no staging). ``None``: when every NIC's
    provider has ``FI_HMEM``; ``True`` with a provider without it fails at registration."""

    watch_interval_us: int = 100
    """While a GPU completion or a :class:`UvmWatcher` is awaited, the poller reads the
    watched words at least this often (1 us to 1 s; it sleeps otherwise)."""

    ipc_streams: int = 1
    """Streams per GPU that CUDA-IPC writes take in turn (1 to 16). With more than one,
    writes posted together run concurrently on several copy engines, and each completes on
    its own (no order between writes; each write's immediate still follows its own bytes).
    What it gains is measured in docs/weights.md."""


_GROUPS = (
    ("transport", TransportOptions),
    ("poller", PollerOptions),
    ("local", SameHostOptions),
    ("gpu", GpuOptions),
)


def merge_options(
    objects: dict[str, Any], keywords: dict[str, Any]
) -> tuple[TransportOptions, PollerOptions, SameHostOptions, GpuOptions]:
    """The four option objects of :func:`open_engine`: each the one given (``objects``, by
    parameter name; None: not given), else its defaults with the keywords given of its fields
    (``keywords``: every grouped keyword, ``_UNSET`` where not given). InvalidArgument for an
    object of the wrong type or a field given both ways."""
    out: list[Any] = []
    for name, cls in _GROUPS:
        obj = objects[name]
        given = {f.name: keywords[f.name] for f in dataclasses.fields(cls) if keywords[f.name] is not _UNSET}
        if obj is None:
            obj = cls(**given)
        elif not isinstance(obj, cls):
            raise InvalidArgument(f"{name} must be an aiote.{cls.__name__}, not {type(obj).__name__}")
        elif given:
            both = ", ".join(sorted(given))
            raise InvalidArgument(f"{both}: given both as a keyword and in {name}={cls.__name__}(...)")
        out.append(obj)
    t, p, s, g = out
    return t, p, s, g


def check_options(
    provider: Any,
    nics: Any,
    t: TransportOptions,
    p: PollerOptions,
    s: SameHostOptions,
    g: GpuOptions,
    retry: Any,
) -> tuple[list[str | None], TransportOptions, PollerOptions, SameHostOptions, GpuOptions]:
    """Checks everything :func:`open_engine` was given (InvalidArgument, before anything is
    opened); returns the rails' NIC names (each NIC once per stream) and the options with
    every number normalised (ints, ``streams`` resolved)."""
    nic_list = _nic_list(provider, nics)
    streams = t.streams
    if streams is None:
        streams = default_streams(provider, [str(n) for n in nic_list])
    streams = as_index(streams, "streams", lo=1, hi=9)
    if len(nic_list) * streams > 16:
        raise InvalidArgument(f"at most 16 rails per engine: {len(nic_list)} NICs x {streams} streams")
    nic_list = [nic for nic in nic_list for _ in range(streams)]
    t = dataclasses.replace(
        t,
        streams=streams,
        max_message_size=as_index(t.max_message_size, "max_message_size", lo=0, hi=1 << 31),
        message_slots=as_index(t.message_slots, "message_slots", lo=1, hi=1 << 16),
        max_peers=as_index(t.max_peers, "max_peers", lo=1, hi=1 << 20),
        max_in_flight=as_index(t.max_in_flight, "max_in_flight", lo=16, hi=1 << 24),
        stripe_min=as_index(t.stripe_min, "stripe_min", lo=1),
    )
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidArgument(f"retry must be an aiote.RetryPolicy, not {type(retry).__name__}")
    if not isinstance(t.combine_messages, bool):
        raise InvalidArgument("combine_messages must be True or False")
    if t.port is not None:
        t = dataclasses.replace(t, port=as_index(t.port, "port", lo=1, hi=65536 - len(nic_list)))
    if s.same_host is not None and (not isinstance(s.same_host, str) or not s.same_host):
        raise InvalidArgument("same_host must be a provider name such as 'shm', or None")
    if not (p.spin_us >= 0 and math.isfinite(p.spin_us)):
        raise InvalidArgument("spin_us must be >= 0")
    if not (p.loop_spin_us >= 0 and math.isfinite(p.loop_spin_us)) or p.loop_spin_us > 100_000:
        raise InvalidArgument("loop_spin_us must be between 0 and 100000")
    g = dataclasses.replace(g, stage_chunk=as_index(g.stage_chunk, "stage_chunk", lo=4096))
    if t.tcp_send_buffer is not None:
        t = dataclasses.replace(
            t, tcp_send_buffer=as_index(t.tcp_send_buffer, "tcp_send_buffer", lo=0, hi=1 << 30)
        )
    s = dataclasses.replace(s, host_arena=as_index(s.host_arena, "host_arena", lo=0, hi=1 << 46))
    if s.copy_threads is not None:
        s = dataclasses.replace(s, copy_threads=as_index(s.copy_threads, "copy_threads", lo=1, hi=9))
    if p.pollers is not None:
        p = dataclasses.replace(p, pollers=as_index(p.pollers, "pollers", lo=1, hi=17))
    if p.follow_loop is not None and not isinstance(p.follow_loop, bool):
        raise InvalidArgument("follow_loop must be True, False or None")
    watch = as_index(g.watch_interval_us, "watch_interval_us", lo=1, hi=1_000_001)
    g = dataclasses.replace(g, watch_interval_us=watch)
    g = dataclasses.replace(g, ipc_streams=as_index(g.ipc_streams, "ipc_streams", lo=1, hi=17))
    backend = g.gpu_backend
    if not (isinstance(backend, str) and (backend in ("cuda", "host") or backend.startswith("host:"))):
        raise InvalidArgument("gpu_backend must be 'cuda' or 'host'")
    return nic_list, t, p, s, g


def _nic_list(provider: Any, nics: Any) -> list[str | None]:
    """The NICs named (or the provider's default one), checked."""
    if not isinstance(provider, str) or not provider:
        raise InvalidArgument("provider must be a non-empty string such as 'tcp' or 'shm'")
    if nics is None:
        return [_DEFAULT_NIC.get(provider)]
    if isinstance(nics, str):
        raise InvalidArgument("nics must be a list of NIC names, e.g. ['lo']")
    nic_list: list[str | None] = list(nics)
    if not nic_list:
        raise InvalidArgument("nics must name at least one NIC")
    if len(nic_list) > 16:
        raise InvalidArgument("at most 16 NICs per engine")
    return nic_list
