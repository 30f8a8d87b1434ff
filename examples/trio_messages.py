"""aiote under trio: two-sided messages plus a batch of one-sided writes counted by one
ImmCounter, with a deadline.

    python examples/trio_messages.py
"""

import numpy as np
import trio

import aiote


async def main() -> None:
    async with aiote.open_engine() as a, aiote.open_engine() as b:
        await a.send(b.address, b"hello from a")
        sender, payload = await b.recv(timeout=10)
        assert sender == a.address and payload == b"hello from a"

        dst = np.zeros(64 * 4096, np.uint8)
        dst_mr = await b.register(dst)
        src = np.arange(64 * 4096, dtype=np.uint32).astype(np.uint8)
        src_mr = await a.register(src, remote_write=False)

        batch = a.batch()  # 64 writes, one native call, awaited as one
        for i in range(64):
            batch.write(src_mr, dst_mr.descriptor, length=4096, src_offset=i * 4096,
                        dst_offset=i * 4096, imm=1)
        await batch.submit(timeout=10)

        await b.imm_counter(1).wait(64, timeout=10)
        assert np.array_equal(src, dst)
        print(f"message received; 64 pages written and counted ({b.imm_counter(1).total} credits)")


if __name__ == "__main__":
    trio.run(main)
