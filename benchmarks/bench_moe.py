"""MoE dispatch + combine benchmark: aiote.moe against torch.distributed all_to_all_single in
the same run, one process per rank.

    python benchmarks/bench_moe.py                      # CPU: 2 and 4 processes, gloo baseline
    python benchmarks/bench_moe.py --world 2 --shapes decode --iters 100
    python benchmarks/bench_moe.py --gpu                # 2 GPUs of one host, NCCL baseline
    python benchmarks/bench_moe.py --gpu --world 2 4 8  # 2, then 4, then 8 GPUs (one process each)

Shape: DeepSeek-V3 (hidden 7168, 256 experts, top-8), decode 128 tokens per rank and prefill
4096 tokens per rank on GPUs (on the CPU 2048 for 2 ranks, 1024 for 4, so that the ranks and
the baselines' buffers fit in memory; ``--prefill-tokens``), routing redrawn every iteration
(uniform top-8 without repetition, random weights). Dispatch in FP8 (e4m3, stored as bytes)
with one float32 scale per 128 elements (56 a token), combine in bfloat16 (``--dispatch-dtype
bfloat16``: bfloat16 both ways). No GEMM runs: with bfloat16 dispatch the "expert" is the
identity; with FP8 its output is a fixed bfloat16 array of the received rows' count (as if an
expert had written it), the same for every path.

Per rank and call, timed (host wall time; on the GPU after synchronizing the stream, so
each call's kernels are included):
- aiote: ``dispatch`` (counts exchange + tokens and their scales + unpack into per-expert
  padded blocks in canonical order) and ``combine`` (pack + write back + float32 reduction in
  k order).
- torch exact: the same exchange with ``all_to_all_single``: counts first (per expert), then
  the tokens with split sizes, then the same local permutation; combine mirrors it and does
  the same reduction (the same NumPy/CuPy code as aiote's).
- torch padded: a fixed-size ``all_to_all_single`` of ``T x min(K, E/W)`` rows per rank pair,
  no count exchange, no permutation: a floor for the data movement alone.
Rows carry the same bytes on every path: the token (and its scales) and its number. With the
torch baselines, every timed path of an iteration, aiote's included, starts from a
``torch.distributed`` barrier taken after the iteration's routing is drawn, so that no path
absorbs the ranks' skew (``--no-torch``: no barrier).
Each iteration's time is the slowest rank's; p50 and p99 over the iterations are printed,
with the bytes a rank sends to other ranks per call (dispatch, combine) and the resulting rate
as a fraction of
the link's bandwidth measured in the same run (one aiote write of 64 MiB, rank 0 -> 1, over
the same route).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

SHAPES = {"decode": 128, "prefill": 4096}
E, K, H = 256, 8, 7168
SCALE_BLOCK = 128  # FP8 dispatch: one float32 scale per 128 elements of a token (DeepSeek-V3's)
NSCALE = -(-H // SCALE_BLOCK)


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


# ---------------------------------------------------------------------------------- parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Starts ``world`` rank processes, hands them the group, returns their results."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if args.trace:
        env["AIOTE_MOE_TRACE"] = args.trace
    cmd = [sys.executable, __file__, "--child", "--world-size", str(world), *child_args(args)]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                         text=True)
        for r in range(world)
    ]
    addrs = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("ADDR "):
            raise RuntimeError(f"a rank did not start: {line!r}")
        addrs.append(line.split()[1])
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(json.dumps(addrs) + "\n")
        p.stdin.flush()
    results = []
    for p in procs:
        assert p.stdout is not None
        out = p.stdout.readline()
        p.wait(timeout=1200)
        if not out.startswith("RESULT "):
            raise RuntimeError(f"a rank failed (exit {p.returncode}): {out!r}")
        results.append(json.loads(out[7:]))
    return results


def child_args(args: argparse.Namespace) -> list[str]:
    out = ["--iters", str(args.iters), "--prefill-iters", str(args.prefill_iters),
           "--prefill-tokens", str(args.prefill_tokens), "--shapes", *args.shapes, "--route", args.route,
           "--dispatch-dtype", args.dispatch_dtype, "--warmup", str(args.warmup)]
    if args.gpu:
        out.append("--gpu")
    if args.no_torch:
        out.append("--no-torch")
    if args.halves:
        out.append("--halves")
    if args.engine_opts:
        out += ["--engine-opts", args.engine_opts]
    return out


def summarize(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape and method: the slowest rank per iteration, then p50/p99 (microseconds)."""
    summary: dict[str, Any] = {"world": world, "link_gbps": results[0].get("link_gbps"),
                               "dispatch_dtype": results[0].get("dispatch_dtype"), "shapes": {}}
    for shape in results[0]["shapes"]:
        entry: dict[str, Any] = {}
        for method, per_rank in results[0]["shapes"][shape]["times"].items():
            n = len(per_rank)
            worst = [max(r["shapes"][shape]["times"][method][i] for r in results) for i in range(n)]
            entry[method] = {"p50_us": pct(worst, 50) * 1e6, "p99_us": pct(worst, 99) * 1e6, "n": n}
        for way in ("dispatch", "combine"):
            sent = [r["shapes"][shape][f"{way}_bytes"] for r in results]
            entry[f"{way}_bytes_per_rank"] = statistics.mean(sent)
        entry["tokens"] = results[0]["shapes"][shape]["tokens"]
        if "phases" in results[0]["shapes"][shape]:
            entry["phases"] = [r["shapes"][shape]["phases"] for r in results]
        summary["shapes"][shape] = entry
    return summary


