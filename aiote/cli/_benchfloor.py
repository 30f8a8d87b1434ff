"""The event loop alone playing a ping-pong over a plain socket, no library (``aiote bench``).

Theory of operation. Two processes play an 8-byte ping-pong over one plain socket, each
waiting in its event loop (asyncio, uvloop or trio) for the other's bytes, then sending its
own: one wake-up of a sleeping event loop per hop, and nothing else (the kernel's hand-off of
a few bytes, the loop's wake-up from its selector, its callback and the task's resume). It is
a reference for what an awaited hop costs on this machine without any library. ``aiote
bench`` runs it beside each latency case, in the same run, as the latency rows' "bare
sockets" figure.

The socket is a loopback TCP connection (``--family tcp``, ``TCP_NODELAY``: what the tcp
route rides on) or a Unix socket pair (``--family unix``: the same host's cheapest
cross-process path). The pinger builds the connected pair, starts the echoing side as a
child (this file, run as a script: it imports no aiote, so no libfabric) with its end passed
down, times ``--iters`` round trips after ``--warmup`` untimed ones, and prints one JSON line:
the one-way p50 and p99 (round trip / 2) in µs, the pinger's loop-thread CPU µs per round
trip, and the event loop it ran under as seen from inside (``ran_under``). Runs with the
standard library alone; ``--loop uvloop`` / ``trio`` need those installed.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

MSG = b"aiotepp!"  # 8 bytes, as the C core's and aiote's ping-pongs


def _pair(family: str) -> tuple[socket.socket, socket.socket]:
    """Two connected sockets: loopback TCP with Nagle off, or a Unix stream pair."""
    if family == "unix":
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


Recv = Callable[[int], Awaitable[bytes]]


async def _play(recv: Recv, send_all: Callable[[], Awaitable[Any]], n: int, first: bool) -> list[int]:
    """``n`` round trips with the loop's own socket calls (``recv(k)``: up to k bytes;
    ``send_all()``: the 8 bytes); the pinger (``first``) sends first and times each one (ns)."""
    times = [0] * n if first else []

    async def take() -> None:
        got = 0
        while got < len(MSG):
            chunk = await recv(len(MSG) - got)
            if not chunk:
                raise ConnectionError("the other side closed the socket")
            got += len(chunk)

    for i in range(n):
        if first:
            t0 = time.perf_counter_ns()
            await send_all()
            await take()
            times[i] = time.perf_counter_ns() - t0
        else:
            await take()
            await send_all()
    return times


async def _asyncio_side(sock: socket.socket, n: int, first: bool) -> list[int]:
    import asyncio

    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    return await _play(partial(loop.sock_recv, sock), partial(loop.sock_sendall, sock, MSG), n, first)


async def _trio_side(raw: socket.socket, n: int, first: bool) -> list[int]:
    import trio

    sock = trio.socket.from_stdlib_socket(raw)

    async def send_all() -> None:
        sent = 0
        while sent < len(MSG):
            sent += await sock.send(MSG[sent:])

    return await _play(sock.recv, send_all, n, first)


def _run(loop: str, sock: socket.socket, n: int, first: bool, deadline: float) -> tuple[list[int], str]:
    """One side's ``n`` round trips under ``loop``: the pinger's round trips in ns, and the
    event loop they ran under, as seen from inside it (``asyncio``, ``uvloop``, ``trio``). Raises
    TimeoutError after ``deadline`` seconds (an other side that stopped answering)."""
    if loop == "trio":
        import trio

        async def bounded_trio() -> tuple[list[int], str]:
            with trio.fail_after(deadline):
                times = await _trio_side(sock, n, first)
            return times, type(trio.lowlevel.current_trio_token()).__module__.split(".")[0]

        try:
            return trio.run(bounded_trio)
        except trio.TooSlowError:
            raise TimeoutError(f"no end of the ping-pong within {deadline} s") from None
    import asyncio

    async def bounded() -> tuple[list[int], str]:
        times = await asyncio.wait_for(_asyncio_side(sock, n, first), deadline)
        return times, type(asyncio.get_running_loop()).__module__.split(".")[0]

    if loop == "uvloop":
        import uvloop

        return uvloop.run(bounded())
    return asyncio.run(bounded())


def pingpong(
    loop: str, family: str, iters: int, warmup: int = 300, deadline: float = 120.0
) -> dict[str, Any]:
    """Runs the ping-pong (this process pings, a child echoes); its figures. TimeoutError
    after ``deadline`` seconds."""
    if iters < 1 or warmup < 0:
        raise ValueError("iters must be at least 1 and warmup at least 0")
    mine, theirs = _pair(family)
    cmd = [sys.executable, str(Path(__file__)), "--echo", str(theirs.fileno()), "--loop", loop,
           "--iters", str(iters + warmup), "--deadline", str(deadline)]
    child = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
    theirs.close()
    try:
        c0 = time.thread_time()
        rtts, ran = _run(loop, mine, iters + warmup, True, deadline)
        rtts = rtts[warmup:]
        cpu = (time.thread_time() - c0) / (iters + warmup) * 1e6
        if child.wait(30) != 0:
            raise RuntimeError(f"the echoing side failed ({child.returncode})")
    finally:
        mine.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    rtts.sort()
    p99 = rtts[min(len(rtts) - 1, len(rtts) * 99 // 100)]
    return {"loop": loop, "ran_under": ran, "family": family, "iters": iters,
            "p50_us": rtts[len(rtts) // 2] / 2e3, "p99_us": p99 / 2e3, "loop_cpu_us_per_rtt": cpu}


def family_of(provider: str) -> str | None:
    """The plain socket a route's reference is measured on: loopback TCP for ``tcp``, a Unix
    socket pair for ``shm`` (the same host); None for a provider of a real NIC."""
    return {"tcp": "tcp", "shm": "unix"}.get(provider)


def floor_run(loop: str, family: str, iters: int) -> dict[str, Any]:
    """:func:`pingpong` in a process of its own (this file as a script: no aiote, no
    libfabric, a fresh interpreter as the C bench gets); RuntimeError if it fails."""
    cmd = [sys.executable, str(Path(__file__)), "--loop", loop, "--family", family, "--iters", str(iters)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise RuntimeError("the event loop's ping-pong took over 300 s") from None
    if run.returncode != 0:
        last = run.stderr.strip().splitlines()[-1:] or [f"exit {run.returncode}"]
        raise RuntimeError(f"the event loop's ping-pong failed: {last[0]}")
    try:
        result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the event loop's ping-pong printed no result: {run.stdout[-200:]!r}") from None
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop", "trio"))
    ap.add_argument("--family", default="tcp", choices=("tcp", "unix"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds for the whole run")
    ap.add_argument("--echo", type=int, metavar="FD", help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be at least 1 and --warmup at least 0")
    if args.echo is not None:
        sock = socket.socket(fileno=args.echo)
        try:
            _run(args.loop, sock, args.iters, False, args.deadline)
        finally:
            sock.close()
        return 0
    result = pingpong(args.loop, args.family, args.iters, args.warmup, args.deadline)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
