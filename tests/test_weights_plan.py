"""aiote.weights planning, sans I/O: coverage (every target byte exactly once, checked
independently of ``validate``), balance, re-planning, plain data, refusals, and the casts."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from _weights_util import e4m3_reference
from hypothesis import given, settings
from hypothesis import strategies as st

import aiote
from aiote import weights as W

DESC = b"\x01region-0"


def fsdp(name: str, shape: tuple[int, ...], dtype: str, cuts: list[int]) -> list[W.SourceShard]:
    return [W.SourceShard(name, shape, dtype, i, (cuts[i], cuts[i + 1])) for i in range(len(cuts) - 1)]


def coverage(p: W.WeightPlan) -> dict[int, np.ndarray]:
    """Times each target byte is written, per target index, from the tasks alone."""
    widths = {s.name: s.width for s in p.sources}
    out = {i: np.zeros(W._plan.target_nbytes(t, widths), np.int64) for i, t in enumerate(p.targets)}
    for t in p.tasks:
        tgt = p.targets[t.target]
        out[t.target][t.offset - tgt.offset : t.offset - tgt.offset + t.nbytes] += 1
    return out


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[W.SourceShard], list[W.TargetShard], int]:
    n_src = draw(st.integers(1, 5))
    sources: list[W.SourceShard] = []
    params = []
    for k in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 40))
        width = draw(st.integers(1, 9))
        dtype = draw(st.sampled_from(["float32", "float16", "bfloat16", "int8"]))
        name = f"p{k}"
        params.append((name, rows, width, dtype))
        if draw(st.booleans()):  # FSDP cuts over every source rank
            cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=n_src - 1, max_size=n_src - 1)))
            sources += fsdp(name, (rows, width), dtype, [0, *cuts, rows])
        else:  # whole on a random non-empty subset of ranks
            ranks = draw(st.sets(st.integers(0, n_src - 1), min_size=1))
            sources += [W.SourceShard(name, (rows, width), dtype, r, (0, rows)) for r in sorted(ranks)]
    targets: list[W.TargetShard] = []
    n_dst = draw(st.integers(1, 4))
    offset = 0
    for r in range(n_dst):
        for k, (name, rows, width, dtype) in enumerate(params):
            a = draw(st.integers(0, rows - 1))
            b = draw(st.integers(a + 1, rows))
            cols = None
            if draw(st.booleans()):
                c0 = draw(st.integers(0, width - 1))
                cols = (c0, draw(st.integers(c0 + 1, width)))
            pieces = [W.Piece(name, (a, b), cols)]
            if k and draw(st.booleans()):  # fused with the previous parameter's rows
                pname, prows, _, pdtype = params[k - 1]
                if W.cast_supported(pdtype, dtype) or pdtype == dtype:
                    pieces.append(W.Piece(pname, (0, prows)))
            tdtype = (
                dtype
                if dtype == "int8"
                else draw(st.sampled_from(["float32", "float16", "bfloat16", "float8_e4m3"]))
            )
            if any(not W.cast_supported(params[int(p.source[1:])][3], tdtype) for p in pieces):
                tdtype = dtype
                pieces = pieces[:1]
            t = W.TargetShard(f"t{k}", r, tdtype, tuple(pieces), DESC, offset)
            offset += W._plan.target_nbytes(t, {s.name: s.width for s in sources}) + draw(st.integers(0, 3))
            targets.append(t)
    return sources, targets, draw(st.integers(1, 200))


@settings(max_examples=150, deadline=None)
@given(problems())
def test_every_target_byte_is_written_exactly_once(
    problem: tuple[list[W.SourceShard], list[W.TargetShard], int],
) -> None:
    sources, targets, chunk = problem
    p = W.plan(sources, targets, chunk_bytes=chunk)
    report = p.validate(link_bytes_per_s=1e9)
    for i, cov in coverage(p).items():
        assert (cov == 1).all(), (i, cov)
    assert sum(report.in_bytes.values()) == report.total_bytes == sum(t.nbytes for t in p.tasks)
    assert report.bound_s == max(max(report.out_bytes.values()), max(report.in_bytes.values())) / 1e9
    assert all(
        t.nbytes <= max(chunk, t.nbytes // max(1, t.row1 - t.row0)) for t in p.tasks
    )  # chunks or 1 row
    assert W.WeightPlan.from_json(p.to_json()) == p
    assert pickle.loads(pickle.dumps(p)) == p
    for r in {s.rank for s in sources}:
        part = p.sender(r)
        assert W.SenderPlan.from_json(part.to_json()) == part
        assert sum(w.nbytes for w in part.writes) == report.out_bytes.get(r, 0)
    for r in {t.rank for t in targets}:
        rp = p.receiver(r)
        assert W.ReceiverPlan.from_json(rp.to_json()) == rp
        assert rp.nbytes == report.in_bytes[r]
        assert p.expected_imms(r) == len(rp.senders) == len({t.src for t in p.tasks if t.dst == r})


def test_replicated_parameters_are_balanced_least_bytes_first() -> None:
    # 8 layers of 3 parameters, each held whole by all 4 trainer ranks; 2 inference ranks
    sources = [
        W.SourceShard(f"l{i}.{n}", (rows, 64), "float32", r, (0, rows))
        for i in range(8)
        for n, rows in (("a", 96), ("b", 32), ("c", 160))
        for r in range(4)
    ]
    specs = [(s.name, "float32", [W.Piece(s.name, (0, s.shape[0]))]) for s in sources if s.rank == 0]
    targets = []
    for r in range(2):
        tg, _ = W.pack_targets(r, specs, sources)
        targets += W.with_desc(tg, bytes([r + 1]))
    p = W.plan(sources, targets, chunk_bytes=8 << 10)
    rep = p.validate(link_bytes_per_s=1e9)
    outs = sorted(rep.out_bytes.values())
    assert len(outs) == 4 and outs[-1] - outs[0] <= 8 << 10  # within one chunk
    assert rep.bound_s == pytest.approx(max(rep.in_bytes.values()) / 1e9)
    # a rank-0 broadcast would send everything from one rank: 4x the balanced max out
    assert rep.total_bytes / 4 <= outs[-1] <= rep.total_bytes / 4 + (8 << 10)
    print(rep)


def test_sender_writes_interleave_receivers() -> None:
    sources = fsdp("w", (64, 16), "float32", [0, 64])
    targets = [
        W.TargetShard("w", r, "float32", (W.Piece("w", W.split_rows(64, 3, r)),), bytes([r + 1]))
        for r in range(3)
    ]
    part = W.plan(sources, targets, chunk_bytes=256).sender(0)
    dsts = [w.dst for w in part.writes]
    assert dsts[:6] == [0, 1, 2, 0, 1, 2]
    assert part.receivers == (0, 1, 2) and part.nbytes == 64 * 16 * 4


def test_empty_pieces_plan_no_write_and_no_wait() -> None:
    """A piece with no columns or no rows moves nothing: no write of 0 bytes (the engine takes
    none without an immediate), and a receiver whose only piece from a trainer is empty does
    not wait for that trainer's immediate."""
    sources = fsdp("w", (8, 32), "float32", [0, 4, 8])
    targets = [
        W.TargetShard(
            "a", 0, "float32", (W.Piece("w", (0, 8), (4, 4)), W.Piece("w", (0, 8), (8, 20))), b"\x01"
        ),
        W.TargetShard("b", 1, "float32", (W.Piece("w", (2, 2)), W.Piece("w", (4, 8))), b"\x02"),
    ]
    p = W.plan(sources, targets, chunk_bytes=4096)
    assert all(t.nbytes > 0 for t in p.tasks)
    assert p.validate().in_bytes == {0: 8 * 12 * 4, 1: 4 * 32 * 4}
    assert p.receiver(1).senders == (1,)  # rows 4..8 only: trainer 0's empty piece is no wait
    assert all(w.nbytes > 0 for s in (0, 1) for w in p.sender(s).writes)


