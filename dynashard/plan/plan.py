"""Plan: decide a style for every linear, with a reason, before anything is rewritten.

Before: the matched linears of one graph. After: a :class:`Plan` (style + reason per linear)
and the :class:`~dynashard.layout.shard.LayoutMap` the rewrite will follow::

    styles    auto.auto_decisions (plan="auto") or user.user_decisions (a dict)
    fixpoint  recut.recut_until_stable: re-cut colwise outputs until the rules' wishes are granted
    finish    in-place writes the layout cannot follow keep the written-to layers whole (auto) or
              raise (user plan); colwise biases held cut; with a sharded KV cache, the plan that
              shards more weight of the two (cache sharded, or k/v gathered into a whole cache)

This module runs those steps in that order and builds the final layout map.

Invariants: planning never mutates the graph; every linear gets exactly one decision and a
reason; the final layout map is recomputed from the final styles, so what the rewrite emits is
what the plan says.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch.fx

from dynashard.capture.linear_forms import converted_source
from dynashard.capture.records import LinearMatch
from dynashard.errors import UsageError
from dynashard.layout.shard import LayoutMap, Wish
from dynashard.layout.split import Split, even
from dynashard.options import Options, Style
from dynashard.plan.auto import auto_decisions, follow_earlier_splits
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


def _why_unshardable(other_uses: list[str]) -> str | None:
    return f"weight is also read by {', '.join(other_uses)}" if other_uses else None


def make_plan(
    linears: list[LinearMatch],
    other_uses: dict[torch.fx.Node, list[str]],
    graph: torch.fx.Graph,
    options: Options,
    world: int,
    rank: int,
    uniform_inputs: frozenset[torch.fx.Node] = frozenset(),
    presplit: dict[torch.fx.Node, int] | None = None,
    prewhole: set[torch.fx.Node] | frozenset[torch.fx.Node] = frozenset(),
) -> Plan:
    blocked = {m.node: _why_unshardable(other_uses[m.weight]) for m in linears}
    by_node = {m.node: m for m in linears}
    modes = {
        "per_rank": options.inputs == "per_rank",
        "sequence": options.sequence_parallel,
        "uniform_inputs": uniform_inputs,
        "stacked": options.weights == "per_rank",
    }
    auto = options.plan == "auto"
    user = None if auto else user_decisions(linears, blocked, options.plan_dict, modes["stacked"], modes["per_rank"],
                                            options._hf_plan, world)

    def solve(cuts: Cuts) -> dict[torch.fx.Node, Decision]:
        def decide(wishes: list[Wish]) -> dict[torch.fx.Node, Decision]:
            if not auto:
                return dict(user)
            decisions = auto_decisions(linears, blocked, graph, options, world, rank, modes, cuts, wishes)
            follow_earlier_splits(linears, decisions, blocked, presplit or {}, prewhole)
            return decisions

        return recut_until_stable(decide, graph, by_node, cuts, modes, world, rank, auto)

    def finish(cuts: Cuts) -> Plan:
        """The fixpoint's styles, then layers an unsafe in-place write reaches, and weights whose uses
        would be cut differently, kept whole (with every other use of their weights)."""
        decisions = solve(cuts)
        _describe_cuts(linears, decisions, cuts.splits)
        while True:
            biases = _held_biases(linears, decisions, cuts.splits, modes, presplit or {}, prewhole)
            layouts = propagate(graph, by_node, lambda m, _src: decisions[m.node].style, world, rank,
                                splits=cuts.splits, states={**cuts.states, **biases}, **modes)
            unsafe, layouts.write_backs = follow_writes(graph, layouts)
            apart = _cut_apart(linears, decisions, layouts, world)
            if not unsafe and not apart:
                return Plan(linears, decisions, layouts, frozenset(biases))
            if unsafe:
                node, origins = unsafe[0]
                names = sorted({by_node[o].fqn for o in origins})
                why = f"an in-place {node.target} writes into its output"
                problem = (f"the in-place op {node.target} writes into the output of {names}, which the plan shards, "
                           "through a view dynashard cannot keep sharded; expected out-of-place code there")
            else:
                origins = frozenset(m.node for m in apart[0])
                names = sorted({f"{m.fqn} ({decisions[m.node].style})" for m in apart[0]})
                why = f"its weight's uses would be cut differently: {', '.join(names)}"
                problem = (f"the uses {names} of one weight would cut it differently (one stored shard serves "
                           "them all); expected styles that cut it alike")
                names = sorted({m.fqn for m in apart[0]})
            if options.plan != "auto":
                raise UsageError(f"dynashard: {problem}, or mark {names} 'replicate'.")
            _keep_whole(linears, decisions, origins, why)

    cuts = Cuts()
    plan = finish(cuts)
    if cuts.states and auto:
        # A cache held sharded follows k's cut; where attention then needs another cut (GQA heads
        # that do not divide the world) the auto plan may keep the projections whole instead. Keep
        # whichever plan shards more weight: the cache sharded, or gathered k/v into a whole cache.
        other = finish(Cuts(allow_states=False))
        if _sharded_numel(linears, other.decisions) > _sharded_numel(linears, plan.decisions):
            plan = other
    return plan


def _held_biases(linears: list[LinearMatch], decisions: dict, splits: dict, modes: dict,
                 presplit: dict[torch.fx.Node, int], prewhole: set[torch.fx.Node] | frozenset[torch.fx.Node]
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
    if modes["per_rank"] or modes["stacked"]:
        return {}
    readers: dict[torch.fx.Node, list[LinearMatch]] = {}
    for m in linears:
        if m.bias is not None:
            readers.setdefault(converted_source(m.bias) or m.bias, []).append(m)
    out: dict[torch.fx.Node, tuple[Split, int, frozenset[torch.fx.Node]]] = {}
    for b, ms in readers.items():
        if b.op != "placeholder" or b not in modes["uniform_inputs"] or b in prewhole:
            continue
        if any(not m.kind.cuts_bias or decisions[m.node].style != Style.COLWISE for m in ms):
            continue
        v = b.meta.get("val")
        cuts = {splits.get(m.node, even(m.out_features)) for m in ms}
        if v is None or v.dim() != 1 or len(cuts) != 1 or any(v.shape[0] != m.out_features for m in ms):
            continue
        if _readers_through_conversions(b) != {m.node for m in ms} and b not in presplit:
            continue
        out[b] = (cuts.pop(), -1, frozenset(m.node for m in ms))
    return out


def _readers_through_conversions(b: torch.fx.Node) -> set[torch.fx.Node]:
    """What reads ``b``, a dtype conversion of it standing for its own readers."""
    out: set[torch.fx.Node] = set()
    for u in b.users:
        out |= set(u.users) if converted_source(u) is b else {u}
    return out


def _cut_apart(linears: list[LinearMatch], decisions: dict, layouts: LayoutMap, world: int
               ) -> list[list[LinearMatch]]:
    """The uses of each weight that would not read one stored shard alike: some cut and some whole,
    or cut on other dims or into other pieces (a layer called twice whose two inputs arrive cut
    differently). One copy of a weight serves every use, so such uses can only all stay whole."""
    uses: dict[torch.fx.Node, list[LinearMatch]] = {}
    for m in linears:
        uses.setdefault(m.weight, []).append(m)

    def held(m: LinearMatch) -> tuple:
        style = decisions[m.node].style
        if style == Style.REPLICATE:
            return (None,)
        split = layouts.weight_split(m.node)
        return split_dim(m, style), None if split is None else tuple(map(tuple, split.owned(world)))

    return [ms for ms in uses.values() if len({held(m) for m in ms}) > 1]


def _keep_whole(linears: list[LinearMatch], decisions: dict, origins: frozenset[torch.fx.Node], why: str) -> None:
    """``origins`` replicated, and every other use of their weights with them (a tied LM head's
    embedding, the other call of a layer called twice): one stored copy serves every use."""
    weights = {m.weight for m in linears if m.node in origins}
    kept = [m for m in linears if m.weight in weights]
    names = {m.fqn for m in kept}
    for m in kept:
        reason = why if m.node in origins else f"kept whole with the other uses of its weight: {why}"
        decisions[m.node] = Decision(Style.REPLICATE, reason)
    for n, d in list(decisions.items()):  # partners now read a replicated input: say so
        if d.style == Style.ROWWISE and d.fed_by & names:
            decisions[n] = Decision(Style.ROWWISE, f"input replicated ({', '.join(sorted(names))} kept whole): "
                                    "narrowed locally")


def _sharded_numel(linears: list[LinearMatch], decisions: dict) -> int:
    return sum(m.numel for m in linears if decisions[m.node].style != Style.REPLICATE)


def _describe_cuts(linears: list[LinearMatch], decisions: dict, splits: dict) -> None:
    for m in linears:
        split, d = splits.get(m.node), decisions[m.node]
        if split is None or d.style != Style.COLWISE:
            continue
        what = str(split.parts[0])
        if len(split.parts) > 1:
            what = f"{len(split.parts)} components of {'/'.join(map(str, split.parts))}"
        note = f"cut in {what} units of {split.unit}"
        if split.whole:
            held = ", ".join(str(i + 1) for i in sorted(split.whole))
            plural = "s" if len(split.whole) > 1 else ""
            note += f"; component{plural} {held} held whole by every rank (fewer units than ranks)"
        decisions[m.node] = dataclasses.replace(d, reason=f"{d.reason}; {note}" if d.reason else note)
