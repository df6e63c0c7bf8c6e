"""Layout propagation: which values are sharded, and what each consumer must do to read them.

A pure analysis over an aten graph and a set of per-linear styles; nothing is mutated. The
rewrite emits exactly what this records, and the plan and ``explain`` read the same record.

Before (styles only)::

    up:   colwise      gelu      view     down: rowwise     output
After (a layout per value, a conversion per edge)::

    addmm_up -> Shard(4096)   gelu -> Shard   view -> Shard (last dim 4096 -> 2048)
    mm_down: input used locally, output all_reduce'd -> Replicated; output: nothing to gather

Rules. Values are Replicated (``None``) or a :class:`Shard`: one dim cut by a :class:`Split`
(whole units per component, balanced over ranks; the plan chooses each colwise output's split):
  * colwise linear: replicated input, output Shard(out_features); a bias is narrowed.
  * rowwise linear: sharded input used locally, a replicated one narrowed; partial sums
    all-reduced; the bias added once, after the reduction.
  * pointwise ops (``torch.Tag.pointwise``) and dtype/copy ops keep a Shard when every sharded
    operand holds the same elements on every rank; replicated operands broadcast over the cut
    dim or are narrowed. In-place ops keep their ``self`` operand's layout.
  * views and the shape ops of attention: heads.py (a size constant of the cut dim is rewritten).
  * anything else, and graph outputs, read a Shard only after it is gathered (one gather per
    value, shared by its consumers). Correct by construction: unknown ops cost a gather.

With ``inputs="per_rank"`` every rank computes its own batch, so a replicated value is this
rank's rows only, while a Shard holds the rows of *all* ranks (concatenated, rank-major) and
this rank's columns -- Megatron's sequence-parallel layout. Conversions change accordingly:
a colwise input is all-gathered along rows (``GLOBAL``), a rowwise linear reduce-scatters its
partial sums back to each rank's rows, reading a Shard as a replicated value is an all-to-all
(``GATHER``), a rowwise linear's replicated input is an all-to-all of feature blocks
(``GLOBAL_NARROW``), and a view of a Shard scales its first size by the world size. Only
rank-uniform values (parameters and what is computed from them alone) may be broadcast into a
Shard's rows; anything else meets it after a gather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from dynashard import _torch_private as private
from dynashard.match import LinearMatch

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_COPIES = (aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default)

# How a consumer reads one producer.
LOCAL = "local"  # use the value as it is (a shard, or replicated)
GATHER = "gather"  # all-gather the producer's shards first
NARROW = "narrow"  # slice this rank's part out of a replicated value
GLOBAL = "global"  # every rank's rows, all columns (a colwise input; replicated mode: as GATHER/LOCAL)
GLOBAL_NARROW = "global_narrow"  # every rank's rows, this rank's columns (a rowwise input)
NARROW_GROUPS = "narrow_groups"  # of whole K/V heads, those of this rank's query heads (GQA attention)


@dataclasses.dataclass(frozen=True)
class Split:
    """How one dim is cut across ranks; the same on every rank.

    The dim holds ``len(parts)`` components side by side (a fused ``[q | k | v]`` has three);
    component ``i`` is ``parts[i]`` units of ``unit`` elements (a head: ``head_dim`` features).
    Each component's units are dealt out balanced, the first ranks taking one more: 6 heads on
    4 ranks are 2/2/1/1. A dim whose size is a multiple of :attr:`size` (a batch dim merged in
    front, ``[B * H]``) repeats the pattern for every outer index. Components listed in
    ``whole`` are held whole by every rank (a fused [q | k | v] with fewer KV heads than ranks:
    q is cut, k and v are not).
    """

    parts: tuple[int, ...]
    unit: int = 1
    whole: frozenset[int] = frozenset()

    @property
    def size(self) -> int:
        return sum(self.parts) * self.unit

    def counts(self, world: int) -> list[list[int]]:
        """Units per component per rank."""
        return [[p] * world if i in self.whole else [p // world + (r < p % world) for r in range(world)]
                for i, p in enumerate(self.parts)]

    def pieces(self, world: int, rank: int) -> list[tuple[int, int]]:
        """``(start, length)`` in elements of the dim, per component, for ``rank``."""
        out, offset = [], 0
        for i, (p, counts) in enumerate(zip(self.parts, self.counts(world))):
            before = 0 if i in self.whole else sum(counts[:rank])
            out.append(((offset + before) * self.unit, counts[rank] * self.unit))
            offset += p
        return out

    def sub(self, i: int, j: int) -> Split | None:
        """Components ``[i, j)`` alone; None when all of them are whole (a replicated value)."""
        if all(c in self.whole for c in range(i, j)):
            return None
        return Split(self.parts[i:j], self.unit, frozenset(c - i for c in self.whole if i <= c < j))

    def local(self, world: int, rank: int) -> int:
        return sum(length for _, length in self.pieces(world, rank))

    def lengths(self, world: int) -> list[list[int]]:
        """Elements per component per rank."""
        return [[c * self.unit for c in counts] for counts in self.counts(world)]

    def owned(self, world: int) -> list[list[tuple[int, int]]]:
        """Per rank, the element ranges ``[start, end)`` it holds, adjacent ones merged."""
        out = []
        for rank in range(world):
            ranges: list[tuple[int, int]] = []
            for start, length in self.pieces(world, rank):
                if ranges and ranges[-1][1] == start:
                    ranges[-1] = (ranges[-1][0], start + length)
                elif length:
                    ranges.append((start, start + length))
            out.append(ranges)
        return out

    def fewest_units(self, world: int) -> int:
        """The fewest units any rank holds of any component (0: some rank holds nothing)."""
        return min(p if i in self.whole else p // world for i, p in enumerate(self.parts))

    def coarsen(self, k: int) -> Split | None:
        """Units ``k`` times larger (``None`` when a component is not a whole number of them)."""
        if any(p % k for p in self.parts):
            return None
        return Split(tuple(p // k for p in self.parts), self.unit * k, self.whole)

    def cut(self, boundaries: set[int]) -> Split:
        """Components also split at these unit offsets (the pieces of a whole one stay whole)."""
        parts, whole, offset = [], set(), 0
        for i, p in enumerate(self.parts):
            inner = sorted(b - offset for b in boundaries if offset < b < offset + p)
            edges = [0, *inner, p]
            for a, b in zip(edges, edges[1:]):
                if i in self.whole:
                    whole.add(len(parts))
                parts.append(b - a)
            offset += p
        return Split(tuple(parts), self.unit, frozenset(whole))

    def keep_whole(self, world: int) -> Split | None:
        """The components with fewer units than ranks held whole by every rank, the rest still
        cut; None if that leaves nothing cut or nothing whole."""
        small = frozenset(i for i, p in enumerate(self.parts) if p < world) | self.whole
        if small == self.whole or len(small) == len(self.parts):
            return None
        return Split(self.parts, self.unit, small)


def even(size: int) -> Split:
    return Split((size,), 1)


@dataclasses.dataclass(frozen=True)
class Shard:
    """A value cut by ``split`` on dim ``dim`` (counted from the end); this rank holds
    :attr:`pieces` of it. Linear outputs are sharded on the last dim; shape rules (heads.py) move
    a shard onto the head dim of an attention block and back."""

    split: Split
    origins: frozenset[torch.fx.Node]  # the colwise linears this shard comes from
    dim: int = -1
    world: int = 1
    rank: int = 0

    @property
    def size(self) -> int:
        return self.split.size

    @property
    def pieces(self) -> list[tuple[int, int]]:
        return self.split.pieces(self.world, self.rank)

    @property
    def length(self) -> int:
        return self.split.local(self.world, self.rank)

    @property
    def start(self) -> int:
        """First element held (a single-component split)."""
        return self.pieces[0][0]

    def alike(self, other: Shard | None) -> bool:
        """Every rank holds the same elements of the same dim in both (elementwise partners), even
        if the splits say it differently (8 heads in 4 + 4 = 4 pairs of heads in 2 + 2)."""
        if other is None or (self.dim, self.size) != (other.dim, other.size):
            return False
        return self.split == other.split or self.split.owned(self.world) == other.split.owned(other.world)

    def moved(self, dim: int, split: Split | None = None) -> Shard:
        return Shard(split or self.split, self.origins, dim, self.world, self.rank)


def shard_bounds(size: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank's part of an evenly split ``size``."""
    return even(size).pieces(world, rank)[0]


