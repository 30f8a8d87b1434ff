"""aiote.weights with CuPy tensors on real GPUs: skipped cleanly where there is no CuPy or no
GPU. Trainer and inference ranks are worker processes with ``--gpu``: over the CUDA-IPC rail
between two GPUs of one host (GPU 0 -> GPU 1; one GPU: both on GPU 0), and staged through host
memory over tcp (``gpu_ipc=False``); every inference shard byte-equal to the NumPy reference,
fused qkv, column slices and casts done on the GPU. Plus in one process: the sender picks CuPy
from the tensors, its staging pool lives on the GPU, and GPU tensors are refused when mixed
with NumPy ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from _cuda import require_cuda
from test_weights import model_2x2, reference

import aiote
from aiote import weights as W
from aiote.testing import engine_pair
from aiote.weights._worker import Worker, spawn_worker

cupy, NGPU = require_cuda()

pytestmark = pytest.mark.anyio


async def _gpu_world(
    backend: str, route: str, gpu_ipc: bool, tmp: Path, ipc_streams: int = 1, memory: str = "cuda"
) -> None:
    sources, specs = model_2x2()
    rx_gpu = 1 if NGPU > 1 else 0
    workers: list[Worker] = []
    try:
        kw = {"gpu_ipc": gpu_ipc, "ipc_streams": ipc_streams}
        senders = [await spawn_worker(backend, route, gpu=0, **kw) for _ in range(2)]
        workers += senders
        receivers = [await spawn_worker(backend, route, gpu=rx_gpu, **kw) for _ in range(2)]
        workers += receivers
        targets: dict[int, list[W.TargetShard]] = {}
        for r, w in enumerate(receivers):
            tg, n = W.pack_targets(r, specs(r, 2), sources)
            desc = (await w.call(op="alloc", nbytes=n, memory=memory))["desc"]
            targets[r] = W.with_desc(tg, bytes.fromhex(desc))
        plan = W.plan(sources, [t for r in (0, 1) for t in targets[r]], chunk_bytes=512)
        plan.validate()
        for s, w in enumerate(senders):
            await w.call(
                op="sender", plan=plan.sender(s).to_json(), max_tmp_bytes=4096, register_sources=s == 1
            )
        for r, w in enumerate(receivers):
            await w.call(op="receiver", plan=plan.receiver(r).to_json())
        shapes = {s.name: (s.shape, s.dtype) for s in sources}
        pushed: list[tuple[int, dict[str, Any]]] = []  # (sender, its push's PushStats)
        for v in (1, 2):

            async def push(s: int, v: int) -> None:
                pushed.append((s, (await senders[s].call(op="push", version=v, timeout=60))["stats"]))

            async with anyio.create_task_group() as g:
                for s in range(len(senders)):
                    g.start_soon(push, s, v)
                for w in receivers:
                    g.start_soon(lambda w=w, v=v: w.call(op="wait", version=v, timeout=60))
            for r, w in enumerate(receivers):
                path = tmp / f"r{r}.bin"
                await w.call(op="dump", path=str(path))
                buf = np.fromfile(path, np.uint8)
                for t in targets[r]:
                    want = reference(t, shapes, v)
                    assert buf[t.offset : t.offset + len(want)].tobytes() == want, (r, t.name, v)
        stats = (await senders[0].call(op="stats"))["stats"]
        # the data went over the rail asked for (the zero-byte immediates may take either path)
        assert stats["gpu_ipc" if gpu_ipc else "gpu_staged"] >= 10, stats
        # over the rail each receiver's immediate went right behind its writes, on the rail
        lanes = [(s, len(p["bytes_by_receiver"])) for s, p in pushed]
        assert [p["imms_behind_writes"] for _, p in pushed] == [n if gpu_ipc else 0 for _, n in lanes], pushed
        assert stats["gpu_ipc_imm"] == (sum(n for s, n in lanes if s == 0) if gpu_ipc else 0), stats
    finally:
        with anyio.CancelScope(shield=True):
            for w in workers:
                await w.aclose()


@pytest.mark.parametrize(("ipc_streams", "memory"), [(1, "cuda"), (4, "cuda"), (1, "alloc_gpu")])
async def test_gpu_push_over_the_cuda_ipc_rail(
    anyio_backend: str, tmp_path: Path, ipc_streams: int, memory: str
) -> None:
    """2 trainers on GPU 0 -> 2 inference ranks on GPU 1 (one host), two versions; IPC writes
    on one stream, or taking 4 in turn (the engine's ``ipc_streams``); the targets in
    ``cudaMalloc`` memory or in ``Engine.alloc_gpu`` memory (mapped through a descriptor)."""
    await _gpu_world(anyio_backend, "default", True, tmp_path, ipc_streams, memory)


async def test_gpu_push_staged_over_tcp(anyio_backend: str, tmp_path: Path) -> None:
    """The same, staged through pinned host memory over tcp (the path to another host)."""
    await _gpu_world(anyio_backend, "tcp", False, tmp_path)


async def test_gpu_sender_in_one_process_picks_cupy_and_refuses_mixed_tensors() -> None:
    sources = [
        W.SourceShard("w", (64, 32), "float32", 0, (0, 64)),
        W.SourceShard("b", (32,), "float32", 0, (0, 32)),
    ]
    async with engine_pair() as (a, b):
        tg, n = W.pack_targets(
            0,
            [("w", "float16", [W.Piece("w", (0, 64), (8, 24))]), ("b", "float32", [W.Piece("b", (0, 32))])],
            sources,
        )
        dst = cupy.zeros(n, cupy.uint8)
        mr = await b.register(dst)
        p = W.plan(sources, W.with_desc(tg, bytes(mr.descriptor)), chunk_bytes=256)
        rx = W.WeightReceiver(b, p.receiver(0))
        w = cupy.arange(64 * 32, dtype=cupy.float32).reshape(64, 32) / 7
        bias = cupy.ones(32, cupy.float32)
        async with W.WeightSender(a, p.sender(0), max_tmp_bytes=1024) as tx:
            with pytest.raises(aiote.InvalidArgument, match="all NumPy or all CuPy"):
                await tx.push({"w": w, "b": np.ones(32, np.float32)}, version=1, timeout=10)
            stats = await tx.push({"w": w, "b": bias}, version=1, timeout=30)
            await rx.wait_version(1, timeout=30)
            assert isinstance(tx._staging, cupy.ndarray)
        assert stats.peak_staging_bytes <= 1024
        host = dst.get()
        want = cupy.asnumpy(w[:, 8:24]).astype(np.float16).tobytes()
        assert host[: len(want)].tobytes() == want
        assert host[tg[1].offset : tg[1].offset + 128].view(np.float32).tolist() == [1.0] * 32