def method_bytes(method: str, e: dict[str, Any]) -> float:
    """The bytes a rank sends off-rank in what ``method`` times: dispatch, combine or both."""
    d, c = e["dispatch_bytes_per_rank"], e["combine_bytes_per_rank"]
    return d + c if "+" in method else d if "dispatch" in method else c


def print_summary(s: dict[str, Any], machine: str) -> None:
    link = s["link_gbps"]
    print(f"\n== {s['world']} ranks ({machine}); dispatch {s['dispatch_dtype']}, combine bfloat16; "
          f"link (aiote 64 MiB write, rank 0 -> 1): {link:.2f} GB/s")
    for shape, e in s["shapes"].items():
        print(f"-- {shape}: {e['tokens']} tokens/rank; sent per rank per call: dispatch "
              f"{e['dispatch_bytes_per_rank'] / 1e6:.1f} MB, combine "
              f"{e['combine_bytes_per_rank'] / 1e6:.1f} MB")
        print(f"   {'method':<28}{'p50 us':>12}{'p99 us':>12}{'GB/s p50':>10}{'of link':>9}")
        for method, v in e.items():
            if not isinstance(v, dict):
                continue
            rate = method_bytes(method, e) / (v["p50_us"] / 1e6) / 1e9 if v["p50_us"] else 0.0
            print(f"   {method:<28}{v['p50_us']:>12.0f}{v['p99_us']:>12.0f}{rate:>10.2f}{rate / link:>9.2f}")
        ex = e.get("torch exact dispatch+combine")
        if ex:
            a = e["aiote dispatch+combine"]
            print(f"   torch exact / aiote, dispatch+combine: p50 {ex['p50_us'] / a['p50_us']:.2f}x, "
                  f"p99 {ex['p99_us'] / a['p99_us']:.2f}x faster (>1: aiote faster)")
        for r, ph in enumerate(e.get("phases", [])):
            print(f"   rank {r} phases, p50 us (time since the previous mark): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in ph.items()))


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device
        return 0


def parent(args: argparse.Namespace) -> None:
    machine = args.machine or f"{os.cpu_count()} cores, {'GPU' if args.gpu else 'CPU'}"
    out = []
    if args.gpu:  # one GPU per rank: a world larger than this machine's is skipped, said so
        have = _gpu_count()
        for w in args.world:
            if w > have:
                print(f"--gpu --world {w} skipped: {have} GPU(s) here")
        args.world = [w for w in args.world if w <= have]
    for w in args.world:
        prefill = args.prefill_tokens
        if prefill is None:
            prefill = 4096 if args.gpu else 2048 if w <= 2 else 1024  # CPU: fits a 23 GB host
        res = run_group(w, argparse.Namespace(**{**vars(args), "prefill_tokens": prefill}))
        s = summarize(w, res)
        print_summary(s, machine)
        out.append(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "runs": out, "argv": sys.argv[1:]}, f, indent=1)