@dataclasses.dataclass(frozen=True)
class Wish:
    """A rule that could keep a value sharded if its origins were cut differently: ``coarsen``
    (units ``arg`` times larger), ``cut`` (components also split at unit offsets ``arg``) or
    ``replicate`` (keep the origins whole and let each rank narrow what it needs)."""

    origins: frozenset[torch.fx.Node]
    kind: str
    arg: Any
    reason: str


@dataclasses.dataclass
class Collective:
    kind: str  # "all_reduce" or "all_gather"
    node: torch.fx.Node  # where it is inserted (the producer for a gather, the linear for a reduce)
    origins: frozenset[torch.fx.Node]  # the linears it is charged to
    reason: str


@dataclasses.dataclass
class LayoutMap:
    world: int
    rank: int
    styles: dict[torch.fx.Node, str]  # linear node -> style
    per_rank: bool = False  # inputs="per_rank": replicated values are this rank's rows only
    stacked: bool = False  # weights="per_rank": sharded weights hold one block of every rank's weight
    uniform: set[torch.fx.Node] = dataclasses.field(default_factory=set)  # same value on every rank
    layouts: dict[torch.fx.Node, Shard | None] = dataclasses.field(default_factory=dict)
    reads: dict[tuple[torch.fx.Node, torch.fx.Node], str] = dataclasses.field(default_factory=dict)
    splits: dict[torch.fx.Node, Split] = dataclasses.field(default_factory=dict)  # colwise output splits (plan)
    # A shape argument to rewrite: (dim, full size of the split, this rank's part); a dim of
    # ``k * full`` (a batch dim merged in front) becomes ``k * local``.
    view_sizes: dict[torch.fx.Node, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    outputs: dict[torch.fx.Node, list[Shard | None]] = dataclasses.field(default_factory=dict)  # tuple-valued ops
    part_sizes: dict[torch.fx.Node, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # split/slice, local
    weight_splits: dict[torch.fx.Node, Split] = dataclasses.field(default_factory=dict)  # linear -> its weight's
    wishes: list[Wish] = dataclasses.field(default_factory=list)
    view_rows_scaled: set[torch.fx.Node] = dataclasses.field(default_factory=set)  # per_rank: first size x world
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    _gathered: set[torch.fx.Node] = dataclasses.field(default_factory=set)

    def shard(self, split: Split, origins: frozenset[torch.fx.Node], dim: int = -1) -> Shard:
        return Shard(split, origins, dim, self.world, self.rank)

    def wish(self, origins: frozenset[torch.fx.Node], kind: str, arg: Any, reason: str) -> None:
        self.wishes.append(Wish(origins, kind, arg, reason))

    def read(self, consumer: torch.fx.Node, producer: torch.fx.Node, how: str) -> None:
        self.reads[(consumer, producer)] = how
        if how in (LOCAL, NARROW, NARROW_GROUPS) or (how, producer) in self._gathered:
            return
        self._gathered.add((how, producer))
        lay = self.layouts[producer]
        if how == GATHER:
            kind = "all_to_all" if self.per_rank else "all_gather"
            self.collectives.append(Collective(kind, producer, lay.origins, _op_name(consumer)))
        elif how == GLOBAL and lay is not None:
            self.collectives.append(Collective("all_gather", producer, lay.origins, _op_name(consumer)))
        elif how == GLOBAL:
            self.collectives.append(Collective("all_gather_rows", producer, frozenset([consumer]), _op_name(consumer)))
        else:  # GLOBAL_NARROW of a replicated value
            self.collectives.append(Collective("all_to_all", producer, frozenset([consumer]), _op_name(consumer)))


def _op_name(node: torch.fx.Node) -> str:
    return "output" if node.op == "output" else getattr(node.target, "__name__", str(node.target))


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _size_at(node, dim: int = -1) -> int | None:
    """The static size of ``node``'s dim ``dim`` (counted from the end), if it has one."""
    v = _val(node)
    if v is None or v.dim() < -dim or not isinstance(v.shape[dim], int):
        return None
    return v.shape[dim]




def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) if _val(a) is not None else None)
    return list(dict.fromkeys(found))


