"""What ``aiote bench`` shows: a progress bar while it runs (rich when installed, plain lines
otherwise), the table at the end, and the plot (matplotlib, ``--plot FILE.png``)."""

from __future__ import annotations

import math
import sys
from typing import Any

LATENCY_LABEL = {"imm-latency": "WriteImm", "sendrecv-latency": "send/recv"}


def size_label(n: int) -> str:
    """``4 KiB``, ``1 MiB``, ``512 B``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def median_ci(values: list[float], level: float = 0.90) -> list[float] | None:
    """A distribution-free confidence interval for the median of ``values`` (independent
    draws): the order statistics k and n - k + 1, k the largest rank with
    P(Binomial(n, 1/2) < k) <= (1 - level) / 2, so the interval covers the median with at
    least ``level``. None below 5 values (no such k)."""
    xs = sorted(values)
    n = len(xs)
    tail, k, below = (1.0 - level) / 2.0, 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= tail:  # (exact integers: any n)
        below += math.comb(n, k) / 2**n
        k += 1
    return [xs[k - 1], xs[n - k]] if k >= 1 else None


def figure(row: dict[str, Any], side: str) -> float | None:
    """A row's median for one side (``"py"``, ``"c"`` or ``"sockets"``) in the row's unit: the
    field ``{side}_us`` on latency rows (``unit`` ``"us"``), ``{side}_gbps`` on throughput rows.
    JSON written before the latency fields had their own names kept microseconds in
    ``{side}_gbps`` too: that name is read as a fallback."""
    for key in (f"{side}_us", f"{side}_gbps"):
        if row.get(key) is not None:
            return float(row[key])
    return None


def case_label(mode: str, size: int, window: int) -> str:
    """A case as the progress bar and the table name it."""
    if mode in LATENCY_LABEL:
        return f"{LATENCY_LABEL[mode]} ping-pong"
    text = f"{mode} {size_label(size)}"
    return f"{text} x{window}" if window else text


class Progress:
    """Counts the measurements of a run on stderr: a rich progress bar when rich is
    installed, else one line per measurement."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._rich: Any = None
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress
        except ImportError:
            return
        console = Console(stderr=True)
        if not console.is_terminal:
            return  # a log file gets the plain lines
        self._rich = RichProgress(
            TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        )
        self._task = self._rich.add_task("aiote bench", total=total)
        self._rich.start()

    def step(self, what: str) -> None:
        """Announces the measurement that starts now."""
        if self._rich is not None:
            self._rich.update(self._task, description=what)
        else:
            sys.stderr.write(f"[{self.done + 1}/{self.total}] {what}\n")
            sys.stderr.flush()

    def advance(self) -> None:
        """Marks the current measurement done."""
        self.done += 1
        if self._rich is not None:
            self._rich.advance(self._task)

    def close(self) -> None:
        """Removes the bar."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def _fmt(v: float | None, spread: list[float] | None) -> str:
    if v is None or spread is None:
        return "-"
    return f"{v:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"


def _varies(rows: list[dict[str, Any]], key: str) -> bool:
    return len({str(r[key]) for r in rows}) > 1


def row_label(r: dict[str, Any]) -> str:
    """The table's name for a row (latency rows: one-way percentile in µs)."""
    if r["unit"] == "us":
        return f"{LATENCY_LABEL[r['mode']]} one-way p{r['size']} (us)"
    return case_label(r["mode"], r["size"], r["window"] or 0)


