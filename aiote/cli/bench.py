"""``aiote bench``: transfer figures from Python, each beside the same case measured in the
same run by the C core alone (``cdeps/bench/aiote_cbench``, the same ``cdeps/`` code driven
without Python), with the ratio.

Modes: ``write`` (one-sided writes with an immediate), ``read`` (one-sided READs),
``sendrecv`` (two-sided messages: throughput and an 8-byte round trip), ``paged``
(``write_paged``), ``imm-latency`` (WriteImm ping-pong), ``all``. Sweeps: ``--sizes``,
``--window``, ``--provider``, ``--nics`` (repeatable), ``--loop`` (comma-separated lists).

By default both sides run on this host: the command spawns its serving side
(``aiote bench --listen`` in a child process). ``--listen`` on one host and ``--connect
ADDRESS`` on another runs across hosts; the C baseline then runs between the same two hosts
(the serving side starts the C bench's peer on request).

GB/s are 1e9 B/s; each figure is the median of ``--repeats`` runs, printed with its spread
(min-max). In each repeat the C core and aiote run the case back to back (in turn first), and
the ratio is the median over the repeats of that repeat's aiote / C core (the ratio of the
medians is in the JSON too): the machine's speed drifts between repeats more than between two
runs in a row. Warns when other processes kept the CPU more than 10 % busy before, during or after
the run, or the hypervisor took more than 10 % (steal).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio

import aiote
from aiote._core._engine import KNOWN_PROVIDERS, auto_pollers, available_providers
from aiote._spawn import child_env, python_module
from aiote.testing import ready_line, stop_process

from . import _benchfloor, _benchout, _observe
from ._benchnet import (
    READY,
    Remote,
    bench_same_host,
    build_cbench,
    c_provider_args,
    c_run,
    cpu_busy,
    host_of,
    proc_stat,
    serve,
    tuning,
)
from ._benchpy import CPU_WRITER, CPU_WRITER_MAIN, TRANSFERS, Case, lanes_of, py_case

__all__ = ["add_arguments", "main", "parse_size"]

WINDOW = 64
THROUGHPUT = ("write", "read", "sendrecv", "paged")
LATENCY = ("imm-latency", "sendrecv-latency")
ORDER = ("write", "read", "sendrecv", "paged", "imm-latency", "sendrecv-latency")
WINDOWED = ("write", "read", "sendrecv")
MSG_SLOTS = 16  # the engine's default message_slots: sends in flight at most

MODES = ("write", "read", "sendrecv", "paged", "imm-latency", "sendrecv-latency", "all")
# (sendrecv: message throughput and the 8-byte send/recv ping-pong; sendrecv-latency: the latter alone)
Config = tuple[str, tuple[str, ...] | None, str]  # provider, NICs, event loop


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``4KiB``, ``64k``, ``1MiB``, ``1.5G`` (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


class _OthersCpu:
    """What other processes took of the CPU while the run went on: the machine's user, nice and
    system time (``/proc/stat``) minus this process's and its waited-for children's (the
    peer, the C bench: ``os.times``), as a share of every core over the interval; and the
    hypervisor's steal time on its own. A lower bound: interrupt and softirq time stay out
    (loopback networking charges its own work there, to no process), and so does any other
    process's share of them."""

    def __init__(self) -> None:
        self._t0, self._busy0, self._steal0, self._own0 = time.monotonic(), *self._machine(), self._own()

    @staticmethod
    def _machine() -> tuple[float, float]:
        v = proc_stat()
        hz = os.sysconf("SC_CLK_TCK")
        return (v[0] + v[1] + v[2]) / hz, (v[7] if len(v) > 7 else 0) / hz

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def shares(self) -> tuple[float, float]:
        """(others' share, steal share) of all the cores since this was made."""
        busy, steal = self._machine()
        cores = (time.monotonic() - self._t0) * (os.cpu_count() or 1)
        others = busy - self._busy0 - (self._own() - self._own0)
        return max(0.0, others) / max(cores, 1e-9), (steal - self._steal0) / max(cores, 1e-9)


# ---------------------------------------------------------------------------- the C core's arguments

