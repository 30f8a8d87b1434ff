"""An inference rank's parameter memory for a plan: one region holding its target shards,
registered once, with typed views of each (the receiver's side of "registers the inference
ranks' parameter memory once, plus its descriptors for the plan")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._core._engine import Engine
from .._core._errors import InvalidArgument
from .._core._memory import MemoryRegion
from ._dtypes import itemsize, storage
from ._layout import pack_targets, with_desc
from ._plan import Piece, SourceShard, TargetShard

__all__ = ["TargetRegion", "register_targets"]


@dataclass
class TargetRegion:
    """One inference rank's targets in one registered region: ``targets`` (with the region's
    descriptor, ready for :func:`plan`), the ``buffer`` (NumPy or CuPy ``uint8``), its
    ``region``, and each target's ``(rows, width)`` shape in elements (``shapes``)."""

    targets: list[TargetShard]
    buffer: Any
    region: MemoryRegion
    shapes: dict[str, tuple[int, int]]

    def view(self, name: str) -> Any:
        """Target ``name`` as a ``(rows, width)`` array of its storage type (a view: it sees
        every update in place). Pieces of different widths come back flat. Raises KeyError
        for an unknown name. O(1)."""
        t = next(t for t in self.targets if t.name == name)
        rows, width = self.shapes[name]  # width 0: ``rows`` is the element count
        n = (rows * width if width else rows) * itemsize(t.dtype)
        buf = getattr(self.buffer, "host", self.buffer)  # the host GPU emulation: its NumPy view
        flat = buf[t.offset : t.offset + n].view(storage(t.dtype))
        return flat.reshape(rows, width) if width else flat


async def register_targets(
    engine: Engine,
    rank: int,
    specs: Iterable[tuple[str, str, Sequence[Piece]]],
    sources: Sequence[SourceShard],
    *,
    buffer: Any = None,
    gpu: int | None = None,
    align: int = 256,
) -> TargetRegion:
    """Lays out inference ``rank``'s targets (``(name, dtype, pieces)`` specs, see
    :func:`pack_targets`) in one buffer and registers it once with ``engine`` (remote writes
    allowed, remote reads refused). ``buffer``: a C-contiguous NumPy or CuPy ``uint8`` array of
    at least the size needed (e.g. GPU memory); None: ``engine.alloc_gpu(size, device=gpu)``
    when ``gpu`` is given (GPU memory that same-host senders' CUDA-IPC rail copies into at the
    link's pace, the fastest GPU path), else ``engine.alloc_host`` (the host arena, the
    fastest same-host path for host memory).

    Raises :class:`~aiote.InvalidArgument` for a buffer too small or not ``uint8``, or both
    ``buffer`` and ``gpu`` given; what ``engine.alloc_gpu`` raises;
    ``PlanError`` for bad specs, and what ``engine.register`` raises. Costs one registration
    (and the buffer's allocation when not given)."""
    targets, nbytes = pack_targets(rank, specs, sources, align=align)
    if buffer is not None and gpu is not None:
        raise InvalidArgument("register_targets: pass buffer or gpu, not both")
    if buffer is None and gpu is not None:
        buffer = engine.alloc_gpu(max(nbytes, 1), device=gpu)
    elif buffer is None:
        buffer = engine.alloc_host(max(nbytes, 1))
    elif str(getattr(buffer, "dtype", "")) != "uint8" or int(buffer.size) < nbytes:
        raise InvalidArgument(f"buffer must be a uint8 array of at least {nbytes} bytes")
    region = await engine.register(buffer, remote_write=True, remote_read=False)
    widths = {s.name: s.width for s in sources}
    shapes: dict[str, tuple[int, int]] = {}
    for t in targets:
        ws = {(p.cols[1] - p.cols[0]) if p.cols is not None else widths[p.source] for p in t.pieces}
        rows = sum(p.rows[1] - p.rows[0] for p in t.pieces)
        shapes[t.name] = (
            (rows, ws.pop())
            if len(ws) == 1
            else (
                sum(
                    (p.rows[1] - p.rows[0])
                    * ((p.cols[1] - p.cols[0]) if p.cols is not None else widths[p.source])
                    for p in t.pieces
                ),
                0,
            )
        )
    return TargetRegion(with_desc(targets, bytes(region.descriptor)), buffer, region, shapes)
