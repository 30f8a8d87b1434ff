"""Paged writes and multi-NIC (issue 3): aiote from Python against the same C core driven
without Python, measured in one run, each case repeated and the median reported.

On tcp over loopback (engines opened with ``same_host=None``, so tcp is really used, and
``nics=["lo"]``), the receiver a separate process (``aiote.testing.spawn_peer``):

a. paged-write throughput, ``await engine.write_paged(...)`` of 10,000 pages per call (2,000
   for 256 KiB pages, to bound memory), identity source pages, a random permutation of
   destination pages, one imm credit per page, one call in flight; page sizes 1-256 KiB,
   beside ``aiote_cbench paged`` for the same case;
b. pages/s at 1 KiB pages, and the median time per call for 10, 1,000 and 10,000 pages: the
   Python overhead per call (aiote - C) beside the C cost of the same call, and the cost of
   one more page in each;
c. single 1 MiB writes with an imm, 64 in flight (4 reusable batches of 16, as
   bench_core.py), over 1 NIC and over 2 rails (``nics=["lo", "lo"]`` on both sides: each
   write >= ``stripe_min`` is split across both), beside ``aiote_cbench write``;
d. the same writes through the engine's automatic same-host choice (default
   ``same_host="shm"``) beside ``aiote_cbench write --provider shm``;
e. the targets: 64 KiB paged / 1 MiB single-write throughput >= 0.90 (tcp), and automatic
   same-host / C shm >= 0.90.

GB/s are 1e9 B/s at the writer, from the first post to the last completion.

    python benchmarks/bench_paged.py [--quick] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median as med
from typing import Any

import anyio
import numpy as np

import aiote
from aiote.cli._benchnet import c_run
from aiote.testing import PeerProcess, spawn_peer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import build_cbench, lane_batches  # the same C bench and window of batches

IMM_WARM, IMM_PAGED, IMM_DATA = 21, 22, 23
WINDOW = 64
WRITE_SIZE = 1 << 20
KIB = 1024
PAGE_SIZES = (1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB)
PAGES = 10_000
PAGES_256K = 2_000  # 256 KiB x 10,000 would be 2.6 GB per side
TARGET = 0.90


def npages_for(page: int) -> int:
    return PAGES_256K if page >= 256 * KIB else PAGES


PER_CALL_PAGES = (10, 1000, PAGES)  # at 1 KiB: the fixed and the per-page cost of a call


def calls_for(page: int, npages: int, quick: bool) -> int:
    """Timed calls per case: about 0.25 (quick) / 0.5 GB moved, at least 3, or for small
    calls enough of them to time the per-call cost (tens to hundreds of ms)."""
    if page * npages <= 16 << 20:
        if npages < 100:
            return 100 if quick else 300
        if npages < PAGES:
            return 30 if quick else 60
        return 10 if quick else 20
    want = (256 << 20 if quick else 512 << 20) // (page * npages)
    return max(2 if quick else 3, want)


# ------------------------------------------------------------------ python cases


async def source(engine: aiote.Engine, nbytes: int) -> aiote.MemoryRegion:
    """A registered source region of ``nbytes`` (touched, so no page faults while timing)."""
    src = np.empty(nbytes, np.uint8)
    src.fill(7)
    return await engine.register(src, remote_write=False, remote_read=False)


async def py_paged(peer: PeerProcess, page: int, npages: int, calls: int, seed: int) -> tuple[float, float]:
    """(seconds, median seconds per call) of ``calls`` awaited write_paged calls of ``npages``
    pages of ``page`` bytes (one untimed warm-up call first); the peer waits for every
    credit meanwhile."""
    engine = peer.engine
    nbytes = page * npages
    mr = await source(engine, nbytes)
    try:
        desc = await peer.register("dst", nbytes)
        sp = np.arange(npages, dtype=np.int64)
        dp = np.random.default_rng(seed).permutation(npages).astype(np.int64)
        await engine.write_paged(
            mr, desc, page_size=page, src_pages=sp, dst_pages=dp, imm=IMM_WARM, timeout=120
        )
        await peer.wait(IMM_WARM, npages)
        per_call = []
        async with anyio.create_task_group() as tg:
            # the receiver waits for every credit of the run while the writer writes
            tg.start_soon(peer.wait, IMM_PAGED, npages * calls, 120.0)
            t0 = tc = time.perf_counter()
            for _ in range(calls):
                await engine.write_paged(
                    mr, desc, page_size=page, src_pages=sp, dst_pages=dp, imm=IMM_PAGED, timeout=120
                )
                t = time.perf_counter()
                per_call.append(t - tc)
                tc = t
        return tc - t0, med(per_call)
    finally:
        await engine.unregister(mr)


async def py_write(peer: PeerProcess, total: int) -> tuple[float, dict[str, Any]]:
    """(GB/s, route) of 1 MiB writes with imm, WINDOW in flight, 4 reusable batches of 16."""
    engine = peer.engine
    size = WRITE_SIZE
    region = size * WINDOW
    mr = await source(engine, region)
    try:
        remote = await peer.register("dst", region)
        r = engine.route(remote)
        route = {"provider": r.provider, "same_host": r.same_host, "pairs": [list(p) for p in r.pairs]}
        rounds = max(total // size, WINDOW) // WINDOW
        n = rounds * WINDOW
        batches = lane_batches(engine, mr, remote, size, 4, WINDOW // 4, IMM_DATA)
        # warm-up: connection set-up and first touch, one round of every batch
        async with anyio.create_task_group() as tg:
            for b in batches:
                tg.start_soon(b.submit)
        await peer.wait(IMM_DATA, WINDOW)

        async def lane(b: aiote.TransferBatch) -> None:
            for _ in range(rounds):
                await b.submit(timeout=120)

        dt = 0.0
        async with anyio.create_task_group() as outer:
            outer.start_soon(peer.wait, IMM_DATA, n, 120.0)
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for b in batches:
                    tg.start_soon(lane, b)
            dt = time.perf_counter() - t0
        return n * size / dt / 1e9, route
    finally:
        await engine.unregister(mr)


async def py_tcp_round(
    paged_cases: list[tuple[int, int, int]], write_total: int, seed: int
) -> tuple[dict[tuple[int, int], tuple[float, float]], float, dict[str, Any]]:
    """One peer on tcp/lo (same_host=None): every paged case, then the 1-NIC write case."""
    async with spawn_peer("tcp", ["lo"], same_host=None) as peer:
        secs = {}
        for page, npages, calls in paged_cases:
            secs[(page, npages)] = await py_paged(peer, page, npages, calls, seed)
        gbps, route = await py_write(peer, write_total)
    return secs, gbps, route


async def py_auto_round(
    page: int, npages: int, calls: int, write_total: int, seed: int
) -> tuple[tuple[float, float], float, dict[str, Any]]:
    """One peer with the defaults (same host: the automatic shm route): a paged case, then
    the 1 MiB write case."""
    async with spawn_peer("tcp", ["lo"]) as peer:
        paged = await py_paged(peer, page, npages, calls, seed)
        gbps, route = await py_write(peer, write_total)
    return paged, gbps, route


async def py_write_with(write_total: int, **kw: Any) -> tuple[float, dict[str, Any]]:
    async with spawn_peer("tcp", **kw) as peer:
        return await py_write(peer, write_total)


# ------------------------------------------------------------------ C cases


def c_paged(page: int, npages: int, calls: int, provider: str = "tcp") -> tuple[float, float]:
    """(seconds, median seconds per call) of ``calls`` paged calls (tcp on lo, or shm)."""
    nic = ["--nic", "lo"] if provider == "tcp" else []
    r = c_run("paged", str(page), str(npages), str(calls), "--provider", provider, *nic)
    return float(r["seconds"]), float(r["call_us_p50"]) * 1e-6


def c_write(provider: str, total: int) -> float:
    nic = ["--nic", "lo"] if provider == "tcp" else []
    r = c_run("write", str(WRITE_SIZE), str(WINDOW), str(total), "--provider", provider, *nic)
    return float(r["gbps"])


# ------------------------------------------------------------------ main


def _size(n: int) -> str:
    return f"{n // KIB} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


class Samples:
    """Every repeat's figures, by case: C core and aiote seconds of the paged calls (``cs``,
    ``ps``) and their median seconds per call (``cc``, ``pc``), the 1 MiB writes' GB/s (``w``),
    the same-host paged case's seconds (``shm_paged``), and the routes aiote took."""

    def __init__(self, quick: bool) -> None:
        # (page size, pages per call, calls); the 1 KiB case at 10,000 pages serves a. and b.
        self.paged_cases = [(p, npages_for(p), calls_for(p, npages_for(p), quick)) for p in PAGE_SIZES]
        self.paged_cases += [(KIB, n, calls_for(KIB, n, quick)) for n in PER_CALL_PAGES if n != PAGES]
        self.cs: dict[tuple[int, int], list[float]] = {(p, n): [] for p, n, _ in self.paged_cases}
        self.ps: dict[tuple[int, int], list[float]] = {(p, n): [] for p, n, _ in self.paged_cases}
        self.cc: dict[tuple[int, int], list[float]] = {(p, n): [] for p, n, _ in self.paged_cases}
        self.pc: dict[tuple[int, int], list[float]] = {(p, n): [] for p, n, _ in self.paged_cases}
        self.w: dict[str, list[float]] = {k: [] for k in ("c_tcp", "py_1nic", "py_2nic", "c_shm", "py_auto")}
        self.shm_case = (64 * KIB, PAGES, calls_for(64 * KIB, PAGES, quick))
        self.shm_paged: dict[str, list[float]] = {"c": [], "py": []}
        self.routes: dict[str, Any] = {}
        self.elapsed = 0.0
        self.calls_of = {(p, n): c for p, n, c in self.paged_cases}  # calls of each paged case

    def gbps_of(self, secs: list[float], p: int, n: int) -> float:
        """GB/s of the paged case (``p``-byte pages, ``n`` a call) from the median seconds."""
        return p * n * self.calls_of[(p, n)] / med(secs) / 1e9


