"""In-place writes: which ones the layout can follow, which ones it cannot.

The aten graph dynashard plans on is not functionalized, so an in-place op (``add_``, ``copy_``,
``index_put_``) writes through whatever alias it is given. Before/after, the logits cut on the
vocabulary (``follow_writes``)::

    logits[logits < v] = -inf   index_put_(logits, [lt], -inf): written on this rank's part, lt cut alike
    logits[..., 0] = -inf       fill_(select(logits, -1, 0)): written into the gather of the logits,
                                which later gathered reads share; this rank's part copied back into
                                the shard (a write-back) where a later read uses the shard
    before = softmax(logits); logits[0] = 0; softmax(logits)
                                the second softmax would share the gather made before the write:
                                the plan keeps the head whole (auto) or refuses (a user plan)

A rule for an in-place op that is not pointwise (a KV cache's ``index_copy_``, a masked write)
belongs here, registered with ``@rule``.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.capture.aliases import alias_roots
from dynashard.layout.nodes import all_args, mutates_self, norm_dim, op_name, size_at, val
from dynashard.layout.shard import LayoutMap, Read, Record, Shard, WishKind, union_origins
from dynashard.plan.rules.registry import rule

aten = torch.ops.aten


def follow_writes(graph: torch.fx.Graph, lm: LayoutMap
                  ) -> tuple[list[tuple[torch.fx.Node, frozenset[torch.fx.Node]]], dict[torch.fx.Node, torch.fx.Node]]:
    """In-place writes the layout cannot follow (the aten graph is not functionalized), and the
    writes into a gather that are copied back into the shard they were gathered from.

    Once sharded, one value of the model may live in several tensors of a rank: its shard, a gather
    of it (one per value and conversion, made where it is first read, shared by its later readers),
    a narrowed copy. A write lands in one of them: the shard (a write the rule keeps sharded), or a
    gather (``logits[..., 0] = -inf`` gathers the logits' cut dim first). It is safe when every later
    read of that memory, through any alias, reads a tensor the write updated, or a gather of an
    updated shard made after the write. A write into a gather updates the shard too where a later
    read needs it (a write-back: this rank's part of the gather copied into the shard, no
    collective); returned as in-place node -> the value gathered. Unsafe, returned with the origins
    of the Shards whose memory it touches: a later read of a copy not updated (a gather made before
    a write into the shard). A write into partial sums (or into memory a partial value aliases) is
    unsafe too: the reads see one all-reduced copy.
    """
    root = alias_roots(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_read: dict[tuple[Read, torch.fx.Node], int] = {}
    for consumer, record in lm.records.items():
        for producer, how in record.reads.items():
            key = (how, producer)
            first_read[key] = min(first_read.get(key, order[consumer]), order[consumer])
    found, write_backs = [], {}
    for node in graph.nodes:
        if node.op != "call_function" or not mutates_self(node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        base = root.get(node.args[0], node.args[0])
        members = [n for n in graph.nodes if root.get(n, n) is base]
        partial = frozenset().union(*(lm.partial[m] for m in members if m in lm.partial))
        if partial and node not in lm.partial:  # (an add_ of partials into its own memory: rules/partial.py)
            found.append((node, partial))
            continue
        shards = [lm.layouts[m] for m in members if lm.layouts.get(m) is not None]
        if not shards:
            continue
        written = _read_copy(lm, root, node, node.args[0])
        updated = {written}
        back = written[1] if written[0] == Read.GATHER and not lm.per_rank else None
        if back is not None and _copy(lm, root, back)[0] == "own":  # the gathered shard: base memory, or a view
            updated.add(_copy(lm, root, back))
        later = [(c, m) for m in members for c in m.users if order[c] > order[node]]
        if all(_sees(lm, root, c, m, {written}, order[node], first_read) for c, m in later):
            continue
        if len(updated) > 1 and all(_sees(lm, root, c, m, updated, order[node], first_read) for c, m in later):
            write_backs[node] = back
            continue
        found.append((node, union_origins(shards)))
    return found, write_backs


def _sees(lm: LayoutMap, root: dict, consumer: torch.fx.Node, member: torch.fx.Node, updated: set,
          at: int, first_read: dict) -> bool:
    """``consumer``, after the write at ``at``, reads ``member`` from a tensor it ``updated``, or from a
    gather of one made after the write (the rewrite gathers where a value is first read)."""
    if _read_copy(lm, root, consumer, member) in updated:
        return True
    how = lm.read_of(consumer, member)
    if how in (Read.NARROW, Read.GLOBAL_NARROW, Read.NARROW_GROUPS):  # a copy made for this consumer, when it runs
        return _copy(lm, root, member) in updated
    return (how in (Read.GATHER, Read.GLOBAL) and lm.layouts.get(member) is not None
            and _copy(lm, root, member) in updated and first_read[(how, member)] > at)


def _copy(lm: LayoutMap, root: dict, node: torch.fx.Node) -> tuple:
    """The tensor of this rank that ``node``'s value lives in: its own memory, or (an alias) its
    input's as the alias reads it."""
    if node not in root:
        return ("own", node)
    return _read_copy(lm, root, node, node.args[0])


def _read_copy(lm: LayoutMap, root: dict, consumer: torch.fx.Node, producer: torch.fx.Node) -> tuple:
    """The tensor ``consumer`` reads ``producer`` from: the producer's own, a gather of it (shared by
    every reader converting it the same way), or a narrowed copy of its own."""
    how = lm.read_of(consumer, producer)
    if how in (None, Read.LOCAL) or (how == Read.GATHER and lm.layouts.get(producer) is None):
        return _copy(lm, root, producer)
    if how in (Read.GATHER, Read.GLOBAL):
        return (how, producer)
    return (how, producer, consumer)  # narrowed for this consumer alone


# Writes into a KV cache: ``cache[:, :, pos] = k`` (index_put_), ``cache.index_copy_(2, pos, k)``,
# ``cache[:, :, a:b] = k`` (a slice, then copy_: rules/pointwise.py). With k head-sharded, the
# cache is held sharded on its head dim like k (a STATE wish: the plan seeds the cache input as a
# Shard, and the backend cuts and frees it like a weight), so no k or v is gathered per step.
_ALIASES_KEEPING_DIMS = (aten.slice.Tensor, aten.alias.default)
# Allocations a cache may start as inside a graph (HF's lazy StaticCache: ``torch.zeros`` in prefill):
# held sharded like an input cache, allocated at this rank's size, returned as a shard.
FACTORIES = (aten.zeros.default, aten.empty.memory_format, aten.full.default, aten.new_empty.default,
             aten.new_zeros.default)
SIZE_ARG = {aten.new_empty.default: 1, aten.new_zeros.default: 1}  # where a factory's size is (else 0)


@rule(aten.index_put_.default)
def index_put(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """``self[..., idx, ...] = values`` with one 1-D index tensor on a dim that is not cut."""
    target, indices, values = node.args[0], node.args[1], node.args[2]
    indexed = [i for i, ix in enumerate(indices) if ix is not None]
    if len(indexed) != 1 or not isinstance(values, torch.fx.Node) or val(indices[indexed[0]]) is None:
        return None
    if val(indices[indexed[0]]).dtype == torch.bool:
        return _write_masked(lm, node, target, indexed[0], indices[indexed[0]], values)
    if val(indices[indexed[0]]).dim() != 1:
        return None
    return _write_along(lm, node, target, values, indexed[0])


def _write_masked(lm: LayoutMap, node: torch.fx.Node, target: torch.fx.Node, at: int, mask: torch.fx.Node,
                  values: torch.fx.Node) -> Record | None:
    """``self[mask] = v`` (nanoGPT's top-k ``logits[logits < v[:, [-1]]] = -inf``), masked_fill's
    in-place twin, written on this rank's part: a mask over the trailing dims, cut dim included, is
    read cut alike and ``v`` is one value; a mask over dims before the cut leaves whole rows of it,
    and ``v`` (aligned from the end, as index_put_ broadcasts it) is read as a part of them."""
    held, t, m, v = lm.layouts.get(target), val(target), val(mask), val(values)
    if held is None or t is None or m is None or v is None:
        return None
    cut, end = t.dim() + held.dim, at + m.dim()
    if end <= cut:  # the mask picks whole rows of the cut dim
        if lm.layouts.get(mask) is not None or not lm.can_read_as_shard(values, held, t.dim()):
            return None
        return _writes(lm, node, values, held)
    if end != t.dim() or v.numel() != 1 or lm.layouts.get(values) is not None \
            or not lm.can_read_as_shard(mask, held, t.dim()):
        return None
    return Record(held, {a: lm.as_shard(a, held) if a is mask else Read.LOCAL for a in all_args(node)})


@rule(aten.index_copy_.default)
def index_copy(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """``self.index_copy_(dim, index, source)`` along a dim that is not cut."""
    target, dim, source = node.args[0], node.args[1], node.args[3]
    t = val(target)
    return None if t is None else _write_along(lm, node, target, source, norm_dim(dim, t.dim()))


@rule(aten.copy_.default)
def copy(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """``self.copy_(src)`` (a slice assignment): a Shard into a Shard cut alike, or a replicated
    value narrowed (or broadcast) into a Shard."""
    target, source = node.args[0], node.args[1]
    held, written = lm.layouts.get(target), lm.layouts.get(source)
    if not isinstance(source, torch.fx.Node) or val(target) is None or val(source) is None:
        return None
    if held is None or (written is not None and not held.alike(written)):
        if written is not None:
            wish_state(lm, node, target, written)
        return None
    if val(source).dim() < -held.dim and written is not None:
        return None
    return _writes(lm, node, source, held)


def _write_along(lm: LayoutMap, node: torch.fx.Node, target: torch.fx.Node, source: torch.fx.Node,
                 d: int) -> Record | None:
    """The source's dims line up with the target's from the end (index_put_ broadcasts its values:
    a batch of one may arrive as ``[heads, T, D]`` for a ``[1, heads, max_len, D]`` cache)."""
    t, s = val(target), val(source)
    if t is None or s is None or s.dim() > t.dim():
        return None
    held, written = lm.layouts.get(target), lm.layouts.get(source)
    if held is None or (written is not None and not held.alike(written)):
        if written is not None:
            wish_state(lm, node, target, written)
        return None
    if t.dim() + held.dim == d:
        return None  # written along the cut dim itself
    return _writes(lm, node, source, held)


def _writes(lm: LayoutMap, node: torch.fx.Node, source: torch.fx.Node, held: Shard) -> Record:
    """``source`` written into the Shard ``held``: read as a part of it; the rest as they are."""
    return Record(held, {a: lm.as_shard(a, held) if a is source else Read.LOCAL for a in all_args(node)})


def wish_state(lm: LayoutMap, node: torch.fx.Node, target: torch.fx.Node, written: Shard) -> None:
    """``node`` writes the Shard ``written`` into ``target`` in place: if ``target`` is (a
    dim-keeping slice of) a graph input, or of a tensor the graph allocates (``FACTORIES``), wish
    it held sharded the same way."""
    if lm.per_rank or lm.stacked or written.split.fewest_units(lm.world) < 1:
        return  # (a cache some rank would hold no head of: fewer K/V heads than ranks, k is held whole)
    root = target
    while root.op == "call_function" and root.target in _ALIASES_KEEPING_DIMS:
        root = root.args[0]
    t, r = val(target), val(root)
    # (an allocation counts when written at positions, as a cache is, or by slices when the graph does
    # not return it (MLA's keys: new_empty, then [..., :nope] and [..., nope:] copied in): a tensor it
    # returns is handed back as a shard, which eager code cannot read)
    allocated = root.op == "call_function" and root.target in FACTORIES and (
        node.target in (aten.index_copy_.default, aten.index_put_.default) or not returned(root))
    if not (root.op == "placeholder" or allocated) or t is None or r is None or t.dim() != r.dim() or (
            t.dim() < -written.dim):
        return
    cut = t.dim() + written.dim
    if size_at(root, written.dim) != written.size or size_at(target, written.dim) != written.size:
        return
    for n in _chain(target, root):  # a slice along the cut dim would not keep it
        if n.target is aten.slice.Tensor and norm_dim(n.args[1] if len(n.args) > 1 else 0, t.dim()) == cut:
            return
    lm.wish(written.origins, WishKind.STATE, (root, written), f"{op_name(node)} writes a shard into input {root.name}")


def grows_cache(lm: LayoutMap, node: torch.fx.Node) -> bool:
    """``node`` is a cache grown by ``cat`` (HF's DynamicCache): Shards joined along a dim that is not
    cut, starting from an input held cut like them (``LayoutMap.states``) or from nothing (a 1-D
    empty tensor, as HF's cache starts). The graph returns it as this rank's shard; the next call
    reads it back as its input (a facade outside the graph)."""
    if node.op != "call_function" or node.target is not aten.cat.default or lm.layouts.get(node) is None:
        return False
    operands = node.args[0]
    return (any(a in lm.states or skipped_by_cat(a) for a in operands)
            and all(lm.layouts.get(a) is not None or skipped_by_cat(a) for a in operands))


def skipped_by_cat(arg: torch.fx.Node) -> bool:
    """A 1-D empty tensor, which ``cat`` skips (torch's legacy rule)."""
    v = val(arg)
    return v is not None and v.dim() == 1 and private_aten.known_equal(v.shape[0], 0)


def returned(value: torch.fx.Node) -> bool:
    """``value``, or a view of it, is one of the graph's outputs."""
    roots = alias_roots(value.graph)
    output = next(n for n in reversed(value.graph.nodes) if n.op == "output")
    return any(roots.get(a, a) is value for a in all_args(output))


def _chain(node: torch.fx.Node, root: torch.fx.Node) -> list[torch.fx.Node]:
    out = []
    while node is not root:
        out.append(node)
        node = node.args[0]
    return out