def test_replan_for_a_joining_rank_touches_only_its_bytes() -> None:
    sources = [
        *fsdp("q", (64, 32), "float32", [0, 10, 40, 64]),
        *(W.SourceShard("b", (512, 8), "float32", r, (0, 512)) for r in range(3)),
    ]

    def targets(r: int, tp: int) -> list[W.TargetShard]:
        tg, _ = W.pack_targets(
            r,
            [
                ("q", "float16", [W.Piece("q", W.split_rows(64, tp, r))]),
                ("b", "float32", [W.Piece("b", (0, 512))]),
            ],
            sources,
        )
        return W.with_desc(tg, bytes([r + 1]))

    old = W.plan(sources, targets(0, 2) + targets(1, 2), chunk_bytes=1024)
    new = W.plan(sources, targets(0, 2) + targets(1, 2) + targets(2, 4), chunk_bytes=1024, previous=old)
    new.validate()
    for r in (0, 1):
        assert new.assignments(r) == old.assignments(r)
        assert new.receiver(r) == old.receiver(r)
    fresh = [t for t in new.tasks if t.dst == 2]
    assert fresh and len(new.tasks) == len(old.tasks) + len(fresh)
    # the joining rank's replicated bias goes to the least-loaded trainers
    assert len({t.src for t in fresh if new.targets[t.target].name == "b"}) > 1