def measure(repeats: int, quick: bool, write_total: int) -> Samples:
    """Every case ``repeats`` times, the C core and aiote interleaved (drift hits both alike)."""
    S = Samples(quick)
    cs, ps, cc, pc, w, shm_paged, routes = S.cs, S.ps, S.cc, S.pc, S.w, S.shm_paged, S.routes
    paged_cases, shm_case = S.paged_cases, S.shm_case
    t_start = time.perf_counter()
    for rep in range(repeats):  # interleaved, so drift hits both sides alike
        for p, n, calls in paged_cases:
            total_s, call_s = c_paged(p, n, calls)
            cs[(p, n)].append(total_s)
            cc[(p, n)].append(call_s)
        secs, gbps, routes["tcp_1nic"] = anyio.run(py_tcp_round, paged_cases, write_total, rep)
        for k, (total_s, call_s) in secs.items():
            ps[k].append(total_s)
            pc[k].append(call_s)
        w["py_1nic"].append(gbps)
        w["c_tcp"].append(c_write("tcp", write_total))
        gbps, routes["tcp_2nic"] = anyio.run(
            lambda: py_write_with(write_total, nics=["lo", "lo"], same_host=None)
        )
        w["py_2nic"].append(gbps)
        w["c_shm"].append(c_write("shm", write_total))
        shm_paged["c"].append(c_paged(*shm_case, provider="shm")[0])
        (ptot, _), gbps, routes["auto"] = anyio.run(py_auto_round, *shm_case, write_total, rep)
        shm_paged["py"].append(ptot)
        w["py_auto"].append(gbps)
    S.elapsed = time.perf_counter() - t_start
    return S


