"""aiote touches only what it owns: importing it leaves the process environment as it was, it
removes only its own dead processes' files from /dev/shm (a live process in another PID
namespace keeps its files, and files that are not aiote's are left alone), and it sets socket
options only on sockets of its own rails. Real processes, real providers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV_SCRIPT = r"""
import ctypes, os, sys
before = dict(os.environ)
import anyio
import aiote

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p

async def main():
    async with aiote.open_engine() as a, aiote.open_engine(same_host=None) as b:
        await a.send(b.address, b"ping", timeout=30)
        assert await b.recv(timeout=30) == (a.address, b"ping")
        dst = bytearray(1 << 16)
        mr = await b.register(dst)
        src = await a.register(bytearray(bytes(range(256)) * 256))
        await a.write(src, mr.descriptor, timeout=30)
        assert dst == bytes(range(256)) * 256
    assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
    c = libc.getenv(b"FI_PROVIDER")  # the C environment as well, where libfabric reads it
    print("C_FI_PROVIDER", c.decode() if c is not None else None, flush=True)

anyio.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("fi_provider", [None, "tcp,ofi_rxm,shm"])
def test_importing_aiote_and_opening_engines_leaves_the_environment_as_it_was(
    backend: str, fi_provider: str | None
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FI_PROVIDER"}
    if fi_provider is not None:
        env["FI_PROVIDER"] = fi_provider
    out = subprocess.run(
        [sys.executable, "-c", ENV_SCRIPT, backend], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"C_FI_PROVIDER {fi_provider}" in out.stdout, out.stdout
