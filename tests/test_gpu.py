"""GPU memory with real CUDA (CuPy): skipped cleanly where there is no CuPy or no GPU (CI).
Run on a GPU machine by scripts/gpu-run.sh (its output is recorded in docs/gpu.md).

Covers: CuPy registration and descriptors, staging over tcp between processes (GPU -> GPU,
GPU -> host, host -> GPU, paged), the credit arriving only once the bytes are in GPU memory,
the CUDA-IPC rail between processes (two GPUs when there are two), stream ordering after a
real kernel, and the UVM watcher woken by a kernel's store.
"""

from __future__ import annotations

import numpy as np
import pytest
from _cuda import require_cuda

import aiote
from aiote._core import _vmm
from aiote.testing import digest, pattern, spawn_peer

cupy, NGPU = require_cuda()

pytestmark = pytest.mark.anyio

_SPIN_STORE = cupy.RawKernel(
    r"""
extern "C" __global__ void spin_store(unsigned char *buf, long long n, unsigned char v,
                                      unsigned long long *word, unsigned long long value,
                                      long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (long long i = threadIdx.x; i < n; i += blockDim.x) buf[i] = v;
    __syncthreads();
    if (threadIdx.x == 0 && word) {
        __threadfence_system();
        *((volatile unsigned long long *)word) = value;
    }
}
""",
    "spin_store",
)


def _gpu_pattern(n: int, seed: int, device: int = 0) -> tuple[object, np.ndarray]:
    host = pattern(n, seed)
    with cupy.cuda.Device(device):
        return cupy.asarray(host), host


async def test_register_cupy_descriptor() -> None:
    async with aiote.open_engine() as e:
        arr, _ = _gpu_pattern(1 << 20, 1)
        mr = await e.register(arr)
        d = aiote.MemoryDescriptor.from_bytes(bytes(mr.descriptor))
        assert d.on_gpu and d.device_id == 0 and mr.device == 0
        assert d.gpu is not None and d.gpu.ipc_handle  # exported for same-host peers
        await e.unregister(mr)

        class OnlyDLPack:  # no __cuda_array_interface__: registered through DLPack
            def __init__(self, a: object) -> None:
                self.a = a

            def __dlpack__(self, **kw: object) -> object:
                return self.a.__dlpack__(**kw)  # type: ignore[attr-defined]

            def __dlpack_device__(self) -> object:
                return self.a.__dlpack_device__()  # type: ignore[attr-defined]

        md = await e.register(OnlyDLPack(arr))
        assert md.on_gpu and md.nbytes == 1 << 20
        await e.unregister(md)
        with pytest.raises(aiote.InvalidArgument, match="contiguous"):
            await e.register(cupy.zeros((64, 64), cupy.float32)[:, ::2])
    # tcp has no FI_HMEM: asking the NICs to register GPU memory directly is refused clearly
    async with aiote.open_engine(gpu_direct=True) as e:
        with pytest.raises(aiote.RegistrationError, match="FI_HMEM"):
            await e.register(cupy.zeros(4096, cupy.uint8))


@pytest.mark.parametrize("n", [1, 4097, (9 << 20) + 3])
async def test_staged_tcp_gpu_to_gpu(n: int) -> None:
    async with spawn_peer(same_host=None, gpu_ipc=False) as peer:
        e = peer.engine
        src, host = _gpu_pattern(n, 3)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="cuda")
        await e.write(mr, dst, imm=1)
        await peer.wait(imm=1, timeout=60)  # credited after the host-to-device copies
        assert await peer.digest("g") == digest(host)
        assert e.stats()["gpu_staged"] == 1


