"""Mooncake Transfer Engine (``mooncake-transfer-engine-non-cuda``) on this host, tcp transport:
write throughput with ``--window`` writes in flight, and an 8 B write + notification round trip.

Both engines start with ``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")``: no metadata
server, each engine answers the other's handshake on its own RPC port; the session name is
``127.0.0.1:<rpc port>``. ``MC_TCP_BIND_ADDRESS=127.0.0.1`` keeps its data sockets on loopback.

Each in-flight slot is one ``transfer_submit_write`` (one write of ``size`` bytes from its own
slice of a ``size * window`` source to its own slice of the target's buffer), polled with
``transfer_check_status`` and re-submitted as soon as it is done. The round trip is
``transfer_sync`` of 8 B with a ``TransferNotify`` each way, the other side polling
``get_notifies``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c

LIB = "mooncake"
PATHS = ("tcp",)
ENV = {"MC_TCP_BIND_ADDRESS": c.HOST}
PING_SLOT = 64


def import_mooncake():  # type: ignore[no-untyped-def]
    from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

    return TransferEngine, TransferNotify, TransferOpcode


def make_engine():  # type: ignore[no-untyped-def]
    TransferEngine, _, _ = import_mooncake()
    e = TransferEngine()
    rc = e.initialize(c.HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake initialize failed: {rc}")
    return e, f"{c.HOST}:{e.get_rpc_port()}"


def register(e, buf: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    rc = e.register_memory(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RuntimeError(f"mooncake register_memory failed: {rc}")


def wait_notify(e, msg: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        if any(n.msg == msg for n in e.get_notifies()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {msg!r} notification")


def target(args) -> int:  # type: ignore[no-untyped-def]
    _, TransferNotify, TransferOpcode = import_mooncake()
    e, session = make_engine()
    region = max(c.sizes_of(args)) * args.window
    dst = c.buffer(region + PING_SLOT)
    dst.fill(0)  # touched before any timing, as aiote bench's serving side fills its regions
    register(e, dst)
    print(
        "INFO " + json.dumps({"session": session, "dst": dst.ctypes.data, "ping": dst.ctypes.data + region})
    )
    sys.stdout.flush()
    peer = json.loads(sys.stdin.readline())
    # Writes need nothing from us (the engine's own threads receive them): wait on stdin without
    # using the CPU until the initiator asks for round trips, then poll notifications until it
    # closes our stdin.
    if sys.stdin.readline().strip() != "rtt":
        os._exit(0)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    src = dst.ctypes.data + region + 8
    while not stop.is_set():
        for n in e.get_notifies():
            if n.msg == "ping":
                rc = e.transfer_sync(
                    peer["session"],
                    src,
                    peer["pong"],
                    8,
                    TransferOpcode.Write,
                    TransferNotify("target", "pong"),
                )
                if rc != 0:
                    raise RuntimeError(f"pong failed: {rc}")
    sys.stdout.flush()
    os._exit(0)


def throughput(e, session: str, dst: int, size: int, args) -> list[float]:  # type: ignore[no-untyped-def]
    window = args.window
    src = c.buffer(size * window)
    src.fill(7)
    register(e, src)
    base = src.ctypes.data

    def submit(slot: int) -> int:
        bid = e.transfer_submit_write(session, base + slot * size, dst + slot * size, size)
        if bid < 0:
            raise RuntimeError(f"mooncake submit failed: {bid}")
        return int(bid)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        busy = {slot: submit(slot) for slot in range(min(window, n))}
        posted = len(busy)
        while busy:
            for slot, bid in list(busy.items()):
                st = e.transfer_check_status(bid)
                if st == 0:
                    continue
                if st != 1:
                    raise RuntimeError(f"mooncake write failed: status {st}")
                if posted < n:
                    busy[slot] = submit(slot)
                    posted += 1
                else:
                    del busy[slot]
        return time.perf_counter() - t0

    run(window)  # warm-up: every slot once
    n = max(window, args.total // size)
    out = [n * size / run(n) / 1e9 for _ in range(args.repeats)]
    e.unregister_memory(base)
    return out


def initiator(args) -> int:  # type: ignore[no-untyped-def]
    _, TransferNotify, TransferOpcode = import_mooncake()
    e, session = make_engine()
    proc = c.spawn_self(os.path.abspath(__file__), args)
    try:
        info = json.loads(c.read_line(proc, "INFO ", 120))
        mine = np.zeros(PING_SLOT, np.uint8)
        register(e, mine)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"session": session, "pong": mine.ctypes.data}) + "\n")
        proc.stdin.flush()
        for size in c.sizes_of(args):
            runs = throughput(e, info["session"], info["dst"], size, args)
            c.write_record(LIB, "tcp", size, args.window, runs, env=ENV)
        if not args.no_rtt:
            proc.stdin.write("rtt\n")
            proc.stdin.flush()
            rtts = []
            for i in range(args.iters + 50):  # 50 warm-up round trips
                t0 = time.perf_counter()
                rc = e.transfer_sync(
                    info["session"],
                    mine.ctypes.data,
                    info["ping"],
                    8,
                    TransferOpcode.Write,
                    TransferNotify("initiator", "ping"),
                )
                if rc != 0:
                    raise RuntimeError(f"ping failed: {rc}")
                wait_notify(e, "pong")
                if i >= 50:
                    rtts.append(time.perf_counter() - t0)
            c.rtt_record(LIB, "tcp", rtts, env=ENV, what="8 B transfer_sync + TransferNotify, each way")
    finally:
        c.finish(proc)
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str]) -> int:
    args = c.parser(__doc__.splitlines()[0]).parse_args(argv)
    try:
        import_mooncake()
    except ImportError:
        return c.skipped(LIB, f"mooncake not installed ({c.INSTALL_HINT})")
    c.paths_of(args, PATHS)
    args.path = "tcp"
    if args.role == "target":
        return target(args)
    if os.environ.get("MC_TCP_BIND_ADDRESS") != c.HOST:
        return c.run_each_path(os.path.abspath(__file__), argv, PATHS, {"tcp": ENV})
    return initiator(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
