"""Shapes: keep a colwise projection's shard through the shape ops of an attention block.

Before (q, k, v colwise on [B*T, H*Dh]; o rowwise)::

    q = view(mm_q, [B, T, H, Dh]); q = transpose(q, 1, 2)          # likewise k, v
    q = q * cos + cat(neg(slice(q, -1, Dh/2)), slice(q, -1, 0, Dh/2)) * sin      # RoPE
    k = _unsafe_view(clone(expand(unsqueeze(k, 2), [B, Hkv, n, T, Dh])), [B, H, T, Dh])  # GQA
    y = _scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]    # or bmm / softmax / bmm
    y = transpose(y, 1, 2); y = view(y, [B, T, H*Dh]); o = mm(view(y), t(w_o))
After: the same ops on this rank's heads; head counts in shape arguments are rewritten
(8 -> 2 on 4 ranks, ``B*8`` -> ``B*2``), nothing is gathered, and the output projection's
all_reduce is the only collective.

A shard is a :class:`~dynashard.layout.Split` of one dim (whole units, balanced over ranks).
Rules (replicated inputs only; anything else falls back to layout.py's gather). Every condition
depends on sizes only, never on this rank's offsets, so all ranks take the same collectives:
  * views: dims equal on the left or right map one to one; in the group of dims that changes,
    the cut must land on a dim whose inner dims fit inside one unit (``[H*Dh] -> [H, Dh]`` with
    units of ``Dh``; ``[B, H] -> [B*H]``; ``[Hkv, n] -> [Hkv*n]`` makes units of ``n`` heads);
  * transpose / permute / unsqueeze / squeeze / select / expand / view_as_complex / view_as_real
    move the cut with its dim; slice, split, unbind, cat, softmax on other dims keep it; a split
    or slice of the cut dim itself must fall on component boundaries (a fused [q | k | v]);
  * attention (SDPA's CPU flash kernel, its CUDA flash / memory-efficient / cuDNN kernels, or bmm)
    whose operands are cut alike on the head/batch dim runs on this rank's heads; a replicated
    operand (or mask with a head dim) is narrowed;
  * reductions, layer norm, softmax, stack and cat along dims that are not cut keep the cut.
When a rule fails only because the origin linears are cut too finely or in one piece, it records
a :class:`~dynashard.layout.Wish` (larger units, component boundaries, or keep KV projections
whole when there are fewer KV heads than ranks: a separate projection entirely, a fused one only
in its k and v components); the plan re-cuts the origins and propagates again.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx

from dynashard import _torch_private as private
from dynashard.layout import (
    LOCAL,
    NARROW_GROUPS,
    LayoutMap,
    Shard,
    Split,
    _all_args,
    _op_name,
    _read_as_shard,
    _val,
    finest,
    unify,
)

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
_DIM_OPS = {  # op -> index of its dim argument; the op works along that dim only
    aten._softmax.default: 1,
    aten._log_softmax.default: 1,
    aten._safe_softmax.default: 1,  # SDPA's math path
    aten.slice.Tensor: 1,
}
# Reductions over the dims in args[1] (keepdim in args[2] or kwargs): local when the cut dim is
# not reduced (q/k RMSNorm over head_dim: Qwen3's q_norm, Gemma's; variance over the last dim).
_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
               aten.std.correction, aten.logsumexp.default)


def _local(lm: LayoutMap, node: torch.fx.Node, out: Shard | None) -> bool:
    for arg in _all_args(node):
        lm.read(node, arg, LOCAL)
    lm.layouts[node] = out
    return True


def _norm(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def view_shard(lm: LayoutMap, node: torch.fx.Node, src: Shard) -> bool:
    """Keep ``src`` through a view (see the module docstring); False: gather instead."""
    full_before, full_after = list(_val(node.args[0]).shape), list(_val(node).shape)
    cut = len(full_before) + src.dim
    if _is_one(full_before[cut]):
        return False
    # Size-1 dims carry no elements: match the others (einsum views [B, H, T, Dh, 1] -> [B*H, T, Dh]).
    keep_before = [i for i, d in enumerate(full_before) if not _is_one(d)]
    keep_after = [i for i, d in enumerate(full_after) if not _is_one(d)]
    before, after = [full_before[i] for i in keep_before], [full_after[i] for i in keep_after]
    p = keep_before.index(cut)

    def at(pos: int) -> int:  # a position in ``after`` as a dim of the real output, from the end
        return keep_after[pos] - len(full_after)

    left = 0
    while left < min(len(before), len(after)) and private.known_equal(before[left], after[left]):
        left += 1
    right = 0
    while (
        right < min(len(before), len(after)) - left
        and private.known_equal(before[-1 - right], after[-1 - right])
    ):
        right += 1
    if p < left:  # the cut dim maps one to one (same place from the left)
        return _viewed(lm, node, src.moved(at(p)))
    if p >= len(before) - right:  # same place from the right
        return _viewed(lm, node, src.moved(at(len(after) - (len(before) - p))))
    if src.split.whole:  # a regrouped dim would deal out the whole components too: gather instead
        return False
    mid_in, mid_out = before[left : len(before) - right], after[left : len(after) - right]
    s = p - left
    inner_in = mid_in[s + 1 :]
    if not all(isinstance(d, int) for d in inner_in):
        return False
    elems = src.split.unit * math.prod(inner_in)  # elements of the flattened group per unit
    units = sum(src.split.parts)
    inner_out = 1
    for o in range(len(mid_out) - 1, -1, -1):
        if o < len(mid_out) - 1:
            if not isinstance(mid_out[o + 1], int):
                return False
            inner_out *= mid_out[o + 1]
        if elems % inner_out == 0:
            new_unit = elems // inner_out
            if private.known_multiple(mid_out[o], units * new_unit):
                out = src.moved(at(left + o), Split(src.split.parts, new_unit))
                merged = not private.known_equal(mid_out[o], units * new_unit)
                if merged and out.split.fewest_units(lm.world) < 1:
                    return False  # a merged dim needs a part on every rank (its outer size is recovered from it)
                return _viewed(lm, node, out)
            continue
        k = math.lcm(elems, inner_out) // elems  # units k times larger would fit this dim
        coarser = src.split.coarsen(k)
        if coarser is not None and coarser.fewest_units(lm.world) >= 1:
            lm.wish(src.origins, "coarsen", k, f"{_op_name(node)} into dims of {inner_out} elements")
        elif coarser is not None:  # e.g. fewer KV heads than ranks: keep the projection whole
            lm.wish(src.origins, "replicate", k,
                    f"{'/'.join(map(str, coarser.parts))} heads of {inner_out} cannot be cut over {lm.world} "
                    "ranks, so every rank computes them (narrowed where they meet sharded heads)")
        return False
    return False


def _is_one(d) -> bool:
    return isinstance(d, int) and d == 1


def _viewed(lm: LayoutMap, node: torch.fx.Node, out: Shard) -> bool:
    lm.view_sizes[node] = (out.dim, out.size, out.length)
    return _local(lm, node, out)


def propagate_heads(lm: LayoutMap, node: torch.fx.Node) -> bool:
    """Layout for the shape ops above; False when no rule applies (the caller gathers)."""
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        outs = lm.outputs.get(node.args[0])
        if outs is None or not isinstance(node.args[1], int):
            return False
        return _local(lm, node, outs[node.args[1]])
    if t in _ATTENTION:
        return _attention(lm, node)
    if t in (aten.bmm.default, aten.baddbmm.default):
        return _bmm(lm, node)
    if t is aten.cat.default:
        return _cat(lm, node)
    if t is aten.stack.default:
        return _cat(lm, node, stack=True)
    src = lm.layouts.get(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if src is None or _val(node.args[0]) is None:
        return False
    if src.split.whole and t not in (aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor):
        return False  # a fused output with whole components: only its split into components is followed
    ndim = _val(node.args[0]).dim()
    p = ndim + src.dim
    if t in (aten.transpose.int, aten.permute.default):
        if t is aten.permute.default:
            new = [_norm(d, ndim) for d in node.args[1]].index(p)
        else:
            a, b = (_norm(int(d), ndim) for d in node.args[1:3])
            new = b if p == a else a if p == b else p
        return _local(lm, node, src.moved(new - ndim))
    if t in (aten.unsqueeze.default, aten.squeeze.dim, aten.select.int, aten.view_as_complex.default,
             aten.view_as_real.default, aten.expand.default):
        out_ndim = _val(node).dim()
        if t is aten.select.int and _norm(node.args[1], ndim) == p:
            return False
        if t is aten.squeeze.dim and _norm(node.args[1], ndim) == p:
            return False
        if t is aten.view_as_complex.default and src.dim == -1:
            return False
        # the cut moves (counted from the left) only when a dim is added or removed before it
        if t is aten.unsqueeze.default:
            d = _norm(node.args[1], out_ndim)
            new = p + (1 if d <= p else 0)
        elif t in (aten.squeeze.dim, aten.select.int):
            d = _norm(node.args[1], ndim)
            new = p - (1 if d < p and out_ndim < ndim else 0)  # squeezing a dim that is not 1 is a no-op
        elif t is aten.expand.default:
            new = p + out_ndim - ndim
            size = node.args[1][new]
            if not (size == -1 or private.known_equal(size, _val(node.args[0]).shape[p])):
                return False
            lm.view_sizes[node] = (new - out_ndim, src.size, src.length)
        else:  # complex views drop or add the trailing pair dim
            new = p
        return _local(lm, node, src.moved(new - out_ndim))
    if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
        return _split(lm, node, src, ndim, p)
    if t in _REDUCTIONS:
        return _reduce(lm, node, src, ndim, p)
    if t is aten.native_layer_norm.default:  # LayerNorm over trailing dims (Phi / StableLM qk_layernorm)
        if p >= ndim - len(node.args[1]) or any(lm.layouts.get(a) is not None for a in node.args[2:4]):
            return False  # the cut dim normalized, or a weight / bias that is itself cut: gather
        for arg in _all_args(node):
            lm.read(node, arg, LOCAL)  # weight and bias span the normalized dims only
        lm.outputs[node] = [src, src, src]  # out, mean, rstd: the same dims before the normalized ones
        lm.layouts[node] = None
        return True
    if t in _DIM_OPS:
        d = _norm(node.args[_DIM_OPS[t]] if len(node.args) > _DIM_OPS[t] else 0, ndim)
        if d != p:
            return _local(lm, node, src)
        if t is aten.slice.Tensor:
            return _take_parts(lm, node, src, ndim, p)
    return False


def _part_ranges(split: Split, edges: list[int]) -> list[tuple[int, int]] | None:
    """Component ranges ``[i, j)`` covering element ranges between ``edges``; None if an edge
    falls inside a component."""
    offsets, acc = [0], 0
    for part in split.parts:
        acc += part * split.unit
        offsets.append(acc)
    if any(e not in offsets for e in edges):
        return None
    return [(offsets.index(a), offsets.index(b)) for a, b in zip(edges, edges[1:])]


def _cut_wish(lm: LayoutMap, node: torch.fx.Node, src: Shard, edges: list[int]) -> None:
    if all(e % src.split.unit == 0 for e in edges):
        lm.wish(src.origins, "cut", frozenset(e // src.split.unit for e in edges[1:-1]), f"{_op_name(node)} of a fused output")


def _sub(src: Shard, i: int, j: int) -> Shard | None:
    sub = src.split.sub(i, j)
    return None if sub is None else src.moved(src.dim, sub)


def _sub_length(src: Shard, i: int, j: int) -> int:
    return sum(length for _, length in src.pieces[i:j])


def _split(lm: LayoutMap, node: torch.fx.Node, src: Shard, ndim: int, p: int) -> bool:
    t = node.target
    dim = node.args[1] if t is aten.unbind.int and len(node.args) > 1 else node.args[2] if len(node.args) > 2 else 0
    d = _norm(dim, ndim)
    outs = [u for u in node.users]
    if any(u.target is not operator.getitem for u in outs):
        return False
    n_out = len(_val_list(node))
    if d != p:
        out = src if t is not aten.unbind.int else src.moved(src.dim + (1 if d > p else 0))
        for arg in _all_args(node):
            lm.read(node, arg, LOCAL)
        lm.outputs[node] = [out] * n_out
        lm.layouts[node] = None
        return True
    size = _val(node.args[0]).shape[p]
    if t is aten.unbind.int or not private.known_equal(size, src.size):
        return False
    widths = [node.args[1]] * n_out if t is aten.split.Tensor else list(node.args[1])
    edges = [0]
    for w in widths:
        edges.append(min(edges[-1] + w, src.size))
    ranges = _part_ranges(src.split, edges)
    if ranges is None:
        _cut_wish(lm, node, src, edges)
        return False
    subs = [_sub(src, i, j) for i, j in ranges]
    for arg in _all_args(node):
        lm.read(node, arg, LOCAL)
    lm.outputs[node] = subs  # a whole component is a replicated output
    lm.part_sizes[node] = tuple(_sub_length(src, i, j) for i, j in ranges)
    lm.layouts[node] = None
    return True


def _val_list(node: torch.fx.Node) -> list:
    v = node.meta.get("val")
    return list(v) if isinstance(v, (list, tuple)) else []


def _take_parts(lm: LayoutMap, node: torch.fx.Node, src: Shard, ndim: int, p: int) -> bool:
    """``x[..., a:b]`` on the cut dim: whole components only (a fused output's q, k or v)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2] or 0, args[3], args[4] or 1
    size = _val(node.args[0]).shape[p]
    if step != 1 or not private.known_equal(size, src.size) or not isinstance(start, int):
        return False
    end = src.size if end is None or (isinstance(end, int) and end > src.size) else end
    if not isinstance(end, int):
        return False
    start, end = start % src.size if start < 0 else start, end % src.size if end < 0 else end
    ranges = _part_ranges(src.split, [start, end])
    if ranges is None:
        _cut_wish(lm, node, src, [0, start, end, src.size])
        return False
    (i, j), = ranges
    out = _sub(src, i, j)
    lm.part_sizes[node] = (_sub_length(src, 0, i), _sub_length(src, i, j))
    return _local(lm, node, out)  # None: whole components, held by every rank (replicated)


def _reduce(lm: LayoutMap, node: torch.fx.Node, src: Shard, ndim: int, p: int) -> bool:
    """A reduction over dims that do not include the cut dim: each rank reduces its own part."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return False  # every dim reduced
    dims = {_norm(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    if p in dims:
        return False
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    new = p if keepdim else p - sum(1 for d in dims if d < p)
    return _local(lm, node, src.moved(new - (ndim if keepdim else ndim - len(dims))))


def _cat(lm: LayoutMap, node: torch.fx.Node, stack: bool = False) -> bool:
    """cat (or stack) of operands cut alike, along a dim that is not the cut one."""
    tensors = node.args[0]
    lays = [lm.layouts.get(a) for a in tensors]
    if any(lay is None or lay.split.whole for lay in lays):
        return False
    first = finest(lays)
    if not all(first.alike(lay) for lay in lays):
        return False
    ndim = _val(tensors[0]).dim()
    out_ndim = ndim + 1 if stack else ndim
    d = _norm(node.args[1] if len(node.args) > 1 else 0, out_ndim)
    p = ndim + first.dim
    if d == p and not stack:
        return False
    new = p + 1 if stack and d <= p else p  # stack inserts a dim at d
    origins = frozenset().union(*(lay.origins for lay in lays))
    return _local(lm, node, Shard(first.split, origins, new - out_ndim, lm.world, lm.rank))


def _heads_alike(lm: LayoutMap, node: torch.fx.Node, operands: list[torch.fx.Node], dim: int) -> Shard | None:
    """The shard every operand has (or can be narrowed to) on ``dim``; wishes when they differ."""
    lays = [lm.layouts.get(a) for a in operands]
    sharded = [lay for lay in lays if lay is not None]
    if not sharded or any(lay.dim != dim for lay in sharded):
        return None
    first = finest(sharded)
    if not all(first.alike(lay) for lay in sharded):
        unify(lm, sharded, _op_name(node))
        _replicate_wish(lm, node, sharded)
        return None
    if first.split.fewest_units(lm.world) < 1:
        return None  # a rank without heads: the attention kernels cannot run on zero heads
    for a, lay in zip(operands, lays):
        v = _val(a)
        if lay is None and (v is None or v.dim() < -dim or not private.known_multiple(v.shape[dim], first.size)):
            return None
    return first


def _replicate_wish(lm: LayoutMap, node: torch.fx.Node, shards: list[Shard]) -> None:
    """GQA with fewer KV heads than ranks: coarser units would leave ranks without heads, so
    keep the coarser-cut operands' projections whole (each rank narrows the heads it needs)."""
    finest = min(shards, key=lambda s: s.split.unit)
    if finest.split.fewest_units(lm.world) < 1:
        return
    for s in shards:
        if s.split.unit > finest.split.unit and len(s.split.parts) == 1:
            unit = math.lcm(s.split.unit, finest.split.unit)
            if Split((s.size // unit,), unit).fewest_units(lm.world) < 1:
                lm.wish(s.origins, "replicate", None,
                        f"{s.split.parts[0]} KV heads cannot be cut over {lm.world} ranks; each rank narrows "
                        f"them to its query heads at {_op_name(node)}")


def _op_arg(node: torch.fx.Node, where: int | str | None, name: str) -> object:
    if where is None:
        return None
    if isinstance(where, str):
        return node.kwargs.get(where)
    return node.args[where] if len(node.args) > where else node.kwargs.get(name)


def _attention(lm: LayoutMap, node: torch.fx.Node) -> bool:
    spec = _ATTENTION[node.target]
    q, k, v = node.args[:3]
    mask = _op_arg(node, spec.mask, "attn_bias")
    if mask is not None and (lm.layouts.get(mask) is not None or _val(mask) is None):
        return False
    if spec.debug_mask is not None and _op_arg(node, spec.debug_mask, "return_debug_mask"):
        return False  # a debug mask output per head pair: run whole
    groups = _kv_groups(q, k)
    if groups is None or (groups > 1 and not spec.gqa):
        return False
    if groups > 1:
        first = _gqa_heads(lm, node, q, k, v, groups)
    else:
        first = _heads_alike(lm, node, [q, k, v], -3)
    if first is None or (lm.layouts.get(q) is None and groups > 1):
        _off_heads_wish(lm, node, [q, k, v])
        return False  # (a replicated q with K/V cut alike by heads is narrowed to this rank's heads)
    origins = frozenset().union(*(lm.layouts[a].origins for a in (q, k, v) if lm.layouts.get(a) is not None))
    out = Shard(first.split, origins, -3, lm.world, lm.rank)
    for arg in _all_args(node):
        if arg in (q, k, v) and lm.layouts.get(arg) is not None:
            lm.read(node, arg, LOCAL)
        elif arg in (k, v) and groups > 1:
            lm.read(node, arg, NARROW_GROUPS)
        elif arg in (q, k, v) or arg is mask:
            _read_as_shard(lm, node, arg, out)
        else:
            lm.read(node, arg, LOCAL)
    lm.outputs[node] = [out, out.moved(spec.lse_dim)] + [None] * (len(_val_list(node)) - 2)
    lm.layouts[node] = None
    return True


def _off_heads_wish(lm: LayoutMap, node: torch.fx.Node, operands: list[torch.fx.Node]) -> None:
    """Operands cut by heads meet others cut on another dim (one K/V head's features: MQA, where
    the head view keeps the cut on ``head_dim``): keep those others' projections whole."""
    lays = [lm.layouts.get(a) for a in operands]
    if not any(lay is not None and lay.dim == -3 and lay.split.fewest_units(lm.world) >= 1 for lay in lays):
        return
    off = [lay for lay in lays if lay is not None and lay.dim != -3]
    if off:
        lm.wish(frozenset().union(*(s.origins for s in off)), "replicate", None,
                f"K/V are not cut by heads where they meet the query heads at {_op_name(node)}; each rank "
                "narrows them to its query heads")


def _kv_groups(q: torch.fx.Node, k: torch.fx.Node) -> int | None:
    """Query heads per K/V head (1 unless K/V are not repeated: SDPA's ``enable_gqa``)."""
    qv, kv = _val(q), _val(k)
    if qv is None or kv is None or qv.dim() < 3 or kv.dim() < 3:
        return None
    hq, hk = qv.shape[-3], kv.shape[-3]
    if private.known_equal(hq, hk):
        return 1
    if not (isinstance(hq, int) and isinstance(hk, int)) or hk < 1 or hq % hk:
        return None
    return hq // hk


def _gqa_heads(lm: LayoutMap, node: torch.fx.Node, q: torch.fx.Node, k: torch.fx.Node, v: torch.fx.Node,
               n: int) -> Shard | None:
    """Attention where query head ``h`` reads K/V head ``h // n`` (K/V not repeated).

    K/V cut so that each rank holds the K/V heads of exactly its query heads run as they are
    (the kernel repeats them locally); whole K/V are narrowed to the heads of this rank's query
    heads (``NARROW_GROUPS``). Otherwise a wish: q in units of ``n`` heads, K/V in matching
    units, or K/V kept whole when there are fewer K/V heads than ranks.
    """
    lq, lk, lv = (lm.layouts.get(a) for a in (q, k, v))
    if lq is None or lq.dim != -3 or lq.split.fewest_units(lm.world) < 1 or (lk is None) != (lv is None):
        return None
    if lk is None:
        return lq
    if lk.dim != -3 or lv.dim != -3 or not lk.alike(lv):
        return None
    grouped = [[(a * n, b * n) for a, b in ranges] for ranges in lk.split.owned(lm.world)]
    if grouped == lq.split.owned(lm.world):
        return lq
    if len(lq.split.parts) == 1 and len(lk.split.parts) == 1:
        unit = math.lcm(lq.split.unit, n * lk.split.unit)
        q_to, kv_to = lq.split.coarsen(unit // lq.split.unit), lk.split.coarsen(unit // (n * lk.split.unit))
        where = f"{_op_name(node)} ({n} query heads per K/V head) needs query units of {unit} heads"
        if q_to is not None and kv_to is not None and min(q_to.fewest_units(lm.world), kv_to.fewest_units(lm.world)) >= 1:
            for s, to in ((lq, q_to), (lk, kv_to), (lv, kv_to)):
                if to != s.split:
                    lm.wish(s.origins, "coarsen", to.unit // s.split.unit, where)
            return None
    lm.wish(lk.origins | lv.origins, "replicate", None,
            f"{lk.size} K/V heads cannot be cut over {lm.world} ranks to match the query heads; each rank "
            f"narrows them to those of its query heads at {_op_name(node)}")
    return None


def _bmm(lm: LayoutMap, node: torch.fx.Node) -> bool:
    """bmm on a batch dim that merges batch and heads (softmax-matmul attention), or baddbmm with
    a bias added to it (BLOOM's ALiBi, ``[B * H, 1, T]``): a bias spanning the merged dim is cut
    like the operands (narrowed if replicated); one of size 1 there broadcasts."""
    bias = node.args[0] if node.target is aten.baddbmm.default else None
    a, b = node.args[1:3] if bias is not None else node.args[:2]
    bias_val = _val(bias) if bias is not None else None
    spans = bias_val is not None and bias_val.dim() >= 3 and not private.known_equal(bias_val.shape[-3], 1)
    first = _heads_alike(lm, node, [a, b, bias] if spans else [a, b], -3)
    if first is None:
        _off_heads_wish(lm, node, [a, b])
        return False
    origins = frozenset().union(*(lm.layouts[x].origins for x in (a, b, bias) if lm.layouts.get(x) is not None))
    out = Shard(first.split, origins, -3, lm.world, lm.rank)
    for arg in _all_args(node):
        _read_as_shard(lm, node, arg, out) if arg in (a, b, bias) else lm.read(node, arg, LOCAL)
    lm.layouts[node] = out
    return True
