"""An open, idle engine costs (almost) no CPU: its poller sleeps on the provider's wait
object and the event loop sleeps on the engine's eventfd."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

IDLE_SCRIPT = r"""
import sys
import anyio
import aiote

async def main():
    # the low-latency setting: the loop thread drove the CQs itself; idle, the poller and the loop sleep
    settings = {} if sys.argv[2] == "default" else {"spin_us": 1000.0, "loop_spin_us": 500.0}
    async with aiote.open_engine(**settings) as engine:
        mr = await engine.register(bytearray(1 << 20))
        # one transfer and one message first, so the poller has been busy once
        await engine.write(mr, mr.descriptor, length=4096, imm=1)
        await engine.imm_counter(1).wait(1, timeout=30)
        await engine.send(engine.address, b"ping", timeout=30)
        assert await engine.recv(timeout=30) == (engine.address, b"ping")
        print("READY", flush=True)
        await anyio.sleep(3600)

anyio.run(main, backend=sys.argv[1])
"""


def _cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is the state (field 3 of proc(5)); utime and stime are fields 14 and 15
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "setting"), [("asyncio", "default"), ("trio", "default"), ("asyncio", "lowlat")]
)
def test_idle_engine_uses_under_2_percent_of_a_core(backend: str, setting: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", IDLE_SCRIPT, backend, setting],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", f"the engine process did not start: {line!r}"
        time.sleep(1.0)  # warm-up: the poller's spin window after the last activity ends
        assert proc.poll() is None
        cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(5.0)
        cpu1, t1 = _cpu_seconds(proc.pid), time.monotonic()
        assert proc.poll() is None, "the engine process died while idle"
        share = (cpu1 - cpu0) / (t1 - t0)
        print(f"idle CPU share {share:.3%}")
        assert share < 0.02, (
            f"an idle engine used {share:.1%} of a core ({cpu1 - cpu0:.3f} s CPU in {t1 - t0:.1f} s)"
        )
    finally:
        proc.kill()
        proc.wait()
