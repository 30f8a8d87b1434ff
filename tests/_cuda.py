"""The guard of the GPU test modules: CuPy and at least one CUDA device, else the module is
skipped (CI has no GPU; scripts/gpu-run.sh runs these modules on a GPU machine)."""

from __future__ import annotations

from typing import Any

import pytest


def require_cuda() -> tuple[Any, int]:
    """(the cupy module, the number of CUDA devices); skips the calling module without them."""
    cupy = pytest.importorskip("cupy")
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver / no device
        n = 0
    if n == 0:
        pytest.skip("no CUDA GPU here", allow_module_level=True)
    return cupy, n
