"""``aiote bench``: throughput of writes and paged writes from Python, each beside the same
case measured in the same run by the C core alone (``cdeps/bench/aiote_cbench``, the same
``cdeps/`` code driven without Python), with the ratio.

Runs both sides on this host (the peer is another process). Modes: ``write``, ``paged``,
``all``. GB/s are 1e9 B/s; each figure is the median of ``--repeats`` runs, printed with its
spread (min-max). Warns when other processes kept the CPU more than 10 % busy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import aiote
from aiote.testing import PeerProcess, spawn_peer

CDEPS = Path(__file__).resolve().parents[2] / "cdeps"
CBENCH = CDEPS / "build" / "aiote_cbench"
WINDOW = 64


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _cpu_busy() -> float:
    """Fraction of the CPU busy over 0.5 s (before a run: anything is someone else)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    t0, i0 = sample()
    time.sleep(0.5)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def build_cbench() -> str | None:
    """Builds the C bench from the source tree; the reason when it cannot."""
    if not (CDEPS / "Makefile").exists():
        return "the C core's sources (cdeps/) are not next to this installation: run from a source checkout"
    r = subprocess.run(["make", "-s", "-C", str(CDEPS), "bench"], capture_output=True, text=True)
    if r.returncode and not CBENCH.exists():
        return f"could not build the C bench: {r.stderr.strip()[-300:]}"
    return None


