"""What observability costs per operation, with every setting on the very same engines.

One writing engine and its peer, in this process, open for the whole run. A block of operations
runs with each setting in turn, the writer switched to it between blocks
(``Engine._observe_as``: a private hook, used so that the settings differ by nothing but the
observation code; nothing is in flight between blocks). Settings: ``off``; ``metrics``;
``tracing`` (these operations run outside any trace, so they get no span); ``tracing-all`` (a
span for every operation, through the SDK's batch processor to an exporter that drops them).

Each round runs a block of each setting, the order rotating each round. Per block: the
event-loop CPU per operation (``time.thread_time``), and the p50 of the operations' own wall
times. The figures are the medians over the rounds of each setting's paired difference from
``off`` in the same round (interquartile range in brackets).

Cases: an awaited ``write_imm`` (the latency path: one operation per round trip to the
poller), and a ``TransferBatch`` of 16 writes of 64 KiB submitted again and again (the
throughput path of ``aiote bench write``: one operation per MiB; its ratio is the throughput
kept), tcp over loopback.

    python benchmarks/bench_observe.py [--rounds 60] [--ops 200] [--backend trio] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

import aiote
from aiote.cli import _observe

SETTINGS = _observe.VARIANTS  # off, metrics, tracing, tracing-all


async def run(rounds: int, ops: int) -> dict[str, Any]:
    cpu: dict[tuple[str, str], list[float]] = {}
    p50: dict[tuple[str, str], list[float]] = {}
    async with aiote.open_engine(same_host=None) as a, \
            aiote.open_engine(same_host=None) as b:
        dst = await b.register(np.zeros(16 << 16, np.uint8))
        src = await a.register(np.ones(16 << 16, np.uint8))
        await a.connect(dst.descriptor, timeout=30)
        batch = a.batch()
        for k in range(16):
            batch.write(src, dst.descriptor, length=1 << 16, src_offset=k << 16, dst_offset=k << 16)
        d = dst.descriptor
        settings = {s: _observe.variant(s) for s in SETTINGS}
        cases: dict[str, tuple[Callable[[], Awaitable[None]], int]] = {
            "write_imm": (lambda: a.write_imm(d, 1), ops),
            "batch 16 x 64 KiB": (lambda: batch.submit(timeout=60), max(1, ops // 4)),
        }
        clock = time.perf_counter_ns
        for r in range(rounds):
            order = SETTINGS[r % len(SETTINGS):] + SETTINGS[: r % len(SETTINGS)]
            for name, (op, n) in cases.items():
                for s in order:
                    a._observe_as(settings[s])
                    await op()  # (warm)
                    walls = [0] * n
                    c0 = time.thread_time()
                    for i in range(n):
                        t0 = clock()
                        await op()
                        walls[i] = clock() - t0
                    cpu.setdefault((name, s), []).append((time.thread_time() - c0) / n * 1e6)
                    p50.setdefault((name, s), []).append(statistics.median(walls) / 1e3)
    rows = []
    for name in cases:
        for s in SETTINGS:
            row: dict[str, Any] = {"case": name, "setting": s}
            for what, figures in (("cpu_us", cpu), ("p50_us", p50)):
                mine, off = figures[(name, s)], figures[(name, "off")]
                added = [x - y for x, y in zip(mine, off, strict=True)]
                row[what] = statistics.median(mine)
                row[f"{what}_added"] = statistics.median(added)
                row[f"{what}_added_iqr"] = statistics.quantiles(added, n=4)[::2]
                if what == "p50_us":
                    ratios = [y / x for x, y in zip(mine, off, strict=True)]  # throughput kept
                    row["throughput_ratio"] = statistics.median(ratios)
                    row["throughput_ratio_iqr"] = statistics.quantiles(ratios, n=4)[::2]
            rows.append(row)
    return {"rounds": rounds, "ops": ops, "python": platform.python_version(),
            "platform": platform.platform(), "aiote": aiote.__version__, "date": time.strftime("%Y-%m-%d"),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--ops", type=int, default=200, help="write_imm per block (batches: a quarter)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args()
    result = anyio.run(run, args.rounds, args.ops, backend=args.backend)
    result["backend"] = args.backend
    sys.stderr.write(f"\n{'case':20} {'setting':12} {'loop CPU us/op':>15} {'added (IQR)':>24} "
                     f"{'p50 us':>9} {'added (IQR)':>24} {'throughput kept':>16}\n")
    for r in result["rows"]:
        c, w, t = r["cpu_us_added_iqr"], r["p50_us_added_iqr"], r["throughput_ratio_iqr"]
        sys.stderr.write(f"{r['case']:20} {r['setting']:12} {r['cpu_us']:15.2f} "
                         f"{r['cpu_us_added']:+8.2f} ({c[0]:+.2f}..{c[1]:+.2f}) {r['p50_us']:9.2f} "
                         f"{r['p50_us_added']:+8.2f} ({w[0]:+.2f}..{w[1]:+.2f}) "
                         + (f"x{r['throughput_ratio']:.3f} ({t[0]:.3f}..{t[1]:.3f})"
                            if "batch" in r["case"] else "") + "\n")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
