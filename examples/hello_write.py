"""Smallest aiote program (asyncio): two engines on tcp loopback, one WriteImm, verified.

    python examples/hello_write.py
"""

import asyncio

import numpy as np

import aiote


async def main() -> None:
    async with aiote.open_engine() as sender, aiote.open_engine() as receiver:
        dst = np.zeros(1 << 20, np.uint8)
        dst_mr = await receiver.register(dst)
        desc_bytes = bytes(dst_mr.descriptor)  # what you would ship to the sender out of band

        src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        src_mr = await sender.register(src, remote_write=False)
        await sender.write(src_mr, aiote.MemoryDescriptor.from_bytes(desc_bytes), imm=7, timeout=10)

        await receiver.imm_counter(7).wait(1, timeout=10)  # the data has landed
        assert np.array_equal(src, dst)
        print("1 MiB written and verified")


if __name__ == "__main__":
    asyncio.run(main())
