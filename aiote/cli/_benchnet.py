"""The two sides of ``aiote bench``: the serving side (``aiote bench --listen``, also the
process the command spawns for itself on one host) and the measuring side's view of it.

Everything between the two goes over aiote messages (``Engine.send``/``recv``): a message
whose payload starts with ``{`` is a JSON command answered with a JSON reply carrying the
same ``id``; one starting with ``S`` is bulk data the server only counts (sendrecv
throughput); one starting with ``E`` is sent straight back (sendrecv round trip). The server
also starts the C bench's peer side (``aiote_cbench ... --listen 0``) on request, so the C
core's baseline runs between the same two hosts.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import ipaddress
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

import aiote
from aiote import Engine, EngineAddress, MemoryDescriptor, MemoryRegion
from aiote._native._fabric_paths import libfabric_dirs
from aiote.testing import answer_pings, ready_line

from . import _observe

CDEPS = Path(__file__).resolve().parents[2] / "cdeps"  # a source checkout's C core
CSRC = Path(__file__).resolve().parents[1] / "_native" / "csrc"  # the same sources, in a wheel
CBENCH = CDEPS / "build" / "aiote_cbench"  # where a source checkout builds it
READY = "AIOTE_BENCH_LISTEN"
HUGE_PAGE = 2 << 20
BULK = ord("S")
ECHO = ord("E")
_built: list[Path] = []  # the C bench that build_cbench() made or found


def bench_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` for a benchmark's region, laid out as the C bench lays out its
    own (``posix_memalign`` and ``MADV_HUGEPAGE`` from 4 MiB on): from 4 MiB on it starts on a 2
    MiB boundary inside a larger NumPy block, which NumPy advises for transparent huge pages, so
    every page of it can be a huge one (a plain ``np.empty`` of 4 MiB starts 16 bytes into its
    mapping, and only half of it is). Same-host copies pin the pages they touch, so the layout
    changes their speed; every library's benchmark (``benchmarks/peers``) allocates the same
    way. Smaller arrays: a plain ``np.empty``."""
    if nbytes < 2 * HUGE_PAGE:
        return np.empty(nbytes, np.uint8)
    raw = np.empty(nbytes + HUGE_PAGE, np.uint8)
    off = -raw.ctypes.data % HUGE_PAGE
    return raw[off : off + nbytes]


def bench_array(e: aiote.Engine, nbytes: int, arena: bool, side: str) -> np.ndarray:
    """A benchmark region's array: from ``e``'s host arena (``arena``: what ``aiote bench
    --arena`` measures), else :func:`bench_buffer`. RuntimeError naming ``side`` when the arena
    has no room: ``alloc_host`` would hand out ordinary memory, another route than the one
    measured."""
    if not arena:
        return bench_buffer(nbytes)
    before = e.stats()["arena_bytes"]
    arr = e.alloc_host(nbytes)
    if e.stats()["arena_bytes"] <= before:
        raise RuntimeError(f"{side}'s host arena has no room for {nbytes} B (host_arena)")
    return arr


def cbench() -> Path:
    """The C bench's executable: the one :func:`build_cbench` built (a source checkout's
    ``cdeps/build/aiote_cbench`` until then)."""
    return _built[-1] if _built else CBENCH


