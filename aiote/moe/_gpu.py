"""GPU kernels of the MoE flow (CuPy ``RawKernel``): the combine reduction in one kernel.

One thread per output element: ``acc = +0.0``; for each top-k slot in order, ``acc = acc +
w * y`` with ``__fmul_rn``/``__fadd_rn`` (never contracted into an FMA, so the result is the
same float32 arithmetic as NumPy's, bit for bit); a skipped slot adds nothing; then ``prev +
acc`` when accumulating; then one rounding to the output type (bfloat16: nearest even on the
bit pattern, as :func:`aiote.moe.f32_to_bf16`; float16: ``__float2half_rn``). Imported only
for ``xp=cupy``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dtypes import DType

__all__ = ["reduce_gpu"]

_LOAD_STORE = {
    "float32": ("float", "v", "a"),
    "float16": ("__half", "__half2float(v)", "__float2half_rn(a)"),
    "bfloat16": ("unsigned short", "__uint_as_float(((unsigned int)v) << 16)", "bf16_rne(a)"),
}

_SOURCE = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned short bf16_rne(float a) {
    unsigned int u = __float_as_uint(a);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float load(const T v) { return LOAD; }
__device__ __forceinline__ T store(const float a) { return STORE; }
extern "C" __global__ void moe_combine(const T* rows, const long long* pos, const float* w,
                                       const T* prev, T* out, long long m, int k, long long h,
                                       int has_prev) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * h) return;
    long long t = i / h, j = i - t * h;
    float acc = 0.0f;
    for (int s = 0; s < k; ++s) {
        long long p = pos[t * k + s];
        if (p >= 0) acc = __fadd_rn(acc, __fmul_rn(w[t * k + s], load(rows[p * h + j])));
    }
    if (has_prev) acc = __fadd_rn(load(prev[i]), acc);
    out[i] = store(acc);
}
"""

_kernels: dict[str, Any] = {}


def _kernel(cupy: Any, dt: DType) -> Any:
    k = _kernels.get(dt.name)
    if k is None:
        ctype, load, store = _LOAD_STORE[dt.name]
        src = _SOURCE.replace("LOAD", load).replace("STORE", store)
        src = f"typedef {ctype} T;\n" + src if dt.name != "float16" else src.replace(
            "#include <cuda_fp16.h>", "#include <cuda_fp16.h>\ntypedef __half T;"
        )
        k = _kernels[dt.name] = cupy.RawKernel(src, "moe_combine")
    return k


def reduce_gpu(cupy: Any, rows: Any, pos: Any, weights: Any, dt: DType, dest: Any, prev: Any = None) -> None:
    """The combine reduction on the current CUDA stream (asynchronous: nothing waits for the
    device). ``rows[N, H]``, ``dest[m, H]`` and ``prev`` C-contiguous of ``dt``'s storage type,
    ``pos[m, K]`` int64, ``weights[m, K]`` float32. Raises what CuPy raises (compilation on the
    first call per type, a few hundred ms, cached)."""
    m, h = dest.shape
    if m == 0:
        return
    k = pos.shape[1]
    pos = cupy.ascontiguousarray(pos, dtype=cupy.int64)
    weights = cupy.ascontiguousarray(weights, dtype=cupy.float32)
    threads = 256
    blocks = (m * h + threads - 1) // threads
    _kernel(cupy, dt)(
        (blocks,), (threads,),
        (rows, pos, weights, dest if prev is None else prev, dest, np.int64(m), np.int32(k), np.int64(h),
         np.int32(prev is not None)),
    )
