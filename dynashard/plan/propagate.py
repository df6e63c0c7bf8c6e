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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from dynashard.capture.aliases import alias_roots
from dynashard.capture.records import GroupQuantized, LinearMatch, SpectralNormed, WeightNormed
from dynashard.layout.nodes import all_args
from dynashard.layout.shard import Collective, CollectiveKind, LayoutMap, Read, Record, Shard
from dynashard.layout.split import Split
from dynashard.options import Style
from dynashard.plan import rules
from dynashard.plan.context import PlanContext
from dynashard.plan.decision import split_dim
from dynashard.plan.rules.inplace import SIZE_ARG, grows_cache
from dynashard.plan.rules.origins import feeds_features, linear
from dynashard.plan.rules.partial import keeps_partial, whole_linear_of_partial
from dynashard.plan.rules.quantized import resize_dequantization
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
    lm = LayoutMap(ctx.mesh, styles={}, splits=dict(splits or {}), written=ctx.written, updates=ctx.updates)
    for node in ctx.graph.nodes:
        if node in (states or {}):  # a cache held sharded (a graph input, or allocated by the graph)
            split, dim, origins = states[node]
            lm.states[node] = shard = lm.shard(split, origins, dim)
            allocated = AllocateLocal(shard, SIZE_ARG.get(node.target, 0)) if node.op == "call_function" else None
            lm.commit(node, Record(shard, lowering=allocated))
            continue
        if node.op in ("placeholder", "get_attr"):
            if node.op == "get_attr" or node in ctx.uniform_inputs:
                lm.uniform.add(node)
            lm.commit(node, Record())
            continue
        seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())  # randn differs per rank
        if node.op == "call_function" and not seeded and all(a in lm.uniform for a in all_args(node)):
            lm.uniform.add(node)
        partial = frozenset(a for a in all_args(node) if a in lm.partial)
        if partial:
            lm.uniform.discard(node)
            kept = keeps_partial(lm, node)
            if kept is not None:
                lm.commit(node, kept)
                continue
        record = _record(ctx, lm, node, choose)
        if record.partial is None or node not in linears or lm.styles[node] != Style.REPLICATE:
            record.reduced = partial  # (a whole linear keeps a partial input partial: whole_linear_of_partial)
        lm.commit(node, record)
    return lm


def _record(ctx: PlanContext, lm: LayoutMap, node: torch.fx.Node, choose: StyleChooser) -> Record:
    """``node``'s record: its linear's, the graph output's, or its rule's (a gather where none applies)."""
    linears = ctx.by_node
    if node in linears:
        match = linears[node]
        style = choose(match, lm.layouts[match.input] if feeds_features(lm, match) else None)
        lm.styles[node] = style
        if style == Style.REPLICATE and (kept := whole_linear_of_partial(lm, match)) is not None:
            return kept
        record = linear(lm, match, style)
        _lower_weight_uses(lm, match, style, record)
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


def _lower_weight_uses(lm: LayoutMap, match: LinearMatch, style: Style, record: Record) -> None:
    """The nodes before a sharded linear that read its weight as the linear's own cut: an
    embedding's ``max_norm`` renorm, a stacked weight's transpose (the bmm reads the weight), the
    weight norm of weight_norm's v, spectral_norm's sigma and power steps."""
    if style == Style.REPLICATE:
        return
    if isinstance(match.kind, SpectralNormed):
        _lower_spectral(lm, match, style, record)
    if isinstance(match.kind, GroupQuantized):
        resize_dequantization(lm, match, style, record)
    for n in match.operand_path:
        if n.target is aten._weight_norm_interface.default:
            _lower_weight_norm(lm, match, style, record, n)
    if match.renorm is not None:
        rows = lm.shard(record.weight_split, frozenset(), -1) if style == Style.ROWWISE else None
        lm.records[match.renorm].lowering = Renorm(match, rows)
    if lm.stacked and match.transpose is not None:
        lm.records[match.transpose].lowering = StackedTranspose()


def _lower_weight_norm(lm: LayoutMap, match: LinearMatch, style: Style, record: Record, norm: torch.fx.Node
                       ) -> None:
    """weight_norm on this rank's slices (cut on its norm dim), or across its norms: then the norms'
    sums of squares cost one all_reduce (match_normed.py)."""
    dim = split_dim(match, style)
    assert isinstance(match.kind, WeightNormed), f"{norm} on the path of a {match.kind}"
    if dim == match.kind.dim:
        lm.records[norm].lowering = NormOfSlices()
        return
    lm.records[norm].lowering = NormAcrossCut(lm.shard(record.weight_split, frozenset()), dim)
    # (charged at g, whose shape the all-reduced norms have: the norm op's own value is a pair)
    record.collectives.append(Collective(CollectiveKind.ALL_REDUCE, match.companions[0], frozenset([match.node]),
                                         "weight_norm's norms"))


def _lower_spectral(lm: LayoutMap, match: LinearMatch, style: Style, record: Record) -> None:
    """spectral_norm's reads of W on this rank's cut (match_normed.py), and the collectives they cost."""
    reads = match.kind.reads
    dim, cut = match.out_dim if style == Style.COLWISE else match.in_dim, lm.shard(record.weight_split, frozenset())
    for mv in (*reads.steps, reads.sigma_mv):
        contracted = dim == (0 if mv.args[0] in reads.transposes else 1)  # (mv contracts its matrix's dim 1)
        lm.records[mv].lowering = CutMatVec(cut, contracted, whole=mv is not reads.sigma_mv)
        if mv is not reads.sigma_mv:
            kind = CollectiveKind.ALL_REDUCE if contracted else CollectiveKind.ALL_GATHER
            record.collectives.append(Collective(kind, mv, frozenset([match.node]), "spectral_norm's power step"))
    lm.records[reads.sigma].lowering = SigmaOfCut(cut, block=dim == 0)
    record.collectives.append(Collective(CollectiveKind.ALL_REDUCE, reads.sigma, frozenset([match.node]), ""))
