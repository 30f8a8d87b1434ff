"""``Engine.alloc_gpu``: GPU memory shared with same-host peers as a file descriptor
(aiote/_core/_vmm.py). Here on the host GPU emulation (``gpu_backend="host"``, a ``memfd``),
across real processes: the descriptor server, the token check, the ``pidfd_getfd`` fallback
and the IPC rail's use of the mapping all run; only the CUDA driver calls do not (those run
in tests/test_gpu.py on a GPU machine)."""

from __future__ import annotations

import gc
import mmap
import os

import pytest

import aiote
from aiote._core import _vmm
from aiote.testing import digest, pattern, spawn_peer

pytestmark = pytest.mark.anyio


async def test_peer_writes_into_alloc_gpu_memory_through_its_descriptor() -> None:
    n = (2 << 20) + 100
    async with spawn_peer(peer_gpu_backend="host", gpu_backend="host") as peer:
        e = peer.engine
        src = e.alloc_gpu(n)  # ours is shared the same way: a read from the peer lands in it
        assert src.nbytes == n and not src.host.any()  # zero-filled
        src.host[:] = pattern(n, 3)
        mr = await e.register(src)
        dst = await peer.register("g", n, device="alloc_gpu")
        g = dst.gpu
        assert g is not None and _vmm.is_handle(g.ipc_handle) and g.ipc_offset == 0
        await e.write(mr, dst, length=n - 7, src_offset=7, dst_offset=0, imm=9)
        await peer.wait(imm=9, n=1, timeout=20)
        assert await peer.digest("g", 0, n - 7) == digest(src.host[7:])
        st = e.stats()
        assert st["gpu_ipc"] == 1 and st["gpu_staged"] == 0  # the route it ran on: the mapping
        # a READ of a peer's GPU memory has only this route (it raises where there is no mapping)
        await e.read(mr, dst, length=4096, src_offset=8192, dst_offset=0)
        assert digest(src.host[:4096]) == digest(src.host[8199 : 8199 + 4096])


async def test_descriptor_fetch_server_and_pidfd_fallback() -> None:
    async with aiote.open_engine(provider="tcp", gpu_backend="host") as e:
        arr = e.alloc_gpu(10_000, device=1)
        arr.host[:] = pattern(10_000, 5)
        rec = _vmm.lookup(arr.host.ctypes.data + 5)
        assert rec is not None and rec.size % mmap.PAGESIZE == 0 and rec.size >= 10_000
        h, off = _vmm.handle(rec, arr.host.ctypes.data + 5)
        assert off == 5 and _vmm.handle_size(h) == rec.size

        size, want = rec.size, arr.host.tobytes()

        def same_memory(fd: int) -> bool:
            try:
                with mmap.mmap(fd, size) as m:
                    return bytes(m[:10_000]) == want
            finally:
                os.close(fd)

        assert same_memory(_vmm.fetch(h))  # over this process's descriptor server
        # a handle whose server cannot be reached: pidfd_getfd (we hold ptrace rights on ourselves),
        # the descriptor checked to be the same file; one whose file differs (a reused number) refused
        nonce_at = 4 + 4 + 4 + 8 + 16
        other = h[:nonce_at] + bytes(8) + h[nonce_at + 8 :]
        assert same_memory(_vmm.fetch(other, timeout=1.0))
        with pytest.raises(aiote.AioteError, match="reused"):
            _vmm.fetch(other[:-8] + bytes(8), timeout=1.0)
        # a wrong token is refused by the server (no fallback: the server was reached)
        token_off = 4 + 4 + 4 + 8
        with pytest.raises(aiote.AioteError, match="does not offer"):
            _vmm.fetch(h[:token_off] + bytes(16) + h[token_off + 16 :])
        # freed: the token is forgotten, the record gone
        base = rec.base
        del arr, rec
        gc.collect()
        with pytest.raises(aiote.AioteError, match="does not offer"):
            _vmm.fetch(h)
        assert _vmm.lookup(base) is None
        with pytest.raises(aiote.InvalidArgument):
            e.alloc_gpu(0)
        with pytest.raises(aiote.InvalidArgument):
            e.alloc_gpu(1.5)  # type: ignore[arg-type]
