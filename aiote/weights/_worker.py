"""A trainer or inference rank in its own process, driven by JSON lines on stdin (one reply
line each on stdout), for the tests, the benchmark and the examples:
``python -m aiote.weights._worker --backend trio --route tcp``. :func:`spawn_worker` starts
one and returns a :class:`Worker` to drive it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
import numpy as np

from .._core._engine import Engine, open_engine
from .._core._errors import AioteError
from .._core._memory import MemoryRegion
from .._core._retry import RetryPolicy
from .._spawn import child_env, python_module
from ._dtypes import cast_into, storage
from ._flow import PushFailed, WeightSender
from ._plan import ReceiverPlan, SenderPlan, SourceShard
from ._receiver import WeightReceiver

__all__ = ["Worker", "WorkerError", "source_tensor", "spawn_worker"]

READY = "AIOTE_WEIGHTS_WORKER"


def source_tensor(
    name: str, shape: Sequence[int], dtype: str, version: int, seed: int = 0
) -> np.ndarray[Any, Any]:
    """The whole parameter ``name`` of ``version``: deterministic pseudo-random values (the
    same in every process), stored as ``storage(dtype)``. O(elements)."""
    rng = np.random.default_rng([seed, version, zlib.crc32(name.encode())])
    if dtype in ("float64", "float32", "float16", "bfloat16"):
        f = rng.standard_normal(tuple(shape), dtype=np.float32)
        out = np.empty(tuple(shape), storage(dtype))
        cast_into(np, out, f, "float32", dtype)
        return out
    info = np.iinfo(storage(dtype))
    return rng.integers(info.min, info.max, size=tuple(shape), dtype=storage(dtype), endpoint=True)


def fast_shard(s: SourceShard, version: int) -> np.ndarray[Any, Any]:
    """A cheap shard for benchmarks: every element of rank ``s.rank``'s rows set to one value
    depending on the parameter, the version and the first row. O(elements), one pass."""
    value = (zlib.crc32(s.name.encode()) % 97 + version + s.rows[0] % 7) % 120
    return np.full(s.local_shape, value, storage(s.dtype))


class WorkerError(AssertionError):
    """The worker process reported that a command failed: ``kind`` is the exception's type
    name, ``reply`` the whole reply."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.kind = str(reply.get("error"))
        self.reply = reply
        super().__init__(f"{self.kind}: {reply.get('msg')}")


