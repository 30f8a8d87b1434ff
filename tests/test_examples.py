"""The examples and the demo are runnable programs: run each as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    d = info["default"]
    assert d["provider"] == "tcp" and d["nics"] == ["lo"] and d["usable"] is True and d["why"]
    text = subprocess.run([sys.executable, "-m", "aiote", "info"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "open_engine() picks" in text.stdout and "lo" in text.stdout


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_aiote_bench_prints_figures_beside_the_c_core(loop: str, tmp_path: Path) -> None:
    out_file = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "aiote", "bench", "all", "--sizes", "64KiB", "--page-sizes", "4KiB",
         "--total", "32MiB", "--pages", "1000", "--calls", "1", "--iters", "200", "--repeats", "1",
         "--loop", loop,
         "--json", str(out_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == result
    assert result["c_baseline"] is True and result["loop"] == loop and result["window"] == 64
    assert [(r["mode"], r["size"]) for r in result["rows"]] == [
        ("write", 65536), ("paged", 4096), ("imm-latency", 50), ("imm-latency", 99)
    ]
    for r in result["rows"]:  # fields and sane values, not speed (latency rows: microseconds)
        assert 0 < r["py_gbps"] < 1e6 and 0 < r["c_gbps"] < 1e6
        assert r["py_spread"][0] <= r["py_gbps"] <= r["py_spread"][1]
        assert abs(r["ratio"] - r["py_gbps"] / r["c_gbps"]) < 1e-9
    assert "C core" in out.stdout and "ratio" in out.stdout
