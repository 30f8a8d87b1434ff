"""aiote.moe without processes: the NumPy reference on a worked example, the flow's layout
(aiote.moe._layout, the offsets every rank computes) against the reference over many random
groups with the data moved by NumPy copies, the bfloat16 helpers, and bad input raising
InvalidArgument before anything is posted (engines in this process)."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
from _util import nothing_posted, snapshot

import aiote
from aiote import moe
from aiote.moe._layout import Geometry, plan_recv, plan_send
from aiote.moe.reference import reference_combine, reference_dispatch


def test_reference_worked_example() -> None:
    """W=2, E=3 (ranks hold experts {0, 1} and {2}), K=2, padding 2."""
    xs = [np.array([[10.0], [11.0], [12.0]], np.float32), np.array([[20.0], [21.0]], np.float32)]
    idx = [np.array([[0, 2], [1, -1], [2, 0]]), np.array([[2, 1], [0, 2]])]
    out = reference_dispatch(xs, idx, num_experts=3, expert_padding=2)
    r0, r1 = out
    assert r0.counts.tolist() == [3, 2] and r0.offsets.tolist() == [0, 4, 6]
    assert r0.src_rank.tolist() == [0, 0, 1, -1, 0, 1]
    assert r0.src_token.tolist() == [0, 2, 1, -1, 1, 0]
    assert r0.expert_x[:, 0].tolist() == [10, 12, 21, 0, 11, 20]
    assert r1.counts.tolist() == [4] and r1.offsets.tolist() == [0, 4]
    assert r1.src_rank.tolist() == [0, 0, 1, 1] and r1.src_token.tolist() == [0, 2, 0, 1]
    ys = [o.expert_x * np.float32(2) for o in out]
    ws = [np.array([[0.5, 0.25], [1.0, 9.0], [0.125, 1.0]], np.float32), np.ones((2, 2), np.float32)]
    got = reference_combine(out, ys, idx, ws, 3, "float32")
    assert got[0][:, 0].tolist() == [2 * 10 * 0.75, 2 * 11.0, 2 * 12 * 1.125]
    assert got[1][:, 0].tolist() == [80.0, 84.0]


def simulate(xs, idx, ws, e, pad, bm, ys_fn):  # type: ignore[no-untyped-def]
    """The flow's data movement with NumPy copies instead of writes: what each rank gets."""
    w = len(xs)
    geo = Geometry(w, e)
    sends = [plan_send(idx[r], bm[r], e) for r in range(w)]
    c = np.stack([s.route for s in sends])
    plans = [plan_recv(c, geo, d, pad, 1 << 20) for d in range(w)]
    h = xs[0].shape[1]
    recv = [np.zeros((p.nrecv, h), xs[0].dtype) for p in plans]
    for r in range(w):
        rows = xs[r][sends[r].row_token]
        for d in range(w):
            n, first, at = plans[r].n[r, d], plans[r].sstart[d], plans[r].dst_row[d]
            recv[d][at : at + n] = rows[first : first + n]
    outs = []
    for d, p in enumerate(plans):
        ex = np.zeros((int(p.offsets[-1]), h), xs[0].dtype)
        ex[p.dest] = recv[d]
        outs.append((p, ex))
    back = [np.zeros((max(1, len(s.row_token)), h), np.float32) for s in sends]  # >= 1 row, as the regions
    for d, (p, ex) in enumerate(outs):
        y = ys_fn(ex)
        got = y[p.dest]
        at_source = (np.cumsum(p.n, axis=1) - p.n)[:, d]
        for r in range(w):
            n, first = p.n[r, d], p.rstart[r]
            back[r][at_source[r] : at_source[r] + n] = got[first : first + n]
    combined = []
    for r in range(w):
        acc = np.zeros((bm[r], h), np.float32)
        for k in range(idx[r].shape[1]):
            rows = sends[r].pos[:, k]
            y = back[r][np.where(rows >= 0, rows, 0)]
            acc = acc + np.where((rows >= 0)[:, None], ws[r][: bm[r], k, None] * y, np.float32(0))
        combined.append(acc)
    return outs, combined


