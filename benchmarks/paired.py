"""Before/after sign-off: `aiote bench` run from two source trees in turn, round by round.

    python benchmarks/paired.py --base ../aiote-before [--rounds 5] [--modes write,imm-latency]
        [--providers tcp,shm] [--sizes 64KiB,1MiB,16MiB] [--json out.json]

Each round runs ``python -m aiote bench MODES --provider P --repeats 1`` once with this
tree's aiote and once with the base tree's (the order alternates from round to round, so a
drift of the machine's load falls on both), each tree built and installed into a temporary
folder beforehand (``pip install --target``, pip's isolated build). Each run also measures
the C core alone, as ``aiote bench`` always does. Prints, per case, the median of each tree's figure over the
rounds, the ratio new/base (throughput: >1 is faster; latency: <1 is faster) as the median of
the per-round ratios with its range, and aiote's ratio to the C core in each tree: a drift of
the machine shows in the C core's figures too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def build(tree: Path, into: Path) -> Path:
    """``tree``'s aiote built and installed into ``into`` (pip's isolated build, so the
    build requirements of the tree's pyproject.toml apply, not this virtualenv's setuptools);
    returns ``into``, the tree's PYTHONPATH entry. Its C bench is built from its cdeps/ when
    ``aiote bench`` first needs it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(into),
         str(tree)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return into


def bench(tree: Path, site: Path, args: argparse.Namespace, provider: str) -> list[dict[str, Any]]:
    """One `aiote bench` run of ``tree``'s aiote (installed in ``site``); its result rows."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("FI_PROVIDER", "tcp,ofi_rxm,shm")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.json"
        cmd = [
            sys.executable, "-P", "-m", "aiote", "bench", args.modes, "--provider", provider,
            "--sizes", args.sizes, "--repeats", "1", "--iters", str(args.iters), "--json", str(out),
        ]
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
        return rows


def _latency() -> dict[str, str]:
    """The latency modes (rows in µs, lower is better) and their labels, as ``aiote bench``
    names them; imported once the trees are built (aiote needs its extension)."""
    from aiote.cli._benchout import LATENCY_LABEL

    return LATENCY_LABEL


def key(row: dict[str, Any]) -> str:
    if row["mode"] in _latency():
        what = _latency()[row["mode"]]
        return f"{row['provider']} {what} one-way {'p50' if row['size'] == 50 else 'p99'} (us)"
    size = row["size"]
    human = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    return f"{row['provider']} {row['mode']} {human} (GB/s)"


def value(row: dict[str, Any], who: str) -> float:
    unit = "us" if row["mode"] in _latency() else "gbps"
    v = row.get(f"{who}_{unit}")
    if v is None and unit == "us":
        v = row.get(f"{who}_gbps")  # older trees kept microseconds there
    return float(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other source tree (before the change)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="write,imm-latency")
    ap.add_argument("--providers", default="tcp,shm")
    ap.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    ap.add_argument("--iters", type=int, default=2000, help="imm-latency round trips per run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trees = {"new": HERE, "base": args.base.resolve()}
    built = tempfile.TemporaryDirectory(prefix="aiote-paired-")
    sites = {name: build(tree, Path(built.name) / name) for name, tree in trees.items()}
    # figures[case][tree] = [per-round aiote figure], c[case][tree] = [per-round C core figure]
    figures: dict[str, dict[str, list[float]]] = {}
    core: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        order = ["new", "base"] if r % 2 == 0 else ["base", "new"]
        for provider in args.providers.split(","):
            for name in order:
                for row in bench(trees[name], sites[name], args, provider):
                    k = key(row)
                    figures.setdefault(k, {}).setdefault(name, []).append(value(row, "py"))
                    core.setdefault(k, {}).setdefault(name, []).append(value(row, "c"))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{'case':38} {'base':>9} {'new':>9} {'new/base':>9} {'range':>13} {'/C base':>8} {'/C new':>7}")
    out = []
    for k, by in figures.items():
        n, b = by["new"], by["base"]
        ratios = [x / y for x, y in zip(n, b, strict=True)]
        rc = {t: statistics.median(by[t]) / statistics.median(core[k][t]) for t in ("base", "new")}
        mid = statistics.median(ratios)
        print(
            f"{k:38} {statistics.median(b):9.2f} {statistics.median(n):9.2f} {mid:9.2f} "
            f"{min(ratios):6.2f}-{max(ratios):<6.2f} {rc['base']:8.2f} {rc['new']:7.2f}"
        )
        out.append({"case": k, "base": b, "new": n, "ratio_median": mid, "c_base": core[k]["base"],
                    "c_new": core[k]["new"]})
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
