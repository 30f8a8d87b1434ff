"""One write over the CUDA-IPC rail, from the writer's call to the owner's counter: its latency
and where it goes (GPU 0 -> GPU 1, or two processes on GPU 0 with one GPU).

Two processes, one engine each (``open_engine()`` defaults). Each iteration, after both paused
1 ms and met through a pipe (so that the owner already waits, as MoE's receive halves do), the
writer writes ``size`` bytes with an immediate and the owner awaits its counter. Printed: the
one-way time p50/p99 (writer's call -> owner's task resumed) and, at p50, when the writer's
stream got the copy's completion kernel (``fence_post``), when the writer's loop saw it
(``fence_seen``), when the write returned, and, with messages, when the credit message reached
the owner (``on_part``). Then the same for a ``write_imm`` alone (after those writes: it goes
on the rail's stream). ``AIOTE_CREDIT_LANES=0`` compares with a message per credit;
``BENCH_PROFILE=1`` prints the writer's profile (cProfile) over the first size's writes.

    python benchmarks/bench_ipc_credit.py [--iters 300] [--engine-opts JSON]
    python benchmarks/bench_ipc_credit.py --host     # the host GPU emulation, on any machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

SIZES = (16, 1 << 20, 0)  # 0: a write_imm (after the writes above); --sizes for others
MARKS: dict[str, list[float]] = {}


def _mark(name: str) -> None:
    MARKS.setdefault(name, []).append(time.perf_counter())


def _patch() -> None:
    """Marks in the GPU support's completion and message paths (this benchmark only)."""
    from aiote._core import _gpu

    for cls, name, tag in ((_gpu._Line, "on_value", "fence_seen"), (_gpu.GpuSupport, "on_part", "on_part"),
                           (_gpu._Line, "fence", "fence_post")):
        orig = getattr(cls, name)

        def wrapped(self: Any, *a: Any, _o: Any = orig, _t: str = tag, **k: Any) -> Any:
            _mark(_t)
            return _o(self, *a, **k)

        setattr(cls, name, wrapped)


def _arrays(rank: int, host: bool, n: int) -> tuple[Any, Any]:
    """The owner's region and the writer's source of ``n`` bytes: CuPy arrays, or with
    ``host`` the host GPU emulation's (``gpu_backend="host"``, no GPU needed)."""
    if host:
        from aiote.testing import HostDeviceArray

        return HostDeviceArray(n, shared=True), HostDeviceArray(n)
    import cupy

    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy.zeros(n, cupy.uint8), cupy.ones(n, cupy.uint8)


async def _side(rank: int, conn: Any, q: Any, iters: int, opts: dict[str, Any], sizes: list[int]) -> None:
    import aiote

    _patch()
    dst, src_arr = _arrays(rank, opts.get("gpu_backend") == "host", max(max(sizes), 1 << 20))
    async with aiote.open_engine(**opts) as e:
        mr = await e.register(dst)
        src = await e.register(src_arr)
        conn.send(bytes(mr.descriptor))
        peer = aiote.MemoryDescriptor.from_bytes(conn.recv())
        out = {}
        prof = None
        if rank == 0 and os.environ.get("BENCH_PROFILE"):
            import cProfile

            prof = cProfile.Profile()
        for k, size in enumerate(sizes):
            MARKS.clear()
            if prof is not None and k == 0:
                prof.enable()
            for i in range(iters):
                await asyncio.sleep(0.001)
                imm = 1 + i + 100000 * k
                if rank == 1:
                    conn.send(0)
                    await e.imm_counter(imm).wait(1, timeout=5)
                    _mark("r_woke")
                else:
                    conn.recv()
                    _mark("w_start")
                    if size:
                        await e.write(src, peer, length=size, imm=imm)
                    else:
                        await e.write_imm(peer, imm)
                    _mark("w_ret")
            if prof is not None and k == 0:
                import pstats

                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(35)
            out[size] = {k: v[20:] for k, v in MARKS.items()}
        st = e.stats()
        q.put((rank, out, (st["gpu_ipc"], st["gpu_lane_credits"])))


def _child(rank: int, conn: Any, q: Any, iters: int, opts: dict[str, Any], sizes: list[int]) -> None:
    asyncio.run(_side(rank, conn, q, iters, opts, sizes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--engine-opts", default="{}", help="JSON of open_engine() keyword arguments")
    p.add_argument("--host", action="store_true", help="the host GPU emulation (no GPU)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per write (0: write_imm)")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    opts = json.loads(args.engine_opts)
    if args.host:
        opts["gpu_backend"] = "host"
    mp.set_start_method("spawn")
    a, b = mp.Pipe()
    q: Any = mp.Queue()
    procs = [mp.Process(target=_child, args=(r, c, q, args.iters, opts, sizes)) for r, c in ((0, a), (1, b))]
    for proc in procs:
        proc.start()
    res = {r: (o, n) for r, o, n in (q.get() for _ in procs)}
    for proc in procs:
        proc.join()
    lanes = os.environ.get("AIOTE_CREDIT_LANES", "1")
    print(f"IPC writes, of them credited through a lane: {res[0][1]} (AIOTE_CREDIT_LANES={lanes}, {opts})")
    for size in sizes:
        w, o = res[0][0][size], res[1][0][size]
        base = np.array(w["w_start"])
        at = []
        for name, d in (("fence_post", w), ("fence_seen", w), ("w_ret", w), ("on_part", o)):
            if len(d.get(name, [])) >= len(base):
                at.append(f"{name} {np.median(np.array(d[name][: len(base)]) - base) * 1e6:.0f}")
        one = (np.array(o["r_woke"][: len(base)]) - base) * 1e6
        what = f"{size:>8} B" if size else "write_imm"
        print(f"{what}: one-way p50 {np.median(one):.0f} us, p99 {np.percentile(one, 99):.0f} us; "
              f"at p50 (us after the call): {', '.join(at)}")


if __name__ == "__main__":
    main()
