"""The auto plan (``plan="auto"``): a style per linear from the graph alone, Megatron-style pairs.

Before: the matched linears of one graph, the current :class:`~dynashard.plan.recut.Cuts`. After: a
:class:`~dynashard.plan.decision.Decision` per linear, from one walk of the graph in order::

    up   (input replicated)                      -> colwise, "pairs with rowwise down"
    gelu (pointwise: keeps up's shard)
    down (input arrives sharded by up)           -> rowwise, "input sharded by up; one all_reduce"
    head (no rowwise partner, in_features >= 256) -> colwise, output gathered

A shardable linear whose input arrives sharded (a colwise output, through pointwise ops and
last-dim-preserving views) becomes rowwise, unless the two are a low-rank bottleneck: the origin
projects down and this layer up (MLA's ``q_a_proj`` 7168 -> 1536 into ``q_b_proj`` 1536 -> 24576,
a LoRA's A into B), where rowwise would all-reduce the wide output. Then the small origin stays
whole and the expanding layer is colwise, as vLLM and SGLang cut DeepSeek, if that layer's shard
reaches a rowwise partner (MLA's o_proj, the base layer's); else (a narrow MLP, 16 -> 3 -> 16) the
two pair as usual. Every other shardable linear is tentatively colwise. A
colwise linear whose shard never reaches a rowwise partner is kept colwise (its output gathered)
when that pays, else replicated. Embeddings are vocab-parallel (rowwise). A weight used several
times (a layer called twice, a tied LM head) gets one split for every use, also across graphs (a
weight an earlier graph split is split the same way; one it reads whole stays whole).

Invariants: it never mutates the graph; every linear gets exactly one decision with a reason.
"""

from __future__ import annotations

import torch.fx

from dynashard.capture.match_adapters import LowRankUpdate
from dynashard.capture.records import LinearMatch
from dynashard.layout.shard import LayoutMap, Shard, Wish
from dynashard.options import Style
from dynashard.plan.context import PlanContext
from dynashard.plan.decision import Decision, shared_conflicts, split_dim, style_along
from dynashard.plan.propagate import propagate
from dynashard.plan.recut import Cuts

# An unpaired colwise linear pays for its all-gather when each gathered element saves at least
# this many multiply-adds: gloo on CPU moves one fp32 element in roughly the time of 50-100
# multiply-adds of one core, so 256 leaves a margin for the collective's fixed latency.
_GATHER_MIN_IN_FEATURES = 256
_LOW_RANK = 4


