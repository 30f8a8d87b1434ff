"""GPU kernels of the MoE flow (compiled by CuPy's ``RawModule``): the send layout, the
packing, the unpacking, the combine packing and the combine reduction, one kernel each.

Launched through the driver's ``cuLaunchKernel`` (:class:`Launch`): the parameters of a kernel
are packed by one ``struct`` call into a buffer made once, and one ``ctypes`` call launches
it, about 3 us of host time where CuPy's ``RawKernel`` call took 20-60 us for 8-19 arguments
on the device machines' hosts (a decode call launches five).

One thread per output element: ``acc = +0.0``; for each top-k slot in order, ``acc = acc +
w * y`` with ``__fmul_rn``/``__fadd_rn`` (never contracted into an FMA, so the result is the
same float32 arithmetic as NumPy's, bit for bit); a skipped slot adds nothing; then ``prev +
acc`` when accumulating; then one rounding to the output type (bfloat16: nearest even on the
bit pattern, as :func:`aiote.moe.f32_to_bf16`; float16: ``__float2half_rn``). Imported only
for ``xp=cupy``.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, ClassVar

from ._dtypes import DType

__all__ = ["KINDS", "Kernels", "Launch", "reduce_gpu"]

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

_kernels: dict[tuple[str, int], Launch] = {}


def _kernel(cupy: Any, dt: DType) -> Launch:
    """The reduction kernel of ``dt`` on the current device (compiled once per process and
    device)."""
    key = (dt.name, cupy.cuda.runtime.getDevice())
    k = _kernels.get(key)
    if k is None:
        ctype, load, store = _LOAD_STORE[dt.name]
        src = _SOURCE.replace("LOAD", load).replace("STORE", store)
        src = f"typedef {ctype} T;\n" + src if dt.name != "float16" else src.replace(
            "#include <cuda_fp16.h>", "#include <cuda_fp16.h>\ntypedef __half T;"
        )
        fn = cupy.RawModule(code=src).get_function("moe_combine")
        k = _kernels[key] = Launch(cupy, fn, "moe_combine")
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
    dp = dest.data.ptr
    _kernel(cupy, dt)(
        blocks, threads, cupy.cuda.get_current_stream().ptr,
        rows.data.ptr, pos.data.ptr, weights.data.ptr, dp if prev is None else prev.data.ptr, dp, m, k, h,
        prev is not None,
    )


# ---------------------------------------------------------------------------------- launches

_FORMAT = {"p": "Q", "q": "q", "i": "i4x"}  # pointer, int64, int32: one 8-byte slot each
# each kernel's parameters in order (p: a pointer, q: long long, i: int), as its C source says
KINDS = {
    "moe_combine": "pppppqiqi",
    "moe_layout": "pqiipppp",
    "moe_pack": "pqpqiiippipqi",
    "moe_unpack": "piiippqiiiipqpqpppi",
    "moe_back": "ppipqippq",
}
_NO_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no current context in this thread yet
_launch_fn: Any = None


def _cu_launch() -> Any:
    """The driver's ``cuLaunchKernel`` through ctypes (looked up once per process)."""
    global _launch_fn
    if _launch_fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        u, vp = ctypes.c_uint, ctypes.c_void_p
        fn.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        fn.restype = ctypes.c_int
        _launch_fn = fn
    return _launch_fn


class Launch:
    """One compiled kernel ``name`` (of a CuPy ``RawModule``, on the current device), launched
    by ``cuLaunchKernel`` on a 1-D grid.

    ``KINDS[name]`` says each parameter's C type in order: ``p`` a pointer, ``q`` a 64-bit
    integer, ``i`` a 32-bit one. The values are packed into a buffer made once (the driver copies them
    at the launch, so the buffer is free again when the call returns; a lock keeps two threads
    from packing it at once).
    Raises CuPy's ``CUDADriverError`` when the driver refuses the launch, ``struct.error`` for
    a value that does not fit its type. Costs one ``struct`` call and one ``ctypes`` call. The
    kernel belongs to the device current when it was made: launch it with that device current
    (a thread with no CUDA context yet gets the device's primary one, as a CuPy call would)."""

    __slots__ = ("_args", "_buf", "_ensure", "_err", "_fn", "_func", "_launch", "_lock", "_params", "name")

    def __init__(self, cupy: Any, func: Any, name: str) -> None:
        kinds = KINDS[name]
        self._func = func  # keeps its module loaded
        # (a RawModule's functions are RawKernels: their compiled Function, for the current
        # device, is ``kernel``)
        self._fn = ctypes.c_void_p(getattr(func, "kernel", func).ptr)
        self._args = struct.Struct("<" + "".join(_FORMAT[c] for c in kinds))
        self._buf = ctypes.create_string_buffer(8 * len(kinds))
        base = ctypes.addressof(self._buf)
        params = (ctypes.c_void_p * len(kinds))(*(base + 8 * i for i in range(len(kinds))))
        self._launch = _cu_launch()
        self._params = params
        self._err = cupy.cuda.driver.CUDADriverError
        self._ensure = cupy.cuda.runtime.free  # free(0): makes the runtime's context current
        self._lock = threading.Lock()
        self.name = name

    def __call__(self, grid: int, block: int, stream: int, *args: int) -> None:
        with self._lock:
            self._args.pack_into(self._buf, 0, *args)
            rc = self._launch(self._fn, grid, 1, 1, block, 1, 1, 0, stream, self._params, None)
            if rc == _NO_CONTEXT:  # a thread's first CUDA call: the runtime sets its context up
                self._ensure(0)
                rc = self._launch(self._fn, grid, 1, 1, block, 1, 1, 0, stream, self._params, None)
        if rc:
            raise self._err(rc)


