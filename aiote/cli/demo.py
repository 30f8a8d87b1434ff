"""``aiote write-demo``: two engines in two processes on tcp loopback. The receiver registers a
buffer (1 GiB by default); the writer writes a deterministic pattern into it as WriteImm
chunks with a window of writes in flight; the receiver awaits its ImmCounter, verifies every
byte, and both print their throughput. The last line printed is one JSON object; the exit
status is non-zero unless every byte was verified."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import anyio
import numpy as np

import aiote
from aiote._spawn import child_env, python_module
from aiote.testing import ready_line

from . import _observe
from .bench import parse_size

IMM_DATA = 1


def fill_pattern(buf: np.ndarray, start: int = 0) -> None:
    """Writes the demo pattern: 8-byte words ``(index + 1) * golden`` (cheap, never all-zero)."""
    words = buf.view(np.uint64)
    idx = np.arange(start // 8 + 1, start // 8 + 1 + len(words), dtype=np.uint64)
    np.multiply(idx, np.uint64(0x9E3779B97F4A7C15), out=words)


def check_pattern(buf: np.ndarray, chunk: int = 64 << 20) -> bool:
    """True if ``buf`` holds exactly the pattern (checked chunk by chunk, bounded memory)."""
    expect = np.empty(min(chunk, len(buf)), np.uint8)
    for off in range(0, len(buf), chunk):
        n = min(chunk, len(buf) - off)
        fill_pattern(expect[:n], off)
        if not np.array_equal(buf[off : off + n], expect[:n]):
            return False
    return True


def _say(role: str, msg: str) -> None:
    sys.stderr.write(f"[{role}] {msg}\n")
    sys.stderr.flush()


async def receiver(size: int, provider: str, backend_note: str) -> None:
    """Registers ``size`` bytes, hands its descriptor to the writer, awaits the credits."""
    async with aiote.open_engine(provider, same_host=None) as engine:  # tcp even on one host
        buf = np.empty(size, np.uint8)
        buf.fill(0)  # touch every page now, not while the data streams in
        mr = await engine.register(buf)
        sys.stdout.write(f"AIOTE_DEMO {engine.address.hex()}\n")
        sys.stdout.flush()
        writer, hello = await engine.recv(timeout=60)
        chunks = json.loads(hello)["chunks"]
        await engine.send(writer, bytes(mr.descriptor))
        t0 = time.perf_counter()
        await engine.imm_counter(IMM_DATA).wait(chunks, timeout=600)
        dt = time.perf_counter() - t0
        _say("receiver", f"{chunks} chunks landed in {dt:.2f} s ({size / dt / 1e9:.2f} GB/s, {backend_note})")
        ok = check_pattern(buf)
        _say("receiver", "every byte verified" if ok else "VERIFICATION FAILED")
        await engine.send(writer, json.dumps({"verified": ok, "receive_s": dt}).encode())
        await engine.recv(timeout=60)  # the writer's goodbye: it is done with our region


async def writer(
    peer: bytes, size: int, chunk: int, window: int, provider: str, observe: aiote.Observability | None = None
) -> dict[str, Any]:
    """Writes ``size`` bytes in ``chunk``-sized WriteImm writes, ``window`` in flight."""
    async with aiote.open_engine(provider, same_host=None, observe=observe) as engine:  # tcp even on one host
        src = np.empty(size, np.uint8)
        fill_pattern(src)
        mr = await engine.register(src, remote_write=False, remote_read=False)
        chunks = (size + chunk - 1) // chunk
        await engine.send(peer, json.dumps({"chunks": chunks}).encode(), timeout=60)
        _, raw = await engine.recv(timeout=60)
        remote = aiote.MemoryDescriptor.from_bytes(raw)
        offsets = iter(range(0, size, chunk))
        t0 = time.perf_counter()

        async def lane() -> None:
            for off in offsets:  # the lanes share one iterator: `window` writes in flight
                await engine.write(mr, remote, length=min(chunk, size - off), src_offset=off,
                                   dst_offset=off, imm=IMM_DATA, timeout=120)

        async with anyio.create_task_group() as tg:
            for _ in range(window):
                tg.start_soon(lane)
        dt = time.perf_counter() - t0
        _say("writer", f"wrote {size / 2**30:.2f} GiB in {chunks} WriteImm chunks in {dt:.2f} s "
                       f"({size / dt / 1e9:.2f} GB/s)")
        _, raw = await engine.recv(timeout=600)
        result = json.loads(raw)
        await engine.send(peer, b"bye", timeout=60)
        return {
            "bytes": size,
            "chunks": chunks,
            "chunk_bytes": chunk,
            "window": window,
            "provider": provider,
            "write_gbps": round(size / dt / 1e9, 3),
            "receive_gbps": round(size / result["receive_s"] / 1e9, 3),
            "verified": bool(result["verified"]),
        }


async def run(args: argparse.Namespace) -> int:
    async with _observe.exporting(args, "writer") as observe:
        return await _run(args, observe)


async def _run(args: argparse.Namespace, observe: aiote.Observability | None) -> int:
    cmd = python_module("aiote", "write-demo", "--role", "receiver", "--size", str(args.size),
                        "--provider", args.provider, "--backend", args.backend)
    async with await anyio.open_process(cmd, stdout=-1, stderr=None, env=child_env()) as proc:
        address = bytes.fromhex((await ready_line(proc, "AIOTE_DEMO", 60)).split()[1])
        result = await writer(address, args.size, args.chunk, args.window, args.provider, observe)
        with anyio.fail_after(60):
            await proc.wait()
        result["receiver_exit"] = proc.returncode
    ok = result["verified"] and result["receiver_exit"] == 0
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    ap.add_argument("--size", type=parse_size, default=1 << 30, help="bytes to transfer (default 1GiB)")
    ap.add_argument("--chunk", type=parse_size, default=16 << 20, help="bytes per WriteImm (default 16MiB)")
    ap.add_argument("--window", type=int, default=8, help="writes in flight (default 8)")
    ap.add_argument("--provider", default="tcp", help="libfabric provider (default tcp on lo)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--role", default="main", choices=["main", "receiver"], help=argparse.SUPPRESS)
    _observe.add_arguments(ap)


def main(args: argparse.Namespace) -> int:
    """Runs the demo (or, with ``--role receiver``, its receiving process)."""
    if args.size <= 0 or args.size % 8 or args.chunk <= 0:
        raise SystemExit("--size must be a positive multiple of 8 and --chunk positive")
    if args.role == "receiver":
        anyio.run(receiver, args.size, args.provider, args.backend, backend=args.backend)
        return 0
    code: int = anyio.run(run, args, backend=args.backend)
    return code
