"""RL weight updates (``aiote.weights``): trainer ranks push each new model version into
inference ranks with one-sided writes, on a static balanced schedule, pipelined, awaitable and
versioned::

    # controller (pure, no I/O): metadata in, plan out; ship each rank its part as JSON
    plan = aiote.weights.plan(sources, targets)   # SourceShard / TargetShard lists
    print(plan.validate(link_bytes_per_s=25e9))    # coverage proof, bytes per rank, bound

    # trainer rank r
    async with aiote.weights.WeightSender(engine, plan.sender(r), max_tmp_bytes=1 << 30) as tx:
        stats = await tx.push({"layers.0.q": q_shard, ...}, version=step, timeout=60)

    # inference rank r, before planning: its parameter memory laid out and registered once
    mem = await aiote.weights.register_targets(engine, r, specs, sources)  # mem.targets -> controller
    # ... and after: completion of each version
    rx = aiote.weights.WeightReceiver(engine, plan.receiver(r))
    await rx.wait_version(step, timeout=60)        # every byte of `step` is in place

Every target byte is written by exactly one trainer rank; each sender announces a version to a
receiver with one immediate once all its bytes there are in place; each version has its own
immediate (24-bit sequence), so a late write of ``v`` never completes ``v + 1``.
See docs/weights.md.
"""

from ._dtypes import DTYPES, E4M3_MAX, cast_into, cast_supported, e4m3_table
from ._flow import VERSION_BITS, PushFailed, PushStats, WeightSender, version_imm
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
from ._receiver import WeightReceiver
from ._region import TargetRegion, register_targets

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
    "TargetRegion",
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
    "register_targets",
    "split_rows",
    "version_imm",
    "with_desc",
]