def _on_off(text: str) -> bool:
    """``on`` or ``off`` (``--follow-loop``, ``--combine``)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, not {text!r}")
    return text == "on"


def c_args(args: argparse.Namespace, case: Case) -> list[str]:
    """The C bench's arguments for the same case (and the same tcp send buffers, arenas and
    their copy threads, connections per NIC and poller threads)."""
    # arena copies of 8 MiB or more are made by as many threads as aiote's engines use
    arena = []
    if args.arena and case[0] in TRANSFERS:
        threads = args.copy_threads if args.copy_threads is not None else aiote.default_copy_threads()
        arena = ["--arena", "--copy-threads", str(threads)]
    copy = ["--copy-out"] if args.c_copy_out and case[0] in ("sendrecv", "sendrecv-latency") else []
    if args.c_in_place and case[0] == "sendrecv":
        copy.append("--in-place")
    return _c_case_args(args, case) + _sndbuf_args(args) + arena + copy + _rails_args(args, case[0])


def config_streams(args: argparse.Namespace, config: Config) -> int:
    """The streams both sides' engines (and the C core) use for ``config``: ``--streams``,
    else aiote's default for its provider and NICs (:func:`aiote.default_streams`)."""
    provider, nics, _ = config
    return int(args.streams) if args.streams is not None else aiote.default_streams(provider, nics)


def _rails_args(args: argparse.Namespace, mode: str) -> list[str]:
    """Writes and reads: the C bench opens as many connections (``--streams``) and poller
    threads as aiote's engines (``pollers``, or aiote's default for that many rails)."""
    if mode not in TRANSFERS:
        return []
    pollers = args.pollers if args.pollers is not None else auto_pollers(args.streams)
    out = ["--streams", str(args.streams)] if args.streams != 1 else []
    return out + (["--pollers", str(min(pollers, args.streams))] if pollers != 1 else [])


def _sndbuf_args(args: argparse.Namespace) -> list[str]:
    return [] if args.tcp_send_buffer is None else ["--sndbuf", str(args.tcp_send_buffer)]


def _transfer_shape(args: argparse.Namespace, size: int, window: int) -> tuple[int, int, int]:
    """A write or read case as the C bench runs it: (requests in flight, bytes in all, per batch)."""
    lanes, per = lanes_of(window)
    inflight = lanes * per
    return inflight, max(args.total, size * inflight), per


def _c_case_args(args: argparse.Namespace, case: Case) -> list[str]:
    mode, size, window = case
    if mode in TRANSFERS:
        inflight, total, per = _transfer_shape(args, size, window)
        return [mode, str(size), str(inflight), str(total), "--batch", str(per)]
    if mode == "sendrecv":
        return [mode, str(size), str(window), str(max(args.total, size * min(window, MSG_SLOTS)))]
    if mode == "paged":
        return ["paged", str(size), str(args.pages), str(args.calls)]
    low = ["--spin-ns", "1000000", "--loop-poll-ns", "500000", "--await-write"] if args.low_latency else []
    return ["pingpong" if mode == "imm-latency" else "msgpingpong", str(args.iters), *low]


def sockets_args(args: argparse.Namespace, case: Case) -> list[str] | None:
    """The C bench's bare-socket run for a write case over tcp (``aiote_cbench sockets``: the
    same sizes, messages in flight and buffers over one plain TCP connection, no libfabric):
    the kernel's ceiling for one connection, or None where it does not apply (other modes,
    arenas)."""
    mode, size, window = case
    if mode != "write" or args.arena:
        return None
    inflight, total, _ = _transfer_shape(args, size, window)
    return ["sockets", str(size), str(inflight), str(total), *_sndbuf_args(args)]


def _c_values(mode: str, r: dict[str, Any], size: int) -> dict[int, float]:
    if mode in LATENCY:
        return {50: float(r["p50_us"]), 99: float(r["p99_us"])}
    if mode == "write" and "writer_main_cpu_s" in r:
        gb = float(r["total_bytes"]) / 1e9
        return {size: float(r["gbps"]), CPU_WRITER: float(r["writer_cpu_s"]) / gb,
                CPU_WRITER_MAIN: float(r["writer_main_cpu_s"]) / gb}
    return {size: float(r["gbps"])}


