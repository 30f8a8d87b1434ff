"""What the observed path adds per operation, in isolation: no transport, no event loop. An engine
per setting (``off``, ``metrics``, ``tracing``: metrics and ``spans="traced"`` with the
OpenTelemetry SDK's provider and no current span) runs a stub operation through its real doors,
each coroutine driven to its end by hand: the awaited door (``_attempts``, what
``write``/``write_imm``/``read`` go through), the door of a kept request (``_memo_post``: a
repeated ``write``/``write_imm``, observed without a record), the in-place door of a batch
(observed without a record as well) and the posted door (``_start``, the group's tap, its
completion). The stub begins one completed group of a one-row table the way ``_begin`` does
(``_GROUPS.get()`` and its ``append``), so each observed operation is recorded and summed up
exactly as a real one. The figure is the best of ``--repeats`` timings of ``--ops`` operations,
in ns per operation, and each setting's excess over ``off``.

    python benchmarks/bench_observe_micro.py [--ops 100000] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

import aiote
from aiote._core._optable import _Op
from aiote._core._records import _GROUPS
from aiote.cli import _observe

SETTINGS = ("off", "metrics", "tracing")
_ROW = np.dtype([("length", "<u8"), ("rail", "<u4"), ("direct", "u1")])


def _stub_op() -> tuple[_Op, Callable[[Any], Any]]:
    """A completed group of a one-row table of 64 KiB, and an ``attempt`` that begins it."""
    table = np.zeros(1, _ROW)
    table["length"] = 1 << 16
    op = _Op((None, table), None)
    op.done = True

    async def attempt(t: float | None) -> None:
        groups = _GROUPS.get()
        if groups is not None:
            groups.append(op)

    return op, attempt


def _drive(coro: Any) -> None:
    try:
        coro.send(None)
    except StopIteration:
        return
    raise RuntimeError("the stub operation suspended")


def _awaited(eng: Any, n: int) -> float:
    _, attempt = _stub_op()
    doors = eng._attempts
    t0 = time.perf_counter_ns()
    for _ in range(n):
        _drive(doors(attempt, None, None, "write_imm"))
    return (time.perf_counter_ns() - t0) / n


def _kept(eng: Any, n: int) -> float:
    op, attempt = _stub_op()
    table = op.refs[1]
    t0 = time.perf_counter_ns()
    for _ in range(n):  # what _memo_post does (a kept write or write_imm request)
        obs = eng._obs
        if obs is not None and obs._plain():
            _drive(eng._observed_kept(obs, table, attempt, None, None, "write_imm"))
        else:
            _drive(eng._attempts(attempt, None, None, "write_imm"))
    return (time.perf_counter_ns() - t0) / n


def _in_place(eng: Any, n: int) -> float:
    op, _ = _stub_op()
    table = op.refs[1]
    obs = eng._obs
    t0 = time.perf_counter_ns()
    for _ in range(n):  # what TransferBatch.submit does around its inline first attempt
        rec = token = None
        t = 0
        if obs is not None:
            if obs._plain():
                t = obs._kept_start()
            else:
                rec, token = obs._enter("batch of 16")
        groups = _GROUPS.get()
        if groups is not None:
            groups.append(op)
        if rec is not None:
            rec.obs._leave(rec, token, None)
        elif obs is not None:
            obs._kept_end(table, "batch of 16", t, None, None)
    return (time.perf_counter_ns() - t0) / n


def _posted(eng: Any, n: int) -> float:
    op, _ = _stub_op()
    obs = eng._obs
    t0 = time.perf_counter_ns()
    for _ in range(n):  # what post_write does, and _drain at the completion
        rec = None if obs is None else obs._start("write")
        if rec is not None:
            rec.tap(op)
        op.obs = rec
        if op.obs is not None:
            op.obs.done(op)
    return (time.perf_counter_ns() - t0) / n


DOORS = {
    "awaited (write, write_imm)": _awaited, "kept request (repeated write, write_imm)": _kept,
    "in place (batch)": _in_place, "posted (post_write)": _posted,
}


def _observe_of(setting: str) -> aiote.Observability | None:
    if setting != "tracing":
        return _observe.variant(setting)
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    return aiote.Observability(registry=CollectorRegistry(), tracer_provider=TracerProvider())


async def run(ops: int, repeats: int) -> dict[str, Any]:
    best: dict[tuple[str, str], float] = {}
    engines = {}
    for s in SETTINGS:
        engines[s] = await aiote.open_engine(observe=_observe_of(s), same_host=None).__aenter__()
    try:
        for _ in range(repeats):
            for door, fn in DOORS.items():
                for s in SETTINGS:
                    ns = fn(engines[s], ops)
                    best[(door, s)] = min(best.get((door, s), ns), ns)
    finally:
        for e in engines.values():
            await e.aclose()
    rows = [{"door": d, "setting": s, "ns": best[(d, s)], "added_ns": best[(d, s)] - best[(d, "off")]}
            for d in DOORS for s in SETTINGS]
    return {"ops": ops, "repeats": repeats, "python": platform.python_version(),
            "platform": platform.platform(), "aiote": aiote.__version__, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", dest="json_file")
    args = ap.parse_args()
    result = anyio.run(run, args.ops, args.repeats)
    sys.stderr.write(f"\n{'door':42} {'setting':9} {'ns/op':>8} {'added':>8}\n")
    for r in result["rows"]:
        sys.stderr.write(f"{r['door']:42} {r['setting']:9} {r['ns']:8.0f} {r['added_ns']:+8.0f}\n")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
