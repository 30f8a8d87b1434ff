"""Column slices of a row-major matrix to a same-host peer process, three ways in one run.

A row-parallel layer's shard is a column slice: ``rows`` pieces of ``piece`` bytes, one per
row, ``pitch`` bytes apart in the source, landing one after another in the target. On the
default same-host route (``open_engine()``'s defaults, the peer a separate process), each
case sends the same bytes, one call in flight, the peer's region touched before timing:

- ``strided``: ``write_paged`` with the rows as pages (``src_stride=pitch``): one strided copy
  per 4096 rows in the core, nothing staged;
- ``staged``: NumPy copies the slice into a registered buffer, then one ``write`` (what a
  sender does without strided copies);
- ``contiguous``: one ``write`` of as many contiguous bytes (the same copy with nothing to
  gather: the ceiling for the other two).

Into the peer's ordinary NumPy memory (``process_vm_writev``) and into its host arena
(``memcpy``). Prints GB/s (1e9 B/s, from the call to its return, the bytes in place), the
median of ``--repeats``, and strided / staged and strided / contiguous; the route each ran on
and the engine's direct copies counted.

    python benchmarks/bench_strided.py [--repeats N] [--rows R]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Awaitable, Callable
from statistics import median

import anyio
import numpy as np

import aiote
from aiote.testing import PeerProcess, spawn_peer

SHAPES = [(4096, 8192, 4096), (2048, 28672, 14336)]  # (rows, pitch, piece): o_proj and down_proj / 2


async def timed(call: Callable[[], Awaitable[None]], repeats: int) -> float:
    """Median seconds of ``call`` after one untimed warm-up."""
    await call()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t)
    return median(out)


async def one_shape(
    peer: PeerProcess, rows: int, pitch: int, piece: int, device: str | None, repeats: int
) -> dict[str, float]:
    """GB/s of the three cases for one shape, into a fresh peer region."""
    e = peer.engine
    n = rows * piece
    matrix = np.random.default_rng(1).integers(0, 255, rows * pitch, dtype=np.uint8)
    staging = np.zeros(n, np.uint8)
    ms, mt = await e.register(matrix), await e.register(staging)
    desc = await peer.register(f"dst-{device}-{piece}", n, device=device)
    r = e.route(desc)
    assert r.direct, f"the peer's region is not reached by direct copies ({r})"
    pages = np.arange(rows)
    view = matrix.reshape(rows, pitch)[:, :piece]

    async def strided() -> None:
        await e.write_paged(
            ms, desc, page_size=piece, src_pages=pages, dst_pages=pages, src_stride=pitch, timeout=60
        )

    async def staged() -> None:
        np.copyto(staging.reshape(rows, piece), view)
        await e.write(mt, desc, length=n, timeout=60)

    async def contiguous() -> None:
        await e.write(ms, desc, length=n, timeout=60)

    out: dict[str, float] = {}
    copies = e.stats()["direct_copies"]
    out["strided"] = n / await timed(strided, repeats) / 1e9
    out["strided copies per call"] = (e.stats()["direct_copies"] - copies) / (repeats + 1)
    await strided()
    want = hashlib.blake2b(np.ascontiguousarray(view).tobytes(), digest_size=16).hexdigest()
    assert await peer.digest(f"dst-{device}-{piece}") == want, "the strided copy landed wrong bytes"
    out["staged"] = n / await timed(staged, repeats) / 1e9
    out["contiguous"] = n / await timed(contiguous, repeats) / 1e9
    await e.unregister(ms)
    await e.unregister(mt)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, default=None, help="rows per call (default: the shapes' own)")
    a = ap.parse_args()
    async with aiote.open_engine() as e, spawn_peer(engine=e) as peer:
        print(f"bench_strided: route {e.route(peer.address).provider}, repeats {a.repeats}")
        for device, label in ((None, "NumPy memory (process_vm_writev)"), ("arena", "host arena (memcpy)")):
            for rows, pitch, piece in SHAPES:
                rows = a.rows or rows
                r = await one_shape(peer, rows, pitch, piece, device, a.repeats)
                print(
                    f"{label}, {rows} rows of {piece // 1024} KiB, pitch {pitch // 1024} KiB "
                    f"({rows * piece / 2**20:.0f} MiB): strided {r['strided']:.2f} GB/s "
                    f"({r['strided copies per call']:.0f} copies per call), staged {r['staged']:.2f}, "
                    f"contiguous {r['contiguous']:.2f}; strided / staged {r['strided'] / r['staged']:.2f}, "
                    f"strided / contiguous {r['strided'] / r['contiguous']:.2f}"
                )


if __name__ == "__main__":
    anyio.run(main)
