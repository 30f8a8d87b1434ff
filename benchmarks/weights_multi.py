"""Trainer GPUs -> inference GPUs of one host: the weight update of ``bench_weights.py --gpu
--trainers N --inference M`` (and its CPU check, without ``--gpu``), one process per rank.

The model: DeepSeek-V3's MoE layer shapes (hidden 7168; MLA attention: q_a 1536, kv_a 512 + 64,
128 heads of 128 + 64 / 128; 256 routed experts of 2048 and one shared expert; the router),
``layers`` of them (embeddings and the first dense layers left out). ``--tiny`` shrinks every
dimension (for the CPU check), keeping multiples of the 128-element block.

Trainers (ranks ``0..N-1``, GPUs ``0..N-1``) hold dim-0 shards in bfloat16, cut at 128-row
block boundaries (stacked experts: by expert), as FSDP keeps them. Each version, before any
transfer, every trainer quantizes its shards to FP8 e4m3 with one float32 scale per 128 x 128
block (``weight_scale_inv``, DeepSeek-V3's checkpoint format: amax / 448), which its shard
boundaries allow without any exchange; the quantization is timed on its own, not in the walls
below (it is the same for every path). What moves: the FP8 weights, their scales, and the
bfloat16 norms and router.

Inference ranks (``N..N+M-1``) hold one tensor-parallel replica (TP = M), as vLLM lays out
DeepSeek-V3: ``fused_qkv_a_proj`` (q_a and kv_a fused, replicated), q_b / kv_b column-parallel,
o_proj row-parallel, the shared expert's gate and up fused (column-parallel), its down
row-parallel, the routed experts' w1 and w3 column-parallel and w2 row-parallel, norms and
router replicated; each FP8 weight with its block scales (a second target: fused and sliced
like the weight). All of a rank's targets in one GPU allocation, registered once.

Paths, all in one run, each timed from a barrier to the last rank's end (the slowest rank),
the median of ``repeats`` after one warm-up:

1. aiote: ``WeightPlan`` over these shards, each trainer's ``WeightSender.push``
   (``register_sources=True``: row slices go straight from the trainer's buffers; column
   slices through its staging pool) until every inference rank's ``wait_version`` returned;
   over the CUDA-IPC rail between GPUs.
2. NCCL all-gather + broadcast (what open frameworks do): the trainers all-gather their
   payload in buckets, trainer 0 broadcasts each bucket to every inference rank, each keeps
   its share (one copy of ``1 / M`` of the bucket).
3. NCCL ``batch_isend_irecv`` executing the same plan: every write of the plan becomes a send
   (row slices straight from the trainer's buffers, column slices packed first) and a
   receive at the same offset of the same region, in batches of ``bucket`` bytes per trainer.
4. The ceiling: concurrent ``cudaMemcpyPeerAsync`` of every (trainer, inference rank) pair's
   bytes, each pair on its own stream, into a second allocation of each inference rank opened
   through CUDA IPC. And the link figure ``B``: one pair's copy alone, for the plan's bound
   ``max(max out, max in) / B``.

After the timed versions, the bytes aiote and the NCCL plan path left in each inference
region (poisoned before each) are compared by checksum.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from weights_model import (  # (a sibling script: benchmarks/ is on the path)
    BLOCK,
    DSV3,
    TINY,
    Param,
    cdiv,
    model,
    quantize_block,
    sources_of,
    specs_of,
    trainer_bf16_bytes,
    trainer_sizes,
)

GB = 1e9


# ------------------------------------------------------------------ parent


def free_port() -> int:
    """A free tcp port on loopback (the torch.distributed rendezvous of a baseline)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_memory_total(gpu: int) -> int | None:
    """Bytes of GPU ``gpu`` (nvidia-smi, so that this process opens no CUDA context)."""
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip().splitlines()[0]) << 20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def run(a: argparse.Namespace) -> dict[str, Any] | None:
    """Starts the ranks, returns rank 0's summary (printed)."""
    world = a.trainers + a.inference
    d = TINY if a.tiny else DSV3
    note = ""
    if a.gpu:
        n = gpu_count()
        if n < world:
            print(f"--gpu --trainers {a.trainers} --inference {a.inference} skipped: {n} GPUs here, "
                  f"{world} needed")
            return None
    layers = a.layers
    one = trainer_bf16_bytes(model(d, 1), a.trainers)
    if layers is None:
        mem = gpu_memory_total(0) if a.gpu else None
        if mem is None:
            layers, note = 1, "1 layer (no GPU memory figure: --layers to choose)"
        else:
            layers = max(1, int(a.trainer_fraction * mem // one))
            note = (f"{layers} layers: as many as fit in {a.trainer_fraction:.0%} of a trainer's "
                    f"{mem / GB:.1f} GB ({layers * one / GB:.1f} GB of bfloat16 shards each)")
    else:
        note = f"{layers} layers (--layers), {layers * one / GB:.1f} GB of bfloat16 shards per trainer"
    cfg = {"trainers": a.trainers, "inference": a.inference, "layers": layers, "tiny": a.tiny, "gpu": a.gpu,
           "repeats": a.repeats, "chunk": a.chunk_mib << 20, "max_tmp": a.max_tmp_mib << 20,
           "bucket": a.bucket_mib << 20, "note": note, "rx_memory": a.rx_memory.split(",")[-1]}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), json.dumps(cfg)],
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True, env=env)
             for r in range(world)]
    try:
        out, _ = procs[0].communicate(timeout=a.timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        print(f"weights {a.trainers} + {a.inference}: past --timeout {a.timeout:.0f} s, ranks killed")
        for p in procs:
            p.kill()
        out, _ = procs[0].communicate()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    summary: dict[str, Any] | None = None
    for line in (out or "").splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "META":
            summary = dict(json.loads(rest), paths={})
        elif summary is not None and kind in ("PATH", "CHECK"):
            key, _, body = rest.partition(" ")
            if kind == "PATH":
                summary["paths"][key] = json.loads(body)
            else:
                summary[key] = json.loads(body)
    codes = [p.returncode for p in procs]
    if summary is None:
        print(f"weights {a.trainers} + {a.inference}: no result (rank exits {codes})")
        return None
    if any(codes):
        print(f"weights {a.trainers} + {a.inference}: a rank failed (exits {codes}); what was measured:")
    print_summary(summary)
    return summary


def print_summary(s: dict[str, Any]) -> None:
    c, be = s["cfg"], s["backend"]
    total = s["total_bytes"]
    print(f"\n== weight update, {c['trainers']} trainer -> {c['inference']} inference ranks "
          f"(TP {c['inference']}), {s['machine']}")
    print(f"model: DeepSeek-V3 MoE layer shapes{' (tiny)' if c['tiny'] else ''}, {c['note']}; "
          f"{s['params'] / 1e9:.2f} B parameters")
    print(f"moved per update: {total / GB:.2f} GB (FP8 weights + float32 block scales + bfloat16 norms and "
          f"router), {s['tasks']} plan writes (chunks <= {c['chunk'] >> 20} MiB), planned in "
          f"{s['plan_s'] * 1e3:.0f} ms")
    print("bytes per rank (plan): out "
          + ", ".join(f"trainer {r} {b / GB:.2f} GB" for r, b in s["out"].items())
          + "; in " + ", ".join(f"inference {r} {b / GB:.2f} GB" for r, b in s["in"].items()))
    print(f"quantization on the trainers (BF16 -> FP8 + 128 x 128 block scales, not in the walls): "
          f"{max(s['quantize_s']):.3f} s (slowest trainer); largest error / block amax "
          f"{s['quant_error']:.4f}")
    paths = s["paths"]
    cp = paths.get("ceiling") or {}
    link, bound, ceil = cp.get("link_gbps"), cp.get("bound_s"), cp.get("wall_s")
    if link:
        print(f"link B: one cudaMemcpyPeerAsync trainer 0 -> inference 0 alone: {link:.1f} GB/s; plan bound "
              f"max(max out, max in) / B = {bound * 1e3:.1f} ms; ceiling per trainer (median): "
              + ", ".join(f"{x * 1e3:.1f} ms" for x in cp.get("per_trainer_s", [])))
    else:
        print("no ceiling and no bound (no GPUs, or not measured)")
    print(f"   {'path':<48}{'wall ms':>9}{'GB/s':>8}{'of ceiling':>11}{'of bound':>9}  walls ms")
    labels = (("ceiling", "ceiling: concurrent cudaMemcpyPeer, every pair"),
              ("aiote", "aiote push, the plan" + (" (CUDA-IPC rail)" if c["gpu"] else "")),
              ("nccl_bcast", f"{be} all-gather + broadcast from trainer 0"),
              ("nccl_p2p", f"{be} batch_isend_irecv, the same plan"))
    for key, label in labels:
        r = paths.get(key)
        if not r:
            print(f"   {label:<48}  not measured")
            continue
        w = r["wall_s"]
        fc = f"{ceil / w:.2f}" if ceil else "-"
        fb = f"{bound / w:.2f}" if bound else "-"
        print(f"   {label:<48}{w * 1e3:>9.1f}{total / w / GB:>8.1f}{fc:>11}{fb:>9}  "
              + ", ".join(f"{x * 1e3:.1f}" for x in r["walls"]))
    ai = paths.get("aiote")
    if ai:
        for t, st in enumerate(ai["stats"]):
            print(f"   aiote trainer {t}: push {st['wall_s'] * 1e3:.1f} ms, staging wait "
                  f"{st['staging_wait_s'] * 1e3:.1f}, transform {st['transform_s'] * 1e3:.1f}, writes "
                  f"{st['write_s'] * 1e3:.0f} summed ({st['writes']}), notify {st['notify_s'] * 1e3:.2f}; "
                  f"direct {st['direct_bytes'] / GB:.2f} GB; peak staging "
                  f"{st['peak_staging_bytes'] / 2**20:.0f} MiB of {c['max_tmp'] >> 20}")
        print("   aiote inference ranks' wait_version returned after (median): "
              + ", ".join(f"{x * 1e3:.1f} ms" for x in ai["recv_s"]))
    for key, label in labels[2:]:
        r = paths.get(key)
        if r:  # a stage's time on a rank includes its waits for the other ranks' stages
            ranks = "; ".join(f"rank {i}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in st.items())
                              for i, st in enumerate(r["stages"]))
            print(f"   {label}, per stage on each rank (ms, the median version): {ranks}; staging "
                  f"{r['staging_bytes'] / 2**20:.0f} MiB per rank")
    if "check" in s or "reference" in s:
        print(f"   check: aiote and the {be} plan path left the same bytes in every inference region: "
              f"{s.get('check', 'not run')}"
              + (f"; every target byte-exact against the trainers' shards: {s['reference']}"
                 if "reference" in s else ""))
    if ai and paths.get("nccl_bcast") and paths.get("nccl_p2p"):
        w = ai["wall_s"]
        print(f"   aiote vs {be} all-gather + broadcast: {paths['nccl_bcast']['wall_s'] / w:.2f}x faster; vs "
              f"{be} batch_isend_irecv: {paths['nccl_p2p']['wall_s'] / w:.2f}x faster"
              + (f"; aiote / ceiling {ceil / w:.2f}, / bound {bound / w:.2f}" if ceil else ""))


# ------------------------------------------------------------------ ranks


class Ctx:
    """One rank: its place, xp, torch and the process groups."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.cfg = rank, cfg
        self.T, self.I = cfg["trainers"], cfg["inference"]
        self.world = self.T + self.I
        self.trainer = rank < self.T
        self.gpu = bool(cfg["gpu"])
        self.torch, self.dist = torch, dist
        self.xp: Any = np
        kw: dict[str, Any] = {}
        if self.gpu:
            import cupy

            cupy.cuda.Device(rank).use()
            torch.cuda.set_device(rank)
            self.xp = cupy
            self.dev = torch.device("cuda", rank)
            kw["device_id"] = self.dev
        else:
            self.dev = torch.device("cpu")
        # a rank that fails makes the others' collectives fail within this, not hang
        kw["timeout"] = datetime.timedelta(seconds=cfg.get("pg_timeout", 90))
        dist.init_process_group("nccl" if self.gpu else "gloo", rank=rank, world_size=self.world, **kw)
        self.cpu = dist.new_group(backend="gloo", timeout=kw["timeout"])  # objects and barriers
        self.tgroup = dist.new_group(list(range(self.T)))
        self.bgroup = dist.new_group([0, *range(self.T, self.world)])
        if self.gpu:
            dist.barrier(device_ids=[rank])  # the world communicator up before any point-to-point

    def tt(self, a: Any) -> Any:
        """A zero-copy torch view of a NumPy/CuPy array (bfloat16 bit patterns as int16)."""
        if a.dtype == np.uint16:
            a = a.view(self.xp.int16)
        return self.torch.from_numpy(a) if self.xp is np else self.torch.as_tensor(a, device=self.dev)

    def sync(self) -> None:
        if self.gpu:
            self.xp.cuda.get_current_stream().synchronize()
            self.torch.cuda.synchronize(self.dev)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.cpu)
        return out

    def barrier(self) -> None:
        self.dist.barrier(group=self.cpu)


class Stages:
    """Per-stage time: CUDA events on the current stream (GPU) or host time (CPU), summed."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.ctx.gpu:
            ev = self.ctx.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def sums(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:], strict=False):
            dt = a.elapsed_time(b) / 1e3 if self.ctx.gpu else b - a
            out[name] = out.get(name, 0.0) + dt
        return out