# ---------------------------------------------------------------------------- one configuration


Figures = dict[tuple[Case, int], float]


async def run_config(
    args: argparse.Namespace, config: Config, cases: list[Case], with_c: bool, progress: _benchout.Progress,
    c_first: bool = True, observe: aiote.Observability | None = None,
) -> tuple[Figures, Figures, Figures]:
    """Runs every case once on one (provider, NICs, loop): Python figures, and (``with_c``)
    the C core's figures and, for tcp writes, the bare sockets' (:func:`sockets_args`),
    interleaved case by case: the C core and aiote back to back (the C core first when
    ``c_first``, else aiote: repeats alternate, so neither always runs on the heels of the
    other), the bare sockets after both."""
    provider, nics, loop = config
    args = argparse.Namespace(**{**vars(args), "streams": config_streams(args, config)})
    same_host = bench_same_host(provider)
    py: Figures = {}
    cc: Figures = {}
    sk: Figures = {}
    proc = None
    try:
        if args.connect:
            address = bytes.fromhex(args.connect)
        else:
            proc = await anyio.open_process(_server_cmd(args, provider, nics), stdin=None, stderr=None,
                                            env=child_env())
            address = bytes.fromhex((await ready_line(proc, READY, 60)).split()[1])
        async with aiote.open_engine(
            provider, list(nics) if nics else None, same_host=same_host, max_message_size=args.max_message,
            observe=observe,
            **tuning(args.low_latency, args.streams, args.tcp_send_buffer, args.pollers, args.follow_loop,
                     args.combine, args.copy_threads),
        ) as e:
            remote = Remote(e, address)
            hello = await remote.call(op="hello")
            limit = min(args.max_message, int(hello["max_message"]))
            try:
                for case in cases:
                    mode, size, window = case
                    if mode == "sendrecv" and size > limit:
                        continue
                    what = _benchout.case_label(mode, size, window)
                    where = f"{provider} {','.join(nics) if nics else ''} {loop}".replace("  ", " ")
                    for side in ("c", "py") if c_first else ("py", "c"):
                        if side == "c" and with_c:
                            progress.step(f"C core  {what} ({where})")
                            cargs = c_args(args, case)
                            r = await _c_remote(remote, address, args.connect, cargs, provider, nics)
                            for k, v in _c_values(mode, r, size).items():
                                cc[(case, k)] = v
                            progress.advance()
                        elif side == "py":
                            progress.step(f"aiote   {what} ({where})")
                            for k, v in (await py_case(remote, args, case)).items():
                                py[(case, k)] = v
                            progress.advance()
                    family = _floor_family(args, provider, mode)
                    if family:
                        progress.step(f"sockets {what} ({where}, {loop} alone)")
                        sk.update(await _loop_floor(args, loop, family, case, what))
                        progress.advance()
                    bare = sockets_args(args, case) if with_c and provider == "tcp" else None
                    if bare:  # after both: the C core and aiote run back to back
                        progress.step(f"sockets {what} ({where})")
                        try:
                            r = await _c_remote(remote, address, args.connect, bare, provider, nics)
                            sk[(case, size)] = float(r["gbps"])
                        except RuntimeError as exc:  # a baseline, not a result: the run goes on
                            sys.stderr.write(f"no bare-socket figure for {what}: {exc}\n")
                        progress.advance()
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await remote.call(10, op="exit", stop=proc is not None)
    finally:
        if proc is not None:
            await stop_process(proc)
    return py, cc, sk


def _server_cmd(args: argparse.Namespace, provider: str, nics: tuple[str, ...] | None) -> list[str]:
    """The command of the benchmark's server process: the same engine options as this side."""
    tuned = [] if args.tcp_send_buffer is None else ["--tcp-send-buffer", str(args.tcp_send_buffer)]
    if args.pollers is not None:
        tuned += ["--pollers", str(args.pollers)]
    if args.copy_threads is not None:
        tuned += ["--copy-threads", str(args.copy_threads)]
    if args.follow_loop is not None:
        tuned += ["--follow-loop", "on" if args.follow_loop else "off"]
    if args.combine is not None:
        tuned += ["--combine", "on" if args.combine else "off"]
    cmd = python_module("aiote", "bench", "--listen", "--once", "--provider", provider,
                        "--max-message", str(args.max_message), "--streams", str(args.streams),
                        *tuned) + (["--low-latency"] if args.low_latency else [])
    if nics:
        cmd += ["--nics", ",".join(nics)]
    return cmd


