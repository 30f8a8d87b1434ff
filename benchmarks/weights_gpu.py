"""One trainer GPU -> one inference GPU: the weight update of ``bench_weights.py --gpu``.

One trainer worker process on GPU 0 pushes the model (Llama-3-8B layer shapes, bf16) into one
inference worker process on GPU 1 over the CUDA-IPC rail (``register_sources``), its tensors
in one allocation each, then in one flat parameter buffer, for each ``--ipc-streams`` value
(the engine's option: streams per GPU that IPC writes take in turn).

Every path is timed in two states of the source memory, in the same run:

- **fresh**: the source was just written by the GPU (a fill kernel over every shard, as a
  training step's optimizer writes the parameters) before each timed transfer;
- **warm**: the same bytes moved again right after an identical transfer, nothing written
  in between (what a repeated benchmark of one copy measures).

The copy engines read freshly written memory more slowly than memory they just read (about
300 against 390 GB/s on 2 x H200), so each path is compared with the ceiling of the same
state. Baselines, same run: ``cudaMemcpyPeerAsync`` GPU 0 -> GPU 1 of the same bytes in one
process (peer access on, CUDA events), as one copy and as 2 and 4 concurrent copies on their
own streams (the ceiling: the fastest of them), and one copy per plan write on one stream;
NCCL broadcast (torch.distributed, 2 ranks) of the same bytes; one aiote ``engine.write`` of
all the bytes (warm).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from weights_multi import free_port  # (a sibling script: benchmarks/ is on the path)

from aiote import weights as W
from aiote.weights._worker import spawn_worker

GB = 1e9
SPLITS = (1, 2, 4)
_SM_COPY = r"""
extern "C" __global__ void sm_copy(const uint4 *__restrict__ src, uint4 *__restrict__ dst,
                                   unsigned long long n) {
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += step)
        dst[i] = src[i];
}
"""


def _events_wall(cupy: Any, streams: list[Any], launch: Any) -> float:
    """Seconds from an event on ``streams[0]`` (the others wait for it) to the last stream's
    end, around ``launch(i, stream)`` for each stream."""
    start = cupy.cuda.Event()
    start.record(streams[0])
    stops = []
    for i, s in enumerate(streams):
        s.wait_event(start)
        launch(i, s)
        e = cupy.cuda.Event()
        e.record(s)
        stops.append(e)
    for e in stops:
        e.synchronize()
    return max(cupy.cuda.get_elapsed_time(start, e) for e in stops) / 1e3


def peer_copy(plan: W.Plan, region: int, repeats: int) -> dict[str, Any]:
    """cudaMemcpyPeerAsync GPU 0 -> GPU 1 of the bytes the plan writes, medians of ``repeats``
    after a warm-up: ``warm[k]`` / ``fresh[k]`` the bytes as ``k`` concurrent copies (one
    stream each) without / after rewriting the source on GPU 0; ``loop`` one copy per plan
    write on one stream (warm)."""
    import cupy

    rt = cupy.cuda.runtime
    for d, o in ((0, 1), (1, 0)):
        with cupy.cuda.Device(d), contextlib.suppress(rt.CUDARuntimeError):  # already enabled
            rt.deviceEnablePeerAccess(o)
    writes = plan.sender(0).writes
    nbytes = sum(w.nbytes for w in writes)
    with cupy.cuda.Device(0):
        src = cupy.ones(nbytes, cupy.uint8)
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(SPLITS))]
    with cupy.cuda.Device(1):
        dst = cupy.zeros(max(region, nbytes), cupy.uint8)

    def timed(copies: list[tuple[int, int, int]], k: int, fresh: bool) -> float:
        walls = []
        with cupy.cuda.Device(0):
            for i in range(repeats + 1):
                if fresh:
                    src.fill(i % 200)
                    cupy.cuda.Device(0).synchronize()

                def launch(j: int, s: Any) -> None:
                    for so, do, n in copies[j::k]:
                        rt.memcpyPeerAsync(dst.data.ptr + do, 1, src.data.ptr + so, 0, n, s.ptr)

                walls.append(_events_wall(cupy, streams[:k], launch))
        return float(statistics.median_low(walls[1:]))

    def sm(fresh: bool) -> float:
        """The same bytes copied by the SMs (16-byte loads and stores over NVLink, as NCCL's
        kernels copy) instead of a copy engine: one kernel, 4 blocks of 512 per SM."""
        walls = []
        with cupy.cuda.Device(0):
            kernel = cupy.RawKernel(_SM_COPY, "sm_copy")
            blocks = 4 * cupy.cuda.Device(0).attributes["MultiProcessorCount"]
            for i in range(repeats + 1):
                if fresh:
                    src.fill(i % 200)
                    cupy.cuda.Device(0).synchronize()

                def launch(j: int, s: Any) -> None:
                    kernel((blocks,), (512,), (src.data.ptr, dst.data.ptr, np.uint64(nbytes // 16)), stream=s)

                walls.append(_events_wall(cupy, streams[:1], launch))
        return float(statistics.median_low(walls[1:]))

    def split(k: int) -> list[tuple[int, int, int]]:
        cut = [nbytes * i // k // 4096 * 4096 for i in range(k)] + [nbytes]
        return [(cut[i], cut[i], cut[i + 1] - cut[i]) for i in range(k)]

    offs, at = [], 0
    for w in writes:  # the sources one after another, each write into its target offset
        offs.append((at, w.offset, w.nbytes))
        at += w.nbytes
    return {
        "warm": {k: timed(split(k), k, False) for k in SPLITS},
        "fresh": {k: timed(split(k), k, True) for k in SPLITS},
        "loop": timed(offs, 1, False),
        "sm": {"warm": sm(False), "fresh": sm(True)},
        "writes": len(writes),
    }


def nccl(nbytes: int, repeats: int) -> dict[str, float] | None:
    """NCCL broadcast of ``nbytes`` GPU 0 -> GPU 1 (2 processes): median seconds, warm and with
    the source rewritten on GPU 0 before each broadcast; None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("NCCL baseline skipped: torch is not installed")
        return None
    port = free_port()
    args = [sys.executable, __file__, str(nbytes), str(port), str(repeats)]
    procs = [subprocess.Popen([*args, str(r)], stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    for line in out.splitlines():
        if line.startswith("NCCL "):
            walls = json.loads(line[5:])
            return {k: float(statistics.median_low(v)) for k, v in walls.items()}
    return None


def nccl_rank(rank: int, nbytes: int, port: int, repeats: int) -> None:
    """One rank of :func:`nccl`."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    walls: dict[str, list[float]] = {"warm": [], "fresh": []}
    for state in ("warm", "fresh"):
        for i in range(repeats + 1):
            if state == "fresh" and rank == 0:
                buf.fill_(i % 200)
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            dist.broadcast(buf, src=0)
            torch.cuda.synchronize()
            if i:
                walls[state].append(time.perf_counter() - t)
    if rank == 0:
        print("NCCL " + json.dumps(walls), flush=True)
    dist.destroy_process_group()


async def aiote_push(
    sources: Any, specs: Any, repeats: int, flat: bool, ipc_streams: int, memory: str
) -> dict[str, Any]:
    """One trainer worker on GPU 0 pushing into one inference worker on GPU 1: medians of the
    sender's push time and the end to end time (command sent -> receiver's wait returned),
    fresh (every shard rewritten by the GPU before each version) and warm (the same shards
    pushed again as the next version). ``memory``: the receiver's targets in ``"cuda"``
    (cudaMalloc, opened with cudaIpcOpenMemHandle) or ``"alloc_gpu"`` (Engine.alloc_gpu)."""
    tx = await spawn_worker("asyncio", "default", gpu=0, ipc_streams=ipc_streams)
    rx = await spawn_worker("asyncio", "default", gpu=1, ipc_streams=ipc_streams)
    try:
        tg_, n = W.pack_targets(0, specs[0], sources)
        desc = (await rx.call(op="alloc", nbytes=n, memory=memory))["desc"]
        plan = W.plan(sources, W.with_desc(tg_, bytes.fromhex(desc)), chunk_bytes=256 << 20)
        await tx.call(
            op="sender", plan=plan.sender(0).to_json(), max_tmp_bytes=1 << 30, register_sources=True
        )
        await rx.call(op="receiver", plan=plan.receiver(0).to_json())
        await tx.call(reply_timeout=300, op="prepare", version=0, fill="fast", flat=flat)
        rows: dict[str, list[dict[str, Any]]] = {"fresh": [], "warm": []}
        v = 0
        for state in ("fresh", "warm"):
            for i in range(repeats + 1):
                v += 1
                if state == "fresh":
                    await tx.call(reply_timeout=300, op="prepare", version=v, fill="gpu", flat=flat)
                t0, t = time.time(), time.perf_counter()
                await tx.send(op="push", version=v, prepared=True, timeout=300)
                got = await rx.call(reply_timeout=300, op="wait", version=v, timeout=300)
                wall = time.perf_counter() - t
                rep = await tx.reply(300)
                if i:  # the first of each state is its warm-up
                    rows[state].append(
                        dict(wall_s=wall, push_s=rep["stats"]["wall_s"], stats=rep["stats"],
                             dispatch_s=rep["t0"] - t0, notice_s=got["at"] - rep["t1"])
                    )
        rail = await tx.call(reply_timeout=300, op="rail", desc=desc, nbytes=n, repeats=repeats)
    finally:
        await tx.aclose()
        await rx.aclose()
    out: dict[str, Any] = {"rail_s": statistics.median_low(rail["walls"])}
    for state, rs in rows.items():
        mid = sorted(rs, key=lambda x: x["push_s"])[(len(rs) - 1) // 2]
        out[state] = dict(
            mid,
            wall_s=statistics.median_low([x["wall_s"] for x in rs]),
            push_s=statistics.median_low([x["push_s"] for x in rs]),
        )
    return out


def _gbps(nbytes: int, t: float) -> str:
    return f"{t * 1e3:.2f} ms = {nbytes / t / GB:.1f} GB/s"


def print_baselines(nbytes: int, peer: dict[str, Any], nc: dict[str, float] | None) -> dict[str, float]:
    """Prints the copies and NCCL; returns the ceiling of each state (its fastest copy)."""
    ceil = {}
    for state in ("fresh", "warm"):
        t = peer[state]
        ceil[state] = min(t.values())
        print(
            f"GPU cudaMemcpyPeerAsync, {state} source, all {nbytes / GB:.2f} GB: "
            + "; ".join(f"{k} concurrent cop{'y' if k == 1 else 'ies'} {_gbps(nbytes, t[k])}" for k in SPLITS)
            + f" -> ceiling {_gbps(nbytes, ceil[state])}"
        )
    print(
        "GPU copy kernel on the SMs instead of a copy engine (reference, not a ceiling): fresh "
        f"{_gbps(nbytes, peer['sm']['fresh'])}, warm {_gbps(nbytes, peer['sm']['warm'])}"
    )
    loop = _gbps(nbytes, peer["loop"])
    print(f"GPU reference, one copy per plan write ({peer['writes']}, one stream, warm): {loop}")
    if nc is not None:
        for state in ("fresh", "warm"):
            print(f"GPU NCCL broadcast, {state} source: {_gbps(nbytes, nc[state])} "
                  f"= {ceil[state] / nc[state]:.2f} of the ceiling")
    return ceil


def print_push(
    nbytes: int,
    r: dict[str, Any],
    layout: str,
    streams: int,
    ceil: dict[str, float],
    nc: dict[str, float] | None,
) -> None:
    """Prints one layout's aiote figures against the ceiling and NCCL of the same state."""
    for state in ("fresh", "warm"):
        x = r[state]
        for what, t in (("sender's push", x["push_s"]), ("end to end", x["wall_s"])):
            line = (
                f"GPU aiote push, {layout}, ipc_streams={streams}, {state} source, {what}: "
                f"{_gbps(nbytes, t)}; / ceiling {ceil[state] / t:.2f}"
            )
            if nc is not None:
                line += f", / NCCL {nc[state] / t:.2f}"
            print(line)
        s = x["stats"]
        print(
            f"  {s['writes']} writes, {s['write_s'] * 1e3:.2f} ms of writes summed, staging wait "
            f"{s['staging_wait_s'] * 1e3:.2f} ms, transform {s['transform_s'] * 1e3:.2f} ms, notify "
            f"{s['notify_s'] * 1e3:.2f} ms ({s.get('imms_behind_writes', 0)} behind the writes), "
            f"direct {s['direct_bytes'] / GB:.2f} GB, peak staging "
            f"{s['peak_staging_bytes'] / 2**20:.0f} MiB; command to push start "
            f"{x['dispatch_s'] * 1e3:.2f} ms, push end to the receiver's wait return "
            f"{x['notice_s'] * 1e3:.2f} ms"
        )
    print(f"  one aiote write of all the bytes (warm): {_gbps(nbytes, r['rail_s'])}")


async def run(
    sources: Any, specs: Any, repeats: int, ipc_streams: list[int],
    memories: tuple[str, ...] = ("cuda", "alloc_gpu"),
) -> None:
    """The whole one-pair GPU benchmark (see the module's docstring)."""
    nbytes = sum(int(np.prod(s.local_shape)) * 2 for s in sources)
    tg_, n = W.pack_targets(0, specs[0], sources)
    plan0 = W.plan(sources, tg_, chunk_bytes=256 << 20)
    print(
        f"GPU model: {len(sources)} tensors, {nbytes / GB:.2f} GB bf16, 1 trainer (GPU 0) -> "
        f"1 inference rank (GPU 1), {len(plan0.sender(0).writes)} plan writes; medians of {repeats}"
    )
    peer = peer_copy(plan0, n, repeats)
    nc = nccl(nbytes, repeats)
    ceil = print_baselines(nbytes, peer, nc)
    for memory in memories:
        for streams in ipc_streams:
            for flat in (False, True):
                r = await aiote_push(sources, specs, repeats, flat, streams, memory)
                layout = "one flat parameter buffer" if flat else "one allocation per tensor"
                where = "Engine.alloc_gpu" if memory == "alloc_gpu" else "cudaMalloc"
                print_push(nbytes, r, f"{layout}, targets in {where}", streams, ceil, nc)


if __name__ == "__main__":  # an NCCL rank: NBYTES PORT REPEATS RANK
    nb, pt, rp, rk = (int(x) for x in sys.argv[1:5])
    nccl_rank(rk, nb, pt, rp)
