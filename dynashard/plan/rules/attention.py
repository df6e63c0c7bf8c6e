"""Attention: SDPA kernels and bmm attention run on this rank's heads.

Before (q, k, v Shards on the head dim, each rank's heads alike; o rowwise)::

    y = _scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]     # or bmm / softmax / bmm
After: the same kernel on this rank's heads; its outputs are Shards on the head dim (the
log-sum-exp too); nothing is gathered. A replicated operand (or a mask with a head dim) is
narrowed to this rank's heads; whole K/V under GQA are narrowed to the K/V heads of this rank's
query heads (``Read.NARROW_GROUPS``).

When operands are cut differently (GQA units, fewer K/V heads than ranks, MQA whose head view
keeps the cut on ``head_dim``) the rule records a wish: coarser units, or K/V projections kept
whole (each rank narrows them). A rank left without heads gathers: the kernels cannot run on
zero heads. A new attention kernel needs one row in ``_ATTENTION``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.layout.nodes import all_args, op_name, val, val_list
from dynashard.layout.shard import LayoutMap, Read, Record, Shard, WishKind, finest
from dynashard.layout.split import Split
from dynashard.plan.rules.registry import rule

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class _AttentionOp:
    """Where an SDPA kernel keeps its mask and its per-head log-sum-exp (output 1), and whether it
    repeats K/V heads itself (GQA); outputs 2+ (RNG state, sequence offsets, sizes) hold no heads."""

    mask: int | str | None  # positional index or keyword of the additive mask / bias
    lse_dim: int  # the head dim of output 1, from the end
    gqa: bool
    debug_mask: int | None = None  # index of return_debug_mask (a [B, H, T, T] output when set)


# NOTE: what F.scaled_dot_product_attention traces to, per device and backend (torch 2.13 schemas).
_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _AttentionOp("attn_mask", -2, gqa=True),
    aten._scaled_dot_product_flash_attention.default: _AttentionOp(None, -2, gqa=False, debug_mask=5),
    aten._scaled_dot_product_efficient_attention.default: _AttentionOp(3, -2, gqa=False),  # lse [B, H, ceil32(T)]
    aten._scaled_dot_product_cudnn_attention.default: _AttentionOp(3, -3, gqa=False, debug_mask=7),  # lse [B, H, T, 1]
}


def heads_alike(lm: LayoutMap, node: torch.fx.Node, operands: list[torch.fx.Node], dim: int) -> Shard | None:
    """The shard every operand has (or can be narrowed to) on ``dim``; wishes when they differ."""
    lays = [lm.layouts.get(a) for a in operands]
    sharded = [lay for lay in lays if lay is not None]
    if not sharded or any(lay.dim != dim for lay in sharded):
        return None
    first = finest(sharded)
    if not all(first.alike(lay) for lay in sharded):
        lm.unify(sharded, op_name(node))
        _replicate_wish(lm, node, sharded)
        return None
    if first.split.fewest_units(lm.world) < 1:
        return None  # a rank without heads: the attention kernels cannot run on zero heads
    for a, lay in zip(operands, lays):
        v = val(a)
        if lay is None and (v is None or v.dim() < -dim or not private_aten.known_multiple(v.shape[dim], first.size)):
            return None
    return first


def _replicate_wish(lm: LayoutMap, node: torch.fx.Node, shards: list[Shard]) -> None:
    """GQA with fewer KV heads than ranks: coarser units would leave ranks without heads, so
    keep the coarser-cut operands' projections whole (each rank narrows the heads it needs)."""
    fine = finest(shards)
    if fine.split.fewest_units(lm.world) < 1:
        return
    for s in shards:
        if s.split.unit > fine.split.unit and len(s.split.parts) == 1:
            unit = math.lcm(s.split.unit, fine.split.unit)
            if Split((s.size // unit,), unit).fewest_units(lm.world) < 1:
                lm.wish(s.origins, WishKind.REPLICATE, None,
                        f"{s.split.parts[0]} KV heads cannot be cut over {lm.world} ranks; each rank narrows "
                        f"them to its query heads at {op_name(node)}")


def _op_arg(node: torch.fx.Node, where: int | str | None, name: str) -> object:
    if where is None:
        return None
    if isinstance(where, str):
        return node.kwargs.get(where)
    return node.args[where] if len(node.args) > where else node.kwargs.get(name)


@rule(*_ATTENTION)
def attention(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    spec = _ATTENTION[node.target]
    q, k, v = node.args[:3]
    mask = _op_arg(node, spec.mask, "attn_bias")
    if mask is not None and (lm.layouts.get(mask) is not None or val(mask) is None):
        return None
    if spec.debug_mask is not None and _op_arg(node, spec.debug_mask, "return_debug_mask"):
        return None  # a debug mask output per head pair: run whole
    groups = kv_groups(q, k)
    if groups is None or (groups > 1 and not spec.gqa):
        return None
    if groups > 1:
        first = gqa_heads(lm, node, q, k, v, groups)
    else:
        first = heads_alike(lm, node, [q, k, v], -3)
    if first is None or (lm.layouts.get(q) is None and groups > 1):
        off_heads_wish(lm, node, [q, k, v])
        return None  # (a replicated q with K/V cut alike by heads is narrowed to this rank's heads)
    origins = frozenset().union(*(lm.layouts[a].origins for a in (q, k, v) if lm.layouts.get(a) is not None))
    out = Shard(first.split, origins, -3, lm.world, lm.rank)
    record = Record(outputs=(out, out.moved(spec.lse_dim)) + (None,) * (len(val_list(node)) - 2))
    for arg in all_args(node):
        if arg in (q, k, v) and lm.layouts.get(arg) is not None:
            record.read(arg, Read.LOCAL)
        elif arg in (k, v) and groups > 1:
            record.read(arg, Read.NARROW_GROUPS)
        elif arg in (q, k, v) or arg is mask:
            record.read(arg, lm.as_shard(arg, out))
        else:
            record.read(arg, Read.LOCAL)
    return record


def off_heads_wish(lm: LayoutMap, node: torch.fx.Node, operands: list[torch.fx.Node]) -> None:
    """Operands cut by heads meet others cut on another dim (one K/V head's features: MQA, where
    the head view keeps the cut on ``head_dim``): keep those others' projections whole."""
    lays = [lm.layouts.get(a) for a in operands]
    if not any(lay is not None and lay.dim == -3 and lay.split.fewest_units(lm.world) >= 1 for lay in lays):
        return
    off = [lay for lay in lays if lay is not None and lay.dim != -3]
    if off:
        lm.wish(frozenset().union(*(s.origins for s in off)), WishKind.REPLICATE, None,
                f"K/V are not cut by heads where they meet the query heads at {op_name(node)}; each rank "
                "narrows them to its query heads")


def kv_groups(q: torch.fx.Node, k: torch.fx.Node) -> int | None:
    """Query heads per K/V head (1 unless K/V are not repeated: SDPA's ``enable_gqa``)."""
    qv, kv = val(q), val(k)
    if qv is None or kv is None or qv.dim() < 3 or kv.dim() < 3:
        return None
    hq, hk = qv.shape[-3], kv.shape[-3]
    if private_aten.known_equal(hq, hk):
        return 1
    if not (isinstance(hq, int) and isinstance(hk, int)) or hk < 1 or hq % hk:
        return None
    return hq // hk


def gqa_heads(lm: LayoutMap, node: torch.fx.Node, q: torch.fx.Node, k: torch.fx.Node, v: torch.fx.Node,
               n: int) -> Shard | None:
    """Attention where query head ``h`` reads K/V head ``h // n`` (K/V not repeated).

    K/V cut so that each rank holds the K/V heads of exactly its query heads run as they are
    (the kernel repeats them locally); whole K/V are narrowed to the heads of this rank's query
    heads (``NARROW_GROUPS``). Otherwise a wish: q in units of ``n`` heads, K/V in matching
    units, or K/V kept whole when there are fewer K/V heads than ranks.
    """
    lq, lk, lv = (lm.layouts.get(a) for a in (q, k, v))
    if lq is None or lq.dim != -3 or lq.split.fewest_units(lm.world) < 1:
        return None
    if lk is None and lv is None:
        return lq
    if any(s is not None and s.dim != -3 for s in (lk, lv)):
        return None
    if lk is not None and lv is not None and not lk.alike(lv):  # (DiffLlama's v taken in two halves, k as one)
        lm.unify([lk, lv], op_name(node))
        return None
    cuts = [s for s in (lk, lv) if s is not None]  # (one may be whole: DiffLlama's v, 1 K/V head a half)
    grouped = [[(a * n, b * n) for a, b in ranges] for ranges in cuts[0].split.owned(lm.world)]
    if grouped == lq.split.owned(lm.world):
        return lq  # (a whole K or V is narrowed by groups)
    where = f"{op_name(node)} ({n} query heads per K/V head)"
    if len(lq.split.parts) > 1 or len(cuts[0].split.parts) > 1:
        # Components (DiffLlama's two halves of heads): K/V in units of their query heads meet q.
        wished = len(lm.wishes)
        lm.unify([lq, *(s.moved(s.dim, s.split.regrouped(s.split.unit * n)) for s in cuts)], where)
        if len(lm.wishes) > wished:
            return None
    else:
        unit = math.lcm(lq.split.unit, n * cuts[0].split.unit)
        q_to, kv_to = lq.split.coarsen(unit // lq.split.unit), cuts[0].split.coarsen(unit // (n * cuts[0].split.unit))
        where = f"{where} needs query units of {unit} heads"
        fits = q_to is not None and kv_to is not None
        if fits and min(q_to.fewest_units(lm.world), kv_to.fewest_units(lm.world)) >= 1:
            for s, to in ((lq, q_to), *((c, kv_to) for c in cuts)):
                if to != s.split:
                    lm.wish(s.origins, WishKind.COARSEN, to.unit // s.split.unit, where)
            return None
    lm.wish(frozenset().union(*(c.origins for c in cuts)), WishKind.REPLICATE, None,
            f"{cuts[0].size} K/V heads cannot be cut over {lm.world} ranks to match the query heads; each rank "
            f"narrows them to those of its query heads at {op_name(node)}")
    return None


@rule(aten.bmm.default, aten.baddbmm.default)
def bmm(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """bmm on a batch dim that merges batch and heads (softmax-matmul attention), or baddbmm with
    a bias added to it (BLOOM's ALiBi, ``[B * H, 1, T]``): a bias spanning the merged dim is cut
    like the operands (narrowed if replicated); one of size 1 there broadcasts."""
    bias = node.args[0] if node.target is aten.baddbmm.default else None
    a, b = node.args[1:3] if bias is not None else node.args[:2]
    bias_val = val(bias) if bias is not None else None
    spans = bias_val is not None and bias_val.dim() >= 3 and not private_aten.known_equal(bias_val.shape[-3], 1)
    first = heads_alike(lm, node, [a, b, bias] if spans else [a, b], -3)
    if first is None:
        off_heads_wish(lm, node, [a, b])
        return None
    origins = frozenset().union(*(lm.layouts[x].origins for x in (a, b, bias) if lm.layouts.get(x) is not None))
    out = Shard(first.split, origins, -3, lm.world, lm.rank)
    return Record(out, {arg: lm.as_shard(arg, out) if arg in (a, b, bias) else Read.LOCAL for arg in all_args(node)})
