"""Where a WriteImm round trip's microseconds go, from both sides (a diagnostic, not a test).

    python benchmarks/latency_timeline.py [--route tcp|default] [--iters 3000] [--rounds 3] [--posted]

Two processes play WriteImm ping-pong with ``open_engine()`` defaults (``--route tcp``: tcp
only, ``same_host=None``, as ``aiote bench --provider tcp`` runs; ``default``: the same-host
route). Each side stamps, on the shared monotonic clock, when its event loop woke for the
poller's record (the engine's bridge callback), when the waiting task resumed, and when the
next request was handed to the transport (the engine's ``_begin``, instrumented here). The
medians give one hop's timeline:

    ping posted -> peer's loop woke -> peer's task resumed -> peer's pong posted -> ...

so the wire and hand-off part (posted -> woke) is told from the Python part (woke ->
resumed -> posted). In the same run the C core plays the same ping-pong (``aiote_cbench
pingpong --await-write``, each side awaiting its write as ``await engine.write_imm`` does),
then again with ``--think-ns`` set to the Python part measured here: if the C core with that
much work per hop lands where aiote does, the gap is the interpreter's work per hop and
nothing else (the poller and the hand-off are the same code). Also prints the loop thread's
CPU time per round trip, and, in each round, asyncio alone playing the same 8-byte ping-pong
over a plain socket (``aiote/cli/_benchfloor.py``: loopback
TCP for ``--route tcp``, a Unix socket pair for ``default``; no library, one wake-up of the
loop per hop), with its loop's CPU per round trip. Uses engine internals to place its stamps;
figures are medians.

``--posted``: each side posts its WriteImm (``post_write_imm``) and awaits the previous one's
:class:`~aiote.Transfer` before posting the next, instead of awaiting each write to its
completion: no event-loop wake-up for the write's own completion (the C core's default
ping-pong does not wait for it either; ``--await-write`` is the awaited form).

``--poller-cpus A,B`` and ``--loop-cpus A,B`` pin each side's poller threads and event-loop
thread (this side's to A, the other's to B), to measure one thread placement at a time;
``--follow-loop on|off`` opens both sides with ``open_engine(follow_loop=...)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

import aiote
from aiote.cli import _benchfloor
from aiote.cli._benchnet import build_cbench, cbench

ROUTES: dict[str, dict[str, Any]] = {"tcp": {"provider": "tcp", "same_host": None}, "default": {}}
WARM = 300
pc = time.perf_counter_ns


def stamp(engine: Any) -> tuple[list[int], list[int]]:
    """Instruments ``engine``: the times its loop woke for records, and its requests posted."""
    woke: list[int] = []
    posted: list[int] = []
    bridge = engine._bridge
    on_ready = bridge._on_ready
    begin = engine._begin

    def ready() -> None:
        woke.append(pc())
        on_ready()

    def begun(*a: Any, **k: Any) -> Any:
        r = begin(*a, **k)
        posted.append(pc())
        return r

    bridge._on_ready = ready
    engine._begin = begun
    return woke, posted


async def send_imm(e: Any, theirs: Any, imm: int, posted: bool, prev: Any) -> Any:
    """One WriteImm: awaited to its completion, or posted (``posted``) after awaiting the
    previous one's Transfer ``prev``; returns what the next call awaits first."""
    if not posted:
        await e.write_imm(theirs, imm)  # as aiote bench imm-latency (its stall bound only)
        return None
    if prev is not None:
        await prev
    return e.post_write_imm(theirs, imm)


def poller_cpu(cpu: int | None) -> set[int] | None:
    """``--poller-cpus``: pins the engine's poller threads, opened next, to ``cpu`` (they take
    the opening thread's affinity); returns the affinity to give the loop thread back."""
    if cpu is None:
        return None
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    return mine


def place_loop(back: set[int] | None, loop: int | None) -> None:
    """After opening: the loop thread pinned to ``loop`` (``--loop-cpus``), or its affinity
    ``back`` from before ``--poller-cpus``."""
    if loop is not None:
        os.sched_setaffinity(0, {loop})
    elif back:
        os.sched_setaffinity(0, back)


