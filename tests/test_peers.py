"""benchmarks/peers/: the comparison logic of run.py (always), the clear skip line of each bench
when its library is absent (always), and a short real run of each bench where its library is
importable (CI has none of them: those skip).

The peer libraries usually live in .venv-peers (scripts/setup-peers.sh), not in the test
interpreter: ``AIOTE_PEERS_PYTHON=.venv-peers/bin/python pytest tests/test_peers.py`` runs the
real benches with that interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
MODULES = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine", "ucxx": "ucxx", "gloo": "torch.distributed"}


def _load_run() -> ModuleType:
    sys.path.insert(0, str(PEERS))
    spec = importlib.util.spec_from_file_location("peers_run", PEERS / "run.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run = _load_run()


def _aiote_row(
    mode: str, size: int, value: float, provider: str = "tcp", loop: str = "asyncio"
) -> dict[str, Any]:
    # as aiote bench writes it: one-way microseconds in py_us on latency rows, GB/s in py_gbps
    key = "py_us" if mode.endswith("latency") else "py_gbps"
    return {"mode": mode, "size": size, "provider": provider, "loop": loop, "window": 64, key: value}


def _write(lib: str, path: str, size: int, gbps: float) -> dict[str, Any]:
    return {
        "library": lib,
        "path": path,
        "mode": "write",
        "size": size,
        "gbps": gbps,
        "spread": [gbps, gbps],
        "window": 64,
    }


def _rtt(lib: str, path: str, p50: float, p99: float) -> dict[str, Any]:
    return {"library": lib, "path": path, "mode": "rtt", "size": 8, "rtt_us_p50": p50, "rtt_us_p99": p99}


KIB64, MIB1 = 64 << 10, 1 << 20

AIOTE = {
    "provider": ["tcp", "shm"],
    "rows": [
        _aiote_row("write", KIB64, 3.0),
        _aiote_row("write", MIB1, 4.0),
        _aiote_row("write", MIB1, 9.9, loop="trio"),  # another loop: asyncio is preferred
        _aiote_row("read", MIB1, 7.0),  # not a write: ignored
        _aiote_row("paged", KIB64, 8.0),  # ignored
        _aiote_row("imm-latency", 50, 20.0),  # one-way µs: round trip 40
        _aiote_row("imm-latency", 99, 50.0),
        _aiote_row("write", MIB1, 8.0, provider="shm"),
        _aiote_row("imm-latency", 50, 5.0, provider="shm"),
    ],
}

PEER_RECORDS = [
    _write("nixl", "tcp", KIB64, 2.0),
    _write("gloo", "tcp", KIB64, 2.5),
    _write("nixl", "tcp", MIB1, 5.0),
    _write("mooncake", "tcp", MIB1, 1.0),
    _write("nixl", "same-host", MIB1, 10.0),  # same-host never counts against tcp
    _write("ucxx", "same-host", MIB1, 1.0),
    _rtt("ucxx", "tcp", 80.0, 200.0),
    _rtt("ucxx", "same-host", 20.0, 60.0),
    _rtt("nixl", "tcp", 30.0, 90.0),  # not UCXX: not the round trip aiote is held to
]


def test_load_aiote_takes_writes_per_path_and_doubles_one_way_latency() -> None:
    got = run.load_aiote(AIOTE, window=64)
    assert got["write"] == {("tcp", KIB64): 3.0, ("tcp", MIB1): 4.0, ("same-host", MIB1): 8.0}
    assert got["rtt_us"] == {"tcp": {"p50": 40.0, "p99": 100.0}, "same-host": {"p50": 10.0}}


def test_compare_ratio_to_best_peer_on_the_same_path() -> None:
    cmp = run.compare(run.load_aiote(AIOTE, window=64), PEER_RECORDS)
    by = {(w["path"], w["size"]): w for w in cmp["write"]}
    assert [(w["path"], w["size"]) for w in cmp["write"]] == [
        ("tcp", KIB64),
        ("tcp", MIB1),
        ("same-host", MIB1),
    ]
    assert by[("tcp", KIB64)]["best_peer"] == "gloo"
    assert by[("tcp", KIB64)]["ratio"] == pytest.approx(3.0 / 2.5)
    assert by[("tcp", MIB1)]["best_peer"] == "nixl"
    assert by[("tcp", MIB1)]["ratio"] == pytest.approx(4.0 / 5.0)
    assert by[("same-host", MIB1)]["best_peer"] == "nixl"
    assert by[("same-host", MIB1)]["ratio"] == pytest.approx(0.8)
    rtt = {r["path"]: r for r in cmp["rtt"]}
    assert rtt["tcp"]["ucxx_rtt_us_p50"] == 80.0
    assert rtt["tcp"]["ratio"] == pytest.approx(40.0 / 80.0)
    assert rtt["same-host"]["ratio"] == pytest.approx(10.0 / 20.0)
    text = run.comparison_table(cmp)
    assert "best peer gloo 2.50 GB/s, ratio 1.20" in text
    assert "aiote/UCXX 0.50" in text


def test_compare_without_a_peer_at_that_size_or_path() -> None:
    aiote = {"rows": [_aiote_row("write", 4096, 1.0), _aiote_row("imm-latency", 50, 10.0, provider="shm")]}
    cmp = run.compare(run.load_aiote(aiote), [_write("nixl", "tcp", KIB64, 2.0)])
    assert cmp["write"] == [
        {
            "path": "tcp",
            "size": 4096,
            "aiote_gbps": 1.0,
            "best_peer": None,
            "best_peer_gbps": None,
            "ratio": None,
        }
    ]
    assert cmp["rtt"][0]["ucxx_rtt_us_p50"] is None and cmp["rtt"][0]["ratio"] is None
    assert "no peer measured" in run.comparison_table(cmp)


def _round(aiote_64k: float, nixl_64k: float, gloo_64k: float, one_way: float, ucxx: float,
           low_one_way: float | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One round of ``run.py --rounds``: the peers' records and aiote's jobs (JSON by job)."""
    recs = [_write("nixl", "tcp", KIB64, nixl_64k), _write("gloo", "tcp", KIB64, gloo_64k),
            _rtt("ucxx", "tcp", ucxx, 2 * ucxx)]
    jobs: dict[str, Any] = {
        "write": {"provider": "tcp", "rows": [_aiote_row("write", KIB64, aiote_64k)]},
        "imm-latency": {"provider": "tcp", "rows": [_aiote_row("imm-latency", 50, one_way),
                                                     _aiote_row("imm-latency", 99, 2 * one_way)]},
    }
    if low_one_way is not None:
        jobs["imm-latency-low"] = {"provider": "tcp", "setting": "low-latency",
                                   "rows": [_aiote_row("imm-latency", 50, low_one_way)]}
    return recs, jobs


