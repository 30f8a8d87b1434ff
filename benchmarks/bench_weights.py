"""RL weight-update benchmark (aiote.weights), same-run baselines.

    python benchmarks/bench_weights.py                 # CPU: 2 GB model, tcp and shm routes, gloo
    python benchmarks/bench_weights.py --size 0.5      # a quick run
    python benchmarks/bench_weights.py --kimi-only     # only the 1T-parameter plan (computed, not run)
    python benchmarks/bench_weights.py --gpu           # 2 GPUs of one host (see below)
    python benchmarks/bench_weights.py --gpu --trainers 2 --inference 2   # 4 GPUs: DeepSeek-V3 shapes
    python benchmarks/bench_weights.py --trainers 2 --inference 2 --tiny --layers 2   # its CPU check

CPU: 2 trainer + 2 inference worker processes on this host. A synthetic model with
Llama-3-8B's layer shapes (hidden 4096, 32 q / 8 kv heads of 128, MLP 14336), as many layers as
``--size`` GB of bf16 takes. Trainers hold FSDP dim-0 halves of every parameter; each inference
rank holds a tensor-parallel half (TP 2) with q/k/v fused into qkv and gate/up into gate_up,
o_proj and down_proj row-parallel (a column slice: staged and gathered by the sender), in
bf16. Lines, all measured in this run:
- aiote: ``WeightSender.push`` on both trainers at once until both inference ranks'
  ``wait_version`` returned (the median of ``--repeats`` versions after one warm-up), per route
  (tcp loopback; the default same-host route, shm with the receivers' host arenas);
- gloo: what the open frameworks do, torch.distributed over the same 4 processes' worth of
  ranks: all_gather of the trainers' shards, then rank 0 broadcasts the whole model to every
  inference rank in 256 MiB buckets, each keeping its half (a copy);
- bound: ``max(max_s out(s), max_r in(r)) / B`` from the plan, B the C core's write
  throughput between two processes on the same provider (``aiote bench write``), same run;
  beside it what the host moves with the push's 4 (trainer, receiver) flows at once: 4 pairs
  of C-core processes whose timed parts start at one instant (``aiote_cbench --start-at``),
  all their bytes over the longest one's time. Where that is below 4 x B the ranks share the
  host's cores and the bound cannot be reached (the most reachable fraction is printed). And 2
  such pairs: as many sending (and receiving) processes as the push has, each sender moving
  its whole share to one receiver: the C core's pace with the push's processes; and those 4
  processes in the push's own pattern, each sender writing to both receivers at once, dealt
  in turn (``aiote_cbench fan``);
- aiote's own flows, from the push's workers before the push (16 MiB writes): one flow alone,
  the push's 4 flows at once, and the same processes as 2 pairs (each trainer to one
  receiver, as the C core's pairs): what one engine writing to two peers costs against pairs.
``--link-mib`` sets the bytes per run of the C core's figures (B: the median of 5 runs).

GPU (``--gpu``, 2 GPUs): one trainer process on GPU 0 pushes the whole model into one
inference process on GPU 1 over the CUDA-IPC rail, beside ``cudaMemcpyPeerAsync`` of the same
bytes (1, 2 and 4 concurrent copies: the ceiling) and NCCL broadcast, each with the source
freshly written by the GPU and warm; see ``benchmarks/weights_gpu.py``.
Baselines whose library is missing are skipped with a line saying so.

Trainer GPUs -> inference GPUs (``--gpu --trainers N --inference M``, N + M GPUs): DeepSeek-V3's
MoE layer shapes, as many layers as fit in 60% of a trainer's memory (``--layers``), trainers
holding bfloat16 dim-0 shards and quantizing them to FP8 with 128 x 128 block scales, the
inference GPUs one tensor-parallel replica (fused qkv_a and gate_up, FP8 with scales); aiote's
plan against NCCL all-gather + broadcast, the same plan over NCCL ``batch_isend_irecv`` and
concurrent ``cudaMemcpyPeerAsync`` of every pair's bytes (the ceiling). See
``benchmarks/weights_multi.py``; without ``--gpu`` the same code runs on the CPU (NumPy, gloo,
the same-host route; no ceiling), for checking it.

Kimi-K2 plan (printed unless ``--no-kimi`` or ``--trainers``): 1T parameters, 256 trainer ranks -> 128
inference ranks, computed and validated (not run), with its planning time and the bound at
50 GB/s per rank, beside the 1.3 s Perplexity reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
from weights_multi import free_port  # (a sibling script: benchmarks/ is on the path)

import aiote
from aiote import weights as W
from aiote._spawn import child_env, python_module
from aiote.weights._worker import Worker, spawn_worker

GB = 1e9
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 4096, 32, 8, 128, 14336


# ------------------------------------------------------------------ models


def llama_layer_params(layer: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"layers.{layer}."
    return [
        (p + "q_proj", (HEADS * HEAD_DIM, HIDDEN)),
        (p + "k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
        (p + "v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
        (p + "o_proj", (HIDDEN, HEADS * HEAD_DIM)),
        (p + "gate_proj", (MLP, HIDDEN)),
        (p + "up_proj", (MLP, HIDDEN)),
        (p + "down_proj", (HIDDEN, MLP)),
        (p + "input_layernorm", (HIDDEN,)),
        (p + "post_attention_layernorm", (HIDDEN,)),
    ]


def llama_model(
    size_gb: float, trainers: int, receivers: int, row_blocks: bool = False
) -> tuple[list[W.SourceShard], list[list[Any]]]:
    """Sources (FSDP dim-0 over ``trainers``) and per inference rank its target specs (TP).
    ``row_blocks``: the row-parallel layers (o_proj, down_proj) cut by rows, as the others,
    instead of by columns: the same bytes per rank, none of them sliced (each trainer's rows of
    those layers then go to one receiver: another pattern, not only no staging)."""
    per_layer = sum(int(np.prod(s)) for _, s in llama_layer_params(0)) * 2
    layers = max(1, round(size_gb * GB / per_layer))
    sources: list[W.SourceShard] = []
    specs: list[list[Any]] = [[] for _ in range(receivers)]
    for layer in range(layers):
        params = dict(llama_layer_params(layer))
        for name, shape in params.items():
            for t in range(trainers):
                sources.append(W.SourceShard(name, shape, "bfloat16", t, W.split_rows(shape[0], trainers, t)))
        p = f"layers.{layer}."
        for r in range(receivers):
            qkv = [(p + n, params[p + n][0]) for n in ("q_proj", "k_proj", "v_proj")]
            gu = [(p + n, MLP) for n in ("gate_proj", "up_proj")]
            specs[r] += [
                (p + "qkv_proj", "bfloat16", W.fused_tp(qkv, r, receivers)),
                (
                    p + "o_proj",
                    "bfloat16",
                    [W.Piece(p + "o_proj", W.split_rows(HIDDEN, receivers, r))] if row_blocks else
                    [W.Piece(p + "o_proj", (0, HIDDEN), W.split_rows(HIDDEN, receivers, r))],
                ),
                (p + "gate_up_proj", "bfloat16", W.fused_tp(gu, r, receivers)),
                (
                    p + "down_proj",
                    "bfloat16",
                    [W.Piece(p + "down_proj", W.split_rows(HIDDEN, receivers, r))] if row_blocks else
                    [W.Piece(p + "down_proj", (0, HIDDEN), W.split_rows(MLP, receivers, r))],
                ),
                (p + "input_layernorm", "bfloat16", [W.Piece(p + "input_layernorm", (0, HIDDEN))]),
                (
                    p + "post_attention_layernorm",
                    "bfloat16",
                    [W.Piece(p + "post_attention_layernorm", (0, HIDDEN))],
                ),
            ]
    return sources, specs


def _kimi_params() -> tuple[list[tuple[str, tuple[int, ...], str]], list[tuple[str, tuple[int, ...]]]]:
    """Kimi-K2's parameters: (dense ones with their inference kind: rows / cols / rep), experts."""
    h, inter, moe_inter, experts, vocab = 7168, 18432, 2048, 384, 163840
    heads, qk, v_dim, q_lora, kv_lora, rope = 64, 192, 128, 1536, 512, 64
    dense: list[tuple[str, tuple[int, ...], str]] = [  # name, shape, inference kind
        ("embed_tokens", (vocab, h), "rows"),
        ("lm_head", (vocab, h), "rows"),
        ("norm", (h,), "rep"),
    ]
    moe: list[tuple[str, tuple[int, ...]]] = []
    for layer in range(61):
        p = f"layers.{layer}."
        dense += [
            (p + "q_a_proj", (q_lora, h), "rep"),
            (p + "q_a_layernorm", (q_lora,), "rep"),
            (p + "q_b_proj", (heads * qk, q_lora), "rows"),
            (p + "kv_a_proj_with_mqa", (kv_lora + rope, h), "rep"),
            (p + "kv_a_layernorm", (kv_lora,), "rep"),
            (p + "kv_b_proj", (heads * (qk - rope + v_dim), kv_lora), "rows"),
            (p + "o_proj", (h, heads * v_dim), "cols"),
            (p + "input_layernorm", (h,), "rep"),
            (p + "post_attention_layernorm", (h,), "rep"),
        ]
        if layer == 0:
            dense += [
                (p + "mlp.gate_proj", (inter, h), "rows"),
                (p + "mlp.up_proj", (inter, h), "rows"),
                (p + "mlp.down_proj", (h, inter), "cols"),
            ]
        else:
            dense += [
                (p + "mlp.gate", (experts, h), "rep"),
                (p + "shared.gate_proj", (moe_inter, h), "rows"),
                (p + "shared.up_proj", (moe_inter, h), "rows"),
                (p + "shared.down_proj", (h, moe_inter), "cols"),
            ]
            moe += [
                (p + "experts.w1", (experts, moe_inter, h)),
                (p + "experts.w3", (experts, moe_inter, h)),
                (p + "experts.w2", (experts, h, moe_inter)),
            ]
    return dense, moe


