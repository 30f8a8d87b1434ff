"""aiote.weights across real processes: trainer ranks and inference ranks are separate worker
processes (``python -m aiote.weights._worker``), over tcp loopback and over the default
same-host route (shm); every inference shard is compared byte for byte with a NumPy
reference (global parameter -> rows/cols of each piece -> cast -> concatenated). Plus, in one
process, what a sender refuses before posting anything."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from _etcd import etcd_cluster, etcd_unavailable
from _util import nothing_posted
from _weights_util import e4m3_reference

import aiote
from aiote import weights as W
from aiote._core import _vmm
from aiote.testing import engine_pair
from aiote.weights._worker import Worker, WorkerError, source_tensor, spawn_worker

pytestmark = pytest.mark.anyio

Spec = tuple[str, str, Sequence[W.Piece]]


# ------------------------------------------------------------------ reference


def reference(t: W.TargetShard, shapes: dict[str, tuple[tuple[int, ...], str]], version: int) -> bytes:
    """What target ``t`` must hold after ``version``: from the whole parameters."""
    out = []
    for p in t.pieces:
        shape, dtype = shapes[p.source]
        full = source_tensor(p.source, shape, dtype, version).reshape(shape[0], -1)
        c0, c1 = p.cols if p.cols is not None else (0, full.shape[1])
        block = full[p.rows[0] : p.rows[1], c0:c1]
        if dtype == "bfloat16" and t.dtype == "float32":
            block = (block.astype(np.uint32) << 16).view(np.float32)
        elif t.dtype == "float8_e4m3":  # brute force: the nearest FP8 value
            block = e4m3_reference(block.astype(np.float32)).reshape(block.shape)
        elif dtype != t.dtype:
            block = block.astype(np.dtype(t.dtype))  # float32 -> float16: NumPy's own rounding
        out.append(np.ascontiguousarray(block).tobytes())
    return b"".join(out)


# ------------------------------------------------------------------ a world of processes


class World:
    def __init__(self, sources: list[W.SourceShard], tmp: Path) -> None:
        self.sources = sources
        self.shapes = {s.name: (s.shape, s.dtype) for s in sources}
        self.tmp = tmp
        self.senders: dict[int, Worker] = {}
        self.receivers: dict[int, Worker] = {}
        self.targets: dict[int, list[W.TargetShard]] = {}
        self.plan: W.WeightPlan | None = None
        self.spare: list[Worker] = []
        self.extra: list[Worker] = []

    async def add_receiver(self, r: int, w: Worker, specs: list[Spec], arena: bool = False) -> None:
        tg, nbytes = W.pack_targets(r, specs, self.sources)
        desc = bytes.fromhex((await w.call(op="alloc", nbytes=nbytes, arena=arena))["desc"])
        self.receivers[r] = w
        self.targets[r] = W.with_desc(tg, desc)

    async def install(
        self, previous: W.WeightPlan | None = None, ranks: Sequence[int] | None = None,
        chunk_bytes: int = 512, **sender: Any
    ) -> W.WeightPlan:
        all_targets = [t for r in sorted(self.targets) for t in self.targets[r]]
        p = W.plan(self.sources, all_targets, chunk_bytes=chunk_bytes, previous=previous)
        report = p.validate(link_bytes_per_s=1e9)
        assert report.total_bytes == sum(report.in_bytes.values())
        async with anyio.create_task_group() as tg:
            for s, w in self.senders.items():
                tg.start_soon(
                    lambda w=w, s=s: w.call(
                        op="sender", plan=p.sender(s).to_json(), max_tmp_bytes=4096, **sender
                    )
                )
            for r, w in self.receivers.items():
                if ranks is None or r in ranks:
                    tg.start_soon(lambda w=w, r=r: w.call(op="receiver", plan=p.receiver(r).to_json()))
        self.plan = p
        return p

    async def push(self, version: int, senders: Sequence[int] | None = None) -> None:
        async with anyio.create_task_group() as tg:
            for s in senders if senders is not None else self.senders:
                tg.start_soon(lambda s=s: self.senders[s].call(op="push", version=version, timeout=30))

    async def check(self, version: int, ranks: Sequence[int] | None = None) -> None:
        for r in ranks if ranks is not None else self.receivers:
            path = self.tmp / f"r{r}.bin"
            await self.receivers[r].call(op="dump", path=str(path))
            buf = np.fromfile(path, np.uint8)
            for t in self.targets[r]:
                want = reference(t, self.shapes, version)
                got = buf[t.offset : t.offset + len(want)].tobytes()
                assert got == want, f"rank {r} target {t.name} differs from version {version}'s reference"


@asynccontextmanager
async def world(
    backend: str, route: str, sources: list[W.SourceShard], n_senders: int, n_receivers: int, tmp: Path
) -> AsyncIterator[World]:
    w = World(sources, tmp)
    procs: dict[tuple[str, int], Worker] = {}

    async def one(key: tuple[str, int]) -> None:
        procs[key] = await spawn_worker(backend, route)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(n_senders):
                tg.start_soon(one, ("s", i))
            for i in range(n_receivers):
                tg.start_soon(one, ("r", i))
        w.senders = {i: procs[("s", i)] for i in range(n_senders)}
        w.spare = [procs[("r", i)] for i in range(n_receivers)]
        yield w
    finally:
        with anyio.CancelScope(shield=True):
            for p in [*procs.values(), *w.extra]:
                await p.aclose()


def fsdp(name: str, shape: tuple[int, ...], dtype: str, cuts: Sequence[int]) -> list[W.SourceShard]:
    """Trainer rank i holds rows cuts[i]:cuts[i+1]."""
    return [W.SourceShard(name, shape, dtype, i, (a, b)) for i, (a, b) in enumerate(itertools.pairwise(cuts))]


# ------------------------------------------------------------------ a small model, 2 -> 2

H = 16


def model_2x2() -> tuple[list[W.SourceShard], Callable[[int, int], list[Spec]]]:
    sources = [
        *fsdp("q", (48, H), "float32", [0, 30, 48]),
        *fsdp("k", (24, H), "float32", [0, 7, 24]),
        *fsdp("v", (24, H), "float32", [0, 12, 24]),
        *fsdp("o", (H, 48), "float32", [0, 9, 16]),
        *fsdp("up", (40, H), "float32", [0, 20, 40]),
        *fsdp("norm", (H,), "float32", [0, 3, H]),
        *fsdp("emb", (30, 8), "bfloat16", [0, 25, 30]),
    ]

    def specs(r: int, tp: int) -> list[Spec]:
        return [
            ("qkv", "float32", W.fused_tp([("q", 48), ("k", 24), ("v", 24)], r, tp)),  # fused q, k, v
            ("o", "float32", [W.Piece("o", (0, H), W.split_rows(48, tp, r))]),  # row-parallel: columns
            ("up", "float16", [W.Piece("up", W.split_rows(40, tp, r))]),  # float32 -> float16
            ("norm", "float32", [W.Piece("norm", (0, H))]),  # replicated
            ("emb", "float32", [W.Piece("emb", W.split_rows(30, tp, r))]),  # bfloat16 -> float32
        ]

    return sources, specs


@pytest.mark.parametrize("route", ["tcp", "default"])
async def test_two_trainers_two_receivers_versions_passive_and_a_rank_joining(
    anyio_backend: str, route: str, tmp_path: Path
) -> None:
    """2 -> 2 with different shardings (fused qkv, a row-parallel slice, two casts), two
    versions back to back, receiver 1 passive (never waits), then a third inference rank
    joins with a re-plan that leaves the others' tasks unchanged, and version 3 reaches all."""
    sources, specs = model_2x2()
    async with world(anyio_backend, route, sources, 2, 2, tmp_path) as w:
        rx = [
            await spawn_rx(w, anyio_backend, route, r, specs(r, 2), arena=route == "default")
            for r in range(2)
        ]
        assert len(rx) == 2
        want = "tcp" if route == "tcp" else "shm"
        for s in w.senders.values():
            for r in w.receivers.values():
                assert (await s.call(op="route", peer=r.address.hex()))["provider"].split(";")[0] == want
        p1 = await w.install()
        for v in (1, 2):  # back to back; receiver 0 waits, receiver 1 is passive
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.push, v)
                await w.receivers[0].call(op="wait", version=v, timeout=30)
            await w.check(v)
        assert (await w.receivers[1].call(op="poll", version=2))["complete"]  # it learns later if it likes

        # a third inference rank joins (TP 3 layout of its own): only its bytes are planned
        await spawn_rx(w, anyio_backend, route, 2, specs(1, 3))
        p2 = await w.install(previous=p1, ranks=[2])
        for r in (0, 1):
            assert p2.assignments(r) == p1.assignments(r)
            assert p2.receiver(r) == p1.receiver(r)
        assert p2.assignments(2) and p2.validate().in_bytes[2] > 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.push, 3)
            for r in (0, 2):
                tg.start_soon(lambda r=r: w.receivers[r].call(op="wait", version=3, timeout=30))
        await w.check(3)


