"""Small helpers shared by the core modules."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio

from ._errors import InvalidArgument, TransferTimeout


def check_timeout(timeout: float | None) -> None:
    """InvalidArgument unless ``timeout`` is None or a number of seconds >= 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout):
        raise InvalidArgument(f"timeout must be a number of seconds or None, not {timeout!r}")
    if timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds, not {timeout!r}")


@contextmanager
def deadline(timeout: float | None, what: str) -> Iterator[None]:
    """Like ``anyio.fail_after`` but raises :class:`TransferTimeout` naming the operation."""
    if timeout is None:
        yield
        return
    check_timeout(timeout)
    scope = anyio.fail_after(timeout)
    try:
        with scope:
            yield
    except TimeoutError as exc:
        if isinstance(exc, TransferTimeout):
            raise
        raise TransferTimeout(f"{what} did not finish within {timeout:g} s") from None


def as_index(value: Any, name: str, *, lo: int = 0, hi: int | None = None) -> int:
    """An integer argument in ``[lo, hi)``; InvalidArgument otherwise (bools refused)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, not a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an integer, not {type(value).__name__}") from None
    if v < lo or (hi is not None and v >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise InvalidArgument(f"{name}={v} is out of range (must be {bound})")
    return v