def kimi_k2(
    trainers: int = 256,
    replicas: int = 8,
    tp: int = 16,
    fp8: str = "float8_e4m3",
    expert_shards: bool = False,
) -> tuple[list[W.SourceShard], list[W.TargetShard]]:
    """Kimi-K2's shapes (DeepSeek-V3 architecture: 61 layers, the first dense, MLA attention,
    384 routed experts of 2048 stacked per layer, 1 shared expert, vocab 163840), bf16.

    Trainers, as in Perplexity's system: parameters are grouped into disjoint mesh groups and
    every rank of a group can produce a whole parameter of it (``full_tensor()``), so each
    parameter has the ranks of its group as holders, the planner picking the least-loaded:
    the 180 expert tensors [384, ...] (w1, w3, w2 of 60 layers) are dealt round robin to 16 MoE
    mesh groups of 16 ranks; the dense and attention parameters to the 8-rank node group ``f(name) % 32`` (a
    fixed hash of the name). ``expert_shards=True`` instead shards every expert tensor by
    expert over 128 ranks, replicated twice (2 holders per expert, 8 writes per inference
    rank and tensor). Inference:
    ``replicas`` replicas of ``tp`` ranks (8 x 16 = 128 GPUs), experts split 24 per rank (EP
    16), attention and dense MLP tensor-parallel (column- or row-parallel as in vLLM), latent
    projections, norms and the router replicated, embeddings vocab-parallel; linear weights
    cast to ``fp8`` (FP8 e4m3, by the sender; "bfloat16" for none), norms, router and
    embeddings kept in bf16."""
    dense, moe = _kimi_params()
    experts = 384
    sources: list[W.SourceShard] = []
    ep = trainers // 2
    for n, (name, shape) in enumerate(moe):
        if expert_shards:
            for t in range(trainers):
                sources.append(W.SourceShard(name, shape, "bfloat16", t, W.split_rows(experts, ep, t % ep)))
        else:
            g = n % (trainers // 16)  # the 180 expert tensors dealt round robin
            sources += [W.SourceShard(name, shape, "bfloat16", g * 16 + i, (0, experts)) for i in range(16)]
    groups = trainers // 8
    for name, shape, _ in dense:
        g = (sum(name.encode()) * 2654435761) % groups
        sources += [W.SourceShard(name, shape, "bfloat16", g * 8 + i, (0, shape[0])) for i in range(8)]
    targets: list[W.TargetShard] = []
    for rep in range(replicas):
        for k in range(tp):
            rank = rep * tp + k
            off = 0
            for name, _ in moe:
                targets.append(
                    W.TargetShard(name, rank, fp8, (W.Piece(name, W.split_rows(experts, tp, k)),), b"", off)
                )
                off += 1  # offsets only need to be distinct per target here (no region)
            for name, shape, kind in dense:
                if kind == "rows":
                    piece = W.Piece(name, W.split_rows(shape[0], tp, k))
                elif kind == "cols":
                    piece = W.Piece(name, (0, shape[0]), W.split_rows(int(np.prod(shape[1:])), tp, k))
                else:
                    piece = W.Piece(name, (0, shape[0]))
                quantized = (
                    len(shape) > 1 and name not in ("embed_tokens", "lm_head") and not name.endswith(".gate")
                )
                dtype = fp8 if quantized else "bfloat16"
                targets.append(W.TargetShard(name, rank, dtype, (piece,), b"", off))
                off += 1
    return sources, targets


def kimi_plan_report(fp8: str = "float8_e4m3", expert_shards: bool = False) -> dict[str, Any]:
    sources, targets = kimi_k2(fp8=fp8, expert_shards=expert_shards)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = W.plan(sources, targets, chunk_bytes=1 << 30)
    plan_s, plan_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    rep = plan.validate(link_bytes_per_s=50 * GB)
    validate_s = time.perf_counter() - t0
    params = sum(int(np.prod(s.shape)) for s in {s.name: s for s in sources}.values())
    return {
        "params": params,
        "tasks": rep.tasks,
        "plan_s": plan_s,
        "plan_cpu_s": plan_cpu_s,
        "validate_s": validate_s,
        "total_gb": rep.total_bytes / GB,
        "max_out_gb": max(rep.out_bytes.values()) / GB,
        "min_out_gb": min(rep.out_bytes.values()) / GB,
        "max_in_gb": max(rep.in_bytes.values()) / GB,
        "bound_s": rep.bound_s,
    }


# ------------------------------------------------------------------ link figure (C core, same run)


def c_core_link(providers: Sequence[str], total: int = 2 << 30, repeats: int = 5) -> dict[str, float]:
    """GB/s of 16 MiB writes between two processes, C core alone and aiote (``aiote bench
    write``, ``repeats`` runs of ``total`` bytes each, taking turns), per provider: ``<provider>``
    the C core's median, ``<provider>_aiote`` aiote's. On shm into the receiver's host arena
    (``--arena``), the memory the push's receivers hold on the default route, copied by as
    many threads as aiote's engines use (``copy_threads``)."""
    res: dict[str, float] = {}
    for prov in providers:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "b.json")
            cmd = [
                *python_module("aiote"),  # the aiote this script imported, wherever it runs from
                "bench", "write", "--sizes", "16MiB", "--provider", prov,
                "--repeats", str(repeats), "--total", str(total), "--json", out,
                *(["--arena"] if prov == "shm" else []),
            ]
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(),
                           timeout=600, check=True)
            with open(out) as f:
                rows = json.load(f)["rows"]
        res[prov] = statistics.median_low([float(r["c_gbps"]) for r in rows])
        res[prov + "_aiote"] = statistics.median_low([float(r["py_gbps"]) for r in rows])
    return res


