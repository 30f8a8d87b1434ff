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
        [sys.executable, "-m", "aiote", "demo", "--size", "64MiB", "--chunk", "1MiB", "--backend", backend],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["verified"] is True
    assert result["bytes"] == 64 << 20 and result["chunks"] == 64
    assert result["write_gbps"] > 0 and result["receive_gbps"] > 0
    assert "every byte verified" in out.stderr


def test_demo_rejects_bad_size() -> None:
    out = subprocess.run([sys.executable, "-m", "aiote", "demo", "--size", "7"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "multiple of 8" in out.stderr