@pytest.mark.parametrize(
    ("sources", "targets", "match"),
    [
        (
            fsdp("w", (8, 4), "float32", [0, 3]),
            [W.TargetShard("w", 0, "float32", (W.Piece("w", (0, 8)),))],
            "row 3 .* held by no source",
        ),
        (
            fsdp("w", (8, 4), "float32", [0, 8]),
            [W.TargetShard("x", 0, "float32", (W.Piece("y", (0, 8)),))],
            "no source holds parameter 'y'",
        ),
        (
            [
                W.SourceShard("w", (8, 4), "float32", 0, (0, 4)),
                W.SourceShard("w", (8, 5), "float32", 1, (4, 8)),
            ],
            [],
            "rank 1 says .8, 5.",
        ),
        (
            [
                W.SourceShard("w", (8, 4), "float32", 0, (0, 4)),
                W.SourceShard("w", (8, 4), "float16", 1, (4, 8)),
            ],
            [],
            "float16",
        ),
        (
            fsdp("w", (8, 4), "float32", [0, 8]),
            [W.TargetShard("w", 0, "int8", (W.Piece("w", (0, 8)),))],
            "cast float32 -> int8 .* not supported",
        ),
        (
            fsdp("w", (8, 4), "float32", [0, 8]),
            [W.TargetShard("w", 0, "float32", (W.Piece("w", (0, 9)),))],
            "outside",
        ),
        (
            fsdp("w", (8, 4), "float32", [0, 8]),
            [W.TargetShard("w", 0, "float32", (W.Piece("w", (0, 8), (2, 5)),))],
            "outside",
        ),
        (
            fsdp("w", (8, 4), "float32", [0, 8]),
            [
                W.TargetShard("a", 0, "float32", (W.Piece("w", (0, 8)),), DESC, 0),
                W.TargetShard("b", 0, "float32", (W.Piece("w", (0, 8)),), DESC, 100),
            ],
            "overlap",
        ),
        (
            fsdp("w", (8, 4), "float32", [0, 8]),
            [
                W.TargetShard("a", 0, "float32", (W.Piece("w", (0, 8)),)),
                W.TargetShard("a", 0, "float32", (W.Piece("w", (0, 8)),)),
            ],
            "twice",
        ),
    ],
)
def test_impossible_plans_are_refused(
    sources: list[W.SourceShard], targets: list[W.TargetShard], match: str
) -> None:
    with pytest.raises(W.PlanError, match=match) as e:
        W.plan(sources, targets)
    assert isinstance(e.value, aiote.InvalidArgument)


def test_bad_fields_are_refused() -> None:
    with pytest.raises(aiote.InvalidArgument, match="dtype"):
        W.SourceShard("w", (8,), "complex64", 0, (0, 8))
    with pytest.raises(W.PlanError, match="outside shape"):
        W.SourceShard("w", (8,), "float32", 0, (0, 9))
    with pytest.raises(W.PlanError, match="start <= stop"):
        W.Piece("w", (5, 2))
    with pytest.raises(W.PlanError, match="pieces"):
        W.TargetShard("w", 0, "float32", ())
    src = fsdp("w", (8, 4), "float32", [0, 8])
    for kw in ({"chunk_bytes": 0}, {"tag": 256}, {"chunk_bytes": True}):
        with pytest.raises(W.PlanError):
            W.plan(src, [], **kw)  # type: ignore[arg-type]
    p = W.plan(src, [W.TargetShard("w", 0, "float32", (W.Piece("w", (0, 8)),))])
    with pytest.raises(W.PlanError, match="no source shard"):
        p.sender(5)
    with pytest.raises(W.PlanError, match="no target"):
        p.receiver(5)
    for text in ("{}", "[1]", "not json"):
        for cls in (W.WeightPlan, W.SenderPlan, W.ReceiverPlan):
            with pytest.raises(W.PlanError):
                cls.from_json(text)