def _floor_family(args: argparse.Namespace, provider: str, mode: str) -> str | None:
    """The plain socket a case's event-loop reference runs on (:mod:`._benchfloor`): latency
    cases on tcp or shm, both sides on this host; None: none for this case."""
    return _benchfloor.family_of(provider) if mode in LATENCY and not args.connect else None


async def _loop_floor(args: argparse.Namespace, loop: str, family: str, case: Case, what: str) -> Figures:
    """A latency case's bare-socket figures: ``loop`` alone playing the 8-byte ping-pong over
    a plain socket of ``family`` (:mod:`._benchfloor`), p50 and p99 one way; none (and a note
    on stderr) if it fails: a baseline, not a result."""
    try:
        got = await anyio.to_thread.run_sync(partial(_benchfloor.floor_run, loop, family, args.iters))
    except RuntimeError as exc:
        sys.stderr.write(f"no bare-socket figure for {what}: {exc}\n")
        return {}
    return {(case, 50): got["p50_us"], (case, 99): got["p99_us"]}


async def _c_remote(
    remote: Remote, address: bytes, connect: str | None, cargs: list[str], provider: str,
    nics: tuple[str, ...] | None,
) -> dict[str, Any]:
    """One C bench run on this host (it forks its peer), or, with ``--connect``, against a
    peer that the serving side starts on request; its JSON result."""
    full = cargs + c_provider_args(provider, nics)
    if connect:
        port = (await remote.call(op="cbench", args=cargs))["port"]
        full += ["--connect", f"{host_of(address)}:{port}"]
    return await anyio.to_thread.run_sync(partial(c_run, *full))


# ---------------------------------------------------------------------------- command line


