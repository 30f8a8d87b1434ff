"""Helpers for the aiote tests (no mocks: they only observe real engines)."""

from __future__ import annotations

import importlib.util
import os
import platform
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import numpy as np
import pytest

import aiote
from aiote.testing import digest, pattern

__all__ = [
    "anyio_backend_with_uvloop",
    "digest",
    "eventually",
    "fails_after_kill",
    "kernel_sndbuf",
    "landed",
    "nothing_posted",
    "pattern",
    "snapshot",
    "tcp_sockets",
    "zeros",
]

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


@pytest.fixture(
    scope="module",
    name="anyio_backend",
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param("trio", id="trio"),
        pytest.param(
            ("asyncio", {"use_uvloop": True}),
            id="uvloop",
            marks=pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop not installed (pip install uvloop)"),
        ),
    ],
)
def anyio_backend_with_uvloop(request: pytest.FixtureRequest) -> Any:
    """asyncio, trio and asyncio on uvloop's event loop (which serving frameworks often run):
    a module imports it to run its tests under all three (``anyio_backend_name`` is "asyncio"
    under uvloop)."""
    return request.param


def zeros(n: int) -> np.ndarray:
    return np.zeros(n, np.uint8)


async def streams_open(e: Any) -> None:
    """Waits until the connections that ``e``'s transfers so far began to open are open
    (a peer reached over several NICs or ``streams``: the first contact opens the others in
    the background, and transfers are split over them only once they are)."""
    await eventually(lambda: e.stats()["routes_opening"] == 0, "the connections to open")


async def peer_buffer(p: Any, size: int, seed: int, *, connect: bool = False) -> tuple[Any, np.ndarray, Any]:
    """A ``size``-byte region "buf" at the peer process ``p`` and a registered pattern of
    ``seed`` on its engine, after a first WriteImm (imm 1) reached it: (descriptor, pattern,
    region). ``connect``: every connection to it (each NIC and stream) open too."""
    e = p.engine
    d = await p.register("buf", size)
    src = pattern(size, seed=seed)
    ms = await e.register(src)
    await e.write_imm(d, 1)
    await p.wait(imm=1)
    if connect:
        await e.connect(d, timeout=30)
    return d, src, ms