# ---------------------------------------------------------------------------------- layout

_LAYOUT_SOURCE = r"""
typedef long long i64;
typedef unsigned char u8;

// all threads of the block copy n bytes (16 at a time when everything is 16-byte aligned)
__device__ __forceinline__ void copy_row(u8* d, const u8* s, i64 n) {
    unsigned long long a = (unsigned long long)d | (unsigned long long)s | (unsigned long long)n;
    if ((a & 15) == 0) {
        uint4* d4 = (uint4*)d; const uint4* s4 = (const uint4*)s;
        for (i64 i = threadIdx.x; i < (n >> 4); i += blockDim.x) d4[i] = s4[i];
    } else if ((a & 3) == 0) {
        unsigned int* d1 = (unsigned int*)d; const unsigned int* s1 = (const unsigned int*)s;
        for (i64 i = threadIdx.x; i < (n >> 2); i += blockDim.x) d1[i] = s1[i];
    } else {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    }
}

// all threads of the block zero n bytes
__device__ __forceinline__ void zero_row(u8* d, i64 n) {
    if ((((unsigned long long)d | (unsigned long long)n) & 15) == 0) {
        uint4* d4 = (uint4*)d;
        for (i64 i = threadIdx.x; i < (n >> 4); i += blockDim.x) d4[i] = make_uint4(0, 0, 0, 0);
    } else {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) d[i] = 0;
    }
}

// the largest i in [0, n) with a[i] <= v (a non-decreasing, a[0] <= v)
__device__ __forceinline__ int last_le(const i64* a, int n, i64 v) {
    int lo = 0, hi = n - 1;
    while (lo < hi) { int mid = (lo + hi + 1) >> 1; if (a[mid] <= v) lo = mid; else hi = mid - 1; }
    return lo;
}

// one block per expert e (256 threads): eoff[e] = the valid slots of lower experts, counts[e] =
// the slots of e; then e's slots, in (token, slot) order, get the send rows eoff[e], +1, ...
// (the stable order of the reference: rows sorted by expert, then token). Block 0 also checks
// the input, counts[E] = 1 (an index out of [-1, E)) | 2 (an expert twice in a token), and
// gives skipped slots pos = -1. eoff[E] = all valid slots.
extern "C" __global__ void moe_layout(const i64* idx, i64 n, int k, int E, int* counts, i64* eoff, i64* pos,
                                      int* row_token) {
    __shared__ unsigned long long red_lo, red_eq;
    __shared__ int flags;
    __shared__ int wsum[32];
    int e = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (threadIdx.x == 0) { red_lo = 0; red_eq = 0; flags = 0; }
    __syncthreads();
    unsigned long long lo = 0, eq = 0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        i64 v = idx[i];
        lo += (v >= 0 && v < e);
        eq += (v == e);
    }
    atomicAdd(&red_lo, lo);
    atomicAdd(&red_eq, eq);
    if (e == 0) {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
            i64 v = idx[i];
            if (v < -1 || v >= E) { atomicOr(&flags, 1); pos[i] = -1; continue; }
            if (v < 0) { pos[i] = -1; continue; }
            for (i64 j = (i / k) * k; j < i; ++j) if (idx[j] == v) atomicOr(&flags, 2);
        }
    }
    __syncthreads();
    i64 base = (i64)red_lo;
    int cnt = (int)red_eq;
    if (threadIdx.x == 0) {
        counts[e] = cnt;
        eoff[e] = base;
        if (e == E - 1) eoff[E] = base + cnt;
        if (e == 0) counts[E] = flags;
    }
    if (cnt == 0) return;
    i64 run = base;
    for (i64 c = 0; c < n; c += blockDim.x) {
        i64 i = c + threadIdx.x;
        bool hit = i < n && idx[i] == e;
        unsigned b = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) wsum[warp] = __popc(b);
        __syncthreads();
        int before = 0, tot = 0;
        for (int w = 0; w < nw; ++w) { int x = wsum[w]; if (w < warp) before += x; tot += x; }
        if (hit) {
            i64 row = run + before + __popc(b & ((1u << lane) - 1u));
            pos[i] = row;
            row_token[row] = (int)(i / k);
        }
        run += tot;
        __syncthreads();
    }
}

// one block per send row i < eoff[E]: x's row (and its scales), then the token number
extern "C" __global__ void moe_pack(const u8* x, i64 xstride, const u8* sc, i64 sstride, int xrow,
                                    int soff, int swidth, const int* row_token, const i64* eoff, int E,
                                    u8* out, i64 ostride, int toff) {
    i64 i = blockIdx.x;
    if (i >= eoff[E]) return;
    int t = row_token[i];
    u8* o = out + i * ostride;
    copy_row(o, x + (i64)t * xstride, xrow);
    if (swidth) copy_row(o + soff, sc + (i64)t * sstride, swidth);
    if (threadIdx.x == 0) *(int*)(o + toff) = t;
}

// one block per output row o: tab = offsets[L + 1] | counts[L] | cum[L][W + 1] (rows of lower
// sources in expert l's block) | start[W][L] (the row of chunk (source r, expert l) in r's
// region: this rank's send rows for r == me, the receive region otherwise). A padding row gets
// zero scales, zero x when zero_x (x is the call's own array), and source -1.
extern "C" __global__ void moe_unpack(const i64* tab, int L, int W, int me, const u8* recv, const u8* own,
                                      i64 dstride, int xrow, int soff, int swidth, int toff, u8* ex,
                                      i64 exstride, u8* exs, i64 exsstride, int* src_rank, int* src_token,
                                      i64* back, int zero_x) {
    i64 o = blockIdx.x;
    const i64* offsets = tab;
    const i64* counts = tab + (L + 1);
    const i64* cum = counts + L;
    const i64* start = cum + (i64)L * (W + 1);
    int l = last_le(offsets, L, o);
    i64 j = o - offsets[l];
    if (j >= counts[l]) {  // padding
        if (zero_x) zero_row(ex + o * exstride, xrow);
        if (swidth) zero_row(exs + o * exsstride, swidth);
        if (threadIdx.x == 0) { src_rank[o] = -1; src_token[o] = -1; back[o] = -1; }
        return;
    }
    int r = last_le(cum + (i64)l * (W + 1), W, j);
    i64 q = start[(i64)r * L + l] + (j - cum[(i64)l * (W + 1) + r]);
    const u8* s = (r == me ? own : recv) + q * dstride;
    copy_row(ex + o * exstride, s, xrow);
    if (swidth) copy_row(exs + o * exsstride, s + soff, swidth);
    if (threadIdx.x == 0) { src_rank[o] = r; src_token[o] = *(const int*)(s + toff); back[o] = q; }
}

// one block per output row o of a source: its expert output back to that source's row (this
// rank's own combine region for its own rows, the send region for the others)
extern "C" __global__ void moe_back(const int* src_rank, const i64* back, int me, const u8* y, i64 ystride,
                                    int yrow, u8* csend, u8* own, i64 cstride) {
    i64 o = blockIdx.x;
    int r = src_rank[o];
    if (r < 0) return;
    copy_row((r == me ? own : csend) + back[o] * cstride, y + o * ystride, yrow);
}
"""

