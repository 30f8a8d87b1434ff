"""The cffi binding of the C core (``cdeps/``) and nothing else.

Loading it loads libfabric and the libraries it links. On Debian one of them, libinfinipath
(the old QLogic PSM provider's, linked whether or not such a NIC exists), installs its own
handlers for SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT in a constructor: after
that, Ctrl-C ended a Python process at once with status 1 instead of raising
``KeyboardInterrupt`` (no ``finally``, no engine closed). So the process's signal dispositions
are read before the load and put back after it, unchanged (:func:`_keeping_signal_handlers`).
"""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def _keeping_signal_handlers() -> Iterator[None]:
    """Restores every signal's disposition (``sigaction``, opaque) as it was on entry. Costs
    two system calls per signal; a no-op where libc's ``sigaction`` cannot be found."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sigaction = libc.sigaction
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        yield
        return
    sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    saved: dict[int, ctypes.Array[ctypes.c_char]] = {}
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP) or s >= signal.SIGRTMIN:
            continue
        buf = ctypes.create_string_buffer(256)  # > sizeof(struct sigaction) (152 on Linux)
        if sigaction(int(s), None, buf) == 0:
            saved[int(s)] = buf
    try:
        yield
    finally:
        for num, buf in saved.items():
            sigaction(num, buf, None)


try:
    with _keeping_signal_handlers():
        from aiote._native._core import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "aiote's C core is not built. Install the package (pip install -e .) on a machine "
        "with libfabric's development files (Debian: apt-get install libfabric-dev)."
    ) from exc

__all__ = ["ffi", "lib"]