# ---------------------------------------------------------------------------------- ranks


class Inputs:
    """One iteration's routing (redrawn per iteration) and the fixed tokens of a rank: bfloat16
    bit patterns, or FP8 bytes (no NaN code) with their float32 block scales in ``scale``."""

    def __init__(self, rank: int, tokens: int, xp: Any, fp8: bool) -> None:
        self.rng = np.random.default_rng(1000 + rank)
        self.tokens, self.xp = tokens, xp
        self.scale: Any = None
        if fp8:
            self.x = xp.asarray(self.rng.integers(0, 0x7F, (tokens, H), dtype=np.uint8))
            self.scale = xp.asarray(self.rng.random((tokens, NSCALE), dtype=np.float32) + 0.5)
            return
        x = self.rng.standard_normal((tokens, H)).astype(np.float32)
        from aiote import moe

        self.x = xp.asarray(moe.f32_to_bf16(x))

    def draw(self) -> tuple[Any, Any]:
        idx = np.argpartition(self.rng.random((self.tokens, E)), K, axis=1)[:, :K].astype(np.int64)
        w = self.rng.random((self.tokens, K)).astype(np.float32)
        return self.xp.asarray(idx), self.xp.asarray(w)


def sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


AIOTE = ("aiote dispatch", "aiote combine", "aiote dispatch+combine")
HALVES = ("aiote dispatch send half", "aiote dispatch recv half", "aiote combine send half",
          "aiote combine recv half")


def phase_times(marks: list[tuple[str, float]], t0: float, into: dict[str, list[float]]) -> None:
    """Per mark of aiote.moe's trace: the time since the previous mark (the first: since t0)."""
    prev = t0
    for name, t in marks:
        into.setdefault(name, []).append(t - prev)
        prev = t


async def aiote_step(
    a2a: Any, inp: Inputs, idx: Any, w: Any, xp: Any, out_x: Any, y: Any, halves: bool = False
) -> tuple[float, ...]:
    """One aiote dispatch + combine into the reused ``out_x`` (as a model layer would), the
    expert's output ``y`` (None: the identity, ``expert_x``); the times of AIOTE's lines.
    The stream is synchronized after the dispatch and after the combine, as the torch path
    is; ``halves``: also between each send half and its receive half, to time the halves
    (HALVES' lines; those syncs then count in dispatch and combine)."""
    sync(xp)
    from aiote.moe import _trace

    _trace.take()
    t0 = time.perf_counter()
    aiote_step.t0 = t0  # type: ignore[attr-defined]
    pending = await a2a.dispatch_send(inp.x, idx, w, x_scale=inp.scale, out_x=out_x)
    if halves:
        sync(xp)
    ts = time.perf_counter()
    h = await pending.recv()
    sync(xp)
    t1 = time.perf_counter()
    cp = await a2a.combine_send(h, h.expert_x if y is None else y)
    if halves:
        sync(xp)
    tc = time.perf_counter()
    await cp.recv()
    sync(xp)
    t2 = time.perf_counter()
    out = (t1 - t0, t2 - t1, t2 - t0)
    return (*out, ts - t0, t1 - ts, tc - t1, t2 - tc) if halves else out