async def spawn_rx(
    w: World, backend: str, route: str, r: int, specs: list[Spec], arena: bool = False
) -> Worker:
    if w.spare:
        proc = w.spare.pop(0)
    else:
        proc = await spawn_worker(backend, route)
        w.extra.append(proc)
    await w.add_receiver(r, proc, specs, arena=arena)
    return proc


# ------------------------------------------------------------------ row-parallel slices


def model_row_parallel() -> tuple[list[W.SourceShard], Callable[[int], list[Spec]]]:
    """Row-parallel layers on 2 trainers -> 2 inference ranks: each rank a column slice of the
    trainers' FSDP row shards (two uncast, one cast)."""
    sources = [
        *fsdp("o", (40, 96), "float32", [0, 23, 40]),
        *fsdp("d", (16, 300), "float16", [0, 9, 16]),
        *fsdp("c", (8, 64), "float32", [0, 4, 8]),
    ]

    def specs(r: int) -> list[Spec]:
        return [
            ("o", "float32", [W.Piece("o", (0, 40), W.split_rows(96, 2, r))]),
            ("d", "float16", [W.Piece("d", (0, 16), W.split_rows(300, 2, r))]),
            ("c16", "float16", [W.Piece("c", (0, 8), W.split_rows(64, 2, r))]),  # a cast: staged
        ]

    return sources, specs


