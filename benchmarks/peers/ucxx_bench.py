"""UCXX (``ucxx-cu12``, its asyncio API) on this host: tag send/recv throughput with ``--window``
messages in flight, and an 8 B send/recv round trip (ping-pong).

UCXX is two-sided only (no one-sided puts in its Python API): the receiver posts a matching
``recv`` for every message, ``--window`` of them in flight, each into its own slot of a
``size * window`` buffer; the sender keeps ``--window`` sends in flight, and the timed run
ends when the receiver's 8 B acknowledgement arrives (every byte landed).

Paths (each in a fresh process pair, since UCX reads its settings once per process):

- ``tcp``: ``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=lo``.
- ``same-host``: UCX's defaults (shared memory, CMA for large messages).

The listener binds to 127.0.0.1 (``create_listener(port=0)``, the client connects to
127.0.0.1).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c

LIB = "ucxx"
PATHS = ("tcp", "same-host")
ENVS = {
    "tcp": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"},
    "same-host": {},
}
WRITE, RTT, BYE = 0, 1, 2


def import_ucxx():  # type: ignore[no-untyped-def]
    import ucxx

    return ucxx


async def windowed(n: int, window: int, op) -> None:  # type: ignore[no-untyped-def]
    """Runs ``op(i)`` for i in range(n), ``window`` at a time, starting one as each finishes."""
    pending: set[asyncio.Future[None]] = set()
    i = 0
    while i < n or pending:
        while i < n and len(pending) < window:
            pending.add(asyncio.ensure_future(op(i)))
            i += 1
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for d in done:
            d.result()


async def serve(ep, window: int, dst: np.ndarray, finished: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
    hdr = np.empty(3, np.int64)
    ack = np.ones(1, np.int64)
    small = np.empty(1, np.int64)
    while True:
        await ep.recv(hdr)
        mode, size, n = (int(x) for x in hdr)
        if mode == BYE:
            break
        if mode == WRITE:

            def recv(i: int, size: int = size):  # type: ignore[no-untyped-def]
                slot = i % window
                return ep.recv(dst[slot * size : (slot + 1) * size])

            await windowed(n, window, recv)
            await ep.send(ack)
        else:
            for _ in range(n):
                await ep.recv(small)
                await ep.send(small)
    finished.set()


async def target_main(args) -> None:  # type: ignore[no-untyped-def]
    ucxx = import_ucxx()
    finished = asyncio.Event()
    dst = c.buffer(max(c.sizes_of(args)) * args.window)  # one receive buffer, every size

    async def handler(ep) -> None:  # type: ignore[no-untyped-def]
        await serve(ep, args.window, dst, finished)

    listener = ucxx.create_listener(handler, port=0)
    print(f"PORT {listener.port}", flush=True)
    await finished.wait()
    del listener


async def initiator_main(args, proc) -> None:  # type: ignore[no-untyped-def]
    ucxx = import_ucxx()
    path = args.path
    port = int(c.read_line(proc, "PORT ", 120))
    ep = await ucxx.create_endpoint(c.HOST, port)
    ack = np.empty(1, np.int64)
    window = args.window
    for size in c.sizes_of(args):
        src = c.buffer(size * window)
        src.fill(7)

        async def run(n: int, size: int = size, src: np.ndarray = src) -> float:
            t0 = time.perf_counter()
            await ep.send(np.array([WRITE, size, n], np.int64))
            await windowed(n, window, lambda i: ep.send(src[(i % window) * size : (i % window + 1) * size]))
            await ep.recv(ack)
            return time.perf_counter() - t0

        await run(window)  # warm-up: every slot once
        n = max(window, args.total // size)
        runs = [n * size / await run(n) / 1e9 for _ in range(args.repeats)]
        c.write_record(LIB, path, size, window, runs, env=ENVS[path], what="tag send/recv (two-sided)")
        del src
    if not args.no_rtt:
        warm, iters = 50, args.iters
        ping = np.zeros(1, np.int64)
        pong = np.empty(1, np.int64)
        await ep.send(np.array([RTT, 8, warm + iters], np.int64))
        rtts = []
        for i in range(warm + iters):
            t0 = time.perf_counter()
            await ep.send(ping)
            await ep.recv(pong)
            if i >= warm:
                rtts.append(time.perf_counter() - t0)
        c.rtt_record(LIB, path, rtts, env=ENVS[path], what="8 B tag send + recv, each way (asyncio)")
    await ep.send(np.array([BYE, 0, 0], np.int64))
    await asyncio.sleep(0.05)


def main(argv: list[str]) -> int:
    args = c.parser(__doc__.splitlines()[0]).parse_args(argv)
    try:
        import_ucxx()
    except ImportError:
        return c.skipped(LIB)
    if args.role == "target":
        asyncio.run(target_main(args))
        sys.stdout.flush()
        os._exit(0)
    paths = c.paths_of(args, PATHS)
    if len(paths) > 1 or os.environ.get("AIOTE_PEERS_PATH") != paths[0]:
        return c.run_each_path(
            os.path.abspath(__file__), argv, paths, {p: {**ENVS[p], "AIOTE_PEERS_PATH": p} for p in paths}
        )
    proc = c.spawn_self(os.path.abspath(__file__), args)
    try:
        asyncio.run(initiator_main(args, proc))
    finally:
        c.finish(proc)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
