"""Shared pieces of the peer benchmarks: arguments, sizes, statistics, result lines, the
second process.

Every ``*_bench.py`` runs both sides on this host: the script itself is the initiator and it
starts itself again with ``--role target`` as the other process. Results go to stdout as a
human line each and, for ``run.py``, as ``RESULT {json}`` lines (one record per figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

HOST = "127.0.0.1"
DEFAULT_SIZES = "64KiB,1MiB,16MiB"
DEFAULT_WINDOW = 64
DEFAULT_REPEATS = 3
RESULT_PREFIX = "RESULT "
SKIP_PREFIX = "skipped: "
INSTALL_HINT = "pip install 'aiote[peers]' or scripts/setup-peers.sh"
HUGE_PAGE = 2 << 20


def buffer(nbytes: int) -> np.ndarray:
    """A uint8 array for a benchmark's source or destination, laid out as ``aiote bench`` and
    its C core lay out theirs (``aiote.cli._benchnet.bench_buffer``; aiote is not installed
    beside the peers): from 4 MiB on, it starts on a 2 MiB boundary of a NumPy block advised
    for transparent huge pages, so all of it can be huge pages. Same-host copies pin the pages
    they touch, and a plain ``np.empty`` of 4 MiB is only half huge pages: every library
    measures on the same kind of memory."""
    if nbytes < 2 * HUGE_PAGE:
        return np.empty(nbytes, np.uint8)
    raw = np.empty(nbytes + HUGE_PAGE, np.uint8)
    off = -raw.ctypes.data % HUGE_PAGE
    return raw[off : off + nbytes]


def parse_size(text: str) -> int:
    """``64KiB`` -> 65536 (k, m, g are powers of 1024; a bare number is bytes)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def size_label(size: int) -> str:
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    if size >= 1 << 10 and size % (1 << 10) == 0:
        return f"{size >> 10} KiB"
    return f"{size} B"


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="write sizes, e.g. 64KiB,1MiB,16MiB")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="operations in flight")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed runs per size")
    ap.add_argument(
        "--total",
        type=parse_size,
        default=1 << 30,
        help="bytes moved per timed run (at least one window; aiote bench: 1 GiB)",
    )
    ap.add_argument(
        "--iters", type=int, default=2000, help="round trips for the 8 B latency (as aiote bench)"
    )
    ap.add_argument("--no-rtt", action="store_true", help="skip the round-trip latency")
    ap.add_argument("--path", default=None, help="tcp, same-host or both (default: all this library has)")
    # internal: the second process
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"], help=argparse.SUPPRESS)
    ap.add_argument("--peer-arg", default="", help=argparse.SUPPRESS)
    return ap


def sizes_of(args: argparse.Namespace) -> list[int]:
    return [parse_size(s) for s in args.sizes.split(",") if s.strip()]


def skipped(library: str, why: str | None = None) -> int:
    """One clear line and exit status 0: the library is absent (or cannot run here)."""
    reason = why or f"{library} not installed ({INSTALL_HINT})"
    print(f"{SKIP_PREFIX}{reason}", flush=True)
    return 0


def emit(record: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def write_record(
    library: str, path: str, size: int, window: int, gbps_runs: Sequence[float], **extra: Any
) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "library": library,
        "path": path,
        "mode": "write",
        "size": size,
        "gbps": statistics.median(gbps_runs),
        "spread": [min(gbps_runs), max(gbps_runs)],
        "window": window,
        "runs": list(gbps_runs),
    }
    rec.update(extra)
    print(
        f"{library:9} {path:9} write {size_label(size):>7}  window {window:3}  "
        f"{rec['gbps']:6.2f} GB/s  ({rec['spread'][0]:.2f}-{rec['spread'][1]:.2f})",
        flush=True,
    )
    emit(rec)
    return rec


def rtt_record(library: str, path: str, rtts_s: Sequence[float], **extra: Any) -> dict[str, Any]:
    p50, p99 = percentiles_us(rtts_s)
    rec: dict[str, Any] = {
        "library": library,
        "path": path,
        "mode": "rtt",
        "size": 8,
        "rtt_us_p50": p50,
        "rtt_us_p99": p99,
        "iters": len(rtts_s),
    }
    rec.update(extra)
    print(f"{library:9} {path:9} rtt   8 B  round trip p50 {p50:7.1f} us  p99 {p99:7.1f} us", flush=True)
    emit(rec)
    return rec


def percentiles_us(samples_s: Sequence[float]) -> tuple[float, float]:
    s = sorted(samples_s)
    if not s:
        return float("nan"), float("nan")
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def spawn_self(
    script: str, args: argparse.Namespace, peer_arg: str = "", env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Starts this script again as the target; its stdout is a pipe (read lines with ``read_line``)."""
    cmd = [
        sys.executable,
        script,
        "--role",
        "target",
        "--sizes",
        args.sizes,
        "--window",
        str(args.window),
        "--repeats",
        str(args.repeats),
        "--total",
        str(args.total),
        "--iters",
        str(args.iters),
        "--peer-arg",
        peer_arg,
    ]
    if args.path:
        cmd += ["--path", args.path]
    if args.no_rtt:
        cmd.append("--no-rtt")
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=full_env)


def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 60.0) -> str:
    """The rest of the child's first stdout line starting with ``prefix`` (other lines are echoed)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target exited (status {proc.wait()}) before printing {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
        sys.stderr.write("target: " + line)
    raise TimeoutError(f"no {prefix!r} line from the target within {timeout} s")


def finish(proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    """Closes the child's stdin (its cue to leave) and waits; kills it if it lingers."""
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of the whole CPU busy over ``interval`` (from /proc/stat; 0.0 where absent)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except OSError:
        return 0.0
    return 1 - (i1 - i0) / max(1, t1 - t0)


def paths_of(args: argparse.Namespace, available: Sequence[str]) -> list[str]:
    if not args.path or args.path in ("both", "all"):
        return list(available)
    wanted = [p.strip() for p in args.path.split(",")]
    unknown = [p for p in wanted if p not in available]
    if unknown:
        raise SystemExit(f"unknown path {unknown}: this library has {list(available)}")
    return wanted


def run_each_path(
    script: str,
    argv: Sequence[str],
    paths: Sequence[str],
    envs: dict[str, dict[str, str]],
    timeout: float = 900.0,
) -> int:
    """Runs this script once per path, each in a fresh process with that path's environment (UCX and
    friends read their settings once per process). Output passes through. The worst exit status."""
    worst = 0
    for path in paths:
        env = dict(os.environ)
        env.update(envs.get(path, {}))
        shown = " ".join(f"{k}={v}" for k, v in envs.get(path, {}).items()) or "(no extra environment)"
        print(f"# {os.path.basename(script)} path {path}: {shown}", flush=True)
        cmd = [sys.executable, script, *strip_path(argv), "--path", path]
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"# {path}: timed out after {timeout:.0f} s", flush=True)
            rc = 124
        worst = worst or rc
    return worst


def strip_path(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--path":
            skip = True
            continue
        if a.startswith("--path="):
            continue
        out.append(a)
    return out