class Worker:
    """The test side of a worker process: :meth:`call` sends one command and returns its
    reply. Commands run one at a time in the worker, in order."""

    def __init__(self, proc: anyio.abc.Process, address: bytes) -> None:
        self.proc = proc
        self.address = address
        self._buf = b""

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return int(self.proc.pid)

    async def send(self, **cmd: Any) -> None:
        """Sends a command without waiting for its reply (read it with :meth:`reply`)."""
        assert self.proc.stdin is not None
        await self.proc.stdin.send((json.dumps(cmd) + "\n").encode())

    async def reply(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next reply; raises :class:`WorkerError` if it reports a failure, TimeoutError
        after ``timeout``, RuntimeError if the worker exited."""
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout):
            while b"\n" not in self._buf:
                try:
                    chunk = await self.proc.stdout.receive()
                except anyio.EndOfStream:
                    raise RuntimeError("the worker exited") from None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        r: dict[str, Any] = json.loads(line)
        if "error" in r:
            raise WorkerError(r)
        return r

    async def call(self, reply_timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        """Sends ``cmd`` (its ``timeout``, if any, is the command's own) and returns its reply
        (see :meth:`reply`; ``reply_timeout`` bounds the wait for it)."""
        await self.send(**cmd)
        return await self.reply(reply_timeout)

    async def aclose(self) -> None:
        """Asks the worker to exit; kills it after 10 s. Shielded."""
        with anyio.CancelScope(shield=True):
            if self.proc.returncode is None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    await self.send(op="exit")
                with anyio.move_on_after(10):
                    await self.proc.wait()
                if self.proc.returncode is None:
                    self.proc.kill()
                    await self.proc.wait()
            await self.proc.aclose()


async def spawn_worker(
    backend: str = "asyncio",
    route: str = "tcp",
    timeout: float = 60.0,
    gpu: int | None = None,
    gpu_ipc: bool = True,
    ipc_streams: int = 1,
    engine_opts: dict[str, Any] | None = None,
) -> Worker:
    """Starts a worker process (``route``: ``"tcp"`` for tcp loopback only, ``"default"`` for
    ``open_engine()``'s defaults, shm to same-host peers; ``gpu``: its tensors and buffers are
    CuPy arrays on that GPU; ``gpu_ipc=False``: GPU writes are staged through host memory
    over the NIC instead of the CUDA-IPC rail; ``ipc_streams``: the engine's option of that
    name; ``engine_opts``: more ``open_engine()`` keyword arguments, JSON-able). Raises
    RuntimeError/TimeoutError if it does
    not come up. Costs a Python process that imports aiote and opens an engine."""
    args = python_module("aiote.weights._worker", "--backend", backend, "--route", route)
    if gpu is not None:
        args += ["--gpu", str(gpu)]
    if not gpu_ipc:
        args += ["--gpu-ipc", "no"]
    if ipc_streams != 1:
        args += ["--ipc-streams", str(ipc_streams)]
    if engine_opts:
        args += ["--engine-opts", json.dumps(engine_opts)]
    proc = await anyio.open_process(args, stdin=-1, stdout=-1, stderr=None, env=child_env())
    w = Worker(proc, b"")
    try:
        r = await w.reply(timeout)
    except BaseException:
        proc.kill()
        await proc.aclose()
        raise
    w.address = bytes.fromhex(r["address"])
    return w


class _State:
    def __init__(self, engine: Engine, gpu: int | None) -> None:
        self.engine = engine
        self.gpu = gpu
        self.buf: Any = None
        self.mr: MemoryRegion | None = None
        self.rx: WeightReceiver | None = None
        self.tx: WeightSender | None = None
        self.shards: dict[str, Any] = {}


async def _op(st: _State, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    e = st.engine
    if op == "alloc":
        if st.gpu is not None:
            import cupy  # type: ignore[import-not-found,unused-ignore]

            if cmd.get("memory") == "alloc_gpu":  # VMM, shared with peers as a descriptor
                st.buf = e.alloc_gpu(cmd["nbytes"], device=st.gpu)
            else:  # cudaMalloc (CuPy's pool), opened by peers with cudaIpcOpenMemHandle
                st.buf = cupy.zeros(cmd["nbytes"], cupy.uint8)
        else:
            st.buf = e.alloc_host(cmd["nbytes"]) if cmd.get("arena") else np.zeros(cmd["nbytes"], np.uint8)
        st.mr = await e.register(st.buf)
        return {"desc": bytes(st.mr.descriptor).hex()}
    if op == "receiver":
        st.rx = WeightReceiver(e, ReceiverPlan.from_json(cmd["plan"]))
        return {}
    if op == "wait":
        assert st.rx is not None
        t = time.monotonic()
        await st.rx.wait_version(cmd["version"], timeout=cmd.get("timeout"))
        return {"waited_s": time.monotonic() - t, "at": time.time()}
    if op == "poll":
        assert st.rx is not None
        return {"complete": st.rx.poll(cmd["version"]), "latest": st.rx.latest}
    if op == "dump":
        assert st.buf is not None
        (st.buf if st.gpu is None else st.buf.get()).tofile(cmd["path"])
        return {}
    if op == "stats":
        return {"stats": e.stats()}
    if op == "route":
        return {"provider": e.route(bytes.fromhex(cmd["peer"])).provider}
    if op == "sender":
        if st.tx is not None:
            await st.tx.aclose()
        plan = SenderPlan.from_json(cmd["plan"])
        retry = None
        if "retry_attempts" in cmd:
            retry = RetryPolicy(
                attempts=cmd["retry_attempts"], connect_timeout=cmd.get("connect_timeout", 5.0)
            )
        st.tx = WeightSender(
            e,
            plan,
            max_tmp_bytes=cmd.get("max_tmp_bytes", 64 << 20),
            register_sources=cmd.get("register_sources", False),
            retry=retry,
            **({"coalesce_bytes": cmd["coalesce_bytes"]} if "coalesce_bytes" in cmd else {}),
        )
        return {"nbytes": plan.nbytes}
    if op == "prepare":
        _prepare(st, cmd)
        return {}
    if op == "push":
        if not cmd.get("prepared"):
            _prepare(st, cmd)
        t0 = time.time()
        r = await _push(st, cmd)
        return dict(r, t0=t0, t1=time.time())
    if op == "rail":
        walls, end = await _rail(st, cmd)
        return {"walls": walls, "end": end}
    raise ValueError(f"unknown op {op!r}")


def _prepare(st: _State, cmd: dict[str, Any]) -> None:
    """This rank's shards of version ``cmd["version"]``, in the same arrays each version (as a
    trainer's parameters), on the GPU for a worker started with ``--gpu``; with ``flat``, the
    first call lays them out one after another in one buffer (a flat parameter buffer)."""
    assert st.tx is not None
    v = cmd["version"]
    if cmd.get("flat") and not st.shards:
        _flat_shards(st)
    if cmd.get("fill") == "gpu" and st.gpu is not None and st.shards:
        _gpu_fill(st, v)  # written in place by the GPU, as an optimizer step writes them
        return
    for s in st.tx.plan.sources:
        if cmd.get("fill") in ("fast", "gpu"):
            new = fast_shard(s, v)
        else:
            new = source_tensor(s.name, s.shape, s.dtype, v, cmd.get("seed", 0))[s.rows[0] : s.rows[1]]
        if st.gpu is not None:
            import cupy

            new = cupy.asarray(new)
        if s.name in st.shards:
            st.shards[s.name][...] = new
        else:
            st.shards[s.name] = new.copy()
    if st.gpu is not None:
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def _gpu_fill(st: _State, version: int) -> None:
    """Every shard set in place, on the GPU, to the value :func:`fast_shard` gives it."""
    import cupy

    assert st.tx is not None
    for s in st.tx.plan.sources:
        st.shards[s.name].fill((zlib.crc32(s.name.encode()) % 97 + version + s.rows[0] % 7) % 120)
    cupy.cuda.get_current_stream().synchronize()


def _flat_shards(st: _State) -> None:
    """Views, one after another in plan order, into one zeroed buffer (8-byte aligned)."""
    assert st.tx is not None
    xp: Any = np
    if st.gpu is not None:
        import cupy

        xp = cupy
    sizes = [int(np.prod(s.local_shape)) * storage(s.dtype).itemsize for s in st.tx.plan.sources]
    flat = xp.zeros(sum(-(-n // 8) * 8 for n in sizes), xp.uint8)
    at = 0
    for s, n in zip(st.tx.plan.sources, sizes, strict=True):
        st.shards[s.name] = flat[at : at + n].view(storage(s.dtype)).reshape(s.local_shape)
        at += -(-n // 8) * 8


async def _rail(st: _State, cmd: dict[str, Any]) -> tuple[list[float], float]:
    """Seconds of each of ``repeats`` rounds (after one warm-up) of writing ``nbytes`` into
    each region of ``descs`` (or the one ``desc``), from its byte ``dst`` on, at once: one
    ``engine.write`` each, or with ``chunk``, writes of ``chunk`` bytes with ``window`` in
    flight per region, the first round
    starting at epoch time ``at`` if given (so that several workers start together); and the
    epoch time the last round ended. What moving the bytes costs on this route, alone or
    beside other flows."""
    from .._core._descriptor import MemoryDescriptor

    xp: Any = np
    if st.gpu is not None:
        import cupy

        xp = cupy
    n = cmd["nbytes"]
    chunk = cmd.get("chunk") or n
    buf = xp.ones(n, xp.uint8)
    mr = await st.engine.register(buf, remote_write=False, remote_read=False)
    descs = [MemoryDescriptor.from_bytes(bytes.fromhex(d)) for d in cmd.get("descs") or [cmd["desc"]]]
    window = anyio.Semaphore(cmd.get("window", 8) * len(descs))
    base = cmd.get("dst", 0)

    async def one(desc: MemoryDescriptor, at: int) -> None:
        async with window:
            k = min(chunk, n - at)
            await st.engine.write(mr, desc, length=k, src_offset=at, dst_offset=base + at, timeout=60)

    walls = []
    try:
        await anyio.sleep(max(0.0, cmd.get("at", 0.0) - time.time()))
        for _ in range(cmd.get("repeats", 3) + 1):
            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for at in range(0, n, chunk):
                    for desc in descs:
                        tg.start_soon(one, desc, at)
            walls.append(time.perf_counter() - t)
        end = time.time()
    finally:
        await st.engine.unregister(mr, timeout=30)
    return walls[1:], end


async def _push(st: _State, cmd: dict[str, Any]) -> dict[str, Any]:
    assert st.tx is not None
    v = cmd["version"]
    try:
        stats = await st.tx.push(st.shards, version=v, timeout=cmd.get("timeout"))
    except PushFailed as exc:
        return {
            "error": "PushFailed",
            "msg": str(exc),
            "completed": list(exc.completed),
            "failed": {str(r): type(x).__name__ for r, x in exc.errors.items()},
        }
    d = dict(vars(stats))
    d["bytes_by_receiver"] = {str(k): b for k, b in stats.bytes_by_receiver.items()}
    return {"stats": d}


async def _serve(
    route: str, gpu: int | None, gpu_ipc: bool, ipc_streams: int = 1, opts: dict[str, Any] | None = None
) -> None:
    kw: dict[str, Any] = {"same_host": None} if route == "tcp" else {}
    kw["gpu_ipc"] = gpu_ipc
    kw["ipc_streams"] = ipc_streams
    kw.update(opts or {})
    if gpu is not None:
        import cupy

        cupy.cuda.Device(gpu).use()
    async with open_engine(**kw) as engine:
        st = _State(engine, gpu)
        print(json.dumps({"address": engine.address.hex(), "pid": os.getpid()}), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("op") == "exit":
                break
            try:
                reply = await _op(st, cmd)
            except (AioteError, ValueError, AssertionError, KeyError) as exc:
                reply = {"error": type(exc).__name__, "msg": str(exc)}
            print(json.dumps(reply), flush=True)
        if st.tx is not None:
            await st.tx.aclose()


def main() -> None:
    """Entry point of ``python -m aiote.weights._worker``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--route", default="tcp", choices=["tcp", "default"])
    ap.add_argument("--gpu", type=int, default=None, help="this rank's GPU (CuPy arrays)")
    ap.add_argument(
        "--gpu-ipc", default="yes", choices=["yes", "no"], help="no: stage GPU writes over the NIC"
    )
    ap.add_argument("--ipc-streams", type=int, default=1, help="the engine's ipc_streams")
    ap.add_argument("--engine-opts", default="{}", help="JSON of more open_engine() keyword arguments")
    a = ap.parse_args()
    opts = json.loads(a.engine_opts)
    anyio.run(_serve, a.route, a.gpu, a.gpu_ipc == "yes", a.ipc_streams, opts, backend=a.backend)


if __name__ == "__main__":
    main()