def c_core_together(
    provider: str, pairs: int = 4, total: int = 1 << 30, fan: bool = False
) -> dict[str, float]:
    """What ``pairs`` pairs of C-core processes move at once on ``provider``: each pair the C
    bench's 16 MiB writes, 8 in flight, with aiote's default connections and pollers (as
    ``aiote bench write`` runs it; on shm into a host arena, as :func:`c_core_link`), every
    pair's timed part started at one instant after its warm-up (``aiote_cbench --start-at``).
    ``gbps``: all pairs' bytes over the longest receive time (from that instant to its last
    byte landed); ``late_ms``: the latest start past the instant (a pair still warming up
    then starts late, and the figure is low). ``fan``: the push's pattern instead, ``pairs``
    senders each writing ``total`` bytes to ``pairs`` receivers at once, dealt in turn
    (``aiote_cbench fan``), the median of 3 runs."""
    from aiote.cli._benchnet import build_cbench, c_provider_args, cbench
    from aiote.cli.bench import c_args, settings

    why = build_cbench()
    if why:
        raise RuntimeError(f"no C bench: {why}")
    ns = settings(arena=provider == "shm", total=total, streams=aiote.default_streams(provider))
    args = [str(cbench()), *c_args(ns, ("write", 16 << 20, 8)), *c_provider_args(provider, None)]
    if fan:  # the median of 3 runs: one run's figure moves by a quarter
        args[1] = "fan"
        cmd = [*args, "--senders", str(pairs), "--receivers", str(pairs)]
        run = {"capture_output": True, "text": True, "env": child_env(), "timeout": 600, "check": True}
        outs = [subprocess.run(cmd, **run).stdout for _ in range(3)]
        gbps = statistics.median(float(json.loads(o.strip().splitlines()[-1])["gbps"]) for o in outs)
        return {"gbps": gbps, "late_ms": 0.0, "pair_gbps": gbps / pairs}
    at = time.time_ns() + 3_000_000_000  # every pair connected and warmed up by then
    procs = [subprocess.Popen([*args, "--start-at", str(at)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=child_env()) for _ in range(pairs)]
    runs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError("aiote_cbench write --start-at failed")
        runs.append(json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]))
    late = max(float(r["start_late_us"]) for r in runs) / 1e3
    wall = max(float(r["recv_seconds"]) + float(r["start_late_us"]) / 1e6 for r in runs)
    return {"gbps": sum(float(r["total_bytes"]) for r in runs) / wall / GB, "late_ms": late,
            "pair_gbps": statistics.median_low([float(r["recv_gbps"]) for r in runs])}


