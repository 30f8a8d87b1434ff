"""The examples and the demo are runnable programs: run each as a user would."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aiote

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "verified" in out.stdout or "counted" in out.stdout


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_demo_verifies_every_byte(backend: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "write-demo", "--size", "64MiB", "--chunk", "1MiB",
         "--backend", backend],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["verified"] is True
    assert result["bytes"] == 64 << 20 and result["chunks"] == 64
    assert result["write_gbps"] > 0 and result["receive_gbps"] > 0
    assert "every byte verified" in out.stderr


def test_demo_rejects_bad_size() -> None:
    out = subprocess.run([sys.executable, "-m", "aiote", "write-demo", "--size", "7"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "multiple of 8" in out.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_kv_demo_verifies_every_page(backend: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "demo", "--requests", "24", "--layers", "8", "--max-tokens", "1024",
         "--backend", backend],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("requests", "verified", "failed", "kv_bytes", "throughput_gbps", "transfer_ms_p50",
                "transfer_ms_p99", "tail_ms_p50"):
        assert key in result
    assert result["verified"] is True and result["failed"] == 0
    assert result["requests"] == result["finished"] == 24
    assert result["kv_bytes"] > 0 and result["throughput_gbps"] > 0
    # a decoder left halfway and a new one joined; every decoder verified what it got
    assert len(result["decoders"]) == 3
    assert sum(d["verified"] for d in result["decoders"]) == 24
    assert all(d["bad"] == 0 and d["exit"] == 0 for d in result["decoders"])
    assert "every page verified" in out.stderr


def test_kv_demo_with_decoders_discovered_through_etcd() -> None:
    from _etcd import etcd_cluster, etcd_unavailable

    why = etcd_unavailable()
    if why:
        pytest.skip(why)
    with etcd_cluster(1) as etcd:
        out = subprocess.run(
            [sys.executable, "-m", "aiote", "demo", "--etcd", etcd.url, "--ttl", "2", "--requests", "12",
             "--layers", "4", "--max-tokens", "512", "--backend", "trio"],
            capture_output=True, text=True, timeout=300,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["etcd"] == etcd.url and result["verified"] is True and result["failed"] == 0
    assert result["finished"] == 12 and sum(d["verified"] for d in result["decoders"]) == 12
    assert f"decoders discovered through etcd at {etcd.url}" in out.stderr


def test_aiote_info_reports_providers_and_the_default_choice() -> None:
    out = subprocess.run([sys.executable, "-m", "aiote", "info", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["aiote"] and info["libfabric"].startswith("1.")
    names = [p["name"] for p in info["providers"]]
    assert names == ["tcp", "shm", "verbs", "efa"]
    tcp = info["providers"][0]
    assert tcp["available"] and any(n["domain"] == "lo" for n in tcp["nics"])
    for n in tcp["nics"]:
        assert n["rma"] is True and n["remote_cq_data_bytes"] >= 4 and n["max_msg_size"] > 0
        assert n["iov_limit"] >= 1 and n["provider"].startswith("tcp")
        assert n["hmem"] is False  # Debian's libfabric: no CUDA memory on tcp
        assert isinstance(n["mr_mode"], list) and all(isinstance(m, str) for m in n["mr_mode"])
        assert n["link_speed_bps"] is None or n["link_speed_bps"] > 0
    d = info["default"]
    assert d["provider"] == "tcp" and d["nics"] == ["lo"] and d["usable"] is True and d["why"]
    # the host's defaults, as open_engine() takes them here (an engine opened with none says so)
    assert d["cores"] == len(os.sched_getaffinity(0))
    assert d["streams"] == aiote.default_streams() and d["copy_threads"] == aiote.default_copy_threads()
    assert d["follow_loop"] is aiote.follow_loop_default()

    async def opened() -> tuple[int, int]:
        async with aiote.open_engine() as e:
            return e.stats()["pollers"], sum(r.provider.startswith("tcp") for r in e.rails)

    pollers, tcp_rails = anyio.run(opened)
    assert (d["pollers"], d["streams"]) == (pollers, tcp_rails)
    text = subprocess.run([sys.executable, "-m", "aiote", "info"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "open_engine() picks" in text.stdout and "lo" in text.stdout


BENCH_QUICK = ["--sizes", "64KiB", "--page-sizes", "4KiB", "--total", "8MiB", "--pages", "500",
               "--calls", "1", "--iters", "100", "--repeats", "1"]


def _check_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:  # fields and sane values, not speed
        # each figure is named by its unit: one-way microseconds on latency rows, GB/s otherwise
        latency = r["mode"].endswith("latency")
        assert r["unit"] == ("us" if latency else "GB/s")
        unit, other = ("us", "gbps") if latency else ("gbps", "us")
        assert not any(k.endswith(f"_{other}") for k in r), sorted(r)
        py, c = r[f"py_{unit}"], r[f"c_{unit}"]
        assert 0 < py < 1e6 and 0 < c < 1e6
        assert r["py_spread"][0] <= py <= r["py_spread"][1]
        assert r["c_spread"][0] <= c <= r["c_spread"][1]
        # the ratio pairs each repeat's two runs; the ratio of the medians beside it
        assert len(r["py_runs"]) == len(r["c_runs"]) >= 1  # by repeat, None where one is missing
        pairs = [p / c for p, c in zip(r["py_runs"], r["c_runs"], strict=True) if p and c]
        assert abs(r["ratio"] - statistics.median(pairs)) < 1e-9
        assert abs(r["ratio_of_medians"] - py / c) < 1e-9
        ci = r["ratio_ci90"]  # the median ratio's 90% confidence interval, from 5 repeats
        assert ci is None if len(pairs) < 5 else min(pairs) <= ci[0] <= r["ratio"] <= ci[1] <= max(pairs)
        assert py == statistics.median(v for v in r["py_runs"] if v is not None)
        assert c == statistics.median(v for v in r["c_runs"] if v is not None)
        if not latency:
            assert py < 1000  # GB/s over loopback
        if r["mode"] == "write":  # the writer's CPU seconds per GB: all its threads, its posting one
            py_cpu, c_cpu = r["py_cpu_s_per_gb"], r["c_cpu_s_per_gb"]
            assert 0 < py_cpu["writer_main"] <= py_cpu["writer"] * 1.01 < 100
            assert 0 <= c_cpu["writer_main"] < 100 and 0 < c_cpu["writer"] < 100
        else:
            assert "py_cpu_s_per_gb" not in r
        if r["mode"] == "write" and r["provider"] == "tcp" and r.get("memory") != "arena":
            # beside it, one bare TCP connection moving the same messages (no libfabric)
            assert 0 < r["sockets_gbps"] < 1000
            assert r["sockets_spread"][0] <= r["sockets_gbps"] <= r["sockets_spread"][1]
        elif latency and r["provider"] in ("tcp", "shm"):
            # beside it, the same event loop's own 8-byte ping-pong over a plain socket (no library)
            assert 0 < r["sockets_us"] < 1e6 and "sockets_gbps" not in r
            assert r["sockets_spread"][0] <= r["sockets_us"] <= r["sockets_spread"][1]
        else:
            assert r.get("sockets_gbps") is None and r.get("sockets_spread") is None


def test_bench_settings_carry_every_option_for_the_c_core_arguments() -> None:
    """``aiote.cli.bench.settings``: what a benchmark builds the C core's arguments from
    (``bench_weights`` does), with every ``aiote bench`` option at its default, so a new option
    cannot break it; an unknown name is refused."""
    from aiote.cli.bench import c_args, settings

    ns = settings(arena=True, total=1 << 30, streams=4)
    got = c_args(ns, ("write", 16 << 20, 8))
    threads = got[got.index("--copy-threads") + 1]
    assert got[:4] == ["write", str(16 << 20), "8", str(1 << 30)]
    assert threads == str(aiote.default_copy_threads()) and got[got.index("--streams") + 1] == "4"
    plain = c_args(settings(), ("sendrecv", 4096, 16))
    assert "--arena" not in plain and "--copy-out" not in plain
    assert "--copy-out" in c_args(settings(c_copy_out=True), ("sendrecv", 4096, 16))
    with pytest.raises(ValueError, match="not aiote bench settings: bogus"):
        settings(bogus=1)


def test_median_confidence_interval_is_distribution_free_and_covers_the_median() -> None:
    from aiote.cli._benchout import median_ci

    assert median_ci([1.0, 2.0, 3.0, 4.0]) is None  # too few to bound the median at 90%
    assert median_ci([5.0, 1.0, 3.0, 2.0, 4.0]) == [1.0, 5.0]  # 1 - 2 / 32 >= 0.90
    assert median_ci([float(x) for x in range(1, 16)]) == [4.0, 12.0]  # ranks 4 and 12 of 15
    assert median_ci([float(x) for x in range(1, 41)]) == [15.0, 26.0]
    # it covers the true median of skewed draws at least 90% of the time
    rng = np.random.default_rng(5)
    draws = rng.lognormal(0.0, 0.5, size=(2000, 15))
    hits = sum(ci[0] <= 1.0 <= ci[1] for ci in (median_ci(list(row)) for row in draws) if ci)
    assert hits / len(draws) >= 0.90


def test_aiote_bench_all_beside_the_c_core_with_plot(tmp_path: Path) -> None:
    out_file, png = tmp_path / "bench.json", tmp_path / "bench.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "all", *BENCH_QUICK, "--json", str(out_file), *plot],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == result
    assert result["c_baseline"] is True and result["loop"] == "asyncio" and result["window"] == 64
    assert result["provider"] == "tcp" and result["repeats"] == 1 and result["connect"] is None
    assert [(r["mode"], r["size"], r["window"]) for r in result["rows"]] == [
        ("write", 65536, 64), ("read", 65536, 64), ("sendrecv", 65536, 16), ("paged", 4096, None),
        ("imm-latency", 50, None), ("imm-latency", 99, None),
        ("sendrecv-latency", 50, None), ("sendrecv-latency", 99, None),
    ]
    _check_rows(result["rows"])
    assert "C core" in out.stdout and "ratio" in out.stdout and "bare sockets" in out.stdout
    assert "read 64 KiB x64" in out.stdout and "send/recv one-way p50" in out.stdout
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_aiote_bench_low_latency_setting_and_its_docs_rows(tmp_path: Path) -> None:
    out_file = tmp_path / "lowlat.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "imm-latency", "--low-latency", *BENCH_QUICK,
         "--provider", "tcp,shm", "--json", str(out_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["setting"] == "low-latency" and "low-latency setting" in out.stdout
    assert [(r["provider"], r["size"], r["setting"]) for r in result["rows"]] == [
        (p, k, "low-latency") for p in ("tcp", "shm") for k in (50, 99)
    ]
    _check_rows(result["rows"])
    # the docs renderer merges a default run and a low-latency run, and puts each round trip
    # beside UCXX's; the default run is written as older aiote wrote it (microseconds in the
    # *_gbps fields, as in docs/*.json of earlier runs), which the renderer still reads
    default = json.loads(out_file.read_text())
    default["setting"] = "default"
    for r in default["rows"]:
        r["setting"] = "default"
        r["py_gbps"] = 2 * r.pop("py_us")
        r["c_gbps"] = r.pop("c_us")
    (tmp_path / "default.json").write_text(json.dumps(default))
    peers = [{"library": "ucxx", "path": p, "mode": "rtt", "size": 8, "rtt_us": 100.0}
             for p in ("tcp", "same-host")]
    (tmp_path / "peers.json").write_text(json.dumps(peers))
    doc = tmp_path / "doc.md"
    doc.write_text("head\n<!-- bench:begin -->\nold\n<!-- bench:end -->\ntail\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "render_docs.py"),
         "--bench", str(tmp_path / "default.json"), "--bench", str(out_file),
         "--peers", str(tmp_path / "peers.json"), "--doc", str(doc)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    text = doc.read_text()
    assert "old" not in text and text.startswith("head") and text.endswith("tail\n")
    assert text.count("WriteImm one-way p50 (µs), low-latency setting") == 2  # tcp and shm
    for prov in ("tcp", "shm"):
        low = next(x["py_us"] for x in result["rows"] if x["provider"] == prov and x["size"] == 50)
        assert f"aiote WriteImm round trip ({prov}, low-latency setting) {2 * low:.1f} µs" in text
        assert f"aiote WriteImm round trip ({prov}) {4 * low:.1f} µs" in text


def test_aiote_bench_arena_buffers_on_both_sides_and_the_c_core(tmp_path: Path) -> None:
    out_file = tmp_path / "arena.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "write,read", "--arena", "--provider", "shm", *BENCH_QUICK,
         "--copy-threads", "3", "--json", str(out_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["arena"] is True and result["provider"] == "shm" and result["copy_threads"] == 3
    assert [(r["mode"], r["size"], r["memory"]) for r in result["rows"]] == [
        ("write", 65536, "arena"), ("read", 65536, "arena")
    ]
    _check_rows(result["rows"])
    assert "shm arena" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "aiote", "bench", "write,bogus"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown mode 'bogus'" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "aiote", "bench", "write", "--copy-threads", "9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--copy-threads must be between 1 and 8" in bad.stderr


def test_aiote_bench_streams_and_pollers_on_both_sides_and_the_c_core(tmp_path: Path) -> None:
    out_file = tmp_path / "streams.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "write,read", *BENCH_QUICK, "--sizes", "1MiB", "--total",
         "32MiB", "--streams", "2", "--pollers", "2", "--json", str(out_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["streams"] == 2 and result["pollers"] == 2
    assert [(r["mode"], r["size"], r["streams"], r["pollers"]) for r in result["rows"]] == [
        ("write", 1 << 20, 2, 2), ("read", 1 << 20, 2, 2)
    ]
    _check_rows(result["rows"])
    bad = subprocess.run([sys.executable, "-m", "aiote", "bench", "write", "--pollers", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--pollers must be between 1 and 16" in bad.stderr


def test_aiote_bench_sendrecv_latency_alone(tmp_path: Path) -> None:
    """``aiote bench sendrecv-latency``: the send/recv ping-pong alone (what the peers' run sets
    against UCXX's round trip), beside the C core's, on the route asked for."""
    out_file = tmp_path / "sr.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "sendrecv-latency", "--provider", "tcp", "--iters", "50",
         "--repeats", "1", "--loop", "asyncio,trio", "--json", str(out_file)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out_file.read_text())["rows"]
    assert [(r["mode"], r["size"], r["provider"], r["loop"]) for r in rows] == [
        ("sendrecv-latency", k, "tcp", loop) for loop in ("asyncio", "trio") for k in (50, 99)]
    assert all(r["py_us"] > 0 and r["c_us"] > 0 for r in rows), rows
    # each loop's row beside that loop's own ping-pong over a plain socket (bare sockets)
    assert all(0 < r["sockets_us"] < 1e6 for r in rows), rows
    assert "bare sockets" in out.stdout and "event loop's own ping-pong" in out.stdout


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_c_bench_fan_writes_from_every_sender_to_every_receiver(provider: str) -> None:
    """``aiote_cbench fan``: 2 sender processes each write their bytes to 2 receiver processes
    at once (the weight push's pattern); every receiver waited for every sender's credits
    before it reported, and the figure counts every sender's bytes."""
    from aiote.cli._benchnet import build_cbench, cbench

    assert build_cbench() is None
    extra = ["--nic", "lo"] if provider == "tcp" else ["--arena"]
    r = subprocess.run([str(cbench()), "fan", "1M", "4", "16M", "--senders", "2", "--receivers", "2",
                        "--provider", provider, *extra], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "FI_PROVIDER": "tcp,ofi_rxm,shm"})
    assert r.returncode == 0, r.stderr[-2000:]
    run = json.loads(r.stdout.strip().splitlines()[-1])
    assert run["mode"] == "fan" and run["senders"] == 2 and run["receivers"] == 2
    assert run["writes_per_sender"] == 16 and run["total_bytes"] == 2 * (16 << 20)
    assert len(run["receiver_seconds"]) == 2 and min(run["receiver_seconds"]) > 0
    assert run["seconds"] == max(run["receiver_seconds"]) and run["gbps"] > 0


def test_aiote_bench_c_copy_out_makes_the_c_core_copy_each_message_out(tmp_path: Path) -> None:
    """``--c-copy-out``: the C core's sendrecv receiver copies every message out of its slot
    before reposting it, as ``Engine.recv`` does (its JSON counts the bytes copied), and
    ``aiote bench`` records and says that its baseline did."""
    from aiote.cli._benchnet import build_cbench, cbench

    assert build_cbench() is None
    env = {**os.environ, "FI_PROVIDER": "tcp,ofi_rxm,shm"}
    runs = {}
    for extra in ([], ["--copy-out"]):
        r = subprocess.run([str(cbench()), "sendrecv", "64K", "16", "4M", "--provider", "tcp", "--nic", "lo",
                            *extra], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[bool(extra)] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs[False]["receiver_copied_bytes"] == 0
    copied = runs[True]["receiver_copied_bytes"]
    assert copied >= runs[True]["total_bytes"] and copied % 65536 == 0  # (the warm-up's too)
    out_file = tmp_path / "copy.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "sendrecv", *BENCH_QUICK, "--c-copy-out",
         "--json", str(out_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["c_copy_out"] is True
    _check_rows(result["rows"])
    assert "the C core's receiver copies each message out" in out.stdout


def test_the_event_loop_alone_is_measured_on_each_loop_and_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_benchfloor``: the plain-socket ping-pong the latency rows stand beside really plays
    round trips under the loop asked for, on loopback TCP and on a Unix socket pair; its result
    comes back with stdout block-buffered too (no PYTHONUNBUFFERED), and a failure is a
    RuntimeError (the bench notes it and goes on)."""
    from aiote.cli import _benchfloor

    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    assert _benchfloor.family_of("tcp") == "tcp" and _benchfloor.family_of("shm") == "unix"
    assert _benchfloor.family_of("verbs") is None
    for loop, family in (("asyncio", "tcp"), ("trio", "unix")):
        got = _benchfloor.floor_run(loop, family, 50)
        assert (got["ran_under"], got["family"], got["iters"]) == (loop, family, 50)  # seen from inside
        assert 0 < got["p50_us"] <= got["p99_us"] < 1e6 and got["loop_cpu_us_per_rtt"] > 0
    with pytest.raises(RuntimeError):
        _benchfloor.floor_run("no-such-loop", "tcp", 10)
    with pytest.raises(RuntimeError, match="--iters must be at least 1"):
        _benchfloor.floor_run("asyncio", "tcp", 0)


def test_aiote_bench_sweeps_sendrecv_over_loops_and_windows(tmp_path: Path) -> None:
    out_file = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "sendrecv", *BENCH_QUICK, "--sizes", "4KiB,64KiB",
         "--window", "4,16", "--loop", "asyncio,trio", "--json", str(out_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["loop"] == ["asyncio", "trio"] and result["window"] == [4, 16]
    got = [(r["loop"], r["mode"], r["size"], r["window"]) for r in result["rows"]]
    assert got == [
        (loop, mode, size, window)
        for loop in ("asyncio", "trio")
        for mode, size, window in [("sendrecv", 4096, 4), ("sendrecv", 65536, 4), ("sendrecv", 4096, 16),
                                   ("sendrecv", 65536, 16), ("sendrecv-latency", 50, None),
                                   ("sendrecv-latency", 99, None)]
    ]
    _check_rows(result["rows"])
    # the C core is measured once per case (it has no event loop): both loops sit beside the same figure
    half = len(result["rows"]) // 2
    def c_figure(r: dict[str, Any]) -> float:
        return float(r["c_us"] if r["unit"] == "us" else r["c_gbps"])

    assert [c_figure(r) for r in result["rows"][:half]] == [c_figure(r) for r in result["rows"][half:]]


def test_aiote_bench_listen_and_connect_across_two_processes(tmp_path: Path) -> None:
    server = subprocess.Popen([sys.executable, "-m", "aiote", "bench", "--listen"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("AIOTE_BENCH_LISTEN "), line
        address = line.split()[1]
        out_file = tmp_path / "bench.json"
        for mode in ("read", "write"):  # one serving side answers several measuring runs
            out = subprocess.run(
                [sys.executable, "-m", "aiote", "bench", mode, *BENCH_QUICK, "--window", "8",
                 "--connect", address, "--json", str(out_file)],
                capture_output=True, text=True, timeout=300,
            )
            assert out.returncode == 0, out.stderr[-2000:]
            result = json.loads(out_file.read_text())
            assert result["connect"] == address and result["c_baseline"] is True
            assert [(r["mode"], r["size"], r["window"]) for r in result["rows"]] == [(mode, 65536, 8)]
            _check_rows(result["rows"])
        assert server.poll() is None  # still serving
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.netns
def test_aiote_bench_connect_across_a_veth_pair_between_namespaces(tmp_path: Path) -> None:
    from _netns import netns_unavailable, two_hosts

    why = netns_unavailable()
    if why:
        pytest.skip(why)
    with two_hosts(1, subnet=217) as h:
        server = subprocess.Popen(
            [*h.prefix, sys.executable, "-m", "aiote", "bench", "--listen", "--nics", h.remote[0]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            assert line.startswith("AIOTE_BENCH_LISTEN "), line
            out_file = tmp_path / "bench.json"
            out = subprocess.run(
                [sys.executable, "-m", "aiote", "bench", "write", *BENCH_QUICK, "--window", "8",
                 "--nics", h.local[0], "--connect", line.split()[1], "--json", str(out_file)],
                capture_output=True, text=True, timeout=300,
            )
            assert out.returncode == 0, out.stderr[-2000:]
            result = json.loads(out_file.read_text())
            assert result["nics"] == [[h.local[0]]] and result["c_baseline"] is True
            _check_rows(result["rows"])
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_aiote_bench_pairs_each_repeat_and_takes_turns_at_going_first(tmp_path: Path) -> None:
    out_file = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "write", "--sizes", "64KiB", "--total", "16MiB",
         "--repeats", "2", "--json", str(out_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # repeat 1: the C core, then aiote; repeat 2: aiote, then the C core; the bare sockets after
    steps = re.findall(r"\] (C core|aiote|sockets) +write", out.stderr)
    assert steps == ["C core", "aiote", "sockets", "aiote", "C core", "sockets"]
    (row,) = json.loads(out_file.read_text())["rows"]
    assert len(row["py_runs"]) == len(row["c_runs"]) == 2
    _check_rows([row])
    # rendered as the target case measured alone: its paired ratio and how many repeats passed
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:begin -->\n<!-- bench:end -->\n")
    render = [sys.executable, str(ROOT / "benchmarks" / "render_docs.py"), "--target", str(out_file)]
    r = subprocess.run([*render, "--doc", str(doc)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = doc.read_text()
    passed = sum(p / c >= 0.95 for p, c in zip(row["py_runs"], row["c_runs"], strict=True))
    assert "2 paired repeats, a run of its own on " in text
    assert f"aiote / C core **{row['ratio']:.3f}**" in text
    assert f"{passed} of 2 at or above 0.95" in text


def test_aiote_bench_refuses_a_provider_not_usable_here_naming_those_that_are() -> None:
    out = subprocess.run([sys.executable, "-m", "aiote", "bench", "write", "--provider", "tcp,efa"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'efa' is not usable here" in out.stderr
    # the providers that do work here are named (tcp and shm at least; more on an RDMA machine)
    listed = re.search(r"available: ([a-z_, ]+)", out.stderr)
    assert listed and {"tcp", "shm"} <= set(listed.group(1).replace(" ", "").split(","))


def test_aiote_bench_counts_other_processes_cpu_during_the_run() -> None:
    cmd = [sys.executable, "-m", "aiote", "bench", "write", "--sizes", "64KiB", "--total", "32MiB",
           "--repeats", "1"]
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    alone = json.loads(quiet.stdout.strip().splitlines()[-1])
    # its own processes (the peer, the C bench) keep both cores busy and are not counted
    assert 0 <= alone["cpu_others_during"] < 0.5 and 0 <= alone["cpu_steal_during"] <= 1
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        hog.kill()
        hog.wait()
    assert busy.returncode == 0, busy.stderr
    result = json.loads(busy.stdout.strip().splitlines()[-1])
    # a busy loop: most of one core over the run (contended on a small machine), in core units
    assert result["cpu_others_during"] * (os.cpu_count() or 1) > 0.4
    assert "other processes used" in busy.stderr and "during the run" in busy.stderr


def test_bench_weights_cpu_runs_with_every_same_run_baseline() -> None:
    """``benchmarks/bench_weights.py``'s CPU run, small, on the default route: it measures the C
    core's link, its pairs started together and aiote's own flows and pairs beside the push, and
    prints the fraction of the bound and what each baseline moved."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_weights.py"), "--size", "0.05", "--no-gloo",
         "--no-kimi", "--routes", "default", "--repeats", "1", "--link-mib", "64"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "FI_PROVIDER": "tcp,ofi_rxm,shm"},
    )
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    text = out.stdout
    link = re.search(r"\(C core / aiote; shm: into a host arena\): shm ([\d.]+) / ([\d.]+) GB/s", text)
    assert link and float(link[1]) > 0 and float(link[2]) > 0, text
    wall = re.search(r"aiote push, route default: wall ([\d.]+) s", text)
    assert wall and float(wall[1]) > 0, text
    frac = re.search(r"fraction of bound ([\d.]+)", text)
    assert frac and float(frac[1]) > 0, text
    fan = re.search(r"in the push.s pattern moves ([\d.]+) GB/s in all: .* runs at ([\d.]+) of its", text)
    assert fan and float(fan[1]) > 0 and float(fan[2]) > 0, text
    pairs = re.search(r"aiote's 2 pairs .* move ([\d.]+) GB/s in all, ([\d.]+) of the C core's pairs", text)
    assert pairs and float(pairs[1]) > 0 and float(pairs[2]) > 0, text
    assert re.search(r"trainer 1: push [\d.]+ s, .*peak staging \d+ MiB", text), text