def _all_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return list(dict.fromkeys(found))


def _mutates_self(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return bool(alias is not None and alias.is_write)


StyleChooser = Callable[[LinearMatch, Shard | None], str]


def propagate(
    graph: torch.fx.Graph,
    linears: dict[torch.fx.Node, LinearMatch],
    choose: StyleChooser,
    world: int,
    rank: int,
    per_rank: bool = False,
    uniform_inputs: frozenset[torch.fx.Node] = frozenset(),
    stacked: bool = False,
    splits: dict[torch.fx.Node, Split] | None = None,
) -> LayoutMap:
    """Walk ``graph`` once in order; ``choose(match, input_layout)`` gives each linear's style.

    ``uniform_inputs`` are the placeholders that hold the same value on every rank (parameters
    under replicated weights); they matter only with ``per_rank``.
    """
    lm = LayoutMap(world=world, rank=rank, styles={}, per_rank=per_rank, stacked=stacked, splits=dict(splits or {}))
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            lm.layouts[node] = None
            if node.op == "get_attr" or node in uniform_inputs:
                lm.uniform.add(node)
            continue
        seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())  # randn differs per rank
        if node.op == "call_function" and not seeded and all(a in lm.uniform for a in _all_args(node)):
            lm.uniform.add(node)
        if node.op == "output":
            _replicate_all(lm, node)
        elif node in linears:
            match = linears[node]
            style = choose(match, lm.layouts[match.input] if feeds_features(lm, match) else None)
            lm.styles[node] = style
            _linear(lm, match, style)
        elif node.op == "call_function" and node.target in _VIEWS:
            _view(lm, node)
        elif node.op == "call_function" and (
            node.target in _COPIES or torch.Tag.pointwise in getattr(node.target, "tags", ())
        ):
            _pointwise(lm, node)
        elif not lm.per_rank and _heads_rule(lm, node):
            pass  # transposes, attention and its outputs on the head dim (heads.py)
        else:
            _replicate_all(lm, node)
    return lm


