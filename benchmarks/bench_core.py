"""Core benchmark: aiote from Python against the same C core driven without Python.

Measured in one run, on tcp over loopback (or --provider shm), each case repeated (C and
Python back to back in each repeat) and the median reported, with the median of the repeats'
paired ratios (or gaps) beside the ratio of the medians:

- throughput of 64 KiB and 1 MiB one-sided writes carrying an immediate, 64 in flight,
  each of the 64 writes to its own slot of the peer's region (as the C program does);
  Python keeps the window full with 4 reusable batches of 16 (``engine.batch()``), and is
  also shown with one ``await engine.write`` per write (64 tasks) and with one task keeping
  64 ``engine.post_write`` transfers in flight;
- one-way latency (round trip / 2) of an 8-byte WriteImm ping-pong, p50 and p99, with the
  default poller spin (50 us) and with the low-latency setting (``spin_us=1000``). Python
  awaits each write before it waits for the answer; the C program posts its ping and waits
  for the pong without waiting for its write's completion first.

The C figures come from ``cdeps/build/aiote_cbench`` (built on demand), the same ``cdeps/``
core, its event-loop side emulated with aio_arm + poll(eventfd) exactly as aiote's bridge
does. Prints a table with the ratios and, last, one JSON object.

    python benchmarks/bench_core.py [--quick] [--provider tcp|shm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import aiote
from aiote.cli._benchnet import build_cbench as _build_cbench
from aiote.cli._benchnet import c_run, cpu_busy
from aiote.testing import answer_pings

IMM_DATA, IMM_PING, IMM_PONG = 1, 2, 3
WINDOW = 64


def _nics(provider: str) -> list[str] | None:
    return ["lo"] if provider == "tcp" else None


# ------------------------------------------------------------------ the peer process


async def _peer(provider: str, region: int, spin_us: float, loop_spin_us: float) -> None:
    async with aiote.open_engine(
        provider, _nics(provider), spin_us=spin_us, loop_spin_us=loop_spin_us, same_host=None
    ) as engine:
        buf = np.empty(region, np.uint8)
        buf.fill(0)
        mr = await engine.register(buf)
        sys.stdout.write(f"PEER {engine.address.hex()}\n")
        sys.stdout.flush()
        while True:
            sender, raw = await engine.recv()
            cmd = json.loads(raw)
            if cmd["op"] == "exit":
                return
            if cmd["op"] == "desc":
                await engine.send(sender, bytes(mr.descriptor))
            elif cmd["op"] == "pong":
                remote = aiote.MemoryDescriptor.from_bytes(bytes.fromhex(cmd["remote"]))
                await engine.send(sender, b"ready")
                await answer_pings(engine, remote, IMM_PING, IMM_PONG, cmd["n"], timeout=None)
            elif cmd["op"] == "credits":
                await engine.imm_counter(IMM_DATA).wait(cmd["n"], timeout=120)
                await engine.send(sender, b"done")


class Peer:
    def __init__(self, provider: str, region: int, spin_us: float, loop_spin_us: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "peer",
                "--provider",
                provider,
                "--region",
                str(region),
                "--spin-us",
                str(spin_us),
                "--loop-spin-us",
                str(loop_spin_us),
            ],
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("PEER "):
            raise RuntimeError(f"peer failed to start: {line!r}")
        self.address = bytes.fromhex(line.split()[1])

    def close(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ python cases


def lane_batches(
    engine: aiote.Engine, mr: aiote.MemoryRegion, remote: aiote.MemoryDescriptor, size: int,
    lanes: int, per_lane: int, imm: int,
) -> list[aiote.TransferBatch]:
    """``lanes`` reusable batches of ``per_lane`` writes of ``size`` bytes with ``imm``, each
    write to its own slot (the same offset on both sides): a window kept full from Python."""
    batches = []
    for lane in range(lanes):
        b = engine.batch()
        for k in range(per_lane):
            off = (lane * per_lane + k) * size
            b.write(mr, remote, length=size, src_offset=off, dst_offset=off, imm=imm)
        batches.append(b)
    return batches


async def py_write(provider: str, size: int, total: int, batched: bool | None) -> float:
    """GB/s of writes of ``size`` with imm, WINDOW in flight; measured at the writer.
    ``batched``: True: 4 reusable batches; False: one ``await engine.write`` per write
    (64 tasks); None: one task keeping 64 ``engine.post_write`` transfers in flight (awaits
    the oldest, posts its slot again)."""
    region = size * WINDOW
    peer = Peer(provider, region, 50.0)
    try:
        async with aiote.open_engine(provider, _nics(provider), same_host=None) as engine:
            src = np.empty(region, np.uint8)
            src.fill(7)
            mr = await engine.register(src, remote_write=False, remote_read=False)
            await engine.send(peer.address, json.dumps({"op": "desc"}).encode(), timeout=30)
            _, raw = await engine.recv(timeout=30)
            remote = aiote.MemoryDescriptor.from_bytes(raw)
            n = max(total // size, WINDOW)
            lanes = 4 if batched else WINDOW
            per_lane = WINDOW // lanes
            rounds = n // WINDOW
            n = rounds * WINDOW
            # warm-up: connection set-up and first touch
            await engine.write(mr, remote, length=size, imm=IMM_DATA)
            batches = lane_batches(engine, mr, remote, size, lanes, per_lane, IMM_DATA)

            async def run_batched(b: aiote.TransferBatch) -> None:
                for _ in range(rounds):
                    await b.submit(timeout=120)

            async def run_posted() -> None:
                window = [
                    engine.post_write(mr, remote, length=size, src_offset=k * size, dst_offset=k * size,
                                      imm=IMM_DATA)
                    for k in range(WINDOW)
                ]
                for i in range(n - WINDOW):
                    slot = i % WINDOW
                    await window[slot].wait(timeout=120)
                    off = slot * size
                    window[slot] = engine.post_write(
                        mr, remote, length=size, src_offset=off, dst_offset=off, imm=IMM_DATA
                    )
                for t in window:
                    await t.wait(timeout=120)

            async def run_single(slot: int) -> None:
                off = slot * size
                for _ in range(rounds):
                    await engine.write(
                        mr, remote, length=size, src_offset=off, dst_offset=off, imm=IMM_DATA, timeout=120
                    )

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                if batched:
                    for b in batches:
                        tg.start_soon(run_batched, b)
                elif batched is None:
                    tg.start_soon(run_posted)
                else:
                    for slot in range(WINDOW):
                        tg.start_soon(run_single, slot)
            dt = time.perf_counter() - t0
            # the receiver must have seen every write (warm-up included)
            await engine.send(peer.address, json.dumps({"op": "credits", "n": n + 1}).encode(), timeout=30)
            await engine.recv(timeout=120)
            await engine.send(peer.address, json.dumps({"op": "exit"}).encode(), timeout=30)
            return n * size / dt / 1e9
    finally:
        peer.close()


async def py_pingpong(provider: str, iters: int, spin_us: float, loop_spin_us: float) -> tuple[float, float]:
    """(p50, p99) one-way latency in microseconds of an 8 B WriteImm ping-pong."""
    peer = Peer(provider, 4096, spin_us, loop_spin_us)
    try:
        async with aiote.open_engine(
            provider, _nics(provider), spin_us=spin_us, loop_spin_us=loop_spin_us, same_host=None
        ) as engine:
            buf = np.zeros(4096, np.uint8)
            mr = await engine.register(buf)
            await engine.send(peer.address, json.dumps({"op": "desc"}).encode(), timeout=30)
            _, raw = await engine.recv(timeout=30)
            remote = aiote.MemoryDescriptor.from_bytes(raw)
            warm = 1000
            await engine.send(
                peer.address,
                json.dumps({"op": "pong", "n": iters + warm, "remote": bytes(mr.descriptor).hex()}).encode(),
            )
            await engine.recv(timeout=30)
            pong = engine.imm_counter(IMM_PONG)
            rtt = []
            for i in range(iters + warm):
                t = time.perf_counter_ns()
                await engine.write(mr, remote, length=8, imm=IMM_PING)
                await pong.wait(1, timeout=30)
                if i >= warm:
                    rtt.append(time.perf_counter_ns() - t)
            await engine.send(peer.address, json.dumps({"op": "exit"}).encode(), timeout=30)
            a = np.array(rtt) / 2e3
            return float(np.percentile(a, 50)), float(np.percentile(a, 99))
    finally:
        peer.close()


# ------------------------------------------------------------------ C cases


def build_cbench() -> None:
    """Builds the C bench (make -C cdeps bench), or stops saying why it cannot."""
    why = _build_cbench()
    if why:
        raise SystemExit(why)


def c_write(provider: str, size: int, total: int) -> float:
    nic = ["--nic", "lo"] if provider == "tcp" else []
    return float(c_run("write", str(size), str(WINDOW), str(total), "--provider", provider, *nic)["gbps"])


def c_pingpong(provider: str, iters: int, spin_us: float) -> tuple[float, float]:
    nic = ["--nic", "lo"] if provider == "tcp" else []
    r = c_run("pingpong", str(iters), "--provider", provider, "--spin-ns", str(int(spin_us * 1000)), *nic)
    return float(r["p50_us"]), float(r["p99_us"])


# ------------------------------------------------------------------ main


def _writes(provider: str, repeats: int, total: dict[int, int], results: dict[str, Any],
            rows: list[tuple[str, float, float, float]]) -> None:
    """The write cases (64 KiB and 1 MiB), C core and aiote interleaved: into ``results`` and
    the table's ``rows``."""
    med = statistics.median
    for size in (65536, 1 << 20):
        c, pb, ps, pp = [], [], [], []
        for _ in range(repeats):  # interleaved, so drift hits both sides alike
            c.append(c_write(provider, size, total[size]))
            pb.append(anyio.run(py_write, provider, size, total[size], True))
            ps.append(anyio.run(py_write, provider, size, total[size] // 4, False))
            pp.append(anyio.run(py_write, provider, size, total[size] // 2, None))
        key = f"write_{size // 1024}KiB"
        results[key] = {
            "c_gbps": med(c),
            "py_batched_gbps": med(pb),
            "py_single_gbps": med(ps),
            "ratio_batched": med(pb) / med(c),
            # each repeat ran C and Python back to back: the median of those pairs' ratios is
            # less moved by the machine's drift over minutes than the ratio of the medians
            "ratio_batched_paired": med([p / q for p, q in zip(pb, c, strict=True)]),
            "ratio_single": med(ps) / med(c),
            "py_posted_gbps": med(pp),
            "ratio_posted": med(pp) / med(c),
            "py_posted_all": pp,
            "c_all": c,
            "py_batched_all": pb,
            "py_single_all": ps,
        }
        rows.append((f"write {size // 1024} KiB x{WINDOW} (GB/s)", med(c), med(pb), med(pb) / med(c)))
        rows.append(("  the same, median of the paired ratios", med(c), med(pb),
                     results[key]["ratio_batched_paired"]))
        rows.append(("  one await per write (GB/s)", med(c), med(ps), med(ps) / med(c)))
        rows.append(("  post_write, 64 in flight, one task (GB/s)", med(c), med(pp), med(pp) / med(c)))


def _latencies(provider: str, repeats: int, iters: int, results: dict[str, Any],
               rows: list[tuple[str, float, float, float]]) -> None:
    """The WriteImm ping-pong in the default and low-latency settings, C core and aiote
    interleaved: into ``results`` and the table's ``rows``."""
    med = statistics.median
    for label, spin, loop_spin in (
        ("default (spin 50us)", 50.0, 0.0),
        ("low-latency (spin 1000us, loop_spin 500us)", 1000.0, 500.0),
    ):
        c50, c99, p50, p99 = [], [], [], []
        for _ in range(repeats):
            x = c_pingpong(provider, iters, spin)
            y = anyio.run(py_pingpong, provider, iters, spin, loop_spin)
            c50.append(x[0])
            c99.append(x[1])
            p50.append(y[0])
            p99.append(y[1])
        key = "latency_" + ("default" if spin == 50.0 else "lowlat")
        results[key] = {
            "spin_us": spin,
            "loop_spin_us": loop_spin,
            "c_p50_us": med(c50),
            "c_p99_us": med(c99),
            "py_p50_us": med(p50),
            "py_p99_us": med(p99),
            "p50_gap_us": med(p50) - med(c50),
            "p50_gap_paired_us": med([p - q for p, q in zip(p50, c50, strict=True)]),
        }
        rows.append((f"one-way p50, {label} (us)", med(c50), med(p50), med(p50) - med(c50)))
        rows.append(("  the same, median of the paired gaps (us)", med(c50), med(p50),
                     results[key]["p50_gap_paired_us"]))
        rows.append((f"one-way p99, {label} (us)", med(c99), med(p99), med(p99) - med(c99)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", choices=["main", "peer"])
    ap.add_argument("--provider", default="tcp")
    ap.add_argument("--region", type=int, default=0)
    ap.add_argument("--spin-us", type=float, default=50.0)
    ap.add_argument("--loop-spin-us", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small totals, one repeat (a smoke run)")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    if a.role == "peer":
        anyio.run(_peer, a.provider, a.region, a.spin_us, a.loop_spin_us)
        return 0
    build_cbench()
    repeats = 1 if a.quick else a.repeats
    total = {65536: (256 << 20) if a.quick else (2 << 30), 1 << 20: (512 << 20) if a.quick else (4 << 30)}
    iters = 2000 if a.quick else 20000
    busy = cpu_busy()
    if busy > 0.10:
        print(f"warning: the machine was {busy:.0%} busy before the run; figures will be noisy")
    results: dict[str, Any] = {"provider": a.provider, "machine_cores": os.cpu_count(), "repeats": repeats}
    rows: list[tuple[str, float, float, float]] = []
    _writes(a.provider, repeats, total, results, rows)
    _latencies(a.provider, repeats, iters, results, rows)
    after = cpu_busy()
    results["cpu_busy_before"] = busy
    results["cpu_busy_after"] = after
    print(
        f"\naiote core benchmark — provider {a.provider}, loopback, {os.cpu_count()} cores, "
        f"median of {repeats}"
    )
    print(f"{'case':52} {'C core':>10} {'aiote':>10} {'ratio/gap':>10}")
    for name, c_v, p_v, r in rows:
        kind = "gap" if "us" in name else "ratio"
        rs = f"{r:+.1f}us" if kind == "gap" else f"{r:.2f}"
        print(f"{name:52} {c_v:10.2f} {p_v:10.2f} {rs:>10}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
