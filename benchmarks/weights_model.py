"""The model of ``weights_multi.py``'s weight update: DeepSeek-V3's MoE layer shapes, the
trainers' dim-0 shards (``sources_of``) and the inference ranks' tensor-parallel targets
(``specs_of``) for :class:`aiote.weights.WeightPlan`, and the trainers' FP8 block
quantization (``quantize_block``). Plain data and arithmetic: no process, no transfer.
See ``weights_multi.py`` for what is measured."""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 128
DSV3 = {"hidden": 7168, "experts": 256, "moe_inter": 2048, "q_lora": 1536, "kv_lora": 512, "rope": 64,
        "heads": 128, "qk_nope": 128, "v_head": 128}
TINY = {"hidden": 256, "experts": 8, "moe_inter": 256, "q_lora": 256, "kv_lora": 128, "rope": 64,
        "heads": 4, "qk_nope": 128, "v_head": 128}
FP8 = "float8_e4m3"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_blocks(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows of part ``i`` of ``n`` rows cut into ``parts`` at 128-row block boundaries."""
    from aiote import weights as W

    b0, b1 = W.split_rows(cdiv(n, BLOCK), parts, i)
    return min(n, b0 * BLOCK), min(n, b1 * BLOCK)


class Param:
    """One parameter: global ``shape`` (3-D for stacked experts), ``quant`` (FP8 with block
    scales, else bfloat16), its inference layout ``kind`` (rep, rows, cols, expert_rows) and
    the fused target it belongs to (``fused``, None for its own)."""

    def __init__(self, name: str, shape: tuple[int, ...], quant: bool, kind: str, fused: str | None = None):
        self.name, self.shape, self.quant, self.kind, self.fused = name, shape, quant, kind, fused

    @property
    def rows2d(self) -> int:  # rows of its 2-D view (experts: all experts' rows)
        return int(np.prod(self.shape[:-1]))

    @property
    def cols(self) -> int:
        return self.shape[-1]

    def scale_shape(self) -> tuple[int, ...]:
        if len(self.shape) == 3:
            return (self.shape[0], cdiv(self.shape[1], BLOCK), cdiv(self.shape[2], BLOCK))
        return (cdiv(self.shape[0], BLOCK), cdiv(self.shape[1], BLOCK))

    def shard(self, trainers: int, t: int) -> tuple[int, int]:
        """Trainer ``t``'s dim-0 rows: whole experts for stacked experts, else block-aligned."""
        if len(self.shape) == 3:
            from aiote import weights as W

            return W.split_rows(self.shape[0], trainers, t)
        if len(self.shape) == 1:
            return split_blocks(self.shape[0], trainers, t)
        return split_blocks(self.shape[0], trainers, t)

    def scale_rows(self, rows: tuple[int, int]) -> tuple[int, int]:
        if len(self.shape) == 3:
            return rows
        return rows[0] // BLOCK, cdiv(rows[1], BLOCK)


def layer_params(d: dict[str, int], layer: int) -> list[Param]:
    p = f"layers.{layer}."
    h, e, i = d["hidden"], d["experts"], d["moe_inter"]
    a = p + "self_attn."
    m = p + "mlp."
    return [
        Param(p + "input_layernorm", (h,), False, "rep"),
        Param(p + "post_attention_layernorm", (h,), False, "rep"),
        Param(a + "q_a_layernorm", (d["q_lora"],), False, "rep"),
        Param(a + "kv_a_layernorm", (d["kv_lora"],), False, "rep"),
        Param(a + "q_a_proj", (d["q_lora"], h), True, "rep", a + "fused_qkv_a_proj"),
        Param(a + "kv_a_proj_with_mqa", (d["kv_lora"] + d["rope"], h), True, "rep", a + "fused_qkv_a_proj"),
        Param(a + "q_b_proj", (d["heads"] * (d["qk_nope"] + d["rope"]), d["q_lora"]), True, "rows"),
        Param(a + "kv_b_proj", (d["heads"] * (d["qk_nope"] + d["v_head"]), d["kv_lora"]), True, "rows"),
        Param(a + "o_proj", (h, d["heads"] * d["v_head"]), True, "cols"),
        Param(m + "gate", (e, h), False, "rep"),
        Param(m + "shared_experts.gate_proj", (i, h), True, "rows", m + "shared_experts.gate_up_proj"),
        Param(m + "shared_experts.up_proj", (i, h), True, "rows", m + "shared_experts.gate_up_proj"),
        Param(m + "shared_experts.down_proj", (h, i), True, "cols"),
        Param(m + "experts.w1", (e, i, h), True, "expert_rows"),
        Param(m + "experts.w3", (e, i, h), True, "expert_rows"),
        # w2 [E, H, I] as its 2-D view [E x H, I]: the row-parallel slice is a column range of it
        Param(m + "experts.w2", (e * h, i), True, "cols"),
    ]


def model(d: dict[str, int], layers: int) -> list[Param]:
    return [q for layer in range(layers) for q in layer_params(d, layer)]


def sources_of(params: list[Param], trainers: int) -> Any:
    """The plan's sources: FP8 weights, their float32 scales (``<name>.scale_inv``), bfloat16
    norms and router, each trainer's dim-0 shard."""
    from aiote import weights as W

    out = []
    for q in params:
        for t in range(trainers):
            rows = q.shard(trainers, t)
            out.append(W.SourceShard(q.name, q.shape, FP8 if q.quant else "bfloat16", t, rows))
            if q.quant:
                out.append(
                    W.SourceShard(q.name + ".scale_inv", q.scale_shape(), "float32", t, q.scale_rows(rows))
                )
    return out


def specs_of(params: list[Param], tp: int, i: int) -> list[tuple[str, str, list[Any]]]:
    """Inference rank ``i``'s targets (TP = ``tp``): ``(name, dtype, pieces)``, each FP8 weight
    followed by its scales, fused parameters as one target."""
    from aiote import weights as W

    def pieces(q: Param) -> tuple[list[Any], list[Any]]:
        s = q.name + ".scale_inv"
        if q.kind == "rep":
            w = [W.Piece(q.name, (0, q.shape[0]))]
            sc = [W.Piece(s, (0, q.scale_shape()[0]))] if q.quant else []
        elif q.kind == "rows":
            r0, r1 = split_blocks(q.shape[0], tp, i)
            w, sc = [W.Piece(q.name, (r0, r1))], [W.Piece(s, q.scale_rows((r0, r1)))]
        elif q.kind == "cols":
            c0, c1 = split_blocks(q.cols, tp, i)
            w = [W.Piece(q.name, (0, q.shape[0]), (c0, c1))]
            sc = [W.Piece(s, (0, q.scale_shape()[0]), (c0 // BLOCK, cdiv(c1, BLOCK)))]
        else:  # expert_rows: rows (i0, i1) of every expert's [I, H]
            e, n, h = q.shape
            i0, i1 = split_blocks(n, tp, i)
            hb = cdiv(h, BLOCK)
            w = [W.Piece(q.name, (0, e), (i0 * h, i1 * h))]
            sc = [W.Piece(s, (0, e), (i0 // BLOCK * hb, cdiv(i1, BLOCK) * hb))]
        return w, sc

    out: list[tuple[str, str, list[Any]]] = []
    fused: dict[str, tuple[list[Any], list[Any]]] = {}
    for q in params:
        w, sc = pieces(q)
        if q.fused is not None:
            f = fused.setdefault(q.fused, ([], []))
            f[0].extend(w)
            f[1].extend(sc)
            nxt = params[params.index(q) + 1] if q is not params[-1] else None
            if nxt is not None and nxt.fused == q.fused:
                continue
            w, sc = fused.pop(q.fused)
            name = q.fused
        else:
            name = q.name
        out.append((name, FP8 if q.quant else "bfloat16", w))
        if q.quant:
            out.append((name + ".scale_inv", "float32", sc))
    return out


def trainer_bf16_bytes(params: list[Param], trainers: int) -> int:
    """The most bfloat16 bytes one trainer holds (its shards)."""
    per = [0] * trainers
    for q in params:
        for t in range(trainers):
            r0, r1 = q.shard(trainers, t)
            per[t] += (r1 - r0) * int(np.prod(q.shape[1:])) * 2
    return max(per)


def quantize_block(torch: Any, x: Any, q: Any, s: Any, elems: int = 64 << 20) -> None:
    """``x`` [R, C] bfloat16 -> ``q`` [R, C] FP8 e4m3 bytes and ``s`` [ceil(R/128), ceil(C/128)]
    float32 scales, in chunks of whole block rows (at most ``elems`` elements a chunk)."""
    rows, cols = x.shape
    cb = cdiv(cols, BLOCK)
    step = max(1, elems // (BLOCK * cb * BLOCK))
    rb = cdiv(rows, BLOCK)
    for b0 in range(0, rb, step):
        b1 = min(rb, b0 + step)
        r0, r1 = b0 * BLOCK, min(rows, b1 * BLOCK)
        xf = x[r0:r1].float()
        pr, pc = (b1 - b0) * BLOCK - (r1 - r0), cb * BLOCK - cols
        if pr or pc:
            xf = torch.nn.functional.pad(xf, (0, pc, 0, pr))
        xb = xf.view(b1 - b0, BLOCK, cb, BLOCK)
        scale = (xb.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
        y = (xb / scale[:, None, :, None]).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
        q[r0:r1] = y.view(torch.uint8).reshape((b1 - b0) * BLOCK, cb * BLOCK)[: r1 - r0, :cols]
        s[b0:b1] = scale


def trainer_sizes(params: list[Param], trainers: int) -> dict[str, int]:
    """Bytes of each trainer buffer, the most over trainers (the NCCL all-gather needs equal
    sizes; a trainer with fewer bytes sends padding)."""
    per = []
    for t in range(trainers):
        z = {"small": 0, "big": 0, "fp8": 0, "scales": 0}
        for q in params:
            r0, r1 = q.shard(trainers, t)
            count = (r1 - r0) * int(np.prod(q.shape[1:]))
            if not q.quant:
                z["small"] += 2 * count
                continue
            z["big"] += 2 * count
            z["fp8"] += count
            sr = q.scale_rows((r0, r1))
            z["scales"] += 4 * (sr[1] - sr[0]) * int(np.prod(q.scale_shape()[1:]))
        per.append(z)
    return {k: max(z[k] for z in per) for k in per[0]}
