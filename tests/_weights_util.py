"""Helpers of the aiote.weights tests that need nothing but NumPy (the GPU tests import them
on machines without hypothesis)."""

from __future__ import annotations

import numpy as np

from aiote import weights as W


def e4m3_reference(x: np.ndarray) -> np.ndarray:
    """FP8 e4m3 codes by brute force, independent of the library's bit tricks: the nearest of
    the 254 finite values (a tie to the even code), saturating at +-448, NaN -> 0x7F."""
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F])
    vals = W.e4m3_table()[codes].astype(np.float64)
    x = np.asarray(x, np.float64).ravel()
    d = np.abs(x[:, None] - vals[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = np.where(d == best, codes[None, :], 1 << 20)
    even = np.where((cand & 1) == 0, cand, 1 << 20).min(axis=1)  # a tie: the even code
    pick = np.where(even < (1 << 20), even, cand.min(axis=1))
    # the sign of zero follows the input (both zeros are nearest)
    pick = np.where((pick & 0x7F) == 0, np.where(np.signbit(x), 0x80, 0), pick)
    pick = np.where(np.abs(x) >= 448, np.where(x < 0, 0xFE, 0x7E), pick)
    return np.where(np.isnan(x), 0x7F, pick).astype(np.uint8)
