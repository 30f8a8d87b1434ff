"""aiote logs through structlog into the stdlib logger "aiote": silent until the application
configures logging, then every event shows with its fields."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import logging, sys
import anyio
import aiote
from aiote._core._log import get_logger

if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)

async def main():
    async with aiote.open_engine() as engine:          # logs "engine open" (debug)
        get_logger(component="test").warning("a warning from aiote", answer=42)
        get_logger(component="test").error("an error from aiote")

anyio.run(main)
"""


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)


def test_quiet_by_default() -> None:
    out = _run("default")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == ""  # not even warnings and errors (no lastResort)


def test_events_show_once_logging_is_configured() -> None:
    out = _run("configured")
    assert out.returncode == 0, out.stderr
    assert "event='engine open'" in out.stderr and "component='engine'" in out.stderr
    assert "event='a warning from aiote'" in out.stderr and "answer=42" in out.stderr
    assert "WARNING:aiote" in out.stderr and "ERROR:aiote" in out.stderr


def test_quiet_aiote_never_imports_structlog() -> None:
    """With aiote's logger not enabled, an engine's life (its debug events) drops every event
    before structlog is imported; enabled, the same events come through structlog."""
    script = (
        "import logging, sys, anyio, aiote\n"
        "if sys.argv[1] == 'configured':\n"
        "    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        "async def main():\n"
        "    async with aiote.open_engine():\n"
        "        pass\n"
        "anyio.run(main)\n"
        "print('structlog' in sys.modules)\n"
    )
    run = [sys.executable, "-c", script]
    quiet = subprocess.run([*run, "default"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "False" and quiet.stderr == ""
    shown = subprocess.run([*run, "configured"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "True" and "event='engine open'" in shown.stderr