def test_head_to_head_compares_within_each_round_then_takes_the_median() -> None:
    # the machine drifts: round 2 is twice as fast for everyone. Compared across rounds (aiote's
    # fast round against the peers' slow one) aiote would look 2x ahead; round by round it is not.
    rounds = [
        _round(1.0, 1.1, 0.5, one_way=50.0, ucxx=80.0, low_one_way=20.0),
        _round(2.0, 2.2, 1.0, one_way=25.0, ucxx=40.0, low_one_way=10.0),
        _round(1.2, 1.0, 0.9, one_way=60.0, ucxx=100.0),  # no low-latency run this round
    ]
    got = run.head_to_head(rounds, window=64)
    w = next(v for v in got if v["kind"] == "write")
    assert (w["path"], w["size"], w["rounds"]) == ("tcp", KIB64, 3)
    assert w["ratios"] == pytest.approx([1.0 / 1.1, 2.0 / 2.2, 1.2])
    assert w["ratio"] == pytest.approx(1.0 / 1.1)  # the median of the three
    assert w["ahead"] == 1 and w["best_peers"] == ["nixl"]
    assert w["aiote_gbps"] == pytest.approx(1.2) and w["best_peer_gbps"] == pytest.approx(1.1)
    rtt = {v["setting"]: v for v in got if v["kind"] == "rtt"}
    # aiote's round trip is twice its one-way figure
    assert rtt["default"]["ratios"] == pytest.approx([100 / 80, 50 / 40, 120 / 100])
    assert rtt["default"]["ahead"] == 0 and rtt["default"]["rounds"] == 3
    assert rtt["low-latency"]["ratios"] == pytest.approx([40 / 80, 20 / 40])
    assert rtt["low-latency"]["ahead"] == 2 and rtt["low-latency"]["rounds"] == 2
    text = run.versus_table(got)
    assert "ratio 0.91 (ahead in 1 of 3 rounds" in text
    assert "low-latency: aiote 30.0 us, UCXX asyncio 60.0 us, ratio 0.50 (faster in 2 of 2 rounds" in text