def _heads_rule(lm: LayoutMap, node: torch.fx.Node) -> bool:
    from dynashard.heads import propagate_heads

    return propagate_heads(lm, node)


def _replicate_all(lm: LayoutMap, node: torch.fx.Node) -> None:
    for arg in _all_args(node):
        lm.read(node, arg, GATHER if lm.layouts.get(arg) is not None else LOCAL)
    lm.layouts[node] = None


def feeds_features(lm: LayoutMap, match: LinearMatch) -> bool:
    """The linear's input is sharded on exactly its input features (a rowwise input as it is);
    a shard on another dim (heads fed to a per-head linear, a merged dim) must be gathered."""
    src = lm.layouts.get(match.input)
    return (src is not None and src.dim == -1 and not src.split.whole
            and src.size == match.in_features == _size_at(match.input))


def _linear(lm: LayoutMap, match: LinearMatch, style: str) -> None:
    node = match.node
    if style == "replicate":
        _replicate_all(lm, node)
        return
    for arg in _all_args(node):
        lm.read(node, arg, LOCAL)  # the weight's transpose reads the (already sharded) weight
    src = lm.layouts.get(match.input)
    if style == "colwise":
        if lm.per_rank:
            lm.read(node, match.input, GLOBAL)
        elif src is not None:
            lm.read(node, match.input, GATHER)
        out = lm.shard(lm.splits.get(node, even(match.out_features)), frozenset([node]))
        lm.weight_splits[node] = out.split
        if match.bias is not None:
            bias = _val(match.bias)
            if lm.stacked:
                if match.bias.op != "placeholder" or bias.dim() != 1:
                    raise ValueError(
                        f"dynashard: colwise {match.fqn!r} with weights='per_rank' needs its bias to be a "
                        "1-D parameter (it is exchanged like the weight). Mark it 'replicate' in the plan."
                    )
                lm.read(node, match.bias, LOCAL)  # the rewrite adds every rank's bias block itself
                lm.layouts[node] = out
                return
            if lm.per_rank and not (match.bias in lm.uniform and bias.dim() <= 1):
                raise ValueError(
                    f"dynashard: colwise {match.fqn!r} with inputs='per_rank' needs a 1-D bias that is the "
                    f"same on every rank; found a {bias.dim()}-D bias. Mark it 'replicate' in the plan."
                )
            _read_as_shard(lm, node, match.bias, out)
        lm.layouts[node] = out
    elif match.kind == "embedding":  # rowwise = vocab-parallel: every rank looks up every id
        lm.weight_splits[node] = even(match.in_features)
        lm.read(node, match.input, GLOBAL if lm.per_rank else LOCAL)
        kind = "reduce_scatter" if lm.per_rank else "all_reduce"
        lm.collectives.append(Collective(kind, node, frozenset([node]), ""))
        lm.layouts[node] = None
    else:  # rowwise
        usable = feeds_features(lm, match)
        if src is not None and not usable and lm.per_rank:
            raise ValueError(
                f"dynashard: rowwise {match.fqn!r} with inputs='per_rank' needs its input sharded on its "
                f"{match.in_features} input features; found it sharded on dim {src.dim}. Mark it 'colwise' or "
                "'replicate' in the plan."
            )
        lm.weight_splits[node] = src.split if usable else even(match.in_features)
        # an input sharded some other way is gathered, then this rank's features taken (rewrite.py)
        how = LOCAL if usable else GATHER if src is not None else GLOBAL_NARROW if lm.per_rank else NARROW
        lm.read(node, match.input, how)
        if match.bias is not None and lm.layouts.get(match.bias) is not None:
            lm.read(node, match.bias, GATHER)
        kind = "reduce_scatter" if lm.per_rank else "all_reduce"
        lm.collectives.append(Collective(kind, node, frozenset([node]), ""))
        lm.layouts[node] = None


