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


LOCK_OF_ME = r"""
def my_lock():
    import os
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/aiote-") and target.endswith(".lock"):
            return target[len("/dev/shm/"):-len(".lock")]
    raise SystemExit("no aiote lock file is held")
"""

HOLDER_SCRIPT = LOCK_OF_ME + r"""
import os, sys
import anyio
import aiote

async def main():
    async with aiote.open_engine() as a, aiote.open_engine() as b:
        print("LOCK", my_lock(), os.getpid(), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        # the files of its shm endpoints are still there: the engines still reach each other
        await a.send(b.address, b"still here", timeout=20)
        assert await b.recv(timeout=20) == (a.address, b"still here")
        assert a.route(b.address).provider == "shm"
        print("OK", flush=True)

anyio.run(main)
"""

SWEEPER_SCRIPT = r"""
import anyio
import aiote

async def main():
    async with aiote.open_engine():  # its first shm endpoint sweeps /dev/shm
        pass

anyio.run(main)
"""


SWEEP_DRIVER = r"""
import os, subprocess, sys

HOLDER, SWEEPER, collide = sys.argv[1], sys.argv[2], sys.argv[3] == "1"


def files(token):
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(token))


def dead_pid(at_least):
    pid = at_least
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def line(proc, prefix):
    text = proc.stdout.readline()
    assert text.startswith(prefix), f"expected {prefix!r}, got {text!r}"
    return text.split()


token = os.urandom(4).hex()
foreign = [f"/dev/shm/{dead_pid(20000)}:{token}", f"/dev/shm/12345:{token}foo"]
for path in foreign:
    with open(path, "w") as f:
        f.write("not aiote's")
# a live aiote process in another PID namespace (sharing /dev/shm): its pid there is the pid
# of a process that does not exist here, or of one that does
pad = max(dead_pid(10) - 2, 0) if collide else 0
inner = subprocess.Popen(
    ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
     f'i=0; while [ $i -lt {pad} ]; do /bin/true; i=$((i+1)); done; "$0" -c "$1"', sys.executable, HOLDER],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
try:
    _, inner_token, inner_pid = line(inner, "LOCK")
    assert files(inner_token), "the engine in the other namespace has no files"
    if collide:
        assert not os.path.exists(f"/proc/{inner_pid}"), f"pid {inner_pid} is alive here"
    else:
        assert os.path.exists(f"/proc/{inner_pid}"), f"pid {inner_pid} is not alive here"
    # an aiote process killed with its engine open leaves its files behind
    dead = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    _, dead_token, _ = line(dead, "LOCK")
    dead.kill()
    dead.wait()
    left = files(dead_token)
    assert f"{dead_token}.lock" in left and len(left) >= 2, left
    inner_files = files(inner_token)

    subprocess.run([sys.executable, "-c", SWEEPER], check=True, timeout=60)

    assert files(dead_token) == [], f"a dead aiote process's files were kept: {files(dead_token)}"
    assert files(inner_token) == inner_files, "a live process's files were removed"
    for path in foreign:
        assert os.path.exists(path), f"{path} is not aiote's, and was removed"
    inner.stdin.write("go\n")
    inner.stdin.flush()
    line(inner, "OK")
    assert inner.wait(timeout=30) == 0
    assert files(inner_token) == [], f"an engine that closed left files: {files(inner_token)}"
    print("PASS", flush=True)
finally:
    if inner.poll() is None:
        inner.kill()
"""


def _can_unshare() -> bool:
    try:
        return subprocess.run(
            ["unshare", "--mount", "--pid", "--fork", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
            capture_output=True, timeout=30,
        ).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(os.geteuid() != 0 or not _can_unshare(), reason="needs mount and PID namespaces")
@pytest.mark.parametrize("collide", [True, False], ids=["pid-of-a-dead-process-here", "pid-alive-here"])
def test_the_shm_sweep_removes_only_files_of_dead_aiote_processes(collide: bool) -> None:
    """An engine's first shm endpoint sweeps /dev/shm. It used to remove every <pid>:* file whose
    pid named no live process in its own PID namespace: another program's files, and those of a
    live aiote process in another PID namespace (a container sharing /dev/shm) whose pid is
    free here. Only files of aiote processes that are gone may go. Run with a /dev/shm of its
    own (a mount namespace), shared by every process of the test, so that other programs on the
    machine neither see nor sweep its files."""
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=512m tmpfs /dev/shm && exec "$0" -c "$1" "$2" "$3" "$4"',
         sys.executable, SWEEP_DRIVER, HOLDER_SCRIPT, SWEEPER_SCRIPT, "1" if collide else "0"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0 and "PASS" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
