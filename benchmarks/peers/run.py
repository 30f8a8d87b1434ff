"""Runs every peer benchmark (NIXL, Mooncake TE, UCXX, gloo) on this host, one after the other,
each as a subprocess with a timeout, and prints one table. ``--json FILE`` writes the records;
``--aiote FILE.json`` (what ``aiote bench ... --json FILE`` wrote; may be given twice, e.g. a tcp and
an shm run) adds aiote's ratio to the best peer on the same path for each size, and aiote's WriteImm
round trip against UCXX's asyncio round trip. ``--rounds N --run-aiote`` runs aiote and every
library once per round, N rounds, and compares them round by round (what scripts/bench-docs.sh
does: on a machine whose speed drifts over minutes only a comparison within one round is fair).

    .venv-peers/bin/python benchmarks/peers/run.py --json peers.json --aiote aiote.json
    .venv/bin/python benchmarks/peers/run.py --rounds 5 --run-aiote --json peers.json

Records (one per figure)::

    {"library", "path": "tcp"|"same-host", "mode": "write", "size", "gbps", "spread": [min, max], "window"}
    {"library", "path", "mode": "rtt", "size": 8, "rtt_us_p50", "rtt_us_p99", "rtt_us" (= p50)}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import _common as c  # noqa: E402

LIBRARIES = ("nixl", "mooncake", "ucxx", "gloo")
SOCKETS = "sockets"  # one plain TCP connection (aiote bench's bare-socket figure), not a peer
PEERS_VENV = HERE.parents[1] / ".venv-peers" / "bin" / "python"
PATHS = ("tcp", "same-host")


# ---------------------------------------------------------------- running the peers


def run_one(
    python: str,
    lib: str,
    passthrough: Sequence[str],
    timeout: float,
    echo: bool = True,
    script: Path | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Runs ``<lib>_bench.py`` (or ``script``); its records and, when it did not finish cleanly, why."""
    cmd = [python, str(script or HERE / f"{lib}_bench.py"), *passthrough]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    records: list[dict[str, Any]] = []
    err_tail: list[str] = []

    def drain_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_tail.append(line)
            del err_tail[:-30]

    def drain_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(c.SKIP_PREFIX):
                records.append({"skipped": line[len(c.SKIP_PREFIX) :].strip()})
            elif line.startswith(c.RESULT_PREFIX):
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line[len(c.RESULT_PREFIX) :]))
            elif echo:
                sys.stdout.write(f"  {line}")
                sys.stdout.flush()

    threads = [
        threading.Thread(target=drain_out, daemon=True),
        threading.Thread(target=drain_err, daemon=True),
    ]
    for t in threads:
        t.start()
    why = None
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and every process it started
        proc.wait()
        rc = None
        why = f"timed out after {timeout:.0f} s"
    for t in threads:
        t.join(5)
    if rc:
        why = f"exit status {rc}: " + "".join(err_tail[-5:]).strip()[-600:]
    elif rc == 0 and not records:
        why = "no results"
    return records, why


