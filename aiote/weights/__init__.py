"""RL weight updates (``aiote.weights``): trainer ranks push each new model version into
inference ranks with one-sided writes, on a static balanced schedule, pipelined, awaitable and
versioned::

    # controller (pure, no I/O): metadata in, plan out; ship each rank its part as JSON
    plan = aiote.weights.plan(sources, targets)   # SourceShard / TargetShard lists
    print(plan.validate(link_bytes_per_s=25e9))    # coverage proof, bytes per rank, bound

    # trainer rank r
    async with aiote.weights.WeightSender(engine, plan.sender(r), max_tmp_bytes=1 << 30) as tx:
        stats = await tx.push({"layers.0.q": q_shard, ...}, version=step, timeout=60)

    # inference rank r (its parameter memory registered once; the plan carries its descriptor)
    rx = aiote.weights.WeightReceiver(engine, plan.receiver(r))
    await rx.wait_version(step, timeout=60)        # every byte of `step` is in place

Every target byte is written by exactly one trainer rank; each sender announces a version to a
receiver with one immediate once all its bytes there are in place; each version has its own
immediate (24-bit sequence), so a late write of ``v`` never completes ``v + 1``.
See docs/weights.md.
"""

from ._dtypes import DTYPES, E4M3_MAX, cast_into, cast_supported, e4m3_table
from ._flow import VERSION_BITS, PushFailed, PushStats, WeightReceiver, WeightSender, version_imm
from ._layout import fused_tp, pack_targets, split_rows, with_desc
from ._plan import (
    Piece,
    PlanError,
    PlanReport,
    ReceiverPlan,
    SenderPlan,
    SourceShard,
    TargetShard,
    Task,
    WeightPlan,
    Write,
    plan,
)

__all__ = [
    "DTYPES",
    "E4M3_MAX",
    "VERSION_BITS",
    "Piece",
    "PlanError",
    "PlanReport",
    "PushFailed",
    "PushStats",
    "ReceiverPlan",
    "SenderPlan",
    "SourceShard",
    "TargetShard",
    "Task",
    "WeightPlan",
    "WeightReceiver",
    "WeightSender",
    "Write",
    "cast_into",
    "cast_supported",
    "e4m3_table",
    "fused_tp",
    "pack_targets",
    "plan",
    "split_rows",
    "version_imm",
    "with_desc",
]
