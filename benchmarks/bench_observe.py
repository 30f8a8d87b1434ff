"""What observability costs per operation, measured finely interleaved in one process.

Four engines, one per setting (``off``; ``metrics``; ``tracing``: metrics and spans for the
operations inside a sampled span, none here; ``tracing-all``: a span for every operation),
each writing to a peer engine of its own in this process, all open for the whole run. A round
runs a block of operations on each setting in turn (the order rotating each round); the
figures are the medians over the rounds of each block's event-loop CPU per operation
(``time.thread_time``) and wall time per operation, and of the paired differences from
``off`` in the same round. Fine interleaving keeps a shared machine's drift out of the pairs,
which ``aiote bench --observe`` (whole cases, seconds apart) cannot on a busy machine.

Cases: an awaited ``write_imm`` (the latency path: one operation per round trip to the
poller), and a ``TransferBatch`` of 16 writes of 64 KiB submitted again and again (the
throughput path of ``aiote bench write``: one operation per MiB), tcp over loopback.

    python benchmarks/bench_observe.py [--rounds 60] [--ops 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np

import aiote
from aiote.cli import _observe

SETTINGS = _observe.VARIANTS  # off, metrics, tracing, tracing-all


async def _cases(stack: AsyncExitStack, setting: str) -> dict[str, Callable[[], Awaitable[None]]]:
    """The operations of one setting's engine: {case: one operation}."""
    a = await stack.enter_async_context(aiote.open_engine(observe=_observe.variant(setting), same_host=None))
    b = await stack.enter_async_context(aiote.open_engine(same_host=None))
    dst = await b.register(np.zeros(16 << 16, np.uint8))
    src = await a.register(np.ones(16 << 16, np.uint8))
    await a.connect(dst.descriptor, timeout=30)
    batch = a.batch()
    for k in range(16):
        batch.write(src, dst.descriptor, length=1 << 16, src_offset=k << 16, dst_offset=k << 16)
    d = dst.descriptor

    async def write_imm() -> None:
        await a.write_imm(d, 1)

    async def write_batch() -> None:
        await batch.submit(timeout=60)

    return {"write_imm": write_imm, "batch 16 x 64 KiB": write_batch}


async def run(rounds: int, ops: int) -> dict[str, Any]:
    cpu: dict[tuple[str, str], list[float]] = {}
    wall: dict[tuple[str, str], list[float]] = {}
    async with AsyncExitStack() as stack:
        cases = {s: await _cases(stack, s) for s in SETTINGS}
        for r in range(rounds):
            order = SETTINGS[r % len(SETTINGS):] + SETTINGS[: r % len(SETTINGS)]
            for name in cases[SETTINGS[0]]:
                n = ops if name == "write_imm" else max(1, ops // 10)
                for s in order:
                    op = cases[s][name]
                    await op()  # (warm)
                    c0, w0 = time.thread_time(), time.perf_counter()
                    for _ in range(n):
                        await op()
                    cpu.setdefault((name, s), []).append((time.thread_time() - c0) / n * 1e6)
                    wall.setdefault((name, s), []).append((time.perf_counter() - w0) / n * 1e6)
    rows = []
    for name in cases[SETTINGS[0]]:
        for s in SETTINGS:
            row: dict[str, Any] = {"case": name, "setting": s}
            for what, figures in (("cpu_us", cpu), ("wall_us", wall)):
                mine, off = figures[(name, s)], figures[(name, "off")]
                added = [x - y for x, y in zip(mine, off, strict=True)]
                row[what] = statistics.median(mine)
                row[f"{what}_added"] = statistics.median(added)
                row[f"{what}_added_iqr"] = statistics.quantiles(added, n=4)[::2]
            rows.append(row)
    return {"rounds": rounds, "ops": ops, "python": platform.python_version(),
            "platform": platform.platform(), "aiote": aiote.__version__, "date": time.strftime("%Y-%m-%d"),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--ops", type=int, default=200, help="write_imm per block (batches: a tenth)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args()
    result = anyio.run(run, args.rounds, args.ops, backend=args.backend)
    result["backend"] = args.backend
    sys.stderr.write(f"\n{'case':20} {'setting':12} {'loop CPU us/op':>15} {'added (IQR)':>24} "
                     f"{'wall us/op':>11} {'added (IQR)':>24}\n")
    for r in result["rows"]:
        c, w = r["cpu_us_added_iqr"], r["wall_us_added_iqr"]
        sys.stderr.write(f"{r['case']:20} {r['setting']:12} {r['cpu_us']:15.2f} "
                         f"{r['cpu_us_added']:+8.2f} ({c[0]:+.2f}..{c[1]:+.2f}) {r['wall_us']:11.2f} "
                         f"{r['wall_us_added']:+8.2f} ({w[0]:+.2f}..{w[1]:+.2f})\n")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
