"""Rewrites the generated part of docs/benchmarks.md (between ``<!-- bench:begin -->`` and
``<!-- bench:end -->``) from the JSON of ``aiote bench --json`` and, when given, of the peer
libraries' run (``benchmarks/peers/run.py --json``: a list of
``{"library", "path", "mode", "size", "gbps" | "rtt_us", ...}``).

    python benchmarks/render_docs.py --bench docs/bench.json [--peers docs/peers.json] \\
        [--plot bench.png] [--doc docs/benchmarks.md]

Run by scripts/bench-docs.sh; everything between the markers is replaced, the rest of the
file is left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
LATENCY = {"imm-latency": "WriteImm", "sendrecv-latency": "send/recv"}
SOCKETS_NOTE = (" Bare sockets, in the same run: on tcp writes, the same sizes, messages in flight and "
                "buffers over one plain TCP connection, no libfabric (`aiote_cbench sockets`): the most one "
                "connection moves here; on latency rows, the same event loop playing the 8-byte ping-pong "
                "over a plain socket (loopback TCP for tcp, a Unix socket pair for shm), no library "
                "(`aiote/cli/_benchfloor.py`): one wake-up of a sleeping event loop per hop, nothing else.")
LIBRARY_LABEL = {"sockets": "bare sockets (no library)"}
NOT_PEERS = ("aiote", "aiote-arena", "sockets")  # rows of the peers' table that are no peer


def fig_of(r: dict[str, Any], side: str) -> float | None:
    """A bench row's median for ``side`` (``"py"``, ``"c"``, ``"sockets"``) in the row's unit:
    ``{side}_us`` on latency rows and ``{side}_gbps`` on throughput rows; JSON written before the
    latency fields had their own names (docs/*.json of earlier runs) kept microseconds in
    ``{side}_gbps``, which is read when the new name is absent."""
    for key in (f"{side}_us", f"{side}_gbps"):
        if r.get(key) is not None:
            return float(r[key])
    return None


def size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _fig(v: float | None, spread: list[float] | None) -> str:
    if v is None:
        return "-"
    if spread and spread[0] != spread[1]:
        return f"{v:.2f} [{spread[0]:.2f}-{spread[1]:.2f}]"
    return f"{v:.2f}"


def _varies(rows: list[dict[str, Any]], key: str) -> bool:
    return len({str(r.get(key)) for r in rows}) > 1


def _during(b: dict[str, Any]) -> str:
    """What other processes (and the hypervisor) took during the run, when the JSON has it."""
    if "cpu_others_during" not in b:
        return ""
    return (f"; during it, other processes took {b['cpu_others_during']:.0%} of the CPU and the "
            f"hypervisor {b['cpu_steal_during']:.0%} (steal)")


def bench_section(b: dict[str, Any], plot: str | None) -> list[str]:
    rows = b["rows"]
    sockets = any(fig_of(r, "sockets") is not None for r in rows)
    m = b.get("machine") or {}
    out = [
        f"Machine: {m.get('cpu') or '?'}, {m.get('cores') or '?'} cores, Python {m.get('python', '?')}, "
        f"{m.get('platform', '?')}, libfabric {m.get('libfabric', '?')}; aiote {b.get('aiote', '?')}; "
        f"{b.get('date', '?')}; the CPU was "
        f"{b['cpu_busy_before']:.0%} busy before and {b['cpu_busy_after']:.0%} after the run (other "
        f"processes){_during(b)}. Median of {b['repeats']} (spread min-max in brackets); GB/s = 1e9 B/s; "
        "latency rows are one-way µs (round trip / 2), lower is better; ratio = aiote / C core, the "
        "median over the repeats of each repeat's ratio (the two run back to back, taking turns at "
        "going first)."
        + (SOCKETS_NOTE if sockets else ""),
        "",
        "| case | path | C core | aiote | ratio |" + (" bare sockets |" if sockets else ""),
        "| --- | --- | ---: | ---: | ---: |" + (" ---: |" if sockets else ""),
    ]
    if max(b["cpu_busy_before"], b["cpu_busy_after"], b.get("cpu_others_during", 0.0),
           b.get("cpu_steal_during", 0.0)) > 0.10:
        out[1:1] = ["", "**Noisy run**: other processes kept the CPU busy, so these figures are for shape, "
                    "not scale; regenerate on a quiet machine."]
    for r in rows:
        if r.get("unit") == "us":
            case = f"{LATENCY.get(r['mode'], r['mode'])} one-way p{r['size']} (µs)"
            if r.get("setting") == "low-latency":
                case += ", low-latency setting"
        else:
            case = f"{r['mode']} {size_label(r['size'])}" + (f" x{r['window']}" if r.get("window") else "")
        path = [r.get("provider", "") + (" arena" if r.get("memory") == "arena" else "")]
        if _varies(rows, "nics") and r.get("nics"):
            path.append(",".join(r["nics"]))
        if _varies(rows, "loop"):
            path.append(r.get("loop", ""))
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") else "-"
        out.append(f"| {case} | {' '.join(path)} | {_fig(fig_of(r, 'c'), r.get('c_spread'))} | "
                   f"{_fig(fig_of(r, 'py'), r.get('py_spread'))} | {ratio} |"
                   + (f" {_fig(fig_of(r, 'sockets'), r.get('sockets_spread'))} |" if sockets else ""))
    if plot:
        out += ["", f"![aiote bench: throughput against size, latency percentiles]({plot})"]
    return out


def peers_section(peers: list[dict[str, Any]], b: dict[str, Any] | None) -> list[str]:
    sizes = sorted({int(p["size"]) for p in peers if p.get("gbps") is not None and p.get("size")})
    keys: list[tuple[str, str, str]] = []
    tput: dict[tuple[str, str, str], dict[int, float]] = {}
    rtt: dict[tuple[str, str, str], float] = {}
    versus = [p for p in peers if p.get("mode") == "versus"]
    peers = [p for p in peers if p.get("mode") != "versus"]
    for p in peers:
        k = (str(p.get("library", "?")), str(p.get("path", "?")), str(p.get("mode", "?")))
        if k not in keys:
            keys.append(k)
        if p.get("gbps") is not None:
            tput.setdefault(k, {})[int(p["size"])] = float(p["gbps"])
        if p.get("rtt_us") is not None:
            rtt[k] = float(p["rtt_us"])
    rounds = max((int(p.get("rounds", 1)) for p in peers), default=1)
    how = (f"run by the same command in {rounds} rounds, each library and aiote once per round; median of "
           "the rounds" if rounds > 1 else "run by the same command")
    out = [
        f"Peer libraries on the same loopback, same sizes and window (`benchmarks/peers/run.py`, {how}; "
        "GB/s, round trip in µs):",
        "",
        "| library | path | mode | " + " | ".join(size_label(s) for s in sizes) + " | round trip (µs) |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in sizes) + " | ---: |",
    ]
    for k in keys:
        cells = [f"{tput[k][s]:.2f}" if s in tput.get(k, {}) else "-" for s in sizes]
        name = LIBRARY_LABEL.get(k[0], k[0])
        out.append(f"| {name} | {k[1]} | {k[2]} | " + " | ".join(cells) + f" | {rtt[k]:.1f} |"
                   if k in rtt else f"| {name} | {k[1]} | {k[2]} | " + " | ".join(cells) + " | - |")
    if versus:  # aiote against the peers round by round (benchmarks/peers/run.py --rounds)
        out += versus_lines(versus)
    elif b:  # aiote's writes against the best peer at each size and path (tcp: tcp, shm: same-host)
        for prov, label in (("tcp", "tcp"), ("shm", "same-host")):
            aiote = {r["size"]: fig_of(r, "py") for r in b["rows"]
                     if r["mode"] == "write" and r.get("provider") == prov and r.get("unit") == "GB/s"}
            parts = []
            for s in sizes:
                best = max(((v[s], k[0]) for k, v in tput.items()
                            if s in v and k[1].lower() == label and k[0] not in NOT_PEERS),
                           default=None)
                if best and aiote.get(s):
                    parts.append(f"{size_label(s)}: {aiote[s] / best[0]:.2f} (best: {best[1]})")
            if parts:
                out += ["", f"aiote write ({prov}) / best peer on a {label} path: " + "; ".join(parts) + "."]
        # WriteImm round trip (2 x the one-way p50) against UCXX's asyncio round trip
        for prov, label in (("tcp", "tcp"), ("shm", "same-host")):
            for setting in ("default", "low-latency"):
                one = [fig_of(r, "py") for r in b["rows"]
                       if r["mode"] == "imm-latency" and r.get("provider") == prov and r.get("size") == 50
                       and r.get("setting", "default") == setting]
                ux = rtt.get(("ucxx", label, "rtt"))
                if one and one[0] is not None and ux:
                    how = "" if setting == "default" else ", low-latency setting"
                    out += ["", f"aiote WriteImm round trip ({prov}{how}) {2 * one[0]:.1f} µs against UCXX "
                                f"asyncio ({label}) {ux:.1f} µs: ratio {2 * one[0] / ux:.2f} (target < 1)."]
    return out


def _ratios(v: dict[str, Any]) -> str:
    return ", ".join(f"{x:.2f}" for x in v.get("ratios", []))


def versus_lines(versus: list[dict[str, Any]]) -> list[str]:
    """The head-to-head lines: aiote against the best peer (writes) and against UCXX (round
    trip), each the median over the rounds of that round's ratio."""
    out: list[str] = []
    for prov, label in (("tcp", "tcp"), ("shm", "same-host")):
        for memory, how in (("numpy", ""), ("arena", ", buffers from Engine.alloc_host")):
            ws = [v for v in versus if v["kind"] == "write" and v["path"] == label
                  and v.get("memory", "numpy") == memory]
            if ws:
                parts = [f"{size_label(v['size'])}: {v['ratio']:.2f} (best: {'/'.join(v['best_peers'])}; "
                         f"ahead in {v['ahead']} of {v['rounds']}; rounds: {_ratios(v)})"
                         for v in sorted(ws, key=lambda v: v["size"])]
                out += ["", f"aiote write ({prov}{how}) / best peer on a {label} path, median of the "
                            "rounds' ratios: " + "; ".join(parts) + "."]
                bare = [v for v in sorted(ws, key=lambda v: v["size"]) if "sockets_gbps" in v]
                if bare:
                    figs = "; ".join(f"{size_label(v['size'])}: aiote {v['aiote_of_sockets']:.2f}, best peer "
                                     f"{v['peer_of_sockets']:.2f} (sockets {v['sockets_gbps']:.2f} GB/s)"
                                     for v in bare)
                    out += ["", f"Against bare sockets ({prov}: one plain TCP connection, no library, "
                                "measured by the same rounds' `aiote bench write`), median of the rounds' "
                                "ratios: " + figs + "."]
    for prov, label in (("tcp", "tcp"), ("shm", "same-host")):
        for setting in ("default", "low-latency", "send/recv"):
            for v in versus:
                if v["kind"] == "rtt" and v["path"] == label and v["setting"] == setting:
                    how = ", low-latency setting" if setting == "low-latency" else ""
                    what = "send/recv round trip (8 B)" if setting == "send/recv" else "WriteImm round trip"
                    out += ["", f"aiote {what} ({prov}{how}) against UCXX asyncio ({label}): "
                                f"median of the rounds' ratios **{v['ratio']:.2f}** (target < 1; faster in "
                                f"{v['ahead']} of {v['rounds']} rounds; rounds: {_ratios(v)}). Medians of "
                                f"the round trips: {v['aiote_rtt_us']:.1f} µs against "
                                f"{v['ucxx_rtt_us']:.1f} µs (ratio "
                                f"{v['aiote_rtt_us'] / v['ucxx_rtt_us']:.2f})."]
    return out


def _ci(ci: list[float] | None) -> str:
    """The median's 90% confidence interval (aiote bench's ``ratio_ci90``), as a clause."""
    return f"with a 90% confidence interval of {ci[0]:.3f} to {ci[1]:.3f} " if ci else ""


def _cpu(r: dict[str, Any]) -> str:
    """A write row's CPU seconds per GB at the writer (aiote bench's ``py_cpu_s_per_gb`` and
    ``c_cpu_s_per_gb``), as a sentence; empty when not measured."""
    py, c = r.get("py_cpu_s_per_gb"), r.get("c_cpu_s_per_gb")
    if not py or not c:
        return ""
    return (f" The writer's CPU per GB (medians): aiote {py['writer']:.3f} s, of which its event loop's "
            f"thread {py['writer_main']:.4f} s; the C core {c['writer']:.3f} s, of which its main "
            f"thread {c['writer_main']:.4f} s.")


def target_section(t: dict[str, Any]) -> list[str]:
    """The issue's target case (tcp writes of 1 MiB against the C core), measured alone with
    more repeats than the table (``aiote bench write --sizes 1MiB --repeats N``): the table's
    few repeats cannot resolve a few percent on a machine whose runs differ by a third."""
    out = []
    for r in t["rows"]:
        pairs = sorted(p / c for p, c in zip(r["py_runs"], r["c_runs"] or [], strict=False) if p and c)
        if not pairs:
            continue
        out.append(
            f"The target case alone ({r['mode']} {size_label(r['size'])} x{r['window']}, {r['provider']}, "
            f"{t['repeats']} paired repeats, a run of its own on {t.get('date', '?')}): "
            f"aiote / C core **{r['ratio']:.3f}** "
            f"{_ci(r.get('ratio_ci90'))}"
            f"(target >= 0.95; ratio of the medians {r['ratio_of_medians']:.3f}; C core "
            f"{_fig(fig_of(r, 'c'), r['c_spread'])} GB/s, "
            f"aiote {_fig(fig_of(r, 'py'), r['py_spread'])} GB/s; "
            f"the repeats' ratios from {pairs[0]:.2f} to {pairs[-1]:.2f}, "
            f"{sum(x >= 0.95 for x in pairs)} of {len(pairs)} at or above 0.95).{_cpu(r)}"
        )
    return out


def render(doc: str, bench: dict[str, Any] | None, peers: list[dict[str, Any]] | None,
           plot: str | None, target: dict[str, Any] | None = None) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"the document has no {BEGIN} ... {END} section to rewrite")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = ["<!-- generated by scripts/bench-docs.sh (benchmarks/render_docs.py): edits are lost -->", ""]
    if bench:
        body += bench_section(bench, plot)
    if target:
        body += ["", *target_section(target)]
    if peers:
        body += ["", *peers_section(peers, bench)]
    return head + BEGIN + "\n" + "\n".join(body) + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, action="append",
                    help="aiote bench --json output (repeatable: the rows of later runs are appended)")
    ap.add_argument("--peers", type=Path, help="benchmarks/peers/run.py --json output")
    ap.add_argument("--plot", help="the plot, relative to the document (e.g. bench.png)")
    ap.add_argument("--target", type=Path, help="aiote bench --json of the target case, measured alone")
    default_doc = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    ap.add_argument("--doc", type=Path, default=default_doc)
    a = ap.parse_args(argv)
    bench = None
    for path in a.bench or []:
        got = json.loads(path.read_text())
        if bench is None:
            bench = got
        else:
            bench["rows"] += got["rows"]
            bench["cpu_busy_before"] = max(bench["cpu_busy_before"], got["cpu_busy_before"])
            bench["cpu_busy_after"] = max(bench["cpu_busy_after"], got["cpu_busy_after"])
            for k in ("cpu_others_during", "cpu_steal_during"):
                if k in got:
                    bench[k] = max(bench.get(k, 0.0), got[k])
    peers = json.loads(a.peers.read_text()) if a.peers and a.peers.exists() else None
    target = json.loads(a.target.read_text()) if a.target and a.target.exists() else None
    a.doc.write_text(render(a.doc.read_text(), bench, peers, a.plot, target))
    sys.stderr.write(f"rewrote the generated section of {a.doc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
