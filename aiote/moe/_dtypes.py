"""Element types of the MoE flow, and bfloat16 as uint16 bit patterns.

NumPy (and CuPy) have no bfloat16, so the flow carries bfloat16 data as ``uint16`` arrays
holding the bit patterns (the high half of a float32), and float8 (e4m3fn, dispatch only) as
``uint8``. Dispatch copies bytes, so any of these moves unchanged; combine decodes the
expert outputs to float32 (exactly: every bfloat16 and float16 is a float32), accumulates in
float32 and rounds once, to nearest even, to the output type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import InvalidArgument

__all__ = ["DType", "bf16_to_f32", "dtype_of", "f32_to_bf16"]


@dataclass(frozen=True)
class DType:
    """An element type of the flow: its ``name`` (``"float32"``, ``"float16"``, ``"bfloat16"``,
    ``"float8_e4m3fn"``), the NumPy/CuPy ``storage`` dtype arrays of it have, its ``itemsize``
    and whether combine can reduce it (``arith``)."""

    name: str
    storage: np.dtype[Any]
    arith: bool

    @property
    def itemsize(self) -> int:
        """Bytes per element. O(1), raises nothing."""
        return int(self.storage.itemsize)


_TYPES = {
    "float32": DType("float32", np.dtype(np.float32), True),
    "float16": DType("float16", np.dtype(np.float16), True),
    "bfloat16": DType("bfloat16", np.dtype(np.uint16), True),
    "float8_e4m3fn": DType("float8_e4m3fn", np.dtype(np.uint8), False),
}


def dtype_of(spec: Any, what: str) -> DType:
    """The :class:`DType` named by ``spec`` (a name above, or ``np.float32``/``np.float16``).
    Raises :class:`~aiote.InvalidArgument` for any other. O(1)."""
    if isinstance(spec, str):
        key = spec
    else:
        try:
            key = np.dtype(spec).name
        except TypeError:
            key = repr(spec)
    if key not in _TYPES or key in ("uint16", "uint8"):
        raise InvalidArgument(f"{what} must be one of {sorted(_TYPES)}, not {spec!r}")
    return _TYPES[key]


def bf16_to_f32(bits: Any, xp: Any = np) -> Any:
    """float32 values of bfloat16 bit patterns (a ``uint16`` array of NumPy or of ``xp``):
    exact (the bits become the high half). Allocates the result, O(n); raises TypeError for a
    non-uint16 input."""
    if bits.dtype != np.uint16:
        raise TypeError(f"bfloat16 bit patterns must be uint16, not {bits.dtype}")
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16(values: Any, xp: Any = np) -> Any:
    """bfloat16 bit patterns (``uint16``) of float32 values, rounded to nearest, ties to even
    (what torch's ``.to(torch.bfloat16)`` does); NaN stays NaN (a quiet NaN of the same sign),
    infinities and overflow to infinity as IEEE rounding says. Allocates, O(n); raises
    TypeError for a non-float32 input."""
    if values.dtype != np.float32:
        raise TypeError(f"values must be float32, not {values.dtype}")
    u = values.view(xp.uint32)
    t = u >> 16
    t &= 1
    t += 0x7FFF
    t += u  # wraps only for NaN payloads, fixed below
    t >>= 16
    rounded = t.astype(xp.uint16)
    nan = values != values
    if xp is not np:  # no data-dependent branch on the GPU (it would wait for the device)
        return xp.where(nan, ((u >> 16) | xp.uint32(0x0040)).astype(xp.uint16), rounded)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def to_f32(a: Any, dt: DType, xp: Any = np) -> Any:
    """float32 values of an array of type ``dt`` (exact). Allocates, O(n)."""
    if dt.name == "bfloat16":
        return bf16_to_f32(a, xp)
    return a.astype(xp.float32, copy=False)


def from_f32(a: Any, dt: DType, xp: Any = np) -> Any:
    """``a`` (float32) rounded once to ``dt`` (nearest even). Allocates, O(n)."""
    if dt.name == "bfloat16":
        return f32_to_bf16(a, xp)
    return a.astype(dt.storage)