HDR = f"{'case':50} {'C core':>10} {'aiote':>10} {'ratio':>8}"  # the tables' header


def report_paged(S: Samples, results: dict[str, Any]) -> None:
    """a. paged writes by page size."""
    cs, ps = S.cs, S.ps
    print("\na. paged writes, GB/s (one call in flight, 1 imm credit per page)")
    print(HDR)
    paged: dict[str, Any] = {}
    for p in PAGE_SIZES:
        n = npages_for(p)
        c, y = S.gbps_of(cs[(p, n)], p, n), S.gbps_of(ps[(p, n)], p, n)
        note = f"  ({n:,} pages per call, to bound memory)" if n != PAGES else ""
        print(f"{f'{_size(p)} pages x {n:,} per call':50} {c:10.3f} {y:10.3f} {y / c:8.2f}{note}")
        paged[f"{p // KIB}KiB"] = {
            "pages": n,
            "calls": S.calls_of[(p, n)],
            "c_gbps": c,
            "py_gbps": y,
            "ratio": y / c,
            "c_seconds_all": cs[(p, n)],
            "py_seconds_all": ps[(p, n)],
        }
    results["paged"] = paged


def report_pages(S: Samples, results: dict[str, Any]) -> None:
    """b. 1 KiB pages: pages per second and the cost of a call by its page count."""
    cs, ps, cc, pc = S.cs, S.ps, S.cc, S.pc
    print("\nb. 1 KiB pages: pages/s, and median time per call (us; last column: aiote - C)")
    print(f"{'case':50} {'C core':>10} {'aiote':>10} {'ratio/gap':>10}")
    k10 = (KIB, PAGES)
    c_pps = PAGES * S.calls_of[k10] / med(cs[k10])
    p_pps = PAGES * S.calls_of[k10] / med(ps[k10])
    print(f"{'pages/s, 10,000 pages per call':50} {c_pps:10.0f} {p_pps:10.0f} {p_pps / c_pps:10.2f}")
    per_call: dict[int, tuple[float, float]] = {}
    for n in PER_CALL_PAGES:
        c_us, p_us = med(cc[(KIB, n)]) * 1e6, med(pc[(KIB, n)]) * 1e6
        per_call[n] = (c_us, p_us)
        label = f"us per call, {n:,} pages (x{S.calls_of[(KIB, n)]} calls)"
        print(f"{label:50} {c_us:10.1f} {p_us:10.1f} {p_us - c_us:+9.1f}us")
    (c1, p1), (c10, p10) = per_call[1000], per_call[PAGES]
    print(
        f"one more page (1,000 -> 10,000 pages): C {(c10 - c1) / 9e3 * 1e3:.0f} ns, "
        f"aiote {(p10 - p1) / 9e3 * 1e3:.0f} ns (the C loop in both; the difference is noise "
        f"unless it is large)"
    )
    results["pages_1KiB"] = {
        "c_pages_per_s": c_pps,
        "py_pages_per_s": p_pps,
        "us_per_call": {str(n): {"c": c, "py": y, "gap": y - c} for n, (c, y) in per_call.items()},
    }


