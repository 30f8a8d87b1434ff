"""Per-phase timestamps of the MoE flow, for profiling (off unless ``AIOTE_MOE_TRACE`` is set).

``AIOTE_MOE_TRACE=1``: host time at each phase boundary; ``=sync``: the current CUDA stream
is synchronized first, so that a phase's GPU work is counted in it (slower, for attribution).
:func:`take` returns and clears the marks of this process: ``[(name, perf_counter), ...]``.
"""

from __future__ import annotations

import os
import time
from typing import Any

MODE = os.environ.get("AIOTE_MOE_TRACE", "")
_marks: list[tuple[str, float]] = []


def mark(name: str, xp: Any = None) -> None:
    """Records ``name`` now (a no-op unless tracing)."""
    if not MODE:
        return
    if MODE == "sync" and xp is not None and getattr(xp, "__name__", "") == "cupy":
        xp.cuda.get_current_stream().synchronize()
    _marks.append((name, time.perf_counter()))


def take() -> list[tuple[str, float]]:
    """The marks recorded since the last call (and forgets them)."""
    out = list(_marks)
    _marks.clear()
    return out
