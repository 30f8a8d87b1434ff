"""NIXL (``nixl-cu12``) on this host: one-sided WRITE throughput with ``--window`` transfer
requests in flight, and an 8 B WRITE + notification round trip.

Paths (each in a fresh process pair, since UCX reads its settings once per process):

- ``tcp``: the UCX backend restricted to TCP over loopback: ``UCX_TLS=tcp,self``,
  ``UCX_NET_DEVICES=lo``.
- ``same-host``: the UCX backend with UCX's defaults (on one host it picks shared memory and
  CMA for RMA).

Each in-flight slot is one prepared transfer request (one descriptor of ``size`` bytes from its
own slice of a ``size * window`` source to its own slice of the target's buffer); a slot is
re-posted as soon as its request is DONE (``check_xfer_state`` polled from Python, as NIXL users
do). The target is another process that only serves the round trips.
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

LIB = "nixl"
PATHS = ("tcp", "same-host")
ENVS = {
    "tcp": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"},
    "same-host": {},
}
# NIXL's own progress thread (its default) on top of the Python polling loops on both sides
# makes 4 spinning threads on this 2-core machine; off by default here, NIXL_BENCH_PROG_THREAD=1 to
# measure it with the thread.
PROG_THREAD = os.environ.get("NIXL_BENCH_PROG_THREAD", "0") == "1"
PING_SLOT = 64  # bytes at the end of each side's buffer for the round trip


def import_nixl():  # type: ignore[no-untyped-def]
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12 import nixl_agent, nixl_agent_config  # the wheel's own module name
    return nixl_agent, nixl_agent_config


def make_agent(name: str, prog_thread: bool):  # type: ignore[no-untyped-def]
    nixl_agent, nixl_agent_config = import_nixl()
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"]))


def wait_done(agent, handle, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        st = agent.check_xfer_state(handle)
        if st == "DONE":
            return
        if st == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if time.monotonic() > deadline:
            raise TimeoutError("NIXL transfer did not finish")


def wait_notif(agent, want: bytes, handle, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Polls for the notification ``want`` and, meanwhile, our own ``handle``: with NIXL 1.5.1 a
    write and its notification only move while the sender polls its state."""
    deadline = time.monotonic() + timeout
    mine_done = False
    while True:
        if not mine_done:
            st = agent.check_xfer_state(handle)
            if st == "ERR":
                raise RuntimeError("NIXL transfer failed")
            mine_done = st == "DONE"
        for msgs in agent.get_new_notifs().values():
            if want in msgs:
                if not mine_done:
                    wait_done(agent, handle)
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {want!r} notification")


def target(args) -> int:  # type: ignore[no-untyped-def]
    agent = make_agent("target", PROG_THREAD)
    region = max(c.sizes_of(args)) * args.window
    dst = c.buffer(region + PING_SLOT)
    dst.fill(0)  # touched before any timing, as aiote bench's serving side fills its regions
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    print("META " + agent.get_agent_metadata().hex(), flush=True)
    print("INFO " + json.dumps({"dst": dst.ctypes.data, "ping": dst.ctypes.data + region}), flush=True)
    peer = json.loads(sys.stdin.readline())
    name = agent.add_remote_agent(bytes.fromhex(peer["meta"]))
    pong = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([(dst.ctypes.data + region + 8, 8, 0)], "DRAM"),
        agent.get_xfer_descs([(peer["pong"], 8, 0)], "DRAM"),
        name,
        b"pong",
    )
    # No progress thread: this loop drives UCX (incoming tcp writes need it) and serves the round
    # trips, until the initiator closes our stdin.
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        for msgs in agent.get_new_notifs().values():
            for m in msgs:
                if m == b"ping":
                    # transfer()'s own default b"" would drop the notification given at creation
                    if agent.transfer(pong, b"pong") == "ERR":
                        raise RuntimeError("pong failed")
                    wait_done(agent, pong)  # the sender's polling moves it (and its notification)
    sys.stdout.flush()
    os._exit(0)