# ------------------------------------------------------------------ aiote


def thread_cpu(pids: Sequence[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU seconds (user + system) of every thread of ``pids`` so far, with its name
    (``aiote-poll<i>`` the engine's pollers, ``aiote-copy`` its copy helper, the rest Python's
    or libfabric's), keyed by (pid, tid)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except FileNotFoundError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(pid, int(tid))] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_by_name(before: dict[tuple[int, int], tuple[str, float]],
                after: dict[tuple[int, int], tuple[str, float]], pid: int) -> dict[str, tuple[int, float]]:
    """Per thread name of process ``pid``: (threads that ran, CPU seconds) between two
    :func:`thread_cpu` snapshots."""
    res: dict[str, tuple[int, float]] = {}
    for (p, tid), (name, cpu) in after.items():
        if p != pid:
            continue
        d = cpu - before.get((p, tid), (name, 0.0))[1]
        if d > 0:
            n, c = res.get(name, (0, 0.0))
            res[name] = (n + 1, c + d)
    return res


async def aiote_run(
    route: str,
    sources: list[W.SourceShard],
    specs: list[list[Any]],
    repeats: int,
    max_tmp: int,
    chunk: int = 16 << 20,
    engine_opts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    n_s = len({s.rank for s in sources})
    workers: list[Worker] = []
    try:
        async with anyio.create_task_group() as tg:

            async def one() -> None:
                workers.append(await spawn_worker("asyncio", route, engine_opts=engine_opts))

            for _ in range(n_s + len(specs)):
                tg.start_soon(one)
        senders, receivers = workers[:n_s], workers[n_s:]
        targets: list[W.TargetShard] = []
        smallest = 1 << 30  # per flow: a round of 256 MiB is mostly its ramp and tail on tcp
        for r, (w, sp) in enumerate(zip(receivers, specs, strict=True)):
            tg_, nbytes = W.pack_targets(r, sp, sources)
            smallest = min(smallest, nbytes)
            desc = (await w.call(op="alloc", nbytes=nbytes, arena=route == "default"))["desc"]
            targets += W.with_desc(tg_, bytes.fromhex(desc))
        t0 = time.perf_counter()
        plan = W.plan(sources, targets, chunk_bytes=chunk)
        plan_s = time.perf_counter() - t0
        report = plan.validate()
        for s, w in enumerate(senders):
            await w.call(
                op="sender", plan=plan.sender(s).to_json(), max_tmp_bytes=max_tmp, register_sources=True
            )
        for r, w in enumerate(receivers):
            await w.call(op="receiver", plan=plan.receiver(r).to_json())
        links = await route_links(senders, sorted({t.desc.hex() for t in targets}), repeats, smallest)
        walls: list[float] = []
        stats: list[list[dict[str, Any]]] = []
        pids = [w.pid for w in workers]
        cpu: dict[int, dict[str, tuple[int, float]]] = {p: {} for p in pids}
        for v in range(1, repeats + 2):
            for w in senders:
                await w.call(reply_timeout=300, op="prepare", version=v, fill="fast")
            snap = thread_cpu(pids)
            t = time.perf_counter()
            for w in senders:
                await w.send(op="push", version=v, prepared=True, timeout=300)
            for w in receivers:
                await w.call(reply_timeout=300, op="wait", version=v, timeout=300)
            wall = time.perf_counter() - t
            got = [(await w.reply(300))["stats"] for w in senders]
            if v > 1:  # the first version is the warm-up (connections, first touch)
                walls.append(wall)
                stats.append(got)
                now = thread_cpu(pids)
                for p in pids:
                    for name, (n, c) in cpu_by_name(snap, now, p).items():
                        n0, c0 = cpu[p].get(name, (0, 0.0))
                        cpu[p][name] = (max(n, n0), c0 + c)
        k = walls.index(statistics.median_low(walls))
        return {
            "wall_s": walls[k], "walls": walls, "stats": stats[k], "report": report, "plan_s": plan_s,
            "cpu": [cpu[p] for p in pids], "n_senders": n_s, **links
        }
    finally:
        with anyio.CancelScope(shield=True):
            for w in workers:
                await w.aclose()


async def route_links(
    senders: list[Worker], descs: list[str], repeats: int, n: int = 1 << 30
) -> dict[str, float]:
    """This route's own figures, from the push's workers, before the push (aiote writes of
    16 MiB, 8 in flight per flow, into the receivers' regions): ``route_gbps`` one flow alone
    (trainer 0 -> the first receiver), ``route_all_gbps`` every (trainer, receiver) flow at
    once, each trainer writing its own part of every region (as the push, and the C core's
    ``fan``: trainers writing the same bytes of a same-host arena at once would fight over
    its cache lines), all bytes over the wall from their common start to the last one's end;
    ``route_pairs_gbps`` the same processes as pairs (trainer i -> receiver i only), as the C
    core's pairs run."""
    alone = await senders[0].call(
        reply_timeout=300, op="rail", descs=descs[:1], nbytes=n, chunk=16 << 20, repeats=repeats
    )
    at = time.time() + 3.0  # every sender starts then, its buffer registered
    part = n // len(senders)  # each trainer writes n bytes in all: its part of every region
    for i, w in enumerate(senders):
        await w.send(op="rail", descs=descs, nbytes=part, dst=i * part, chunk=16 << 20, repeats=repeats,
                     at=at)
    wall = max([(await w.reply(300))["end"] for w in senders]) - at
    flows = len(senders) * len(descs)
    # the same processes as pairs: each trainer writes to one receiver (as the C core's pairs)
    at = time.time() + 3.0
    for i, w in enumerate(senders):
        d = descs[i % len(descs)]
        await w.send(op="rail", descs=[d], nbytes=n, chunk=16 << 20, repeats=repeats, at=at)
    pairs_wall = max([(await w.reply(300))["end"] for w in senders]) - at
    return {
        "route_gbps": n / statistics.median_low(alone["walls"]) / GB,
        "route_all_gbps": flows * part * (repeats + 1) / wall / GB,
        "route_pairs_gbps": len(senders) * n * (repeats + 1) / pairs_wall / GB,
        "flows": flows,
    }


# ------------------------------------------------------------------ gloo (what open frameworks do)


def gloo_rank(rank: int, world: int, trainers: int, shard_bytes: int, port: int, repeats: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tgroup = dist.new_group(list(range(trainers)))
    bgroup = dist.new_group([0, *range(trainers, world)])
    total = shard_bytes * trainers
    bucket = 256 << 20
    receivers = world - trainers
    keep = total // receivers
    mine = torch.full((shard_bytes,), rank % 100, dtype=torch.uint8) if rank < trainers else None
    full = torch.empty(total, dtype=torch.uint8) if rank < trainers else None  # inference: one bucket
    buf = torch.empty(bucket, dtype=torch.uint8) if rank >= trainers else None
    kept = torch.empty(keep, dtype=torch.uint8) if rank >= trainers else None
    lo = (rank - trainers) * keep
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        if full is not None:
            assert mine is not None
            dist.all_gather_into_tensor(full, mine, group=tgroup)
        if rank == 0 or rank >= trainers:
            for off in range(0, total, bucket):
                n = min(bucket, total - off)
                if full is not None:
                    dist.broadcast(full[off : off + n], src=0, group=bgroup)
                else:  # each inference rank keeps its part of the bucket (a copy)
                    assert buf is not None and kept is not None
                    dist.broadcast(buf[:n], src=0, group=bgroup)
                    a, b = max(off, lo), min(off + n, lo + keep)
                    if a < b:
                        kept[a - lo : b - lo].copy_(buf[a - off : b - off])
        dist.barrier()
        times.append(time.perf_counter() - t)
    if rank == 0:
        print("GLOO " + json.dumps({"walls": times[1:]}), flush=True)
    dist.destroy_process_group()


def gloo_run(trainers: int, receivers: int, shard_bytes: int, repeats: int) -> dict[str, Any] | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("gloo baseline skipped: torch is not installed (pip install torch==2.13.0, the CPU wheel)")
        return None
    port = free_port()
    world = trainers + receivers
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--gloo-rank",
                str(r),
                "--gloo-world",
                str(world),
                "--gloo-trainers",
                str(trainers),
                "--gloo-shard",
                str(shard_bytes),
                "--gloo-port",
                str(port),
                "--repeats",
                str(repeats),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = procs[0].communicate(timeout=1200)[0]
    for p in procs[1:]:
        p.wait(timeout=120)
    for line in out.splitlines():
        if line.startswith("GLOO "):
            walls = json.loads(line[5:])["walls"]
            return {"wall_s": statistics.median_low(walls), "walls": walls}
    print("gloo baseline failed: no result")
    return None


# ------------------------------------------------------------------ GPU


async def gpu_run(size_gb: float, repeats: int, ipc_streams: list[int], memories: tuple[str, ...]) -> None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 2:
            raise RuntimeError("fewer than 2 GPUs")
    except Exception as exc:  # no CuPy, no CUDA, one GPU
        print(f"--gpu skipped: {exc}")
        return
    import weights_gpu

    sources, specs = llama_model(size_gb, 1, 1)
    await weights_gpu.run(sources, specs, repeats, ipc_streams, memories)


# ------------------------------------------------------------------ main


def _print_aiote(route: str, r: dict[str, Any], link: float, host_gbps: float, gloo_s: float | None,
                 two_gbps: float, fan_gbps: float) -> None:
    rep = r["report"]
    bound = max(max(rep.out_bytes.values()), max(rep.in_bytes.values())) / (link * GB)
    wall = r["wall_s"]
    print(
        f"\naiote push, route {route}: wall {wall:.3f} s (median of {len(r['walls'])}: "
        + ", ".join(f"{x:.3f}" for x in r["walls"])
        + f"), {rep.total_bytes / wall / GB:.2f} GB/s in all"
    )
    print(
        f"  bound at the C core's {link:.2f} GB/s per rank: {bound:.3f} s -> "
        f"fraction of bound {bound / wall:.2f}"
    )
    own = max(max(rep.out_bytes.values()), max(rep.in_bytes.values())) / (r["route_gbps"] * GB)
    print(
        f"  this route's own link (aiote, one flow alone, same workers) {r['route_gbps']:.2f} GB/s: "
        f"bound {own:.3f} s -> fraction {own / wall:.2f}"
    )
    host = rep.total_bytes / (r["route_all_gbps"] * GB)  # every flow shares this host's cores
    print(
        f"  the push's {r['flows']} flows at once on this route move {r['route_all_gbps']:.2f} GB/s in all "
        f"(the C core's 4 pairs started together: {host_gbps:.2f}): "
        f"total / that = {host:.3f} s -> fraction {host / wall:.2f}"
        + (f"; so at most {bound / host:.2f} of the C core's bound (and {own / host:.2f} of this route's) "
           "is reachable here" if host > bound else "")
    )
    two = rep.total_bytes / (two_gbps * GB)  # the C core with the push's 2 sending processes
    print(
        f"  the C core's 2 pairs (as many sending processes as the push) move {two_gbps:.2f} GB/s in all: "
        f"total / that = {two:.3f} s, {bound / two:.2f} of the bound; the push runs at {two / wall:.2f} "
        "of their pace"
    )
    fan = rep.total_bytes / (fan_gbps * GB)  # the C core in the push's own pattern
    print(
        f"  the C core in the push's pattern moves {fan_gbps:.2f} GB/s in all: total / that = {fan:.3f} s, "
        f"{bound / fan:.2f} of the bound; the push runs at {fan / wall:.2f} of its pace"
    )
    pairs = r["route_pairs_gbps"]
    print(
        f"  aiote's {r['n_senders']} pairs (the same processes, each trainer writing to one receiver) "
        f"move {pairs:.2f} GB/s in all, {pairs / two_gbps:.2f} of the C core's pairs; "
        f"each trainer writing to every receiver: {r['route_all_gbps'] / pairs:.2f} of that"
    )
    if gloo_s:
        print(f"  vs gloo all_gather + broadcast {gloo_s:.3f} s: {gloo_s / wall:.2f}x faster")
    print(
        f"  plan: {r['plan_s'] * 1e3:.1f} ms, {rep.tasks} writes; "
        + str(rep).split("\n", 1)[1].replace("\n", "\n  ")
    )
    pushes = sum(r["walls"])
    for i, by_name in enumerate(r["cpu"]):
        who = f"trainer {i}" if i < r["n_senders"] else f"inference {i - r['n_senders']}"
        busy = sum(c for _, c in by_name.values()) / pushes
        print(
            f"  {who}: {busy:.2f} cores busy over the pushes ("
            + ", ".join(f"{name} x{n} {c / pushes:.2f}" for name, (n, c) in
                        sorted(by_name.items(), key=lambda kv: -kv[1][1]))
            + ")"
        )
    for i, s in enumerate(r["stats"]):
        print(
            f"  trainer {i}: push {s['wall_s']:.3f} s, staging wait {s['staging_wait_s']:.3f} s, "
            f"transform {s['transform_s']:.3f} s, writes {s['write_s']:.3f} s summed ({s['writes']}), "
            f"notify {s['notify_s'] * 1e3:.1f} ms, direct {s['direct_bytes'] / GB:.2f} GB "
            f"(strided {s['strided_bytes'] / GB:.2f} GB), "
            f"peak staging {s['peak_staging_bytes'] / 2**20:.0f} MiB"
        )


async def main(a: argparse.Namespace) -> None:
    cores = os.cpu_count()
    print(f"bench_weights: {cores} cores; load {os.getloadavg()[0]:.2f} (other agents share this machine)")
    if a.trainers or a.inference:
        import weights_multi

        a.trainers, a.inference = a.trainers or 2, a.inference or 2
        a.chunk_mib = a.chunk_mib or 256
        a.max_tmp_mib = a.max_tmp_mib or 4096
        await anyio.to_thread.run_sync(weights_multi.run, a)
        return
    a.chunk_mib = a.chunk_mib or 16
    a.max_tmp_mib = a.max_tmp_mib or 256
    if not a.kimi_only and not a.gpu:
        routes = a.routes.split(",")
        providers = ["tcp" if r == "tcp" else "shm" for r in routes]
        link_total = a.link_mib << 20
        link = c_core_link(providers, link_total)
        print(
            "link, 16 MiB writes between two processes (C core / aiote; shm: into a host arena): "
            + ", ".join(f"{p} {link[p]:.2f} / {link[p + '_aiote']:.2f} GB/s" for p in providers)
        )
        together = min(link_total, 1 << 30)
        shared = {p: c_core_together(p, total=together) for p in providers}  # the push's 4 flows at once
        print(
            "the C core, 4 pairs of processes started together (median pair / all 4 at once): "
            + ", ".join(f"{p} {shared[p]['pair_gbps']:.2f} / {shared[p]['gbps']:.2f} GB/s "
                        f"(latest start {shared[p]['late_ms']:.1f} ms late)" for p in providers)
        )
        # the push's processes: 2 trainers sending, 2 receivers; the C core with as many
        senders = {p: c_core_together(p, pairs=2, total=together) for p in providers}
        print(
            "the C core, 2 pairs started together (the push's 2 sending and 2 receiving processes; "
            "median pair / both at once): "
            + ", ".join(f"{p} {senders[p]['pair_gbps']:.2f} / {senders[p]['gbps']:.2f} GB/s"
                        for p in providers)
        )
        fan = {p: c_core_together(p, pairs=2, total=together, fan=True)["gbps"] for p in providers}
        print(
            "the C core in the push's pattern (2 senders each writing to both receivers at once): "
            + ", ".join(f"{p} {fan[p]:.2f} GB/s ({fan[p] / senders[p]['gbps']:.2f} of its 2 pairs)"
                        for p in providers)
        )
        sources, specs = llama_model(a.size, 2, 2, row_blocks=a.row_blocks)
        total = sum(int(np.prod(s.local_shape)) * 2 for s in sources)
        print(
            f"model: Llama-3-8B layer shapes, {len({s.name for s in sources})} parameters, "
            f"{total / GB:.2f} GB bf16; 2 trainers (FSDP halves) -> 2 inference ranks "
            "(TP 2, fused qkv/gate_up)"
        )
        gloo = None if a.no_gloo else gloo_run(2, 2, total // 2, a.repeats)
        if gloo:
            print(
                f"gloo: all_gather + rank-0 broadcast in 256 MiB buckets: {gloo['wall_s']:.3f} s "
                f"(median of {len(gloo['walls'])}: " + ", ".join(f"{x:.3f}" for x in gloo["walls"]) + ")"
            )
        for route, prov in zip(routes, providers, strict=True):
            r = await aiote_run(
                route, sources, specs, a.repeats, a.max_tmp_mib << 20, a.chunk_mib << 20,
                json.loads(a.engine_opts) if a.engine_opts else None,
            )
            _print_aiote(route, r, link[prov], shared[prov]["gbps"], gloo["wall_s"] if gloo else None,
                         senders[prov]["gbps"], fan[prov])
    if a.gpu:
        await gpu_run(a.size, a.repeats, [int(x) for x in a.ipc_streams.split(",")],
                      tuple(a.rx_memory.split(",")))
    if not a.no_kimi:
        layouts = [
            ("float8_e4m3", False, "FP8 e4m3 linear weights, whole tensors in mesh groups"),
            ("bfloat16", False, "bf16 throughout, whole tensors in mesh groups"),
            ("float8_e4m3", True, "FP8, experts sharded by expert on the trainers"),
        ]
        for fp8, shards, what in layouts:
            k = kimi_plan_report(fp8, shards)
            print(
                f"\nKimi-K2 plan, {what} (computed, not run): {k['params'] / 1e12:.3f} T params, "
                f"256 trainers -> 128 inference ranks (8 replicas x 16), {k['tasks']} writes, "
                f"planned in {k['plan_s']:.3f} s ({k['plan_cpu_s']:.3f} s of CPU), "
                f"validated in {k['validate_s']:.3f} s"
            )
            print(
                f"  {k['total_gb']:.0f} GB written; "
                f"out per trainer {k['min_out_gb']:.1f}-{k['max_out_gb']:.1f} GB, "
                f"in per inference rank up to {k['max_in_gb']:.1f} GB; bound at 50 GB/s per rank: "
                f"{k['bound_s']:.2f} s (Perplexity reported 1.3 s, FP8 inference)"
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=2.0, help="model size in GB of bf16 (default 2)")
    ap.add_argument("--routes", default="tcp,default", help="tcp, default (shm), or both")
    ap.add_argument("--engine-opts", default="",
                    help="CPU runs: JSON of open_engine() keyword arguments for every worker")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-mib", type=int, default=2048,
                    help="MiB per run of the C core's link figures (default 2048; smaller for a quick check)")
    ap.add_argument("--max-tmp-mib", type=int, default=None,
                    help="each sender's staging pool (default 256; 4096 with --trainers)")
    ap.add_argument("--chunk-mib", type=int, default=None,
                    help="the plan's chunk_bytes (default 16; 256 with --trainers)")
    ap.add_argument("--row-blocks", action="store_true",
                    help="CPU runs: o_proj and down_proj cut by rows, not columns (another pattern)")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--no-kimi", action="store_true")
    ap.add_argument("--kimi-only", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="the 2-GPU benchmark instead of the CPU one")
    ap.add_argument("--ipc-streams", default="1,4",
                    help="with --gpu: the engine's ipc_streams values to run aiote with (default 1,4)")
    ap.add_argument("--rx-memory", default="cuda,alloc_gpu",
                    help="with --gpu: the receivers' GPU memory, cuda (cudaMalloc, opened with "
                         "cudaIpcOpenMemHandle) and/or alloc_gpu (Engine.alloc_gpu, VMM shared as a "
                         "descriptor); with --trainers the last one given (default cuda,alloc_gpu)")
    ap.add_argument("--trainers", type=int, default=None,
                    help="trainer ranks -> --inference ranks, DeepSeek-V3 shapes (with --gpu: one GPU each)")
    ap.add_argument("--inference", type=int, default=None, help="inference ranks (one TP replica)")
    ap.add_argument("--layers", type=int, default=None,
                    help="with --trainers: MoE layers (default: as many as fit in --trainer-fraction)")
    ap.add_argument("--trainer-fraction", type=float, default=0.6,
                    help="with --trainers: the share of a trainer GPU's memory its bfloat16 shards may take")
    ap.add_argument("--tiny", action="store_true", help="with --trainers: every dimension shrunk (CPU check)")
    ap.add_argument("--bucket-mib", type=int, default=1024,
                    help="with --trainers: the NCCL paths' bucket per trainer (all-gather, p2p batches)")
    ap.add_argument("--timeout", type=float, default=540, help="with --trainers: seconds for the whole run")
    ap.add_argument("--gloo-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gloo-world", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--gloo-trainers", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--gloo-shard", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gloo_rank is not None:
        gloo_rank(
            args.gloo_rank, args.gloo_world, args.gloo_trainers, args.gloo_shard, args.gloo_port, args.repeats
        )
    else:
        anyio.run(main, args)