@pytest.mark.parametrize("seed", range(40))
def test_layout_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = int(rng.integers(1, 6))
    e = int(rng.integers(1, 20))
    k = int(rng.integers(1, min(e, 8) + 1))
    pad = int(rng.choice([1, 2, 16]))
    h = 3
    tokens = [int(rng.choice([0, rng.integers(1, 10)])) for _ in range(w)]
    xs = [rng.standard_normal((t, h)).astype(np.float32) for t in tokens]
    idx = []
    for t in tokens:
        ind = np.argsort(rng.random((t, e)), axis=1)[:, :k]
        ind[rng.random(ind.shape) < 0.2] = -1
        idx.append(ind)
    ws = [rng.random((t, k)).astype(np.float32) for t in tokens]
    bm = [int(rng.integers(0, t + 1)) for t in tokens]
    want = reference_dispatch(xs, idx, e, pad, bm)
    outs, combined = simulate(xs, idx, ws, e, pad, bm, lambda x: x * np.float32(3))
    for d, (p, ex) in enumerate(outs):
        assert np.array_equal(p.counts, want[d].counts)
        assert np.array_equal(p.offsets, want[d].offsets)
        assert np.array_equal(p.src_rank, want[d].src_rank)
        assert np.array_equal(ex, want[d].expert_x)  # padding zero on both sides here
    ref = reference_combine(want, [o.expert_x * np.float32(3) for o in want], idx, ws, e, "float32", bm)
    for r in range(w):
        assert np.array_equal(combined[r], ref[r])


def _gpu_rows(tab: np.ndarray, ll: int, w: int, me: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """What the GPU unpack kernel (``moe_unpack`` in aiote/moe/_gpu.py) reads for each output
    row from the table of ``_plan_gpu``: (source rank, row ``q``), -1 for padding."""
    offsets, counts = tab[: ll + 1], tab[ll + 1 : 2 * ll + 1]
    cum = tab[2 * ll + 1 : 2 * ll + 1 + ll * (w + 1)].reshape(ll, w + 1)
    start = tab[2 * ll + 1 + ll * (w + 1) :].reshape(w, ll)
    src, q = np.full(rows, -1), np.full(rows, -1)
    for o in range(rows):
        lv = int(np.flatnonzero(offsets[:ll] <= o)[-1])
        j = o - offsets[lv]
        if j < counts[lv]:
            r = int(np.flatnonzero(cum[lv, :w] <= j)[-1])
            src[o], q[o] = r, start[r, lv] + j - cum[lv, r]
    return src, q


@pytest.mark.parametrize("seed", range(30))
def test_gpu_plan_places_rows_as_the_cpu_plan(seed: int) -> None:
    """The GPU path's receive table (``GpuFlow._plan_gpu``, read by the unpack kernel) puts
    every row where the CPU path's plan (``plan_recv``) does: same counts, offsets, sources
    and source blocks; each output row taken from the received row (or, for this rank's own
    rows, the send row) that the CPU plan moves there."""
    from aiote.moe._gpuflow import GpuFlow

    rng = np.random.default_rng(seed)
    w, e = int(rng.integers(1, 9)), int(rng.integers(1, 300))
    pad = int(rng.choice([1, 4, 16]))
    c = rng.integers(0, 6, size=(w, e)).astype(np.int32)
    if seed == 0:
        c[:] = 0
    geo = Geometry(w, e)
    for me in range(w):
        flow = GpuFlow.__new__(GpuFlow)
        flow.geometry, flow.rank, flow.world = geo, me, w
        flow.max_recv_tokens, flow.expert_padding = 1 << 20, pad
        g = flow._plan_gpu(c)
        cpu = plan_recv(c, geo, me, pad, 1 << 20)
        for name in ("n", "rstart", "counts", "offsets", "dst_row"):
            assert np.array_equal(getattr(g, name), getattr(cpu, name)), name
        first, last = geo.local_range(me)
        rows = int(cpu.offsets[-1])
        src, q = _gpu_rows(g.tab, last - first, w, me, rows)
        assert np.array_equal(src, cpu.src_rank)
        own = q - int(cpu.sstart[me]) + int(cpu.rstart[me])  # a send row as the CPU plan counts it
        recv_row = np.where(src == me, own, q)
        for o in np.flatnonzero(src >= 0):
            assert cpu.dest[recv_row[o]] == o
    flow.max_recv_tokens = 0
    if c.any():
        with pytest.raises(aiote.InvalidArgument, match="max_recv_tokens"):
            flow._plan_gpu(c)


def test_gpu_kernel_parameter_kinds_match_their_sources() -> None:
    """The GPU kernels are launched with their parameters packed by ``Launch`` from
    ``KINDS`` (pointer, long long, int): each string must follow its kernel's C signature,
    parameter by parameter (a wrong one shifts every later argument). Read from the CUDA
    sources, without a GPU."""
    import re

    from aiote.moe import _gpu

    sources = _gpu._SOURCE.replace("const T*", "const float*").replace("T*", "float*") + _gpu._LAYOUT_SOURCE
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', sources):
        kinds = ""
        for p in params.split(","):
            decl = " ".join(p.split()[:-1])  # the type, without the parameter's name
            kinds += "p" if "*" in decl else {"long long": "q", "i64": "q", "int": "i"}.get(decl, "?")
        found[name] = kinds
    assert found == _gpu.KINDS


def test_bf16_helpers_round_to_nearest_even() -> None:
    vals = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -2.5, 0.0, -0.0, np.inf, 3.4e38],
                    np.float32)
    b = moe.f32_to_bf16(vals)
    back = moe.bf16_to_f32(b)
    # ties go to even: 1 + 2^-8 -> 1.0, 1 + 3*2^-8 -> 1 + 2^-6; 1 + 2^-9 (below half) -> 1.0
    assert back[:4].tolist() == [1.0, 1.0, 1.0 + 2**-6, 1.0]
    assert back[4] == -2.5 and np.signbit(back[6]) and back[7] == np.inf
    assert np.isinf(back[8])  # past bfloat16's largest finite: rounds to infinity
    assert np.isnan(moe.bf16_to_f32(moe.f32_to_bf16(np.array([np.nan], np.float32))))[0]
    with pytest.raises(TypeError):
        moe.f32_to_bf16(np.zeros(2, np.float64))


