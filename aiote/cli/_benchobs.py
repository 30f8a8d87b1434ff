"""``aiote bench --observe``: what observability costs. Each Python case of ``aiote bench``
(``write`` and ``imm-latency`` by default) runs with observability off, with metrics, with
metrics and tracing, and with a span for every operation (:data:`aiote.cli._observe.VARIANTS`),
in turn within every repeat (the order rotating from repeat to repeat), each setting's engine
against a serving process of its own observed the same way (all of them opened once, for the
whole run); the ratio of each setting to "off" is taken within a repeat, and its median and
range over the repeats are printed (throughput: on / off; latency: on - off, in µs)."""

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

import aiote
from aiote._spawn import child_env, python_module
from aiote.testing import ready_line, stop_process

from . import _benchout, _observe
from ._benchnet import READY, Remote, bench_same_host, tuning
from .bench import CPU_WRITER_MAIN, LATENCY, Case, _cases, _machine, _split, py_case

__all__ = ["main"]

DEFAULT_MODES = "write,imm-latency"


Runs = dict[tuple[Case, int], dict[str, dict[int, float]]]


async def _serving(args: argparse.Namespace, stack: AsyncExitStack) -> dict[str, bytes]:
    """One serving process per setting, observed with it, started at once and kept for the
    whole run (stopped by ``stack``): {setting: its address}."""
    provider = _split(args.provider)[0]
    addresses: dict[str, bytes] = {}

    async def start(setting: str) -> None:
        cmd = python_module("aiote", "bench", "--listen", "--once", "--provider", provider,
                            "--max-message", str(args.max_message), "--observe-setting", setting)
        if args.streams is not None:
            cmd += ["--streams", str(args.streams)]
        proc = await anyio.open_process(cmd, stdin=None, stderr=None, env=child_env())
        stack.push_async_callback(stop_process, proc)
        addresses[setting] = bytes.fromhex((await ready_line(proc, READY, 60)).split()[1])

    async with anyio.create_task_group() as tg:
        for setting in _observe.VARIANTS:
            tg.start_soon(start, setting)
    return addresses


async def _side(args: argparse.Namespace, setting: str, address: bytes, stack: AsyncExitStack) -> Remote:
    """An engine of this process observed with ``setting``, and its serving side at
    ``address``, kept for the whole run (closed by ``stack``)."""
    provider = _split(args.provider)[0]
    e = await stack.enter_async_context(aiote.open_engine(
        provider, same_host=bench_same_host(provider), max_message_size=args.max_message,
        observe=_observe.variant(setting), **tuning(args.low_latency, args.streams),
    ))
    remote = Remote(e, address)

    async def leave() -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await remote.call(10, op="exit", stop=True)

    stack.push_async_callback(leave)
    return remote


async def _run(args: argparse.Namespace, cases: list[Case], progress: _benchout.Progress) -> Runs:
    """Every case with every setting, ``args.repeats`` times, the settings in turn within a
    repeat (the order rotating): {(case, key): {setting: {repeat: figure}}}."""
    runs: Runs = {}
    n = len(_observe.VARIANTS)
    async with AsyncExitStack() as stack:
        addresses = await _serving(args, stack)
        sides = {s: await _side(args, s, addresses[s], stack) for s in _observe.VARIANTS}
        for rep in range(args.repeats):
            for s in [_observe.VARIANTS[(rep + j) % n] for j in range(n)]:
                progress.step(f"{s} (repeat {rep + 1})")
                await sides[s].call(op="hello")  # (the serving side forgets the last repeat's regions)
                for case in cases:
                    for k, v in (await py_case(sides[s], args, case)).items():
                        if k >= 0 or k == CPU_WRITER_MAIN:  # (the loop thread's CPU, not the process's)
                            runs.setdefault((case, k), {name: {} for name in _observe.VARIANTS})[s][rep] = v
                progress.advance()
    return runs


def _row(case: Case, k: int, runs: dict[str, dict[int, float]], repeats: int) -> dict[str, Any]:
    """One case's figures per setting and each setting's ratio to "off" within a repeat."""
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
        row[s]["ratio_range"] = [min(ratios), max(ratios)] if ratios else None
        if latency:
            added = [runs[s][i] - off[i] for i in range(repeats) if i in runs[s] and i in off]
            row[s]["added"] = statistics.median(added) if added else None
            row[s]["added_range"] = [min(added), max(added)] if added else None
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    sys.stderr.write(f"\n{'case':34} {'setting':17} {'median':>9} {'range':>17} {'vs off (paired)':>26}\n")
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
                lo, hi = f["added_range"]
                vs = f"{f['added']:+.3g} ({lo:+.3g}..{hi:+.3g}) x{f['ratio']:.3f}"
            else:
                vs = f"x{f['ratio']:.3f} ({f['ratio_range'][0]:.3f}-{f['ratio_range'][1]:.3f})"
            sys.stderr.write(f"{label:34} {s:17} {f['median']:9.2f} {rng:>17} {vs:>26}\n")


def main(args: argparse.Namespace) -> int:
    """Runs ``aiote bench --observe``; prints the table on stderr and the JSON on stdout (and
    writes it to ``--json FILE`` when given)."""
    if args.mode == "all":
        args.mode = DEFAULT_MODES
    cases = _cases(args, [int(w) for w in _split(args.window)])
    _observe.variant("tracing")  # the packages, checked before anything runs
    progress = _benchout.Progress(args.repeats * len(_observe.VARIANTS))
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
