"""The cffi binding of the C core (``cdeps/``) and nothing else."""

from __future__ import annotations

try:
    from aiote._native._core import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "aiote's C core is not built. Install the package (pip install -e .) on a machine "
        "with libfabric's development files (Debian: apt-get install libfabric-dev)."
    ) from exc

__all__ = ["ffi", "lib"]
