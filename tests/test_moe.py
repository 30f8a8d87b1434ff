"""aiote.moe across real processes, one per rank (tests/_moe_rank.py), under asyncio and trio:
every case is checked inside each rank against the NumPy reference (aiote.moe.reference),
dispatch byte-exact and combine bit-exact, over tcp loopback (4 ranks) and over the default
same-host route (2 ranks; the route that ran is asserted). One group of processes serves all
the cases of a test module's backend, so the matrix costs process start-ups only once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import numpy as np
import pytest
from _etcd import etcd_cluster, etcd_unavailable
from anyio.streams.buffered import BufferedByteReceiveStream

import aiote
from aiote import moe
from aiote.testing import ready_line, stop_process

pytestmark = pytest.mark.anyio

WORKER = str(Path(__file__).with_name("_moe_rank.py"))


class Ranks:
    """The rank processes of one group, driven over their stdin/stdout."""

    def __init__(self, procs: list[anyio.abc.Process], addrs: list[str]) -> None:
        self.procs = procs
        self.addrs = addrs
        self.readers = [BufferedByteReceiveStream(p.stdout) for p in procs]  # type: ignore[arg-type]
        self.routes: list[list[str]] = []

    async def send(self, r: int, **cmd: Any) -> None:
        assert self.procs[r].stdin is not None
        await self.procs[r].stdin.send((json.dumps(cmd) + "\n").encode())

    async def reply(self, r: int, timeout: float = 60) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            line = await self.readers[r].receive_until(b"\n", 1 << 20)
        return dict(json.loads(line))

    async def all(
        self, ranks: list[int] | None = None, timeout: float = 60, **cmd: Any
    ) -> list[dict[str, Any]]:
        """Sends ``cmd`` to ``ranks`` (default all) and returns their replies, each checked ok."""
        ranks = list(range(len(self.procs))) if ranks is None else ranks
        for r in ranks:
            await self.send(r, **cmd)
        replies = [await self.reply(r, timeout) for r in ranks]
        for r, rep in zip(ranks, replies, strict=True):
            assert rep.get("ok"), f"rank {r}: {rep.get('error')} (case {cmd})"
        return replies


async def start_ranks(
    world: int, backend: str, mode: str, gpus: list[int] | None = None, *, given: bool = True
) -> Ranks:
    """``world`` rank processes (``gpus``: the GPU of each, CuPy arrays), given their group
    (``given``; otherwise they are to find it: see the etcd test)."""
    procs: list[anyio.abc.Process] = []
    addrs: list[str] = []
    for r in range(world):
        cmd = [sys.executable, WORKER, "--backend", backend, "--mode", mode]
        if gpus is not None:
            cmd += ["--gpu", str(gpus[r])]
        proc = await anyio.open_process(cmd, stdin=-1, stdout=-1, stderr=None)
        procs.append(proc)
    for proc in procs:
        line = await ready_line(proc, "MOE_RANK", 60)
        addrs.append(line.split()[1])
    ranks = Ranks(procs, addrs)
    if not given:
        return ranks
    for r in range(world):
        await ranks.send(r, op="group", addrs=addrs, rank=r)
    ranks.routes = [(await ranks.reply(r))["routes"] for r in range(world)]
    return ranks


async def stop_ranks(ranks: Ranks) -> None:
    with anyio.CancelScope(shield=True):
        for r, p in enumerate(ranks.procs):
            if p.returncode is None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    await ranks.send(r, op="exit")
        for p in ranks.procs:
            await stop_process(p, grace=10)


@pytest.fixture(scope="module")
async def tcp4(anyio_backend: str) -> AsyncIterator[Ranks]:
    ranks = await start_ranks(4, anyio_backend, "tcp")
    try:
        yield ranks
    finally:
        await stop_ranks(ranks)


@pytest.fixture(scope="module")
async def host2(anyio_backend: str) -> AsyncIterator[Ranks]:
    ranks = await start_ranks(2, anyio_backend, "default")
    try:
        yield ranks
    finally:
        await stop_ranks(ranks)


def case(**kw: Any) -> dict[str, Any]:
    base = {"E": 8, "K": 2, "H": 16, "T": 12, "dtype": "float32", "pad": 1, "seed": 1, "calls": 1}
    base.update(kw)
    return base


# The matrix of FLOWS.md B7 at small shapes: (name, case); tokens per rank listed for 4 ranks.
MATRIX = [
    ("E divisible by W, k=2", case(tokens=[12, 12, 12, 12])),
    ("E not divisible by W (some rank holds fewer experts), k=1", case(E=7, K=1, tokens=[5, 12, 3, 9])),
    ("k=8, padding 16", case(E=10, K=8, pad=16, tokens=[12, 7, 12, 2])),
    ("some ranks with zero tokens", case(tokens=[0, 12, 0, 4])),
    ("no tokens at all", case(tokens=[0, 0, 0, 0])),
    ("all tokens to one expert (past any per-source slots)",
     case(K=2, one_expert=5, tokens=[12, 12, 12, 12])),
    ("bfloat16, padding 16", case(dtype="bfloat16", pad=16, E=9, K=2, H=24, tokens=[12, 6, 12, 1])),
    ("bound_m below the buffer size", case(bound=[5, 0, 12, 3], tokens=[12, 12, 12, 12])),
    ("-1 indices", case(K=8, E=12, skip=0.3, tokens=[12, 12, 5, 12])),
    ("accumulate into out (float32)", case(accumulate=True, tokens=[12, 3, 12, 12])),
    ("accumulate into out (bfloat16)", case(dtype="bfloat16", accumulate=True, tokens=[4, 12, 12, 0])),
    ("float8 with block scales, bfloat16 combine", case(dtype="float8_e4m3fn", out="bfloat16", scale=16, H=48,
                                                        K=8, E=16, pad=16, tokens=[12, 5, 12, 0])),
]


@pytest.mark.parametrize("name,spec", MATRIX, ids=[m[0] for m in MATRIX])
async def test_tcp_four_ranks_against_reference(tcp4: Ranks, name: str, spec: dict[str, Any]) -> None:
    assert all(route == ["tcp;ofi_rxm"] * 3 for route in tcp4.routes), tcp4.routes
    replies = await tcp4.all(op="case", **{**spec, "calls": 2})  # both the whole call and the split halves
    assert all(r["checks"] >= 12 for r in replies), replies


async def test_tcp_hundred_back_to_back_calls_fresh_routing(tcp4: Ranks) -> None:
    spec = case(E=8, K=2, H=8, T=8, tokens=[8, 8, 6, 8], seed=5, skip=0.1, calls=100)
    replies = await tcp4.all(op="case", timeout=120, **spec)
    assert all(r["checks"] >= 600 for r in replies), replies


async def test_tcp_two_micro_batches_in_flight(tcp4: Ranks) -> None:
    """dispatch_send A, dispatch_send B, recv A, recv B, combine A and B: the two parities'
    regions in use at once, 20 times with fresh routing."""
    spec = case(E=10, K=3, H=16, T=10, tokens=[10, 7, 10, 0], seed=41, calls=20, dtype="bfloat16", pad=4)
    replies = await tcp4.all(op="overlap", timeout=120, **spec)
    assert all(r["checks"] >= 20 * 4 for r in replies), replies


async def test_tcp_cancelled_calls_leave_the_next_correct(tcp4: Ranks) -> None:
    for where, others in (("dispatch_send", "timeout"), ("dispatch_recv", "ok"), ("combine_recv", "ok")):
        spec = case(E=8, K=2, tokens=[12, 12, 12, 12], seed=11, where=where)
        replies = await tcp4.all(op="cancel", **spec)
        assert replies[0]["outcome"] == "cancelled", (where, replies)
        assert [r["outcome"] for r in replies[1:]] == [others] * 3, (where, replies)
        after = await tcp4.all(op="case", **{**spec, "seed": 12, "calls": 3})
        assert all(r["checks"] >= 18 for r in after), after


async def test_tcp_peer_killed_mid_dispatch_fails_every_other_rank(tcp4: Ranks) -> None:
    """Runs last on this group (it kills rank 3). The survivors wait for the victim's counts;
    it dies; each raises PeerUnreachable within connect_timeout (2 s here) plus the probe
    interval (0.25 s) plus slack."""
    spec = case(tokens=[12, 12, 12, 12], seed=21)
    await tcp4.all([3], op="stall")
    for r in range(3):
        await tcp4.send(r, op="fail", **spec)
    await anyio.sleep(0.3)  # the survivors are inside their dispatch, waiting on rank 3
    os.kill(tcp4.procs[3].pid, signal.SIGKILL)
    killed = time.monotonic()
    replies = [await tcp4.reply(r, timeout=40) for r in range(3)]
    assert all(r["ok"] for r in replies), replies
    assert [r["error"] for r in replies] == ["PeerUnreachable"] * 3, replies
    assert all(r["elapsed"] < 8.0 for r in replies), replies
    assert time.monotonic() - killed < 8.0


HOST_CASES = [
    ("bfloat16 k=8 padding 16 with -1 indices", case(dtype="bfloat16", E=16, K=8, pad=16, skip=0.2,
                                                     tokens=[12, 9])),
    ("float32 E not divisible, zero tokens on one rank", case(E=5, K=2, tokens=[0, 12])),
    ("all tokens to one expert, bound_m", case(one_expert=0, bound=[7, 12], tokens=[12, 12])),
]


@pytest.mark.parametrize("name,spec", HOST_CASES, ids=[m[0] for m in HOST_CASES])
async def test_same_host_route_two_ranks(
    host2: Ranks, need_shm: None, name: str, spec: dict[str, Any]
) -> None:
    assert host2.routes == [["shm"], ["shm"]], host2.routes  # the default route between same-host ranks
    replies = await host2.all(op="case", **{**spec, "calls": 2})
    assert all(r["checks"] >= 12 for r in replies), replies


async def test_same_host_back_to_back_overlap_and_cancel(host2: Ranks, need_shm: None) -> None:
    replies = await host2.all(op="case", **case(E=6, K=3, H=8, T=8, tokens=[8, 8], seed=9, calls=100),
                              timeout=120)
    assert all(r["checks"] >= 600 for r in replies), replies
    replies = await host2.all(op="overlap", timeout=120, **case(E=6, K=2, H=8, T=8, tokens=[8, 5], seed=43,
                                                                calls=10))
    assert all(r["checks"] >= 40 for r in replies), replies
    spec = case(tokens=[12, 12], seed=13, where="dispatch_recv")
    replies = await host2.all(op="cancel", **spec)
    assert [r["outcome"] for r in replies] == ["cancelled", "ok"], replies
    after = await host2.all(op="case", **{**spec, "seed": 14, "calls": 2})
    assert all(r["checks"] >= 12 for r in after), after


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    why = etcd_unavailable()
    if why is not None:
        pytest.skip(why)
    with etcd_cluster(1) as c:
        yield c.url


async def test_ranks_find_their_group_through_etcd(anyio_backend: str, etcd_url: str) -> None:
    """Three ranks that know only etcd's address (aiote.membership): each registers its
    engine with its rank, waits for the others (Group.ranks) and forms the group in rank
    order; every rank agrees on it, and a dispatch/combine over it matches the reference."""
    ranks = await start_ranks(3, anyio_backend, "tcp", given=False)
    try:
        group = f"moe/ep-{anyio_backend}"
        for r in (2, 0, 1):  # in any order: each waits for the rest
            await ranks.send(r, op="join", url=etcd_url, group=group, rank=r, world=3)
        joined = [await ranks.reply(r) for r in range(3)]
        assert all(j.get("ok") for j in joined), joined
        assert all(j["addrs"] == ranks.addrs for j in joined), (joined, ranks.addrs)
        assert all(j["routes"] == ["tcp;ofi_rxm"] * 2 for j in joined), joined
        replies = await ranks.all(op="case", **case(tokens=[12, 5, 9], seed=7, calls=2))
        assert all(r["checks"] >= 12 for r in replies), replies
    finally:
        await stop_ranks(ranks)


async def test_one_rank_in_process_against_reference() -> None:
    """W = 1: no peer, every token stays local; the same semantics."""
    async with aiote.open_engine(same_host=None) as e:
        a = await moe.AllToAll.create(
            e, moe.Group([e.address], 0), num_experts=5, experts_per_token=3, hidden=8, max_tokens=16,
            in_dtype="float32", out_dtype="float32", expert_padding=16, timeout=10,
        )
        rng = np.random.default_rng(3)
        for call in range(3):
            x = rng.standard_normal((16, 8)).astype(np.float32)
            idx = np.argsort(rng.random((16, 5)), axis=1)[:, :3]
            idx[2, 1] = -1
            w = rng.random((16, 3)).astype(np.float32)
            h = await a.dispatch(x, idx, w, bound_m=13 - call)
            want = moe.reference.reference_dispatch([x], [idx], 5, 16, [13 - call])[0]
            valid = want.src_rank >= 0
            assert np.array_equal(h.counts, want.counts) and np.array_equal(h.offsets, want.offsets)
            assert np.array_equal(h.src_token, want.src_token)
            assert np.array_equal(h.expert_x[valid], want.expert_x[valid])
            y = (h.expert_x * np.float32(2)).astype(np.float32)
            out = await a.combine(h, y)
            ref_out = moe.reference.reference_combine([want], [y], [idx], [w], 5, "float32", [13 - call])[0]
            assert np.array_equal(out, ref_out)
        await a.aclose()


async def test_same_host_peer_killed_mid_dispatch(host2: Ranks, need_shm: None) -> None:
    """Runs last on this group (it kills rank 1): the survivor, waiting for the victim's
    counts over the same-host route, raises PeerUnreachable within the bound."""
    await host2.all([1], op="stall")
    await host2.send(0, op="fail", **case(tokens=[12, 12], seed=31))
    await anyio.sleep(0.3)
    os.kill(host2.procs[1].pid, signal.SIGKILL)
    reply = await host2.reply(0, timeout=40)
    assert reply["ok"] and reply["error"] == "PeerUnreachable", reply
    assert reply["elapsed"] < 8.0, reply
