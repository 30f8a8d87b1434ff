"""Element types of the weights flow and the casts between them, written once for NumPy and
CuPy (``xp``): bfloat16 is stored as ``uint16`` and FP8 e4m3 as ``uint8`` (NumPy has neither)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core._errors import InvalidArgument

__all__ = [
    "DTYPES",
    "E4M3_MAX",
    "FLOATS",
    "cast_into",
    "e4m3_table",
    "cast_supported",
    "check_dtype",
    "itemsize",
    "storage",
]

# element type name -> storage dtype (what the bytes are stored as in NumPy/CuPy)
DTYPES: dict[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "uint16",
    "float8_e4m3": "uint8",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
}
FLOATS = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3"})
E4M3_MAX = 448.0


def check_dtype(name: Any, what: str) -> str:
    """``name`` if it is a known element type; :class:`~aiote.InvalidArgument` otherwise."""
    if not isinstance(name, str) or name not in DTYPES:
        raise InvalidArgument(f"{what}: dtype {name!r} is not one of {sorted(DTYPES)}")
    return name


def itemsize(name: str) -> int:
    """Bytes per element of the element type ``name`` (known: see :data:`DTYPES`)."""
    return int(np.dtype(DTYPES[name]).itemsize)


def storage(name: str) -> np.dtype[Any]:
    """The NumPy dtype an element type is stored as (bfloat16: ``uint16``)."""
    return np.dtype(DTYPES[name])


def cast_supported(src: str, dst: str) -> bool:
    """True for the identity and for any cast between two float types."""
    return src == dst or (src in FLOATS and dst in FLOATS)


def e4m3_table() -> np.ndarray[Any, Any]:
    """The float32 value of each of the 256 FP8 e4m3 (``fn``: no infinities) codes: sign bit,
    4 exponent bits (bias 7), 3 mantissa bits; 0x7F and 0xFF are NaN, the largest is 448."""
    c = np.arange(256)
    e, m = (c >> 3) & 0xF, (c & 7).astype(np.float64)
    v = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7.0))
    v = np.where(c & 0x80, -v, v).astype(np.float32)
    v[(c & 0x7F) == 0x7F] = np.nan
    return v


_E4M3 = e4m3_table()


def _e4m3_bits(xp: Any, f: Any) -> Any:
    """float32 -> FP8 e4m3 codes: round to nearest even, saturating at +-448, NaN -> 0x7F."""
    f = f.astype(xp.float32, copy=False)
    sign = ((f.view(xp.uint32) >> 24) & xp.uint32(0x80)).astype(xp.uint8)
    a = xp.minimum(xp.abs(f), xp.float32(E4M3_MAX))
    u = a.view(xp.uint32)
    normal = ((u + xp.uint32(0x7FFFF) + ((u >> 20) & xp.uint32(1))) >> 20).astype(xp.int32) - (120 << 3)
    sub = xp.rint(a * xp.float32(512)).astype(xp.int32)  # below 2**-6: multiples of 2**-9
    code = xp.minimum(xp.where(a < xp.float32(2.0**-6), sub, normal), 0x7E)
    code = xp.where(xp.isnan(f), 0x7F, code)
    return code.astype(xp.uint8) | sign


def _to_f32(xp: Any, a: Any, src: str) -> Any:
    if src == "bfloat16":
        return (a.astype(xp.uint32) << 16).view(xp.float32)
    if src == "float8_e4m3":
        return xp.asarray(_E4M3)[a]
    return a.astype(xp.float32) if src != "float64" else a


def _bf16_bits(xp: Any, f: Any) -> Any:
    """float32 (or float64, rounded to float32 first) -> bfloat16 bits, round to nearest even;
    NaN stays a quiet NaN."""
    f = f.astype(xp.float32, copy=False)
    u = f.view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, xp.uint32(0x7FC0), rounded).astype(xp.uint16)


def cast_into(xp: Any, out: Any, a: Any, src: str, dst: str) -> None:
    """Writes ``a`` (stored as ``storage(src)``) cast to ``dst`` into ``out`` (same shape, stored
    as ``storage(dst)``). Costs one pass over the elements (two through float32 for bfloat16);
    raises :class:`~aiote.InvalidArgument` for a cast :func:`cast_supported` refuses."""
    if src == dst:
        out[...] = a
        return
    if not cast_supported(src, dst):
        raise InvalidArgument(f"no cast from {src} to {dst}")
    if xp is np:
        with np.errstate(over="ignore", invalid="ignore"):  # out of range -> inf, as a GPU cast does
            _cast(xp, out, a, src, dst)
    else:
        _cast(xp, out, a, src, dst)


def _cast(xp: Any, out: Any, a: Any, src: str, dst: str) -> None:
    if dst == "float8_e4m3":
        out[...] = _e4m3_bits(xp, a if src in ("float32", "float64") else _to_f32(xp, a, src))
    elif dst == "bfloat16":
        out[...] = _bf16_bits(xp, a if src in ("float32", "float64") else _to_f32(xp, a, src))
    elif src in ("bfloat16", "float8_e4m3"):
        out[...] = _to_f32(xp, a, src).astype(storage(dst))
    else:
        out[...] = a.astype(storage(dst))