def test_bf16_helpers_agree_with_torch() -> None:
    torch = pytest.importorskip("torch")
    v = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 1e3
    ours = moe.f32_to_bf16(v)
    theirs = torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)


def test_group_checks() -> None:
    with pytest.raises(aiote.InvalidArgument):
        moe.Group([], 0)
    with pytest.raises(aiote.InvalidArgument):
        moe.Group([b"x", b"x"], 0)


@pytest.mark.anyio
async def test_bad_input_raises_before_anything_is_posted(anyio_backend: str) -> None:
    async with aiote.testing.engine_pair(same_host=None) as (a, b):
        g = [a.address, b.address]
        kw = dict(num_experts=4, experts_per_token=2, hidden=8, max_tokens=4, in_dtype="float32",
                  out_dtype="float32", timeout=10)
        with pytest.raises(aiote.InvalidArgument):
            await moe.AllToAll.create(a, moe.Group(g, 0), **{**kw, "experts_per_token": 5})
        with pytest.raises(aiote.InvalidArgument):
            await moe.AllToAll.create(a, moe.Group(g, 0), **{**kw, "out_dtype": "float8_e4m3fn"})
        for spin in (-1.0, True, 1e6, "5"):
            with pytest.raises(aiote.InvalidArgument, match="loop_spin_us"):
                await moe.AllToAll.create(a, moe.Group(g, 0), **{**kw, "loop_spin_us": spin})
        pair: list[moe.AllToAll] = []
        async with anyio.create_task_group() as tg:
            async def mk(e: aiote.Engine, r: int) -> None:
                pair.append(await moe.AllToAll.create(e, moe.Group(g, r), **kw))
            tg.start_soon(mk, a, 0)
            tg.start_soon(mk, b, 1)
        a2a = next(p for p in pair if p.engine is a)
        x = np.zeros((4, 8), np.float32)
        idx = np.array([[0, 1], [1, 2], [2, 3], [3, -1]])
        w = np.ones((4, 2), np.float32)
        before = snapshot(a)
        bad = [
            (x.astype(np.float16), idx, w, {}),                     # wrong dtype
            (np.zeros((5, 8), np.float32), np.zeros((5, 2), np.int64), np.ones((5, 2), np.float32), {}),
            (x, np.array([[0, 0], [1, 2], [2, 3], [3, 1]]), w, {}),  # an expert twice in a token
            (x, np.array([[0, 4], [1, 2], [2, 3], [3, 1]]), w, {}),  # out of range
            (x, idx, w.astype(np.float64), {}),
            (x, idx, w, {"bound_m": 5}),
            (x[:, :4], idx[:, :1], w[:, :1], {}),
        ]
        for bx, bi, bw, extra in bad:
            with pytest.raises(aiote.InvalidArgument):
                await a2a.dispatch(bx, bi, bw, **extra)
        nothing_posted(a, before)
        for p in pair:
            await p.aclose()