_THREADS = 128


class Kernels:
    """The layout and row-moving kernels of one device (compiled on first use, cached)."""

    _mods: ClassVar[dict[int, Any]] = {}

    def __init__(self, cupy: Any) -> None:
        self.cp = cupy
        dev = cupy.cuda.Device().id
        mod = self._mods.get(dev)
        if mod is None:
            mod = self._mods[dev] = cupy.RawModule(code=_LAYOUT_SOURCE)
        f = mod.get_function
        names = ("moe_layout", "moe_pack", "moe_unpack", "moe_back")
        self._layout, self.pack, self.unpack, self.back = (Launch(cupy, f(n), n) for n in names)

    def layout(
        self, idx: Any, k: int, num_experts: int, counts: Any, eoff: Any, pos: Any, row_token: Any,
        stream: int,
    ) -> None:
        """``idx[m * k]`` int64 -> ``counts[E + 1]`` (the last: bad-input flags), ``eoff[E + 1]``,
        ``pos[m * k]`` (the send row of each slot, -1 skipped), ``row_token`` (the token of
        each send row): one kernel on ``stream`` (a pointer)."""
        self._layout(
            num_experts, 256, stream, idx.data.ptr, idx.size, k, num_experts, counts.data.ptr,
            eoff.data.ptr, pos.data.ptr, row_token.data.ptr,
        )