def build_cbench() -> str | None:
    """Builds the C bench (``aiote_cbench``: the same C core as the extension, driven without
    Python), or finds it built; returns the reason when it cannot (never raises for a missing
    compiler, ``make`` or libfabric, or an unwritable cache). In a source checkout:
    ``make -C cdeps bench``. In an installed wheel: from the core's sources shipped in
    ``aiote/_native/csrc``, compiled once with ``$CC`` (``cc``) against libfabric
    (``AIOTE_FABRIC_PREFIX``, else pkg-config, else the system paths) into
    ``$XDG_CACHE_HOME/aiote`` (``~/.cache/aiote``), keyed by the sources, compiler and flags.
    Costs a compile (seconds) the first time; blocks the calling thread meanwhile."""
    if (CDEPS / "Makefile").exists():
        # an older executable left from an earlier build is not used: it may hold an older core
        try:
            r = subprocess.run(["make", "-s", "-C", str(CDEPS), "bench"], capture_output=True, text=True,
                               timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"could not build the C bench (no make?): {exc}"
        if r.returncode or not CBENCH.exists():
            return f"could not build the C bench: {r.stderr.strip()[-300:]}"
        _built.append(CBENCH)
        return None
    core = sorted((CSRC / "core").glob("*.c"))  # the core, one file per concern
    bench = sorted((CSRC / "bench").glob("*.c"))  # the bench: aiote_cbench.c (main) and its parts
    srcs = [CSRC / "aiote_core.h", *sorted((CSRC / "core").glob("*.h")), *core,
            *sorted((CSRC / "bench").glob("*.h")), *bench]
    if not core or CSRC / "bench" / "aiote_cbench.c" not in bench or not all(p.exists() for p in srcs):
        return "the C core's sources are neither in a source checkout (cdeps/) nor in this installation"
    cc = shlex.split(os.environ.get("CC") or "cc")  # e.g. "ccache gcc"
    flags = ["-std=gnu11", "-O2", "-pthread", f"-I{CSRC}", *_fabric_cflags()]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in srcs))
    key.update(" ".join([*cc, *flags]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiote"
    exe = cache / f"aiote_cbench-{key.hexdigest()[:16]}"
    if not exe.exists():
        tmp = exe.with_name(f"{exe.name}.{os.getpid()}")
        try:
            cache.mkdir(parents=True, exist_ok=True)
            r = subprocess.run([*cc, *flags, "-o", str(tmp), *map(str, bench), *map(str, core), "-lfabric"],
                               capture_output=True, text=True, timeout=300)
            if r.returncode:
                return f"could not build the C bench: {r.stderr.strip()[-300:]}"
            tmp.replace(exe)  # atomic: a concurrent build leaves one whole executable
        except (OSError, subprocess.SubprocessError) as exc:
            return f"could not build the C bench (no C compiler, or {cache} not writable?): {exc}"
        finally:
            with contextlib.suppress(OSError):  # a cache path that is not a folder, say
                tmp.unlink(missing_ok=True)
    _built.append(exe)
    return None


def _fabric_cflags() -> list[str]:
    """libfabric's include and library flags, found as the extension's build finds them
    (:func:`aiote._native._fabric_paths.libfabric_dirs`); none when it finds nothing (the
    compile then reports what is missing)."""
    try:
        inc, libs = libfabric_dirs()
    except RuntimeError:
        return []
    return [*(f"-I{d}" for d in inc), *(f"-L{d}" for d in libs), *(f"-Wl,-rpath,{d}" for d in libs)]


def proc_stat() -> list[int]:
    """The machine's CPU times in clock ticks (``/proc/stat``'s first line: user, nice, system,
    idle, iowait, irq, softirq, steal, ...). One small file read."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of the whole machine's CPU busy over ``interval`` seconds (sleeps that long;
    before a run, anything busy is someone else)."""
    v0 = proc_stat()
    time.sleep(interval)
    v1 = proc_stat()
    total = sum(v1) - sum(v0)
    return 1 - ((v1[3] + v1[4]) - (v0[3] + v0[4])) / max(1, total)


def c_run(*args: str) -> dict[str, Any]:
    """Runs the C bench (both sides, or one with ``--connect``); its JSON result line."""
    out = subprocess.run([str(cbench()), *args], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"aiote_cbench {' '.join(args)} failed: {out.stderr.strip()[-500:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def c_provider_args(provider: str, nics: Sequence[str] | None) -> list[str]:
    """The C bench's provider options for an engine on ``provider`` over ``nics`` (it drives
    one NIC: the first)."""
    args = ["--provider", provider]
    if nics:
        args += ["--nic", nics[0]]
    elif provider == "tcp":
        args += ["--nic", "lo"]
    return args


def host_of(address: bytes) -> str:
    """The IP address in an engine address's first tcp NIC (where the C bench's peer of a
    ``--listen`` side can be reached); ``127.0.0.1`` when it has none (shm)."""
    for rail in EngineAddress.from_bytes(address).rails:
        a = rail.address
        if len(a) >= 8 and int.from_bytes(a[0:2], "little") == 2:  # sockaddr_in
            ip4 = ipaddress.IPv4Address(a[4:8])
            return "127.0.0.1" if ip4.is_unspecified else str(ip4)
        if len(a) >= 24 and int.from_bytes(a[0:2], "little") == 10:  # sockaddr_in6
            ip6 = ipaddress.IPv6Address(a[8:24])
            return "::1" if ip6.is_unspecified else f"[{ip6}]"
    return "127.0.0.1"


# ---------------------------------------------------------------------------- serving side


class _Server:
    def __init__(self, engine: Engine, tg: anyio.abc.TaskGroup) -> None:
        self.engine = engine
        self.tg = tg
        self.regions: dict[str, MemoryRegion] = {}
        self.sunk = 0
        self.sink_waiter: tuple[bytes, Any, int] | None = None  # (sender, id, n)
        self.c_procs: list[anyio.abc.Process] = []
        self.observe: dict[str, aiote.Observability | None] = {}  # (op "observe": one per setting)

    def observing(self, setting: str) -> aiote.Observability | None:
        """The ``observe=`` of ``setting`` (one of ``_observe.VARIANTS``), made once."""
        if setting not in self.observe:
            self.observe[setting] = _observe.variant(setting)
        return self.observe[setting]

    async def reply(self, to: bytes, rid: Any, body: dict[str, Any]) -> None:
        body["id"] = rid
        await self.engine.send(to, json.dumps(body).encode(), timeout=60)

    async def check_sink(self) -> None:
        if self.sink_waiter and self.sunk >= self.sink_waiter[2]:
            to, rid, n = self.sink_waiter
            self.sink_waiter = None
            self.sunk -= n
            await self.reply(to, rid, {"ok": True})

    async def clear(self) -> None:
        for mr in self.regions.values():
            await self.engine.unregister(mr)
        self.regions.clear()
        self.sunk = 0
        self.sink_waiter = None

    async def command(self, sender: bytes, cmd: dict[str, Any], max_message: int) -> bool:
        """Runs one command; False when the server should stop."""
        e = self.engine
        op = cmd.get("op")
        rid = cmd.get("id")
        body: dict[str, Any] = {"ok": True}
        try:
            if op == "exit":
                await self.clear()
                if cmd.get("stop"):
                    await self.reply(sender, rid, body)
                    return False
            elif op == "hello":  # a new measuring side: forget what an earlier one left
                await self.clear()
                for p in list(self.c_procs):
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                body.update(aiote=aiote.__version__, max_message=max_message,
                            provider=e.rails[0].provider, nics=[r.domain for r in e.rails])
            elif op == "register":
                name = cmd["name"]
                # "arena": from the engine's host arena (Engine.alloc_host), as `aiote bench --arena`;
                # each case registers its own region, so earlier ones give their room back (an
                # arena too full for the next would hand out ordinary memory: another route)
                arena = bool(cmd.get("arena"))
                for old in list(self.regions) if arena else [name]:
                    if old in self.regions:
                        await e.unregister(self.regions.pop(old))
                if arena:
                    gc.collect()  # (an array freed now gives its arena range back now)
                arr = bench_array(e, cmd["size"], arena, "the serving side")
                arr.fill(0x5A)  # touched: reads of untouched pages would read the kernel's zero page
                self.regions[name] = await e.register(arr, remote_write=True, remote_read=True)
                body["desc"] = bytes(self.regions[name].descriptor).hex()
            elif op == "observe":  # aiote bench --observe: this engine observed as the setting says
                e._observe_as(self.observing(cmd["setting"]))
            elif op == "observe-pong":  # aiote bench --observe: pongs in blocks, each block observed
                remote = MemoryDescriptor.from_bytes(bytes.fromhex(cmd["remote"]))  # as its setting says
                for name in cmd["order"]:
                    e._observe_as(self.observing(name))
                    await answer_pings(e, remote, cmd["ping"], cmd["pong"], cmd["per"])
            elif op == "wait":
                await e.imm_counter(cmd["imm"]).wait(cmd["n"], timeout=cmd.get("wait_timeout", 120))
            elif op == "sink":  # replies once n more bulk messages arrived
                self.sink_waiter = (sender, rid, int(cmd["n"]))
                await self.check_sink()
                return True
            elif op == "pong":  # answers each ping immediate with a pong immediate
                remote = MemoryDescriptor.from_bytes(bytes.fromhex(cmd["remote"]))
                await answer_pings(e, remote, cmd["ping"], cmd["pong"], cmd["iters"])
            elif op == "cbench":  # the C bench's peer side, for a client on another host
                why = await anyio.to_thread.run_sync(build_cbench)  # a compile: off the loop
                if why:
                    raise RuntimeError(why)
                body["port"] = await self.start_c(cmd["args"])
            else:
                body = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the measuring side, which stops
            body = {"error": f"{type(exc).__name__}: {exc}"}
        await self.reply(sender, rid, body)
        return True

    async def start_c(self, args: list[str]) -> int:
        nics = [r.domain for r in self.engine.rails]
        prov = self.engine.rails[0].provider.split(";")[0]
        own = c_provider_args(prov, nics if prov == "tcp" else None)
        proc = await anyio.open_process([str(cbench()), *args, *own, "--listen", "0"], stderr=None)
        self.c_procs.append(proc)
        line = await ready_line(proc, '{"listening"', 30)
        self.tg.start_soon(self.reap, proc)
        return int(json.loads(line)["listening"])

    async def reap(self, proc: anyio.abc.Process) -> None:
        assert proc.stdout is not None
        async for _ in proc.stdout:  # keep its pipe drained
            pass
        await proc.wait()
        self.c_procs.remove(proc)

    async def run(self, once: bool, max_message: int) -> None:
        e = self.engine
        while True:
            sender, payload = await e.recv()
            if not payload:
                continue
            tag = payload[0]
            if tag == BULK:
                self.sunk += 1
                await self.check_sink()
            elif tag == ECHO:
                await e.send(sender, payload, timeout=60)
            else:
                try:
                    cmd = json.loads(payload)
                except ValueError:
                    continue
                if not await self.command(sender, cmd, max_message) and once:
                    return


def tuning(low_latency: bool, streams: int | None = None, tcp_send_buffer: int | None = None,
           pollers: int | None = None, follow_loop: bool | None = None,
           combine: bool | None = None, copy_threads: int | None = None) -> dict[str, Any]:
    """``open_engine`` arguments of ``--low-latency`` (aiote's documented low-latency setting:
    the poller spins 1 ms after activity and the loop thread polls up to 500 us while it
    waits), ``--streams`` (connections per NIC), ``--tcp-send-buffer``, ``--pollers``,
    ``--follow-loop``, ``--combine`` and ``--copy-threads``, or none (the defaults)."""
    out: dict[str, Any] = {"spin_us": 1000.0, "loop_spin_us": 500.0} if low_latency else {}
    if copy_threads is not None:
        out["copy_threads"] = copy_threads
    if follow_loop is not None:
        out["follow_loop"] = follow_loop
    if combine is not None:
        out["combine_messages"] = combine
    if streams is not None:
        out["streams"] = streams
    if pollers is not None:
        out["pollers"] = pollers
    if tcp_send_buffer is not None:
        out["tcp_send_buffer"] = tcp_send_buffer
    return out


def bench_same_host(provider: str) -> str | None:
    """The ``same_host`` both sides of a bench open: shm's own path for ``shm``, none for any
    other provider, so a run on verbs or efa measures that provider (as the C core's does), not
    the same-host path a single-host run would otherwise take."""
    return "shm" if provider == "shm" else None


async def serve(provider: str, nics: Sequence[str] | None, *, port: int | None, once: bool,
                max_message: int, low_latency: bool = False, streams: int | None = None,
                tcp_send_buffer: int | None = None, pollers: int | None = None,
                observe: aiote.Observability | None = None, follow_loop: bool | None = None,
                combine: bool | None = None, copy_threads: int | None = None) -> None:
    """The ``--listen`` side: opens an engine, prints ``AIOTE_BENCH_LISTEN <address hex>`` and
    serves measuring sides one after the other (with ``once``: until the first one leaves)."""
    same_host = bench_same_host(provider)
    async with aiote.open_engine(
        provider, list(nics) if nics else None, same_host=same_host, port=port, max_message_size=max_message,
        observe=observe,
        **tuning(low_latency, streams, tcp_send_buffer, pollers, follow_loop, combine, copy_threads),
    ) as e:
        sys.stdout.write(f"{READY} {e.address.hex()}\n")
        sys.stdout.flush()
        if not once:
            nic = ",".join(r.domain for r in e.rails)
            sys.stderr.write(
                f"aiote bench: serving on {provider} ({nic}); on the other host run\n"
                f"  aiote bench all --provider {provider} --connect {e.address.hex()}\n"
            )
        async with anyio.create_task_group() as tg:
            server = _Server(e, tg)
            try:
                await server.run(once, max_message)
            finally:
                for p in list(server.c_procs):
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                tg.cancel_scope.cancel()


# ---------------------------------------------------------------------------- measuring side


class Remote:
    """The measuring side's handle on a serving side: JSON commands over aiote messages.
    One command at a time (the benchmark is sequential)."""

    def __init__(self, engine: Engine, address: bytes) -> None:
        self.engine = engine
        self.address = address
        self._next = 0

    async def call(self, timeout: float = 120.0, **cmd: Any) -> dict[str, Any]:
        """Sends a command and returns its reply (``RuntimeError`` if it failed)."""
        self._next += 1
        rid = self._next
        await self.engine.send(self.address, json.dumps({**cmd, "id": rid}).encode(), timeout=timeout)
        with anyio.fail_after(timeout):
            while True:
                sender, payload = await self.engine.recv()
                if sender != self.address or not payload.startswith(b"{"):
                    continue
                reply: dict[str, Any] = json.loads(payload)
                if reply.get("id") == rid:
                    break
        if "error" in reply:
            raise RuntimeError(f"the serving side failed {cmd.get('op')}: {reply['error']}")
        return reply

    async def register(self, name: str, nbytes: int, arena: bool = False) -> MemoryDescriptor:
        """Registers a filled buffer there (remote write and read allowed; ``arena``: from its
        engine's :meth:`~aiote.Engine.alloc_host`, in place of its earlier regions; RuntimeError
        when its arena has no room, rather than a figure of another route); its descriptor."""
        r = await self.call(op="register", name=name, size=nbytes, arena=arena)
        return MemoryDescriptor.from_bytes(bytes.fromhex(r["desc"]))

    async def wait(self, imm: int, n: int, timeout: float = 120.0) -> None:
        """Returns once the serving side has taken ``n`` credits of ``imm``."""
        await self.call(timeout + 10, op="wait", imm=imm, n=n, wait_timeout=timeout)

    async def sink(self, n: int) -> None:
        """Returns once the serving side has received ``n`` more bulk messages."""
        await self.call(op="sink", n=n)