def settings(**overrides: Any) -> argparse.Namespace:
    """``aiote bench``'s settings as its command line gives them with no argument, with
    ``overrides``: what a benchmark passes to :func:`c_args` (every option present, so a new
    one never breaks it). ValueError for a name that is not an option."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ns = ap.parse_args([])
    unknown = sorted(set(overrides) - set(vars(ns)))
    if unknown:
        raise ValueError(f"not aiote bench settings: {', '.join(unknown)}")
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``aiote bench`` options."""
    ap.add_argument("mode", nargs="?", default="all",
                    help=f"{', '.join(MODES)}, or several: write,read (default: all)")
    ap.add_argument("--sizes", default="64KiB,1MiB", help="transfer sizes, e.g. 4KiB,64KiB,1MiB")
    ap.add_argument("--page-sizes", default="4KiB,64KiB", help="paged-write page sizes")
    ap.add_argument("--window", default=str(WINDOW),
                    help="operations in flight, or a sweep: 16,64 (sendrecv: at most 16 messages)")
    ap.add_argument("--total", type=parse_size, default=1 << 30, help="bytes per throughput case")
    ap.add_argument("--pages", type=int, default=10_000, help="pages per paged call")
    ap.add_argument("--calls", type=int, default=3, help="paged calls per case")
    ap.add_argument("--iters", type=int, default=2000, help="ping-pong round trips (latency)")
    ap.add_argument("--provider", default="tcp",
                    help="tcp, shm, verbs, efa (what `aiote info` lists), or a sweep: tcp,shm")
    ap.add_argument("--nics", action="append", default=None,
                    help="comma-separated NICs of one engine (default lo for tcp); repeat to sweep")
    ap.add_argument("--loop", default="asyncio", help="asyncio, uvloop, trio, or a sweep: asyncio,trio")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-message", type=parse_size, default=1 << 20,
                    help="largest sendrecv message (engines' max_message_size); larger sizes are skipped")
    ap.add_argument("--json", dest="json_file", help="write the results to this file")
    ap.add_argument("--plot", dest="plot_file", help="draw throughput and latency to this PNG (matplotlib)")
    net = ap.add_mutually_exclusive_group()
    net.add_argument("--listen", action="store_true",
                     help="serve as the other side for a --connect on another host (prints its address)")
    net.add_argument("--connect", metavar="ADDRESS",
                     help="run against an `aiote bench --listen` (the address it printed)")
    ap.add_argument("--port", type=int, default=None, help="--listen on tcp: listen on this port")
    ap.add_argument("--low-latency", action="store_true",
                    help="both sides' engines in aiote's low-latency setting (spin_us=1000, "
                         "loop_spin_us=500: the loop thread polls while it waits); the C core "
                         "waits the same way")
    ap.add_argument("--streams", type=int, default=None,
                    help="connections per NIC of both sides' engines (open_engine(streams=N)): writes "
                         "of at least 1 MiB are split across them while fewer are in flight than "
                         "streams; the C core's writes and reads take them in turn; default: "
                         "aiote.default_streams (on tcp with one NIC 2, or 4 on 16 cores or more; else 1)")
    ap.add_argument("--pollers", type=int, default=None, metavar="N",
                    help="poller threads of both sides' engines (open_engine(pollers=N)); default: "
                         "aiote's (one per rail, up to the cores, at least two); the C core's the same")
    ap.add_argument("--copy-threads", type=int, default=None, metavar="N",
                    help="threads that make one large copy into or out of a same-host peer's host "
                         "arena, both sides' engines (open_engine(copy_threads=N)) and the C core's; "
                         "default: aiote.default_copy_threads (2, or 4 on 16 cores or more)")
    ap.add_argument("--follow-loop", type=_on_off, default=None, metavar="on|off",
                    help="both sides' engines: poller 0 keeps to the event loop's CPU or not "
                         "(open_engine(follow_loop=...)); default: aiote's (on at most 2 CPUs)")
    ap.add_argument("--combine", type=_on_off, default=None, metavar="on|off",
                    help="both sides' engines: concurrent sends to one peer travel as one message or "
                         "not (open_engine(combine_messages=...)); default: aiote's (on)")
    ap.add_argument("--c-copy-out", action="store_true",
                    help="sendrecv: the C core's receiver copies each message out of its slot into a "
                         "fresh allocation, as Engine.recv does (where the rest of the gap lies)")
    ap.add_argument("--c-in-place", action="store_true",
                    help="sendrecv: the C core sends each message from its buffer, not copied into a "
                         "send slot, as Engine.send does with a bytes payload over 16 KiB")
    ap.add_argument("--tcp-send-buffer", type=parse_size, default=None, metavar="SIZE",
                    help="SO_SNDBUF of both sides' tcp connections (open_engine(tcp_send_buffer=)), "
                         "and the C core's the same; 0: the kernel's autotuning; default: aiote's "
                         "(512 KiB on same-host connections)")
    ap.add_argument("--arena", action="store_true",
                    help="write, read: both sides' buffers from their engines' host arenas "
                         "(Engine.alloc_host; same-host peers memcpy into them), and the C core's the same")
    ap.add_argument("--observe", action="store_true",
                    help="the cost of observability: write and imm-latency (or the modes given) with "
                         "metrics, and metrics and tracing, against neither, paired in one run")
    _observe.add_arguments(ap)
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)


def _cpu_medians(figures: dict[Any, dict[int, float]], key: tuple[Any, ...]) -> dict[str, float] | None:
    """A write row's CPU seconds per GB (medians over the repeats): ``writer`` (the writing
    process) and ``writer_main`` (its posting thread: aiote's event loop, the C core's main
    thread); None when not measured."""
    got = {name: list(figures.get((*key, k), {}).values())
           for name, k in (("writer", CPU_WRITER), ("writer_main", CPU_WRITER_MAIN))}
    return {name: statistics.median(v) for name, v in got.items()} if all(got.values()) else None


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _cases(args: argparse.Namespace, windows: list[int]) -> list[Case]:
    sizes = [parse_size(s) for s in _split(args.sizes)]
    modes = _split(args.mode)
    want = ORDER if "all" in modes else [
        w for m in modes for w in {"sendrecv": ("sendrecv", "sendrecv-latency")}.get(m, (m,))
    ]
    cases: list[Case] = []
    for mode in ORDER:
        if mode not in want:
            continue
        if mode in WINDOWED:  # sendrecv: no more sends in flight than message slots
            ws = sorted({min(w, MSG_SLOTS) for w in windows}) if mode == "sendrecv" else windows
            cases += [(mode, s, w) for w in ws for s in sizes]
        elif mode == "paged":
            cases += [("paged", parse_size(s), 0) for s in _split(args.page_sizes)]
        else:
            cases.append((mode, 0, 0))
    return cases