@pytest.mark.parametrize("route", ["tcp", "default", "arena"])
async def test_row_parallel_slices_from_registered_sources(
    anyio_backend: str, route: str, tmp_path: Path
) -> None:
    """Row-parallel layers (each inference rank a column slice of the trainers' FSDP row
    shards) with ``register_sources``, 2 -> 2 across processes, two versions, byte-equal to the
    reference. On the same-host route, into ordinary buffers and into the receivers' host
    arena, every uncast slice went as a strided copy from the registered source, not staged
    (``strided_bytes``); a slice that needs a cast is staged on every route, and over tcp all
    of them are."""
    sources, specs = model_row_parallel()
    where = "tcp" if route == "tcp" else "default"
    async with world(anyio_backend, where, sources, 2, 2, tmp_path) as w:
        for r in range(2):
            await spawn_rx(w, anyio_backend, where, r, specs(r), arena=route == "arena")
        for s in w.senders.values():
            for r in w.receivers.values():
                got = (await s.call(op="route", peer=r.address.hex()))["provider"].split(";")[0]
                assert got == ("tcp" if route == "tcp" else "shm")
        p = await w.install(chunk_bytes=4096, register_sources=True)
        before = {s: (await x.call(op="stats"))["stats"] for s, x in w.senders.items()}
        for v in (1, 2):
            replies: dict[int, dict[str, Any]] = {}

            async def push(s: int, v: int = v, replies: dict[int, dict[str, Any]] = replies) -> None:
                replies[s] = await w.senders[s].call(op="push", version=v, timeout=30)

            async with anyio.create_task_group() as tg:
                for s in w.senders:
                    tg.start_soon(push, s)
            await w.check(v)
            for s, reply in replies.items():
                sliced = sum(x.nbytes for x in p.sender(s).writes if x.src_dtype == x.dst_dtype)
                cast = sum(x.nbytes for x in p.sender(s).writes if x.src_dtype != x.dst_dtype)
                assert sliced > 0 and cast > 0
                stats = reply["stats"]
                assert stats["strided_bytes"] == (0 if route == "tcp" else sliced), (route, s, stats)
                assert stats["direct_bytes"] == stats["strided_bytes"]
        for s, x in w.senders.items():
            st = (await x.call(op="stats"))["stats"]
            copies = st["direct_copies"] - before[s]["direct_copies"]
            mapped = st["direct_mapped"] - before[s]["direct_mapped"]
            if route == "tcp":
                assert copies == 0
            elif route == "arena":
                assert mapped > 0 and copies >= mapped
            else:
                assert copies > 0 and mapped == 0


async def failed_for_rank_1_only(w: World, kinds: tuple[str, ...]) -> None:
    """Every trainer's push (sent already) raised PushFailed naming rank 1 alone, with one of
    ``kinds``, and rank 0 completed."""
    for s in w.senders.values():
        with pytest.raises(WorkerError) as e:
            await s.reply(timeout=40)
        assert e.value.kind == "PushFailed"
        assert e.value.reply["completed"] == [0]
        assert set(e.value.reply["failed"]) == {"1"}
        assert e.value.reply["failed"]["1"] in kinds


@pytest.mark.parametrize("route", ["default", "arena"])
async def test_a_dead_receiver_fails_its_strided_slices_only(
    anyio_backend: str, route: str, tmp_path: Path
) -> None:
    """Row-parallel slices as strided copies on the same-host route: version 1 reaches both
    receivers; then receiver 1's process is killed, and each push of version 2 raises
    PushFailed naming rank 1 only (its copies fail on the dead process), within the core's
    peer-failure bound, while rank 0 gets every byte of version 2."""
    sources, specs = model_row_parallel()
    async with world(anyio_backend, "default", sources, 2, 2, tmp_path) as w:
        for r in range(2):
            await spawn_rx(w, anyio_backend, "default", r, specs(r), arena=route == "arena")
        await w.install(chunk_bytes=4096, register_sources=True, retry_attempts=0, connect_timeout=2.0)
        replies = [await x.call(op="push", version=1, timeout=30) for x in w.senders.values()]
        assert all(rep["stats"]["strided_bytes"] > 0 for rep in replies)
        await w.check(1)
        victim = w.receivers[1]
        os.kill(victim.pid, signal.SIGKILL)
        await victim.proc.wait()
        t = time.monotonic()
        for s in w.senders.values():
            await s.send(op="push", version=2, timeout=60)
        await failed_for_rank_1_only(w, ("PeerUnreachable", "TransferError"))
        assert time.monotonic() - t < 10
        await w.receivers[0].call(op="wait", version=2, timeout=30)
        await w.check(2, ranks=[0])


