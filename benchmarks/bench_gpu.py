"""GPU benchmarks (needs CuPy and a GPU; the CUDA-IPC figures want 2 GPUs of one host).

    python benchmarks/bench_gpu.py [--json FILE] [--quick]

1. CUDA-IPC rail: 256 MiB writes GPU0 -> GPU1 across two processes (window 4), and paged
   writes of 64 KiB pages (4096 pages a call, destinations permuted), beside
   ``cudaMemcpyPeer`` of the same bytes measured in the same run. Targets: >= 0.90 and >= 0.70.
2. Staged path over tcp loopback: 64 MiB writes GPU -> GPU between two processes (D2H,
   tcp, H2D, credit after the copy), beside host -> host over the same provider in the same
   run. Target >= 0.90.
3. UVM watcher: a persistent kernel echoes a host store into a watched word; the figure is
   from the host's store to the awaiting task resuming (so it includes one host -> GPU -> host
   PCIe round trip), p50/p99, for the default watch interval (100 us) and 10 us.

GB/s = 1e9 B/s; each throughput is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np

import aiote
from aiote.testing import spawn_peer

try:
    import cupy
except ImportError:  # pragma: no cover
    print("skipped: CuPy is not installed (pip install 'aiote[gpu]')")
    sys.exit(0)

MiB = 1 << 20
_ECHO = r"""
extern "C" __global__ void echo(volatile unsigned long long *flag, unsigned long long *word) {
    unsigned long long last = 0;
    for (;;) {
        unsigned long long v = *flag;
        if (v == last) continue;
        last = v;
        if (v == ~0ULL) return;
        __threadfence_system();
        *((volatile unsigned long long *)word) = v;
    }
}
"""


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _med(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def memcpy_peer(nbytes: int, src_dev: int, dst_dev: int, reps: int) -> float:
    """cudaMemcpyPeer GB/s (one process, both devices, peer access enabled: NVLink)."""
    if src_dev != dst_dev:
        for a, b in ((src_dev, dst_dev), (dst_dev, src_dev)):
            with cupy.cuda.Device(a), contextlib.suppress(cupy.cuda.runtime.CUDARuntimeError):
                cupy.cuda.runtime.deviceEnablePeerAccess(b)  # raises when already enabled
    with cupy.cuda.Device(src_dev):
        a = cupy.ones(nbytes, cupy.uint8)
    with cupy.cuda.Device(dst_dev):
        b = cupy.zeros(nbytes, cupy.uint8)
    cupy.cuda.runtime.memcpyPeer(b.data.ptr, dst_dev, a.data.ptr, src_dev, nbytes)  # warm
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        cupy.cuda.runtime.memcpyPeer(b.data.ptr, dst_dev, a.data.ptr, src_dev, nbytes)
    with cupy.cuda.Device(dst_dev):
        cupy.cuda.runtime.deviceSynchronize()
    with cupy.cuda.Device(src_dev):
        cupy.cuda.runtime.deviceSynchronize()
    return _gbps(nbytes * reps, time.perf_counter() - t0)


async def _windowed(n: int, window: int, one: Any) -> float:
    sem = anyio.Semaphore(window)
    t0 = time.perf_counter()

    async def run(i: int) -> None:
        async with sem:
            await one(i)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(run, i)
    return time.perf_counter() - t0


async def bench_ipc(repeats: int, quick: bool) -> list[dict[str, Any]]:
    ngpu = cupy.cuda.runtime.getDeviceCount()
    dst_dev = 1 if ngpu > 1 else 0
    size = (64 if quick else 256) * MiB
    writes = 8 if quick else 16
    out = []
    async with spawn_peer(watch_interval_us=20) as peer:
        e = peer.engine
        with cupy.cuda.Device(0):
            src = cupy.ones(size, cupy.uint8)
        mr = await e.register(src)
        dst = await peer.register("g", size, device="cuda", gpu=dst_dev)
        await e.write(mr, dst)  # opens the IPC handle
        ours, base = [], []
        for _ in range(repeats):
            dt = await _windowed(writes, 4, lambda i: e.write(mr, dst))
            ours.append(_gbps(size * writes, dt))
            base.append(memcpy_peer(size, 0, dst_dev, writes))
        out.append(
            _row(f"IPC write {size // MiB} MiB GPU0->GPU{dst_dev}", ours, "cudaMemcpyPeer", base, 0.90)
        )
        page = 64 << 10
        npages = size // page
        rng = np.random.default_rng(0)
        dp = rng.permutation(npages)
        sp = np.arange(npages)
        calls = 4 if quick else 8
        await e.write_paged(mr, dst, page_size=page, src_pages=sp, dst_pages=dp)
        ours, base = [], []
        for _ in range(repeats):
            dt = await _windowed(
                calls, 2, lambda i: e.write_paged(mr, dst, page_size=page, src_pages=sp, dst_pages=dp)
            )
            ours.append(_gbps(size * calls, dt))
            base.append(memcpy_peer(size, 0, dst_dev, calls))
        out.append(
            _row(f"IPC paged 64 KiB x {npages} GPU0->GPU{dst_dev}", ours, "cudaMemcpyPeer", base, 0.70)
        )
        assert e.stats()["gpu_ipc"] > 0
    return out


async def bench_staged(repeats: int, quick: bool) -> list[dict[str, Any]]:
    size = (16 if quick else 64) * MiB
    writes = 4 if quick else 8
    ours, base = [], []
    async with spawn_peer(same_host=None, gpu_ipc=False) as peer:
        e = peer.engine
        with cupy.cuda.Device(0):
            src = cupy.ones(size, cupy.uint8)
        mg = await e.register(src)
        dg = await peer.register("g", size, device="cuda")
        hsrc = np.ones(size, np.uint8)
        mh = await e.register(hsrc)
        dh = await peer.register("h", size)
        imm = 100

        async def run(mr: aiote.MemoryRegion, dst: aiote.MemoryDescriptor) -> float:
            nonlocal imm
            imm += 1
            k = imm
            t0 = time.perf_counter()
            await _windowed(writes, 2, lambda i: e.write(mr, dst, imm=k))
            await peer.wait(imm=k, n=writes, timeout=120)  # GPU: after the H2D copies
            return time.perf_counter() - t0

        await run(mg, dg)
        await run(mh, dh)
        for _ in range(repeats):
            ours.append(_gbps(size * writes, await run(mg, dg)))
            base.append(_gbps(size * writes, await run(mh, dh)))
        assert e.stats()["gpu_staged"] > 0
    return [_row(f"staged tcp {size // MiB} MiB GPU->GPU", ours, "host->host tcp", base, 0.90)]


async def bench_uvm(iters: int) -> list[dict[str, Any]]:
    rows = []
    for interval in (100, 10):
        async with aiote.open_engine(watch_interval_us=interval) as e:
            flag = e.uvm_watcher()
            w = e.uvm_watcher()
            kern = cupy.RawKernel(_ECHO, "echo")
            s = cupy.cuda.Stream(non_blocking=True)
            kern((1,), (1,), (np.uint64(flag.device_pointer), np.uint64(w.device_pointer)), stream=s)
            lat = []
            try:
                for i in range(1, iters + 1):
                    t0 = time.perf_counter_ns()
                    flag.host[0] = i
                    await w.wait_for(i, timeout=10)
                    lat.append((time.perf_counter_ns() - t0) / 1000)
                    await anyio.sleep(0.0005)
            finally:  # the echo kernel ends on this value, also after an error: else freeing
                flag.host[0] = (1 << 64) - 1  # the watched memory would wait for it forever
                s.synchronize()
            lat.sort()
            p50 = lat[len(lat) // 2]
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            rows.append(
                {
                    "case": f"UVM watcher store->resume, watch_interval_us={interval}",
                    "p50_us": p50,
                    "p99_us": p99,
                }
            )
            print(f"{rows[-1]['case']:<62} p50 {p50:8.1f} us   p99 {p99:8.1f} us", flush=True)
            w.close()
            flag.close()
    return rows


def _row(case: str, ours: list[float], base_name: str, base: list[float], target: float) -> dict[str, Any]:
    m, lo, hi = _med(ours)
    bm, blo, bhi = _med(base)
    ratio = m / bm
    verdict = "PASS" if ratio >= target else "MISS"
    print(
        f"{case:<44} aiote {m:7.1f} GB/s [{lo:.1f}-{hi:.1f}]   {base_name} {bm:7.1f} GB/s "
        f"[{blo:.1f}-{bhi:.1f}]   ratio {ratio:.2f}  target >= {target:.2f} {verdict}",
        flush=True,
    )
    return {
        "case": case,
        "aiote_gbps": m,
        "spread": [lo, hi],
        "baseline": base_name,
        "baseline_gbps": bm,
        "baseline_spread": [blo, bhi],
        "ratio": ratio,
        "target": target,
        "pass": ratio >= target,
    }


async def main(args: argparse.Namespace) -> None:
    ngpu = cupy.cuda.runtime.getDeviceCount()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(
        f"# aiote GPU benchmarks: {ngpu} x {props['name'].decode()}, aiote {aiote.__version__}, "
        f"CuPy {cupy.__version__}, repeats {args.repeats}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    rows += await bench_ipc(args.repeats, args.quick)
    rows += await bench_staged(args.repeats, args.quick)
    rows += await bench_uvm(100 if args.quick else 500)
    if args.json:
        text = json.dumps({"gpus": ngpu, "gpu": props["name"].decode(), "rows": rows}, indent=1)
        await anyio.Path(args.json).write_text(text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("FI_PROVIDER", "tcp,ofi_rxm,shm")
    anyio.run(main, a)