def test_head_to_head_sets_the_send_recv_round_trip_against_ucxx_apart_from_writeimm() -> None:
    """The ``sendrecv-latency`` job (aiote's 8-byte send/recv ping-pong) is compared with UCXX's
    round trip (a send/recv ping-pong too) as a setting of its own; its rows never stand in for
    the WriteImm round trip, nor the WriteImm rows for it."""
    rounds = []
    for one_way, ucxx, sr in ((50.0, 80.0, 30.0), (25.0, 40.0, 25.0), (60.0, 100.0, 45.0)):
        recs, jobs = _round(1.0, 1.1, 0.5, one_way=one_way, ucxx=ucxx)
        jobs["sendrecv-latency"] = {"provider": "tcp", "rows": [_aiote_row("sendrecv-latency", 50, sr),
                                                                 _aiote_row("sendrecv-latency", 99, 3 * sr)]}
        rounds.append((recs, jobs))
    got = run.head_to_head(rounds, window=64)
    rtt = {v["setting"]: v for v in got if v["kind"] == "rtt"}
    assert rtt["send/recv"]["ratios"] == pytest.approx([60 / 80, 50 / 40, 90 / 100])
    assert rtt["send/recv"]["ahead"] == 2 and rtt["send/recv"]["aiote_rtt_us"] == pytest.approx(60.0)
    assert rtt["default"]["ratios"] == pytest.approx([100 / 80, 50 / 40, 120 / 100])
    # a WriteImm job's rows are not read as send/recv, nor the send/recv job's as WriteImm
    assert run.load_aiote([rounds[0][1]["imm-latency"]], 64, run._SENDRECV_MODES)["rtt_us"] == {}
    assert run.load_aiote([rounds[0][1]["sendrecv-latency"]], 64)["rtt_us"] == {}
    assert "round trip tcp       send/recv  : aiote 60.0 us, UCXX asyncio 80.0 us" in run.versus_table(got)


def test_head_to_head_sets_aiote_and_the_best_peer_against_bare_sockets_of_the_same_round(
    tmp_path: Path,
) -> None:
    # aiote bench write measures one plain TCP connection beside its tcp rows (sockets_gbps):
    # it is no peer (never the best peer), but both aiote and the best peer are read against it
    rounds = []
    for aiote_64k, nixl_64k, bare in [(1.0, 1.1, 2.0), (2.0, 2.2, 2.5), (1.2, 1.0, 1.5)]:
        recs, jobs = _round(aiote_64k, nixl_64k, 0.5, 50.0, 80.0)
        jobs["write"]["rows"][0]["sockets_gbps"] = bare
        rounds.append((recs, jobs))
    assert run.load_sockets(rounds[0][1]["write"]) == {("tcp", KIB64): 2.0}
    w = next(v for v in run.head_to_head(rounds, 64) if v["kind"] == "write")
    assert w["best_peers"] == ["nixl"] and w["ratio"] == pytest.approx(1.0 / 1.1)
    assert w["sockets_gbps"] == pytest.approx(2.0)
    assert w["aiote_of_sockets"] == pytest.approx(0.8)  # median of 0.5, 0.8, 0.8
    assert w["peer_of_sockets"] == pytest.approx(0.667, abs=1e-3)  # median of 0.55, 0.88, 0.667
    assert "bare sockets 2.00 GB/s: aiote at 0.80 of them, the best peer at 0.67" in run.versus_table([w])
    text = _render_peers(tmp_path, [w])
    assert "Against bare sockets (tcp: one plain TCP connection" in text
    assert "64 KiB: aiote 0.80, best peer 0.67 (sockets 2.00 GB/s)" in text