def _machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    from aiote._native import lib

    fv = int(lib.aio_fabric_version())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "libfabric": f"{fv >> 16}.{fv & 0xFFFF}"}


def _check(args: argparse.Namespace, providers: list[str], loops: list[str]) -> str | None:
    modes = _split(args.mode)
    bad = [m for m in modes if m not in MODES] if modes else [args.mode]
    if bad:
        return f"unknown mode {bad[0]!r} ({', '.join(MODES)}; several: write,read)"
    have = available_providers(tuple(dict.fromkeys([*KNOWN_PROVIDERS, *providers])))
    for p in providers:
        if p not in have:
            return (f"provider {p!r} is not usable here (libfabric offers no RDM endpoint with RMA and "
                    f"remote CQ data for it); available: {', '.join(have) or 'none'} (see `aiote info`)")
    for lp in loops:
        if lp not in ("asyncio", "uvloop", "trio"):
            return f"unknown event loop {lp!r} (asyncio, uvloop, trio)"
        if lp != "asyncio" and importlib.util.find_spec(lp) is None:
            return f"--loop {lp} needs {lp}: pip install {lp}"
    if args.streams is not None and not 1 <= args.streams <= 8:
        return f"--streams must be between 1 and 8, not {args.streams}"
    if args.pollers is not None and not 1 <= args.pollers <= 16:
        return f"--pollers must be between 1 and 16, not {args.pollers}"
    if args.copy_threads is not None and not 1 <= args.copy_threads <= 8:
        return f"--copy-threads must be between 1 and 8, not {args.copy_threads}"
    if args.connect and (len(providers) > 1 or len(args.nics or []) > 1):
        return "--connect measures one provider and one set of NICs (the serving side's)"
    if args.connect:
        try:
            aiote.EngineAddress.from_bytes(bytes.fromhex(args.connect))
        except ValueError as exc:
            return f"--connect wants the address `aiote bench --listen` printed: {exc}"
    if args.plot_file:
        return _benchout.plot_unavailable()
    return None


ByRepeat = dict[tuple[Any, ...], dict[int, float]]  # a figure per repeat, by (config, case, key)


def main(args: argparse.Namespace) -> int:
    """Runs ``aiote bench``; returns the exit status."""
    providers, loops = _split(args.provider), _split(args.loop)
    why = _check(args, providers, loops)
    if why:
        sys.stderr.write(f"aiote bench: {why}\n")
        return 2
    nic_sets: list[tuple[str, ...] | None] = [tuple(_split(n)) for n in args.nics] if args.nics else [None]
    exporter = _observe.Exporter(args, "bench")  # --metrics-port, --trace-dir
    observe = exporter.observe
    try:
        return _main(args, providers, loops, nic_sets, observe)
    finally:
        exporter.close()


