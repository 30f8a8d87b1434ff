"""Does a copy into memory another process exported through CUDA IPC slow down after the
source was written? The open question of docs/weights.md (one trainer GPU -> one inference
GPU): copies inside an aiote push run at 260-330 GB/s after the sender wrote its shards, while
a one-process ``cudaMemcpyPeerAsync`` into a peer allocation does not slow down at all.

    python benchmarks/gpu_ipc_fresh.py [--gb 2.18] [--repeats 5]

GPU 0 -> GPU 1, one ``cudaMemcpyPeerAsync`` of ``--gb`` GB timed with CUDA events, medians of
``--repeats``, in four cases, each fresh (the source rewritten by a fill kernel right before)
and warm (the same copy again): into a peer allocation of this process; into an allocation of
a child process on GPU 1 opened here through CUDA IPC (as aiote's IPC rail writes); both again
with the source exported through CUDA IPC too (as ``engine.register`` exports it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
from typing import Any

STATES = ("fresh", "warm")


def child(nbytes: int) -> None:
    """On GPU 1: allocate, print the IPC handle in hex, keep it until stdin closes."""
    import cupy

    with cupy.cuda.Device(1):
        buf = cupy.zeros(nbytes, cupy.uint8)
        print(bytes(cupy.cuda.runtime.ipcGetMemHandle(buf.data.ptr)).hex(), flush=True)
        sys.stdin.read()


def timed(cupy: Any, src: Any, dst_ptr: int, nbytes: int, repeats: int, fresh: bool) -> float:
    """GB/s of the median copy (after one warm-up)."""
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    gbps = []
    for i in range(repeats + 1):
        if fresh:
            src.fill(i % 200)
            cupy.cuda.Device(0).synchronize()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        rt.memcpyPeerAsync(dst_ptr, 1, src.data.ptr, 0, nbytes, stream.ptr)
        b.record(stream)
        b.synchronize()
        gbps.append(nbytes / (cupy.cuda.get_elapsed_time(a, b) / 1e3) / 1e9)
    return float(statistics.median_low(gbps[1:]))


def main(a: argparse.Namespace) -> None:
    import cupy

    nbytes = int(a.gb * 1e9) // 4096 * 4096
    rt = cupy.cuda.runtime
    for d, o in ((0, 1), (1, 0)):
        with cupy.cuda.Device(d), contextlib.suppress(rt.CUDARuntimeError):  # already enabled
            rt.deviceEnablePeerAccess(o)
    with cupy.cuda.Device(1):
        own = cupy.zeros(nbytes, cupy.uint8)
    cmd = [sys.executable, __file__, "--child", str(nbytes)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    handle = bytes.fromhex(proc.stdout.readline().strip())
    try:
        with cupy.cuda.Device(0):
            ipc = int(rt.ipcOpenMemHandle(handle, 1))  # cudaIpcMemLazyEnablePeerAccess
            src = cupy.ones(nbytes, cupy.uint8)
            for exported in (False, True):
                if exported:
                    rt.ipcGetMemHandle(src.data.ptr)
                for where, ptr in (("this process's peer allocation", own.data.ptr), ("IPC-opened", ipc)):
                    got = {st: timed(cupy, src, ptr, nbytes, a.repeats, st == "fresh") for st in STATES}
                    how = "exported" if exported else "not exported"
                    print(
                        f"{nbytes / 1e9:.2f} GB into {where}, source {how}: "
                        f"fresh {got['fresh']:.1f} GB/s, warm {got['warm']:.1f} GB/s",
                        flush=True,
                    )
            rt.ipcCloseMemHandle(ipc)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.18)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
    else:
        main(args)