def run_aiote(
    python: str, args: argparse.Namespace, timeout: float, keep: str | None = None, repeats: int | None = None
) -> dict[str, Any]:
    """``aiote bench write``, ``aiote bench imm-latency``, ``aiote bench imm-latency --low-latency``
    and ``aiote bench sendrecv-latency`` on tcp and shm, and ``aiote bench write --arena`` on
    shm, with the peers' sizes, window and repeats (``repeats`` overrides them), right before
    the peers (same run); their JSON by job name (``write``, ``write-arena``, ``imm-latency``,
    ``imm-latency-low``, ``sendrecv-latency``; a job that failed is missing). Runs in a
    scratch directory so that a source tree in the current directory (maybe not built) does
    not shadow the installed aiote. Its tables are echoed; with ``keep`` (the --json file),
    its JSON is kept beside it as ``<keep stem>.aiote-<job>.json``."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="aiote-peers-") as tmp:
        common = ["--provider", "tcp,shm", "--repeats", str(repeats or args.repeats)]
        iters = ["--iters", str(args.iters)] if args.iters else []
        jobs = {
            "write": ["write", "--sizes", args.sizes, "--window", str(args.window), *common]
            + (["--total", args.total] if args.total else [])
            + (["--streams", str(args.aiote_streams)] if args.aiote_streams is not None else []),
            # same-host writes between buffers of the engines' host arenas (Engine.alloc_host)
            "write-arena": ["write", "--sizes", args.sizes, "--window", str(args.window), "--provider", "shm",
                            "--repeats", str(repeats or args.repeats), "--arena"]
            + (["--total", args.total] if args.total else []),
            "imm-latency": ["imm-latency", *common, *iters],
            "imm-latency-low": ["imm-latency", "--low-latency", *common, *iters],
            # an 8-byte send/recv ping-pong: the same exchange as UCXX's round trip (two-sided)
            "sendrecv-latency": ["sendrecv-latency", *common, *iters],
        }
        for name, argv in jobs.items():
            target = Path(tmp) / f"{name}.json"
            print(f"== aiote bench {' '.join(argv)}", flush=True)
            try:
                r = subprocess.run(
                    [python, "-m", "aiote", "bench", *argv, "--json", str(target)],
                    cwd=tmp,
                    timeout=timeout,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            except subprocess.TimeoutExpired:
                print(f"   aiote bench {name}: timed out after {timeout:.0f} s", flush=True)
                continue
            for line in r.stdout.splitlines():
                if not line.startswith("{"):  # its table; the last line repeats the JSON
                    print(f"  {line}")
            if r.returncode or not target.exists():
                print(f"   aiote bench {name}: exit status {r.returncode}", flush=True)
                continue
            text = target.read_text()
            if keep:
                Path(keep).with_suffix(f".aiote-{name}.json").write_text(text)
            out[name] = json.loads(text)
    return out


# ---------------------------------------------------------------- aiote's own JSON


_AIOTE_PATH = {
    "tcp": "tcp",
    "shm": "same-host",
    "same-host": "same-host",
    "sm2": "same-host",
    "cma": "same-host",
}
_GBPS_KEYS = ("py_gbps", "aiote_gbps", "python_gbps", "gbps")
_LATENCY_MODES = ("imm-latency", "write-imm-latency", "writeimm-latency", "imm_latency", "write_imm")
_SENDRECV_MODES = ("sendrecv-latency",)


def _path_of(provider: Any) -> str | None:
    if isinstance(provider, str):
        return _AIOTE_PATH.get(provider.lower().split(";")[0])
    return None


def _rows(node: Any, inherited: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    """Every dict with a ``mode`` anywhere in aiote's JSON, with provider/loop/window filled in from
    the enclosing objects when the row has none (the format has moved; be tolerant)."""
    if isinstance(node, list):
        for item in node:
            yield from _rows(item, inherited)
    elif isinstance(node, dict):
        here = dict(inherited)
        for k in ("provider", "path", "loop", "window"):
            if k in node and not isinstance(node[k], (list, dict)):
                here[k] = node[k]
        if "mode" in node:
            yield {**here, **node}
        for v in node.values():
            if isinstance(v, (list, dict)):
                yield from _rows(v, here)


def _preference(row: Mapping[str, Any], window: int | None) -> tuple[int, int, int]:
    """Lower is better: asyncio first (UCXX is measured under asyncio), then the same window, then
    no NIC list."""
    return (
        0 if row.get("loop", "asyncio") == "asyncio" else 1,
        0 if window is None or row.get("window") in (None, window) else 1,
        0 if not row.get("nics") else 1,
    )


def load_aiote(
    data: Any, window: int | None = None, latency_modes: Sequence[str] = _LATENCY_MODES
) -> dict[str, Any]:
    """aiote's figures from ``aiote bench --json`` output (one dict, or a list of them):

    ``{"write": {(path, size): gbps}, "rtt_us": {path: {"p50": us, "p99": us}}}``

    ``rtt_us`` is the WriteImm round trip (``latency_modes``: the rows it is read from;
    ``_SENDRECV_MODES``: the send/recv round trip instead); aiote reports one-way latency (round
    trip / 2) in rows of mode ``imm-latency`` whose ``size`` is the percentile, so it is doubled
    here. Fields named ``rtt_us_p50`` / ``rtt_us_p99`` are taken as round trips already.
    """
    best: dict[tuple[str, str, int], tuple[tuple[int, int, int], float]] = {}

    def offer(key: tuple[str, str, int], pref: tuple[int, int, int], value: float) -> None:
        if key not in best or pref < best[key][0]:
            best[key] = (pref, value)

    for row in _rows(data, {}):
        path = _path_of(row.get("path")) or _path_of(row.get("provider"))
        if path is None:
            continue
        mode = str(row["mode"]).lower()
        pref = _preference(row, window)
        if mode == "write":
            value = next((row[k] for k in _GBPS_KEYS if isinstance(row.get(k), (int, float))), None)
            if value is not None and isinstance(row.get("size"), int):
                offer(("write", path, int(row["size"])), pref, float(value))
        elif mode in latency_modes:
            for pct in (50, 99):
                rtt = row.get(f"rtt_us_p{pct}")
                one_way = row.get(f"p{pct}_us", row.get(f"one_way_us_p{pct}"))
                if rtt is None and one_way is None and row.get("size") == pct:
                    one_way = next((row[k] for k in ("py_gbps", "py_us", "value") if k in row), None)
                if isinstance(rtt, (int, float)):
                    offer(("rtt", path, pct), pref, float(rtt))
                elif isinstance(one_way, (int, float)):
                    offer(("rtt", path, pct), pref, 2 * float(one_way))
    out: dict[str, Any] = {"write": {}, "rtt_us": {}}
    for (kind, path, n), (_, value) in best.items():
        if kind == "write":
            out["write"][(path, n)] = value
        else:
            out["rtt_us"].setdefault(path, {})[f"p{n}"] = value
    return out


def load_sockets(data: Any, window: int | None = None) -> dict[tuple[str, int], float]:
    """The bare-socket figures that ``aiote bench write`` measures beside its tcp rows
    (``sockets_gbps``: one plain TCP connection, no libfabric, same sizes, window and buffers):
    ``{("tcp", size): gbps}``."""
    best: dict[tuple[str, int], tuple[tuple[int, int, int], float]] = {}
    for row in _rows(data, {}):
        if str(row.get("mode")) == "write" and isinstance(row.get("sockets_gbps"), (int, float)):
            path = _path_of(row.get("path")) or _path_of(row.get("provider"))
            if path and isinstance(row.get("size"), int):
                key, pref = (path, int(row["size"])), _preference(row, window)
                if key not in best or pref < best[key][0]:  # the row load_aiote would take
                    best[key] = (pref, float(row["sockets_gbps"]))
    return {k: v for k, (_, v) in best.items()}


def compare(
    aiote: Mapping[str, Any], records: Sequence[Mapping[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """aiote beside the peers on the same path.

    ``write``: for each (path, size) aiote has, the best peer's write figure on that path and size
    and ``ratio`` = aiote / best (>= 1 meets the issue's target); ``rtt``: aiote's WriteImm round
    trip p50 against UCXX's round trip p50 on the same path, ``ratio`` = aiote / UCXX (< 1 meets it).
    """
    writes = []
    for (path, size), gbps in sorted(
        aiote.get("write", {}).items(), key=lambda kv: (PATHS.index(kv[0][0]), kv[0][1])
    ):
        peers = [
            r for r in records if r.get("mode") == "write" and r.get("path") == path and r.get("size") == size
        ]
        top = max(peers, key=lambda r: r["gbps"], default=None)
        writes.append(
            {
                "path": path,
                "size": size,
                "aiote_gbps": gbps,
                "best_peer": top["library"] if top else None,
                "best_peer_gbps": top["gbps"] if top else None,
                "ratio": gbps / top["gbps"] if top and top["gbps"] > 0 else None,
            }
        )
    rtts = []
    for path, pcts in sorted(aiote.get("rtt_us", {}).items(), key=lambda kv: PATHS.index(kv[0])):
        if "p50" not in pcts:
            continue
        ucxx = next(
            (
                r
                for r in records
                if r.get("library") == "ucxx" and r.get("mode") == "rtt" and r.get("path") == path
            ),
            None,
        )
        rtts.append(
            {
                "path": path,
                "aiote_rtt_us_p50": pcts["p50"],
                "aiote_rtt_us_p99": pcts.get("p99"),
                "ucxx_rtt_us_p50": ucxx["rtt_us_p50"] if ucxx else None,
                "ucxx_rtt_us_p99": ucxx["rtt_us_p99"] if ucxx else None,
                "ratio": pcts["p50"] / ucxx["rtt_us_p50"] if ucxx and ucxx["rtt_us_p50"] > 0 else None,
            }
        )
    return {"write": writes, "rtt": rtts}


# ---------------------------------------------------------------- rounds


def merge_rounds(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per (library, path, mode, size) from the records of every round: the median
    of the rounds' figures, ``spread`` over every timed run of every round, ``rounds`` the count."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault((r.get("library"), r.get("path"), r.get("mode"), r.get("size")), []).append(r)
    med = statistics.median
    out = []
    for rs in groups.values():
        m: dict[str, Any] = {k: v for k, v in rs[0].items() if k != "round"}
        m["rounds"] = len(rs)
        if all(isinstance(r.get("gbps"), (int, float)) for r in rs):
            m["gbps"] = med(float(r["gbps"]) for r in rs)
            runs = [float(x) for r in rs for x in (r.get("runs") or [r["gbps"]])]
            m["runs"] = runs
            m["spread"] = [min(runs), max(runs)]
        for k in ("rtt_us_p50", "rtt_us_p99"):
            if all(isinstance(r.get(k), (int, float)) for r in rs):
                m[k] = med(float(r[k]) for r in rs)
        out.append(m)
    return out


def _aiote_records(data: Mapping[str, Any], n: int, library: str = "aiote") -> list[dict[str, Any]]:
    """aiote's figures of round ``n`` (see :func:`load_aiote`) as peer-style records (library
    ``library``), so that the table shows aiote among the peers measured in the same rounds."""
    out: list[dict[str, Any]] = []
    for (path, size), gbps in data.get("write", {}).items():
        out.append({"library": library, "path": path, "mode": "write", "size": size, "gbps": gbps,
                    "round": n})
    for path, pcts in data.get("rtt_us", {}).items():
        if "p50" in pcts:
            out.append({"library": "aiote", "path": path, "mode": "rtt", "size": 8, "round": n,
                        "rtt_us_p50": pcts["p50"], "rtt_us_p99": pcts.get("p99", pcts["p50"])})
    return out


def head_to_head(
    per_round: Sequence[tuple[Sequence[Mapping[str, Any]], Mapping[str, Any]]], window: int | None
) -> list[dict[str, Any]]:
    """aiote against the peers round by round (each round's aiote run against the same round's
    peers), then the median over the rounds. Records of mode ``versus``:

    - ``kind: write``: per (path, size, memory), ``ratio`` = median of aiote / best peer of the
      round (>= 1 meets the target), ``ratios`` (one per round), ``ahead`` (rounds with ratio
      >= 1); ``memory``: ``numpy`` (ordinary arrays), or ``arena`` (the ``write-arena`` job:
      both sides' buffers from ``Engine.alloc_host``); where the round's ``aiote bench write``
      measured bare sockets too (tcp), ``sockets_gbps`` and the medians of aiote / sockets
      (``aiote_of_sockets``) and best peer / sockets (``peer_of_sockets``);
    - ``kind: rtt``: per (path, setting: default or low-latency), ``ratio`` = median of aiote's
      WriteImm round trip / UCXX asyncio's round trip of the round (< 1 meets the target),
      ``ahead`` (rounds with ratio < 1); setting ``send/recv``: aiote's 8-byte send/recv round
      trip (default setting) against the same UCXX round trip (also a send/recv ping-pong).
    """
    med = statistics.median
    writes: dict[tuple[str, int, str], list[Mapping[str, Any]]] = {}
    rtts: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for recs, jobs in per_round:
        base = load_aiote([jobs[k] for k in ("write", "imm-latency") if k in jobs], window)
        arena = load_aiote([jobs["write-arena"]], window) if "write-arena" in jobs else {"write": {}}
        bare = load_sockets(jobs["write"], window) if "write" in jobs else {}
        for memory, got in (("numpy", base), ("arena", arena)):
            for w in compare({"write": got["write"], "rtt_us": {}}, recs)["write"]:
                if w["ratio"] is not None:
                    sk = bare.get((w["path"], w["size"])) if memory == "numpy" else None
                    writes.setdefault((w["path"], w["size"], memory), []).append({**w, "sockets_gbps": sk})
        for setting, job in (("default", "imm-latency"), ("low-latency", "imm-latency-low"),
                             ("send/recv", "sendrecv-latency")):
            if job not in jobs:
                continue
            modes = _SENDRECV_MODES if job == "sendrecv-latency" else _LATENCY_MODES
            got = load_aiote([jobs[job]], window, modes)
            for r in compare({"write": {}, "rtt_us": got["rtt_us"]}, recs)["rtt"]:
                if r["ratio"] is not None:
                    rtts.setdefault((r["path"], setting), []).append(r)
    out: list[dict[str, Any]] = []
    for (path, size, memory), ws in sorted(
        writes.items(), key=lambda kv: (PATHS.index(kv[0][0]), kv[0][2] == "arena", kv[0][1])
    ):
        ratios = [float(w["ratio"]) for w in ws]
        rec: dict[str, Any] = {
            "mode": "versus", "kind": "write", "path": path, "size": size, "memory": memory,
            "rounds": len(ws),
            "ratio": med(ratios), "ratios": ratios, "ahead": sum(x >= 1 for x in ratios),
            "aiote_gbps": med(float(w["aiote_gbps"]) for w in ws),
            "best_peer_gbps": med(float(w["best_peer_gbps"]) for w in ws),
            "best_peers": sorted({str(w["best_peer"]) for w in ws}),
        }
        with_sk = [w for w in ws if w["sockets_gbps"]]
        if with_sk:  # against one plain TCP connection measured in the same rounds
            rec["sockets_gbps"] = med(float(w["sockets_gbps"]) for w in with_sk)
            rec["aiote_of_sockets"] = med(float(w["aiote_gbps"]) / w["sockets_gbps"] for w in with_sk)
            rec["peer_of_sockets"] = med(float(w["best_peer_gbps"]) / w["sockets_gbps"] for w in with_sk)
        out.append(rec)
    for (path, setting), rs in sorted(rtts.items(), key=lambda kv: (PATHS.index(kv[0][0]), kv[0][1])):
        ratios = [float(r["ratio"]) for r in rs]
        out.append({
            "mode": "versus", "kind": "rtt", "path": path, "setting": setting, "rounds": len(rs),
            "ratio": med(ratios), "ratios": ratios, "ahead": sum(x < 1 for x in ratios),
            "aiote_rtt_us": med(float(r["aiote_rtt_us_p50"]) for r in rs),
            "ucxx_rtt_us": med(float(r["ucxx_rtt_us_p50"]) for r in rs),
        })
    return out


def versus_table(versus: Sequence[Mapping[str, Any]]) -> str:
    lines = ["aiote against the peers, round by round (median of the rounds' ratios)"]
    for v in versus:
        n = v["rounds"]
        if v["kind"] == "write":
            mem = " (arena)" if v.get("memory") == "arena" else ""
            lines.append(
                f"  write {v['path']:9} {c.size_label(v['size']):>7}: aiote{mem} {v['aiote_gbps']:.2f} GB/s, "
                f"best peer ({'/'.join(v['best_peers'])}) {v['best_peer_gbps']:.2f} GB/s, "
                f"ratio {v['ratio']:.2f} (ahead in {v['ahead']} of {n} rounds; >= 1: aiote is ahead)"
            )
            if "sockets_gbps" in v:
                lines.append(
                    f"    bare sockets {v['sockets_gbps']:.2f} GB/s: aiote at {v['aiote_of_sockets']:.2f} "
                    f"of them, the best peer at {v['peer_of_sockets']:.2f}"
                )
        else:
            lines.append(
                f"  round trip {v['path']:9} {v['setting']:11}: aiote {v['aiote_rtt_us']:.1f} us, "
                f"UCXX asyncio {v['ucxx_rtt_us']:.1f} us, ratio {v['ratio']:.2f} "
                f"(faster in {v['ahead']} of {n} rounds; < 1: aiote is faster)"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------- printing


def table(records: Sequence[Mapping[str, Any]], skipped: Mapping[str, str]) -> str:
    sizes = sorted({int(r["size"]) for r in records if r.get("mode") == "write"})
    head = f"{'library':9} {'path':9}" + "".join(f" {c.size_label(s):>18}" for s in sizes)
    head += f" {'rtt p50 / p99 (us)':>20}"
    lines = ["write GB/s (1e9 B/s): median (min-max); 8 B round trip", head]
    keys = sorted(
        {(r["library"], r["path"]) for r in records if "path" in r},
        key=lambda k: (
            LIBRARIES.index(k[0]) if k[0] in LIBRARIES else 99,
            PATHS.index(k[1]) if k[1] in PATHS else 9,
        ),
    )
    for lib, path in keys:
        line = f"{lib:9} {path:9}"
        for s in sizes:
            r = next(
                (
                    r
                    for r in records
                    if (r["library"], r["path"], r["mode"], r["size"]) == (lib, path, "write", s)
                ),
                None,
            )
            cell = f"{r['gbps']:.2f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})" if r else "-"
            line += f" {cell:>18}"
        rt = next((r for r in records if (r["library"], r["path"], r["mode"]) == (lib, path, "rtt")), None)
        rcell = f"{rt['rtt_us_p50']:.0f} / {rt['rtt_us_p99']:.0f}" if rt else "-"
        lines.append(line + f" {rcell:>20}")
    for lib, why in skipped.items():
        lines.append(f"{lib:9} skipped: {why}")
    return "\n".join(lines)


def comparison_table(cmp: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    lines = ["aiote beside the best peer on the same path (ratio >= 1: aiote is ahead)"]
    for w in cmp["write"]:
        head = f"  write {w['path']:9} {c.size_label(w['size']):>7}: aiote {w['aiote_gbps']:.2f} GB/s, "
        if w["best_peer"] is None:
            lines.append(head + "no peer measured at this size on this path")
            continue
        ratio = f"{w['ratio']:.2f}" if w["ratio"] is not None else "-"
        lines.append(head + f"best peer {w['best_peer']} {w['best_peer_gbps']:.2f} GB/s, ratio {ratio}")
    for r in cmp["rtt"]:
        ucxx = f"{r['ucxx_rtt_us_p50']:.1f}" if r["ucxx_rtt_us_p50"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(
            f"  round trip {r['path']:9} p50: aiote WriteImm {r['aiote_rtt_us_p50']:.1f} us, UCXX asyncio "
            f"{ucxx} us, aiote/UCXX {ratio} (< 1: aiote is faster)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(LIBRARIES), help="comma-separated: " + ",".join(LIBRARIES))
    ap.add_argument("--sizes", default=c.DEFAULT_SIZES)
    ap.add_argument("--window", type=int, default=c.DEFAULT_WINDOW)
    ap.add_argument("--repeats", type=int, default=c.DEFAULT_REPEATS)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every library (and aiote, with --run-aiote) once per round, this many rounds, "
        "and compare aiote with the peers round by round: on a machine whose speed drifts, a "
        "comparison within one round is fair where one across minutes is not",
    )
    ap.add_argument("--total", default=None, help="bytes per timed run (default: each bench's)")
    ap.add_argument("--iters", type=int, default=None, help="round trips (default: each bench's)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per library before it is killed")
    ap.add_argument(
        "--python",
        default=None,
        help="interpreter for the benches (default: .venv-peers/bin/python when it exists, else this one)",
    )
    ap.add_argument("--json", dest="json_file", help="write the records (a JSON list) here")
    ap.add_argument("--aiote", action="append", default=[], help="aiote bench --json output (repeatable)")
    ap.add_argument(
        "--run-aiote",
        nargs="?",
        const="auto",
        metavar="PYTHON",
        help="run `aiote bench` (write and imm-latency, tcp and shm) first, with this interpreter "
        "(default: the repository's .venv/bin/python, else this one)",
    )
    ap.add_argument(
        "--aiote-streams",
        type=int,
        default=None,
        help="with --run-aiote: aiote's writes over this many connections per NIC (aiote bench "
        "--streams; default: aiote's)",
    )
    ap.add_argument("--quiet", action="store_true", help="don't echo each bench's lines")
    return ap


def _one_round(
    n: int, rounds: int, repeats: int, libs: list[str], python: str, passthrough: list[str],
    aiote_py: str | None, args: argparse.Namespace, skipped: dict[str, str],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Round ``n``: aiote (with ``--run-aiote``) and every library once; their records, and
    aiote's bench results by mode. A library that is absent or fails goes into ``skipped``
    and is not run again in later rounds."""
    jobs: dict[str, Any] = {}
    if aiote_py:
        keep = args.json_file if n == rounds - 1 else None
        jobs = run_aiote(aiote_py, args, args.timeout, keep=keep, repeats=repeats)
    got_round: list[dict[str, Any]] = []
    for lib in libs:
        if lib in skipped and n:  # absent, or failed in an earlier round: not again
            continue
        t0 = time.monotonic()
        print(f"== {lib}", flush=True)
        got, why = run_one(python, lib, passthrough, args.timeout, echo=not args.quiet)
        for r in got:
            if "skipped" in r:
                skipped[lib] = r["skipped"]
            else:
                got_round.append({**r, "round": n})
        if why and lib not in skipped:
            skipped[lib] = why if not got else f"partial: {why}"
        print(f"   ({time.monotonic() - t0:.0f} s)", flush=True)
    if jobs:
        got_round += _aiote_records(load_aiote([jobs[k] for k in ("write", "imm-latency") if k in jobs],
                                               args.window), n)
        if "write" in jobs:  # the bare sockets measured by the same aiote bench run
            got_round += _aiote_records({"write": load_sockets(jobs["write"], args.window)}, n, SOCKETS)
        if "write-arena" in jobs:
            got_round += _aiote_records(load_aiote([jobs["write-arena"]], args.window), n, "aiote-arena")
    return got_round, jobs


def _write_json(path: str, records: list[dict[str, Any]], versus: list[dict[str, Any]]) -> None:
    """The records (with one round-trip figure as ``rtt_us``) and the head-to-head rows."""
    keep_keys = (
        "library", "path", "mode", "size", "gbps", "spread", "window", "rtt_us_p50", "rtt_us_p99",
        "rounds",
    )
    out = [{k: r[k] for k in keep_keys if k in r} for r in records]
    for r in out:  # benchmarks/render_docs.py reads one round-trip figure as "rtt_us"
        if r.get("mode") == "rtt":
            r["rtt_us"] = r["rtt_us_p50"]
    Path(path).write_text(json.dumps(out + versus, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)

    python = args.python or (str(PEERS_VENV) if PEERS_VENV.exists() else sys.executable)
    rounds = max(1, args.rounds)
    repeats = 1 if rounds > 1 else args.repeats  # in rounds, the rounds are the repeats
    passthrough = ["--sizes", args.sizes, "--window", str(args.window), "--repeats", str(repeats)]
    if args.total:
        passthrough += ["--total", args.total]
    if args.iters:
        passthrough += ["--iters", str(args.iters)]
    libs = [x.strip() for x in args.only.split(",") if x.strip()]
    for lib in libs:
        if lib not in LIBRARIES:
            ap.error(f"unknown library {lib!r}")
    busy = c.cpu_busy()
    how = f"{rounds} rounds (each library and aiote once per round)" if rounds > 1 else f"{repeats} repeats"
    print(f"peers: {python}; sizes {args.sizes}, window {args.window}, {how}; CPU busy {busy:.0%}")
    if busy > 0.10:
        print(f"warning: the CPU was {busy:.0%} busy before the run: figures will be noisy")
    aiote_data: list[Any] = [json.loads(Path(f).read_text()) for f in args.aiote]
    aiote_py = None
    if args.run_aiote:
        repo_venv = HERE.parents[1] / ".venv" / "bin" / "python"
        aiote_py = (
            args.run_aiote
            if args.run_aiote != "auto"
            else str(repo_venv if repo_venv.exists() else sys.executable)
        )
        if os.sep in aiote_py:  # aiote runs in a scratch directory: a relative path would not be found
            aiote_py = os.path.abspath(aiote_py)  # (not resolved: a venv's python is a symlink)
    per_round: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    all_records: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for n in range(rounds):
        if rounds > 1:
            print(f"=== round {n + 1} of {rounds}", flush=True)
        got_round, jobs = _one_round(n, rounds, repeats, libs, python, passthrough, aiote_py, args, skipped)
        per_round.append(([r for r in got_round if r["library"] in LIBRARIES], jobs))
        all_records += got_round
    records = merge_rounds(all_records)
    after = c.cpu_busy()
    print()
    print(table(records, skipped))
    print(f"CPU busy before {busy:.0%}, after {after:.0%} (2-core machines: compare only within one run)")
    versus: list[dict[str, Any]] = []
    if aiote_py:
        versus = head_to_head(per_round, args.window)
        print()
        print(versus_table(versus))
    elif aiote_data:
        cmp = compare(load_aiote(aiote_data, args.window), records)
        print()
        print(comparison_table(cmp))
    if args.json_file:
        _write_json(args.json_file, records, versus)
    return 0

if __name__ == "__main__":
    sys.exit(main())
