"""``aiote bench``'s Python cases: each mode as aiote measures it, one case at a time
(:func:`py_case`), against the serving side's :class:`~aiote.cli._benchnet.Remote`. The
sweep, the C core's arguments for the same case and the result rows are :mod:`aiote.cli.bench`'s;
``--observe``'s blocks (:mod:`aiote.cli._benchobs`) build on these too."""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import aiote

from ._benchnet import BULK, ECHO, Remote, bench_array, bench_buffer

__all__ = [
    "CPU_WRITER",
    "CPU_WRITER_MAIN",
    "TRANSFERS",
    "Case",
    "lane_batches",
    "lanes_of",
    "pings",
    "py_case",
]

WARM = 1000  # latency: warm-up round trips, not counted (the C bench's pingpong warms up as long)
TRANSFERS = ("write", "read")  # one-sided transfer modes (the ones --arena applies to)
# writes: besides GB/s (keyed by size), the writer's CPU seconds per GB of the timed part, under
# these keys of a run's figures: the whole writing process, and the thread that posts and
# drains (aiote: the event loop's; the C core: its main thread), without the poller threads
CPU_WRITER, CPU_WRITER_MAIN = -1, -2
Case = tuple[str, int, int]  # mode, size (0 for latency), window (0 where it does not apply)