def engine_kw(route: str, follow: str | None) -> dict[str, Any]:
    """``open_engine`` arguments of ``--route`` and ``--follow-loop``."""
    kw = dict(ROUTES[route])
    if follow is not None:
        kw["follow_loop"] = follow == "on"
    return kw


async def pong(route: str, iters: int, posted: bool, cpu: int | None = None, loop: int | None = None,
               follow: str | None = None) -> None:
    back = poller_cpu(cpu)
    async with aiote.open_engine(**engine_kw(route, follow)) as e:
        place_loop(back, loop)
        mr = await e.register(np.zeros(64, np.uint8))
        print(bytes(mr.descriptor).hex(), flush=True)
        theirs = aiote.MemoryDescriptor.from_bytes(bytes.fromhex(sys.stdin.readline().strip()))
        ping = e.imm_counter(4)
        woke, handed = stamp(e)  # (not `posted`: that names the mode)
        resumed = []
        prev = None
        for _ in range(iters + WARM):
            await ping.wait(1, timeout=30)
            resumed.append(pc())
            prev = await send_imm(e, theirs, 5, posted, prev)
        if prev is not None:
            await prev
        print(json.dumps({"woke": woke, "posted": handed[-len(resumed):], "resumed": resumed}), flush=True)
        sys.stdin.readline()