async def test_staged_mixed_and_paged() -> None:
    n = 4 << 20
    async with spawn_peer(same_host=None, gpu_ipc=False) as peer:
        e = peer.engine
        src, host = _gpu_pattern(n, 4)
        mr = await e.register(src)
        hd = await peer.register("h", n)
        await e.write(mr, hd, imm=2)  # GPU -> host
        await peer.wait(imm=2, timeout=60)
        assert await peer.digest("h") == digest(host)
        h2 = pattern(n, 5).copy()
        mh = await e.register(h2)
        gd = await peer.register("g", 2 * n, device="cuda")
        await e.write(mh, gd, dst_offset=n, imm=3)  # host -> GPU
        await peer.wait(imm=3, timeout=60)
        assert await peer.digest("g", n, n) == digest(h2)
        page = 64 << 10
        sp = np.random.default_rng(1).permutation(n // page)
        dp = np.random.default_rng(2).permutation(2 * n // page)[: len(sp)]
        await e.write_paged(mr, gd, page_size=page, src_pages=sp, dst_pages=dp, imm=4)  # GPU -> GPU paged
        await peer.wait(imm=4, n=len(sp), timeout=60)
        for k in (0, len(sp) - 1):
            s, d = int(sp[k]), int(dp[k])
            assert await peer.digest("g", d * page, page) == digest(host[s * page : (s + 1) * page])


@pytest.mark.parametrize("memory,fence", [("cuda", "memop"), ("alloc_gpu", "memop"), ("cuda", "kernel")])
async def test_ipc_rail_between_processes(memory: str, fence: str) -> None:
    """The CUDA-IPC rail into a peer's ``cudaMalloc`` memory (CuPy's pool: an IPC handle) and
    into its ``Engine.alloc_gpu`` memory (a VMM allocation: a descriptor it hands over). The
    fences (completion words and credit-lane entries) are the stream's own stores where the
    driver takes them (``memop``), else kernels (forced here: ``kernel``)."""
    n = 32 << 20
    target = 1 if NGPU > 1 else 0
    async with spawn_peer() as peer:
        e = peer.engine
        src, host = _gpu_pattern(n, 6)
        if memory == "alloc_gpu":
            src = e.alloc_gpu(n)
            src.set(host)
        mr = await e.register(src)
        backend = e._gpu_support().b
        if fence == "kernel":
            backend._memops.update({d: None for d in range(NGPU)})
        elif backend._memop(mr._dev.device) is None:
            pytest.skip("this driver refuses stream memory operations: the kernels make every fence")
        dst = await peer.register("g", n, device=memory, gpu=target)
        assert dst.device_id == target and dst.gpu is not None
        assert _vmm.is_handle(dst.gpu.ipc_handle) == (memory == "alloc_gpu")
        await e.write(mr, dst, imm=5)
        await peer.wait(imm=5, timeout=60)
        assert await peer.digest("g") == digest(host)
        page = 64 << 10
        sp = np.arange(n // page)[::-1].copy()
        await e.write_paged(mr, dst, page_size=page, src_pages=sp, dst_pages=np.arange(n // page), imm=6)
        await peer.wait(imm=6, n=len(sp), timeout=60)
        expect = host.reshape(-1, page)[::-1].reshape(-1)
        assert await peer.digest("g") == digest(expect.copy())
        out = cupy.zeros(4096, cupy.uint8)
        mo = await e.register(out)
        await e.read(mo, dst, length=4096, src_offset=page)
        assert digest(cupy.asnumpy(out)) == digest(expect[page : page + 4096].copy())
        st = e.stats()
        assert st["gpu_ipc"] == 2 and st["gpu_staged"] == 0
        assert st["gpu_lane_credits"] >= 1  # the paged write's credit: a lane entry the fence stored


async def test_stream_ordering_after_a_kernel() -> None:
    n = 1 << 20
    async with spawn_peer(same_host=None, gpu_ipc=False) as peer:
        e = peer.engine
        src = cupy.zeros(n, cupy.uint8)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="cuda")
        s = cupy.cuda.Stream(non_blocking=True)
        # a kernel that waits ~20 ms of GPU clocks, then fills the source with 7s
        _SPIN_STORE(
            (1,),
            (256,),
            (src, np.int64(n), np.uint8(7), np.uint64(0), np.uint64(0), np.int64(30_000_000)),
            stream=s,
        )
        await e.write(mr, dst, imm=1, stream=s)
        await peer.wait(imm=1, timeout=60)
        assert await peer.digest("g") == digest(np.full(n, 7, np.uint8))


async def test_uvm_watcher_kernel_store() -> None:
    async with aiote.open_engine(watch_interval_us=20) as e:
        w = e.uvm_watcher()
        buf = cupy.zeros(16, cupy.uint8)
        s = cupy.cuda.Stream(non_blocking=True)
        _SPIN_STORE(
            (1,),
            (32,),
            (
                buf,
                np.int64(16),
                np.uint8(1),
                np.uint64(w.device_pointer),
                np.uint64(42),
                np.int64(20_000_000),
            ),
            stream=s,
        )
        assert await w.wait_for(42, timeout=10) == 42
        assert int(buf.get()[0]) == 1  # the kernel's earlier stores are visible too
        w.close()