async def eventually(pred: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Polls ``pred`` (on real engine state) until it holds; fails the test after ``timeout``."""
    with anyio.move_on_after(timeout):
        while not pred():  # noqa: ASYNC110 (polls native state)
            await anyio.sleep(0.002)
        return
    raise AssertionError(f"timed out waiting for {what}")


# system calls in which a thread only waits (x86_64 and aarch64 numbers): epoll_wait and
# epoll_pwait(2), futex(_waitv), poll, ppoll, select, pselect6, read, nanosleep,
# clock_nanosleep, wait4
_WAITING_SYSCALLS = {
    "x86_64": {232, 281, 441, 202, 449, 7, 271, 23, 270, 0, 35, 230, 61},
    "aarch64": {22, 441, 98, 449, 73, 72, 63, 101, 115, 260},
}


def _thread_states(pid: int) -> list[tuple[str, str]]:
    """(state letter, first field of /proc/.../syscall) of every thread of ``pid``."""
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/task/{t}/syscall") as f:
            out.append((state, f.read().split()[0]))
    return out


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (a SIGSTOP took effect)."""
    return all(state in "Tt" for state, _ in _thread_states(pid))


@asynccontextmanager
async def frozen(pid: int, timeout: float = 20.0) -> AsyncIterator[None]:
    """Process ``pid`` stopped (SIGSTOP) for the body, every thread seen stopped, then
    resumed (SIGCONT), however the body ends. It is stopped where each of its threads waits
    in a system call (an epoll or futex wait, a read, a sleep): a stop that finds a thread
    anywhere else resumes the process and tries again. libfabric 1.17's shm provider holds a
    process's region lock while that process takes in a message (copying it with
    process_vm_readv), and a sender to it spins on the lock inside its posting call: a peer
    frozen there would hold this test's event loop until it ran again (see
    docs/cancellation.md)."""
    waiting = _WAITING_SYSCALLS.get(platform.machine())
    try:
        with anyio.fail_after(timeout):
            while True:
                os.kill(pid, signal.SIGSTOP)
                while not stopped(pid):  # noqa: ASYNC110 (polls /proc)
                    await anyio.sleep(0.001)
                calls = [call for _, call in _thread_states(pid)]
                if waiting is None or all(c.isdigit() and int(c) in waiting for c in calls):
                    break
                os.kill(pid, signal.SIGCONT)
                await anyio.sleep(0.005)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def fails_after_kill(
    op: Callable[[], Awaitable[object]],
    kill: Callable[[], object],
    *,
    after: float,
    beside: Sequence[Callable[[], Any]] = (),
) -> tuple[BaseException, float]:
    """Runs ``op`` over and over (the peer alive: it succeeds) while ``beside`` run, kills the
    peer after ``after`` seconds, and returns the AioteError that ended the loop and how long
    after the kill it came (the loop gives up after 60 s: no error at all fails the test)."""
    killed = [0.0]
    outcome: list[tuple[BaseException, float]] = []

    async def loop() -> None:
        try:
            with anyio.fail_after(60):
                while True:  # until the peer's death shows
                    await op()
        except aiote.AioteError as exc:
            outcome.append((exc, time.monotonic() - killed[0]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop)
        for other in beside:
            tg.start_soon(other)
        await anyio.sleep(after)
        killed[0] = time.monotonic()
        kill()
    assert outcome, "the operations to the killed peer never failed"
    return outcome[0]


async def landed(engine: aiote.Engine, expected: dict[int, int], timeout: float = 20.0) -> None:
    """Waits, without consuming anything, until every imm in ``expected`` has received
    exactly that many credits (``counter.total``, fed by the native poller)."""
    counters = {imm: engine.imm_counter(imm) for imm in expected}
    await eventually(
        lambda: all(counters[i].total >= n for i, n in expected.items()), f"credits {expected}", timeout
    )
    got = {i: counters[i].total for i in expected}
    assert got == expected


async def two_regions(
    a: aiote.Engine, b: aiote.Engine, nsrc: int, ndst: int
) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    """Zeroed ``nsrc`` bytes registered with ``a`` and ``ndst`` with ``b``: (src, dst, src's
    region, dst's descriptor)."""
    src, dst = zeros(nsrc), zeros(ndst)
    ms = await a.register(src)
    md = await b.register(dst)
    return src, dst, ms, md.descriptor


@contextmanager
def counting(obj: Any, name: str) -> Iterator[list[int]]:
    """Counts the calls of ``obj.name`` inside the block (a wrapper set on the instance,
    removed after): yields a one-element list holding the count, read as ``calls[0]``."""
    calls = [0]
    inner = getattr(obj, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return inner(*args, **kwargs)

    setattr(obj, name, wrapper)
    try:
        yield calls
    finally:
        delattr(obj, name)


def snapshot(engine: aiote.Engine) -> dict[str, int]:
    return engine.stats()


def nothing_posted(engine: aiote.Engine, before: dict[str, int]) -> None:
    """Asserts that nothing was posted since ``before`` (a stats() snapshot)."""
    after = engine.stats()
    assert after["ops_in_flight"] == 0, after
    assert after["pending"] == 0, after
    assert after["completions"] == before["completions"], (before, after)
    assert after["errors"] == before["errors"], (before, after)


def as_u8(a: Any) -> np.ndarray:
    return np.frombuffer(memoryview(a).cast("B"), np.uint8)


def tcp_sockets() -> list[tuple[tuple[str, int], tuple[str, int] | None, int]]:
    """This process's TCP sockets: (local address, remote address or None for a listener,
    SO_SNDBUF as the kernel reports it). Reads them through duplicates of the descriptors."""
    out: list[tuple[tuple[str, int], tuple[str, int] | None, int]] = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:
            continue  # gone meanwhile
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # not a socket
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            local = s.getsockname()[:2]
            try:
                remote: tuple[str, int] | None = s.getpeername()[:2]
            except OSError:
                remote = None
            out.append((local, remote, s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)))
    return out


def kernel_sndbuf(asked: int) -> int:
    """What SO_SNDBUF reads back after setting ``asked``: doubled, capped at wmem_max."""
    with open("/proc/sys/net/core/wmem_max") as f:
        cap = int(f.read())
    return 2 * min(asked, cap)


_SILENT = r"""
import sys, anyio, aiote
async def main():
    async with aiote.open_engine(**({} if sys.argv[1] == "shm" else {"same_host": None})) as e:
        print(e.address.hex(), flush=True)
        await anyio.sleep(3600)  # never receives: a sender's messages fill its slots, then pend
anyio.run(main)
"""


@asynccontextmanager
async def silent_peer(same_host: str | None) -> AsyncIterator[tuple[Any, bytes]]:
    """A peer engine in a child process that never receives (``same_host``: "shm", the
    default same-host route, or None: tcp only): yields the process and its address."""
    import sys

    async with await anyio.open_process([sys.executable, "-c", _SILENT, str(same_host)]) as proc:
        assert proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive()
        yield proc, bytes.fromhex(line.decode().strip())