def start_pong(route: str, iters: int, posted: bool, cpu: int | None, loop: int | None = None,
               follow: str | None = None) -> subprocess.Popen[str]:
    """The other side, a process of its own (this script with ``--pong``)."""
    return subprocess.Popen(
        [sys.executable, __file__, "--pong", route, "--iters", str(iters), *(["--posted"] if posted else []),
         *(["--poller-cpus", f"{cpu},{cpu}"] if cpu is not None else []),
         *(["--loop-cpus", f"{loop},{loop}"] if loop is not None else []),
         *(["--follow-loop", follow] if follow is not None else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


async def ping(child: subprocess.Popen[str], route: str, iters: int, posted: bool, cpu: int | None = None,
               loop: int | None = None, follow: str | None = None) -> dict[str, float]:
    assert child.stdin is not None and child.stdout is not None
    back = poller_cpu(cpu)
    async with aiote.open_engine(**engine_kw(route, follow)) as e:
        place_loop(back, loop)
        mr = await e.register(np.zeros(64, np.uint8))
        theirs = aiote.MemoryDescriptor.from_bytes(bytes.fromhex(child.stdout.readline().strip()))
        child.stdin.write(bytes(mr.descriptor).hex() + "\n")
        child.stdin.flush()
        counter = e.imm_counter(5)
        woke, handed = stamp(e)
        t0s, t2s = [], []
        c0 = 0.0
        prev = None
        for i in range(iters + WARM):
            if i == WARM:
                c0 = time.thread_time()
            t0s.append(pc())
            prev = await send_imm(e, theirs, 4, posted, prev)
            await counter.wait(1, timeout=30)
            t2s.append(pc())
        if prev is not None:
            await prev
        cpu = (time.thread_time() - c0) / iters * 1e6
        peer = json.loads(child.stdout.readline())
        child.stdin.write("bye\n")
        child.stdin.flush()
    child.wait(30)  # it exits once told (bye): no wait in practice
    return timeline(t0s, t2s, handed[-len(t0s):], woke, peer, cpu)


def timeline(t0s: list[int], t2s: list[int], posted: list[int], woke: list[int], peer: dict[str, Any],
             cpu: float) -> dict[str, float]:
    """The medians of one round trip's phases (µs), both sides' stamps on the same clock."""
    t0, t2, p = (np.array(x[WARM:], np.int64) for x in (t0s, t2s, posted))
    r = np.array(peer["resumed"][WARM:], np.int64)
    pp = np.array(peer["posted"][WARM:], np.int64)
    pw = np.array(peer["woke"], np.int64)
    w_peer = pw[np.searchsorted(pw, r) - 1]  # the peer's last wake-up before its task resumed
    mw = np.array(woke, np.int64)
    w_me = mw[np.searchsorted(mw, t2) - 1]

    def med(x: Any) -> float:
        return float(np.median(x)) / 1e3

    return {
        "rtt": med(t2 - t0),
        "ping: call -> posted": med(p - t0),
        "ping posted -> peer's loop woke": med(w_peer - p),
        "peer woke -> task resumed": med(r - w_peer),
        "peer resumed -> pong posted": med(pp - r),
        "pong posted -> pinger's loop woke": med(w_me - pp),
        "pinger woke -> task resumed": med(t2 - w_me),
        "loop CPU per round trip": cpu,
    }


def c_core(route: str, iters: int, think_ns: int, posted: bool) -> float:
    """The C core's one-way p50 (µs) of the same ping-pong, each side awaiting its write
    (unless ``posted``)."""
    prov = ["--provider", "tcp", "--nic", "lo"] if route == "tcp" else ["--provider", "shm"]
    args = [str(cbench()), "pingpong", str(iters), *prov, *([] if posted else ["--await-write"])]
    if think_ns:
        args += ["--think-ns", str(think_ns)]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["p50_us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--route", default="tcp", choices=sorted(ROUTES))
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--posted", action="store_true", help="post_write_imm, awaited later (see above)")
    ap.add_argument("--poller-cpus", default=None, metavar="A,B",
                    help="pin this side's poller threads to CPU A and the other side's to CPU B "
                         "(the loop threads stay free): how thread placement moves the figures")
    ap.add_argument("--loop-cpus", default=None, metavar="A,B",
                    help="pin this side's event-loop thread to CPU A and the other side's to CPU B")
    ap.add_argument("--follow-loop", choices=("on", "off"), default=None,
                    help="both sides' open_engine(follow_loop=...); default: aiote's")
    ap.add_argument("--pong", metavar="ROUTE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("FI_PROVIDER", "tcp,ofi_rxm,shm")
    cpus = [int(c) for c in args.poller_cpus.split(",")] if args.poller_cpus else [None, None]
    loops = [int(c) for c in args.loop_cpus.split(",")] if args.loop_cpus else [None, None]
    if args.pong:
        asyncio.run(pong(args.pong, args.iters, args.posted, cpus[1], loops[1], args.follow_loop))
        return
    why = build_cbench()
    if why:
        sys.exit(f"the C bench could not be built: {why}")
    rows: list[dict[str, float]] = []
    for k in range(args.rounds):
        child = start_pong(args.route, args.iters, args.posted, cpus[1], loops[1], args.follow_loop)
        row = asyncio.run(ping(child, args.route, args.iters, args.posted, cpus[0], loops[0],
                               args.follow_loop))
        python_us = row["peer woke -> task resumed"] + row["peer resumed -> pong posted"]
        row["aiote one-way p50"] = row["rtt"] / 2
        row["C core one-way p50"] = c_core(args.route, args.iters, 0, args.posted)
        think = int(python_us * 1e3)
        row["C core + Python's us as think time"] = c_core(args.route, args.iters, think, args.posted)
        # no library: asyncio alone ping-ponging over a plain socket (one loop wake-up per hop)
        floor = _benchfloor.floor_run("asyncio", "tcp" if args.route == "tcp" else "unix", args.iters)
        row["asyncio alone, plain socket, one-way p50"] = floor["p50_us"]
        row["asyncio alone: loop CPU per round trip"] = floor["loop_cpu_us_per_rtt"]
        rows.append(row)
        print(f"round {k + 1}/{args.rounds}: aiote {row['aiote one-way p50']:.1f} us one-way, "
              f"C core {row['C core one-way p50']:.1f}", file=sys.stderr)
    how = "posted" if args.posted else "awaited"
    print(f"WriteImm ping-pong ({how}), route {args.route}, {args.iters} round trips, "
          f"median of {args.rounds} rounds (us)")
    for name in rows[0]:
        vals = [r[name] for r in rows]
        print(f"  {name:<40} {statistics.median(vals):8.1f}   ({min(vals):.1f}-{max(vals):.1f})")


if __name__ == "__main__":
    main()
