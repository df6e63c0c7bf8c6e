"""The re-cut fixpoint: decide styles -> propagate -> grant the rules' wishes -> re-cut -> again.

Before: the colwise outputs cut evenly (``Split((out_features,), 1)``). After: :class:`Cuts`, each
origin cut as the shape rules downstream need it (a fused ``[q | k | v]`` at its component
boundaries, then in whole heads; GQA groups), origins that must stay whole forced replicated (auto
plan only), graph inputs written from shards (KV caches) held sharded like them::

    round 1: c_attn Split((192,), 1)         wish CUT {64, 128}   (qkv.split(64): q, k, v)
    round 2: c_attn Split((64, 64, 64), 1)   wish COARSEN 16      (each viewed as 4 heads of 16)
    round 3: c_attn Split((4, 4, 4), 16)     no wish: stable      (tests/models.py nanogpt, hidden 64)

The same wish cuts a projection that is not fused but taken apart the same way: DiffLlama chunks its
heads in two halves (head h paired with h + H/2, V's K/V heads halved), so q becomes
``Split((H/2, H/2), head_dim)`` and k and v ``Split((KV/2, KV/2), head_dim)``; where shards cut
into components meet shards cut as one (the attention), ``LayoutMap.unify`` asks the others for
the same boundaries in their own units, or keeps them whole where such a cut would leave a rank
nothing (1 K/V head a half on 2 ranks). Halves that units coarsened for GQA (pairs of query
heads) cannot deal to every rank ask for finer units instead (``WishKind.REFINE``).

Invariants: a round only changes cuts (and, for the auto plan, forces styles), never the graph;
the same layer of every block is re-cut together, and every use of one weight of one kind; a weight
shared by uses of different kinds (a tied head and its embedding) keeps its cut;
a re-cut never leaves a rank holding nothing it held before; a colwise output whose weight an earlier graph
cut (``parallelize``'s, without gradients, then a training compile's) starts from that cut and is never re-cut
(``Cuts.pinned``): its full value is gone, so a rule that needs another cut gathers. Stopping at the round limit
is safe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import torch.fx

from dynashard.capture.records import LinearMatch
from dynashard.layout.shard import Wish, WishKind
from dynashard.layout.split import Split, even
from dynashard.options import Style
from dynashard.plan.context import PlanContext
from dynashard.plan.decision import Decision
from dynashard.plan.propagate import propagate

# Rounds of re-cutting colwise outputs for the rules' wishes (see recut_until_stable).
_MAX_ROUNDS = 8

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Cuts:
    """What the re-cut loop changes between rounds: how each colwise output is cut (heads, fused
    parts), and, for the auto plan, the linears kept whole so that the rest can stay sharded."""

    splits: dict[torch.fx.Node, Split] = dataclasses.field(default_factory=dict)
    forced: dict[torch.fx.Node, Decision] = dataclasses.field(default_factory=dict)
    # graph inputs held sharded (KV caches written from head-sharded k/v): placeholder -> split, dim, origins
    states: dict[torch.fx.Node, tuple[Split, int, frozenset[torch.fx.Node]]] = dataclasses.field(default_factory=dict)
    allow_states: bool = True
    # colwise outputs whose weight an earlier graph cut (and freed): their split is that cut, never re-cut
    pinned: frozenset[torch.fx.Node] = frozenset()

    @classmethod
    def following(cls, ctx: PlanContext, allow_states: bool = True) -> Cuts:
        """The cuts to start from: each colwise output whose weight an earlier graph cut on its output dim
        split as that cut (``ctx.presplit``), pinned. A rule that needs another cut of it gathers instead: the
        full weight is gone, and a different split would be refused when the weights are cut."""
        splits = {m.node: split for m in ctx.linears
                  if (cut := ctx.presplit.get(m.weight)) is not None and cut[0] == m.out_dim
                  for split in [cut[1]]}
        return cls(splits=splits, allow_states=allow_states, pinned=frozenset(splits))


def recut_until_stable(ctx: PlanContext, cuts: Cuts, decide: Callable[[list[Wish]], dict[torch.fx.Node, Decision]]
                       ) -> dict[torch.fx.Node, Decision]:
    """The planning fixpoint: decide styles -> propagate -> collect the rules' wishes -> re-cut
    the origins they name -> again, until no wish changes a cut.

    Each round changes only ``cuts`` (an origin's split made finer or coarser, an origin forced
    whole, a graph input held sharded); ``decide(wishes)`` gives the round's styles from them (and
    collects the wishes met while deciding).

    A fused qkv needs two rounds (component boundaries, then whole heads), GQA a third. Stopping
    at the round limit is safe (the final layout is recomputed from the final cuts: at worst a
    value is gathered that a finer cut could have kept sharded) and logged.
    """
    for _ in range(_MAX_ROUNDS):
        wishes: list[Wish] = []
        decisions = decide(wishes)
        layouts = propagate(ctx, lambda m, _src, d=decisions: d[m.node].style, cuts.splits, cuts.states)
        if not _grant(ctx, wishes + layouts.wishes, cuts):
            return decisions
    log.warning(
        "dynashard: planning stopped re-cutting after %d rounds with wishes still changing cuts (%s); the plan "
        "is correct but may gather values a finer cut would keep sharded. Please report this model.",
        _MAX_ROUNDS, "; ".join(sorted({w.reason for w in wishes + layouts.wishes}))[:400],
    )
    return decide([])


def _grant(ctx: PlanContext, wishes: list[Wish], cuts: Cuts) -> bool:
    """Re-cut (or, for the auto plan, keep whole) the origins the shape rules asked about.

    A fused origin asked to stay whole keeps only its components with fewer units than ranks
    whole (a fused [q | k | v] with 2 KV heads on 4 ranks: q still cut, k and v held by all).

    Wishes of one round combine: component boundaries first, then the least common unit. The uses
    of one weight are re-cut together when they are of one kind (a layer called twice, a model run
    twice in one graph, an expert weight used once per expert); a weight shared by uses of different
    kinds (a tied head and its embedding) keeps its cut. True if anything changed.
    """
    linears, by_node, world = ctx.linears, ctx.by_node, ctx.mesh.world
    splits, forced = cuts.splits, cuts.forced
    uses: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for m in linears:
        uses.setdefault(m.weight, []).append(m.node)
    family = _families(uses, by_node)
    boundaries: dict[torch.fx.Node, set[int]] = {}
    units: dict[torch.fx.Node, int] = {}
    refined: dict[torch.fx.Node, tuple[int, frozenset[int]]] = {}
    whole: dict[torch.fx.Node, Wish] = {}  # auto plan: keep (parts of) these whole
    changed = False
    for w in wishes:
        if w.kind == WishKind.STATE:  # an input written from a Shard: held cut like it
            if not cuts.allow_states:
                continue
            placeholder, shard = w.arg
            held = (shard.split, shard.dim, shard.origins)
            changed |= cuts.states.get(placeholder) != held
            cuts.states[placeholder] = held
            continue
        for o in w.origins:
            m = by_node[o]
            if (len(uses[m.weight]) > 1 and o not in family) or o in cuts.pinned:
                continue
            o = family[o][0] if o in family else o
            current = splits.get(o, even(m.out_features))
            if w.kind == WishKind.REPLICATE:
                if ctx.auto and o not in forced:
                    whole.setdefault(o, w)
            elif w.kind == WishKind.CUT:
                boundaries.setdefault(o, set()).update(w.arg)
            elif w.kind == WishKind.REFINE:
                refined.setdefault(o, w.arg)
            else:
                units[o] = math.lcm(units.get(o, current.unit), current.unit * w.arg)
    before = dict(splits)
    for o, (k, offsets) in refined.items():  # (only where nothing else asks this origin to change this round)
        finer = splits.get(o, even(by_node[o].out_features)).refine(k)
        if o not in boundaries and o not in units and finer is not None:
            for member in family.get(o, [o]):
                splits[member] = finer.cut(set(offsets))
            changed = True
    for o in set(boundaries) | set(units):
        m = by_node[o]
        current = splits.get(o, even(m.out_features))
        new = current.cut(boundaries.get(o, set()))
        if current.empties_a_rank(new, world):
            new = current  # one-unit pieces (a per-head split) would all be dealt to the first ranks
        new = new.coarsen(units.get(o, new.unit) // new.unit) if units.get(o, new.unit) % new.unit == 0 else None
        if new is not None and new != current:
            for member in family.get(o, [o]):
                splits[member] = new
            changed = True
    for o, w in whole.items():
        current = splits.get(o, even(by_node[o].out_features))
        # ``arg``: how much coarser the asking rule wanted the units (heads); safe to apply either way
        coarser = current.coarsen(w.arg) if w.arg else current
        partly = (coarser or current).keep_whole(world) if len(current.parts) > 1 else None
        for member in family.get(o, [o]):
            if partly is not None:
                splits[member] = partly
            else:
                forced[member] = Decision(Style.REPLICATE, f"kept whole: {w.reason}")
        changed = True
    recut = {o: (before.get(o, even(by_node[o].out_features)), split) for o, split in splits.items()
             if split != before.get(o)}
    _recut_siblings(recut, splits, linears, uses, family, cuts.pinned)
    return changed


def _recut_siblings(recut: dict, splits: dict, linears: Sequence[LinearMatch], uses: dict, family: dict,
                    pinned: frozenset[torch.fx.Node]) -> None:
    """The same layer of the other blocks (``layers.3.attn.wqkv`` for ``layers.0.attn.wqkv``: the same
    name but for its block numbers, the same width, the same cut so far) is re-cut as ``recut`` re-cut it.

    Each round's walk only gets as far as the first layer whose cut is still changing: the layers
    after it see a gathered stream and are planned otherwise. Without this, a deep model re-cuts one
    block per two rounds (components, then heads) and stops at the round limit.
    A sibling is only cut as its twin is, which is a valid cut whatever it turns out to need; the
    next round's wishes correct it like any other."""
    by_node = {m.node: m for m in linears}
    by_pattern: dict[tuple, tuple[Split, Split]] = {}
    for o, change in recut.items():
        by_pattern[(_block_pattern(by_node[o].fqn), by_node[o].out_features)] = change
    for m in linears:
        change = by_pattern.get((_block_pattern(m.fqn), m.out_features))
        members = family.get(m.node, [m.node])
        if change is None or len(uses[m.weight]) != len(members) or any(n in recut or n in pinned for n in members):
            continue
        if all(splits.get(n, even(m.out_features)) == change[0] for n in members):
            for n in members:
                splits[n] = change[1]


def _families(uses: dict[torch.fx.Node, list[torch.fx.Node]], by_node: dict[torch.fx.Node, LinearMatch]
              ) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Use -> every use of its weight, for weights used several times by one kind of computation on
    the same dims (their outputs cut alike read one stored shard): a layer called twice, a model run
    twice in one graph (a generate loop Dynamo unrolls), an expert weight used once per expert."""
    out: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for ns in uses.values():
        if len(ns) > 1 and len({(by_node[n].kind.name, by_node[n].weight_form, by_node[n].out_features)
                                for n in ns}) == 1:
            out.update(dict.fromkeys(ns, ns))
    return out


def _block_pattern(fqn: str) -> str:
    """``layers.3.attn.wqkv`` -> ``layers.#.attn.wqkv``: the numbered path components (a block's
    index in a ModuleList) replaced, names such as ``w1`` / ``w3`` kept apart."""
    return ".".join("#" if part.isdigit() else part for part in fqn.split("."))

