"""Emulated GPU memory for machines without a GPU (engines opened with ``gpu_backend="host"``)."""

from __future__ import annotations

import contextlib
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from .._core._device import _HostStream
from .._core._vmm import HostGpuView

__all__ = ["HostDeviceArray", "HostStream"]


def HostStream(device: int = 0) -> Any:
    """A stream of the host GPU emulation (``gpu_backend="host"``): ``submit(fn)`` runs
    ``fn`` in a worker thread after the work submitted before, as a CUDA stream runs kernels.
    Pass it as ``stream=`` to order a transfer after that work. Costs one daemon thread per
    stream (its ``close()`` ends it); raises nothing."""
    return _HostStream(device, 0.0)


class HostDeviceArray(HostGpuView):
    """Host memory that presents itself as GPU memory (``__cuda_array_interface__``), for the
    engine's host GPU backend: the staging pipeline, credit ordering and IPC rail then run on
    a machine without CUDA. ``host`` is the NumPy view to fill and check. ``shared=True``
    allocates it in POSIX shared memory, so that a peer process on this host can open it the
    way CUDA IPC opens a GPU allocation. Never pass one to an engine using real CUDA.
    Building one allocates ``nbytes`` (zeroed) or a shared-memory segment of that size; it
    raises what NumPy or ``SharedMemory`` raise (e.g. MemoryError, OSError)."""

    def __init__(self, nbytes: int, *, device: int = 0, shared: bool = False, readonly: bool = False) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        if shared:
            self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
            buf: Any = self._shm.buf
            self.host: np.ndarray = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
            self.shm_name: str | None = self._shm.name
        else:
            self.host = np.zeros(nbytes, dtype=np.uint8)
            self.shm_name = None
        self.shm_offset = 0
        self.device_id = device
        self._readonly = readonly

    def close(self) -> None:
        """Releases the shared-memory segment (the view becomes invalid). Idempotent; a no-op
        for a non-shared array. Costs one unmap and one unlink; raises BufferError while NumPy
        views of ``host`` taken before are alive (the segment is unlinked all the same)."""
        if self._shm is not None:
            shm, self._shm = self._shm, None
            self.host = np.zeros(0, dtype=np.uint8)
            try:
                shm.close()
            finally:
                with contextlib.suppress(FileNotFoundError):
                    shm.unlink()