def auto_decisions(ctx: PlanContext, cuts: Cuts, wishes: list[Wish]) -> dict[torch.fx.Node, Decision]:
    """Styles from one walk of the graph (tentatively colwise, rowwise where the input arrives
    sharded); ``wishes`` collects what the shape rules asked for on the way."""
    linears, blocked, by_node, updates, mesh = ctx.linears, ctx.blocked, ctx.by_node, ctx.updates, ctx.mesh
    decisions: dict[torch.fx.Node, Decision] = {}
    partners: dict[torch.fx.Node, list[str]] = {}
    expanded: dict[torch.fx.Node, list[LinearMatch]] = {}  # origin -> the expanding layers it fed
    bottlenecks: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}  # expanding layer -> its origins

    def choose(m: LinearMatch, src: Shard | None) -> str:
        numel = m.numel
        if m.node in cuts.forced:
            decisions[m.node] = cuts.forced[m.node]
        elif (refused := m.kind.refused(False, False)) is not None:  # (what it is, before how it is read)
            decisions[m.node] = Decision(Style.REPLICATE, f"kept whole: {refused}")
        elif blocked[m.node]:
            decisions[m.node] = Decision(Style.REPLICATE, blocked[m.node])
        elif (follows := adapter_decision(m, updates, decisions)) is not None:
            decisions[m.node] = follows
        elif numel < ctx.options.min_shard_numel:
            decisions[m.node] = Decision(
                Style.REPLICATE, f"small: {numel} weight elements < min_shard_numel={ctx.options.min_shard_numel}"
            )
        elif (refused := m.kind.refused(mesh.stacked, mesh.per_rank)) is not None:
            decisions[m.node] = Decision(Style.REPLICATE, f"kept whole: {refused}")
        elif (own := m.kind.auto_style(mesh.reduce_name)) is not None:
            decisions[m.node] = Decision(Style(own[0]), own[1])
        elif src is not None and _bottleneck([by_node[o] for o in src.origins if o in by_node], m) \
                and m.kind.refused_dim(m.out_dim, mesh.per_rank) is None:
            for o in src.origins:
                expanded.setdefault(o, []).append(m)
            bottlenecks[m.node] = src.origins
            decisions[m.node] = Decision(Style.COLWISE, "")
        elif (refused := m.kind.refused_dim(m.in_dim if src is not None else m.out_dim, mesh.per_rank)
              or (m.kind.refused_input(src.split, mesh.world) if src is not None else None)) is not None:
            decisions[m.node] = Decision(Style.REPLICATE, f"kept whole: {refused}")  # (weight_norm, per_rank)
        elif src is not None:
            names = sorted(by_node[o].fqn for o in src.origins)
            for o in src.origins:
                partners.setdefault(o, []).append(m.fqn)
            decisions[m.node] = Decision(Style.ROWWISE, f"input sharded by {', '.join(names)}; one {mesh.reduce_name}",
                                         frozenset(names))
        else:
            decisions[m.node] = Decision(Style.COLWISE, "")
        return decisions[m.node].style

    walked = propagate(ctx, choose, cuts.splits, cuts.states)
    wishes.extend(walked.wishes)
    for node, origins in bottlenecks.items():  # cut colwise for nothing: pair with the origins after all
        if node in partners or _only_loss_parallel(walked, by_node[node]):
            continue
        names = sorted(by_node[o].fqn for o in origins)
        for o in origins:
            expanded[o] = [e for e in expanded[o] if e.node is not node]
            if not expanded[o]:
                del expanded[o]
            partners.setdefault(o, []).append(by_node[node].fqn)
        decisions[node] = Decision(Style.ROWWISE, f"input sharded by {', '.join(names)}; one {mesh.reduce_name} "
                                   "(cut colwise, its shard would reach no rowwise partner)", frozenset(names))
    for m in linears:
        d = decisions[m.node]
        if d.style != Style.COLWISE or adapter_decision(m, updates, decisions) is not None:
            continue
        if m.node in partners:
            partner = ", ".join(sorted(set(partners[m.node])))
            decisions[m.node] = Decision(Style.COLWISE, f"pairs with rowwise {partner}")
        elif m.node in expanded:
            into = ", ".join(sorted({f"{e.fqn} ({e.in_features} -> {e.out_features})" for e in expanded[m.node]}))
            decisions[m.node] = Decision(
                Style.REPLICATE, f"feeds {into}, which expands it: kept whole, so that layer is cut colwise "
                f"instead of reducing {max(e.out_features for e in expanded[m.node])} features")
        elif _only_loss_parallel(walked, m):
            decisions[m.node] = Decision(
                Style.COLWISE, "vocab-parallel logits into cross_entropy (loss parallel): never gathered")
        elif m.in_features >= _GATHER_MIN_IN_FEATURES:
            decisions[m.node] = Decision(
                Style.COLWISE, f"no rowwise partner{_stopped_at(walked, m)}; output gathered "
                f"(in_features {m.in_features} >= {_GATHER_MIN_IN_FEATURES})"
            )
        else:
            decisions[m.node] = Decision(
                Style.REPLICATE, f"no rowwise partner{_stopped_at(walked, m)} and in_features {m.in_features} < "
                f"{_GATHER_MIN_IN_FEATURES}: a gather would not pay"
            )
    for ms in shared_conflicts(linears, decisions).values():
        _settle_shared(ctx, ms, decisions)
    follow_bases(linears, updates, decisions, lambda m: m.node not in cuts.forced and not blocked[m.node])
    return decisions


def adapter_decision(m: LinearMatch, updates: dict[torch.fx.Node, LowRankUpdate],
                     decisions: dict[torch.fx.Node, Decision]) -> Decision | None:
    """A LoRA's A or B cut by its base layer's style (decided first: it comes first in the graph),
    so that the adapter adds no collective; None for any other linear."""
    update = updates.get(m.node)
    if update is None or m not in (update.a, update.b) or update.base_linear.node not in decisions:
        return None
    base, style = update.base_linear.fqn, decisions[update.base_linear.node].style
    if update.a is None:  # (an embedding's LoRA: A a table looked up whole, match_adapters.py)
        return Decision(Style.REPLICATE, f"LoRA B of embedding {base}: whole, applied to the whole lookup of A "
                                         f"({m.in_features} features a token) and added after the base's collective")
    if style == Style.REPLICATE:
        return Decision(Style.REPLICATE, f"LoRA {'A' if m is update.a else 'B'} of {base}, kept whole like it")
    if m is update.a and style == Style.COLWISE:
        return Decision(Style.REPLICATE, f"LoRA A of colwise {base}: whole (its input is replicated); B is cut "
                                         "like the base")
    if m is update.b and style == Style.COLWISE:
        return Decision(Style.COLWISE, f"LoRA B of colwise {base}: cut on its output features like it; the "
                                       "two shards are added locally")
    if m is update.b:
        return Decision(Style.REPLICATE, f"LoRA B of rowwise {base}: whole, applied to each rank's partial sums "
                                         "of A; they join the base's")
    return Decision(Style.ROWWISE, f"LoRA A of rowwise {base}: cut on its input features like it; its partial "
                                   "sums join the base's one all_reduce through B")


