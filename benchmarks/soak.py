"""Soak: minutes of mixed traffic between 3 processes (this one and two peers), printing
operations per second and the resident memory of each process every minute.

    python benchmarks/soak.py                  # 10 minutes
    python benchmarks/soak.py --minutes 1      # a short run

Traffic, all at once: writes with immediates (one peer over tcp, the other over the
automatic same-host path, shm), paged writes, zero-byte immediates, READs, send/recv
(every peer command is a message and its reply), writes the peers make into this process,
and writes cancelled at random moments. Every completed write is verified (sampled while
running, all of them at the end: a slot holds its bytes, or nothing if its write was
cancelled before posting). Target: RSS growth < 1 % after the first minute, no failed
verification. Exits non-zero when either is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import anyio
import numpy as np

import aiote
from aiote.testing import PeerProcess, digest, spawn_peer

SLOT = 64 << 10
SLOTS = 256  # per region: 16 MiB
PAGE = 16 << 10


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, engine: aiote.Engine, peers: list[PeerProcess], seconds: float) -> None:
        self.e = engine
        self.peers = peers
        self.end = time.monotonic() + seconds
        self.ops = 0
        self.cancelled = 0
        self.verified = 0
        self.failures: list[str] = []
        self.src = np.random.default_rng(1).integers(0, 256, SLOT * SLOTS, dtype=np.uint8)
        self.written: dict[tuple[int, str], set[int]] = {}

    def running(self) -> bool:
        return time.monotonic() < self.end and not self.failures

    async def writer(self, k: int, name: str, cancel: bool) -> None:
        peer = self.peers[k]
        d = self.descs[(k, name)]
        done = self.written.setdefault((k, name), set())
        rng = random.Random(hash((k, name)))
        while self.running():
            i = rng.randrange(SLOTS)
            off = i * SLOT
            if cancel:
                with anyio.move_on_after(rng.choice((0.00002, 0.0001, 0.001, 0.01))) as scope:
                    await self.e.write(self.ms, d, length=SLOT, src_offset=off, dst_offset=off, imm=10 + k)
                if scope.cancelled_caught:
                    self.cancelled += 1
                    continue
            else:
                await self.e.write(self.ms, d, length=SLOT, src_offset=off, dst_offset=off, imm=10 + k)
            done.add(i)
            self.ops += 1
            if rng.random() < 0.01:  # sample: the peer digests a slot it holds
                got = await peer.digest(name, off, SLOT)
                self.ops += 1
                if got != digest(self.src[off : off + SLOT]):
                    self.failures.append(f"peer {k} {name} slot {i}: wrong bytes")
                self.verified += 1

    async def pager(self, k: int) -> None:
        d = self.descs[(k, "paged")]
        rng = np.random.default_rng(k)
        n = SLOT * SLOTS // PAGE
        while self.running():
            cnt = int(rng.integers(1, 256))
            pages = rng.choice(n, size=cnt, replace=False)
            await self.e.write_paged(self.ms, d, page_size=PAGE, src_pages=pages, dst_pages=pages, imm=20 + k)
            self.ops += 1

    async def reader_and_imms(self, k: int) -> None:
        d = self.descs[(k, "ro")]
        back = np.zeros(SLOT, np.uint8)
        mb = await self.e.register(back)
        want = np.random.default_rng(100 + k).integers(0, 256, SLOT * 4, dtype=np.uint8)
        rng = random.Random(k)
        while self.running():
            i = rng.randrange(4)
            await self.e.read(mb, d, length=SLOT, src_offset=i * SLOT)
            if not np.array_equal(back, want[i * SLOT : (i + 1) * SLOT]):
                self.failures.append(f"READ from peer {k}: wrong bytes")
            self.verified += 1
            await self.e.write_imm(d, 30 + k)
            self.ops += 2
        await self.e.unregister(mb)

    async def inbound(self, k: int) -> None:
        """The peer writes into this process (over its command messages)."""
        peer = self.peers[k]
        region = np.zeros(SLOT * 4, np.uint8)
        mr = await self.e.register(region)
        counter = self.e.imm_counter(40 + k)
        src = np.random.default_rng(200 + k).integers(0, 256, SLOT * 4, dtype=np.uint8)
        while self.running():
            region[:] = 0
            await peer.write("pat", mr.descriptor, length=SLOT * 4, imm=40 + k)
            await counter.wait(1, timeout=60)
            if not np.array_equal(region, src):
                self.failures.append(f"peer {k} wrote wrong bytes here")
            self.verified += 1
            self.ops += 2
        await self.e.unregister(mr)

    async def final_check(self) -> None:
        back = np.zeros(SLOT * SLOTS, np.uint8)
        mb = await self.e.register(back)
        want = self.src.reshape(SLOTS, SLOT)
        for (k, name), done in self.written.items():
            await self.e.read(mb, self.descs[(k, name)], timeout=120)
            got = back.reshape(SLOTS, SLOT)
            ok = (got == want).all(axis=1)
            empty = (got == 0).all(axis=1)
            if not (ok | empty).all() or not ok[sorted(done)].all():
                self.failures.append(f"final check of peer {k} {name} failed")
            self.verified += len(done)
        await self.e.unregister(mb)

    async def run(self) -> None:
        self.ms = await self.e.register(self.src, remote_write=False)
        self.descs: dict[tuple[int, str], aiote.MemoryDescriptor] = {}
        for k, p in enumerate(self.peers):
            for name in ("w", "c", "paged"):
                self.descs[(k, name)] = await p.register(name, SLOT * SLOTS)
            self.descs[(k, "ro")] = await p.register("ro", SLOT * 4, fill="pattern", seed=100 + k)
            await p.register("pat", SLOT * 4, fill="pattern", seed=200 + k)
        async with anyio.create_task_group() as tg:
            for k in range(len(self.peers)):
                tg.start_soon(self.writer, k, "w", False)
                tg.start_soon(self.writer, k, "c", True)
                tg.start_soon(self.pager, k)
                tg.start_soon(self.reader_and_imms, k)
                tg.start_soon(self.inbound, k)
        await self.final_check()


async def main(minutes: float, out: str | None) -> int:
    rows: list[dict[str, Any]] = []
    async with aiote.open_engine() as e, spawn_peer(engine=e, same_host=None) as p1, spawn_peer(
        engine=e
    ) as p2:
        routes = [e.route(p.address).provider for p in (p1, p2)]
        soak = Soak(e, [p1, p2], minutes * 60)
        pids = {"this": os.getpid(), "peer_tcp": p1.pid, "peer_same_host": p2.pid}
        print(f"soak: {minutes:g} min, 3 processes, peers reached over {routes}", flush=True)
        head = " ".join(f"{k + ' RSS MiB':>20}" for k in pids)
        print(f"{'min':>4} {'ops/s':>9} {'cancelled':>9} {'verified':>9} {head}")

        async def monitor() -> None:
            last_ops, minute, last_t = 0, 0, time.monotonic()
            while soak.running():
                await anyio.sleep(min(60.0, max(0.0, soak.end - time.monotonic())) or 0.01)
                minute += 1
                now = time.monotonic()
                rss = {k: rss_kib(pid) for k, pid in pids.items()}
                rate = (soak.ops - last_ops) / max(now - last_t, 1e-9)
                last_t = now
                rows.append({"minute": minute, "ops_per_s": rate, "rss_kib": rss,
                             "cancelled": soak.cancelled, "verified": soak.verified})
                last_ops = soak.ops
                print(f"{minute:4d} {rows[-1]['ops_per_s']:9.0f} {soak.cancelled:9d} {soak.verified:9d} "
                      + " ".join(f"{rss[k] / 1024:20.1f}" for k in pids), flush=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor)
            await soak.run()
        stats = e.stats()
    growth = {}
    if len(rows) >= 2:
        for k in rows[0]["rss_kib"]:
            a, b = rows[0]["rss_kib"][k], rows[-1]["rss_kib"][k]
            growth[k] = (b - a) / a * 100 if a else 0.0
    ok = not soak.failures and all(g < 1.0 for g in growth.values())
    result = {"minutes": minutes, "per_minute": rows, "rss_growth_pct_after_minute_1": growth,
              "failures": soak.failures, "verified": soak.verified, "ops": soak.ops,
              "cancelled": soak.cancelled, "engine_stats": stats, "routes": routes, "ok": ok}
    print("RSS growth after the first minute (%): " + ", ".join(f"{k} {v:+.2f}" for k, v in growth.items()))
    print(f"verification failures: {len(soak.failures)} {soak.failures[:3]}")
    print(json.dumps({k: v for k, v in result.items() if k != "per_minute"}))
    if out:
        await anyio.Path(out).write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--json", help="write the per-minute figures to this file")
    a = ap.parse_args()
    sys.exit(anyio.run(main, a.minutes, a.json))
