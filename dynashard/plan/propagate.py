"""Layout propagation: which values are sharded, and what each consumer must do to read them.

A pure analysis over an aten graph and a style per linear; nothing is mutated. The rewrite
emits exactly what this records, and the plan and ``explain`` read the same record.

Before (styles only)::

    up:   colwise      gelu      view     down: rowwise     output
After (a layout per value, a read per edge: a :class:`~dynashard.layout.shard.LayoutMap`)::

    addmm_up -> Shard(4096)   gelu -> Shard   view -> Shard (last dim 4096 -> 2048)
    mm_down: input used locally, output all_reduce'd -> Replicated; output: nothing to gather

One walk in graph order. Matched linears go to :func:`dynashard.plan.rules.origins.linear` with the
style ``choose`` gives them; every other op to its rule in the registry (``dynashard/plan/rules/``:
pointwise, views, shapes, reductions, attention, in-place); an op without a rule, or whose rule
declines, and the graph's outputs read every Shard gathered (one gather per value, shared by its
consumers). Partial sums (a rowwise expert's output) go first to :mod:`dynashard.plan.rules.partial`:
an op linear in them keeps them partial; any other reads them all-reduced, then its rule sees a
replicated value. Correct by construction: an unknown op costs a collective, never a wrong value.

Invariants: every record is filed complete, once. The nodes on a linear's weight path (a renorm, a
weight norm, spectral_norm's reads, a stacked transpose, a dequantization's views) are emitted at the
cut that linear gets further on, so they are placed when visited and filed with their lowerings when
it is decided (:class:`_WeightPaths`), never changed after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from dynashard.capture.aliases import alias_roots
from dynashard.capture.records import GroupQuantized, LinearMatch, SpectralNormed, WeightNormed
from dynashard.layout.nodes import all_args
from dynashard.layout.shard import Collective, CollectiveKind, LayoutMap, Lowering, Read, Record, Shard
from dynashard.layout.split import Split
from dynashard.options import Style
from dynashard.plan import rules
from dynashard.plan.context import PlanContext
from dynashard.plan.decision import split_dim
from dynashard.plan.rules.inplace import SIZE_ARG, grows_cache
from dynashard.plan.rules.origins import feeds_features, linear
from dynashard.plan.rules.partial import keeps_partial, whole_linear_of_partial
from dynashard.plan.rules.quantized import dequantization_resizes, dequantization_views
from dynashard.rewrite.lowerings import (
    AllocateLocal,
    CutMatVec,
    NormAcrossCut,
    NormOfSlices,
    Renorm,
    SigmaOfCut,
    StackedTranspose,
)

aten = torch.ops.aten

StyleChooser = Callable[[LinearMatch, Shard | None], Style]


def propagate(
    ctx: PlanContext,
    choose: StyleChooser,
    splits: dict[torch.fx.Node, Split] | None = None,
    states: dict[torch.fx.Node, tuple[Split, int, frozenset[torch.fx.Node]]] | None = None,
) -> LayoutMap:
    """Walk ``ctx.graph`` once in order; ``choose(match, input_layout)`` gives each linear's style.

    ``splits``: the colwise outputs' cuts. ``states``: graph inputs held sharded (placeholder ->
    split, dim, origins: a KV cache the graph writes head-sharded k/v into).
    """
    linears = ctx.by_node
    lm = LayoutMap(ctx.mesh, styles={}, splits=dict(splits or {}), written=ctx.written, updates=ctx.updates,
                   presplit=ctx.presplit)
    paths = _WeightPaths.of(ctx)
    for node in ctx.graph.nodes:
        if node in (states or {}):  # a cache held sharded (a graph input, or allocated by the graph)
            split, dim, origins = states[node]
            lm.states[node] = shard = lm.shard(split, origins, dim)
            allocated = AllocateLocal(shard, SIZE_ARG.get(node.target, 0)) if node.op == "call_function" else None
            paths.commit(lm, node, Record(shard, lowering=allocated))
            continue
        if node.op in ("placeholder", "get_attr"):
            if node.op == "get_attr" or node in ctx.uniform_inputs:
                lm.uniform.add(node)
            paths.commit(lm, node, Record())
            continue
        seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())  # randn differs per rank
        if node.op == "call_function" and not seeded and all(a in lm.uniform for a in all_args(node)):
            lm.uniform.add(node)
        partial = frozenset(a for a in all_args(node) if a in lm.partial)
        if partial:
            lm.uniform.discard(node)
            kept = keeps_partial(lm, node)
            if kept is not None:
                paths.commit(lm, node, kept)
                continue
        record = _record(ctx, lm, node, choose, paths)
        if record.partial is None or node not in linears or lm.styles[node] != Style.REPLICATE:
            record.reduced = partial  # (a whole linear keeps a partial input partial: whole_linear_of_partial)
        paths.commit(lm, node, record)
    assert not paths.held, f"weight path nodes after their linears: {sorted(n.name for n in paths.held)}"
    return lm


@dataclasses.dataclass
class _WeightPaths:
    """The nodes before a linear that read its weight as the linear's own cut (:func:`_weight_path`),
    emitted at the cut the walk gives that linear later (graph order). Each is placed when visited
    (later rules read its layout; its reads are charged in order) and filed once every linear
    reading it is decided, its lowering or resize in it: no filed record is changed afterwards."""

    paths: dict[torch.fx.Node, tuple[torch.fx.Node, ...]]  # linear -> its weight path's nodes
    waiting: dict[torch.fx.Node, int]  # a path's node -> how many of the linears reading it are undecided
    held: dict[torch.fx.Node, Record] = dataclasses.field(default_factory=dict)  # placed, not yet filed
    lowered: dict[torch.fx.Node, dict[str, Any]] = dataclasses.field(default_factory=dict)  # -> its fields

    @classmethod
    def of(cls, ctx: PlanContext) -> _WeightPaths:
        paths = {m.node: _weight_path(m, ctx.mesh.stacked) for m in ctx.linears}
        waiting: dict[torch.fx.Node, int] = {}
        for nodes in paths.values():
            for n in nodes:
                waiting[n] = waiting.get(n, 0) + 1
        return cls(paths, waiting)

    def lower(self, fields: dict[torch.fx.Node, dict[str, Any]]) -> None:
        """A decided linear's lowerings (resizes) of its path's nodes (with several readers, the last's)."""
        for n, f in fields.items():
            self.lowered.setdefault(n, {}).update(f)

    def commit(self, lm: LayoutMap, node: torch.fx.Node, record: Record) -> None:
        """File ``node``'s record, or place it until its linears are decided; a linear's decision files
        the nodes of its weight path that no other linear still waits on."""
        if self.waiting.get(node):
            lm.place(node, record)
            self.held[node] = record
        else:
            lm.commit(node, record)
        for n in self.paths.get(node, ()):
            self.waiting[n] -= 1
            if not self.waiting[n]:
                lm.file(n, dataclasses.replace(self.held.pop(n), **self.lowered.pop(n, {})))


def _weight_path(match: LinearMatch, stacked: bool) -> tuple[torch.fx.Node, ...]:
    """The nodes before ``match`` emitted at its cut when it is cut: an embedding's ``max_norm`` renorm,
    a stacked weight's transpose (the bmm reads the weight), the weight norm of weight_norm's v,
    spectral_norm's power steps and sigma, a group-quantized weight's dequantization views."""
    nodes = [n for n in match.operand_path if n.target is aten._weight_norm_interface.default]
    if isinstance(match.kind, SpectralNormed):
        nodes += [*match.kind.reads.steps, match.kind.reads.sigma_mv, match.kind.reads.sigma]
    nodes += dequantization_views(match)
    nodes += [n for n in (match.renorm, match.transpose if stacked else None) if n is not None]
    return tuple(dict.fromkeys(nodes))


def _record(ctx: PlanContext, lm: LayoutMap, node: torch.fx.Node, choose: StyleChooser, paths: _WeightPaths
            ) -> Record:
    """``node``'s record: its linear's, the graph output's, or its rule's (a gather where none applies).
    A linear's decision also gives its weight path's lowerings (to ``paths``)."""
    linears = ctx.by_node
    if node in linears:
        match = linears[node]
        style = choose(match, lm.layouts[match.input] if feeds_features(lm, match) else None)
        lm.styles[node] = style
        if style == Style.REPLICATE and (kept := whole_linear_of_partial(lm, match)) is not None:
            return kept
        record = linear(lm, match, style)
        paths.lower(_lower_weight_uses(lm, match, style, record))
        return record
    if node.op == "output":  # (partial sums reduced) returned whole, but a cache the graph allocated
        # or grew by cat is returned as it is held (program.py wraps it)
        roots = alias_roots(ctx.graph)
        record = Record()
        for arg in all_args(node):
            root, lay = roots.get(arg, arg), lm.layouts.get(arg)
            if lay is not None and root.op == "call_function" and (
                    (root in lm.states and lay.alike(lm.states[root]))
                    or (grows_cache(lm, root) and lay.alike(lm.layouts[root]))):
                lm.held_outputs[arg] = lay
            record.read(arg, Read.GATHER if lay is not None and arg not in lm.held_outputs else Read.LOCAL)
        return record
    found = rules.lookup(node, lm.per_rank)
    record = found(lm, node) if found is not None else None
    return record if record is not None else lm.gathered(node)


def _lower_weight_uses(lm: LayoutMap, match: LinearMatch, style: Style, record: Record
                       ) -> dict[torch.fx.Node, dict[str, Any]]:
    """The lowerings (resizes) of the nodes on a sharded linear's weight path (:func:`_weight_path`), by
    node; the collectives they cost go into ``record``, the linear's."""
    if style == Style.REPLICATE:
        return {}
    out: dict[torch.fx.Node, dict[str, Any]] = {}
    if isinstance(match.kind, SpectralNormed):
        for n, lowering in _lower_spectral(lm, match, style, record).items():
            out.setdefault(n, {})["lowering"] = lowering
    if isinstance(match.kind, GroupQuantized):
        for n, resize in dequantization_resizes(lm, match, style, record).items():
            out.setdefault(n, {})["resize"] = resize
    for n in match.operand_path:
        if n.target is aten._weight_norm_interface.default:
            out.setdefault(n, {})["lowering"] = _lower_weight_norm(lm, match, style, record, n)
    if match.renorm is not None:
        rows = lm.shard(record.weight_split, frozenset(), -1) if style == Style.ROWWISE else None
        out.setdefault(match.renorm, {})["lowering"] = Renorm(match, rows)
    if lm.stacked and match.transpose is not None:
        out.setdefault(match.transpose, {})["lowering"] = StackedTranspose()
    return out


def _lower_weight_norm(lm: LayoutMap, match: LinearMatch, style: Style, record: Record, norm: torch.fx.Node
                       ) -> Lowering:
    """weight_norm on this rank's slices (cut on its norm dim), or across its norms: then the norms'
    sums of squares cost one all_reduce (match_normed.py)."""
    dim = split_dim(match, style)
    assert isinstance(match.kind, WeightNormed), f"{norm} on the path of a {match.kind}"
    if dim == match.kind.dim:
        return NormOfSlices()
    # (charged at g, whose shape the all-reduced norms have: the norm op's own value is a pair)
    record.collectives.append(Collective(CollectiveKind.ALL_REDUCE, match.companions[0], frozenset([match.node]),
                                         "weight_norm's norms"))
    return NormAcrossCut(lm.shard(record.weight_split, frozenset()), dim)


def _lower_spectral(lm: LayoutMap, match: LinearMatch, style: Style, record: Record
                    ) -> dict[torch.fx.Node, Lowering]:
    """spectral_norm's reads of W on this rank's cut (match_normed.py), and the collectives they cost."""
    reads = match.kind.reads
    dim, cut = match.out_dim if style == Style.COLWISE else match.in_dim, lm.shard(record.weight_split, frozenset())
    out: dict[torch.fx.Node, Lowering] = {}
    for mv in (*reads.steps, reads.sigma_mv):
        contracted = dim == (0 if mv.args[0] in reads.transposes else 1)  # (mv contracts its matrix's dim 1)
        out[mv] = CutMatVec(cut, contracted, whole=mv is not reads.sigma_mv)
        if mv is not reads.sigma_mv:
            kind = CollectiveKind.ALL_REDUCE if contracted else CollectiveKind.ALL_GATHER
            record.collectives.append(Collective(kind, mv, frozenset([match.node]), "spectral_norm's power step"))
    out[reads.sigma] = SigmaOfCut(cut, block=dim == 0)
    record.collectives.append(Collective(CollectiveKind.ALL_REDUCE, reads.sigma, frozenset([match.node]), ""))
    return out