# ------------------------------------------------------------------ 4 -> 3, uneven rows


async def test_four_trainers_three_receivers_uneven_rows(anyio_backend: str, tmp_path: Path) -> None:
    """4 trainers with uneven FSDP rows -> 3 tensor-parallel inference ranks (rows that do not
    divide), a bias every trainer holds whole (the planner spreads it), float32 -> float16 and
    float32 -> FP8 e4m3 targets; over the default route."""
    sources = [
        *fsdp("w", (37, 24), "float32", [0, 5, 20, 21, 37]),
        *fsdp("x", (11, 40), "float32", [0, 1, 2, 3, 11]),
        *(W.SourceShard("b", (90,), "float32", i, (0, 90)) for i in range(4)),
    ]
    async with world(anyio_backend, "default", sources, 4, 3, tmp_path) as w:
        for r in range(3):
            await spawn_rx(
                w,
                anyio_backend,
                "default",
                r,
                [
                    ("w", "float32", [W.Piece("w", W.split_rows(37, 3, r))]),
                    ("x", "float16", [W.Piece("x", W.split_rows(11, 3, r))]),
                    ("x8", "float8_e4m3", [W.Piece("x", W.split_rows(11, 3, r))]),  # FP8, saturating
                    ("b", "float32", [W.Piece("b", (0, 90))]),
                ],
            )
        p = await w.install()
        b_srcs = {t.src for t in p.tasks if p.targets[t.target].name == "b"}
        assert len(b_srcs) > 1  # the replicated bias is spread over several trainers
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.push, 7)
            for r in range(3):
                tg.start_soon(lambda r=r: w.receivers[r].call(op="wait", version=7, timeout=30))
        await w.check(7)


# ------------------------------------------------------------------ versions never mix


async def test_a_late_write_of_v_never_completes_v_plus_1(anyio_backend: str, tmp_path: Path) -> None:
    sources = fsdp("w", (64, 32), "float32", [0, 40, 64])
    async with world(anyio_backend, "tcp", sources, 2, 1, tmp_path) as w:
        await spawn_rx(w, anyio_backend, "tcp", 0, [("w", "float32", [W.Piece("w", (0, 64))])])
        await w.install()
        rx = w.receivers[0]
        await w.push(1)
        await rx.call(op="wait", version=1, timeout=30)
        await w.push(2, senders=[0])
        await w.push(1, senders=[1])  # late: sender 1 writes version 1 again
        with pytest.raises(WorkerError) as e:
            await rx.call(op="wait", version=2, timeout=0.5)
        assert e.value.kind == "TransferTimeout"
        assert not (await rx.call(op="poll", version=2))["complete"]
        await w.push(2, senders=[1])
        await rx.call(op="wait", version=2, timeout=30)
        await w.check(2)


# ------------------------------------------------------------------ faults


def model_faults() -> tuple[list[W.SourceShard], Callable[[int], list[Spec]]]:
    # each trainer writes to both inference ranks
    sources = [
        *fsdp("a", (256, 256), "float32", [0, 200, 256]),
        *fsdp("b", (64, 256), "float16", [0, 20, 64]),
    ]

    def specs(r: int) -> list[Spec]:
        return [
            ("a", "float32", [W.Piece("a", W.split_rows(256, 2, r))]),
            ("b", "float16", [W.Piece("b", W.split_rows(64, 2, r))]),
        ]

    return sources, specs


async def test_receiver_killed_mid_push_fails_that_receiver_only(anyio_backend: str, tmp_path: Path) -> None:
    """Receiver 1 frozen (SIGSTOP: no write to it can complete), both trainers push, receiver
    0 completes while the pushes hang on receiver 1; receiver 1 killed: each push raises
    PushFailed naming rank 1 only, with rank 0 completed."""
    sources, specs = model_faults()
    async with world(anyio_backend, "tcp", sources, 2, 2, tmp_path) as w:
        for r in range(2):
            await spawn_rx(w, anyio_backend, "tcp", r, specs(r))
        await w.install(retry_attempts=0, connect_timeout=2.0)  # a dead peer is not tried again
        victim = w.receivers[1]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            for s in w.senders.values():
                await s.send(op="push", version=1, timeout=60)
            await w.receivers[0].call(op="wait", version=1, timeout=30)  # the pushes are mid-way
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        await failed_for_rank_1_only(w, ("PeerUnreachable", "TransferError", "RemoteAccessError"))
        assert time.monotonic() - killed < 10  # the core's peer-failure bound: connect_timeout
        await w.check(1, ranks=[0])
        await victim.proc.wait()


