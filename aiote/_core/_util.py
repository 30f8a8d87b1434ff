"""Small helpers shared by the core modules."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
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


_NO_DEADLINE: AbstractContextManager[None] = nullcontext()


def deadline(timeout: float | None, what: str) -> AbstractContextManager[None]:
    """Like ``anyio.fail_after`` but raises :class:`TransferTimeout` naming the operation.
    Free when ``timeout`` is None (a shared null context: this is on every operation's path)."""
    if timeout is None:
        return _NO_DEADLINE
    check_timeout(timeout)
    return _deadline(timeout, what)


def deadline_at(end: float | None, timeout: float | None, what: str) -> AbstractContextManager[None]:
    """:func:`deadline` at an absolute time ``end`` (``anyio.current_time()`` + ``timeout``,
    computed once by the caller): for operations that enter a scope only around the awaits they
    actually make, so that one completing without waiting pays no cancel scope or timer."""
    if end is None or timeout is None:
        return _NO_DEADLINE
    return _deadline(timeout, what, end)


@contextmanager
def _deadline(timeout: float, what: str, end: float | None = None) -> Iterator[None]:
    scope = anyio.fail_after(timeout) if end is None else anyio.fail_at(end)
    try:
        with scope:
            yield
    except TimeoutError as exc:
        if isinstance(exc, TransferTimeout):
            raise
        raise TransferTimeout(f"{what} did not finish within {timeout:g} s") from None


def as_index(value: Any, name: str, *, lo: int = 0, hi: int | None = None) -> int:
    """An integer argument in ``[lo, hi)``; InvalidArgument otherwise (bools refused)."""
    if type(value) is int and value >= lo and (hi is None or value < hi):
        return value  # the common case, on every operation's path: no further checks
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