def follow_bases(linears: list[LinearMatch], updates: dict[torch.fx.Node, LowRankUpdate],
                 decisions: dict[torch.fx.Node, Decision], free=lambda m: True) -> None:
    """Every LoRA A and B for which ``free(m)``, cut by its base's final style."""
    for m in linears:
        if free(m) and (follows := adapter_decision(m, updates, decisions)) is not None:
            decisions[m.node] = follows


def _bottleneck(origins: list[LinearMatch], m: LinearMatch) -> bool:
    """``origins`` project down and ``m`` projects up at least ``_LOW_RANK`` times: a low-rank
    factorisation (MLA's 16-64x, a LoRA's B), not a narrow MLP (DeepSeek-V3's shared expert, 2048
    inside 7168: 3.5x), whose down projection is a rowwise partner like any other."""
    return (bool(origins) and m.out_features >= _LOW_RANK * m.in_features
            and all(o.out_features < o.in_features for o in origins))


def _stopped_at(walked: LayoutMap, m: LinearMatch) -> str:
    """Where the tentatively colwise output of ``m`` was first gathered: the op no rule kept it
    sharded through (or the graph output)."""
    ops = [c.reason for c in walked.collectives if c.kind.gathers and m.node in c.origins and not c.loss_parallel]
    return f" (its shard is gathered before {ops[0]})" if ops else ""


def _only_loss_parallel(walked: LayoutMap, m: LinearMatch) -> bool:
    """The tentatively colwise output of ``m`` reaches a loss-parallel cross-entropy and nothing
    gathers it: the shard pays for itself (no ``[tokens, vocab]`` gather), however small."""
    mine = [c.loss_parallel for c in walked.collectives if m.node in c.origins]
    return any(mine) and all(mine)


def _settle_shared(ctx: PlanContext, ms: list[LinearMatch], decisions: dict) -> None:
    """One split for a shared weight: a use replicated only for cost follows the sharded uses'
    dim (a tied LM head follows its vocab-parallel embedding); otherwise all stay whole."""
    names = ", ".join(sorted({f"{m.fqn} ({decisions[m.node].style})" for m in ms}))

    def others(m: LinearMatch) -> str:  # the other uses (a tied head and its embedding share one FQN)
        return ", ".join(sorted({f"{o.fqn} ({decisions[o.node].style} {o.kind})" for o in ms if o.node is not m.node}))

    dims = {split_dim(m, decisions[m.node].style) for m in ms} - {None}
    stuck = any(ctx.blocked[m.node] or m.kind.refused(ctx.mesh.stacked, False) is not None
                or any(m.kind.refused_dim(d, ctx.mesh.per_rank) is not None for d in dims) for m in ms)
    if len(dims) == 1 and not stuck:
        (dim,) = dims
        for m in ms:
            if decisions[m.node].style == Style.REPLICATE:
                decisions[m.node] = Decision(style_along(m, dim),
                                             f"shares its weight with {others(m)}: split on the same dim")
        return
    for m in ms:
        decisions[m.node] = Decision(Style.REPLICATE, f"weight shared by uses that would split it differently: {names}")


def follow_earlier_splits(ctx: PlanContext, decisions: dict) -> None:
    """A weight an earlier graph split (and freed) is split the same way here, if it can be; one an
    earlier graph reads whole stays whole (cutting it would free what that graph reads)."""
    for m in ctx.linears:
        if m.weight in ctx.prewhole and decisions[m.node].style != Style.REPLICATE:
            decisions[m.node] = Decision(Style.REPLICATE,
                                         "kept whole: a graph compiled earlier reads this weight whole")
            continue
        dim = ctx.presplit[m.weight][0] if m.weight in ctx.presplit else None
        if dim is None or split_dim(m, decisions[m.node].style) == dim or ctx.blocked[m.node] \
                or m.kind.refused_dim(dim) is not None:
            continue
        decisions[m.node] = Decision(style_along(m, dim), f"weight already split on dim {dim} by an earlier graph")