async def test_sender_killed_mid_push_leaves_the_version_incomplete(
    anyio_backend: str, tmp_path: Path
) -> None:
    """Receiver 1 frozen so that trainer 0's push hangs mid-way (receiver 0 done, receiver 1
    not); trainer 0 killed, receiver 1 thawed: trainer 1 completes, but receiver 1's
    wait_version fails at its deadline and the version is not marked complete."""
    sources, specs = model_faults()
    async with world(anyio_backend, "tcp", sources, 2, 2, tmp_path) as w:
        for r in range(2):
            await spawn_rx(w, anyio_backend, "tcp", r, specs(r))
        await w.install()
        s0, s1 = w.senders[0], w.senders[1]
        frozen = w.receivers[1]
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            for s in (s0, s1):
                await s.send(op="push", version=5, timeout=60)
            await w.receivers[0].call(op="wait", version=5, timeout=30)
            os.kill(s0.pid, signal.SIGKILL)
            await s0.proc.wait()
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        assert "stats" in await s1.reply(timeout=30)  # trainer 1 reaches receiver 1 once it runs
        t = time.monotonic()
        with pytest.raises(WorkerError) as e:
            await frozen.call(op="wait", version=5, timeout=1.0)
        assert e.value.kind == "TransferTimeout"
        assert 0.9 <= time.monotonic() - t < 10
        r = await frozen.call(op="poll", version=5)
        assert not r["complete"] and r["latest"] is None


async def test_push_deadline_on_a_frozen_receiver_and_the_next_push_waits_for_it(
    anyio_backend: str, tmp_path: Path
) -> None:
    """Receiver 1 frozen: the push's deadline fails rank 1 only (TransferTimeout), rank 0
    completes; the next push refuses to start while those writes may still land (they read the
    staging buffer); once receiver 1 runs again they settle and the next version reaches both."""
    sources, specs = model_faults()
    async with world(anyio_backend, "tcp", sources, 2, 2, tmp_path) as w:
        for r in range(2):
            await spawn_rx(w, anyio_backend, "tcp", r, specs(r))
        await w.install()
        s0 = w.senders[0]
        frozen = w.receivers[1]
        await w.push(1)  # connections open: writes to the frozen rank are then posted and stay in flight
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(WorkerError) as e:
                await s0.call(op="push", version=2, timeout=1.0)
            assert 0.9 <= time.monotonic() - t < 10
            assert e.value.kind == "PushFailed" and e.value.reply["failed"] == {"1": "TransferTimeout"}
            assert e.value.reply["completed"] == [0]
            with pytest.raises(WorkerError) as e:
                await s0.call(op="push", version=3, timeout=0.5)
            assert e.value.kind == "TransferTimeout" and "earlier push" in str(e.value), e.value.reply
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        await w.push(4)
        for r in range(2):
            await w.receivers[r].call(op="wait", version=4, timeout=30)
        await w.check(4)


# ------------------------------------------------------------------ refusals, in one process


async def test_push_refuses_bad_input_before_posting(anyio_backend: str) -> None:
    sources = fsdp("w", (8, 4), "float32", [0, 4, 8])
    async with engine_pair(same_host=None) as (a, b):
        tg, n = W.pack_targets(0, [("w", "float32", [W.Piece("w", (0, 8))])], sources)
        dst = np.zeros(n, np.uint8)
        mr = await b.register(dst)
        p = W.plan(sources, W.with_desc(tg, bytes(mr.descriptor)))
        before = a.stats()
        async with W.WeightSender(a, p.sender(0), max_tmp_bytes=1024) as tx:
            good = np.ones((4, 4), np.float32)
            for bad, match in [
                ({}, "no tensor"),
                ({"w": np.ones((5, 4), np.float32)}, "shape"),
                ({"w": np.ones((4, 4), np.float64)}, "float64"),
                ({"w": np.ones((4, 8), np.float32)[:, ::2]}, "shape|contiguous"),
                ({"w": [1, 2]}, "NumPy or CuPy"),
            ]:
                with pytest.raises(aiote.InvalidArgument, match=match):
                    await tx.push(bad, version=1, timeout=5)
            for v in (-1, 1.5, True):
                with pytest.raises(aiote.InvalidArgument, match="version"):
                    await tx.push({"w": good}, version=v, timeout=5)  # type: ignore[arg-type]
            with pytest.raises(aiote.InvalidArgument, match="timeout"):
                await tx.push({"w": good}, version=1, timeout=-1)
            nothing_posted(a, before)
            assert not dst.any()
            stats = await tx.push({"w": good}, version=1, timeout=5)
            assert stats.nbytes == 64 and stats.bytes_by_receiver == {0: 64}
        with pytest.raises(W.PlanError, match="max_tmp_bytes"):
            W.WeightSender(a, p.sender(0), max_tmp_bytes=8)
        with pytest.raises(W.PlanError, match="descriptors"):
            W.WeightSender(a, W.plan(sources, tg).sender(0))
        assert dst[:64].view(np.float32).tolist() == [1.0] * 16