async def run_shapes(args: argparse.Namespace, rank: int, world: int, addrs: list[bytes], xp: Any,
                     engine: Any, res: dict[str, Any]) -> None:
    """Per shape, iterations alternate: aiote's dispatch + combine, then (with torch) the exact
    torch path and the padded floor, on the same routing, so that both see the same load."""
    from aiote import moe

    group = moe.Group(addrs, rank)
    fp8 = args.dispatch_dtype != "bfloat16"
    res["dispatch_dtype"] = args.dispatch_dtype
    for si, shape in enumerate(args.shapes):
        t = SHAPES[shape] if shape == "decode" else args.prefill_tokens
        iters = args.iters if shape == "decode" else args.prefill_iters
        cap = None if shape == "decode" else int(t * K * 1.25) + 1024  # uniform routing: ~T*K per rank
        a2a = await moe.AllToAll.create(
            engine, group, num_experts=E, experts_per_token=K, hidden=H, max_tokens=t,
            in_dtype=args.dispatch_dtype, out_dtype="bfloat16", max_recv_tokens=cap, imm_tag=0x60 + si,
            timeout=120, scale_block=SCALE_BLOCK if fp8 else None, xp=xp,
        )
        inp = Inputs(rank, t, xp, fp8)
        # FP8: the expert's bfloat16 output, fixed (as if written by the expert), for every path
        y = None
        if fp8:
            rows = (a2a.max_expert_rows, H)
            rand = inp.rng.random if xp is np else xp.random.random
            f = rand(rows, dtype=np.float32)
            y = moe.f32_to_bf16(f - np.float32(0.5), xp)
            del f
        baseline = None if args.no_torch else TorchBaselines(args, rank, world, xp, t, inp, y)
        names = AIOTE + HALVES if args.halves else AIOTE
        times: dict[str, list[float]] = {m: [] for m in names}
        sent: list[tuple[float, float]] = []
        phases: dict[str, list[float]] = {}
        out_x = xp.zeros((a2a.max_expert_rows, H), dtype=a2a.in_dtype.storage)
        for i in range(iters + args.warmup):
            idx, w = inp.draw()
            if baseline is not None:  # aiote's call starts from a barrier, as each torch path does
                baseline.barrier()
            got = dict(zip(names, await aiote_step(a2a, inp, idx, w, xp, out_x, y, args.halves), strict=True))
            if os.environ.get("AIOTE_MOE_TRACE") and i >= args.warmup:
                from aiote.moe import _trace

                phase_times(_trace.take(), aiote_step.t0, phases)  # type: ignore[attr-defined]
            if baseline is not None:
                got.update(baseline.step(idx.get() if xp is not np else idx, w))
            if i >= args.warmup:
                for name, v in got.items():
                    times.setdefault(name, []).append(v)
                sent.append(bytes_sent(a2a, idx, xp))
        res["shapes"][shape] = {"times": times, "tokens": t,
                                "dispatch_bytes": statistics.mean(d for d, _ in sent),
                                "combine_bytes": statistics.mean(c for _, c in sent)}
        if phases:
            res["shapes"][shape]["phases"] = {k: pct(v, 50) * 1e6 for k, v in phases.items()}
        del baseline, y, out_x
        await a2a.aclose()
    # after every create: no group message can be in flight now (create takes the messages)
    res["link_gbps"] = await link_bandwidth(engine, rank, addrs, xp)