def _render_peers(tmp_path: Path, records: list[dict[str, Any]]) -> str:
    """The generated section benchmarks/render_docs.py writes for these peer records."""
    (tmp_path / "peers.json").write_text(json.dumps(records))
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:begin -->\n<!-- bench:end -->\n")
    r = subprocess.run(
        [sys.executable, str(PEERS.parent / "render_docs.py"), "--peers", str(tmp_path / "peers.json"),
         "--doc", str(doc)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return doc.read_text()


def test_head_to_head_keeps_arena_writes_apart_from_ordinary_ones(tmp_path: Path) -> None:
    # aiote's write-arena job (buffers from Engine.alloc_host) is compared with the same peers
    # on the same-host path, as a row of its own beside the ordinary-memory one
    rounds = []
    for k, (plain, arena, nixl) in enumerate([(10.0, 30.0, 12.0), (11.0, 33.0, 13.0)]):
        recs, jobs = _round(1.0, 1.1, 0.5, 50.0, 80.0)
        recs.append({**_write("nixl", "same-host", KIB64, nixl), "round": k})
        jobs["write"]["rows"].append(_aiote_row("write", KIB64, plain, provider="shm"))
        jobs["write-arena"] = {"provider": "shm", "rows": [_aiote_row("write", KIB64, arena, provider="shm")]}
        rounds.append((recs, jobs))
    got = [v for v in run.head_to_head(rounds, 64) if v["kind"] == "write" and v["path"] == "same-host"]
    assert [(v["memory"], v["size"], v["rounds"]) for v in got] == [("numpy", KIB64, 2), ("arena", KIB64, 2)]
    assert got[0]["ratios"] == pytest.approx([10 / 12, 11 / 13]) and got[0]["ahead"] == 0
    assert got[1]["ratios"] == pytest.approx([30 / 12, 33 / 13]) and got[1]["ahead"] == 2
    assert "aiote (arena) 31.50 GB/s" in run.versus_table(got)
    text = _render_peers(tmp_path, got)
    assert "aiote write (shm) / best peer on a same-host path" in text
    assert "aiote write (shm, buffers from Engine.alloc_host) / best peer on a same-host path" in text


def test_merge_rounds_takes_medians_and_spreads_over_every_run() -> None:
    recs = [
        {**_write("nixl", "tcp", KIB64, 1.0), "runs": [0.9, 1.0, 1.1], "round": 0},
        {**_write("nixl", "tcp", KIB64, 3.0), "runs": [3.0], "round": 1},
        {**_write("nixl", "tcp", KIB64, 2.0), "round": 2},
        {**_rtt("ucxx", "tcp", 80.0, 200.0), "round": 0},
        {**_rtt("ucxx", "tcp", 120.0, 100.0), "round": 1},
    ]
    got = {(r["library"], r["mode"]): r for r in run.merge_rounds(recs)}
    w = got[("nixl", "write")]
    assert w["gbps"] == 2.0 and w["spread"] == [0.9, 3.0] and w["rounds"] == 3 and "round" not in w
    r = got[("ucxx", "rtt")]
    assert r["rtt_us_p50"] == 100.0 and r["rtt_us_p99"] == 150.0 and r["rounds"] == 2


def test_render_docs_prints_the_head_to_head_of_the_rounds(tmp_path: Path) -> None:
    rounds = [_round(1.0, 1.1, 0.5, 50.0, 80.0, 20.0), _round(2.0, 1.5, 1.0, 25.0, 40.0, 10.0)]
    got = run.head_to_head(rounds, 64)
    peers = [*run.merge_rounds([{**r, "round": 0} for r in _round(1.0, 1.1, 0.5, 50.0, 80.0)[0]]), *got,
             {"library": "aiote", "path": "tcp", "mode": "write", "size": KIB64, "gbps": 9.0, "rounds": 2}]
    text = _render_peers(tmp_path, peers)
    assert "in 2 rounds, each library and aiote once per round" in text
    assert "| aiote | tcp | write | 9.00 |" in text  # aiote's row beside the peers'
    ratio = (1.0 / 1.1 + 2.0 / 1.5) / 2
    assert f"64 KiB: {ratio:.2f} (best: nixl; ahead in 1 of 2; rounds: 0.91, 1.33)" in text
    assert ("aiote WriteImm round trip (tcp, low-latency setting) against UCXX asyncio (tcp): median of the "
            "rounds' ratios **0.50** (target < 1; faster in 2 of 2 rounds; rounds: 0.50, 0.50)") in text
    assert "Medians of the round trips: 30.0 µs against 60.0 µs (ratio 0.50)" in text
    assert "faster in 0 of 2 rounds" in text  # the default round trips: 100/80 and 50/40


def test_load_aiote_is_tolerant_of_older_and_nested_formats() -> None:
    # main's first format: provider only at the top, no loop in rows; two files given as a list
    old_tcp = {
        "provider": "tcp",
        "rows": [
            {"mode": "write", "size": MIB1, "py_gbps": 2.0},
            {"mode": "imm-latency", "size": 50, "py_gbps": 7.5},
        ],
    }
    old_shm = {"provider": "shm", "rows": [{"mode": "write", "size": MIB1, "py_gbps": 6.0}]}
    # a hypothetical nested one with explicit round trips and a "path"
    nested = {
        "runs": [
            {
                "path": "same-host",
                "results": [{"mode": "imm-latency", "rtt_us_p50": 12.0, "rtt_us_p99": 30.0}],
            }
        ]
    }
    got = run.load_aiote([old_tcp, old_shm, nested])
    assert got["write"] == {("tcp", MIB1): 2.0, ("same-host", MIB1): 6.0}
    assert got["rtt_us"] == {"tcp": {"p50": 15.0}, "same-host": {"p50": 12.0, "p99": 30.0}}
    assert run.load_aiote({"nothing": 1}) == {"write": {}, "rtt_us": {}}


def test_table_lists_figures_and_skips() -> None:
    text = run.table(PEER_RECORDS, {"mooncake": "mooncake not installed"})
    assert "nixl      tcp" in text and "5.00 (5.00-5.00)" in text
    assert "80 / 200" in text
    assert "mooncake  skipped: mooncake not installed" in text


def _importable_here(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.parametrize("lib", sorted(MODULES))
def test_bench_prints_one_clear_line_when_its_library_is_absent(lib: str) -> None:
    if _importable_here(MODULES[lib].split(".")[0]):
        pytest.skip(f"{lib} is installed here")
    out = subprocess.run(
        [sys.executable, str(PEERS / f"{lib}_bench.py")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(f"skipped: {lib} not installed")
    assert "aiote[peers]" in out.stdout.splitlines()[0]


def _peers_python(lib: str) -> str:
    """The interpreter that has ``lib``, or a skip."""
    python = os.environ.get("AIOTE_PEERS_PYTHON")
    mod = MODULES[lib]
    if python:
        ok = subprocess.run([python, "-c", f"import {mod}"], capture_output=True, timeout=120).returncode == 0
        if ok:
            return python
        pytest.skip(f"{mod} not importable with {python}")
    if not _importable_here(mod.split(".")[0]):
        pytest.skip(
            f"{mod} not installed (pip install 'aiote[peers]'; or AIOTE_PEERS_PYTHON=.venv-peers/bin/python)"
        )
    return sys.executable


@pytest.mark.slow
@pytest.mark.parametrize("lib", sorted(MODULES))
def test_bench_runs_both_sides_and_reports_records(lib: str) -> None:
    python = _peers_python(lib)
    cmd = [
        python,
        str(PEERS / f"{lib}_bench.py"),
        "--sizes",
        "64KiB",
        "--window",
        "8",
        "--repeats",
        "2",
        "--total",
        "4MiB",
        "--iters",
        "50",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = [json.loads(ln[len("RESULT ") :]) for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    writes = [r for r in records if r.get("mode") == "write"]
    rtts = [r for r in records if r.get("mode") == "rtt"]
    paths = {"nixl": {"tcp", "same-host"}, "ucxx": {"tcp", "same-host"}}.get(lib, {"tcp"})
    assert {r["path"] for r in writes} == paths
    assert {r["path"] for r in rtts} == paths
    for r in writes:
        assert r["library"] == lib and r["size"] == 64 << 10 and r["window"] == 8
        assert 0 < r["spread"][0] <= r["gbps"] <= r["spread"][1] < 200
    for r in rtts:
        assert 0 < r["rtt_us_p50"] <= r["rtt_us_p99"] < 10_000_000


def test_run_one_kills_a_hung_bench_and_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    hung = tmp_path / "hung_bench.py"
    hung.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        'print(\'RESULT {"library": "x", "path": "tcp", "mode": "write", "size": 1, "gbps": 1.0, '
        '"spread": [1.0, 1.0], "window": 64}\', flush=True)\n'
        "time.sleep(300)\n"
    )
    import time

    t0 = time.monotonic()
    records, why = run.run_one(sys.executable, "x", [], timeout=3, echo=False, script=hung)
    assert time.monotonic() - t0 < 30
    assert why == "timed out after 3 s"
    assert records == [_write("x", "tcp", 1, 1.0)]
    child = int(pidfile.read_text())
    for _ in range(50):
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the bench's child outlived the timeout")


def test_run_one_reads_the_skip_line(tmp_path: Path) -> None:
    script = tmp_path / "absent_bench.py"
    script.write_text("print('skipped: absent not installed (pip install x)')\n")
    records, why = run.run_one(sys.executable, "absent", [], timeout=60, echo=False, script=script)
    assert records == [{"skipped": "absent not installed (pip install x)"}]
    assert why is None