def test_bench_strided_runs_its_three_cases_on_the_same_host_route() -> None:
    """``benchmarks/bench_strided.py``, small: every shape into NumPy memory and into an arena,
    each as one strided copy per call (its bytes checked by the benchmark), beside staged and
    contiguous writes of the same bytes; the route is shm."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_strided.py"), "--repeats", "1", "--rows", "64"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "FI_PROVIDER": "tcp,ofi_rxm,shm"},
    )
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    assert "route shm" in out.stdout, out.stdout
    rows = re.findall(
        r"strided ([\d.]+) GB/s \((\d+) copies per call\), staged ([\d.]+), contiguous ([\d.]+); "
        r"strided / staged ([\d.]+)", out.stdout
    )
    assert len(rows) == 4, out.stdout
    for strided, copies, staged, contiguous, ratio in rows:
        assert copies == "1" and min(float(strided), float(staged), float(contiguous), float(ratio)) > 0


def test_aiote_bench_plot_without_matplotlib_says_so(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['matplotlib'] = None; from aiote.cli import main; "
            f"sys.exit(main(['bench', 'write', '--plot', {str(tmp_path / 'x.png')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--plot needs matplotlib" in out.stderr and "aiote[bench]" in out.stderr


def test_bench_buffers_start_on_a_huge_page_boundary_as_the_c_benchs() -> None:
    """aiote bench's regions from 4 MiB on start on a 2 MiB boundary (every page can be a huge
    one, as in the C bench and the peers' benchmarks); smaller ones are plain arrays."""
    import numpy as np

    from aiote.cli._benchnet import HUGE_PAGE, bench_buffer

    for n in (4 << 20, (4 << 20) + 4096, 64 << 20):
        a = bench_buffer(n)
        assert a.dtype == np.uint8 and a.nbytes == n and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % HUGE_PAGE == 0
        a[-1] = 7  # the whole length is ours
        assert a[-1] == 7
    small = bench_buffer(64 << 10)
    assert small.nbytes == 64 << 10 and small.base is None