@pytest.mark.anyio
async def test_a_rank_whose_waits_spin_gets_the_same_results(anyio_backend: str) -> None:
    """``loop_spin_us`` is each rank's own choice (with NumPy, by default the engine's own
    setting: none here): rank 0's waits spin (its loop drives the completion queues:
    ``loop_polls``), rank 1's sleep; the calls return the tokens, and combine (the identity
    expert, weights summing to 1) gives each token back exactly."""
    async with aiote.testing.engine_pair(same_host=None) as (a, b):
        g = [a.address, b.address]
        kw: dict[str, Any] = dict(num_experts=4, experts_per_token=2, hidden=8, max_tokens=4,
                                  in_dtype="float32", out_dtype="float32", timeout=10)
        pair: dict[int, moe.AllToAll] = {}

        async def mk(e: aiote.Engine, r: int, spin: float | None) -> None:
            pair[r] = await moe.AllToAll.create(e, moe.Group(g, r), loop_spin_us=spin, **kw)

        async with anyio.create_task_group() as tg:
            tg.start_soon(mk, a, 0, 300.0)
            tg.start_soon(mk, b, 1, None)
        assert pair[0].loop_spin_us == 300.0 and pair[1].loop_spin_us is None
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2)]
        idx = [np.array([[0, 1], [1, 2], [2, 3], [3, 0]]), np.array([[3, 2], [2, 1], [1, 0], [0, 3]])]
        w = np.full((4, 2), 0.5, np.float32)

        async def run(r: int) -> None:
            for _ in range(5):
                h = await pair[r].dispatch(xs[r], idx[r], w)
                assert int(h.counts.sum()) == 8  # 4 slots from each rank for this rank's two experts
                assert np.array_equal(await pair[r].combine(h, h.expert_x), xs[r])

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
        assert a.stats()["loop_polls"] > 0 and b.stats()["loop_polls"] == 0
        for p in pair.values():
            await p.aclose()


@pytest.mark.anyio
async def test_stale_and_repeated_handles_raise(anyio_backend: str) -> None:
    async with aiote.open_engine(same_host=None) as e:
        a = await moe.AllToAll.create(e, moe.Group([e.address], 0), num_experts=3, experts_per_token=1,
                                      hidden=4, max_tokens=2, in_dtype="float32", out_dtype="float32",
                                      timeout=10)
        x = np.ones((2, 4), np.float32)
        idx = np.array([[0], [2]])
        w = np.ones((2, 1), np.float32)
        h0 = await a.dispatch(x, idx, w)
        h1 = await a.dispatch(x, idx, w)
        out1 = await a.combine(h1, h1.expert_x)
        assert np.array_equal(out1, x)
        with pytest.raises(aiote.InvalidArgument):
            await a.combine(h1, h1.expert_x)  # combined already
        h2 = await a.dispatch(x, idx, w)
        with pytest.raises(aiote.InvalidArgument):
            await a.combine(h0, h0.expert_x)  # two calls back: stale
        with pytest.raises(aiote.InvalidArgument):
            await a.combine(h2, h2.expert_x[:, :2])
        with pytest.raises(aiote.InvalidArgument):
            await a.combine(h2, h2.expert_x, accumulate=True)
        assert np.array_equal(await a.combine(h2, h2.expert_x), x)
        # a dispatch whose receive half is kept while 140 calls go by stays stale: its recv
        # raises at once (it would otherwise read regions those calls reused)
        kept = await a.dispatch_send(x, idx, w)
        for _ in range(140):
            h = await a.dispatch(x, idx, w)
            assert np.array_equal(await a.combine(h, h.expert_x), x)
        with anyio.fail_after(5), pytest.raises(aiote.InvalidArgument, match="stale"):
            await kept.recv(timeout=30)
        await a.aclose()