def lanes_of(window: int) -> tuple[int, int]:
    """How write and read keep ``window`` in flight: (batches, transfers per batch), each batch
    submitted again as soon as it completes; the C core's run is driven the same way."""
    lanes = min(4, window)
    return lanes, max(1, window // lanes)


def lane_batches(
    e: aiote.Engine, op: str, mr: aiote.MemoryRegion, d: aiote.MemoryDescriptor, size: int, lanes: int,
    per: int,
) -> list[aiote.TransferBatch]:
    """The ``lanes`` batches of ``per`` transfers of ``size`` each (``op``: "write", each with
    the immediate 2, or "read") that keep a window in flight (:func:`lanes_of`), over
    consecutive slots of ``mr`` and ``d``."""
    batches = []
    for lane in range(lanes):
        b = e.batch()
        for k in range(per):
            off = (lane * per + k) * size
            if op == "write":
                b.write(mr, d, length=size, src_offset=off, dst_offset=off, imm=2)
            else:
                b.read(mr, d, length=size, src_offset=off, dst_offset=off)
        batches.append(b)
    return batches


async def pings(
    e: aiote.Engine, theirs: aiote.MemoryDescriptor, pong: aiote.ImmCounter, n: int
) -> list[float]:
    """``n`` WriteImm round trips (imm 4 out, one credit of ``pong`` back): each one's seconds."""
    rtts = [0.0] * n
    for i in range(n):
        t0 = time.perf_counter()
        await e.write_imm(theirs, 4)
        await pong.wait(1, timeout=30)
        rtts[i] = time.perf_counter() - t0
    return rtts


async def py_transfer(
    remote: Remote, op: str, size: int, total: int, window: int, arena: bool = False,
    cpu: dict[int, float] | None = None,
) -> float:
    """GB/s of one-sided ``op`` ("write" with an immediate, or "read") of ``size``, ``window``
    in flight (up to 4 reusable batches submitted concurrently); ``arena``: both sides' buffers
    from their engines' ``alloc_host``. ``cpu``: receives this process's and the event loop
    thread's CPU seconds per GB over the timed part (keys CPU_WRITER, CPU_WRITER_MAIN)."""
    e = remote.engine
    lanes, per = lanes_of(window)
    region = size * lanes * per
    local = bench_array(e, region, arena, "this side")
    local.fill(7)
    mr = await e.register(local, remote_write=op == "read")
    try:
        d = await remote.register(f"{op}-dst", region, arena=arena)
        await e.connect(d, timeout=60)  # every stream's connection, as the C bench connects first
        batches = lane_batches(e, op, mr, d, size, lanes, per)
        rounds = max(1, total // (size * lanes * per))
        for b in batches:  # warm-up
            await b.submit(timeout=120)
        if op == "write":
            await remote.wait(2, lanes * per)

        async def lane_run(b: aiote.TransferBatch) -> None:
            for _ in range(rounds):
                await b.submit(timeout=120)

        c0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for b in batches:
                tg.start_soon(lane_run, b)
        dt = time.perf_counter() - t0
        gb = rounds * lanes * per * size / 1e9
        if cpu is not None:
            cpu[CPU_WRITER] = (time.process_time() - c0) / gb
            cpu[CPU_WRITER_MAIN] = (time.thread_time() - m0) / gb
        if op == "write":
            await remote.wait(2, rounds * lanes * per)
        return gb / dt
    finally:
        await e.unregister(mr)


async def py_sendrecv(remote: Remote, size: int, total: int, window: int) -> float:
    """GB/s of ``size``-byte messages (``Engine.send``) from ``window`` concurrent senders,
    from the first send to the serving side's reply that it received the last one."""
    e, to = remote.engine, remote.address
    payload = bytes([BULK]) + bytes(size - 1)
    n = max(1, total // size)

    async def send_all(count: int) -> None:
        senders = max(1, min(window, count))

        async def one(k: int) -> None:
            for _ in range(k):
                await e.send(to, payload, timeout=120)

        async with anyio.create_task_group() as tg:
            for i in range(senders):
                tg.start_soon(one, count // senders + (i < count % senders))

    warm = min(n, window)
    await send_all(warm)
    await remote.sink(warm)
    t0 = time.perf_counter()
    await send_all(n)
    await remote.sink(n)
    dt = time.perf_counter() - t0
    return n * size / dt / 1e9


async def py_msg_latency(remote: Remote, iters: int) -> dict[int, float]:
    """{50: p50, 99: p99} one-way latency in µs of an 8-byte send/recv ping-pong (RTT / 2)."""
    e, to = remote.engine, remote.address
    msg = bytes([ECHO]) + bytes(7)
    rtts: list[float] = []
    for i in range(iters + WARM):  # warm-up round trips first
        t0 = time.perf_counter()
        await e.send(to, msg, timeout=30)
        while True:
            sender, _ = await e.recv(timeout=30)
            if sender == to:
                break
        if i >= WARM:
            rtts.append(time.perf_counter() - t0)
    return _percentiles(rtts)


def _percentiles(rtts: list[float]) -> dict[int, float]:
    rtts.sort()
    return {50: rtts[len(rtts) // 2] / 2 * 1e6, 99: rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] / 2 * 1e6}


async def py_paged(remote: Remote, page: int, npages: int, calls: int) -> float:
    """GB/s of ``calls`` paged writes of ``npages`` pages (permuted destinations), one awaited
    at a time."""
    e = remote.engine
    src = bench_buffer(page * npages)
    src.fill(5)
    mr = await e.register(src, remote_write=False)
    try:
        d = await remote.register("pdst", page * npages)
        perm = np.random.default_rng(1).permutation(npages)
        await e.write_paged(mr, d, page_size=page, src_pages=np.arange(npages), dst_pages=perm, imm=3)
        t0 = time.perf_counter()
        for _ in range(calls):
            await e.write_paged(mr, d, page_size=page, src_pages=np.arange(npages), dst_pages=perm, imm=3)
        dt = time.perf_counter() - t0
        await remote.wait(3, npages * (calls + 1))
        return page * npages * calls / dt / 1e9
    finally:
        await e.unregister(mr)


async def py_imm_latency(remote: Remote, iters: int) -> dict[int, float]:
    """{50: p50, 99: p99} one-way latency in µs of a WriteImm ping-pong (RTT / 2), and under
    CPU_WRITER_MAIN the event-loop thread's CPU µs per round trip."""
    e = remote.engine
    mine = await e.register(np.zeros(64, np.uint8))
    try:
        theirs = await remote.register("pp", 64)
        pong = e.imm_counter(5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: remote.call(
                    120, op="pong", remote=bytes(mine.descriptor).hex(), iters=iters + WARM, ping=4, pong=5
                )
            )
            c0 = time.thread_time()
            rtts = (await pings(e, theirs, pong, iters + WARM))[WARM:]  # warm-up round trips first
            cpu = (time.thread_time() - c0) / (iters + WARM) * 1e6
        return {**_percentiles(rtts), CPU_WRITER_MAIN: cpu}
    finally:
        await e.unregister(mine)


async def py_case(remote: Remote, args: argparse.Namespace, case: Case) -> dict[int, float]:
    """One Python measurement: {size: GB/s} for throughput, {percentile: µs} for latency."""
    mode, size, window = case
    if mode in TRANSFERS:
        cpu: dict[int, float] = {}
        gbps = await py_transfer(remote, mode, size, args.total, window, args.arena,
                                 cpu if mode == "write" else None)
        return {size: gbps, **cpu}
    if mode == "sendrecv":
        return {size: await py_sendrecv(remote, size, args.total, window)}
    if mode == "paged":
        return {size: await py_paged(remote, size, args.pages, args.calls)}
    if mode == "imm-latency":
        return await py_imm_latency(remote, args.iters)
    return await py_msg_latency(remote, args.iters)