def report_writes(S: Samples, results: dict[str, Any]) -> None:
    """c./d. single 1 MiB writes over tcp (1 and 2 NICs) and the same host; the same-host
    paged case."""
    w, shm_paged, shm_case, ra = S.w, S.shm_paged, S.shm_case, S.routes["auto"]
    print(f"\nc./d. single {_size(WRITE_SIZE)} writes, {WINDOW} in flight, GB/s")
    print(HDR)
    ct, p1n, p2n = med(w["c_tcp"]), med(w["py_1nic"]), med(w["py_2nic"])
    csh, pau = med(w["c_shm"]), med(w["py_auto"])
    print(f"{'tcp, 1 NIC (lo)':50} {ct:10.3f} {p1n:10.3f} {p1n / ct:8.2f}")
    print(f"{'tcp, 2 NICs (lo, lo), striped (C: 1 NIC)':50} {ct:10.3f} {p2n:10.3f} {p2n / ct:8.2f}")
    label = f"same host, automatic ({ra['provider']}) vs C shm"
    print(f"{label:50} {csh:10.3f} {pau:10.3f} {pau / csh:8.2f}")
    print(f"automatic same-host / tcp 1 NIC (aiote): {pau / p1n:.2f}; C shm / C tcp: {csh / ct:.2f}")
    results["write_1MiB"] = {
        "c_tcp_gbps": ct,
        "py_tcp_1nic_gbps": p1n,
        "py_tcp_2nic_gbps": p2n,
        "c_shm_gbps": csh,
        "py_auto_gbps": pau,
        "auto_provider": ra["provider"],
        "all": w,
    }

    sp_bytes = shm_case[0] * shm_case[1] * shm_case[2]
    c_sp, p_sp = sp_bytes / med(shm_paged["c"]) / 1e9, sp_bytes / med(shm_paged["py"]) / 1e9
    label = f"64 KiB pages x {PAGES:,}, same host: automatic ({ra['provider']}) vs C shm"
    print(f"{label:50} {c_sp:10.3f} {p_sp:10.3f} {p_sp / c_sp:8.2f}")
    results["paged_shm_64KiB"] = {"c_gbps": c_sp, "py_gbps": p_sp, "ratio": p_sp / c_sp}


