"""The paged KV layout both sides agree on, and a page allocator."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._core._errors import InvalidArgument

__all__ = ["KVLayout", "PageAllocator"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A paged KV cache: ``layers`` layers, K and V, pages of ``page_tokens`` tokens, each
    token taking ``token_bytes`` bytes per layer in K (and as many in V), ``pool_pages``
    pages per pool.

    Pool memory (one NumPy array per side, registered once) is ordered layer, then K/V, then
    page: page ``p`` of K in layer ``l`` starts at ``(2*l*pool_pages + p) * page_bytes`` and
    the matching V page ``pool_pages`` pages later, so one paged write per layer moves both
    (index ``p`` for K, ``pool_pages + p`` for V, ``src_offset``/``dst_offset`` at the layer).

    Example: a Llama-3-70B-like shape, 8 KV heads of dimension 128 in bf16 and 16-token
    pages, is ``KVLayout(layers=80, page_tokens=16, token_bytes=8 * 128 * 2, pool_pages=...)``:
    32 KiB per page for K and 32 KiB for V, 64 KiB per page per layer.

    Building one raises :class:`~aiote.InvalidArgument` for a field that is not an integer >= 1
    or more than 256 layers; O(1). Its properties cost O(1) and raise nothing.
    """

    layers: int
    page_tokens: int
    token_bytes: int
    pool_pages: int

    def __post_init__(self) -> None:
        for name in ("layers", "page_tokens", "token_bytes", "pool_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"KVLayout.{name} must be an integer >= 1, not {v!r}")
        if self.layers > 256:
            raise InvalidArgument("KVLayout.layers must be at most 256 (the layer travels in 8 bits)")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K (or of V) in one layer. O(1), raises nothing."""
        return self.page_tokens * self.token_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of a pool (K and V, every page). O(1), raises nothing."""
        return 2 * self.pool_pages * self.page_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of a whole pool. O(1), raises nothing."""
        return self.layers * self.layer_bytes

    def pages_for(self, tokens: int) -> int:
        """Pages a request of ``tokens`` tokens needs (per layer, per K/V). O(1); ``tokens`` is
        not checked, nothing is raised for an int."""
        return -(-tokens // self.page_tokens)

    def new_pool(self) -> np.ndarray:
        """A zeroed pool of the right size (touched, so no page faults during transfers).
        Allocates and writes ``pool_bytes`` bytes: O(pool_bytes); MemoryError when they do not
        fit."""
        pool = np.empty(self.pool_bytes, np.uint8)
        pool.fill(0)
        return pool

    def pool_for(self, pool: Any) -> Any:
        """``pool`` checked against this layout (raises InvalidArgument if its size differs), or
        a new zeroed one when it is None. O(1) for a given pool; :meth:`new_pool`'s cost
        otherwise."""
        if pool is None:
            return self.new_pool()
        if pool.nbytes != self.pool_bytes:
            raise InvalidArgument(f"the pool has {pool.nbytes} B; the layout needs {self.pool_bytes} B")
        return pool

    def page(self, pool: np.ndarray, layer: int, kv: int, page: int) -> np.ndarray:
        """The bytes of one page (a view): ``kv`` 0 for K, 1 for V. No copy, O(1); the arguments
        are not checked (integers raise nothing)."""
        off = ((2 * layer + kv) * self.pool_pages + page) * self.page_bytes
        return pool[off : off + self.page_bytes]

    def layer_indices(self, pages: np.ndarray) -> np.ndarray:
        """Page indices of one layer's paged write: the K pages, then the V pages. A new array,
        O(pages); raises nothing for an integer array."""
        return np.concatenate((pages, pages + self.pool_pages))

    def to_dict(self) -> dict[str, Any]:
        """The four fields as a dict (JSON-ready). O(1), raises nothing."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """The layout of :meth:`to_dict`'s dict. Raises KeyError for a missing field,
        ValueError or TypeError for a field that is not a number, and
        :class:`~aiote.InvalidArgument` as the constructor does. O(1)."""
        return cls(**{k: int(d[k]) for k in ("layers", "page_tokens", "token_bytes", "pool_pages")})


class PageAllocator:
    """Pages of a pool, handed out and taken back; last freed, first reused (so tests see
    reuse at once). Building one costs O(pages); nothing is checked or raised."""

    def __init__(self, pages: int) -> None:
        self._free: deque[int] = deque(range(pages - 1, -1, -1))
        self.capacity = pages

    @property
    def free(self) -> int:
        """Pages free now. O(1), raises nothing."""
        return len(self._free)

    def take(self, n: int) -> np.ndarray | None:
        """``n`` pages, or None when fewer are free. O(n), raises nothing."""
        if n > len(self._free):
            return None
        return np.array([self._free.pop() for _ in range(n)], dtype=np.int64)

    def give(self, pages: np.ndarray) -> None:
        """Takes pages back. O(pages), raises nothing; a page given twice is not detected."""
        for p in pages.tolist()[::-1]:
            self._free.append(int(p))
