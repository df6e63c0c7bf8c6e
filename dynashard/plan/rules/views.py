"""Views and dim moves: follow the cut dim through one dim map per op.

Before (q colwise on [B*T, H*Dh])::

    q = view(mm_q, [B, T, H, Dh]); q = transpose(q, 1, 2); q = unsqueeze(q, 2)
After: the same ops on this rank's heads, ``H`` in the view's size argument rewritten (8 -> 2
on 4 ranks); the Shard moves from the last dim to the head dim and on.

Every op here is described by a :class:`DimMap` (in the spirit of DTensor's ``_view_ops``): where
each input dim goes (one to one, or removed), plus, for a reshape, the group of dims that is
regrouped. One function, :func:`follow`, moves the cut through it:
  * a dim that maps one to one carries the cut (a removed or broadcast cut dim: gather);
  * in a regrouped group the cut must land on a dim whose inner dims fit inside one unit
    (``[H*Dh] -> [H, Dh]`` with units of ``Dh``; ``[B, H] -> [B*H]``; ``[Hkv, n] -> [Hkv*n]``
    makes units of ``n`` heads). When it does not only because the origins are cut too finely, a
    wish asks for coarser units (or, for fewer KV heads than ranks, for the projection whole);
  * a fused output whose components repeat once per group (HF Falcon's ``[q heads | k | v]`` per KV
    group, viewed ``[.., KV, n + 2, Dh]``) with fewer groups than ranks is cut inside every group:
    each rank holds its part of every group's query heads, k and v whole (``_per_group``).
A new view-like op needs a dim-map function in ``_DIM_MAPS`` and nothing else.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.layout.nodes import is_one, norm_dim, op_name, size_at, val
from dynashard.layout.shard import LayoutMap, Record, Resize, Shard, WishKind
from dynashard.layout.split import Split
from dynashard.plan.rules.registry import rule

aten = torch.ops.aten
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SIZED = (*RESHAPES, aten.expand.default)  # ops whose size argument names the cut dim's size


@dataclasses.dataclass(frozen=True)
class DimMap:
    """Input dim ``i`` (from the left) becomes output dim ``moves[i]``, or carries no cut (None).
    ``group``: a reshape's regrouped dims, ``(in_start, in_end, out_start, out_end)`` as positions
    in the shapes without their size-1 dims, with ``kept_in`` / ``kept_out`` mapping those
    positions back to real dims."""

    moves: tuple[int | None, ...]
    group: tuple[int, int, int, int] | None = None
    kept_in: tuple[int, ...] = ()
    kept_out: tuple[int, ...] = ()


def _transpose(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    a, b = (norm_dim(int(d), ndim) for d in node.args[1:3])
    return DimMap(tuple(b if i == a else a if i == b else i for i in range(ndim)))


def _permute(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    order = [norm_dim(d, ndim) for d in node.args[1]]
    return DimMap(tuple(order.index(i) for i in range(ndim)))


def _unsqueeze(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    d = norm_dim(node.args[1], out_ndim)
    return DimMap(tuple(i + (1 if d <= i else 0) for i in range(ndim)))


def _remove_dim(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    """select, squeeze.dim: the dim goes (a squeeze of a dim that is not 1 keeps the rest in place)."""
    d = norm_dim(node.args[1], ndim)
    removed = out_ndim < ndim
    return DimMap(tuple(None if i == d else i - (1 if d < i and removed else 0) for i in range(ndim)))


def _expand(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    """New leading dims; a dim keeps its cut only where its size is unchanged (not broadcast)."""
    shift, in_shape = out_ndim - ndim, val(node.args[0]).shape

    def kept(i: int) -> bool:  # (a size computed in the graph is an fx node: not provably equal)
        size = node.args[1][i + shift]
        return not isinstance(size, torch.fx.Node) and (size == -1 or private_aten.known_equal(size, in_shape[i]))

    return DimMap(tuple(i + shift if kept(i) else None for i in range(ndim)))


def _view_as_complex(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    return DimMap(tuple(i if i < ndim - 1 else None for i in range(ndim)))  # the trailing pair is gone


def _same_dims(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    return DimMap(tuple(range(ndim)))  # view_as_real adds a trailing pair dim


def _reshape(node: torch.fx.Node, ndim: int, out_ndim: int) -> DimMap:
    """Dims equal from the left or from the right map one to one; the rest is one regrouped group.
    Size-1 dims carry no elements and are matched around (einsum views [B, H, T, Dh, 1] -> [B*H, T, Dh])."""
    full_before, full_after = list(val(node.args[0]).shape), list(val(node).shape)
    kept_in = tuple(i for i, d in enumerate(full_before) if not is_one(d))
    kept_out = tuple(i for i, d in enumerate(full_after) if not is_one(d))
    before, after = [full_before[i] for i in kept_in], [full_after[i] for i in kept_out]
    left = 0
    while left < min(len(before), len(after)) and private_aten.known_equal(before[left], after[left]):
        left += 1
    right = 0
    while (right < min(len(before), len(after)) - left
           and private_aten.known_equal(before[-1 - right], after[-1 - right])):
        right += 1
    moves: list[int | None] = [None] * ndim
    for pos, i in enumerate(kept_in):
        if pos < left:
            moves[i] = kept_out[pos]
        elif pos >= len(before) - right:
            moves[i] = kept_out[len(after) - (len(before) - pos)]
    group = (left, len(before) - right, left, len(after) - right)
    return DimMap(tuple(moves), group, kept_in, kept_out)


_DIM_MAPS = {
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _remove_dim,
    aten.select.int: _remove_dim,
    aten.expand.default: _expand,
    aten.view_as_complex.default: _view_as_complex,
    aten.view_as_real.default: _same_dims,
    **{op: _reshape for op in RESHAPES},
}


@rule(*(op for op in _DIM_MAPS if op not in RESHAPES))
def follow(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """Keep the input's Shard through ``node``'s dim map; None: gather instead."""
    reshape = node.target in RESHAPES
    found = lm.input_shard(node, whole_ok=reshape)  # (a reshape keeps whole components only one to one)
    if found is None:
        return None
    src, ndim, p = found
    out_ndim = val(node).dim()
    if reshape and is_one(val(node.args[0]).shape[p]):
        return None
    dims = _DIM_MAPS[node.target](node, ndim, out_ndim)
    if dims.moves[p] is not None:
        return _moved(lm, node, src.moved(dims.moves[p] - out_ndim))
    if dims.group is None:
        return None
    out = _regroup(lm, node, src, dims, dims.kept_in.index(p))
    return None if out is None else _moved(lm, node, out)


def _moved(lm: LayoutMap, node: torch.fx.Node, out: Shard, rows_scaled: bool = False) -> Record:
    sized = node.target in _SIZED
    return lm.keep(node, out, resize=Resize(out.dim, out.size, out.length, rows_scaled) if sized else None)


def _regroup(lm: LayoutMap, node: torch.fx.Node, src: Shard, dims: DimMap, p: int) -> Shard | None:
    """The cut dim (position ``p`` in the shape without size-1 dims) inside a regrouped group."""
    before = [val(node.args[0]).shape[i] for i in dims.kept_in]
    after = [val(node).shape[i] for i in dims.kept_out]
    in_start, in_end, out_start, out_end = dims.group
    mid_in, mid_out = before[in_start:in_end], after[out_start:out_end]
    inner_in = mid_in[p - in_start + 1 :]
    if not all(isinstance(d, int) for d in inner_in):
        return None
    elems = src.split.unit * math.prod(inner_in)  # elements of the flattened group per unit
    units = sum(src.split.parts)
    out_ndim = val(node).dim()
    inner_out = 1
    for o in range(len(mid_out) - 1, -1, -1):
        if o < len(mid_out) - 1:
            if not isinstance(mid_out[o + 1], int):
                return None
            inner_out *= mid_out[o + 1]
        if o == 0 and not inner_in and len(mid_out) > 1 and _separated(node, dims.kept_out[out_start]):
            fused = _components(lm, node, src, mid_out)
            if fused is not None:
                return fused[0] if fused[0] is None else fused[0].moved(dims.kept_out[out_start + fused[1]] - out_ndim)
        if elems % inner_out == 0:
            new_unit = elems // inner_out
            per_group = _per_group(src.split, mid_out[:o], mid_out[o], new_unit) if p == in_start else None
            if per_group is not None:  # the same components in every group: cut inside each one
                return src.moved(dims.kept_out[out_start + o] - out_ndim, per_group)
            if private_aten.known_multiple(mid_out[o], units * new_unit):
                out = src.moved(dims.kept_out[out_start + o] - out_ndim, src.split.regrouped(new_unit))
                merged = not private_aten.known_equal(mid_out[o], units * new_unit)
                if merged and (out.split.fewest_units(lm.world) < 1 or src.split.whole):
                    return None  # a merged dim needs a part on every rank (its outer size is recovered from it)
                return out  # (whole components stay whole: every unit keeps its elements)
            continue
        if src.split.deals is not None:
            return None  # pieces carved out of a cut: their origins are not what to re-cut
        k = math.lcm(elems, inner_out) // elems  # units k times larger would fit this dim
        coarser = src.split.coarsen(k)
        if coarser is not None and coarser.fewest_units(lm.world) >= 1:
            lm.wish(src.origins, WishKind.COARSEN, k, f"{op_name(node)} into dims of {inner_out} elements")
        elif coarser is not None and _components_in_groups(lm, node, src, mid_out[: o + 1], inner_out,
                                                           dims.kept_out[out_start + o + 1]):
            pass  # (a wish to cut every group into its components, each rank holding a part of each group)
        elif coarser is not None:  # e.g. fewer KV heads than ranks: keep the projection whole
            lm.wish(src.origins, WishKind.REPLICATE, k,
                    f"{'/'.join(map(str, coarser.parts))} heads of {inner_out} cannot be cut over {lm.world} "
                    "ranks, so every rank computes them (narrowed where they meet sharded heads)")
        return None
    return None


def _per_group(split: Split, outer: list, size: object, unit: int) -> Split | None:
    """The cut of one group when ``split`` repeats the same components (and deal) once per group
    (``prod(outer)`` groups of ``size`` positions of ``unit`` units each): HF Falcon's fused
    ``[q heads | k | v]`` per KV group viewed as ``[.., KV, n + 2, head_dim]`` with each group's query
    heads dealt out and its k and v whole. None for anything else (one component: the heads rules)."""
    if not outer or not all(isinstance(d, int) for d in (*outer, size)) or len(split.parts) < 2:
        return None
    groups = math.prod(outer)
    n = len(split.parts) // groups
    if groups < 2 or n < 2 or n * groups != len(split.parts) or split.parts[:n] * groups != split.parts:
        return None  # (one component a group: q, k, v as a dim of their own, ``_components``)
    if sum(split.parts[:n]) * unit != size:
        return None
    first = split.sub(0, n)
    if first is None or any(split.sub(g * n, (g + 1) * n) != first for g in range(groups)):
        return None  # (all whole: a replicated value, not a cut one)
    return first.regrouped(unit)


def _components_in_groups(lm: LayoutMap, node: torch.fx.Node, src: Shard, outer: list, inner: int,
                          d: int) -> bool:
    """Groups fewer than ranks (HF Falcon's 2 KV groups on 4 ranks), each group taken apart on the
    dim after it (``d``: slices and indices of its query heads, its k, its v): wish the origin cut
    into every group's components, so that each rank holds its part of every group's query heads
    (the small components, k and v, are then held whole: ``rules/shapes._taken``). Only where every
    rank gets a query head of every group, else False (the projection is kept whole)."""
    split = src.split
    if len(split.parts) != 1 or split.whole or split.deals is not None or not all(isinstance(x, int) for x in outer):
        return False
    groups, size = math.prod(outer), val(node).shape[d]
    if not isinstance(size, int) or inner % size or (inner // size) % split.unit or inner % split.unit:
        return False
    per_pos, period = inner // size // split.unit, inner // split.unit  # units per position, per group
    if period * groups != split.parts[0]:
        return False
    edges = _taken_apart_at(node, d, size)
    if not edges:
        return False
    cuts = {g * period + e * per_pos for g in range(groups) for e in (0, *edges) if g or e}
    new = split.cut(cuts)
    if max(new.parts[: len(edges) + 1]) < lm.world or split.empties_a_rank(new, lm.world):
        return False
    lm.wish(src.origins, WishKind.CUT, frozenset(cuts),
            f"{op_name(node)} views {groups} groups of components, each taken apart")
    return True


def _taken_apart_at(node: torch.fx.Node, d: int, size: int, depth: int = 4) -> list[int] | None:
    """Inner edges (positions) at which the readers of ``node`` take dim ``d`` apart by slices and
    constant indices of consecutive positions (``qkv[..., :-2, :]``, ``qkv[..., [-2], :]``); None if
    any reader does anything else with the value. NOTE: under dynamic shapes Dynamo keeps the
    full slices of the dims in front (``qkv[:, :, :, [-2]]`` starts with ``slice(qkv, 0, 0, max)``):
    a slice of another dim is followed to its readers."""
    edges: set[int] = set()
    ndim = val(node).dim()
    for user in node.users:
        if user.target is aten.slice.Tensor and norm_dim(user.args[1], ndim) != d and depth:
            inner = _taken_apart_at(user, d, size, depth - 1)
            if inner is None:
                return None
            edges.update(inner)
            continue
        if user.target is aten.slice.Tensor and norm_dim(user.args[1], ndim) == d:
            args = list(user.args) + [None] * (5 - len(user.args))
            start, end, step = args[2] or 0, args[3], args[4] or 1
            if step != 1 or not isinstance(start, int) or not isinstance(end, (int, type(None))):
                return None
            end = size if end is None or end > size else end
            bounds = [start % size if start < 0 else start, end % size if end < 0 else end]
        elif user.target is aten.index.Tensor:
            given = [(i, x) for i, x in enumerate(user.args[1]) if x is not None]
            values = private_aten.constant_value(given[0][1]) if len(given) == 1 and given[0][0] == d else None
            if values is None or values.dim() != 1 or not values.numel():
                return None
            positions = [int(v) % size for v in values.tolist()]
            if positions != list(range(positions[0], positions[-1] + 1)):
                return None
            bounds = [positions[0], positions[-1] + 1]
        else:
            return None
        edges.update(b for b in bounds if 0 < b < size)
    return sorted(edges)


# ops that take a dim apart -> the index of their dim argument (default 0)
_SEPARATES = {aten.unbind.int: 1, aten.select.int: 1, aten.split.Tensor: 2, aten.split_with_sizes.default: 2}
_SAME_DIMS = (aten.clone.default, aten.alias.default, aten._to_copy.default)


def _separated(node: torch.fx.Node, d: int, depth: int = 8) -> bool:
    """Dim ``d`` of ``node`` is taken apart later (unbind, select, split on it, after dim moves):
    a fused output's components (q, k, v), not heads. Every reader must do so."""
    if depth == 0 or not node.users or val(node) is None:
        return False
    ndim = val(node).dim()
    for user in node.users:
        if user.target in _SEPARATES:
            i = _SEPARATES[user.target]
            if norm_dim(user.args[i] if len(user.args) > i else user.kwargs.get("dim", 0), ndim) != d:
                return False
        elif user.target in _SAME_DIMS:
            if not _separated(user, d, depth - 1):
                return False
        elif user.target in _DIM_MAPS and user.target not in RESHAPES and val(user) is not None:
            moved = _DIM_MAPS[user.target](user, ndim, val(user).dim()).moves[d]
            if moved is None or not _separated(user, moved, depth - 1):
                return False
        else:
            return False
    return True


def _components(lm: LayoutMap, node: torch.fx.Node, src: Shard, mid_out: list) -> tuple[Shard | None, int] | None:
    """A fused output viewed with its components as a dim of their own (timm's ViT and ModernBERT
    ``qkv.reshape(B, N, 3, H, hd)``, ``nn.MultiheadAttention``'s ``unflatten(-1, (3, E))``): the
    cut, alike in every component, lands inside the rest (on the heads); each rank holds its heads
    of q, of k and of v. ``(shard, position in mid_out)``; ``(None, 0)`` after a wish (cut the
    origin into those components, or in coarser units); None when this is not such a view."""
    c, rest = mid_out[0], mid_out[1:]
    # Parts, not heads: 3 of them (q, k, v), or 2 with heads inside ([2, H, hd]: k and v). A dim of
    # 2 with only features inside, or of more, taken apart is heads (StableLM's per-head norms on
    # its 2 K/V heads, ``q.unbind(heads)``), which the view rules cut in whole heads. (Either
    # reading is correct; this picks the cut that keeps heads whole.)
    if not isinstance(c, int) or not (c == 3 or (c == 2 and len(rest) >= 2)):
        return None
    if not all(isinstance(d, int) for d in rest):
        return None
    split = src.split
    if split.deals is not None or split.whole or c * math.prod(rest) != src.size:
        return None
    if len(split.parts) == 1:
        width = math.prod(rest)
        if width % split.unit == 0:
            lm.wish(src.origins, WishKind.CUT, frozenset(k * width // split.unit for k in range(1, c)),
                    f"{op_name(node)} views a fused output as {c} parts")
            return None, 0
        return None
    if len(split.parts) != c or len(set(split.parts)) != 1:
        return None
    units, elems, inner_out = split.parts[0], split.unit, 1
    for o in range(len(rest) - 1, -1, -1):
        if o < len(rest) - 1:
            inner_out *= rest[o + 1]
        if elems % inner_out == 0:
            if rest[o] == units * (elems // inner_out):
                return src.moved(src.dim, Split((units,), elems // inner_out)), o + 1
            continue
        k = math.lcm(elems, inner_out) // elems  # heads of whole units: a wish for coarser ones
        coarser = split.coarsen(k)
        if coarser is not None and coarser.fewest_units(lm.world) >= 1:
            lm.wish(src.origins, WishKind.COARSEN, k, f"{op_name(node)} into dims of {inner_out} elements")
        return None, 0
    return None, 0


@rule(*RESHAPES, per_rank=True)
def reshape(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """Reshapes under both input modes: ``inputs="per_rank"`` keeps only a last-dim cut whose dim
    is unchanged (every rank's rows: the first size scales by the world size)."""
    if not lm.per_rank:
        return follow(lm, node)
    src = lm.layouts.get(node.args[0])
    if src is None or not (src.dim == -1 and size_at(node) == src.size == size_at(node.args[0])):
        return None
    return _moved(lm, node, src, rows_scaled=True)
