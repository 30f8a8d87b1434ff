"""Opening the native engine: providers, rails, pollers and the host arena."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .._native import ffi, lib
from ._arena import Arena
from ._errors import InvalidArgument, ProviderError
from ._records import RailInfo, _log
from ._wire import _strerror

# libfabric probes every provider it knows at start-up; the C core restricts that first probe to
# the providers aiote can use (unless FI_PROVIDER is set) without changing os.environ (fab_init).

KNOWN_PROVIDERS = ("tcp", "shm", "verbs", "efa")


def available_providers(names: Sequence[str] = KNOWN_PROVIDERS) -> list[str]:
    """Which of ``names`` libfabric offers here with what aiote needs (RDM endpoints, RMA,
    remote CQ data). Costs one provider query each (milliseconds; the first also pays
    libfabric's start-up)."""
    entries = ffi.new("aio_probe_entry[64]")
    return [n for n in names if int(lib.aio_probe(n.encode(), entries, 64)) > 0]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def follow_loop_default() -> bool:
    """``open_engine``'s default ``follow_loop`` (:class:`PollerOptions`): on where this
    process may use at most 2 CPUs."""
    return usable_cores() <= 2


def auto_pollers(rails: int) -> int:
    """``open_engine``'s default ``pollers`` for an engine of ``rails`` rails: one thread per
    rail, up to the cores this process may run on (at least two)."""
    return max(1, min(rails, max(2, usable_cores())))


def _open_native(
    provider: str,
    nics: Sequence[str | None],
    *,
    slots: int,
    slot_size: int,
    spin_ns: int,
    sleep_ms: int,
    max_in_flight: int,
    same_host: str | None = None,
    base_port: int = 0,
    watch_us: int = 100,
    direct: bool = False,
    sndbuf: int | None = None,
    arena: int = 0,
    pollers: int | None = None,
    follow_loop: bool = False,
    copy_threads: int | None = None,
) -> tuple[Any, list[RailInfo], Arena | None]:
    cfg = ffi.new(
        "aio_engine_config*",
        {
            "ring_capacity": 1 << 16,
            "max_ops": max_in_flight,
            "max_groups": max_in_flight,
            "spin_ns": spin_ns,
            "sleep_ms": sleep_ms,
            "base_port": base_port,
            "watch_us": watch_us,
            "follow_loop": int(follow_loop),
        },
    )
    out = ffi.new("aio_engine**")
    err = ffi.new("char[1024]")
    rc = lib.aio_engine_create(cfg, out, err, 1024)
    if rc != 0:
        raise ProviderError(ffi.string(err).decode(errors="replace") or _strerror(-rc))
    h = out[0]
    if sndbuf is not None and lib.aio_engine_set_tcp_sndbuf(h, sndbuf, 1) != 0:
        lib.aio_engine_destroy(h)
        raise InvalidArgument(f"tcp_send_buffer: {sndbuf} not accepted")
    rails: list[RailInfo] = []
    wanted: list[tuple[str, str | None, bool]] = [(provider, nic, True) for nic in nics]
    if same_host is not None and same_host != provider:
        wanted.append((same_host, None, False))
    threads = auto_pollers(len(wanted)) if pollers is None else pollers  # the core caps it at the rails
    copiers = default_copy_threads() if copy_threads is None else copy_threads
    if lib.aio_engine_set_pollers(h, threads) != 0 or lib.aio_engine_set_copy_threads(h, copiers) != 0:
        lib.aio_engine_destroy(h)  # pragma: no cover - checked by open_engine
        raise InvalidArgument(f"pollers: {pollers}, copy_threads: {copy_threads} not accepted")
    try:
        for prov, nic, required in wanted:
            rail = _add_rail(h, prov, nic, required, slots, slot_size)
            if rail is not None:
                rails.append(rail)
        host_arena: Arena | None = None
        if direct and any(r.provider == "shm" for r in rails):
            rc = lib.aio_engine_enable_direct(h, err, 1024)
            if rc != 0:
                _log.info(
                    "direct same-host copies unavailable; same-host peers read through shm",
                    reason=ffi.string(err).decode(errors="replace") or _strerror(-rc),
                )
            elif arena:
                host_arena = _open_arena(h, arena)
        rc = lib.aio_engine_start(h)
        if rc != 0:
            raise ProviderError(f"could not start the poller thread: {_strerror(-rc)}")
    except BaseException:
        lib.aio_engine_destroy(h)
        raise
    return h, rails, host_arena


def _add_rail(
    h: Any, prov: str, nic: str | None, required: bool, slots: int, slot_size: int
) -> RailInfo | None:
    """Adds one rail to the native engine ``h``; None when an optional one (the same-host
    provider) is not available here (logged), ProviderError when a required one is not."""
    err = ffi.new("char[1024]")
    name = nic.encode() if nic else ffi.NULL
    rc = lib.aio_engine_add_rail(h, prov.encode(), name, slots, slot_size, err, 1024)
    if rc < 0:
        why = ffi.string(err).decode(errors="replace") or _strerror(-rc)
        if not required:
            _log.info(
                "same-host provider unavailable; same-host peers use the main provider",
                provider=prov,
                reason=why,
            )
            return None
        if "offers no provider" in why:
            have = available_providers()
            why += (
                f"; available here: {', '.join(have)}" if have else "; no provider is usable here"
            ) + " (`aiote info` lists them with their NICs)"
        raise ProviderError(why)
    info = ffi.new("aio_rail_info*")
    lib.aio_rail_get_info(h, rc, info)
    return RailInfo(
        index=rc,
        provider=ffi.string(info.provider).decode(),
        domain=ffi.string(info.domain).decode(),
        fabric=ffi.string(info.fabric).decode(),
        address=bytes(ffi.buffer(info.addr, info.addr_len)),
        mr_mode=int(info.mr_mode),
        cq_data_size=int(info.cq_data_size),
        max_msg_size=int(info.max_msg_size),
        inject_size=int(info.inject_size),
        has_wait_fd=bool(info.has_wait_fd),
        max_message_size=int(info.slot_size),
    )


def _open_arena(h: Any, size: int) -> Arena | None:
    """The engine's host arena, published in its direct-copy table, or None (logged)."""
    err = ffi.new("char[1024]")
    try:
        arena = Arena(size)
    except OSError as e:
        why = str(e)
    else:
        try:
            rc = lib.aio_engine_set_arena(h, arena.fd, ffi.cast("void*", arena.base), arena.size, err, 1024)
        finally:
            arena.close()  # the core holds its own duplicate; the mapping stays
        if rc == 0:
            return arena
        why = ffi.string(err).decode(errors="replace") or _strerror(-rc)
    _log.info("host arena unavailable; alloc_host returns ordinary memory", reason=why)
    return None


_DEFAULT_NIC = {"tcp": "lo"}


_MANY_CORES = 16  # from this many usable cores: tcp with one NIC opens 4 streams, not 2; 4 copy threads


def default_copy_threads(cores: int | None = None) -> int:
    """The ``copy_threads`` (:class:`SameHostOptions`) that :func:`open_engine` takes when
    none is given: 2, or 4 where this process may use 16 cores or more (``cores``: that
    count, default :func:`usable_cores`). One thread's ``memcpy`` moved about 6 GB/s on the
    32-core Xeon hosts measured, 4 threads 20 GB/s (docs/same-host.md). Raises nothing; O(1)."""
    return 4 if (usable_cores() if cores is None else cores) >= _MANY_CORES else 2


def default_streams(
    provider: str = "tcp", nics: Sequence[str] | None = None, cores: int | None = None
) -> int:
    """The ``streams`` (connections per NIC) that :func:`open_engine` takes when none is
    given: on the ``tcp`` provider with one NIC, 2, or 4 where this process may use 16 cores
    or more (``cores``: that count, default :func:`usable_cores`); 1 otherwise. One TCP
    connection moves large writes at about one core's copy speed and its receive path is the
    limit (docs/topology.md), so a host with cores to spare moves more over more
    connections (each with a poller thread of its own); several NICs already give several
    connections, and shm, verbs and efa do not gain from more. Raises nothing; O(NICs)."""
    count = 1 if nics is None or isinstance(nics, str) else len(list(nics))
    if provider != "tcp" or count != 1:
        return 1
    return 4 if (usable_cores() if cores is None else cores) >= _MANY_CORES else 2