def _main(
    args: argparse.Namespace, providers: list[str], loops: list[str], nic_sets: list[tuple[str, ...] | None],
    observe: aiote.Observability | None,
) -> int:
    if args.listen:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends serving
            anyio.run(lambda: serve(providers[0], nic_sets[0], port=args.port, once=args.once,
                                    max_message=args.max_message, low_latency=args.low_latency,
                                    streams=args.streams, tcp_send_buffer=args.tcp_send_buffer,
                                    pollers=args.pollers, observe=observe,
                                    follow_loop=args.follow_loop, combine=args.combine,
                                    copy_threads=args.copy_threads))
        return 0
    windows = [int(w) for w in _split(args.window)]
    cases = _cases(args, windows)
    if any(m == "sendrecv" and s > args.max_message for m, s, _ in cases):
        sys.stderr.write(f"note: sendrecv sizes above --max-message ({args.max_message} B) are skipped\n")
    configs: list[Config] = [(p, n, lp) for p in providers for n in nic_sets for lp in loops]
    busy = cpu_busy()
    if busy > 0.10:
        sys.stderr.write(f"warning: the CPU was {busy:.0%} busy before the run: figures will be noisy\n")
    why_no_c = build_cbench()
    if why_no_c:
        sys.stderr.write(f"no C baseline: {why_no_c}\n")
    n_bare = sum(sockets_args(args, case) is not None for case in cases) if "tcp" in providers else 0
    per_c = (len(cases) * len(providers) + n_bare) * len(nic_sets)  # C core runs, bare-socket runs
    n_floor = sum(bool(_floor_family(args, p, m)) for p, _, _ in configs for m, _, _ in cases)
    per_run = len(cases) * len(configs) + (0 if why_no_c else per_c) + n_floor
    progress = _benchout.Progress(per_run * args.repeats)
    during = _OthersCpu()
    py, cc, sk = _measure(args, configs, cases, loops, why_no_c, progress, observe)
    rows = [row for config in configs for row in _rows(args, config, cases, py, cc, sk)]
    others, steal, after = _noise_after(during)
    result = {
        "provider": providers[0] if len(providers) == 1 else providers,
        "window": windows[0] if len(windows) == 1 else windows,
        "loop": loops[0] if len(loops) == 1 else loops,
        "nics": [list(n) if n else None for n in nic_sets],
        "repeats": args.repeats,
        "setting": "low-latency" if args.low_latency else "default",
        "streams": args.streams,
        "pollers": args.pollers,
        "copy_threads": aiote.default_copy_threads() if args.copy_threads is None else args.copy_threads,
        "follow_loop": aiote.follow_loop_default() if args.follow_loop is None else args.follow_loop,
        "combine_messages": True if args.combine is None else args.combine,
        "c_copy_out": args.c_copy_out,
        "c_in_place": args.c_in_place,
        "tcp_send_buffer": args.tcp_send_buffer,
        "arena": args.arena,
        "connect": args.connect,
        "cpu_busy_before": busy,
        "cpu_busy_after": after,
        "cpu_others_during": others,
        "cpu_steal_during": steal,
        "c_baseline": why_no_c is None,
        "aiote": aiote.__version__,
        "machine": _machine(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    _benchout.print_table(result)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2))
    if args.plot_file:
        _benchout.plot(result, args.plot_file)
        sys.stderr.write(f"plot: {args.plot_file}\n")
    print(json.dumps(result))
    return 0


def _measure(
    args: argparse.Namespace, configs: list[Config], cases: list[Case], loops: list[str],
    why_no_c: str | None, progress: _benchout.Progress, observe: aiote.Observability | None = None,
) -> tuple[ByRepeat, ByRepeat, dict[tuple[Any, ...], list[float]]]:
    """Every repeat of every config, each in its own event loop: the figures of aiote and of
    the C core by repeat (the ratio pairs each aiote figure with the C core's of the same
    repeat), and the bare sockets' figures."""
    py: ByRepeat = {}
    cc: ByRepeat = {}
    sk: dict[tuple[Any, ...], list[float]] = {}
    try:
        for rep in range(args.repeats):
            for config in configs:
                provider, nics, loop = config
                backend, options = loop, {}
                if loop == "uvloop":
                    backend, options = "asyncio", {"use_uvloop": True}
                with_c = not why_no_c and loop == loops[0]
                got_py, got_c, got_sk = anyio.run(
                    run_config, args, config, cases, with_c, progress, rep % 2 == 0, observe,
                    backend=backend, backend_options=options,
                )
                for (case, k), v in got_py.items():
                    py.setdefault((config, case, k), {})[rep] = v
                for (case, k), v in got_c.items():
                    cc.setdefault((provider, nics, case, k), {})[rep] = v
                for (case, k), v in got_sk.items():
                    sk.setdefault(_bare_key(config, case, k), []).append(v)
    finally:
        progress.close()
    return py, cc, sk


def _bare_key(config: Config, case: Case, k: int) -> tuple[Any, ...]:
    """Where a bare-socket figure is kept: a write's (C, measured with the first loop only) by
    provider and NICs, a latency row's (the event loop's own ping-pong) by the whole config."""
    provider, nics, _ = config
    return (config, case, k) if case[0] in LATENCY else (provider, nics, case, k)


