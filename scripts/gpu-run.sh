#!/usr/bin/env bash
# The GPU tests and the GPU benchmarks in one call, on a GPU machine (CUDA + CuPy present).
#
#   scripts/gpu-run.sh [OUTDIR]
#
# What that machine lacks comes from carried folders, without network: .whl/ (cffi, pycparser,
# trio, outcome, sniffio, structlog, pytest-trio wheels for its Python) and .deb/ (Debian's
# libfabric1, libfabric-dev and the libraries they link, unpacked under /opt/fab). See
# docs/gpu.md for how to fill them. Output: OUTDIR/gpu-tests.txt, gpu-bench.txt, gpu-bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-/tmp/aiote-gpu}}"
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. scripts/_carried-env.sh
{
    echo "# $(date -u +%FT%TZ) $(uname -srm)"
    nvidia-smi -L
    nvidia-smi topo -m 2>/dev/null | head -5
    "$PY" -c 'import sys, cupy, numpy; print("python", sys.version.split()[0], "cupy", cupy.__version__, "numpy", numpy.__version__)'
} 2>&1 | tee "$OUTDIR/gpu-env.txt"
"$PY" setup.py -q build_ext --inplace >"$OUTDIR/build.txt" 2>&1 || { tail -30 "$OUTDIR/build.txt"; exit 1; }
"$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu.py tests/test_gpu_host.py tests/test_moe_gpu.py tests/test_weights_gpu.py tests/test_alloc_gpu.py 2>&1 | tee "$OUTDIR/gpu-tests.txt"
"$PY" examples/gpu_layers.py 2>&1 | tee -a "$OUTDIR/gpu-tests.txt"
"$PY" benchmarks/bench_gpu.py --json "$OUTDIR/gpu-bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/gpu-bench.txt"
"$PY" benchmarks/bench_weights.py --gpu ${WEIGHTS_ARGS:-} 2>&1 | tee "$OUTDIR/weights-bench.txt"
"$PY" benchmarks/bench_moe.py --gpu --json "$OUTDIR/moe-bench.json" ${MOE_ARGS:-} 2>&1 | tee "$OUTDIR/moe-bench.txt"