def report_targets(S: Samples, results: dict[str, Any]) -> None:
    """e. the targets, from the sections above."""
    paged, ra = results["paged"], S.routes["auto"]
    w1 = results["write_1MiB"]
    p1n, ct, pau, csh = w1["py_tcp_1nic_gbps"], w1["c_tcp_gbps"], w1["py_auto_gbps"], w1["c_shm_gbps"]
    c_sp, p_sp = results["paged_shm_64KiB"]["c_gbps"], results["paged_shm_64KiB"]["py_gbps"]
    print("\ne. targets")
    r64 = paged["64KiB"]["py_gbps"] / p1n
    rc64 = paged["64KiB"]["c_gbps"] / ct
    r64s = p_sp / pau
    rc64s = c_sp / csh
    rsh = pau / csh
    ok = ra["provider"] == "shm"
    for name, v, extra in (
        ("64 KiB paged / 1 MiB single write (aiote, tcp 1 NIC)", r64, f"C core: {rc64:.2f}"),
        ("64 KiB paged / 1 MiB single write (aiote, same host)", r64s, f"C core (shm): {rc64s:.2f}"),
        ("automatic same-host / C shm", rsh, "" if ok else f"route is {ra['provider']}, not shm"),
    ):
        verdict = "PASS" if v >= TARGET and (ok or "same-host" not in name) else "MISS"
        print(f"{name:58} {v:6.2f}  target >= {TARGET:.2f}  {verdict}  {extra}")
    results["targets"] = {
        "paged64k_over_write1m": r64,
        "c_paged64k_over_write1m": rc64,
        "paged64k_over_write1m_same_host": r64s,
        "c_paged64k_over_write1m_shm": rc64s,
        "auto_over_c_shm": rsh,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smaller totals, one repeat (a smoke run)")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    build_cbench()
    repeats = 1 if a.quick else a.repeats
    write_total = (256 << 20) if a.quick else (1 << 30)
    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(
            f"warning: 1-minute load average {load1:.2f} > 0.5 on {os.cpu_count()} cores: other "
            "processes are running; figures will be noisy"
        )
    S = measure(repeats, a.quick, write_total)
    routes = S.routes
    results: dict[str, Any] = {
        "machine_cores": os.cpu_count(),
        "load1_before": load1,
        "load1_after": os.getloadavg()[0],
        "repeats": repeats,
        "seconds": S.elapsed,
        "routes": routes,
    }
    print(
        f"\naiote paged writes and multi-NIC — tcp over loopback (same_host=None) unless noted, "
        f"{os.cpu_count()} cores, median of {repeats}, {S.elapsed:.0f} s"
    )
    r1, r2, ra = routes["tcp_1nic"], routes["tcp_2nic"], routes["auto"]
    print(
        f"routes: 1 NIC {r1['provider']} {r1['pairs']}; 2 NICs {r2['provider']} {r2['pairs']}; "
        f"automatic same-host {ra['provider']} (same_host={ra['same_host']})"
    )
    for section in (report_paged, report_pages, report_writes, report_targets):
        section(S, results)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