def _read_as_shard(lm: LayoutMap, consumer: torch.fx.Node, arg: torch.fx.Node, out: Shard) -> None:
    """Read ``arg`` in a computation whose output is ``out`` (broadcast, slice or use a shard)."""
    v = _val(arg)
    if lm.layouts.get(arg) is not None:
        lm.read(consumer, arg, LOCAL)
    elif v is not None and v.dim() >= -out.dim and _size_at(arg, out.dim) != 1:
        lm.read(consumer, arg, NARROW)  # (a symbolic size is never 1: Dynamo specialises 0 and 1)
    else:
        lm.read(consumer, arg, LOCAL)  # broadcasts over the sharded dim (size 1, or does not reach it)


def _can_read_as_shard(lm: LayoutMap, arg: torch.fx.Node, out: Shard, out_ndim: int) -> bool:
    lay = lm.layouts.get(arg)
    if lay is not None:
        return out.alike(lay)
    v = _val(arg)
    if lm.per_rank and not (arg in lm.uniform and (v.dim() < out_ndim or v.shape[0] == 1)):
        return False  # a Shard's rows are every rank's: only rank-uniform, row-broadcast values fit
    if lm.per_rank and v.dim() >= -out.dim and _size_at(arg, out.dim) not in (1, out.size):
        return False
    return True


def finest(shards: list[Shard]) -> Shard:
    """Of equally owned shards, the one cut in the smallest units (the most views fit it)."""
    return min(shards, key=lambda s: s.split.unit)


