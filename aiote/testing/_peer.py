"""The peer process of :func:`aiote.testing.spawn_peer`: an engine serving JSON commands
received as aiote messages (``python -m aiote.testing._peer --provider tcp``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import anyio
import numpy as np

from .._core._descriptor import MemoryDescriptor
from .._core._engine import Engine, open_engine
from .._core._memory import MemoryRegion
from . import answer_pings, pattern
from ._hostgpu import HostDeviceArray


def _device_array(kind: str, size: int, gpu: int, fill: np.ndarray) -> tuple[Any, Any]:
    """(array to register, host view or None) for a GPU buffer of ``kind``."""
    if kind == "cuda":
        import cupy  # type: ignore[import-not-found,unused-ignore]

        with cupy.cuda.Device(gpu):
            return cupy.asarray(fill), None
    arr = HostDeviceArray(size, device=gpu, shared=kind == "shared")
    arr.host[:] = fill
    return arr, arr.host


def _host_bytes(arr: Any) -> np.ndarray:
    if isinstance(arr, np.ndarray):
        return arr
    if isinstance(getattr(arr, "host", None), np.ndarray):  # HostDeviceArray, emulated alloc_gpu
        return np.asarray(arr.host)
    return np.asarray(arr.get())  # a CuPy array: copied to the host


async def _serve(engine: Engine) -> None:
    regions: dict[str, MemoryRegion] = {}
    arrays: dict[str, Any] = {}
    while True:
        sender, payload = await engine.recv()
        cmd: dict[str, Any] = json.loads(payload)
        if cmd.get("op") == "exit":
            return
        try:
            reply = await _command(engine, sender, cmd, regions, arrays)
        except Exception as exc:  # reported to the caller, who fails its test
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply["id"] = cmd.get("id")
        await engine.send(sender, json.dumps(reply).encode())


async def _command(
    engine: Engine, sender: bytes, cmd: dict[str, Any], regions: dict[str, MemoryRegion],
    arrays: dict[str, Any],
) -> dict[str, Any]:
    """Carries out one command (all but ``exit``); its reply, less its ``id``."""
    op = cmd.get("op")
    reply: dict[str, Any] = {"ok": True}
    if op == "register":
        reply["desc"] = await _register(engine, cmd, regions, arrays)
    elif op in ("write", "paged", "pong", "imm"):
        await _transfer(engine, op, cmd, regions)
    elif op == "wait":
        await engine.imm_counter(cmd["imm"]).wait(cmd["n"], timeout=cmd.get("wait_timeout"))
    elif op == "unregister":  # the region goes, its memory stays (digest still reads it)
        await engine.unregister(regions.pop(cmd["name"]), timeout=cmd.get("wait_timeout", 30))
    elif op == "counter":
        reply["available"] = engine.imm_counter(cmd["imm"]).available
    elif op == "digest":
        arr = _host_bytes(arrays[cmd["name"]])
        off = cmd.get("offset") or 0
        length = cmd.get("length")
        view = arr[off:] if length is None else arr[off : off + length]
        reply["digest"] = hashlib.blake2b(view.tobytes(), digest_size=16).hexdigest()
    elif op == "route":
        r = engine.route(bytes.fromhex(cmd["peer"]))
        reply["provider"] = r.provider
        reply["pairs"] = [list(p) for p in r.pairs]
    elif op == "stats":
        reply["stats"] = engine.stats()
    elif op == "echo":
        reply["payload"] = cmd.get("payload")
    elif op == "send_raw":  # raw payloads of these sizes (pattern bytes) to the caller
        for size, seed in zip(cmd["sizes"], cmd["seeds"], strict=True):
            await engine.send(sender, pattern(size, seed).tobytes())
    elif op == "recv_raw":  # the next `count` messages are raw: their sizes and digests
        got = []
        for _ in range(cmd["count"]):
            _, raw = await engine.recv()
            got.append([len(raw), hashlib.blake2b(raw, digest_size=16).hexdigest()])
        reply["got"] = got
    else:
        reply = {"error": f"unknown op {op!r}"}
    return reply


async def _register(
    engine: Engine, cmd: dict[str, Any], regions: dict[str, MemoryRegion], arrays: dict[str, Any]
) -> str:
    """``register``: a new region named ``cmd["name"]`` (replacing one of that name); its
    descriptor in hex."""
    name = cmd["name"]
    if name in regions:
        await engine.unregister(regions.pop(name))
    if cmd.get("fill") == "pattern":
        arr = np.random.default_rng(cmd.get("seed", 0)).integers(
            0, 256, size=cmd["size"], dtype=np.uint8
        )
    else:
        arr = np.zeros(cmd["size"], np.uint8)
    if cmd.get("device") == "arena":  # the engine's host arena (alloc_host)
        arena = engine.alloc_host(cmd["size"])
        arena[:] = arr
        arr = arena
    elif cmd.get("device") == "alloc_gpu":  # Engine.alloc_gpu: shared as a descriptor
        dev = engine.alloc_gpu(cmd["size"], device=cmd.get("gpu", 0))
        if isinstance(getattr(dev, "host", None), np.ndarray):  # the host GPU emulation
            dev.host[:] = arr
        else:
            dev.set(arr)
        arr = dev
    elif cmd.get("device"):
        arr, _ = _device_array(cmd["device"], cmd["size"], cmd.get("gpu", 0), arr)
    arrays[name] = arr
    regions[name] = await engine.register(
        arr, remote_write=cmd.get("remote_write", True), remote_read=cmd.get("remote_read", True)
    )
    return bytes(regions[name].descriptor).hex()


async def _transfer(engine: Engine, op: str, cmd: dict[str, Any], regions: dict[str, MemoryRegion]) -> None:
    """``write``, ``paged``, ``pong`` (answers each ping immediate with a pong immediate) and
    ``imm``, to the remote region ``cmd["remote"]``."""
    remote = MemoryDescriptor.from_bytes(bytes.fromhex(cmd["remote"]))
    if op == "write":
        for _ in range(cmd.get("count", 1)):
            await engine.write(
                regions[cmd["name"]], remote, length=cmd.get("length"),
                src_offset=cmd.get("src_offset", 0), dst_offset=cmd.get("dst_offset", 0),
                imm=cmd.get("imm"),
            )
    elif op == "paged":
        await engine.write_paged(
            regions[cmd["name"]], remote, page_size=cmd["page_size"], src_pages=cmd["src_pages"],
            dst_pages=cmd["dst_pages"], src_stride=cmd.get("src_stride"),
            dst_stride=cmd.get("dst_stride"), imm=cmd.get("imm"),
        )
    elif op == "pong":
        await answer_pings(engine, remote, cmd["ping"], cmd["pong"], cmd["iters"])
    else:  # imm
        for _ in range(cmd.get("count", 1)):
            await engine.write_imm(remote, cmd["imm"])


async def _main(
    provider: str,
    nics: list[str] | None,
    same_host: str | None,
    port: int | None,
    gpu_backend: str,
    gpu_direct: bool | None,
    streams: int | None = None,
    same_host_direct: bool = True,
) -> None:
    async with open_engine(
        provider, nics or None, same_host=same_host, port=port, gpu_backend=gpu_backend,
        gpu_direct=gpu_direct, streams=streams, same_host_direct=same_host_direct,
    ) as engine:
        sys.stdout.write(f"AIOTE_PEER {engine.address.hex()}\n")
        sys.stdout.flush()
        await _serve(engine)


def main() -> None:
    """Entry point of the peer process."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--provider", default="tcp")
    ap.add_argument("--nic", action="append")
    ap.add_argument("--same-host", default="shm", help="same-host provider, or 'none'")
    ap.add_argument("--port", type=int, default=None, help="tcp: listen on this port (first NIC)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--gpu-backend", default="cuda", help="cuda, or host (GPU emulation for tests)")
    ap.add_argument("--gpu-direct", choices=["auto", "yes", "no"], default="auto")
    ap.add_argument("--streams", type=int, default=None, help="connections per NIC (default: aiote's)")
    ap.add_argument("--no-direct", action="store_true", help="open_engine(same_host_direct=False)")
    a = ap.parse_args()
    same_host = None if a.same_host == "none" else a.same_host
    direct = {"auto": None, "yes": True, "no": False}[a.gpu_direct]
    anyio.run(
        _main, a.provider, a.nic, same_host, a.port, a.gpu_backend, direct, a.streams, not a.no_direct,
        backend=a.backend,
    )


if __name__ == "__main__":
    main()