def test_validate_catches_a_tampered_plan() -> None:
    src = fsdp("w", (32, 4), "float32", [0, 16, 32])
    tg = [W.TargetShard("w", 0, "float32", (W.Piece("w", (0, 32)),), DESC)]
    p = W.plan(src, tg, chunk_bytes=64)
    t0 = p.tasks[0]
    cases = [
        (p.tasks[1:], "row 0|gap"),
        ((*p.tasks, t0), "overlap"),
        ((t0._replace(src=1 - t0.src), *p.tasks[1:]), "does not hold"),
        ((t0._replace(offset=t0.offset + 4), *p.tasks[1:]), "offset"),
        ((t0._replace(dst=3), *p.tasks[1:]), "rank 0, not 3"),
    ]
    for tasks, match in cases:
        bad = W.WeightPlan(p.sources, p.targets, tuple(tasks), p.tag, p.chunk_bytes)
        with pytest.raises(W.PlanError, match=match):
            bad.validate()


def test_fused_tp_and_pack_targets_layout() -> None:
    assert [W.split_rows(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    pieces = W.fused_tp([("q", 8), ("k", 4), ("v", 4)], 1, 2)
    assert pieces == (W.Piece("q", (4, 8)), W.Piece("k", (2, 4)), W.Piece("v", (2, 4)))
    src = [
        *fsdp("q", (8, 3), "float32", [0, 8]),
        *fsdp("k", (4, 3), "float32", [0, 4]),
        *fsdp("v", (4, 3), "float32", [0, 4]),
    ]
    tg, n = W.pack_targets(
        0, [("qkv", "float16", pieces), ("q", "float32", [W.Piece("q", (0, 8))])], src, align=64
    )
    assert tg[0].offset == 0 and tg[1].offset == 64 and n == 64 + 8 * 3 * 4
    json.loads(W.plan(src, W.with_desc(tg, DESC)).to_json())


def test_casts_round_and_keep_nan() -> None:
    f = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 65504.0, np.nan, np.inf, 1e-40], np.float32)
    bf = np.empty(f.shape, np.uint16)
    W.cast_into(np, bf, f, "float32", "bfloat16")
    back = np.empty(f.shape, np.float32)
    W.cast_into(np, back, bf, "bfloat16", "float32")
    assert back[0] == 1.0 and back[1] == 1.0  # a tie rounds to even
    assert back[2] == 1.0 + 4 * 2**-8  # a tie rounds to even (up)
    assert back[3] == -2.5 and back[4] == 65536.0 and np.isnan(back[5]) and back[6] == np.inf
    h = np.empty(f.shape, np.float16)
    W.cast_into(np, h, bf, "bfloat16", "float16")
    assert h[0] == 1.0 and h[3] == -2.5
    with pytest.raises(aiote.InvalidArgument, match="no cast"):
        W.cast_into(np, np.empty(2, np.int8), np.zeros(2, np.float32), "float32", "int8")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_fp8_e4m3_cast_matches_a_brute_force_reference(values: list[float]) -> None:
    f = np.array(values, np.float32)
    ties = np.array([2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, -1.0625, 464.0, 480.0], np.float32)
    f = np.concatenate([f, ties, (W.e4m3_table()[:0x7F] * 1.0001).astype(np.float32)])
    got = np.empty(f.shape, np.uint8)
    W.cast_into(np, got, f, "float32", "float8_e4m3")
    want = e4m3_reference(f)
    nan = np.isnan(f)
    assert np.array_equal(got[~nan], want[~nan])
    assert ((got[nan] & 0x7F) == 0x7F).all()
    back = np.empty(f.shape, np.float32)
    W.cast_into(np, back, got, "float8_e4m3", "float32")
    assert np.array_equal(back[~nan], W.e4m3_table()[want[~nan]])