def c_run(*args: str) -> dict[str, Any]:
    out = subprocess.run([str(CBENCH), *args], check=True, capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


async def py_write(peer: PeerProcess, size: int, total: int, window: int) -> float:
    """GB/s of writes of ``size`` with an immediate, ``window`` in flight (4 reusable batches)."""
    e = peer.engine
    region = size * window
    src = np.empty(region, np.uint8)
    src.fill(7)
    mr = await e.register(src, remote_write=False)
    try:
        d = await peer.register("dst", region)
        lanes = min(4, window)
        per = window // lanes
        batches = []
        for lane in range(lanes):
            b = e.batch()
            for k in range(per):
                off = (lane * per + k) * size
                b.write(mr, d, length=size, src_offset=off, dst_offset=off, imm=2)
            batches.append(b)
        rounds = max(1, total // (size * lanes * per))
        for b in batches:  # warm-up
            await b.submit(timeout=120)
        await peer.wait(2, lanes * per, 120)

        async def lane_run(b: aiote.TransferBatch) -> None:
            for _ in range(rounds):
                await b.submit(timeout=120)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for b in batches:
                tg.start_soon(lane_run, b)
        dt = time.perf_counter() - t0
        await peer.wait(2, rounds * lanes * per, 120)
        return rounds * lanes * per * size / dt / 1e9
    finally:
        await e.unregister(mr)


async def py_paged(peer: PeerProcess, page: int, npages: int, calls: int) -> float:
    e = peer.engine
    src = np.empty(page * npages, np.uint8)
    src.fill(5)
    mr = await e.register(src, remote_write=False)
    try:
        d = await peer.register("pdst", page * npages)
        perm = np.random.default_rng(1).permutation(npages)
        await e.write_paged(mr, d, page_size=page, src_pages=np.arange(npages), dst_pages=perm, imm=3)
        t0 = time.perf_counter()
        for _ in range(calls):
            await e.write_paged(mr, d, page_size=page, src_pages=np.arange(npages), dst_pages=perm, imm=3)
        dt = time.perf_counter() - t0
        await peer.wait(3, npages * (calls + 1), 120)
        return page * npages * calls / dt / 1e9
    finally:
        await e.unregister(mr)


async def py_latency(peer: PeerProcess, iters: int) -> tuple[float, float]:
    """(p50, p99) one-way latency in µs of an 8 B-class WriteImm ping-pong (round trip / 2)."""
    e = peer.engine
    mine = await e.register(np.zeros(64, np.uint8))
    try:
        theirs = await peer.register("pp", 64)
        pong = e.imm_counter(5)
        rtts: list[float] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: peer.call(
                    120, op="pong", remote=bytes(mine.descriptor).hex(), iters=iters + 50, ping=4, pong=5
                )
            )
            for i in range(iters + 50):  # 50 warm-up round trips
                t0 = time.perf_counter()
                await e.write_imm(theirs, 4)
                await pong.wait(1, timeout=30)
                if i >= 50:
                    rtts.append(time.perf_counter() - t0)
        rtts.sort()
        return rtts[len(rtts) // 2] / 2 * 1e6, rtts[int(len(rtts) * 0.99)] / 2 * 1e6
    finally:
        await e.unregister(mine)


async def run_python(args: argparse.Namespace, cases: list[tuple[str, int]]) -> dict[tuple[str, int], float]:
    same_host = None if args.provider == "tcp" else "shm"
    nics = args.nics.split(",") if args.nics else None
    out: dict[tuple[str, int], float] = {}
    async with spawn_peer(args.provider, nics, same_host=same_host) as peer:
        for mode, size in cases:
            if mode == "write":
                out[(mode, size)] = await py_write(peer, size, args.total, args.window)
            elif mode == "paged":
                out[(mode, size)] = await py_paged(peer, size, args.pages, args.calls)
            elif (mode, size) not in out:
                p50, p99 = await py_latency(peer, args.iters)
                out[("imm-latency", 50)], out[("imm-latency", 99)] = p50, p99
    return out


def _prov(args: argparse.Namespace) -> list[str]:
    prov = ["--provider", args.provider] + (["--nic", args.nics.split(",")[0]] if args.nics else [])
    if args.provider == "tcp" and not args.nics:
        prov += ["--nic", "lo"]
    return prov


def run_c(args: argparse.Namespace, mode: str, size: int) -> float:
    prov = _prov(args)
    if mode == "write":
        r = c_run("write", str(size), str(args.window), str(max(args.total, size * args.window)), *prov)
    elif mode == "paged":
        r = c_run("paged", str(size), str(args.pages), str(args.calls), *prov)
    else:  # imm-latency: one run gives both percentiles; size is the percentile
        r = c_run("pingpong", str(args.iters), *prov)
        return float(r[f"p{size}_us"])
    return float(r["gbps"])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("mode", nargs="?", default="all", choices=["write", "paged", "imm-latency", "all"])
    ap.add_argument("--sizes", default="64KiB,1MiB", help="write sizes (e.g. 4KiB,64KiB,1MiB)")
    ap.add_argument("--page-sizes", default="4KiB,64KiB", help="paged-write page sizes")
    ap.add_argument("--window", type=int, default=WINDOW, help="writes in flight")
    ap.add_argument("--total", type=parse_size, default=1 << 30, help="bytes per write case")
    ap.add_argument("--pages", type=int, default=10_000, help="pages per paged call")
    ap.add_argument("--calls", type=int, default=3, help="paged calls per case")
    ap.add_argument("--iters", type=int, default=2000, help="ping-pong round trips (imm-latency)")
    ap.add_argument("--provider", default="tcp", choices=["tcp", "shm"])
    ap.add_argument("--nics", default=None, help="comma-separated NICs (default lo for tcp)")
    ap.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop", "trio"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_file", help="write the results to this file")


def main(args: argparse.Namespace) -> int:
    cases: list[tuple[str, int]] = []
    if args.mode in ("write", "all"):
        cases += [("write", parse_size(s)) for s in args.sizes.split(",")]
    if args.mode in ("paged", "all"):
        cases += [("paged", parse_size(s)) for s in args.page_sizes.split(",")]
    if args.mode in ("imm-latency", "all"):
        cases += [("imm-latency", 50), ("imm-latency", 99)]
    busy = _cpu_busy()
    if busy > 0.10:
        sys.stderr.write(f"warning: the CPU was {busy:.0%} busy before the run: figures will be noisy\n")
    why_no_c = build_cbench()
    if why_no_c:
        sys.stderr.write(f"no C baseline: {why_no_c}\n")
    backend, options = args.loop, {}
    if args.loop == "uvloop":
        backend, options = "asyncio", {"use_uvloop": True}
    py: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    cc: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for rep in range(args.repeats):
        sys.stderr.write(f"\rrun {rep + 1}/{args.repeats} ...")
        sys.stderr.flush()
        if not why_no_c:
            for mode, size in cases:
                if mode == "imm-latency":
                    if size == 50:
                        r = c_run("pingpong", str(args.iters), *_prov(args))
                        cc[(mode, 50)].append(float(r["p50_us"]))
                        cc[(mode, 99)].append(float(r["p99_us"]))
                    continue
                cc[(mode, size)].append(run_c(args, mode, size))
        got = anyio.run(run_python, args, cases, backend=backend, backend_options=options)
        for k, v in got.items():
            py[k].append(v)
    sys.stderr.write("\n")
    rows = []
    for mode, size in cases:
        p = py[(mode, size)]
        c = cc[(mode, size)]
        row: dict[str, Any] = {
            "mode": mode,
            "size": size,
            "py_gbps": statistics.median(p),
            "py_spread": [min(p), max(p)],
            "c_gbps": statistics.median(c) if c else None,
            "c_spread": [min(c), max(c)] if c else None,
        }
        row["ratio"] = row["py_gbps"] / row["c_gbps"] if row["c_gbps"] else None
        rows.append(row)
    after = _cpu_busy()
    print(
        f"aiote bench: {args.provider}, window {args.window}, {args.loop}, median of {args.repeats} "
        "(GB/s unless noted)"
    )
    print(f"{'case':24} {'C core':>16} {'aiote':>16} {'ratio':>6}")
    for r in rows:
        label = f"{r['mode']} {r['size'] // 1024} KiB"
        if r["mode"] == "imm-latency":
            label = f"one-way p{r['size']} (us, lower is better)"
        cs = f"{r['c_gbps']:.2f} ({r['c_spread'][0]:.2f}-{r['c_spread'][1]:.2f})" if r["c_gbps"] else "-"
        ps = f"{r['py_gbps']:.2f} ({r['py_spread'][0]:.2f}-{r['py_spread'][1]:.2f})"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"{label:24} {cs:>16} {ps:>16} {ratio:>6}")
    result = {
        "provider": args.provider,
        "window": args.window,
        "loop": args.loop,
        "repeats": args.repeats,
        "cpu_busy_before": busy,
        "cpu_busy_after": after,
        "c_baseline": why_no_c is None,
        "aiote": aiote.__version__,
        "rows": rows,
    }
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0
