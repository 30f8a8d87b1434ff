"""One rank of an aiote.moe test group, in its own process (tests/test_moe.py drives it).

Reads JSON commands on stdin, answers one JSON line each on stdout. Every rank builds every
rank's inputs from the case's seed, computes the NumPy reference for all of them
(aiote.moe.reference), runs its own share of the real all-to-all, and checks it: dispatch
byte for byte (rows, counts, offsets, sources), combine bit for bit (float32 and bfloat16
alike: same float32 operations, one rounding), and bfloat16 results within bfloat16
tolerance of the float64 truth.

    python tests/_moe_rank.py --backend asyncio --mode tcp|default
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiote
from aiote import moe
from aiote.moe import reference as ref

DT = {"float32": np.float32, "bfloat16": np.uint16}


def make_inputs(case: dict[str, Any], call: int) -> tuple[list[Any], list[Any], list[Any], list[int]]:
    """Every rank's x, indices, weights and bound_m for call ``call`` of ``case`` (float8: x is
    random bytes, and ``case['scales']`` gets every rank's block scales)."""
    rng = np.random.default_rng([case["seed"], call])
    e, k, h = case["E"], case["K"], case["H"]
    xs, idx, ws, bm = [], [], [], []
    case["scales"] = []
    for r, t in enumerate(case["tokens"]):
        x = rng.standard_normal((t, h)).astype(np.float32)
        if case["dtype"] == "float8_e4m3fn":
            xs.append(rng.integers(0, 256, (t, h), dtype=np.uint8))
            case["scales"].append(rng.random((t, -(-h // case["scale"]))).astype(np.float32))
        else:
            xs.append(moe.f32_to_bf16(x) if case["dtype"] == "bfloat16" else x)
        if case.get("one_expert") is not None:
            j = case["one_expert"]
            others = np.array([x for x in range(e) if x != j])
            rest = np.argsort(rng.random((t, len(others))), axis=1)[:, : k - 1]
            ind = np.concatenate([np.full((t, 1), j), others[rest]], axis=1)
        else:
            ind = np.argsort(rng.random((t, e)), axis=1)[:, :k]
        ind = ind.astype(np.int64)
        skip = case.get("skip", 0.0)
        if skip:
            ind[rng.random(ind.shape) < skip] = -1
        idx.append(ind)
        ws.append(rng.random((t, k)).astype(np.float32))
        bounds = case.get("bound")
        bm.append(t if bounds is None else min(bounds[r], t))
    return xs, idx, ws, bm


def expert_fn(ex: np.ndarray, dtype: str, scale: np.ndarray | None = None) -> np.ndarray:
    """The 'expert': y = 1.5 x - 0.25 in float32, rounded to the output type (float8 rows:
    y = byte value x first block scale, to bfloat16)."""
    if scale is not None:
        return moe.f32_to_bf16(ex.astype(np.float32) * scale[:, :1])
    if dtype == "bfloat16":
        return moe.f32_to_bf16(moe.bf16_to_f32(ex) * np.float32(1.5) - np.float32(0.25))
    return (ex * np.float32(1.5) - np.float32(0.25)).astype(np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


class Rank:
    def __init__(self, engine: aiote.Engine, mode: str, xp: Any = np) -> None:
        self.engine, self.mode, self.xp = engine, mode, xp
        self.group: moe.Group | None = None
        self.a2a: dict[str, moe.AllToAll] = {}
        self.held = contextlib.AsyncExitStack()  # a membership and its registration, once joined
        self.out_x: dict[tuple[int, int], Any] = {}

    async def join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Joins the group through etcd (aiote.membership): registers this engine with its rank,
        waits for every rank, and takes the group in rank order from what etcd holds."""
        from aiote import membership

        members = await self.held.enter_async_context(membership.connect(cmd["url"]))
        grp = members.group(cmd["group"], ttl=5)
        await self.held.enter_async_context(grp.register(self.engine.address, meta={"rank": cmd["rank"]}))
        ranked = await grp.ranks(cmd["world"], timeout=30)
        self.group = moe.Group([m.address for m in ranked], cmd["rank"])
        peers = [a for a in self.group.addresses if a != self.engine.address]
        return {"ok": True, "routes": [self.engine.route(p).provider for p in peers],
                "addrs": [a.hex() for a in self.group.addresses]}

    async def get(self, case: dict[str, Any]) -> moe.AllToAll:
        key = json.dumps([case.get(k) for k in ("E", "K", "H", "T", "dtype", "pad", "out", "scale", "cap")])
        a = self.a2a.get(key)
        if a is None:
            assert self.group is not None
            a = self.a2a[key] = await moe.AllToAll.create(
                self.engine, self.group, num_experts=case["E"], experts_per_token=case["K"],
                hidden=case["H"], max_tokens=case["T"], in_dtype=case["dtype"],
                out_dtype=case.get("out", case["dtype"]), scale_block=case.get("scale"),
                expert_padding=case["pad"], imm_tag=0x40 + len(self.a2a), timeout=30, probe_interval=0.25,
                max_recv_tokens=case.get("cap"), xp=self.xp,
            )
        return a

    def prep(self, case: dict[str, Any], call: int) -> dict[str, Any]:
        """Call ``call`` of ``case``: every rank's inputs, the reference, this rank's arguments."""
        assert self.group is not None
        me = self.group.rank
        xs, idx, ws, bm = make_inputs(case, call)
        scales = case["scales"] or None
        expect = ref.reference_dispatch(xs, idx, case["E"], case["pad"], bm, x_scales=scales)
        dev = self.xp.asarray
        return {
            "case": case, "call": call, "xs": xs, "idx": idx, "ws": ws, "bm": bm, "scales": scales,
            "expect": expect, "args": (dev(xs[me]), dev(idx[me]), dev(ws[me])),
            "kw": {"x_scale": None if scales is None else dev(scales[me]), "bound_m": bm[me]},
        }

    def host(self, v: Any) -> Any:
        return v if self.xp is np else v.get()

    def check_dispatch(self, c: dict[str, Any], h: moe.DispatchHandle, own: bool = True) -> Any:
        """Checks a dispatch against the reference; returns the expert outputs to combine.
        Padding rows are zero in the scales, and in expert_x when it is the call's own array
        (``own``; a caller's out_x keeps its padding rows as they were)."""
        assert self.group is not None
        me, case, expect = self.group.rank, c["case"], c["expect"]
        mine = expect[me]
        valid = mine.src_rank >= 0
        ex = self.host(h.expert_x)
        assert np.array_equal(h.counts, mine.counts), (h.counts, mine.counts)
        assert np.array_equal(h.offsets, mine.offsets), (h.offsets, mine.offsets)
        assert np.array_equal(self.host(h.src_rank), mine.src_rank)
        assert np.array_equal(self.host(h.src_token), mine.src_token)
        assert np.array_equal(bits(ex[valid]), bits(mine.expert_x[valid])), "dispatched rows differ"
        assert not own or not bits(ex[~valid]).any(), "padding rows of expert_x are not zero"
        sc = None
        if c["scales"] is not None:
            sc = self.host(h.expert_x_scale)
            assert mine.expert_x_scale is not None
            assert np.array_equal(bits(sc[valid]), bits(mine.expert_x_scale[valid])), "scales differ"
            assert not bits(sc[~valid]).any(), "padding rows of the scales are not zero"
        return self.xp.asarray(expert_fn(ex, case.get("out", case["dtype"]), sc))

    def expected_combine(self, c: dict[str, Any]) -> tuple[np.ndarray, list[np.ndarray], Any]:
        """The reference combine of this rank, the expert outputs of all, and accumulate's out."""
        assert self.group is not None
        me, w, case, expect, bm = self.group.rank, self.group.world, c["case"], c["expect"], c["bm"]
        out_dt = case.get("out", case["dtype"])
        ys = [expert_fn(expect[d].expert_x, out_dt, expect[d].expert_x_scale) for d in range(w)]
        prev = None
        if case.get("accumulate"):
            rng = np.random.default_rng([case["seed"], c["call"], 7])
            prev = [expert_fn(rng.standard_normal((bm[r], case["H"])).astype(np.float32), "float32")
                    if out_dt == "float32" else
                    moe.f32_to_bf16(rng.standard_normal((bm[r], case["H"])).astype(np.float32))
                    for r in range(w)]
        want = ref.reference_combine(expect, ys, c["idx"], c["ws"], case["E"], out_dt, bm, out=prev)[me]
        return want, ys, None if prev is None else self.xp.asarray(prev[me].copy())

    def check_combine(self, c: dict[str, Any], got: Any, want: np.ndarray, ys: list[np.ndarray]) -> int:
        assert self.group is not None
        me, case = self.group.rank, c["case"]
        got = self.host(got)
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
        assert np.array_equal(bits(got), bits(want)), "combined rows differ"
        bm = c["bm"][me]
        if case.get("out", case["dtype"]) == "bfloat16" and not case.get("accumulate") and bm:
            return 1 + check_bf16_tolerance(got, c["expect"], ys, c["idx"][me][:bm], c["ws"][me], case, me)
        return 1

    def reused_out_x(self, a: moe.AllToAll, case: dict[str, Any], slot: int = 0) -> Any:
        """A reused out_x full of 0xFF bytes (its padding rows are left as they were)."""
        key = (id(a), slot)
        out_x = self.out_x.get(key)
        if out_x is None:
            dt = DT.get(case["dtype"], np.uint8)
            out_x = self.out_x[key] = self.xp.full((a.max_expert_rows, case["H"]), 0xFF, dtype=dt)
        return out_x

    async def one_call(self, a: moe.AllToAll, case: dict[str, Any], call: int, split: bool) -> int:
        """One verified dispatch + combine (whole, or the split halves into a reused out_x);
        returns the number of checks made."""
        c = self.prep(case, call)
        if split:
            pending = await a.dispatch_send(*c["args"], **c["kw"], out_x=self.reused_out_x(a, case))
            h = await pending.recv()
        else:
            h = await a.dispatch(*c["args"], **c["kw"])
        y = self.check_dispatch(c, h, own=not split)
        want, ys, out = self.expected_combine(c)
        if split:
            cp = await a.combine_send(h, y)
            got = await cp.recv(out=out, accumulate=out is not None)
        else:
            got = await a.combine(h, y, out=out, accumulate=out is not None)
        return 5 + self.check_combine(c, got, want, ys)

    async def overlap(self, case: dict[str, Any]) -> dict[str, Any]:
        """Two micro-batches in flight, as a model overlapping them: dispatch_send A, dispatch_send
        B, recv A, recv B, combine_send A, combine_send B, recv A, recv B; each checked."""
        a = await self.get(case)
        checks = 0
        for i in range(case["calls"]):
            ca, cb = self.prep(case, 2 * i), self.prep(case, 2 * i + 1)
            pa = await a.dispatch_send(*ca["args"], **ca["kw"], out_x=self.reused_out_x(a, case, 0))
            pb = await a.dispatch_send(*cb["args"], **cb["kw"], out_x=self.reused_out_x(a, case, 1))
            ha, hb = await pa.recv(), await pb.recv()
            ya, yb = self.check_dispatch(ca, ha, own=False), self.check_dispatch(cb, hb, own=False)
            (wa, ysa, oa), (wb, ysb, ob) = self.expected_combine(ca), self.expected_combine(cb)
            qa, qb = await a.combine_send(ha, ya), await a.combine_send(hb, yb)
            ga = await qa.recv(out=oa, accumulate=oa is not None)
            gb = await qb.recv(out=ob, accumulate=ob is not None)
            checks += self.check_combine(ca, ga, wa, ysa) + self.check_combine(cb, gb, wb, ysb) + 2
        return {"ok": True, "checks": checks}

    async def run_case(self, case: dict[str, Any]) -> dict[str, Any]:
        a = await self.get(case)
        checks = 0
        for call in range(case.get("calls", 1)):
            checks += await self.one_call(a, case, call, split=bool(call % 2))
        return {"ok": True, "checks": checks}

    async def cancel(self, case: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 cancels at ``case['where']``; the others run with a short deadline; then every
        rank makes a verified call (the caller sends that as a separate case)."""
        assert self.group is not None
        a = await self.get(case)
        me = self.group.rank
        xs, idx, ws, bm = make_inputs(case, 1000)
        where, outcome = case["where"], "ok"
        if me == 0:
            with anyio.CancelScope() as scope:
                if where == "dispatch_send":
                    scope.cancel()
                    await a.dispatch(xs[me], idx[me], ws[me], bound_m=bm[me])
                pending = await a.dispatch_send(xs[me], idx[me], ws[me], bound_m=bm[me])
                if where == "dispatch_recv":
                    scope.cancel()
                h = await pending.recv()
                cp = await a.combine_send(h, expert_fn(h.expert_x, case["dtype"]))
                scope.cancel()  # "combine_recv"
                await cp.recv()
            outcome = "cancelled" if scope.cancelled_caught else "finished"
        else:
            try:
                h = await a.dispatch(xs[me], idx[me], ws[me], bound_m=bm[me], timeout=1.5)
                if where == "combine_recv":
                    await a.combine(h, expert_fn(h.expert_x, case["dtype"]), timeout=5)
            except aiote.TransferTimeout:
                outcome = "timeout"
        return {"ok": True, "outcome": outcome}

    async def expect_failure(self, case: dict[str, Any]) -> dict[str, Any]:
        """A call that a dead peer must fail: the error's type and how long it took."""
        assert self.group is not None
        a = await self.get(case)
        xs, idx, ws, bm = make_inputs(case, 2000)
        me = self.group.rank
        t0 = time.monotonic()
        try:
            await a.dispatch(xs[me], idx[me], ws[me], bound_m=bm[me], timeout=30)
        except aiote.AioteError as exc:
            return {"ok": True, "error": type(exc).__name__, "elapsed": time.monotonic() - t0}
        return {"ok": False, "error": "the dispatch did not fail"}


def check_bf16_tolerance(got: np.ndarray, expect: list[Any], ys: list[np.ndarray], idx: np.ndarray,
                         w: np.ndarray, case: dict[str, Any], me: int) -> int:
    """|out - truth| <= 2^-8 |truth| + 2^-20 sum_k |w y|: one bfloat16 rounding (half an ulp, at
    most 2^-8 relative) of a float32 sum whose own error is far below that."""
    per = -(-case["E"] // len(expect))
    m = idx.shape[0]
    truth = np.zeros(got.shape, np.float64)
    mag = np.zeros(got.shape, np.float64)
    for t in range(m):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            d = e // per
            rd = expect[d]
            hit = np.nonzero((rd.src_rank == me) & (rd.src_token == t))[0]
            lo, hi = rd.offsets[e - d * per], rd.offsets[e - d * per + 1]
            row = int(hit[(hit >= lo) & (hit < hi)][0])
            term = float(w[t, k]) * moe.bf16_to_f32(ys[d][row]).astype(np.float64)
            truth[t] += term
            mag[t] += np.abs(term)
    err = np.abs(moe.bf16_to_f32(got).astype(np.float64) - truth)
    assert np.all(err <= 2.0**-8 * np.abs(truth) + 2.0**-20 * mag), float(err.max())
    return 1


async def serve(rank: Rank) -> None:
    stdin = anyio.wrap_file(sys.stdin)
    while True:
        line = await stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "exit":
                return
            if op == "group":
                rank.group = moe.Group([bytes.fromhex(a) for a in cmd["addrs"]], cmd["rank"])
                peers = [a for a in rank.group.addresses if a != rank.engine.address]
                reply: dict[str, Any] = {"ok": True, "routes": [rank.engine.route(p).provider for p in peers]}
            elif op == "join":
                reply = await rank.join(cmd)
            elif op == "case":
                reply = await rank.run_case(cmd)
            elif op == "overlap":
                reply = await rank.overlap(cmd)
            elif op == "cancel":
                reply = await rank.cancel(cmd)
            elif op == "stall":
                reply = {"ok": True}
            elif op == "fail":
                reply = await rank.expect_failure(cmd)
            else:
                reply = {"ok": False, "error": f"unknown op {op}"}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


async def main(args: argparse.Namespace) -> None:
    kw: dict[str, Any] = {"retry": aiote.RetryPolicy(connect_timeout=2.0)}
    if args.mode == "tcp":
        kw["same_host"] = None
    xp: Any = np
    if args.gpu is not None:  # this rank's GPU (CuPy arrays; same-host peers over CUDA IPC)
        import cupy

        cupy.cuda.Device(args.gpu).use()
        xp = cupy
    async with aiote.open_engine(**kw) as engine:
        print("MOE_RANK " + engine.address.hex(), flush=True)
        rank = Rank(engine, args.mode, xp)
        await serve(rank)
        for a in rank.a2a.values():
            with anyio.move_on_after(5):
                await a.aclose()
        with anyio.move_on_after(10):
            await rank.held.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="asyncio")
    p.add_argument("--mode", default="tcp", choices=["tcp", "default"])
    p.add_argument("--gpu", type=int, default=None, help="run this rank on that GPU (CuPy)")
    anyio.run(main, p.parse_args(), backend=p.parse_args().backend)