def bytes_sent(a2a: Any, idx: Any, xp: Any) -> tuple[float, float]:
    """Bytes of payload this rank sends to other ranks in one dispatch (rows for experts not on
    this rank x (H x the input's itemsize + its scales)) and receives back in combine (the same
    rows x H x 2, bfloat16)."""
    host = idx.get() if xp is not np else idx
    per = -(-E // a2a.world)
    rows = float(((host // per) != a2a.rank).sum())
    scales = 4 * NSCALE if a2a.scale_block else 0
    return rows * (H * a2a.in_dtype.itemsize + scales), rows * H * 2


async def link_bandwidth(engine: Any, rank: int, addrs: list[bytes], xp: Any) -> float:
    """GB/s of one 64 MiB aiote write, rank 0 -> rank 1 (median of 5), over the same route and
    into the same kind of memory as aiote.moe's receive regions (the host arena on the CPU)."""
    import anyio

    n = 64 << 20
    if rank > 1:
        return 0.0
    buf = xp.zeros(n, dtype=xp.uint8) if xp is not np else engine.alloc_host(n)  # as aiote.moe's regions
    mr = await engine.register(buf)
    peer = addrs[1 - rank]
    await engine.send(peer, bytes(mr.descriptor), timeout=60)
    _, desc = await engine.recv(timeout=60)
    gbps = 0.0
    if rank == 0:
        dts = []
        for _ in range(6):
            t0 = time.perf_counter()
            await engine.write(mr, desc, imm=0x7F000001, timeout=60)
            sync(xp)
            dts.append(time.perf_counter() - t0)
        gbps = n / statistics.median(dts[1:]) / 1e9
        await engine.send(peer, b"done", timeout=60)
    else:
        await engine.recv(timeout=120)
    with anyio.move_on_after(10):
        await engine.unregister(mr)
    return gbps


class TorchExact:
    """The exact exchange over torch.distributed: counts, then tokens with split sizes, then the
    same local permutation as aiote's; combine mirrored, with aiote's reduction code. A row
    carries the same bytes as aiote's: the token (and its block scales) and its number (16
    bytes), as bytes (gloo has no 16-bit integers, NCCL no FP8 in every version)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, xp: Any, t: int, inp: Inputs,
                 y: Any) -> None:
        import torch
        import torch.distributed as dist

        from aiote.moe import _dtypes
        from aiote.moe._layout import Geometry

        self.torch, self.dist, self.xp, self.rank, self.world, self.t = torch, dist, xp, rank, world, t
        self.dev = torch.device("cuda", rank) if args.gpu else torch.device("cpu")
        self.geo = Geometry(world, E)
        self.bf = _dtypes.dtype_of("bfloat16", "dtype")
        self.x_dtype = inp.x.dtype
        self.xb = H * inp.x.dtype.itemsize  # bytes of a token
        self.sb = 0 if inp.scale is None else 4 * NSCALE  # bytes of its scales
        self.drow = self.xb + self.sb + 16  # + its number, padded to 16 bytes
        self.xrow = xp.zeros((t, self.drow), dtype=xp.uint8)
        self.xrow[:, : self.xb] = inp.x.view(xp.uint8).reshape(t, self.xb)
        if inp.scale is not None:
            self.xrow[:, self.xb : self.xb + self.sb] = inp.scale.view(xp.uint8).reshape(t, self.sb)
        tail = self.xb + self.sb
        self.xrow[:, tail : tail + 4] = xp.arange(t, dtype=xp.int32).view(xp.uint8).reshape(t, 4)
        self.y = y  # the expert's output (None: the identity)
        self.ex: Any = None
        self.exs: Any = None

    def tt(self, a: Any) -> Any:
        """A zero-copy torch view of a NumPy/CuPy array."""
        return self.torch.from_numpy(a) if self.xp is np else self.torch.as_tensor(a, device=self.dev)

    def from_torch(self, a: Any) -> Any:
        return self.xp.asarray(a.cpu().numpy()) if self.xp is np else self.xp.asarray(a)

    def step(self, idx_h: np.ndarray, w: Any) -> tuple[float, float]:
        """One dispatch + combine; their times (host wall, after a stream sync on the GPU)."""
        from aiote.moe._layout import plan_recv, plan_send
        from aiote.moe._util import reduce_rows

        torch, dist, xp, geo, per = self.torch, self.dist, self.xp, self.geo, self.geo.per_rank
        t0 = time.perf_counter()
        send = plan_send(idx_h, self.t, E)
        route = np.zeros(self.world * per, np.int32)
        route[:E] = send.route
        got = torch.empty(self.world * per, dtype=torch.int32, device=self.dev)
        dist.all_to_all_single(got, self.tt(xp.asarray(route)))
        c_local = got.cpu().numpy().reshape(self.world, per)  # [src, my experts] (a device sync on GPU)
        c = np.zeros((self.world, self.world * per), np.int32)
        c[:, self.rank * per : (self.rank + 1) * per] = c_local
        c[self.rank, :] = route  # my own row, for my send splits
        plan = plan_recv(c[:, :E], geo, self.rank, 1, 1 << 30)
        in_split = geo.rank_sums(send.route[None, :])[0].tolist()
        out_split = c_local.sum(1).tolist()
        rows_out = self.xrow[xp.asarray(send.row_token)] if len(send.row_token) else self.xrow[:0]
        recv = torch.empty((sum(out_split), self.drow), dtype=torch.uint8, device=self.dev)
        dist.all_to_all_single(recv, self.tt(rows_out), out_split, in_split)
        rows = int(plan.offsets[-1])
        if self.ex is None or self.ex.shape[0] < rows:  # reused, as aiote's out_x
            self.ex = xp.zeros((rows + rows // 4 + 64, H), dtype=self.x_dtype)
            self.exs = xp.zeros((self.ex.shape[0], max(1, self.sb // 4)), dtype=xp.float32)
        ex = self.ex[:rows].view(xp.uint8)
        src_token = xp.full(rows, -1, dtype=xp.int32)
        r_arr = self.from_torch(recv)
        dest = xp.asarray(plan.dest)
        ex[dest] = r_arr[:, : self.xb]
        if self.sb:
            self.exs[:rows].view(xp.uint8)[dest] = r_arr[:, self.xb : self.xb + self.sb]
        tail = self.xb + self.sb
        src_token[dest] = xp.ascontiguousarray(r_arr[:, tail : tail + 4]).view(xp.int32).ravel()
        sync(xp)
        t1 = time.perf_counter()
        out = self.ex if self.y is None else self.y  # the expert's output rows
        yb = out[dest].view(xp.uint8)  # back in received order
        back = torch.empty((len(send.row_token), 2 * H), dtype=torch.uint8, device=self.dev)
        dist.all_to_all_single(back, self.tt(xp.ascontiguousarray(yb)), in_split, out_split)
        back_x = self.from_torch(back).view(xp.uint16)
        # the same reduction code as aiote's combine (float32, slot order, one rounding)
        reduce_rows(back_x, xp.asarray(send.pos), w, self.bf, xp, xp.empty((self.t, H), dtype=xp.uint16))
        sync(xp)
        return t1 - t0, time.perf_counter() - t1


class TorchBaselines:
    """torch.distributed all_to_all_single (gloo on CPU, NCCL on GPU): the exact path
    (:class:`TorchExact`) and the padded fixed-size floor, each after a barrier."""

    NAMES = ("torch exact dispatch", "torch exact combine", "torch exact dispatch+combine",
             "torch padded dispatch", "torch padded combine")

    def __init__(self, args: argparse.Namespace, rank: int, world: int, xp: Any, t: int, inp: Inputs,
                 y: Any) -> None:
        import torch

        self.exact = TorchExact(args, rank, world, xp, t, inp, y)
        self.gpu = args.gpu
        pair = t * min(K, self.exact.geo.per_rank)
        dev = self.exact.dev
        self.pad_in = torch.ones((world * pair, self.exact.drow), dtype=torch.uint8, device=dev)
        self.pad_out = torch.empty_like(self.pad_in)
        self.pad_cin = torch.ones((world * pair, 2 * H), dtype=torch.uint8, device=dev)
        self.pad_cout = torch.empty_like(self.pad_cin)

    def _sync(self) -> None:
        if self.gpu:
            self.exact.torch.cuda.synchronize(self.exact.dev)

    def barrier(self) -> None:
        """The ranks leave together: what every timed path starts from."""
        self.exact.dist.barrier()

    def step(self, idx_h: np.ndarray, w: Any) -> dict[str, float]:
        """One exact dispatch + combine and one padded exchange each way; their times."""
        dist = self.exact.dist
        dist.barrier()
        td, tc = self.exact.step(idx_h, w)
        dist.barrier()
        t3 = time.perf_counter()
        dist.all_to_all_single(self.pad_out, self.pad_in)
        self._sync()
        t4 = time.perf_counter()
        dist.all_to_all_single(self.pad_cout, self.pad_cin)
        self._sync()
        t5 = time.perf_counter()
        return dict(zip(self.NAMES, (td, tc, td + tc, t4 - t3, t5 - t4), strict=True))


def child(args: argparse.Namespace) -> None:
    import anyio

    import aiote

    rank, world = args.rank, args.world_size
    xp: Any = np
    if args.gpu:
        import cupy

        cupy.cuda.Device(rank).use()
        xp = cupy
    if not args.no_torch:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            print("torch is not installed: baselines skipped", file=sys.stderr)
            args.no_torch = True
        else:
            kw: dict[str, Any] = {}
            if args.gpu:
                torch.cuda.set_device(rank)
                kw["device_id"] = torch.device("cuda", rank)
            dist.init_process_group("nccl" if args.gpu else "gloo", rank=rank, world_size=world, **kw)
    res: dict[str, Any] = {"rank": rank, "shapes": {}}

    async def run() -> None:
        kw: dict[str, Any] = {"same_host": None} if args.route == "tcp" else {}
        kw.update(json.loads(args.engine_opts or "{}"))
        async with aiote.open_engine(**kw) as engine:
            print("ADDR " + engine.address.hex(), flush=True)
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            addrs = [bytes.fromhex(a) for a in json.loads(line)]
            await run_shapes(args, rank, world, addrs, xp, engine, res)

    prof_dir = os.environ.get("AIOTE_MOE_PROFILE")  # a folder: cProfile of each rank's run there
    if prof_dir:
        import cProfile

        with cProfile.Profile() as prof:
            anyio.run(run)
        prof.dump_stats(os.path.join(prof_dir, f"rank{rank}.prof"))
    else:
        anyio.run(run)
    if not args.no_torch:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=None,
                   help="ranks per run, one after the other (CPU: 2 4; GPU: 2; at most the GPU count)")
    p.add_argument("--shapes", nargs="+", default=["decode", "prefill"], choices=list(SHAPES))
    p.add_argument("--iters", type=int, default=None, help="decode iterations (CPU 50, GPU 1000)")
    p.add_argument("--prefill-iters", type=int, default=None, help="prefill iterations (CPU 5, GPU 100)")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="prefill tokens per rank (default 4096 on GPUs; on the CPU 2048 for 2 ranks and "
                        "1024 past that, for memory: 4096 x 2 ranks takes ~17 GB with the baselines)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--route", default="default", choices=["default", "tcp"],
                   help="default: open_engine() defaults (same host: shm, or CUDA IPC for GPU memory)")
    p.add_argument("--gpu", action="store_true", help="CuPy arrays, one GPU per rank, NCCL baseline")
    p.add_argument("--dispatch-dtype", default="float8_e4m3fn", choices=["float8_e4m3fn", "bfloat16"],
                   help="dispatch rows: FP8 with a float32 scale per 128 elements (default), or bfloat16; "
                        "combine is bfloat16 either way")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    p.add_argument("--halves", action="store_true",
                   help="also time aiote's send and receive halves (a stream sync between them)")
    p.add_argument("--trace", default="", choices=["", "1", "sync"],
                   help="per-phase times of aiote's calls (AIOTE_MOE_TRACE; sync: GPU work in its phase)")
    p.add_argument("--engine-opts", default="", help="JSON of open_engine() keyword arguments, e.g. "
                   '\'{"watch_interval_us": 20}\'')
    p.add_argument("--machine", default=None, help="how to name the machine in the output")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.iters is None:
        args.iters = 1000 if args.gpu else 50
    if args.prefill_iters is None:
        args.prefill_iters = 100 if args.gpu else 5
    if args.world is None:
        args.world = [2] if args.gpu else [2, 4]
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
