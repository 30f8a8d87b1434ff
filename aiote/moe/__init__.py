"""MoE dispatch and combine over aiote (``aiote.moe``): each token goes to the ranks holding
its top-k experts, and the experts' outputs come back to the token's rank, weighted and summed.

    group = aiote.moe.Group(addresses, rank)      # every rank's engine.address, this rank's index
    a2a = await aiote.moe.AllToAll.create(engine, group, num_experts=256, experts_per_token=8,
                                          hidden=7168, max_tokens=128, in_dtype="bfloat16",
                                          out_dtype="bfloat16", expert_padding=1)
    h = await a2a.dispatch(x, indices, weights)          # h.expert_x: per-expert padded blocks
    y = expert_compute(h.expert_x, h.counts, h.offsets)  # rows as h.expert_x
    out = await a2a.combine(h, y)                        # [T, H]: sum_k w[t, k] * y[row(t, k)]

    pending = await a2a.dispatch_send(x, indices, weights)   # the halves, for overlap
    ...
    h = await pending.recv()

Semantics (FLOWS.md B4, docs/moe.md): experts ``ceil(E / W)`` per rank; -1 indices skipped;
``bound_m`` tokens used; per-expert blocks padded to ``expert_padding`` rows, rows in canonical
order (source rank, then token) with ``src_rank``/``src_token`` returned; combine accumulates
in float32 in top-k slot order and rounds once. bfloat16 data are ``uint16`` bit patterns
(:func:`bf16_to_f32`, :func:`f32_to_bf16`). :mod:`aiote.moe.reference` is the NumPy
reference (all ranks in one process).
"""

from . import reference
from ._a2a import AllToAll
from ._dtypes import bf16_to_f32, f32_to_bf16
from ._handles import CombinePending, DispatchHandle, DispatchPending, Group

__all__ = [
    "AllToAll",
    "CombinePending",
    "DispatchHandle",
    "DispatchPending",
    "Group",
    "bf16_to_f32",
    "f32_to_bf16",
    "reference",
]
