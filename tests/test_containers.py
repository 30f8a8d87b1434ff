"""Containers on one node: peers started under ``unshare`` in another PID namespace, or with
their own ``/dev/shm``, cannot share memory with us, so the default engine reaches them over
tcp (loopback is shared); a peer in another IPC namespace alone still can, and gets the
same-host route. Needs root and util-linux's unshare; skipped otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from _util import digest, pattern

import aiote
from aiote.testing import spawn_peer

pytestmark = pytest.mark.anyio


def _unshare_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "unshare needs root"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create namespaces here: {r.stderr.strip()}"
    return None


_why = _unshare_unavailable()
if _why:
    pytest.skip(_why, allow_module_level=True)

_OWN_SHM = 'mount -t tmpfs -o size=256m aiote-test /dev/shm && exec "$@"'
SETUPS = {
    # (command prefix, can it share memory with us?)
    "pid+ipc+mount+own-shm": (["unshare", "--pid", "--fork", "--mount-proc", "--ipc", "--mount",
                               "sh", "-c", _OWN_SHM, "sh"], False),
    "pid": (["unshare", "--pid", "--fork", "--mount-proc"], False),
    "own-shm": (["unshare", "--mount", "sh", "-c", _OWN_SHM, "sh"], False),
    "ipc": (["unshare", "--ipc"], True),
    "mount": (["unshare", "--mount"], True),
}


@pytest.mark.parametrize("setup", list(SETUPS))
async def test_a_peer_in_another_container_is_reached_over_tcp(setup: str) -> None:
    prefix, shares = SETUPS[setup]
    async with aiote.open_engine() as e, spawn_peer(engine=e, prefix=prefix) as p:
        d = await p.register("buf", 8 << 20)
        route = e.route(d)
        assert route.provider == ("shm" if shares else "tcp;ofi_rxm"), (setup, route)
        assert route.same_host == shares
        src = pattern(8 << 20, seed=80)
        ms = await e.register(src)
        before = e.stats()["direct_copies"]
        await e.write(ms, d, imm=81, timeout=30)
        await p.wait(imm=81, timeout=30)
        assert await p.digest("buf") == digest(src)
        back = pattern(8 << 20, seed=82)
        mb = await e.register(back)
        await e.read(mb, d, timeout=30)
        assert digest(back) == digest(src)
        assert (e.stats()["direct_copies"] > before) == shares
        # and the peer reaches us the same way
        mine = await e.register(pattern(4096, seed=83))
        assert (await p.route(e.address))["provider"] == route.provider
        await p.write_imm(mine.descriptor, 84)
        await e.imm_counter(84).wait(1, timeout=30)
