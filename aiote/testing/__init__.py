"""Test helpers aiote ships for its users: an engine pair in one process and a real peer
engine in another process, driven over aiote's own send/recv.

    async with aiote.testing.engine_pair() as (a, b):
        ...
    async with aiote.testing.spawn_peer() as peer:          # another process
        desc = await peer.register("buf", 1 << 20)
        await engine.write(mr, desc, imm=1)
        await peer.wait(imm=1, n=1)
        assert await peer.digest("buf") == aiote.testing.digest(expected)

The pytest plugin (installed with the package, see :mod:`aiote.testing._plugin`) exposes
these as fixtures: ``aiote_engine_pair`` and ``aiote_peer``; they work under anyio's pytest
plugin (asyncio and trio) and under pytest-trio.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import numpy as np

from .._core._descriptor import MemoryDescriptor
from .._core._engine import Engine, open_engine
from .._spawn import child_env, python_module
from ._hostgpu import HostDeviceArray, HostStream

__all__ = [
    "HostDeviceArray",
    "HostStream",
    "PeerError",
    "PeerProcess",
    "answer_pings",
    "digest",
    "engine_pair",
    "pattern",
    "ready_line",
    "spawn_peer",
    "stop_process",
]


def pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` of deterministic pseudo-random bytes (the same in every process). Allocates and
    fills them: O(nbytes). Raises ValueError for a negative ``nbytes``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def digest(data: Any) -> str:
    """Hex BLAKE2b digest of a buffer, as the peer process computes it. Hashes it in place (no
    copy), O(bytes); raises TypeError for an object that is not a C-contiguous buffer."""
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


class PeerError(AssertionError):
    """The peer process reported that a command failed."""


class _Mailbox:
    def __init__(self) -> None:
        self.replies: dict[tuple[bytes, Any], dict[str, Any]] = {}
        self.lock = anyio.Lock()
        self.changed = anyio.Event()


_boxes: weakref.WeakKeyDictionary[Engine, _Mailbox] = weakref.WeakKeyDictionary()
_ids = itertools.count(1)


def _mailbox(engine: Engine) -> _Mailbox:
    box = _boxes.get(engine)
    if box is None:
        box = _boxes[engine] = _Mailbox()
    return box


@asynccontextmanager
async def engine_pair(provider: str = "tcp", nics: Sequence[str] | None = None, **kw: Any) -> AsyncIterator[
    tuple[Engine, Engine]
]:
    """Two engines in this process on the same provider (loopback by default). Raises what
    :func:`~aiote.open_engine` raises (:class:`~aiote.ProviderError`,
    :class:`~aiote.InvalidArgument`); costs two engines (poller threads, message slots)."""
    async with open_engine(provider, nics, **kw) as a, open_engine(provider, nics, **kw) as b:
        yield a, b


class PeerProcess:
    """A peer engine in a child process, serving JSON commands that arrive as aiote
    messages. Its replies come back the same way, so every call crosses the transport: each
    command method costs one message each way plus the peer's work, and raises
    :class:`PeerError` when the peer reports a failure (plus what :meth:`call` raises)."""

    def __init__(self, engine: Engine, proc: anyio.abc.Process, address: bytes) -> None:
        self.engine = engine
        self.process = proc
        self.address = address

    @property
    def pid(self) -> int:
        """The peer's process id. O(1), raises nothing."""
        return int(self.process.pid)

    async def call(self, timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        """Sends one command and returns its reply; raises :class:`PeerError` if it failed.

        Safe to call from several tasks at once, for one or several peers sharing the local
        engine: replies carry the command's id, and whichever task receives a message files
        it for the task it belongs to. Also raises TimeoutError when no reply comes within
        ``timeout``, and what :meth:`Engine.send` raises (:class:`~aiote.PeerUnreachable`,
        :class:`~aiote.TransferTimeout`, :class:`~aiote.EngineClosed`). Costs one message each
        way (JSON) plus the peer's work."""
        box = _mailbox(self.engine)
        rid = next(_ids)
        await self.engine.send(self.address, json.dumps({**cmd, "id": rid}).encode(), timeout=timeout)
        key = (self.address, rid)
        with anyio.fail_after(timeout):
            while key not in box.replies:
                if box.lock.locked():  # another task is receiving: wait until it files something
                    await box.changed.wait()
                    continue
                async with box.lock:
                    if key in box.replies:
                        break
                    try:
                        sender, payload = await self.engine.recv()
                        try:
                            msg = json.loads(payload)
                            box.replies[(sender, msg.get("id"))] = msg
                        except (ValueError, AttributeError):
                            pass  # not a peer reply: not ours to keep
                    finally:  # wake the others: one of them receives next (also if we gave up)
                        changed, box.changed = box.changed, anyio.Event()
                        changed.set()
        reply: dict[str, Any] = box.replies.pop(key)
        if "error" in reply:
            raise PeerError(f"peer failed {cmd.get('op')}: {reply['error']}")
        return reply

    async def register(
        self,
        name: str,
        nbytes: int,
        *,
        fill: str = "zeros",
        seed: int = 0,
        remote_write: bool = True,
        remote_read: bool = True,
        device: str | None = None,
        gpu: int = 0,
    ) -> MemoryDescriptor:
        """Registers a buffer in the peer (``fill``: "zeros" or "pattern"); its descriptor.
        ``device``: None (host memory), ``"arena"`` (host memory from the peer engine's
        :meth:`~aiote.Engine.alloc_host`), ``"cuda"`` (a CuPy array on GPU ``gpu``), ``"host"``
        or ``"shared"`` (a :class:`HostDeviceArray`, for a peer with ``gpu_backend="host"``),
        ``"alloc_gpu"`` (the peer engine's :meth:`~aiote.Engine.alloc_gpu` on GPU ``gpu``).
        Raises :class:`PeerError` if the peer fails it; costs one :meth:`call` and the peer's
        registration."""
        r = await self.call(
            op="register", name=name, size=nbytes, fill=fill, seed=seed,
            remote_write=remote_write, remote_read=remote_read, device=device, gpu=gpu,
        )
        return MemoryDescriptor.from_bytes(bytes.fromhex(r["desc"]))

    async def unregister(self, name: str, timeout: float = 30.0) -> None:
        """Makes the peer unregister buffer ``name``, keeping its memory (so :meth:`digest`
        still reads it): descriptors of it go stale. Raises :class:`PeerError` if it fails
        there (an unknown name, :class:`~aiote.RegionBusy`); costs one :meth:`call`."""
        await self.call(timeout + 10, op="unregister", name=name, wait_timeout=timeout)

    async def wait(self, imm: int, n: int = 1, timeout: float = 30.0) -> None:
        """Makes the peer wait for ``n`` credits of ``imm`` on its engine. Raises
        :class:`PeerError` when they do not come within ``timeout``; costs one :meth:`call`."""
        await self.call(timeout + 10, op="wait", imm=imm, n=n, wait_timeout=timeout)

    async def digest(self, name: str, offset: int = 0, length: int | None = None) -> str:
        """BLAKE2b digest of a slice of a peer buffer (compare with :func:`digest`). Raises
        :class:`PeerError` (e.g. an unknown buffer); costs one :meth:`call` and O(bytes) hashing
        in the peer."""
        r = await self.call(op="digest", name=name, offset=offset, length=length)
        return str(r["digest"])

    async def write(
        self, name: str, remote: MemoryDescriptor, *, length: int | None = None, src_offset: int = 0,
        dst_offset: int = 0, imm: int | None = None, count: int = 1,
    ) -> None:
        """Makes the peer write ``count`` times from its buffer into ``remote``. Raises
        :class:`PeerError` if a write fails there; costs one :meth:`call` and ``count`` writes."""
        await self.call(
            op="write", name=name, remote=bytes(remote).hex(), length=length, src_offset=src_offset,
            dst_offset=dst_offset, imm=imm, count=count,
        )

    async def write_imm(self, remote: MemoryDescriptor, imm: int, count: int = 1) -> None:
        """Makes the peer send ``count`` zero-byte writes carrying ``imm`` to ``remote``'s owner.
        Raises :class:`PeerError` if one fails there; costs one :meth:`call` and ``count``
        writes."""
        await self.call(op="imm", remote=bytes(remote).hex(), imm=imm, count=count)

    async def write_paged(
        self, name: str, remote: MemoryDescriptor, *, page_size: int, src_pages: Sequence[int],
        dst_pages: Sequence[int], src_stride: int | None = None, dst_stride: int | None = None,
        imm: int | None = None,
    ) -> None:
        """Makes the peer do one paged write from its buffer into ``remote``. Raises
        :class:`PeerError` if it fails there; costs one :meth:`call` and the write."""
        await self.call(
            op="paged", name=name, remote=bytes(remote).hex(), page_size=page_size,
            src_pages=[int(x) for x in src_pages], dst_pages=[int(x) for x in dst_pages],
            src_stride=src_stride, dst_stride=dst_stride, imm=imm,
        )

    async def route(self, peer: bytes) -> dict[str, Any]:
        """How the peer's engine reaches ``peer`` (provider and NIC pairs). Raises
        :class:`PeerError` if it fails there; costs one :meth:`call`."""
        return await self.call(op="route", peer=peer.hex())

    async def counter(self, imm: int) -> int:
        """The peer's available credits for ``imm``. Raises :class:`PeerError` if the peer
        fails it; costs one :meth:`call`."""
        r = await self.call(op="counter", imm=imm)
        return int(r["available"])

    async def stats(self) -> dict[str, int]:
        """The peer engine's :meth:`Engine.stats` (polls, sleeps, completions, ...), read in the
        peer process. Raises what :meth:`call` raises; costs one message each way."""
        reply = await self.call(op="stats")
        return dict(reply["stats"])


@asynccontextmanager
async def spawn_peer(
    provider: str = "tcp", nics: Sequence[str] | None = None, *, engine: Engine | None = None,
    startup_timeout: float = 30.0, peer_nics: Sequence[str] | None = None,
    same_host: str | None = "shm", prefix: Sequence[str] = (), peer_port: int | None = None,
    peer_gpu_backend: str | None = None, peer_gpu_direct: bool | None = None, peer_streams: int | None = None,
    peer_same_host_direct: bool = True, **engine_kw: Any,
) -> AsyncIterator[PeerProcess]:
    """Starts a peer engine in a new Python process (``python -m aiote.testing._peer``).

    Talks to it through ``engine`` (or a fresh local engine on the same provider, ``nics``
    and ``same_host``). The peer opens ``peer_nics`` (default: ``nics``) with ``same_host``;
    ``prefix`` runs it under a command (e.g. ``["ip", "netns", "exec", "h2"]``); with
    ``peer_port`` its (tcp) engine listens on that port, so a restarted peer has the same
    address; ``peer_gpu_backend``/``peer_gpu_direct`` open it with that ``gpu_backend`` and
    ``gpu_direct``; ``peer_streams``: its connections per NIC (``open_engine(streams=)``;
    default: aiote's for its provider and NICs);
    ``peer_same_host_direct``: its ``open_engine(same_host_direct=)``.
    The peer exits when
    the block ends; if it is still alive after 10 s it is killed.

    Raises RuntimeError when the peer exits before it is up (or prints something else),
    TimeoutError after ``startup_timeout``, and what :func:`~aiote.open_engine` raises for the
    local engine. Costs a new Python process that imports aiote and opens an engine, plus a
    local engine when ``engine`` is None.
    """
    args = [*prefix, *python_module("aiote.testing._peer", "--provider", provider)]
    for nic in (nics if peer_nics is None else peer_nics) or []:
        args += ["--nic", nic]
    args += ["--same-host", same_host or "none"]
    if peer_port is not None:
        args += ["--port", str(peer_port)]
    if peer_gpu_backend is not None:
        args += ["--gpu-backend", peer_gpu_backend]
    if peer_gpu_direct is not None:
        args += ["--gpu-direct", "yes" if peer_gpu_direct else "no"]
    if peer_streams is not None:
        args += ["--streams", str(peer_streams)]
    if not peer_same_host_direct:
        args += ["--no-direct"]
    engine_kw["same_host"] = same_host
    proc = await anyio.open_process(args, stdin=None, stdout=-1, stderr=None, env=child_env())
    try:
        line = await ready_line(proc, "AIOTE_PEER", startup_timeout)
        if not line.startswith("AIOTE_PEER "):
            raise RuntimeError(f"unexpected output from the peer process: {line!r}")
        address = bytes.fromhex(line.split()[1])
        if engine is None:
            async with open_engine(provider, nics, **engine_kw) as local:
                peer = PeerProcess(local, proc, address)
                try:
                    yield peer
                finally:
                    await _stop(peer)
        else:
            peer = PeerProcess(engine, proc, address)
            try:
                yield peer
            finally:
                await _stop(peer)
    finally:
        await stop_process(proc)


async def stop_process(proc: anyio.abc.Process, grace: float = 10.0) -> None:
    """Lets a child process exit on its own for up to ``grace`` seconds, kills it after
    that, and closes its pipes. Shielded: runs to the end inside a cancelled scope. Raises
    nothing of its own; costs up to ``grace`` seconds of waiting."""
    with anyio.CancelScope(shield=True):
        if proc.returncode is None:
            with anyio.move_on_after(grace):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await proc.aclose()


async def answer_pings(
    engine: Engine, remote: MemoryDescriptor, ping: int, pong: int, iters: int, timeout: float | None = 30.0
) -> None:
    """The answering side of a WriteImm ping-pong: ``iters`` times, waits for one credit of
    ``ping`` and answers with a ``write_imm`` of ``pong`` to ``remote``. Raises
    :class:`~aiote.TransferTimeout` when a ping does not come within ``timeout``.

    Each answer is awaited before the next ping is waited for. Posting it instead
    (``post_write_imm``, collected later) was measured slower on a 2-core VM: the loop
    woke once per round trip instead of twice, but it slept between pings, and waking it
    cost more than the extra wake-up (see docs/benchmarks.md)."""
    counter = engine.imm_counter(ping)
    for _ in range(iters):
        await counter.wait(1, timeout=timeout)
        await engine.write_imm(remote, pong)


async def ready_line(proc: anyio.abc.Process, marker: str, timeout: float = 60.0) -> str:
    """The first line a child process prints that starts with ``marker`` (its "I am up"
    line; earlier lines are skipped). Raises RuntimeError if it exits first, TimeoutError
    after ``timeout`` seconds. Costs reading the child's stdout as it comes (no polling)."""
    assert proc.stdout is not None
    buf = b""
    with anyio.fail_after(timeout):
        while True:
            while b"\n" in buf:
                raw, buf = buf.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith(marker):
                    return line
            try:
                chunk = await proc.stdout.receive()
            except anyio.EndOfStream:
                chunk = b""
            if not chunk:
                raise RuntimeError(f"the process exited before printing {marker!r}")
            buf += chunk


async def _stop(peer: PeerProcess) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
        if peer.process.returncode is None and not peer.engine.closed:
            try:
                await peer.engine.send(peer.address, json.dumps({"op": "exit"}).encode(), timeout=2)
            except Exception:
                peer.process.kill()
