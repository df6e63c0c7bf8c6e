"""Plan: decide a style for every linear, with a reason, before anything is rewritten.

Before: the matched linears of one graph. After: a :class:`Plan` (style + reason per linear)
and the :class:`~dynashard.layout.shard.LayoutMap` the rewrite will follow::

    context   context.PlanContext.build: the graph's facts and the modes (a Mesh), built once, frozen
    decide    auto.auto_decisions (plan="auto") or user.user_decisions (a dict), from the current cuts
    fixpoint  recut.recut_until_stable: re-cut colwise outputs until the rules' wishes are granted
    finish    in-place writes the layout cannot follow keep the written-to layers whole (auto) or
              raise (user plan); colwise biases held cut
    make_plan with a sharded KV cache, the plan that shards more weight of the two (cache sharded,
              or k/v gathered into a whole cache)

This module runs those steps in that order (:func:`plan_with`) and builds the final layout map.

Invariants: planning never mutates the graph; every linear gets exactly one decision and a
reason; the final layout map is recomputed from the final styles, so what the rewrite emits is
what the plan says.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import torch.fx

from dynashard.capture.linear_forms import converted_source
from dynashard.capture.records import LinearMatch
from dynashard.errors import UsageError
from dynashard.layout.shard import LayoutMap, Wish
from dynashard.layout.split import Split, even
from dynashard.options import Options, Style
from dynashard.plan.auto import auto_decisions, follow_earlier_splits
from dynashard.plan.context import PlanContext
from dynashard.plan.decision import Decision, split_dim
from dynashard.plan.propagate import propagate
from dynashard.plan.recut import Cuts, recut_until_stable
from dynashard.plan.rules.inplace import follow_writes
from dynashard.plan.user import user_decisions


@dataclasses.dataclass
class Plan:
    linears: list[LinearMatch]
    decisions: dict[torch.fx.Node, Decision]
    layouts: LayoutMap
    held_biases: frozenset[torch.fx.Node] = frozenset()  # colwise biases held cut (in layouts.states)

    def sharded(self) -> list[LinearMatch]:
        return [m for m in self.linears if self.decisions[m.node].style != Style.REPLICATE]

    def fingerprint(self, shapes: list[str]) -> str:
        """A hash every rank must agree on before the first collective."""
        cut = self.layouts.weight_split
        rows = [(m.fqn, m.node.name, self.decisions[m.node].style, str(cut(m.node))) for m in self.linears]
        states = sorted((n.name, s.dim, str(s.split)) for n, s in self.layouts.states.items())
        return hashlib.sha256(repr((rows, states, shapes)).encode()).hexdigest()[:16]


def make_plan(
    linears: list[LinearMatch],
    other_uses: dict[torch.fx.Node, list[str]],
    graph: torch.fx.Graph,
    options: Options,
    world: int,
    rank: int,
    uniform_inputs: frozenset[torch.fx.Node] = frozenset(),
    presplit: dict[torch.fx.Node, tuple[int, Split]] | None = None,
    prewhole: set[torch.fx.Node] | frozenset[torch.fx.Node] = frozenset(),
) -> Plan:
    """The plan of one graph: :func:`plan_with` its cuts; with a sharded KV cache (auto plan), also
    without holding any graph input sharded, keeping whichever plan shards more weight."""
    ctx = PlanContext.build(linears, other_uses, graph, options, world, rank, uniform_inputs, presplit, prewhole)
    user = None if ctx.auto else user_decisions(ctx)
    cuts = Cuts.following(ctx)
    plan = plan_with(ctx, cuts, user)
    if cuts.states and ctx.auto:
        # A cache held sharded follows k's cut; where attention then needs another cut (GQA heads
        # that do not divide the world) the auto plan may keep the projections whole instead. Keep
        # whichever plan shards more weight: the cache sharded, or gathered k/v into a whole cache.
        other = plan_with(ctx, Cuts.following(ctx, allow_states=False), user)
        if _sharded_numel(ctx, other.decisions) > _sharded_numel(ctx, plan.decisions):
            plan = other
    return plan


def plan_with(ctx: PlanContext, cuts: Cuts, user: dict[torch.fx.Node, Decision] | None) -> Plan:
    """The planning loop, in its steps: :func:`decide` styles from the cuts, re-cut until stable
    (``recut_until_stable`` changes ``cuts``), then :func:`finish` the styles into the plan."""
    decisions = recut_until_stable(ctx, cuts, functools.partial(decide, ctx, cuts, user))
    _describe_cuts(ctx, decisions, cuts.splits)
    return finish(ctx, cuts, decisions)


def decide(ctx: PlanContext, cuts: Cuts, user: dict[torch.fx.Node, Decision] | None, wishes: list[Wish]
           ) -> dict[torch.fx.Node, Decision]:
    """One round's styles: the user plan's as given, or the auto plan's from the current ``cuts``
    (``wishes`` collects what its walk's rules asked for), following earlier graphs' splits."""
    if user is not None:
        return dict(user)
    decisions = auto_decisions(ctx, cuts, wishes)
    follow_earlier_splits(ctx, decisions)
    return decisions


def finish(ctx: PlanContext, cuts: Cuts, decisions: dict[torch.fx.Node, Decision]) -> Plan:
    """The fixpoint's styles, then layers an unsafe in-place write reaches, and weights whose uses
    would be cut differently, kept whole (with every other use of their weights).

    Each round propagates the styles with the colwise biases held cut, and either returns the plan
    or replicates the sharded linears of the first unsafe write or weight cut apart (and every other
    use of their weights; an error for a user plan). Each such round replicates at least one more
    linear, so the loop ends within one round per linear, plus one; the assertion after it guards
    that (a round that replicated nothing would repeat itself forever).
    """
    for _ in range(len(ctx.linears) + 1):
        biases = _held_biases(ctx, decisions, cuts.splits)
        layouts = propagate(ctx, lambda m, _src: decisions[m.node].style, cuts.splits, {**cuts.states, **biases})
        unsafe, layouts.write_backs = follow_writes(ctx.graph, layouts)
        apart = _cut_apart(ctx, decisions, layouts)
        if not unsafe and not apart:
            return Plan(list(ctx.linears), decisions, layouts, frozenset(biases))
        origins, why, problem, names = _unsafe_cut(ctx, decisions, unsafe, apart)
        if not ctx.auto:
            raise UsageError(f"dynashard: {problem}, or mark {names} 'replicate'.")
        _keep_whole(ctx, decisions, origins, why)
    raise AssertionError("dynashard: keeping layers whole did not settle; each round should shard fewer linears")


def _unsafe_cut(ctx: PlanContext, decisions: dict, unsafe: list, apart: list[list[LinearMatch]]
                ) -> tuple[frozenset[torch.fx.Node], str, str, list[str]]:
    """The first unsafe in-place write, else the first weight cut apart: the linears to keep whole,
    the reason they get, the problem a user plan is told, and the FQNs it should mark 'replicate'."""
    if unsafe:
        node, origins = unsafe[0]
        names = sorted({ctx.by_node[o].fqn for o in origins})
        why = f"an in-place {node.target} writes into its output"
        problem = (f"the in-place op {node.target} writes into the output of {names}, which the plan shards, "
                   "through a view dynashard cannot keep sharded; expected out-of-place code there")
        return origins, why, problem, names
    origins = frozenset(m.node for m in apart[0])
    styled = sorted({f"{m.fqn} ({decisions[m.node].style})" for m in apart[0]})
    why = f"its weight's uses would be cut differently: {', '.join(styled)}"
    problem = (f"the uses {styled} of one weight would cut it differently (one stored shard serves "
               "them all); expected styles that cut it alike")
    return origins, why, problem, sorted({m.fqn for m in apart[0]})


def _held_biases(ctx: PlanContext, decisions: dict, splits: dict
                 ) -> dict[torch.fx.Node, tuple[Split, int, frozenset[torch.fx.Node]]]:
    """Colwise biases held cut like the linear's output, as Megatron holds them: each rank stores
    and adds only its features' part, so a training step has no all_reduce of the bias's gradient
    (a whole bias narrowed in the graph gets its gradient summed over the ranks every step).

    Only a 1-D parameter read by colwise linears alone, all cut alike (a layer called twice), and
    not one a graph compiled earlier reads whole; read as stored or through autocast's dtype
    conversion (``_to_copy(b, bf16)`` of this rank's part is this rank's part of the conversion,
    so parallelize in float32 and a step under autocast hold it alike). One an earlier graph cut
    is held cut whatever else reads it (those readers gather it). Held like a cache (``LayoutMap.states``): the store
    cuts and frees it, ``parallelize`` registers the shard, the graph reads it locally.
    """
    if ctx.mesh.per_rank or ctx.mesh.stacked:
        return {}
    readers: dict[torch.fx.Node, list[LinearMatch]] = {}
    for m in ctx.linears:
        if m.bias is not None:
            readers.setdefault(converted_source(m.bias) or m.bias, []).append(m)
    out: dict[torch.fx.Node, tuple[Split, int, frozenset[torch.fx.Node]]] = {}
    for b, ms in readers.items():
        if b.op != "placeholder" or b not in ctx.uniform_inputs or b in ctx.prewhole:
            continue
        if any(not m.kind.cuts_bias or decisions[m.node].style != Style.COLWISE for m in ms):
            continue
        v = b.meta.get("val")
        cuts = {splits.get(m.node, even(m.out_features)) for m in ms}
        if v is None or v.dim() != 1 or len(cuts) != 1 or any(v.shape[0] != m.out_features for m in ms):
            continue
        if _readers_through_conversions(b) != {m.node for m in ms} and b not in ctx.presplit:
            continue
        out[b] = (cuts.pop(), -1, frozenset(m.node for m in ms))
    return out


def _readers_through_conversions(b: torch.fx.Node) -> set[torch.fx.Node]:
    """What reads ``b``, a dtype conversion of it standing for its own readers."""
    out: set[torch.fx.Node] = set()
    for u in b.users:
        out |= set(u.users) if converted_source(u) is b else {u}
    return out


def _cut_apart(ctx: PlanContext, decisions: dict, layouts: LayoutMap) -> list[list[LinearMatch]]:
    """The uses of each weight that would not read one stored shard alike: some cut and some whole,
    or cut on other dims or into other pieces (a layer called twice whose two inputs arrive cut
    differently). One copy of a weight serves every use, so such uses can only all stay whole."""
    uses: dict[torch.fx.Node, list[LinearMatch]] = {}
    for m in ctx.linears:
        uses.setdefault(m.weight, []).append(m)
    return [ms for ms in uses.values() if len({_held(m, decisions, layouts) for m in ms}) > 1]


def _held(m: LinearMatch, decisions: dict, layouts: LayoutMap) -> tuple:
    """What of its weight ``m`` reads: the dim cut and every rank's ranges (``(None,)``: whole)."""
    style = decisions[m.node].style
    if style == Style.REPLICATE:
        return (None,)
    split = layouts.weight_split(m.node)
    return split_dim(m, style), None if split is None else tuple(map(tuple, split.owned(layouts.world)))


def _keep_whole(ctx: PlanContext, decisions: dict, origins: frozenset[torch.fx.Node], why: str) -> None:
    """``origins`` replicated, and every other use of their weights with them (a tied LM head's
    embedding, the other call of a layer called twice): one stored copy serves every use."""
    weights = {m.weight for m in ctx.linears if m.node in origins}
    kept = [m for m in ctx.linears if m.weight in weights]
    names = {m.fqn for m in kept}
    for m in kept:
        reason = why if m.node in origins else f"kept whole with the other uses of its weight: {why}"
        decisions[m.node] = Decision(Style.REPLICATE, reason)
    for n, d in list(decisions.items()):  # partners now read a replicated input: say so
        if d.style == Style.ROWWISE and d.fed_by & names:
            decisions[n] = Decision(Style.ROWWISE, f"input replicated ({', '.join(sorted(names))} kept whole): "
                                    "narrowed locally")


def _sharded_numel(ctx: PlanContext, decisions: dict) -> int:
    return sum(m.numel for m in ctx.linears if decisions[m.node].style != Style.REPLICATE)


def _describe_cuts(ctx: PlanContext, decisions: dict, splits: dict) -> None:
    for m in ctx.linears:
        split, d = splits.get(m.node), decisions[m.node]
        if split is None or d.style != Style.COLWISE or split == even(m.out_features):
            continue  # (an even cut is the default: nothing to say)
        what = str(split.parts[0])
        if len(split.parts) > 1:
            what = f"{len(split.parts)} components of {'/'.join(map(str, split.parts))}"
        note = f"cut in {what} units of {split.unit}"
        if split.whole:
            held = ", ".join(str(i + 1) for i in sorted(split.whole))
            plural = "s" if len(split.whole) > 1 else ""
            note += f"; component{plural} {held} held whole by every rank (fewer units than ranks)"
        decisions[m.node] = dataclasses.replace(d, reason=f"{d.reason}; {note}" if d.reason else note)
