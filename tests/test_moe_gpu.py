"""aiote.moe with CuPy arrays: one process per rank, each on its own GPU where there are two
(one GPU: both ranks share it), same-host peers over the CUDA-IPC rail, packing, unpacking and
the reduction done by GPU kernels. Checked inside each rank against the NumPy reference, as in
tests/test_moe.py (dispatch byte-exact, combine bit-exact). Skipped cleanly where there is no
CuPy or no GPU (CI); run on a GPU machine:

    .venv/bin/python -m pytest -q tests/test_moe_gpu.py
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from _cuda import require_cuda

cupy, NGPU = require_cuda()

from test_moe import MATRIX, Ranks, case, start_ranks, stop_ranks  # noqa: E402

import aiote  # noqa: E402
from aiote import moe  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def gpu2(anyio_backend: str) -> AsyncIterator[Ranks]:
    ranks = await start_ranks(2, anyio_backend, "default", gpus=[0, 1 % NGPU])
    try:
        yield ranks
    finally:
        await stop_ranks(ranks)


GPU_CASES = [
    ("bfloat16 k=8 padding 16 with -1 indices", case(dtype="bfloat16", E=16, K=8, H=64, T=32, pad=16,
                                                     skip=0.2, tokens=[32, 17])),
    ("float32 E not divisible, zero tokens on one rank", case(E=5, K=2, H=32, T=24, tokens=[0, 24])),
    ("all tokens to one expert, bound_m, accumulate", case(one_expert=0, bound=[7, 12], tokens=[12, 12],
                                                           accumulate=True)),
    ("float8 with block scales, bfloat16 combine", case(dtype="float8_e4m3fn", out="bfloat16", scale=16, H=48,
                                                        K=8, E=16, pad=16, tokens=[12, 5])),
]


@pytest.mark.parametrize("name,spec", GPU_CASES, ids=[m[0] for m in GPU_CASES])
async def test_gpu_two_ranks_against_reference(gpu2: Ranks, name: str, spec: dict[str, Any]) -> None:
    replies = await gpu2.all(op="case", **{**spec, "calls": 2})
    assert all(r["checks"] >= 12 for r in replies), replies


GPU4_CASES = [m for m in MATRIX if m[0].startswith(("float8", "E not divisible", "-1 indices", "some ranks"))]


@pytest.mark.skipif(NGPU < 4, reason="fewer than 4 GPUs")
async def test_gpu_four_ranks_against_reference(anyio_backend: str) -> None:
    """4 ranks on 4 GPUs (the group size of bench_moe.py --world 4): cases of the 4-rank matrix
    (FP8 with block scales, E not divisible by W, -1 indices, ranks without tokens), whole and
    split, then 20 back-to-back calls."""
    ranks = await start_ranks(4, anyio_backend, "default", gpus=[0, 1, 2, 3])
    try:
        assert len(GPU4_CASES) == 4
        for name, spec in GPU4_CASES:
            replies = await ranks.all(op="case", **{**spec, "calls": 2}, timeout=120)
            assert all(r["checks"] >= 12 for r in replies), (name, replies)
        replies = await ranks.all(op="case", timeout=300, **case(E=8, K=2, H=32, T=16, tokens=[16, 9, 16, 3],
                                                                 seed=7, calls=20))
        assert all(r["checks"] >= 120 for r in replies), replies
    finally:
        await stop_ranks(ranks)


async def test_gpu_back_to_back_calls(gpu2: Ranks) -> None:
    replies = await gpu2.all(op="case", **case(E=8, K=2, H=32, T=16, tokens=[16, 16], seed=3, calls=100),
                             timeout=300)
    assert all(r["checks"] >= 600 for r in replies), replies


async def test_gpu_two_micro_batches_in_flight(gpu2: Ranks) -> None:
    """dispatch_send A, dispatch_send B, then the receives and combines, 20 times: both parities'
    regions and per-parity kernel buffers in use at once."""
    replies = await gpu2.all(op="overlap", timeout=120, **case(E=6, K=2, H=8, T=8, tokens=[8, 5], seed=43,
                                                               calls=20))
    assert all(r["checks"] >= 40 for r in replies), replies


async def test_gpu_receive_capacity_below_the_worst_case(gpu2: Ranks) -> None:
    """max_recv_tokens below the worst case (smaller regions; the capacity check on the GPU
    layout); 6 calls, whole and split."""
    spec = case(E=8, K=2, H=32, T=16, tokens=[16, 16], seed=5, cap=50, calls=6)
    replies = await gpu2.all(op="case", **spec)
    assert all(r["checks"] >= 36 for r in replies), replies


async def test_gpu_one_rank_in_process() -> None:
    async with aiote.open_engine() as e:
        a = await moe.AllToAll.create(
            e, moe.Group([e.address], 0), num_experts=4, experts_per_token=2, hidden=16, max_tokens=8,
            in_dtype="bfloat16", out_dtype="bfloat16", expert_padding=4, timeout=30, xp=cupy,
        )
        rng = np.random.default_rng(0)
        x = moe.f32_to_bf16(rng.standard_normal((8, 16)).astype(np.float32))
        idx = np.argsort(rng.random((8, 4)), axis=1)[:, :2]
        w = rng.random((8, 2)).astype(np.float32)
        h = await a.dispatch(cupy.asarray(x), cupy.asarray(idx), cupy.asarray(w))
        want = moe.reference.reference_dispatch([x], [idx], 4, 4)[0]
        valid = want.src_rank >= 0
        assert np.array_equal(h.expert_x.get()[valid], want.expert_x[valid])
        out = await a.combine(h, h.expert_x)
        ref_out = moe.reference.reference_combine([want], [want.expert_x], [idx], [w], 4, "bfloat16")[0]
        assert np.array_equal(out.get(), ref_out)
        await a.aclose()
