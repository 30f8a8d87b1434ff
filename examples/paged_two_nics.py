"""Paged writes over two NICs (two rails on loopback): a KV-like pool of pages, a request's
pages written to the slots the receiver chose, one credit per page whatever the NIC count.

    python examples/paged_two_nics.py
"""

from __future__ import annotations

import anyio
import numpy as np

import aiote

PAGE = 64 << 10  # 64 KiB pages
POOL = 256  # pages per pool


async def main() -> None:
    nics = ["lo", "lo"]  # two NICs; on a real host e.g. ["eth0", "eth1"]
    async with aiote.open_engine(nics=nics, same_host=None) as sender, aiote.open_engine(
        nics=nics, same_host=None
    ) as receiver:
        src_pool = np.random.default_rng(0).integers(0, 256, POOL * PAGE, dtype=np.uint8)
        dst_pool = np.zeros(POOL * PAGE, np.uint8)
        src_mr = await sender.register(src_pool, remote_write=False)
        dst_mr = await receiver.register(dst_pool)
        desc = bytes(dst_mr.descriptor)  # what the receiver would send to the sender
        print("route:", sender.route(aiote.MemoryDescriptor.from_bytes(desc)))

        request_pages = np.array([17, 3, 250, 42, 99, 100, 101, 7])  # sender's pool pages
        slots = np.arange(len(request_pages))  # where the receiver wants them
        await sender.write_paged(
            src_mr, desc, page_size=PAGE, src_pages=request_pages, dst_pages=slots, imm=1234
        )
        await receiver.imm_counter(1234).wait(len(request_pages), timeout=10)
        got = dst_pool[: len(slots) * PAGE].reshape(-1, PAGE)
        want = src_pool.reshape(POOL, PAGE)[request_pages]
        assert np.array_equal(got, want)
        print(f"{len(request_pages)} pages over {len(nics)} NICs, counted once each: verified")


if __name__ == "__main__":
    anyio.run(main)
