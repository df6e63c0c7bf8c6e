"""Taking apart and putting together: split, unbind, slice, index, cat, stack, repeat, getitem of a tuple.

Before (a fused qkv colwise on [B, T, 3*D])::

    q, k, v = split(addmm_qkv, D, -1)          # getitem 0, 1, 2
After: each rank splits its own ``[q_r | k_r | v_r]`` at its local sizes; q, k and v are each
a Shard of D. Along a dim that is not cut, every op here keeps the cut. On the cut dim, a split or
slice (or a constant index of consecutive positions) must fall on component boundaries (a fused
``[q | k | v]``, DiffLlama's two halves of the heads; otherwise a wish asks the plan to cut the origin
into those components). A repeat along the cut dim tiles its components: each rank's local repeat
is its part of every tile.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.layout.nodes import all_args, is_parameter, norm_dim, op_name, val, val_list
from dynashard.layout.shard import LayoutMap, Record, Shard, WishKind, finest
from dynashard.layout.split import Split, joined
from dynashard.plan.rules.inplace import returned, skipped_by_cat, wish_state
from dynashard.plan.rules.registry import rule
from dynashard.rewrite.lowerings import TakeParts

aten = torch.ops.aten


@rule(operator.getitem)
def getitem(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    outs = lm.outputs.get(node.args[0])
    if outs is None or not isinstance(node.args[1], int):
        return None
    return lm.keep(node, outs[node.args[1]])


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def split(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    t = node.target
    found = lm.input_shard(node, whole_ok=t is not aten.unbind.int)
    if found is None:
        return None
    src, ndim, p = found
    dim = node.args[1] if t is aten.unbind.int and len(node.args) > 1 else node.args[2] if len(node.args) > 2 else 0
    d = norm_dim(dim, ndim)
    if any(u.target is not operator.getitem for u in node.users):
        return None
    n_out = len(val_list(node))
    if d != p:
        out = src if t is not aten.unbind.int else src.moved(src.dim + (1 if d > p else 0))
        return lm.keep(node, None, outputs=(out,) * n_out)
    size = val(node.args[0]).shape[p]
    if t is aten.unbind.int or not private_aten.known_equal(size, src.size):
        return None
    widths = [node.args[1]] * n_out if t is aten.split.Tensor else list(node.args[1])
    edges = [0]
    for w in widths:
        edges.append(min(edges[-1] + w, src.size))
    ranges = _part_ranges(src.split, edges)
    if ranges is None:
        if _refine_wish(lm, node, src, edges):
            return None
        carved = _carve(lm, src, edges)
        if carved is None:
            _cut_wish(lm, node, src, edges)
            return None
        return lm.keep(node, None, outputs=tuple(carved),
                       lowering=TakeParts(tuple(s.length for s in carved), src.dim))
    outputs = tuple(_sub(src, i, j) for i, j in ranges)  # a whole component is a replicated output
    return lm.keep(node, None, outputs=outputs,
                   lowering=TakeParts(tuple(_sub_length(src, i, j) for i, j in ranges), src.dim))


def _carve(lm: LayoutMap, src: Shard, edges: list[int]) -> list[Shard] | None:
    """Pieces each rank computes from what it holds (``q.split(1, dim=heads)``, per-head norms or
    scales, put back by ``cat``), when re-cutting the origin into those pieces instead would leave
    a rank without any (the balanced deal gives every one-head piece to the first ranks). Pieces
    that are gathered later instead (DiffLlama's V halves of one K/V head, repeated) make the auto
    plan keep their origin whole (``LayoutMap._charge``)."""
    if any(e % src.split.unit for e in edges):
        return None
    units = [e // src.split.unit for e in edges]
    recut = src.split.cut(set(units[1:-1])) if src.split.deals is None and len(src.split.parts) == 1 else None
    if recut is None or all(recut.local(lm.world, r) > 0 for r in range(lm.world)):
        return None  # the origin can be re-cut into these pieces (a fused [q | k | v]): wish for it
    pieces = src.split.carve(units, lm.world)
    return None if pieces is None else [src.moved(src.dim, s) for s in pieces]


def _refine_wish(lm: LayoutMap, node: torch.fx.Node, src: Shard, edges: list[int]) -> bool:
    """Pieces the origin's units are too coarse to deal to every rank, though finer units would
    (DiffLlama's two halves of 4 heads on 3 ranks, the heads first grouped in twos for GQA keys cut
    2/1/1): wish the origin cut at the pieces in the finest such units (its keys then meet a cut
    into halves: ``LayoutMap.unify`` re-cuts them or keeps them whole). True when wished."""
    split = src.split
    if split.refine(1) is None or any(e % split.unit for e in edges):
        return False  # (one balanced component only: a fused output's parts are not re-dealt)
    if not split.empties_a_rank(split.cut({e // split.unit for e in edges[1:-1]}), lm.world):
        return False  # (the usual wish to cut at those offsets)
    for k in range(2, split.unit + 1):
        finer = split.refine(k)
        if finer is None or any(e % finer.unit for e in edges):
            continue
        offsets = frozenset(e // finer.unit for e in edges[1:-1])
        if not split.empties_a_rank(finer.cut(offsets), lm.world):
            lm.wish(src.origins, WishKind.REFINE, (k, offsets),
                    f"{op_name(node)} takes pieces that units of {split.unit} cannot deal to every rank")
            return True
    return False


@rule(aten.repeat.default)
def repeat(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """``x.repeat(...)``: along other dims the cut is kept; ``n`` times along the cut dim, the output
    holds the components ``n`` times over (DiffLlama's ``v_half.repeat(1, 2, 1, 1)``), and every
    rank's local repeat is its part of each copy. Carved pieces (dealt unevenly) are not tiled."""
    found = lm.input_shard(node, whole_ok=True)
    if found is None:
        return None
    src, ndim, p = found
    times = node.args[1][len(node.args[1]) - ndim + p]
    if not isinstance(times, int) or times == 1:
        return lm.keep(node, src) if times == 1 else None
    split = src.split
    if split.deals is not None or not private_aten.known_equal(val(node.args[0]).shape[p], src.size):
        return None  # (a batch dim merged in front of the cut one would interleave the copies)
    n = len(split.parts)
    tiled = Split(split.parts * times, split.unit, frozenset(i + k * n for k in range(times) for i in split.whole))
    return lm.keep(node, src.moved(src.dim, tiled))


@rule(aten.slice.Tensor)
def slice_(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """Along another dim: the cut kept. ``x[..., a:b]`` on the cut dim: whole components only (a
    fused output's q, k or v)."""
    found = lm.input_shard(node, whole_ok=True)
    if found is None:
        return None
    src, ndim, p = found
    if norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim) != p:
        return lm.keep(node, src)
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2] or 0, args[3], args[4] or 1
    size = val(node.args[0]).shape[p]
    if step != 1:
        return _every_kth(lm, node, src, start, end, step, size)
    if not private_aten.known_equal(size, src.size) or not isinstance(start, int):
        return None
    end = src.size if end is None or (isinstance(end, int) and end > src.size) else end
    if not isinstance(end, int):
        return None
    start, end = start % src.size if start < 0 else start, end % src.size if end < 0 else end
    return _cut_range(lm, node, src, start, end)


def _every_kth(lm: LayoutMap, node: torch.fx.Node, src: Shard, start: object, end: object, step: object,
               size: object) -> Record | None:
    """``x[..., s::k]`` over the whole cut dim (GPT-OSS's interleaved ``gate_up[..., ::2]`` and
    ``[..., 1::2]``): when every unit is a multiple of ``k`` elements, each rank's part starts at a
    multiple of ``k`` and its own ``[s::k]`` is its part of the result (units ``k`` times smaller).
    Otherwise a wish for units of ``k``."""
    if not (isinstance(step, int) and isinstance(start, int) and 0 <= start < step) or src.split.deals is not None:
        return None
    if not private_aten.known_equal(size, src.size) or not (end is None or (isinstance(end, int) and end >= src.size)):
        return None
    if src.split.unit % step:
        k = step // math.gcd(src.split.unit, step)
        coarser = src.split.coarsen(k)
        if coarser is not None and coarser.fewest_units(lm.world) >= 1:
            lm.wish(src.origins, WishKind.COARSEN, k, f"{op_name(node)} takes every {step}th element")
        return None
    split = src.split
    return lm.keep(node, src.moved(src.dim, Split(split.parts, split.unit // step, split.whole)))


def _cut_range(lm: LayoutMap, node: torch.fx.Node, src: Shard, start: int, end: int) -> Record | None:
    """Elements ``[start, end)`` of the cut dim: whole components (a wish to cut at those bounds
    otherwise); this rank's part of them, narrowed by the rewrite (``TakeParts``)."""
    ranges = _part_ranges(src.split, [start, end])
    if ranges is None:
        _cut_wish(lm, node, src, [0, start, end, src.size])
        return None
    (i, j), = ranges
    # (None: whole components, held by every rank: replicated)
    return lm.keep(node, _taken(lm, node, src, i, j),
                   lowering=TakeParts((_sub_length(src, 0, i), _sub_length(src, i, j)), src.dim))


@rule(aten.index.Tensor)
def index(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """``x[..., idx, ...]`` with one integer index tensor, on a dim that is not cut: the cut is kept
    (HF Falcon's ``qkv[:, :, :, [-2]]`` takes one part of every KV group, the groups cut). On the
    cut dim, a constant index of consecutive positions is the slice it equals (Falcon-7B's
    multi-query ``fused[..., [-2], :]`` takes the one k head out of ``[q heads | k | v]``)."""
    found = lm.input_shard(node, whole_ok=True)
    if found is None:
        return None
    src, ndim, p = found
    given = [(d, i) for d, i in enumerate(node.args[1]) if i is not None]
    if len(given) != 1:
        return None  # several index tensors broadcast together and may move their dims first
    (d, idx), = given
    if lm.layouts.get(idx) is not None or val(idx) is None or val(idx).dtype in (torch.bool, torch.uint8):
        return None  # a sharded index, or a mask (it spans several dims)
    if d == p:
        return _index_as_slice(lm, node, src, idx)
    if src.split.whole:
        return None
    out_ndim = val(node).dim()
    # Dims before the indexed one keep their place from the left, dims after it from the right.
    return lm.keep(node, src.moved(p - out_ndim) if p < d else src)


def _index_as_slice(lm: LayoutMap, node: torch.fx.Node, src: Shard, idx: torch.fx.Node) -> Record | None:
    values = private_aten.constant_value(idx)
    size = val(node.args[0]).shape[val(node.args[0]).dim() + src.dim]
    if values is None or values.dim() != 1 or not values.numel() or not private_aten.known_equal(size, src.size):
        return None
    positions = [int(v) % src.size for v in values.tolist()]
    start, end = positions[0], positions[-1] + 1
    if positions != list(range(start, end)):
        return None
    return _cut_range(lm, node, src, start, end)


@rule(aten.cat.default)
def cat(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    return _cat(lm, node, stack=False)


@rule(aten.stack.default)
def stack(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    return _cat(lm, node, stack=True)


def _cat(lm: LayoutMap, node: torch.fx.Node, stack: bool) -> Record | None:
    """cat (or stack) of operands cut alike, along a dim that is not the cut one. ``cat`` skips
    1-D empty operands (torch's legacy rule: HF's DynamicCache starts as ``torch.tensor([])``), and
    narrows replicated ones that span the cut dim (GPT-OSS's attention sinks, one per head, next to
    the head-sharded scores)."""
    tensors = [a for a in node.args[0] if stack or not skipped_by_cat(a)]
    if not tensors:
        return None
    lays = [lm.layouts.get(a) for a in tensors]
    if not stack and any(lay is not None for lay in lays) and any(lay is None for lay in lays):
        return _cat_narrowing(lm, node, tensors, lays)
    if any(lay is None or lay.split.whole for lay in lays):
        return None
    if not stack and returned(node):
        _follow_recut(lm, node, tensors, lays)
    first = finest(lays)
    if not all(first.alike(lay) for lay in lays) and not _along_cut(node, tensors, lays, stack):
        return None
    ndim = val(tensors[0]).dim()
    out_ndim = ndim + 1 if stack else ndim
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, out_ndim)
    p = ndim + first.dim
    if d == p and not stack:
        return _join(lm, node, tensors, lays)
    new = p + 1 if stack and d <= p else p  # stack inserts a dim at d
    origins = frozenset().union(*(lay.origins for lay in lays))
    return lm.keep(node, Shard(first.split, origins, new - out_ndim, lm.world, lm.rank))


def _cat_narrowing(lm: LayoutMap, node: torch.fx.Node, tensors: list[torch.fx.Node],
                   lays: list[Shard | None]) -> Record | None:
    """cat of Shards cut alike and replicated operands, along another dim: each replicated one
    narrowed to this rank's part of the cut dim, which it must span whole (cat does not broadcast)."""
    sharded = [lay for lay in lays if lay is not None]
    first = finest(sharded)
    if first.split.whole or not all(first.alike(lay) for lay in sharded):
        return None
    ndim = val(tensors[0]).dim()
    if norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim) == ndim + first.dim:
        return None  # along the cut dim: the replicated operand's elements are no rank's part
    for a, lay in zip(tensors, lays):
        if lay is None and not (val(a).dim() == ndim and private_aten.known_equal(val(a).shape[first.dim], first.size)
                                and lm.can_read_as_shard(a, first, ndim)):
            return None
    out = Shard(first.split, frozenset().union(*(lay.origins for lay in sharded)), first.dim, lm.world, lm.rank)
    if returned(node):  # a cache grown by cat (HF's DynamicCache): the input it grows held cut like it
        for a, lay in zip(tensors, lays):
            if lay is None and a.op == "placeholder" and not is_parameter(a):
                wish_state(lm, node, a, out)
    return Record(out, {a: lm.as_shard(a, out) for a in all_args(node)})


def _follow_recut(lm: LayoutMap, node: torch.fx.Node, tensors: list[torch.fx.Node], lays: list[Shard]) -> None:
    """A cache held cut (an input in ``lm.states``) grown by cat with new Shards its origin has since been
    re-cut into (DiffLlama's v in two halves of heads, a round after the cache was first held): wish it
    held as the new ones are. Until then the two meet cut differently and are gathered."""
    fresh = [lay for a, lay in zip(tensors, lays) if a not in lm.states]
    if not fresh or not all(fresh[0].alike(lay) for lay in fresh):
        return
    for a, lay in zip(tensors, lays):
        if a in lm.states and not lay.alike(fresh[0]):
            wish_state(lm, node, a, fresh[0])


def _along_cut(node: torch.fx.Node, tensors: list[torch.fx.Node], lays: list[Shard], stack: bool) -> bool:
    """A cat along the dim every operand is cut on (operands need not be cut alike)."""
    if stack or len({lay.dim for lay in lays}) != 1:
        return False
    ndim = val(tensors[0]).dim()
    return norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim) == ndim + lays[0].dim


def _join(lm: LayoutMap, node: torch.fx.Node, tensors: list[torch.fx.Node], lays: list[Shard]) -> Record | None:
    """cat along the cut dim: each rank's output is its operands' parts side by side, which is its
    part of the joined split (carved pieces put back in order are the original cut again)."""
    dim = lays[0].dim
    if any(not private_aten.known_equal(val(a).shape[dim], lay.size) for a, lay in zip(tensors, lays)):
        return None  # a batch dim merged in front: the pieces would interleave
    split = joined([lay.split for lay in lays], lm.world)
    if split is None:
        return None
    origins = frozenset().union(*(lay.origins for lay in lays))
    return lm.keep(node, Shard(split, origins, dim, lm.world, lm.rank))


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
    if src.split.deals is not None:
        return  # a carved piece: its offsets are not its origin's
    if all(e % src.split.unit == 0 for e in edges):
        lm.wish(src.origins, WishKind.CUT, frozenset(e // src.split.unit for e in edges[1:-1]),
                f"{op_name(node)} of a fused output")


def _sub(src: Shard, i: int, j: int) -> Shard | None:
    sub = src.split.sub(i, j)
    return None if sub is None else src.moved(src.dim, sub)


def _taken(lm: LayoutMap, node: torch.fx.Node, src: Shard, i: int, j: int) -> Shard | None:
    """Components ``[i, j)`` of a fused Shard taken out by a slice or index. When some rank holds
    none of them (Falcon-7B's one k head out of ``[q heads | k | v]`` on 2 ranks), ask for the
    fused origin's small components held whole, as for fewer KV heads than ranks."""
    out = _sub(src, i, j)
    if out is not None and len(src.split.parts) > 1 and out.split.fewest_units(lm.world) < 1:
        lm.wish(out.origins, WishKind.REPLICATE, 0,
                f"{op_name(node)} takes {sum(out.split.parts)} unit(s) of a fused output, fewer than {lm.world} ranks")
    return out


def _sub_length(src: Shard, i: int, j: int) -> int:
    return sum(length for _, length in src.pieces[i:j])
