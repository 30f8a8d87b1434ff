"""Engine and region lifecycles: unregister, closing, use after close."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from _util import anyio_backend_with_uvloop as anyio_backend  # noqa: F401 (the fixture: asyncio, trio, uvloop)
from _util import landed, nothing_posted, pattern, zeros

import aiote

pytestmark = pytest.mark.anyio


async def test_unregister_after_completion_and_twice(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    src = pattern(1 << 16, seed=1)
    dst = zeros(1 << 16)
    ms = await a.register(src)
    md = await b.register(dst)
    regions = a.stats()["regions"]
    assert ms.registered
    await a.write(ms, md.descriptor, imm=1)
    await a.unregister(ms, timeout=0)  # nothing in flight once write() returned
    assert not ms.registered
    assert a.stats()["regions"] == regions - 1
    assert "unregistered" in repr(ms)
    with pytest.raises(aiote.InvalidArgument, match="already unregistered"):
        await a.unregister(ms)
    with pytest.raises(aiote.InvalidArgument, match="not a memory region of this engine"):
        await a.unregister(md)  # b's region
    with pytest.raises(aiote.InvalidArgument):
        await a.unregister(src)  # type: ignore[arg-type]
    await b.imm_counter(1).wait(1, timeout=30)
    assert np.array_equal(src, dst)
    # the buffer can be registered again and used
    ms2 = await a.register(src)
    await a.write(ms2, md.descriptor, length=16, imm=1)
    await b.imm_counter(1).wait(1, timeout=30)


async def test_engine_closed_after_its_block() -> None:
    async with aiote.testing.engine_pair() as (a, b):
        ms = await a.register(pattern(4096))
        md = await b.register(zeros(4096))
        address = a.address
        assert not a.closed
        await a.write(ms, md.descriptor, imm=1)
        c = a.imm_counter(3)
    assert a.closed and b.closed
    assert not ms.registered and not md.registered
    assert a.address == address  # still readable
    with pytest.raises(aiote.EngineClosed):
        await a.register(zeros(16))
    with pytest.raises(aiote.EngineClosed):
        await a.unregister(ms)
    with pytest.raises(aiote.EngineClosed):
        await a.send(b.address, b"x")
    with pytest.raises(aiote.EngineClosed):
        await a.recv()
    with pytest.raises(aiote.EngineClosed):
        await a.recv(timeout=1)
    with pytest.raises(aiote.EngineClosed):
        await c.wait(1)
    with pytest.raises(aiote.EngineClosed):
        await a.imm_counter(4).wait(0)
    with pytest.raises(aiote.EngineClosed):
        _ = c.available
    with pytest.raises(aiote.EngineClosed):
        a.stats()
    await a.aclose()  # idempotent


async def test_transfers_on_a_closed_engine_raise_engine_closed() -> None:
    async with aiote.testing.engine_pair() as (a, b):
        ms = await a.register(pattern(4096))
        md = await b.register(zeros(4096))
        desc = md.descriptor
        prepared = a.batch().write(ms, desc, imm=1)  # built while open, submitted after close
    with pytest.raises(aiote.EngineClosed):
        await prepared.submit()
    async with aiote.open_engine() as other:
        live = await other.register(zeros(4096))
        desc = live.descriptor  # a live destination: only the closed engine is at fault
        for what, op in [
            ("write", lambda: a.write(ms, desc, imm=1)),
            ("read", lambda: a.read(ms, desc)),
            ("write_imm", lambda: a.write_imm(desc, 1)),
            ("batch.submit", lambda: a.batch().write(ms, desc, imm=1).submit()),
        ]:
            with pytest.raises(aiote.EngineClosed):
                await op()
                pytest.fail(f"{what} on a closed engine did not raise")


async def test_waiters_fail_with_engine_closed_when_the_engine_closes() -> None:
    results: dict[str, BaseException | None] = {}

    async def capture(name: str, fn) -> None:
        try:
            await fn()
            results[name] = None
        except aiote.EngineClosed as exc:
            results[name] = exc

    async with anyio.create_task_group() as tg, aiote.open_engine() as e:
        tg.start_soon(capture, "wait", lambda: e.imm_counter(5).wait(1))
        tg.start_soon(capture, "recv", lambda: e.recv())
        await anyio.wait_all_tasks_blocked()
        assert results == {}
    assert set(results) == {"wait", "recv"}
    assert all(isinstance(v, aiote.EngineClosed) for v in results.values()), results


async def test_aclose_inside_the_block() -> None:
    async with aiote.open_engine() as e:
        mr = await e.register(zeros(64))
        await e.aclose()
        assert e.closed and not mr.registered
        await e.aclose()
        with pytest.raises(aiote.EngineClosed):
            await e.send(e.address, b"x")
    assert e.closed


async def test_engine_properties(aiote_engine_pair) -> None:
    a, b = aiote_engine_pair
    # the main provider's NIC first, then the same-host provider (shm) where available
    k = a.domains.streams  # tcp with one NIC: two connections (aiote.default_streams)
    assert k == aiote.default_streams("tcp", ["lo"])
    assert len(a.rails) in (k, k + 1)
    assert a.rails[-1].provider == "shm" or len(a.rails) == k
    rail = a.rails[0]
    assert "tcp" in rail.provider
    assert rail.domain == "lo"
    assert rail.index == 0
    assert rail.cq_data_size >= 4
    assert rail.max_message_size >= a.max_message_size
    st = a.stats()
    assert st["ops_in_flight"] == 0 and st["pending"] == 0
    assert st["regions"] == 1  # the engine's internal scratch region
    addr = aiote.EngineAddress.from_bytes(a.address)
    assert [r.address for r in addr.rails] == [r.address for r in a.rails]
    assert addr.host_id == aiote.EngineAddress.from_bytes(b.address).host_id  # same host


async def test_many_engines_open_and_close_in_turn() -> None:
    # engines release what they hold: repeated open/transfer/close cycles keep working
    for i in range(5):
        async with aiote.testing.engine_pair() as (a, b):
            src = pattern(10_000, seed=i)
            dst = zeros(10_000)
            ms = await a.register(src)
            md = await b.register(dst)
            await a.write(ms, md.descriptor, imm=i)
            await landed(b, {i: 1})
            assert np.array_equal(src, dst)
            before = a.stats()
            nothing_posted(a, before)



_CTRL_C = """
import os, signal, time
# Python's own handler, as in a terminal: a run started in the background (`cmd &` in a script)
# inherits SIGINT ignored, and Python then installs none
signal.signal(signal.SIGINT, signal.default_int_handler)
import aiote
try:
    os.kill(os.getpid(), signal.SIGINT)  # outside any event loop (which installs its own)
    time.sleep(10)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""

_SEGV = """
import ctypes, faulthandler, aiote
assert faulthandler.is_enabled()
ctypes.string_at(0)
"""


def test_signal_handlers_survive_loading_the_core() -> None:
    """Debian's libfabric links libinfinipath, whose constructor installs its own SIGINT,
    SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT handlers: after ``import aiote`` Ctrl-C ended
    the process with status 1 (no ``KeyboardInterrupt``, no ``finally``), and faulthandler's
    report of a crash was lost. aiote puts every handler back after loading its core."""
    import subprocess
    import sys

    from aiote._spawn import child_env

    out = subprocess.run(
        [sys.executable, "-c", _CTRL_C], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout.strip()) == (0, "KeyboardInterrupt"), (out, out.stderr[-2000:])
    out = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _SEGV], env=child_env(), capture_output=True,
        text=True, timeout=60,
    )
    assert out.returncode < 0 and "Fatal Python error: Segmentation fault" in out.stderr, (
        out.returncode,
        out.stderr[-2000:],
    )