@pytest.mark.anyio
async def test_receive_capacity_exceeded_raises_on_every_rank_then_next_works(anyio_backend: str) -> None:
    """Every rank holds the whole count matrix, so every rank raises the same InvalidArgument
    before any token moves, and the group's next call is correct."""
    async with aiote.testing.engine_pair(same_host=None) as (e0, e1):
        g = [e0.address, e1.address]
        kw = dict(num_experts=2, experts_per_token=1, hidden=4, max_tokens=4, in_dtype="float32",
                  out_dtype="float32", max_recv_tokens=3, timeout=10)
        a2a: dict[int, moe.AllToAll] = {}

        async def mk(e: aiote.Engine, r: int) -> None:
            a2a[r] = await moe.AllToAll.create(e, moe.Group(g, r), **kw)

        async with anyio.create_task_group() as tg:
            tg.start_soon(mk, e0, 0)
            tg.start_soon(mk, e1, 1)
        x = [np.full((4, 4), r + 1, np.float32) for r in range(2)]
        w = np.ones((4, 1), np.float32)
        errors: dict[int, BaseException] = {}

        async def call(r: int, idx: np.ndarray, bound_m: int = 4) -> None:
            try:
                h = await a2a[r].dispatch(x[r], idx, w, bound_m=bound_m)
                out = await a2a[r].combine(h, h.expert_x)
                assert np.array_equal(out, x[r][:bound_m])
            except aiote.InvalidArgument as exc:
                errors[r] = exc

        async with anyio.create_task_group() as tg:  # 8 rows for expert 1 (rank 1): past 3
            tg.start_soon(call, 0, np.ones((4, 1), np.int64))
            tg.start_soon(call, 1, np.ones((4, 1), np.int64))
        assert set(errors) == {0, 1} and all("max_recv_tokens" in str(e) for e in errors.values())
        errors.clear()
        async with anyio.create_task_group() as tg:  # 3 tokens each: 3 rows per rank, fits
            tg.start_soon(call, 0, np.array([[0], [1], [0], [0]]), 3)
            tg.start_soon(call, 1, np.array([[1], [0], [1], [1]]), 3)
        assert not errors
        for a in a2a.values():
            await a.aclose()


@pytest.mark.anyio
async def test_out_x_must_hold_the_largest_dispatch(anyio_backend: str) -> None:
    async with aiote.open_engine(same_host=None) as e:
        a = await moe.AllToAll.create(e, moe.Group([e.address], 0), num_experts=3, experts_per_token=1,
                                      hidden=4, max_tokens=2, in_dtype="float32", out_dtype="float32",
                                      expert_padding=4, timeout=10)
        assert a.max_expert_rows == 2 + 3 * 3
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        idx, w = np.array([[0], [2]]), np.ones((2, 1), np.float32)
        before = snapshot(e)
        with pytest.raises(aiote.InvalidArgument, match="out_x"):
            await a.dispatch(x, idx, w, out_x=np.zeros((a.max_expert_rows - 1, 4), np.float32))
        nothing_posted(e, before)
        buf = np.full((a.max_expert_rows, 4), -7, np.float32)
        h = await a.dispatch(x, idx, w, out_x=buf)
        assert np.shares_memory(h.expert_x, buf) and h.offsets.tolist() == [0, 4, 4, 8]
        assert np.array_equal(h.expert_x[[0, 4]], x) and np.all(h.expert_x[1:4] == -7)  # padding left
        await a.aclose()


@pytest.mark.anyio
async def test_a_wait_on_the_gpu_in_a_thread_ends_at_the_calls_deadline(anyio_backend: str) -> None:
    """The waits that go to a worker thread (a CUDA event or a device-to-host copy not done
    within a millisecond) raise TransferTimeout naming the call at its deadline, without
    waiting for the thread: nothing else in a call holds a cancel scope now."""
    import time

    from aiote.moe._state import _in_thread

    t0 = anyio.current_time()
    with pytest.raises(aiote.TransferTimeout, match="dispatch 7 did not finish by its deadline"):
        await _in_thread(lambda: time.sleep(2), t0 + 0.1, "dispatch 7")
    assert anyio.current_time() - t0 < 1.0
    assert await _in_thread(lambda: 42, None, "dispatch 8") == 42