async def test_wait_version_in_one_process_timeouts_and_two_waiters(anyio_backend: str) -> None:
    sources = fsdp("w", (8, 4), "float32", [0, 8])
    async with engine_pair(same_host=None) as (a, b):
        tg, n = W.pack_targets(0, [("w", "float16", [W.Piece("w", (0, 8))])], sources)
        dst = np.zeros(n, np.uint8)
        mr = await b.register(dst)
        p = W.plan(sources, W.with_desc(tg, bytes(mr.descriptor)))
        rx = W.WeightReceiver(b, p.receiver(0))
        with pytest.raises(aiote.TransferTimeout):
            await rx.wait_version(3, timeout=0.05)
        assert not rx.is_complete(3) and not rx.poll(3)
        src = np.arange(32, dtype=np.float32).reshape(8, 4)
        done: list[int] = []

        async def waiter() -> None:
            await rx.wait_version(3, timeout=10)
            done.append(1)

        async with W.WeightSender(a, p.sender(0)) as tx, anyio.create_task_group() as g:
            g.start_soon(waiter)
            g.start_soon(waiter)
            await anyio.sleep(0.01)
            stats = await tx.push({"w": src}, version=3, timeout=10)
        assert done == [1, 1] and rx.is_complete(3) and rx.latest == 3
        assert stats.writes == 1 and stats.peak_staging_bytes == 64
        assert dst[:64].view(np.float16).tolist() == list(range(32))


async def test_registered_sources_in_one_flat_buffer_merge_into_few_writes(anyio_backend: str) -> None:
    """Tensors of different sizes laid out one after another in one buffer, packed the same
    way on the receiver (the plan orders the writes by size, not by place): with
    ``register_sources`` the buffer is registered once and the writes, taken in the order of
    what they read, merge up to ``coalesce_bytes`` (and a quarter of ``max_tmp_bytes``); a
    cast, or a tensor of its own, stays a write of its own. Every byte verified, four
    versions; ``coalesce_bytes=0`` merges none."""
    names = [f"p{i}" for i in range(6)]
    rows = {nm: 4 * (i + 1) for i, nm in enumerate(names)}  # 128 .. 768 bytes
    sources = [s for nm in names for s in fsdp(nm, (rows[nm], 8), "float32", [0, rows[nm]])]
    sources += fsdp("own", (4, 8), "float32", [0, 4]) + fsdp("cast", (4, 8), "float32", [0, 4])
    specs: list[Spec] = [(nm, "float32", [W.Piece(nm, (0, rows[nm]))]) for nm in names]
    specs += [("own", "float32", [W.Piece("own", (0, 4))]), ("cast", "float16", [W.Piece("cast", (0, 4))])]
    async with engine_pair(same_host=None) as (a, b):
        tg, n = W.pack_targets(0, specs, sources, align=32)
        dst = np.zeros(n, np.uint8)
        mr = await b.register(dst)
        p = W.plan(sources, W.with_desc(tg, bytes(mr.descriptor)), chunk_bytes=256)
        planned = len(p.sender(0).writes)
        assert planned == 12 + 2 and [w.source for w in p.sender(0).writes][:2] != ["p0", "p1"]
        rx = W.WeightReceiver(b, p.receiver(0))
        flat = np.zeros(sum(rows.values()) * 32, np.uint8)
        t, at = {}, 0
        for nm in names:
            t[nm] = flat[at : at + rows[nm] * 32].view(np.float32).reshape(rows[nm], 8)
            at += rows[nm] * 32
        t["own"], t["cast"] = np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)
        # (coalesce_bytes, max_tmp_bytes, version, writes): a merge is at most a quarter of the budget
        cases = ((1024, 1 << 20, 1, 3 + 2), (0, 1 << 20, 2, planned), (1 << 20, 1 << 20, 3, 1 + 2))
        for coalesce, tmp, version, want_writes in (*cases, (1 << 20, 4096, 4, 3 + 2)):
            for i, a_ in enumerate(t.values()):
                a_[...] = np.arange(a_.size, dtype=np.float32).reshape(a_.shape) + 100 * i + version
            async with W.WeightSender(
                a, p.sender(0), register_sources=True, coalesce_bytes=coalesce, max_tmp_bytes=tmp
            ) as tx:
                stats = await tx.push(t, version=version, timeout=10)
                await rx.wait_version(version, timeout=10)
                assert len(tx._registered) == 2  # the flat buffer and "own"
            assert stats.writes == want_writes, (coalesce, stats)
            assert stats.direct_bytes == flat.nbytes + 128 and stats.nbytes == flat.nbytes + 128 + 64
            for tgt in tg:
                want = t[tgt.name].astype(np.float16 if tgt.name == "cast" else np.float32).tobytes()
                assert dst[tgt.offset : tgt.offset + len(want)].tobytes() == want, (tgt.name, version)
        # one sender, the layout changing between pushes (each tensor apart: merges within one
        # only): the merges follow, never a stale one
        apart = {nm: np.array(t[nm]) for nm in names} | {"own": t["own"], "cast": t["cast"]}
        async with W.WeightSender(a, p.sender(0), register_sources=True, coalesce_bytes=1024) as tx:
            for version, tensors, want_writes in ((5, t, 3 + 2), (6, apart, len(names) + 2), (7, t, 3 + 2)):
                for i, a_ in enumerate(tensors.values()):
                    a_[...] = np.arange(a_.size, dtype=np.float32).reshape(a_.shape) + 100 * i + version
                stats = await tx.push(tensors, version=version, timeout=10)
                await rx.wait_version(version, timeout=10)
                assert stats.writes == want_writes, (version, stats)
                for tgt in tg:
                    want = tensors[tgt.name].astype(np.float16 if tgt.name == "cast" else np.float32)
                    assert dst[tgt.offset : tgt.offset + want.nbytes].tobytes() == want.tobytes(), version
            tx.coalesce_bytes = 0  # the cap changed: no merge
            assert (await tx.push(t, version=8, timeout=10)).writes == planned
        with pytest.raises(aiote.InvalidArgument, match="coalesce_bytes"):
            W.WeightSender(a, p.sender(0), coalesce_bytes=-1)


