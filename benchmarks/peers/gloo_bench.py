"""torch.distributed with the gloo backend on this host: ``isend``/``irecv`` throughput with
``--window`` messages in flight, and an 8 B send/recv round trip.

Two ranks (this process is rank 0, the second process rank 1), ``init_process_group("gloo",
init_method="tcp://127.0.0.1:<free port>")`` and ``GLOO_SOCKET_IFNAME=lo``: gloo always goes
through TCP, so ``tcp`` is its only path. Rank 1 posts an ``irecv`` per message into its own slot
of a ``size * window`` buffer, ``--window`` in flight; rank 0 keeps ``--window`` ``isend`` in
flight; a timed run ends when rank 1's 8 B acknowledgement arrives (every byte landed).
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c

LIB = "gloo"
PATHS = ("tcp",)
ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def import_dist():  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        raise ImportError("torch.distributed without gloo")
    return torch, dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind((c.HOST, 0))
        return int(s.getsockname()[1])


def windowed(n: int, window: int, post) -> None:  # type: ignore[no-untyped-def]
    """Posts ``post(i)`` for i in range(n), at most ``window`` unfinished (oldest waited first)."""
    busy: collections.deque = collections.deque()  # type: ignore[type-arg]
    for i in range(n):
        if len(busy) >= window:
            busy.popleft().wait()
        busy.append(post(i))
    while busy:
        busy.popleft().wait()


def both_sides(args, rank: int) -> None:  # type: ignore[no-untyped-def]
    """The same sequence on both ranks: rank 0 sends and times, rank 1 receives and acknowledges."""
    torch, dist = import_dist()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{c.HOST}:{int(args.peer_arg)}", rank=rank, world_size=2
    )
    peer = 1 - rank
    window = args.window
    ack = torch.zeros(1, dtype=torch.int64)
    for size in c.sizes_of(args):
        buf = torch.from_numpy(c.buffer(size * window))
        buf.fill_(7)

        def slot(i: int, size: int = size, buf=buf):  # type: ignore[no-untyped-def]
            k = i % window
            return buf[k * size : (k + 1) * size]

        def run(n: int) -> float:
            t0 = time.perf_counter()
            if rank == 0:
                windowed(n, window, lambda i: dist.isend(slot(i), peer))
                dist.recv(ack, peer)
            else:
                windowed(n, window, lambda i: dist.irecv(slot(i), peer))
                dist.send(ack, peer)
            return time.perf_counter() - t0

        run(window)  # warm-up: every slot once
        n = max(window, args.total // size)
        runs = [n * size / run(n) / 1e9 for _ in range(args.repeats)]
        if rank == 0:
            c.write_record(LIB, "tcp", size, window, runs, env=ENV, what="isend/irecv (two-sided)")
        del buf
    if not args.no_rtt:
        warm = 50
        small = torch.zeros(1, dtype=torch.int64)  # 8 B
        rtts = []
        for i in range(warm + args.iters):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(small, peer)
                dist.recv(small, peer)
            else:
                dist.recv(small, peer)
                dist.send(small, peer)
            if i >= warm:
                rtts.append(time.perf_counter() - t0)
        if rank == 0:
            c.rtt_record(LIB, "tcp", rtts, env=ENV, what="8 B send + recv, each way")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    args = c.parser(__doc__.splitlines()[0]).parse_args(argv)
    try:
        import_dist()
    except ImportError:
        return c.skipped(LIB, f"gloo not installed (torch.distributed with gloo: {c.INSTALL_HINT})")
    c.paths_of(args, PATHS)
    args.path = "tcp"
    if args.role == "target":
        both_sides(args, 1)
        return 0
    if os.environ.get("GLOO_SOCKET_IFNAME") != ENV["GLOO_SOCKET_IFNAME"]:
        return c.run_each_path(os.path.abspath(__file__), argv, PATHS, {"tcp": ENV})
    args.peer_arg = str(free_port())  # rank 0 serves the rendezvous store there
    proc = c.spawn_self(os.path.abspath(__file__), args, peer_arg=args.peer_arg)
    try:
        both_sides(args, 0)
    finally:
        c.finish(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