def _rows(
    args: argparse.Namespace, config: Config, cases: list[Case], py: ByRepeat, cc: ByRepeat,
    sk: dict[tuple[Any, ...], list[float]],
) -> list[dict[str, Any]]:
    """The result rows of one config: one per case and figure (p50 and p99 on latency rows)."""
    provider, nics, loop = config
    rows = []
    for case in cases:
        mode, size, window = case
        keys = [50, 99] if mode in LATENCY else [size]
        for k in keys:
            p_runs = py.get((config, case, k))
            if not p_runs:
                continue
            c_runs = cc.get((provider, nics, case, k), {})
            p, c = list(p_runs.values()), list(c_runs.values())
            pairs = [v / c_runs[i] for i, v in p_runs.items() if c_runs.get(i)]
            reps = range(args.repeats)
            bare = sk.get(_bare_key(config, case, k), [])
            # figures in the row's unit, named by it: py_us / c_us (one-way microseconds) on
            # latency rows, py_gbps / c_gbps (and the bare sockets') on throughput rows
            unit = "us" if mode in LATENCY else "gbps"
            row: dict[str, Any] = {
                "mode": mode,
                "size": k,
                "unit": "us" if mode in LATENCY else "GB/s",
                "provider": provider,
                "nics": list(nics) if nics else None,
                "loop": loop,
                "setting": "low-latency" if args.low_latency else "default",
                "streams": config_streams(args, (provider, nics, loop)),
                "pollers": args.pollers,
                "tcp_send_buffer": args.tcp_send_buffer,
                "memory": "arena" if args.arena and mode in TRANSFERS else "numpy",
                "window": window or None,
                f"py_{unit}": statistics.median(p),
                "py_spread": [min(p), max(p)],
                f"c_{unit}": statistics.median(c) if c else None,
                "c_spread": [min(c), max(c)] if c else None,
            }
            # bare sockets: one plain TCP connection's GB/s (C, tcp writes), or the event loop's own
            # ping-pong over a plain socket (latency rows, under the row's loop: _benchfloor)
            if unit == "gbps" or bare:
                row[f"sockets_{unit}"] = statistics.median(bare) if bare else None
                row["sockets_spread"] = [min(bare), max(bare)] if bare else None
            # the ratio: the median over the repeats of each repeat's aiote / C core (run
            # back to back), which the machine's drift between repeats does not move as it
            # moves the medians; the ratio of the medians beside it. The runs are listed by
            # repeat (None where that repeat has no figure), so they pair index by index
            row["py_runs"] = [p_runs.get(i) for i in reps]
            row["c_runs"] = [c_runs.get(i) for i in reps] if c_runs else None
            row["ratio"] = statistics.median(pairs) if pairs else None
            row["ratio_ci90"] = _benchout.median_ci(pairs)  # None below 5 repeats
            row["ratio_of_medians"] = row[f"py_{unit}"] / row[f"c_{unit}"] if row[f"c_{unit}"] else None
            if mode == "write":  # the writer's CPU seconds per GB, medians over the repeats
                row["py_cpu_s_per_gb"] = _cpu_medians(py, (config, case))
                row["c_cpu_s_per_gb"] = _cpu_medians(cc, (provider, nics, case))
            rows.append(row)
    return rows


def _noise_after(during: _OthersCpu) -> tuple[float, float, float]:
    """Warns of what made the run's figures noisy; (others' CPU share during the run, the
    hypervisor's steal share, how busy the CPU was after it)."""
    others, steal = during.shares()
    if others > 0.10:
        sys.stderr.write(f"warning: other processes used {others:.0%} of the CPU during the run: "
                         "figures are noisy\n")
    if steal > 0.10:
        sys.stderr.write(f"warning: the hypervisor took {steal:.0%} of the CPU (steal) during the run: "
                         "figures are noisy\n")
    after = cpu_busy()
    if after > 0.10:
        sys.stderr.write(f"warning: the CPU was {after:.0%} busy after the run: figures may be noisy\n")
    return others, steal, after