async def test_large_staged_copies_split_over_threads(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host with cores to spare a staged chunk (a cast, a column slice) is copied by up
    to four worker threads at once, each a block of its rows: every byte still lands where
    the plan says (checked against NumPy), and the copies did go in parts."""
    from aiote.weights import _flow

    monkeypatch.setattr(_flow, "_COPY_THREADS", 4)
    parts: list[tuple[int, int] | None] = []
    real = _flow.WeightSender._transform

    def spy(self: Any, w: Any, src: Any, off: int, part: tuple[int, int] | None = None) -> None:
        parts.append(part)
        real(self, w, src, off, part)

    monkeypatch.setattr(_flow.WeightSender, "_transform", spy)
    sources = fsdp("w", (1024, 2048), "float32", [0, 1024])
    specs: list[Spec] = [
        ("w16", "float16", [W.Piece("w", (0, 1024))]),  # a cast: 4 MiB staged
        ("wcols", "float32", [W.Piece("w", (0, 1024), (512, 2048))]),  # a column slice: 6 MiB staged
    ]
    async with engine_pair(same_host=None) as (a, b):
        tg, n = W.pack_targets(0, specs, sources)
        dst = np.zeros(n, np.uint8)
        mr = await b.register(dst)
        p = W.plan(sources, W.with_desc(tg, bytes(mr.descriptor)), chunk_bytes=16 << 20)
        rx = W.WeightReceiver(b, p.receiver(0))
        w = np.random.default_rng(5).standard_normal((1024, 2048)).astype(np.float32)
        async with W.WeightSender(a, p.sender(0), max_tmp_bytes=64 << 20) as tx:
            await tx.push({"w": w}, version=1, timeout=20)
        await rx.wait_version(1, timeout=20)
        want = {"w16": w.astype(np.float16), "wcols": w[:, 512:]}
        for t in tg:
            got = dst[t.offset : t.offset + want[t.name].nbytes]
            assert got.tobytes() == np.ascontiguousarray(want[t.name]).tobytes(), t.name
    assert len(parts) == 8 and all(x is not None for x in parts)  # 4 parts each, none whole


# ------------------------------------------------------------------ the vLLM-shaped example


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_vllm_backend_example_runs_standalone(backend: str) -> None:
    """examples/weights_vllm_backend.py: the phases of vLLM's weight-transfer interface over
    aiote.weights, without vLLM; two versions, every inference shard verified."""
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "examples" / "weights_vllm_backend.py"
    out = subprocess.run(
        [sys.executable, str(path), "--backend", backend], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"version 2: every inference shard verified ({backend})" in out.stdout
    assert "plan: 8 writes" in out.stdout


async def test_register_targets_and_typed_views(anyio_backend: str) -> None:
    """An inference rank's memory laid out, registered once, and read through typed views."""
    sources = [*fsdp("q", (8, 4), "float32", [0, 4, 8]), *fsdp("k", (4, 4), "float32", [0, 4])]
    sources += fsdp("o", (4, 8), "float32", [0, 4])
    async with engine_pair(same_host=None) as (a, b):
        specs: list[Spec] = [
            ("qk", "float16", W.fused_tp([("q", 8), ("k", 4)], 0, 2)),
            ("o", "float32", [W.Piece("o", (0, 4), (2, 6))]),
            ("mixed", "float32", [W.Piece("q", (0, 1)), W.Piece("o", (0, 1))]),
        ]
        mem = await W.register_targets(b, 0, specs, sources)
        assert mem.shapes == {"qk": (6, 4), "o": (4, 4), "mixed": (12, 0)}
        with pytest.raises(aiote.InvalidArgument, match="at least"):
            await W.register_targets(b, 0, specs, sources, buffer=np.zeros(8, np.uint8))
        with pytest.raises(aiote.InvalidArgument, match="not both"):
            await W.register_targets(b, 0, specs, sources, buffer=np.zeros(1 << 12, np.uint8), gpu=0)
        async with aiote.open_engine(provider="tcp", gpu_backend="host") as g:  # gpu=: Engine.alloc_gpu
            gm = await W.register_targets(g, 0, specs, sources, gpu=0)
            d = gm.region.descriptor.gpu
            assert d is not None and _vmm.is_handle(d.ipc_handle) and gm.view("qk").shape == (6, 4)
        p = W.plan(sources, mem.targets)
        rx = W.WeightReceiver(b, p.receiver(0))
        q = np.arange(32, dtype=np.float32).reshape(8, 4)
        k = -np.arange(16, dtype=np.float32).reshape(4, 4)
        o = np.arange(32, dtype=np.float32).reshape(4, 8) / 2
        async with W.WeightSender(a, p.sender(0)) as t0, W.WeightSender(a, p.sender(1)) as t1:
            await t0.push({"q": q[:4], "k": k, "o": o}, version=9, timeout=10)
            await t1.push({"q": q[4:]}, version=9, timeout=10)
        await rx.wait_version(9, timeout=10)
        assert np.array_equal(mem.view("qk"), np.concatenate([q[:4], k[:2]]).astype(np.float16))
        assert np.array_equal(mem.view("o"), o[:, 2:6])
        assert np.array_equal(mem.view("mixed"), np.concatenate([q[0], o[0]]))


async def test_a_controller_takes_the_receivers_descriptors_from_etcd(anyio_backend: str) -> None:
    """Inference ranks that know only etcd's address register their engine, their region's
    descriptor and their rank (aiote.membership); the controller waits for every rank
    (Group.ranks), plans with the descriptors etcd holds, and the trainers' push lands byte
    for byte in each rank's region."""
    why = etcd_unavailable()
    if why is not None:
        pytest.skip(why)
    from aiote import membership

    sources, specs = model_2x2()
    layouts = [W.pack_targets(r, specs(r, 2), sources) for r in range(2)]
    with etcd_cluster(1) as etcd:
        async with contextlib.AsyncExitStack() as stack:
            members = await stack.enter_async_context(membership.connect(etcd.url))
            grp = members.group(f"weights/inference-{anyio_backend}", ttl=5)
            trainers = [await stack.enter_async_context(aiote.open_engine(same_host=None)) for _ in range(2)]
            regions = []
            for r in (1, 0):  # the ranks join in any order
                e = await stack.enter_async_context(aiote.open_engine(same_host=None))
                dst = np.zeros(layouts[r][1], np.uint8)
                mr = await e.register(dst)
                regions.append((r, e, dst, mr))
                await stack.enter_async_context(
                    grp.register(e.address, descriptors={"weights": mr.descriptor}, meta={"rank": r})
                )
            ranked = await grp.ranks(2, timeout=20)  # the controller's view, in rank order
            assert [m.meta["rank"] for m in ranked] == [0, 1]
            targets = [t for r, m in enumerate(ranked)
                       for t in W.with_desc(layouts[r][0], bytes(m.descriptors["weights"]))]
            plan = W.plan(sources, targets)
            rx = {r: W.WeightReceiver(e, plan.receiver(r)) for r, e, _, _ in regions}
            tensors = [
                {s.name: source_tensor(s.name, s.shape, s.dtype, 1)[s.rows[0] : s.rows[1]] for s in sources
                 if s.rank == t}
                for t in range(2)
            ]
            async with W.WeightSender(trainers[0], plan.sender(0)) as t0, \
                    W.WeightSender(trainers[1], plan.sender(1)) as t1, anyio.create_task_group() as tg:
                tg.start_soon(lambda: t0.push(tensors[0], version=1, timeout=30))
                tg.start_soon(lambda: t1.push(tensors[1], version=1, timeout=30))
            shapes = {s.name: (s.shape, s.dtype) for s in sources}
            for r, _, dst, _ in regions:
                await rx[r].wait_version(1, timeout=30)
                for t in layouts[r][0]:
                    want = reference(t, shapes, 1)
                    assert dst[t.offset : t.offset + len(want)].tobytes() == want, (r, t.name)