class Trainer:
    """A trainer's buffers: bfloat16 shards (norms and router in a small buffer of their own,
    the weights to quantize in a large one), and the FP8 weights and float32 scales the
    quantization writes, each kind in one allocation (views per parameter)."""

    def __init__(self, ctx: Ctx, params: list[Param], sizes: dict[str, int]) -> None:
        xp, t, n = ctx.xp, ctx.rank, ctx.T
        self.ctx = ctx
        self.small = xp.zeros(sizes["small"] // 2, xp.uint16)  # bfloat16 norms and router
        self.big = xp.empty(sizes["big"] // 2, xp.uint16)  # bfloat16 weights (to quantize)
        self.fp8 = xp.zeros(sizes["fp8"], xp.uint8)
        self.scales = xp.zeros(sizes["scales"] // 4, xp.float32)
        self.tensors: dict[str, Any] = {}  # what the plan moves: name -> local shard
        self.work: list[tuple[Any, Any, Any]] = []  # (bf16 2-D, fp8 2-D, scales 2-D)
        at = {"small": 0, "big": 0, "fp8": 0, "scales": 0}
        for q in params:
            r0, r1 = q.shard(n, t)
            local = (r1 - r0, *q.shape[1:])
            count = int(np.prod(local))
            if not q.quant:
                self.tensors[q.name] = self.small[at["small"] : at["small"] + count].reshape(local)
                at["small"] += count
                continue
            b = self.big[at["big"] : at["big"] + count]
            at["big"] += count
            f = self.fp8[at["fp8"] : at["fp8"] + count]
            at["fp8"] += count
            sr = q.scale_rows((r0, r1))
            slocal = (sr[1] - sr[0], *q.scale_shape()[1:])
            scount = int(np.prod(slocal))
            s = self.scales[at["scales"] : at["scales"] + scount]
            at["scales"] += scount
            self.tensors[q.name] = f.reshape(local)
            self.tensors[q.name + ".scale_inv"] = s.reshape(slocal)
            rows2d = count // q.cols
            self.work.append((b.reshape(rows2d, q.cols), f.reshape(rows2d, q.cols),
                              s.reshape(cdiv(rows2d, BLOCK), cdiv(q.cols, BLOCK))))

    def fill(self, seed: int) -> None:
        torch = self.ctx.torch
        gen = torch.Generator(device=self.ctx.dev)
        gen.manual_seed(seed)
        for buf in (self.small, self.big):
            if buf.size:
                self.ctx.tt(buf).view(torch.bfloat16).normal_(generator=gen)

    def quantize(self) -> float:
        """BF16 -> FP8 e4m3 with one float32 scale (amax / 448) per 128 x 128 block, every
        weight of this trainer; seconds."""
        torch = self.ctx.torch
        self.ctx.sync()
        t0 = time.perf_counter()
        for b, f, s in self.work:
            quantize_block(torch, self.ctx.tt(b).view(torch.bfloat16), self.ctx.tt(f), self.ctx.tt(s))
        self.ctx.sync()
        dt = time.perf_counter() - t0
        if self.ctx.gpu:
            torch.cuda.empty_cache()
        return dt

    def quant_error(self) -> float:
        """The largest |dequantized - bfloat16| of the first weight's first 256 rows, over its
        block's amax (e4m3 rounds to 3 mantissa bits: at most 1/28 near the top)."""
        torch = self.ctx.torch
        b, f, s = self.work[0]
        rows = min(256, b.shape[0])
        x = self.ctx.tt(b[:rows]).view(torch.bfloat16).float()
        q = self.ctx.tt(f[:rows]).view(torch.float8_e4m3fn).float()
        sc = self.ctx.tt(s[: cdiv(rows, BLOCK)])
        full = sc.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, : x.shape[1]]
        return float(((q * full - x).abs() / (full * 448.0)).max())

    def payload(self) -> list[Any]:
        """What the NCCL all-gather path moves: its three contiguous buffers, as bytes."""
        return [self.small.view(self.ctx.xp.uint8), self.fp8, self.scales.view(self.ctx.xp.uint8)]


def checksum(xp: Any, buf: Any) -> str:
    """A position-weighted sum of ``buf``'s bytes (as uint32 words, the tail bytes apart)."""
    n = buf.size // 4 * 4
    words = buf[:n].view(xp.uint32)
    step = 1 << 24
    wts = (xp.arange(min(step, max(1, words.size)), dtype=xp.uint64) % 65521) + 1
    total = 0
    for off in range(0, words.size, step):
        part = words[off : off + step].astype(xp.uint64)
        total = (total * 1000003 + int((part * wts[: part.size]).sum())) % (1 << 61)
    tail = bytes(xp.asnumpy(buf[n:]) if xp is not np else buf[n:])
    return f"{total:x}-{tail.hex()}"


def emit(ctx: Ctx, kind: str, mine: Any, build: Any) -> Any:
    """Gathers every rank's ``mine``; rank 0 prints ``kind`` and ``build(all of them)`` as one
    JSON line at once (the parent keeps what came before a failure); returns the list."""
    every = ctx.gather(mine)
    if ctx.rank == 0:
        print(kind + " " + json.dumps(build(every)), flush=True)
    return every


async def rank_main(ctx: Ctx) -> None:
    import anyio

    import aiote
    from aiote import weights as W

    cfg, xp = ctx.cfg, ctx.xp
    d = TINY if cfg["tiny"] else DSV3
    params = model(d, cfg["layers"])
    sources = sources_of(params, ctx.T)
    me = ctx.rank - ctx.T  # inference index
    trainers = list(range(ctx.T))
    async with aiote.open_engine() as engine:
        tr: Trainer | None = None
        mem = None
        res: dict[str, Any] = {}
        if ctx.trainer:
            tr = Trainer(ctx, params, trainer_sizes(params, ctx.T))
            tr.fill(1234 + ctx.rank)
            first = tr.quantize()  # the first run includes the kernels' first launches
            res["quantize_s"] = min(first, tr.quantize())
            res["quant_error"] = tr.quant_error()
        else:
            specs = specs_of(params, ctx.I, me)
            _, nbytes = W.pack_targets(me, specs, sources)
            if ctx.gpu and cfg["rx_memory"] == "alloc_gpu":  # VMM, mapped by the senders as a descriptor
                mem = await W.register_targets(engine, me, specs, sources, gpu=ctx.rank)
            else:
                buf = xp.zeros(nbytes, xp.uint8) if ctx.gpu else None
                mem = await W.register_targets(engine, me, specs, sources, buffer=buf)
        got = ctx.gather(None if mem is None else mem.targets)
        targets = [t for part in got if part for t in part]
        t0 = time.perf_counter()
        plan = W.plan(sources, targets, chunk_bytes=cfg["chunk"])
        res["plan_s"] = time.perf_counter() - t0
        report = plan.validate()
        emit(ctx, "META", res, lambda every: meta(ctx, params, report, every))
        pair = {(t.src, t.dst): 0 for t in plan.tasks}
        for t in plan.tasks:
            pair[(t.src, t.dst)] += t.nbytes
        if ctx.gpu:
            emit(ctx, "PATH ceiling", ceiling(ctx, tr, report, pair),
                 lambda every: ceiling_summary(report, [every[t] for t in trainers]))
        ai = await aiote_path(ctx, engine, plan, tr, mem)
        mine_ai = ai.pop("checksum", None)
        emit(ctx, "PATH aiote", ai, lambda every: aiote_summary(ctx, every))
        if cfg["tiny"]:  # small enough to check every byte against the trainers' shards
            emit(ctx, "CHECK reference", reference_check(ctx, tr, mem, sources), verdict)
        ctx.sync()
        emit(ctx, "PATH nccl_bcast", nccl_bcast(ctx, tr, mem), nccl_summary)
        p2p = nccl_p2p(ctx, plan, tr, mem)
        mine_p2p = p2p.pop("checksum", None)
        emit(ctx, "PATH nccl_p2p", p2p, nccl_summary)
        emit(ctx, "CHECK check", None if mem is None else mine_ai == mine_p2p, verdict)
        with anyio.CancelScope(shield=True):
            if mem is not None:
                await engine.unregister(mem.region, timeout=30)


def verdict(every: list[Any]) -> str:
    got = [x for x in every if x is not None]
    return "yes" if got and all(got) else "NO"


def reference_check(ctx: Ctx, tr: Trainer | None, mem: Any, sources: list[Any]) -> bool | None:
    """Every inference target against its pieces cut from the whole parameters (the trainers'
    shards put together): the bytes aiote's last version left there (``--tiny`` only)."""
    xp = ctx.xp
    host = (lambda a: np.asarray(a)) if xp is np else xp.asnumpy
    got = ctx.gather(None if tr is None else {k: host(v) for k, v in tr.tensors.items()})
    if tr is not None:
        return None
    full: dict[str, np.ndarray] = {}
    for src in sorted(sources, key=lambda x: x.rows[0]):
        part = got[src.rank][src.name].reshape(src.rows[1] - src.rows[0], src.width)
        full[src.name] = part if src.name not in full else np.concatenate([full[src.name], part])
    buf = host(mem.buffer)
    for t in mem.targets:
        want = b"".join(
            np.ascontiguousarray(full[p.source][p.rows[0] : p.rows[1], slice(*p.cols) if p.cols else
                                 slice(None)])
            .tobytes() for p in t.pieces)
        if buf[t.offset : t.offset + len(want)].tobytes() != want:
            return False
    return True


def ceiling(ctx: Ctx, tr: Trainer | None, report: Any, pair: dict[tuple[int, int], int]) -> dict[str, Any]:
    """The copy ceiling and the link figure, through CUDA IPC (see the module's docstring): each
    inference rank opens a second allocation of its in-bytes to the trainers, which copy every
    pair's bytes into it side by side (from their bfloat16 buffer: contents do not matter)."""
    import cupy

    rt = cupy.cuda.runtime
    reps = ctx.cfg["repeats"]
    raw = None
    handle = None
    if not ctx.trainer:
        raw = rt.malloc(max(1, report.in_bytes.get(ctx.rank - ctx.T, 0)))
        handle = rt.ipcGetMemHandle(raw)
    handles = ctx.gather(handle)
    opened: dict[int, int] = {}
    streams = []
    if tr is not None:
        for i in range(ctx.I):
            opened[i] = rt.ipcOpenMemHandle(handles[ctx.T + i])
            streams.append(cupy.cuda.Stream(non_blocking=True))

    def timed(which: list[tuple[int, int]]) -> list[float]:
        walls = []
        for _ in range(reps + 1):
            ctx.barrier()
            t0 = time.perf_counter()
            if tr is not None:
                for t, i in which:
                    n = min(pair.get((t, i), 0), int(tr.big.nbytes))
                    if t != ctx.rank or not n:
                        continue
                    at = sum(pair.get((u, i), 0) for u in range(t))  # trainers side by side
                    rt.memcpyPeerAsync(opened[i] + at, ctx.T + i, tr.big.data.ptr, ctx.rank, n,
                                       streams[i].ptr)
                for st in streams:
                    st.synchronize()
            walls.append(time.perf_counter() - t0)
        return walls[1:]

    out = {"link_one_s": timed([(0, 0)]), "link_one_bytes": pair.get((0, 0), 0),
           "ceiling_walls": timed([(t, i) for t in range(ctx.T) for i in range(ctx.I)])}
    ctx.barrier()
    for ptr in opened.values():
        rt.ipcCloseMemHandle(ptr)
    ctx.barrier()
    if raw is not None:
        rt.free(raw)
    return out


async def aiote_path(ctx: Ctx, engine: Any, plan: Any, tr: Trainer | None, mem: Any) -> dict[str, Any]:
    from aiote import weights as W

    reps = ctx.cfg["repeats"]
    walls: list[float] = []
    stats: list[Any] = []
    out: dict[str, Any] = {}
    if tr is not None:
        async with W.WeightSender(engine, plan.sender(ctx.rank), max_tmp_bytes=ctx.cfg["max_tmp"],
                                  register_sources=True) as tx:
            for v in range(1, reps + 3):
                ctx.barrier()  # v = reps + 2: the checked version (the regions poisoned first)
                t0 = time.perf_counter()
                st = await tx.push(tr.tensors, version=v, timeout=60)
                walls.append(time.perf_counter() - t0)
                by = {str(k): b for k, b in st.bytes_by_receiver.items()}
                stats.append(vars(st) | {"bytes_by_receiver": by})
                ctx.barrier()
        out["stats"] = stats[1 : reps + 1]
    else:
        rx = W.WeightReceiver(engine, plan.receiver(ctx.rank - ctx.T))
        for v in range(1, reps + 3):
            if v == reps + 2:
                mem.buffer.fill(0xAB)
                ctx.sync()
            ctx.barrier()
            t0 = time.perf_counter()
            await rx.wait_version(v, timeout=60)
            walls.append(time.perf_counter() - t0)
            ctx.barrier()
        out["checksum"] = checksum(ctx.xp, mem.buffer)
    out["walls"] = walls[1 : reps + 1]
    return out


def nccl_bcast(ctx: Ctx, tr: Trainer | None, mem: Any) -> dict[str, Any]:
    """All-gather of the trainers' payload in buckets, then broadcast of each bucket from
    trainer 0 to every inference rank, each keeping its share (a copy)."""
    torch, dist = ctx.torch, ctx.dist
    cap = ctx.cfg["bucket"]
    sizes = trainer_sizes_from(ctx, tr)
    full = torch.empty(ctx.T * cap, dtype=torch.uint8, device=ctx.dev)
    reps = ctx.cfg["repeats"]
    walls, stages = [], []
    for _ in range(reps + 1):
        st = Stages(ctx)
        ctx.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        st.mark("start")
        kept = 0
        for seg, size in enumerate(sizes):
            for off in range(0, size, cap):
                n = min(cap, size - off)
                if tr is not None:
                    mine = ctx.tt(tr.payload()[seg][off : off + n])
                    dist.all_gather_into_tensor(full[: ctx.T * n], mine, group=ctx.tgroup)
                    st.mark("all-gather")
                if ctx.rank == 0 or tr is None:
                    dist.broadcast(full[: ctx.T * n], src=0, group=ctx.bgroup)
                    st.mark("broadcast")
                if tr is None:
                    share = ctx.T * n // ctx.I
                    me = ctx.rank - ctx.T
                    dst = mem.buffer
                    at = kept % max(1, dst.size - share) if dst.size > share else 0
                    k = min(share, dst.size - at)
                    ctx.tt(dst[at : at + k]).copy_(full[me * share : me * share + k])
                    kept += k
                    st.mark("keep")
        ctx.sync()
        walls.append(time.perf_counter() - t0)
        stages.append(st.sums())
    return {"walls": walls[1:], "stages": stages[1:], "staging_bytes": ctx.T * cap}


def trainer_sizes_from(ctx: Ctx, tr: Trainer | None) -> list[int]:
    """The payload segments' sizes, the same on every rank (from trainer 0)."""
    sizes = [int(p.nbytes) for p in tr.payload()] if tr is not None else None
    got: list[Any] = ctx.gather(sizes)
    return [int(x) for x in got[0]]


def nccl_p2p(ctx: Ctx, plan: Any, tr: Trainer | None, mem: Any) -> dict[str, Any]:
    """The plan executed with NCCL's batch_isend_irecv, in batches of ``bucket`` bytes per
    trainer; then once more into poisoned regions, for the checksum."""
    dist, xp = ctx.dist, ctx.xp
    cap = ctx.cfg["bucket"]
    parts = [plan.sender(t) for t in range(ctx.T)]
    batches: list[list[list[Any]]] = []  # per trainer, its writes cut into batches
    for sp in parts:
        cut: list[list[Any]] = [[]]
        size = 0
        for w in sp.writes:
            if cut[-1] and size + w.nbytes > cap:
                cut.append([])
                size = 0
            cut[-1].append(w)
            size += w.nbytes
        batches.append(cut)
    nb = max(len(b) for b in batches)
    pack = None
    views: dict[str, Any] = {}
    widths: dict[str, int] = {}
    peak = 0
    if tr is not None:
        sp = parts[ctx.rank]
        for s in sp.sources:
            a = tr.tensors[s.name]
            widths[s.name] = s.width
            views[s.name] = a.reshape(s.local_shape[0], s.width)
        biggest = max((w.nbytes for w in sp.writes), default=1)
        most = max((len(b) for b in batches[ctx.rank]), default=1)
        pack = xp.empty(cap + biggest + 256 * (most + 1), xp.uint8)  # each packed write 256-byte aligned
    reps = ctx.cfg["repeats"]
    walls, stages = [], []
    out: dict[str, Any] = {}
    for rep in range(reps + 2):
        if rep == reps + 1 and mem is not None:
            mem.buffer.fill(0xAB)
        st = Stages(ctx)
        ctx.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        st.mark("start")
        for k in range(nb):
            ops = []
            if tr is not None:
                assert pack is not None
                at = 0
                for w in batches[ctx.rank][k] if k < len(batches[ctx.rank]) else []:
                    v = views[w.source]
                    if w.col0 == 0 and w.col1 == widths[w.source]:
                        src = v[w.row0 : w.row1].reshape(-1).view(xp.uint8)
                    else:
                        src = pack[at : at + w.nbytes]
                        src.view(v.dtype).reshape(w.row1 - w.row0, w.col1 - w.col0)[...] = v[
                            w.row0 : w.row1, w.col0 : w.col1]
                        at = -(-(at + w.nbytes) // 256) * 256
                    ops.append(dist.P2POp(dist.isend, ctx.tt(src), ctx.T + w.dst))
                peak = max(peak, at)
                st.mark("pack")
            else:
                me = ctx.rank - ctx.T
                for t in range(ctx.T):
                    for w in batches[t][k] if k < len(batches[t]) else []:
                        if w.dst == me:
                            dst = mem.buffer[w.offset : w.offset + w.nbytes]
                            ops.append(dist.P2POp(dist.irecv, ctx.tt(dst), t))
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            st.mark("send/recv")
        ctx.sync()
        walls.append(time.perf_counter() - t0)
        stages.append(st.sums())
    if mem is not None:
        out["checksum"] = checksum(xp, mem.buffer)
    out.update(walls=walls[1 : reps + 1], stages=stages[1 : reps + 1], staging_bytes=peak)
    return out


def _median_of_max(per_rank: list[list[float]]) -> tuple[float, list[float]]:
    """Each repeat's slowest rank, then the median of those (and the list)."""
    worst = [max(r[i] for r in per_rank) for i in range(len(per_rank[0]))]
    return float(statistics.median_low(worst)), worst


def meta(ctx: Ctx, params: list[Param], report: Any, every: list[dict[str, Any]]) -> dict[str, Any]:
    trainers = every[: ctx.T]
    return {
        "cfg": ctx.cfg, "machine": machine(ctx), "total_bytes": report.total_bytes, "tasks": report.tasks,
        "params": sum(int(np.prod(q.shape)) for q in params),
        "out": {str(k): v for k, v in sorted(report.out_bytes.items())},
        "in": {str(k): v for k, v in sorted(report.in_bytes.items())},
        "plan_s": every[0]["plan_s"], "quantize_s": [r["quantize_s"] for r in trainers],
        "quant_error": max(r["quant_error"] for r in trainers), "backend": "NCCL" if ctx.gpu else "gloo",
    }


def ceiling_summary(report: Any, trainers: list[dict[str, Any]]) -> dict[str, Any]:
    one = float(statistics.median(trainers[0]["link_one_s"]))
    link = trainers[0]["link_one_bytes"] / one / GB
    most = max(max(report.out_bytes.values()), max(report.in_bytes.values()))
    w, walls = _median_of_max([r["ceiling_walls"] for r in trainers])
    return {"wall_s": w, "walls": walls, "link_gbps": link, "bound_s": most / (link * GB),
            "per_trainer_s": [statistics.median(r["ceiling_walls"]) for r in trainers]}


def aiote_summary(ctx: Ctx, every: list[dict[str, Any]]) -> dict[str, Any]:
    w, walls = _median_of_max([r["walls"] for r in every])
    k = walls.index(w)
    return {"wall_s": w, "walls": walls, "stats": [r["stats"][k] for r in every[: ctx.T]],
            "recv_s": [statistics.median(r["walls"]) for r in every[ctx.T :]]}


def nccl_summary(every: list[dict[str, Any]]) -> dict[str, Any]:
    w, walls = _median_of_max([r["walls"] for r in every])
    k = walls.index(w)
    return {"wall_s": w, "walls": walls, "stages": [r["stages"][k] for r in every],
            "staging_bytes": max(r["staging_bytes"] for r in every)}


def machine(ctx: Ctx) -> str:
    if not ctx.gpu:
        return f"{os.cpu_count()} cores, CPU"
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return f"{ctx.world} x {name}, {os.cpu_count()} cores"


def child(rank: int, cfg: dict[str, Any]) -> None:
    import anyio

    ctx = Ctx(rank, cfg)
    try:
        anyio.run(rank_main, ctx)
    finally:
        with contextlib.suppress(Exception):
            ctx.dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", type=int, required=True)
    ap.add_argument("cfg")
    a = ap.parse_args()
    child(a.child, json.loads(a.cfg))
