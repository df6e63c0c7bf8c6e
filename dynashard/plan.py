"""Plan: decide a style for every linear, with a reason, before anything is rewritten.

Before: the matched linears of one graph. After: a :class:`Plan` (style + reason per linear)
and the :class:`~dynashard.shard.LayoutMap` the rewrite will follow.

``plan="auto"`` pairs linears Megatron-style from the graph alone: walking the graph in order,
a shardable linear whose input arrives sharded (a colwise output, through pointwise ops and
last-dim-preserving views) becomes rowwise; every other shardable linear is tentatively
colwise. A colwise linear whose shard never reaches a rowwise partner is kept colwise (its
output gathered) when that pays, else replicated. Embeddings are vocab-parallel (rowwise). A
weight used several times (a layer called twice, a tied LM head) gets one split for every use,
also across graphs (a weight an earlier graph split is split the same way). An in-place write
the layout cannot follow keeps the written-to layers whole. A user plan maps module FQN globs to
styles; every key must match a linear, and a named linear that cannot be sharded is an error.

Invariants: planning never mutates the graph; every linear gets exactly one decision and a
reason; the final layout map is recomputed from the final styles, so what the rewrite emits is
what the plan says.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import hashlib
import logging
import math

import torch.fx

from dynashard.errors import UsageError
from dynashard.match import LinearMatch
from dynashard.options import Options
from dynashard.propagate import propagate
from dynashard.rules.inplace import unsafe_mutations
from dynashard.shard import LOSS_PARALLEL, LayoutMap, Shard, Wish, WishKind
from dynashard.split import Split, even

# An unpaired colwise linear pays for its all-gather when each gathered element saves at least
# this many multiply-adds: gloo on CPU moves one fp32 element in roughly the time of 50-100
# multiply-adds of one core, so 256 leaves a margin for the collective's fixed latency.
_GATHER_MIN_IN_FEATURES = 256
# Rounds of re-cutting colwise outputs for the rules' wishes (see recut_until_stable).
_MAX_ROUNDS = 8

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    style: str  # "colwise" | "rowwise" | "replicate"
    reason: str
    fed_by: frozenset[str] = frozenset()  # auto rowwise: the FQNs of the colwise linears sharding its input


@dataclasses.dataclass
class Plan:
    linears: list[LinearMatch]
    decisions: dict[torch.fx.Node, Decision]
    layouts: LayoutMap
    held_biases: frozenset[torch.fx.Node] = frozenset()  # colwise biases held cut (in layouts.states)

    def sharded(self) -> list[LinearMatch]:
        return [m for m in self.linears if self.decisions[m.node].style != "replicate"]

    def fingerprint(self, shapes: list[str]) -> str:
        """A hash every rank must agree on before the first collective."""
        cuts = self.layouts.weight_splits
        rows = [(m.fqn, m.node.name, self.decisions[m.node].style, str(cuts.get(m.node))) for m in self.linears]
        states = sorted((n.name, s.dim, str(s.split)) for n, s in self.layouts.states.items())
        return hashlib.sha256(repr((rows, states, shapes)).encode()).hexdigest()[:16]


def _why_unshardable(other_uses: list[str]) -> str | None:
    return f"weight is also read by {', '.join(other_uses)}" if other_uses else None


def _split_dim(m: LinearMatch, style: str) -> int | None:
    return None if style == "replicate" else m.out_dim if style == "colwise" else m.in_dim


def _shared_conflicts(linears: list[LinearMatch], decisions: dict) -> dict[torch.fx.Node, list[LinearMatch]]:
    """Weights used more than once (a layer called twice, tied embedding and LM head) whose
    uses do not all split it on the same dim: one copy cannot serve them all."""
    by_weight: dict[torch.fx.Node, list[LinearMatch]] = {}
    for m in linears:
        by_weight.setdefault(m.weight, []).append(m)
    return {
        w: ms
        for w, ms in by_weight.items()
        if len({_split_dim(m, decisions[m.node].style) for m in ms}) > 1
    }


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
        "uniform_inputs": uniform_inputs,
        "stacked": options.weights == "per_rank",
    }
    auto = options.plan == "auto"
    user = None if auto else _user(linears, blocked, options.plan_dict, modes["stacked"], modes["per_rank"])

    def solve(cuts: Cuts) -> dict[torch.fx.Node, Decision]:
        def decide(wishes: list[Wish]) -> dict[torch.fx.Node, Decision]:
            if not auto:
                return dict(user)
            decisions = _auto(linears, blocked, graph, options, world, rank, modes, cuts, wishes)
            _follow_earlier_splits(linears, decisions, blocked, presplit or {}, prewhole)
            return decisions

        return recut_until_stable(decide, graph, by_node, cuts, modes, world, rank, auto)

    def finish(cuts: Cuts) -> Plan:
        """The fixpoint's styles, then layers an unsafe in-place write reaches kept whole."""
        decisions = solve(cuts)
        _describe_cuts(linears, decisions, cuts.splits)
        while True:
            biases = _held_biases(linears, decisions, cuts.splits, modes, presplit or {}, prewhole)
            layouts = propagate(graph, by_node, lambda m, _src: decisions[m.node].style, world, rank,
                                splits=cuts.splits, states={**cuts.states, **biases}, **modes)
            unsafe = unsafe_mutations(graph, layouts)
            if not unsafe:
                return Plan(linears, decisions, layouts, frozenset(biases))
            node, origins = unsafe[0]
            names = sorted(by_node[o].fqn for o in origins)
            if options.plan != "auto":
                raise UsageError(
                    f"dynashard: the in-place op {node.target} writes into the output of {names}, which the plan "
                    "shards, through a view dynashard cannot keep sharded; expected out-of-place code there, "
                    f"or mark {names} 'replicate'."
                )
            for o in origins:  # keep the written-to layers whole and plan again
                decisions[o] = Decision("replicate", f"an in-place {node.target} writes into its output")
            for n, d in list(decisions.items()):  # partners now read a replicated input: say so
                if d.style == "rowwise" and d.fed_by & set(names):
                    decisions[n] = Decision(
                        "rowwise", f"input replicated ({', '.join(names)} kept whole): narrowed locally")

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
    not one a graph compiled earlier reads whole; one an earlier graph cut is held cut whatever
    else reads it (those readers gather it). Held like a cache (``LayoutMap.states``): the store
    cuts and frees it, ``parallelize`` registers the shard, the graph reads it locally.
    """
    if modes["per_rank"] or modes["stacked"]:
        return {}
    readers: dict[torch.fx.Node, list[LinearMatch]] = {}
    for m in linears:
        if m.bias is not None:
            readers.setdefault(m.bias, []).append(m)
    out: dict[torch.fx.Node, tuple[Split, int, frozenset[torch.fx.Node]]] = {}
    for b, ms in readers.items():
        if b.op != "placeholder" or b not in modes["uniform_inputs"] or b in prewhole:
            continue
        if any(m.kind != "linear" or decisions[m.node].style != "colwise" for m in ms):
            continue
        v = b.meta.get("val")
        cuts = {splits.get(m.node, even(m.out_features)) for m in ms}
        if v is None or v.dim() != 1 or len(cuts) != 1 or any(v.shape[0] != m.out_features for m in ms):
            continue
        if set(b.users) != {m.node for m in ms} and b not in presplit:
            continue
        out[b] = (cuts.pop(), -1, frozenset(m.node for m in ms))
    return out


@dataclasses.dataclass
class Cuts:
    """What the re-cut loop changes between rounds: how each colwise output is cut (heads, fused
    parts), and, for the auto plan, the linears kept whole so that the rest can stay sharded."""

    splits: dict[torch.fx.Node, Split] = dataclasses.field(default_factory=dict)
    forced: dict[torch.fx.Node, Decision] = dataclasses.field(default_factory=dict)
    # graph inputs held sharded (KV caches written from head-sharded k/v): placeholder -> split, dim, origins
    states: dict[torch.fx.Node, tuple[Split, int, frozenset[torch.fx.Node]]] = dataclasses.field(default_factory=dict)
    allow_states: bool = True


def recut_until_stable(decide, graph: torch.fx.Graph, by_node: dict, cuts: Cuts, modes: dict, world: int, rank: int,
                       auto: bool) -> dict[torch.fx.Node, Decision]:
    """The planning fixpoint: decide styles -> propagate -> collect the rules' wishes -> re-cut
    the origins they name -> again, until no wish changes a cut.

    A fused qkv needs two rounds (component boundaries, then whole heads), GQA a third. Stopping
    at the round limit is safe (the final layout is recomputed from the final cuts: at worst a
    value is gathered that a finer cut could have kept sharded) and logged.
    """
    for _ in range(_MAX_ROUNDS):
        wishes: list[Wish] = []
        decisions = decide(wishes)
        layouts = propagate(graph, by_node, lambda m, _src, d=decisions: d[m.node].style, world, rank,
                            splits=cuts.splits, states=cuts.states, **modes)
        if not _grant(wishes + layouts.wishes, cuts, auto, list(by_node.values()), world):
            return decisions
    log.warning(
        "dynashard: planning stopped re-cutting after %d rounds with wishes still changing cuts (%s); the plan "
        "is correct but may gather values a finer cut would keep sharded. Please report this model.",
        _MAX_ROUNDS, "; ".join(sorted({w.reason for w in wishes + layouts.wishes}))[:400],
    )
    return decide([])


def _grant(wishes: list[Wish], cuts: Cuts, auto: bool, linears: list[LinearMatch], world: int) -> bool:
    """Re-cut (or, for the auto plan, keep whole) the origins the shape rules asked about.

    A fused origin asked to stay whole keeps only its components with fewer units than ranks
    whole (a fused [q | k | v] with 2 KV heads on 4 ranks: q still cut, k and v held by all).

    Wishes of one round combine: component boundaries first, then the least common unit. A
    weight shared by several layers keeps its cut (its uses must agree). True if anything changed.
    """
    by_node = {m.node: m for m in linears}
    splits, forced = cuts.splits, cuts.forced
    uses: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for m in linears:
        uses.setdefault(m.weight, []).append(m.node)
    # One expert weight used once per expert (``W[e]`` in a loop): its uses are re-cut together.
    family = {n: ns for ns in uses.values() if all(by_node[n].kind == "experts" for n in ns) for n in ns}
    boundaries: dict[torch.fx.Node, set[int]] = {}
    units: dict[torch.fx.Node, int] = {}
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
            if len(uses[m.weight]) > 1 and o not in family:
                continue
            o = family[o][0] if o in family else o
            current = splits.get(o, even(m.out_features))
            if w.kind == WishKind.REPLICATE:
                if auto and o not in forced:
                    whole.setdefault(o, w)
            elif w.kind == WishKind.CUT:
                boundaries.setdefault(o, set()).update(w.arg)
            else:
                units[o] = math.lcm(units.get(o, current.unit), current.unit * w.arg)
    before = dict(splits)
    for o in set(boundaries) | set(units):
        m = by_node[o]
        current = splits.get(o, even(m.out_features))
        new = current.cut(boundaries.get(o, set()))
        if _empties_a_rank(current, new, world):
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
                forced[member] = Decision("replicate", f"kept whole: {w.reason}")
        changed = True
    recut = {o: (before.get(o, even(by_node[o].out_features)), split) for o, split in splits.items()
             if split != before.get(o)}
    _recut_siblings(recut, splits, linears, uses, family)
    return changed


def _recut_siblings(recut: dict, splits: dict, linears: list[LinearMatch], uses: dict, family: dict) -> None:
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
        if change is None or m.node in recut or len(uses[m.weight]) > 1 or m.node in family:
            continue
        if splits.get(m.node, even(m.out_features)) == change[0]:
            splits[m.node] = change[1]


def _block_pattern(fqn: str) -> str:
    """``layers.3.attn.wqkv`` -> ``layers.#.attn.wqkv``: the numbered path components (a block's
    index in a ModuleList) replaced, names such as ``w1`` / ``w3`` kept apart."""
    return ".".join("#" if part.isdigit() else part for part in fqn.split("."))


def _sharded_numel(linears: list[LinearMatch], decisions: dict) -> int:
    return sum(m.numel for m in linears if decisions[m.node].style != "replicate")


def _empties_a_rank(current: Split, new: Split, world: int) -> bool:
    """Components are dealt out one by one, the first ranks taking each one's extra units: cutting
    a dim into components smaller than the world (``q.split(1, dim=heads)``: 4 one-head pieces on
    2 ranks) would give rank 0 every piece and leave another rank nothing it held before."""
    return any(new.local(world, r) == 0 < current.local(world, r) for r in range(world))


def _describe_cuts(linears: list[LinearMatch], decisions: dict, splits: dict) -> None:
    for m in linears:
        split, d = splits.get(m.node), decisions[m.node]
        if split is None or d.style != "colwise":
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


def _auto(
    linears, blocked, graph, options: Options, world: int, rank: int, modes: dict, cuts: Cuts,
    wishes: list[Wish],
) -> dict[torch.fx.Node, Decision]:
    """Styles from one walk of the graph (tentatively colwise, rowwise where the input arrives
    sharded); ``wishes`` collects what the shape rules asked for on the way."""
    decisions: dict[torch.fx.Node, Decision] = {}
    partners: dict[torch.fx.Node, list[str]] = {}

    def choose(m: LinearMatch, src: Shard | None) -> str:
        numel = m.numel
        if m.node in cuts.forced:
            decisions[m.node] = cuts.forced[m.node]
        elif blocked[m.node]:
            decisions[m.node] = Decision("replicate", blocked[m.node])
        elif numel < options.min_shard_numel:
            decisions[m.node] = Decision(
                "replicate", f"small: {numel} weight elements < min_shard_numel={options.min_shard_numel}"
            )
        elif m.kind == "experts" and (modes["stacked"] or modes["per_rank"]):
            mode = "weights='per_rank'" if modes["stacked"] else "inputs='per_rank'"
            decisions[m.node] = Decision("replicate", f"experts with {mode}: kept whole (not supported yet)")
        elif m.kind == "embedding" and modes["stacked"]:
            decisions[m.node] = Decision("replicate", "embedding with weights='per_rank': kept whole")
        elif m.kind == "embedding":
            reduce = "reduce_scatter" if modes["per_rank"] else "all_reduce"
            decisions[m.node] = Decision("rowwise", f"vocab-parallel embedding: masked local lookup, one {reduce}")
        elif src is not None:
            names = sorted(by_node[o].fqn for o in src.origins)
            for o in src.origins:
                partners.setdefault(o, []).append(m.fqn)
            reduce = "reduce_scatter" if modes["per_rank"] else "all_reduce"
            decisions[m.node] = Decision("rowwise", f"input sharded by {', '.join(names)}; one {reduce}",
                                         frozenset(names))
        else:
            decisions[m.node] = Decision("colwise", "")
        return decisions[m.node].style

    by_node = {m.node: m for m in linears}
    walked = propagate(graph, by_node, choose, world, rank, splits=cuts.splits, states=cuts.states, **modes)
    wishes.extend(walked.wishes)
    for m in linears:
        d = decisions[m.node]
        if d.style != "colwise":
            continue
        if m.node in partners:
            decisions[m.node] = Decision("colwise", f"pairs with rowwise {', '.join(sorted(set(partners[m.node])))}")
        elif _only_loss_parallel(walked, m):
            decisions[m.node] = Decision(
                "colwise", "vocab-parallel logits into cross_entropy (loss parallel): never gathered")
        elif m.in_features >= _GATHER_MIN_IN_FEATURES:
            decisions[m.node] = Decision(
                "colwise", f"no rowwise partner{_stopped_at(walked, m)}; output gathered "
                f"(in_features {m.in_features} >= {_GATHER_MIN_IN_FEATURES})"
            )
        else:
            decisions[m.node] = Decision(
                "replicate", f"no rowwise partner{_stopped_at(walked, m)} and in_features {m.in_features} < "
                f"{_GATHER_MIN_IN_FEATURES}: a gather would not pay"
            )
    for ms in _shared_conflicts(linears, decisions).values():
        _settle_shared(ms, decisions, blocked, modes["stacked"])
    return decisions


def _stopped_at(walked: LayoutMap, m: LinearMatch) -> str:
    """Where the tentatively colwise output of ``m`` was first gathered: the op no rule kept it
    sharded through (or the graph output)."""
    ops = [c.reason for c in walked.collectives if c.kind.gathers and m.node in c.origins and c.reason != LOSS_PARALLEL]
    return f" (its shard is gathered before {ops[0]})" if ops else ""


def _only_loss_parallel(walked: LayoutMap, m: LinearMatch) -> bool:
    """The tentatively colwise output of ``m`` reaches a loss-parallel cross-entropy and nothing
    gathers it: the shard pays for itself (no ``[tokens, vocab]`` gather), however small."""
    mine = [c.reason for c in walked.collectives if m.node in c.origins]
    return LOSS_PARALLEL in mine and all(r == LOSS_PARALLEL for r in mine)


def _settle_shared(ms: list[LinearMatch], decisions: dict, blocked: dict, stacked: bool) -> None:
    """One split for a shared weight: a use replicated only for cost follows the sharded uses'
    dim (a tied LM head follows its vocab-parallel embedding); otherwise all stay whole."""
    names = ", ".join(sorted({f"{m.fqn} ({decisions[m.node].style})" for m in ms}))

    def others(m: LinearMatch) -> str:  # the other uses (a tied head and its embedding share one FQN)
        return ", ".join(sorted({f"{o.fqn} ({decisions[o.node].style} {o.kind})" for o in ms if o.node is not m.node}))

    dims = {_split_dim(m, decisions[m.node].style) for m in ms} - {None}
    stuck = any(blocked[m.node] or (stacked and m.kind == "embedding") for m in ms)
    if len(dims) == 1 and not stuck:
        (dim,) = dims
        for m in ms:
            if decisions[m.node].style == "replicate":
                style = "colwise" if m.out_dim == dim else "rowwise"
                decisions[m.node] = Decision(style, f"shares its weight with {others(m)}: split on the same dim")
        return
    for m in ms:
        decisions[m.node] = Decision("replicate", f"weight shared by uses that would split it differently: {names}")


def _follow_earlier_splits(linears, decisions: dict, blocked: dict, presplit: dict[torch.fx.Node, int],
                           prewhole: set[torch.fx.Node] | frozenset[torch.fx.Node] = frozenset()) -> None:
    """A weight an earlier graph split (and freed) is split the same way here, if it can be; one an
    earlier graph reads whole stays whole (cutting it would free what that graph reads)."""
    for m in linears:
        if m.weight in prewhole and decisions[m.node].style != "replicate":
            decisions[m.node] = Decision("replicate", "kept whole: a graph compiled earlier reads this weight whole")
            continue
        dim = presplit.get(m.weight)
        if dim is None or _split_dim(m, decisions[m.node].style) == dim or blocked[m.node]:
            continue
        style = "colwise" if m.out_dim == dim else "rowwise"
        decisions[m.node] = Decision(style, f"weight already split on dim {dim} by an earlier graph")


def key_matches(key: str, fqn: str) -> bool:
    """A plan key matches a module FQN in full, or a dotted suffix of it (HF base-model plans)."""
    return fnmatch.fnmatchcase(fqn, key) or fnmatch.fnmatchcase(fqn, "*." + key)


def _user(linears, blocked, plan: dict[str, str], stacked: bool, per_rank: bool) -> dict[torch.fx.Node, Decision]:
    names = sorted({m.fqn for m in linears})
    for key in plan:
        if not any(key_matches(key, n) for n in names):
            close = difflib.get_close_matches(key, names, n=5, cutoff=0.3) or names[:5]
            raise UsageError(
                f"dynashard: plan key {key!r} matches no linear layer in the compiled graph; "
                f"closest linear FQNs: {close}. Fix the key (globs like 'layers.*.mlp.up' are "
                "matched against module FQNs as in model.named_modules())."
            )
    decisions: dict[torch.fx.Node, Decision] = {}
    for m in linears:
        keys = [k for k in plan if key_matches(k, m.fqn)]
        if not keys:
            decisions[m.node] = Decision("replicate", "not named by the plan")
            continue
        style = plan[keys[-1]]
        if style != "replicate" and blocked[m.node]:
            raise UsageError(
                f"dynashard: plan asks for {style} on {m.fqn!r}, but its {blocked[m.node]}, so it "
                "cannot be sharded. Expected a weight used only by linear layers; set its style to "
                "'replicate' or remove it from the plan."
            )
        if stacked and m.kind == "embedding" and style != "replicate":
            raise UsageError(
                f"dynashard: plan asks for {style} on embedding {m.fqn!r} with weights='per_rank'; expected "
                "'replicate' (every rank's own embedding stays whole)."
            )
        if (stacked or per_rank) and m.kind == "experts" and style != "replicate":
            mode = "weights='per_rank'" if stacked else "inputs='per_rank'"
            raise UsageError(
                f"dynashard: plan asks for {style} on experts {m.fqn!r} with {mode}, which experts do not support "
                "yet; expected 'replicate' for them, or the default inputs='replicated', weights='replicated'."
            )
        decisions[m.node] = Decision(style, f"plan key {keys[-1]!r}")
    for ms in _shared_conflicts(linears, decisions).values():
        uses = ", ".join(sorted({f"{m.fqn} as {decisions[m.node].style}" for m in ms}))
        raise UsageError(
            f"dynashard: one weight is used by several layers that the plan splits differently ({uses}); "
            "expected every use of a shared weight to have styles that split the same dim (e.g. a tied "
            "embedding 'rowwise' with its LM head 'colwise'), or all 'replicate'."
        )
    return decisions
