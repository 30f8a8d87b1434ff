"""``aiote bench --observe``: what observability costs, with every setting on the same two
engines. The settings (:data:`aiote.cli._observe.VARIANTS`: off, metrics, metrics and tracing,
a span for every operation) run in blocks, one block of each in turn per repeat (the order
rotating from repeat to repeat), the engines switched to the block's setting before it
(``Engine._observe_as``, with nothing in flight), so that the settings differ by nothing but
the observation code and a block of one setting sits between blocks of the others:

- ``write``: blocks of ``--total`` bytes written (the measuring side switched; the serving
  side only receives);
- ``imm-latency``: blocks of ``--iters`` round trips, both sides switched in step (the serving
  side knows the blocks' order and size, and switches before each block's first ping);
- another mode: one whole case per block, both sides switched.

Each block gives its figures (GB/s and the loop thread's CPU per GB; one-way p50 and p99 and
the loop thread's CPU per round trip); each setting's paired ratio or difference to "off" is
taken within a repeat, and its median and interquartile range over the repeats are printed."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import aiote
from aiote._spawn import child_env, python_module
from aiote.testing import ready_line, stop_process

from . import _benchout, _observe
from ._benchnet import READY, Remote, bench_buffer, bench_same_host, tuning
from ._benchpy import CPU_WRITER_MAIN, Case, _percentiles, lane_batches, lanes_of, pings, py_case
from .bench import LATENCY, _cases, _machine, _split

__all__ = ["main"]

DEFAULT_MODES = "write,imm-latency"
BLOCK_WARM = 20  # round trips (or one submission per batch) before a block's timed part

Runs = dict[tuple[Case, int], dict[str, dict[int, float]]]


async def _serving(args: argparse.Namespace, stack: AsyncExitStack) -> bytes:
    """The serving process, kept for the whole run (stopped by ``stack``): its address."""
    provider = _split(args.provider)[0]
    cmd = python_module("aiote", "bench", "--listen", "--once", "--provider", provider,
                        "--max-message", str(args.max_message))
    if args.streams is not None:
        cmd += ["--streams", str(args.streams)]
    proc = await anyio.open_process(cmd, stdin=None, stderr=None, env=child_env())
    stack.push_async_callback(stop_process, proc)
    return bytes.fromhex((await ready_line(proc, READY, 60)).split()[1])


async def _side(args: argparse.Namespace, address: bytes, stack: AsyncExitStack) -> Remote:
    """The measuring engine of this process and its serving side at ``address``, kept for the
    whole run (closed by ``stack``)."""
    provider = _split(args.provider)[0]
    e = await stack.enter_async_context(aiote.open_engine(
        provider, same_host=bench_same_host(provider), max_message_size=args.max_message,
        **tuning(args.low_latency, args.streams),
    ))
    remote = Remote(e, address)

    async def leave() -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await remote.call(10, op="exit", stop=True)

    stack.push_async_callback(leave)
    return remote


def _order(repeats: int) -> list[str]:
    """The settings of the blocks in turn: one of each per repeat, rotated by the repeat."""
    v, n = _observe.VARIANTS, len(_observe.VARIANTS)
    return [v[(rep + j) % n] for rep in range(repeats) for j in range(n)]


class _Blocks:
    """One run's blocks: where their figures go ({(case, key): {setting: {repeat: figure}}})
    and the setting each block is observed with (one :class:`aiote.Observability` per setting,
    made once: the engines keep an observer per object)."""

    def __init__(self, side: Remote, order: list[str]) -> None:
        self.side = side
        self.order = order
        self.settings = {s: _observe.variant(s) for s in _observe.VARIANTS}
        self.runs: Runs = {}

    def enter(self, j: int) -> None:
        """Block ``j`` starts: the measuring engine switched to its setting."""
        self.side.engine._observe_as(self.settings[self.order[j]])

    def put(self, case: Case, j: int, figures: dict[int, float]) -> None:
        """The figures of block ``j`` of ``case``."""
        s, rep = self.order[j], j // len(_observe.VARIANTS)
        for k, v in figures.items():
            self.runs.setdefault((case, k), {name: {} for name in _observe.VARIANTS})[s][rep] = v


async def _write_blocks(blocks: _Blocks, args: argparse.Namespace, case: Case) -> None:
    """Writes of ``case`` (as ``aiote bench write``: up to 4 batches re-submitted at once, an
    immediate with each write), ``--total`` bytes per block: GB/s and loop CPU s/GB."""
    _, size, window = case
    remote = blocks.side
    e = remote.engine
    lanes, per = lanes_of(window)
    region = size * lanes * per
    mr = await e.register(bench_buffer(region))
    try:
        d = await remote.register("write-dst", region)
        await e.connect(d, timeout=60)
        batches = lane_batches(e, "write", mr, d, size, lanes, per)
        rounds = max(1, args.total // region)

        async def lane_run(b: aiote.TransferBatch) -> None:
            for _ in range(rounds):
                await b.submit(timeout=120)

        for j in range(len(blocks.order)):
            blocks.enter(j)
            for b in batches:
                await b.submit(timeout=120)  # (warm)
            m0, t0 = time.thread_time(), time.perf_counter()
            async with anyio.create_task_group() as tg:
                for b in batches:
                    tg.start_soon(lane_run, b)
            dt = time.perf_counter() - t0
            gb = rounds * region / 1e9
            blocks.put(case, j, {size: gb / dt, CPU_WRITER_MAIN: (time.thread_time() - m0) / gb})
        await remote.wait(2, len(blocks.order) * (rounds + 1) * lanes * per)
    finally:
        await e.unregister(mr)


async def _imm_blocks(blocks: _Blocks, args: argparse.Namespace, case: Case) -> None:
    """A WriteImm ping-pong (as ``aiote bench imm-latency``), ``--iters`` round trips per block,
    both sides switched in step: one-way p50 and p99 (µs) and loop CPU per round trip."""
    remote = blocks.side
    e = remote.engine
    mine = await e.register(np.zeros(64, np.uint8))
    try:
        theirs = await remote.register("pp", 64)
        pong = e.imm_counter(5)
        per = args.iters + BLOCK_WARM
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: remote.call(
                600, op="observe-pong", remote=bytes(mine.descriptor).hex(), ping=4, pong=5, per=per,
                order=blocks.order,
            ))
            for j in range(len(blocks.order)):
                blocks.enter(j)
                await pings(e, theirs, pong, BLOCK_WARM)
                c0 = time.thread_time()
                rtts = await pings(e, theirs, pong, args.iters)
                cpu = (time.thread_time() - c0) / args.iters * 1e6
                blocks.put(case, j, {**_percentiles(rtts), CPU_WRITER_MAIN: cpu})
    finally:
        await e.unregister(mine)


async def _case_blocks(blocks: _Blocks, args: argparse.Namespace, case: Case) -> None:
    """Another mode: one whole case per block, both sides switched to its setting."""
    for j, s in enumerate(blocks.order):
        blocks.enter(j)
        await blocks.side.call(op="observe", setting=s)
        await blocks.side.call(op="hello")  # (the serving side forgets the last case's regions)
        figures = await py_case(blocks.side, args, case)
        blocks.put(case, j, {k: v for k, v in figures.items() if k >= 0 or k == CPU_WRITER_MAIN})


async def _run(args: argparse.Namespace, cases: list[Case], progress: _benchout.Progress) -> Runs:
    """Every case in blocks of every setting, ``args.repeats`` blocks of each."""
    async with AsyncExitStack() as stack:
        side = await _side(args, await _serving(args, stack), stack)
        blocks = _Blocks(side, _order(args.repeats))
        for case in cases:
            progress.step(f"{case[0]} {case[1] or ''}".strip())
            await side.call(op="observe", setting="off")
            await side.call(op="hello")
            if case[0] == "write":
                await _write_blocks(blocks, args, case)
            elif case[0] == "imm-latency":
                await _imm_blocks(blocks, args, case)
            else:
                await _case_blocks(blocks, args, case)
            progress.advance()
        side.engine._observe_as(None)
    return blocks.runs


def _iqr(xs: list[float]) -> list[float]:
    """[first quartile, third quartile] of ``xs`` (both the value itself for one)."""
    return statistics.quantiles(xs, n=4)[::2] if len(xs) > 1 else [xs[0], xs[0]]


def _row(case: Case, k: int, runs: dict[str, dict[int, float]], repeats: int) -> dict[str, Any]:
    """One case's figures per setting (median, range, every repeat's) and each setting's ratio
    and, where lower is better, difference to "off" within a repeat (median, interquartile
    range, full range)."""
    mode, _, window = case
    cpu = k == CPU_WRITER_MAIN  # the event loop thread's CPU: s per GB (write), µs per round trip
    latency = mode in LATENCY or cpu  # (lower is better: the difference is shown)
    row: dict[str, Any] = {"mode": mode, "size": k, "window": window or None}
    row["unit"] = ("us/rtt" if mode in LATENCY else "s/GB") if cpu else ("us" if latency else "GB/s")
    off = runs["off"]
    for s in _observe.VARIANTS:
        vals = [runs[s][i] for i in range(repeats) if i in runs[s]]
        if not vals:
            row[s] = None
            continue
        row[s] = {"median": statistics.median(vals), "range": [min(vals), max(vals)], "runs": vals}
        if s == "off":
            continue
        ratios = [runs[s][i] / off[i] for i in range(repeats) if i in runs[s] and off.get(i)]
        row[s]["ratio"] = statistics.median(ratios) if ratios else None
        row[s]["ratio_iqr"] = _iqr(ratios) if ratios else None
        row[s]["ratio_range"] = [min(ratios), max(ratios)] if ratios else None
        if latency:
            added = [runs[s][i] - off[i] for i in range(repeats) if i in runs[s] and i in off]
            row[s]["added"] = statistics.median(added) if added else None
            row[s]["added_iqr"] = _iqr(added) if added else None
            row[s]["added_range"] = [min(added), max(added)] if added else None
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    sys.stderr.write(f"\n{'case':34} {'setting':12} {'median':>9} {'range':>17} "
                     f"{'vs off, paired: median (interquartile range)':>46}\n")
    for r in rows:
        if r["size"] == CPU_WRITER_MAIN:
            label = f"{r['mode']} loop CPU ({r['unit']})"
        else:
            label = _benchout.row_label({**r, "mode": r["mode"], "size": r["size"], "window": r["window"]})
        for s in _observe.VARIANTS:
            f = r[s]
            if f is None:
                continue
            rng = f"{f['range'][0]:.2f}-{f['range'][1]:.2f}"
            if s == "off":
                vs = ""
            elif r["unit"] != "GB/s":
                lo, hi = f["added_iqr"]
                vs = f"{f['added']:+.3g} ({lo:+.3g}..{hi:+.3g}) x{f['ratio']:.3f}"
            else:
                lo, hi = f["ratio_iqr"]
                vs = f"x{f['ratio']:.3f} ({lo:.3f}-{hi:.3f})"
            sys.stderr.write(f"{label:34} {s:12} {f['median']:9.2f} {rng:>17} {vs:>46}\n")


def main(args: argparse.Namespace) -> int:
    """Runs ``aiote bench --observe``; prints the table on stderr and the JSON on stdout (and
    writes it to ``--json FILE`` when given)."""
    if args.mode == "all":
        args.mode = DEFAULT_MODES
    cases = _cases(args, [int(w) for w in _split(args.window)])
    _observe.variant("tracing")  # the packages, checked before anything runs
    progress = _benchout.Progress(len(cases))
    try:
        runs = anyio.run(_run, args, cases, progress, backend=_split(args.loop)[0])
    finally:
        progress.close()
    rows = [_row(case, k, per, args.repeats) for (case, k), per in runs.items()]
    _print(rows)
    result = {"observe": True, "provider": args.provider, "loop": args.loop, "repeats": args.repeats,
              "aiote": aiote.__version__, "machine": _machine(), "date": time.strftime("%Y-%m-%d"),
              "rows": rows}
    print(json.dumps(result))
    if getattr(args, "json_file", None):
        Path(args.json_file).write_text(json.dumps(result, indent=2))
    return 0