def path_label(r: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Provider (and "arena" for buffers from ``Engine.alloc_host``), and the NICs and event
    loop where they were swept."""
    parts = [r["provider"] + (" arena" if r.get("memory") == "arena" else "")]
    if _varies(rows, "nics") and r["nics"]:
        parts.append(",".join(r["nics"]))
    if _varies(rows, "loop"):
        parts.append(r["loop"])
    return " ".join(parts)


def _with_sockets(rows: list[dict[str, Any]]) -> bool:
    """Whether any row has a bare-socket figure (tcp writes, latency rows): the table then
    shows them."""
    return any(figure(r, "sockets") is not None for r in rows)


def _cells(r: dict[str, Any], sockets: bool) -> list[str]:
    """A row's figures: C core, aiote, ratio, and (``sockets``) the bare sockets'."""
    cells = [_fmt(figure(r, "c"), r["c_spread"]), _fmt(figure(r, "py"), r["py_spread"]),
             f"{r['ratio']:.2f}" if r["ratio"] else "-"]
    if sockets:
        cells.append(_fmt(figure(r, "sockets"), r.get("sockets_spread")))
    return cells


def table_lines(result: dict[str, Any]) -> list[str]:
    """The plain-text table (with a column for bare TCP sockets when tcp writes ran)."""
    rows = result["rows"]
    sockets = _with_sockets(rows)
    head = (
        f"aiote bench: {result['provider']}, window {result['window']}, {result['loop']}, "
        f"median of {result['repeats']} (GB/s unless noted; spread min-max)"
    )
    if result.get("setting") == "low-latency":
        head += "; low-latency setting (spin_us=1000, loop_spin_us=500)"
    if result.get("c_copy_out"):
        head += "; the C core's receiver copies each message out, as recv does"
    if result.get("c_in_place"):
        head += ("; the C core sends each message from its buffer (no copy into a send slot), as send "
                 "does with bytes")
    if sockets:
        head += ("; bare sockets: writes, one plain TCP connection, no libfabric (the most one connection "
                 "moves); latency, the same event loop's own ping-pong over a plain socket (loopback TCP "
                 "for tcp, a Unix socket pair for shm), no library")
    cols = f"{'case':30} {'path':14} {'C core':>24} {'aiote':>24} {'ratio':>6}"
    lines = [head, cols + (f" {'bare sockets':>24}" if sockets else "")]
    for r in rows:
        c = _cells(r, sockets)
        lines.append(
            f"{row_label(r):30} {path_label(r, rows):14} {c[0]:>24} {c[1]:>24} {c[2]:>6}"
            + (f" {c[3]:>24}" if sockets else "")
        )
    return lines


def print_table(result: dict[str, Any]) -> None:
    """Prints the table on stdout: rich on a terminal when installed, else plain text."""
    if sys.stdout.isatty():
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pass
        else:
            rows = result["rows"]
            sockets = _with_sockets(rows)
            t = Table(title=table_lines(result)[0])
            for name, just in (("case", "left"), ("path", "left"), ("C core", "right"),
                               ("aiote", "right"), ("ratio", "right")) + ((("bare sockets", "right"),)
                                                                          if sockets else ()):
                t.add_column(name, justify=just)  # type: ignore[arg-type]
            for r in rows:
                t.add_row(row_label(r), path_label(r, rows), *_cells(r, sockets))
            Console().print(t)
            return
    for line in table_lines(result):
        print(line)


def plot_unavailable() -> str | None:
    """Why ``--plot`` cannot work here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'aiote[bench]' (or pip install matplotlib)"
    return None


def plot(result: dict[str, Any], path: str) -> None:
    """Two panels to ``path``: throughput against size (a line per engine and path, the C
    core dashed), and one-way latency percentiles (aiote beside the C core)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    lines: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        if r["unit"] != "GB/s":
            continue
        where = path_label(r, rows)
        if _varies([x for x in rows if x["window"]], "window"):
            where += f" x{r['window']}" if r["window"] else ""
        lines.setdefault(("aiote", f"{r['mode']} {where}"), {})[r["size"]] = figure(r, "py") or 0.0
        c_figure = figure(r, "c")
        if c_figure is not None:
            c_path = where.replace(f" {r['loop']}", "") if _varies(rows, "loop") else where
            lines.setdefault(("C core", f"{r['mode']} {c_path}"), {})[r["size"]] = c_figure
    colors: dict[str, Any] = {}
    for (engine, what), pts in sorted(lines.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        xs = sorted(pts)
        color = colors.setdefault(what, f"C{len(colors) % 10}")
        ax1.plot(xs, [pts[x] for x in xs], marker="s" if engine == "C core" else "o", color=color,
                 linestyle="--" if engine == "C core" else "-", label=f"{engine}: {what}")
    ax1.set_xscale("log", base=2)
    sizes = sorted({r["size"] for r in rows if r["unit"] == "GB/s"})
    ax1.set_xticks(sizes, [size_label(s) for s in sizes])
    ax1.set_xlabel("transfer size")
    ax1.set_ylabel("GB/s (1e9 B/s), median")
    ax1.set_title("Throughput (dashed: the C core, same run)")
    ax1.grid(True, alpha=0.3)
    if lines:
        ax1.legend(fontsize=6, ncol=2)
    lat = [r for r in rows if r["unit"] == "us"]
    groups: list[str] = []
    vals: dict[str, list[float]] = {"aiote p50": [], "aiote p99": [], "C core p50": [], "C core p99": []}
    for r in lat:
        g = f"{LATENCY_LABEL[r['mode']]}\n{path_label(r, rows)}"
        if g not in groups:
            groups.append(g)
            for v in vals.values():
                v.append(0.0)
        i = groups.index(g)
        vals[f"aiote p{r['size']}"][i] = figure(r, "py") or 0.0
        vals[f"C core p{r['size']}"][i] = figure(r, "c") or 0.0
    width = 0.2
    for j, (name, v) in enumerate(vals.items()):
        ax2.bar([i + (j - 1.5) * width for i in range(len(groups))], v, width, label=name,
                hatch="//" if name.startswith("C") else None)
    ax2.set_xticks(range(len(groups)), groups)
    ax2.set_ylabel("one-way latency, µs (RTT / 2), log scale")
    if groups:
        ax2.set_yscale("log")
    ax2.set_title("Latency percentiles (8-byte ping-pong)")
    ax2.grid(True, axis="y", alpha=0.3)
    if groups:
        ax2.legend(fontsize=7)
    m = result.get("machine") or {}
    fig.suptitle(f"aiote bench, {m.get('cores', '?')} cores {m.get('cpu', '')}, {result.get('date', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