def unify(lm: LayoutMap, shards: list[Shard], where: str) -> None:
    """Shards of one dim cut differently meet (e.g. GQA keys against queries): wish for the
    coarsest common cut, when every rank still holds something of it."""
    if len({s.dim for s in shards}) != 1 or len({s.size for s in shards}) != 1:
        return
    if any(len(s.split.parts) != 1 for s in shards):
        return
    unit = math.lcm(*(s.split.unit for s in shards))
    for s in shards:
        target = s.split.coarsen(unit // s.split.unit)
        if target is not None and target.fewest_units(lm.world) >= 1 and target != s.split:
            lm.wish(s.origins, "coarsen", unit // s.split.unit, f"{where} needs units of {unit}")


def _sharded_args(lm: LayoutMap, args: list[torch.fx.Node]) -> list[tuple[torch.fx.Node, Shard]]:
    return [(a, lm.layouts[a]) for a in args if lm.layouts.get(a) is not None]


def _pointwise(lm: LayoutMap, node: torch.fx.Node) -> None:
    args = _tensor_args(node)
    sharded = [lm.layouts[a] for a in args if lm.layouts.get(a) is not None]
    first = finest(sharded) if sharded else None
    if first is not None and not all(first.alike(s) for s in sharded):
        unify(lm, sharded, _op_name(node))
        first = None
    out_val = _val(node)
    ok = (
        first is not None
        and out_val is not None
        and out_val.dim() >= -first.dim
        # a shard never broadcasts: every sharded operand spans the output's whole cut dim
        and all(private.known_equal(_val(a).shape[s.dim], out_val.shape[s.dim]) for a, s in _sharded_args(lm, args))
        and all(_can_read_as_shard(lm, a, first, out_val.dim()) for a in args)
    )
    if ok and _mutates_self(node):
        ok = lm.layouts.get(node.args[0]) is not None  # writing into a replicated tensor needs it whole
    if not ok:
        _replicate_all(lm, node)
        return
    out = first.moved(first.dim)
    out = Shard(out.split, frozenset().union(*(s.origins for s in sharded)), out.dim, lm.world, lm.rank)
    for arg in _all_args(node):
        _read_as_shard(lm, node, arg, out) if arg in args else lm.read(node, arg, LOCAL)
    lm.layouts[node] = out


def _view(lm: LayoutMap, node: torch.fx.Node) -> None:
    src_node = node.args[0]
    src = lm.layouts.get(src_node)
    if src is None:
        _replicate_all(lm, node)
        return
    if not lm.per_rank:
        from dynashard.heads import view_shard  # any view that keeps the cut whole (heads.py)

        if not view_shard(lm, node, src):
            _replicate_all(lm, node)
        return
    keeps_last = src.dim == -1 and _size_at(node) == src.size == _size_at(src_node)
    if not keeps_last:
        _replicate_all(lm, node)
        return
    for arg in _all_args(node):
        lm.read(node, arg, LOCAL)
    lm.layouts[node] = src
    lm.view_sizes[node] = (-1, src.size, src.length)
    lm.view_rows_scaled.add(node)


def aliases_input(node: torch.fx.Node) -> bool:
    """True when ``node``'s output may share memory with its first argument (views, in-place ops)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None and node.args)


def alias_roots(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """For every node that may alias its first argument, the value whose memory it shares."""
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_function" and aliases_input(node) and isinstance(node.args[0], torch.fx.Node):
            root[node] = root.get(node.args[0], node.args[0])
    return root


def mutated_roots(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Values some in-place op writes into (through any alias)."""
    root = alias_roots(graph)
    return {
        root.get(n.args[0], n.args[0])
        for n in graph.nodes
        if n.op == "call_function" and _mutates_self(n) and isinstance(n.args[0], torch.fx.Node)
    }


def unsafe_mutations(graph: torch.fx.Graph, lm: LayoutMap) -> list[tuple[torch.fx.Node, Shard]]:
    """In-place writes the layout cannot follow (the aten graph is not functionalized).

    Safe: a write into a Shard through a shard-preserving alias, as long as no gather of that
    memory is shared across the write. Unsafe, returned with the Shard whose memory it touches:
    a write through an alias that was gathered (it would change a copy, not the shard), or a
    write between two reads that share one cached gather of the same memory.
    """
    root = alias_roots(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    gathers: dict[torch.fx.Node, list[int]] = {}
    for (consumer, producer), how in lm.reads.items():
        if how in (GATHER, GLOBAL) and lm.layouts.get(producer) is not None:
            gathers.setdefault(producer, []).append(order[consumer])
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or not _mutates_self(node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        base = root.get(node.args[0], node.args[0])
        members = [n for n in graph.nodes if root.get(n, n) is base]
        shard = next((lm.layouts[m] for m in members if lm.layouts.get(m) is not None), None)
        if shard is None:
            continue
        # a write into a copy: of a replicated alias of the shard, or of a gather the op itself reads
        through_copy = lm.layouts.get(node.args[0]) is None or lm.reads.get((node, node.args[0])) in (GATHER, GLOBAL)
        stale = any(min(gathers.get(m, [order[node]])) < order[node] < max(gathers.get(m, [0])) for m in members)
        if through_copy or stale:
            found.append((node, shard))
    return found
