"""Layer-by-layer KV transfer triggered by the GPU: the "model" finishes a layer, a kernel
bumps a UVM watcher word, and the sender starts that layer's paged write at once; the
receiver's counter for the layer reaches its page count only when the pages are in its GPU
memory.

    python examples/gpu_layers.py            # real CUDA when CuPy and a GPU are present
    python examples/gpu_layers.py --host     # the host GPU emulation (any machine)
"""

from __future__ import annotations

import argparse
import threading
import time

import anyio
import numpy as np

import aiote
from aiote.testing import HostDeviceArray

LAYERS, PAGES, PAGE = 8, 32, 16384  # per layer: PAGES pages of PAGE bytes


def have_cuda() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


async def main(host: bool) -> None:
    backend = "host" if host else "cuda"
    layer_bytes = PAGES * PAGE
    expect = np.random.default_rng(0).integers(0, 256, LAYERS * layer_bytes, dtype=np.uint8)
    async with (
        aiote.open_engine(gpu_backend=backend, same_host=None, gpu_ipc=False) as prefill,
        aiote.open_engine(gpu_backend=backend, same_host=None) as decode,
    ):
        if host:
            src: object = HostDeviceArray(LAYERS * layer_bytes)
            dst: object = HostDeviceArray(LAYERS * layer_bytes)
        else:
            import cupy

            src = cupy.zeros(LAYERS * layer_bytes, cupy.uint8)
            dst = cupy.zeros(LAYERS * layer_bytes, cupy.uint8)
        msrc = await prefill.register(src)
        mdst = await decode.register(dst)
        done = prefill.uvm_watcher()  # the model stores "layers finished" here

        def model() -> None:  # the forward pass, one layer at a time
            if host:
                assert isinstance(src, HostDeviceArray)
                for layer in range(LAYERS):
                    time.sleep(0.01)
                    src.host[layer * layer_bytes : (layer + 1) * layer_bytes] = expect[
                        layer * layer_bytes : (layer + 1) * layer_bytes
                    ]
                    done.host[0] = layer + 1  # what the layer's last kernel does on a GPU
                return
            import cupy

            bump = cupy.RawKernel(
                r"""extern "C" __global__ void bump(unsigned long long *w, unsigned long long v) {
                    __threadfence_system(); *((volatile unsigned long long *)w) = v; }""",
                "bump",
            )
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                for layer in range(LAYERS):
                    sl = slice(layer * layer_bytes, (layer + 1) * layer_bytes)
                    src[sl] = cupy.asarray(expect[sl])  # type: ignore[index]
                    bump((1,), (1,), (np.uint64(done.device_pointer), np.uint64(layer + 1)))
            s.synchronize()

        async def sender() -> None:
            sent = 0
            async for finished in done:
                while sent < finished:  # every layer the GPU finished since the last wake-up
                    pages = np.arange(PAGES) + sent * PAGES
                    await prefill.write_paged(
                        msrc, mdst.descriptor, page_size=PAGE, src_pages=pages, dst_pages=pages, imm=sent
                    )
                    sent += 1
                if sent == LAYERS:
                    return

        t0 = time.perf_counter()
        threading.Thread(target=model).start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender)
            for layer in range(LAYERS):  # the decoder consumes layers as they arrive
                await decode.imm_counter(layer).wait(PAGES, timeout=30)
                got = dst.host if host else dst.get()  # type: ignore[attr-defined]
                sl = slice(layer * layer_bytes, (layer + 1) * layer_bytes)
                assert np.array_equal(got[sl], expect[sl]), f"layer {layer} differs"
        done.close()
        print(
            f"{LAYERS} layers x {PAGES} pages of {PAGE} B moved GPU -> GPU ({backend}), each started "
            f"when the GPU finished it, verified, in {time.perf_counter() - t0:.3f} s"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", action="store_true", help="use the host GPU emulation")
    a = ap.parse_args()
    anyio.run(main, a.host or not have_cuda())