def throughput(agent, remote: str, dst: int, size: int, args) -> list[float]:  # type: ignore[no-untyped-def]
    window = args.window
    src = c.buffer(size * window)
    src.fill(7)
    reg = agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [(src.ctypes.data + i * size, size, 0) for i in range(window)], "DRAM"
    )
    far = agent.prep_xfer_dlist(remote, [(dst + i * size, size, 0) for i in range(window)], "DRAM")
    handles = [agent.make_prepped_xfer("WRITE", local, [i], far, [i]) for i in range(window)]

    def run(n: int) -> float:
        posted = 0
        busy = []
        t0 = time.perf_counter()
        for h in handles[: min(window, n)]:
            if agent.transfer(h) == "ERR":
                raise RuntimeError("NIXL post failed")
            posted += 1
            busy.append(h)
        while busy:
            still = []
            for h in busy:
                st = agent.check_xfer_state(h)
                if st == "PROC":
                    still.append(h)
                elif st == "ERR":
                    raise RuntimeError("NIXL transfer failed")
                elif posted < n:
                    if agent.transfer(h) == "ERR":
                        raise RuntimeError("NIXL post failed")
                    posted += 1
                    still.append(h)
            busy = still
        return time.perf_counter() - t0

    run(window)  # warm-up: every slot once
    n = max(window, args.total // size)
    out = [n * size / run(n) / 1e9 for _ in range(args.repeats)]
    for h in handles:
        agent.release_xfer_handle(h)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(far)
    agent.deregister_memory(reg)
    return out


def initiator(args) -> int:  # type: ignore[no-untyped-def]
    path = args.path
    agent = make_agent("initiator", PROG_THREAD)
    proc = c.spawn_self(os.path.abspath(__file__), args)
    try:
        meta = bytes.fromhex(c.read_line(proc, "META ", 120))
        info = json.loads(c.read_line(proc, "INFO ", 60))
        remote = agent.add_remote_agent(meta)
        mine = np.zeros(PING_SLOT, np.uint8)
        agent.register_memory([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM")
        assert proc.stdin is not None
        proc.stdin.write(
            json.dumps({"meta": agent.get_agent_metadata().hex(), "pong": mine.ctypes.data}) + "\n"
        )
        proc.stdin.flush()
        for size in c.sizes_of(args):
            runs = throughput(agent, remote, info["dst"], size, args)
            c.write_record(LIB, path, size, args.window, runs, env=ENVS[path])
        if not args.no_rtt:
            ping = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(mine.ctypes.data, 8, 0)], "DRAM"),
                agent.get_xfer_descs([(info["ping"], 8, 0)], "DRAM"),
                remote,
                b"ping",
            )
            rtts = []
            for i in range(args.iters + 50):  # 50 warm-up round trips
                t0 = time.perf_counter()
                if agent.transfer(ping, b"ping") == "ERR":
                    raise RuntimeError("ping failed")
                wait_notif(agent, b"pong", ping)
                if i >= 50:
                    rtts.append(time.perf_counter() - t0)
            c.rtt_record(LIB, path, rtts, env=ENVS[path], what="8 B WRITE + notification, each way")
    finally:
        c.finish(proc)
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str]) -> int:
    args = c.parser(__doc__.splitlines()[0]).parse_args(argv)
    try:
        import_nixl()
    except ImportError:
        return c.skipped(LIB)
    if args.role == "target":
        return target(args)
    paths = c.paths_of(args, PATHS)
    if len(paths) > 1 or os.environ.get("AIOTE_PEERS_PATH") != paths[0]:
        return c.run_each_path(
            os.path.abspath(__file__), argv, paths, {p: {**ENVS[p], "AIOTE_PEERS_PATH": p} for p in paths}
        )
    return initiator(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
