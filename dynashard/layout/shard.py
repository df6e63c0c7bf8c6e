"""The layout vocabulary every propagation rule speaks: how a value is cut, how a consumer reads it.

Values are Replicated (``None``) or a :class:`Shard`: one dim cut by a :class:`Split` (whole units
per component, balanced over ranks). A :class:`LayoutMap` records, for one graph and one rank, the
layout of every value, how each consumer reads each producer (a :class:`Read`), the collectives
that follow from those reads, and the :class:`Wish` es of rules that could keep a value sharded if
its origins were cut differently. Each rule (``dynashard/plan/rules/``) returns one :class:`Record` per
node; the plan and the rewrite read them. This module imports no rule.

With ``inputs="per_rank"`` every rank computes its own batch, so a replicated value is this
rank's rows only, while a Shard holds the rows of *all* ranks (concatenated, rank-major) and
this rank's columns -- Megatron's sequence-parallel layout. The reads change meaning
accordingly (see :class:`Read`). Only rank-uniform values (parameters and what is computed from
them alone) may be broadcast into a Shard's rows; anything else meets it after a gather.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import torch.fx

from dynashard.layout.mesh import Mesh
from dynashard.layout.nodes import all_args, op_name, size_at, val
from dynashard.layout.split import Split
from dynashard.options import Style


class Read(str, enum.Enum):
    """How a consumer reads one producer."""

    LOCAL = "local"  # use the value as it is (a shard, or replicated)
    GATHER = "gather"  # all-gather the producer's shards first (per_rank: an all-to-all to own rows)
    NARROW = "narrow"  # slice this rank's part out of a replicated value
    # every rank's rows, all columns (a colwise input under per_rank; replicated mode: GATHER/LOCAL)
    GLOBAL = "global"
    GLOBAL_NARROW = "global_narrow"  # every rank's rows, this rank's columns (a rowwise input)
    NARROW_GROUPS = "narrow_groups"  # of whole K/V heads, those of this rank's query heads (GQA)




class CollectiveKind(str, enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    ALL_GATHER_ROWS = "all_gather_rows"  # per_rank: every rank's rows of a replicated value
    ALL_TO_ALL = "all_to_all"
    REDUCE_SCATTER = "reduce_scatter"

    @property
    def gathers(self) -> bool:
        return self in (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_GATHER_ROWS)

    @property
    def reduces(self) -> bool:
        return self in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


class WishKind(str, enum.Enum):
    COARSEN = "coarsen"  # units ``arg`` times larger
    CUT = "cut"  # components also split at the unit offsets in ``arg``
    REPLICATE = "replicate"  # keep the origins whole; each rank narrows what it needs
    # units ``arg[0]`` times smaller, then components split at the offsets ``arg[1]`` in those units
    # (pieces that whole units, as dealt, would leave a rank without)
    REFINE = "refine"
    # a graph input written in place from a Shard (a KV cache): held sharded like it, ``arg`` =
    # (the input's placeholder, the written Shard); cut and freed like a weight
    STATE = "state"

@dataclasses.dataclass(frozen=True)
class Shard:
    """A value cut by ``split`` on dim ``dim`` (counted from the end); this rank holds
    :attr:`pieces` of it. Linear outputs are sharded on the last dim; the view and attention
    rules move a shard onto the head dim of an attention block and back."""

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


@dataclasses.dataclass(frozen=True)
class Wish:
    """A rule that could keep a value sharded if its origins were cut differently (see
    :class:`WishKind`); the plan grants wishes between rounds of propagation."""

    origins: frozenset[torch.fx.Node]
    kind: WishKind
    arg: Any
    reason: str


@dataclasses.dataclass
class Collective:
    kind: CollectiveKind
    node: torch.fx.Node  # where it is inserted (the producer for a gather, the linear for a reduce)
    origins: frozenset[torch.fx.Node]  # the linears it is charged to
    reason: str  # for a gather: the op that could not read the shard ("" for a linear's reduce)
    loss_parallel: bool = False  # the one gather of a loss-parallel cross-entropy (rules/loss.py)


@dataclasses.dataclass(frozen=True)
class Resize:
    """A size argument naming the cut dim (view, reshape, expand), at this rank's size: ``full``
    becomes ``local`` at ``dim`` (``k * full``, a batch dim merged in front, ``k * local``).
    ``rows_scaled``: under ``inputs="per_rank"`` the first size is every rank's rows."""

    dim: int
    full: int
    local: int
    rows_scaled: bool = False


class Lowering:
    """How the rewrite emits a node other than as its own op on its converted operands (a rowwise
    matmul and its all_reduce, a loss-parallel nll_loss, a cache at this rank's size). Subclasses
    (``dynashard/rewrite/lowerings.py``) hold what they need and emit through the rewrite's interpreter."""

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        raise NotImplementedError


@dataclasses.dataclass
class Record:
    """What one node is on this rank, as its rule decided it: the layout of its value (or of each
    of its outputs), how it reads each operand, and how the rewrite emits it. A rule returns one;
    :meth:`LayoutMap.commit` files it and derives the collectives its reads imply."""

    layout: Shard | None = None
    reads: dict[torch.fx.Node, Read] = dataclasses.field(default_factory=dict)
    outputs: tuple[Shard | None, ...] | None = None  # a tuple-valued op's, per output
    resize: Resize | None = None
    lowering: Lowering | None = None
    # Partial sums (the value is whole-shaped; each rank holds a term, their sum is the value): the
    # origins, as for a Shard. A rowwise expert matmul makes one; ops linear in it keep it
    # (rules/partial.py); any other reader reads it all-reduced (``reduced``).
    partial: frozenset[torch.fx.Node] | None = None
    reduced: frozenset[torch.fx.Node] = frozenset()  # partial operands read all-reduced
    weight_split: Split | None = None  # a sharded linear's weight cut
    collectives: list[Collective] = dataclasses.field(default_factory=list)  # its own: a reduce, a loss's gather
    filed: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)  # final: LayoutMap.file

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("filed"):
            raise AssertionError(f"dynashard: a filed record is final; {name!r} set after it was filed")
        super().__setattr__(name, value)

    def read(self, producer: torch.fx.Node, how: Read) -> Record:
        self.reads[producer] = how
        return self


@dataclasses.dataclass
class LayoutMap:
    """The records of one graph on one rank, in graph order, and what they add up to: the
    collectives and the wishes. ``layouts``, ``outputs`` and ``partial`` index the records."""

    mesh: Mesh  # the ranks, and what a replicated value and a weight mean on them (the modes)
    styles: dict[torch.fx.Node, Style]  # linear node -> style
    uniform: set[torch.fx.Node] = dataclasses.field(default_factory=set)  # same value on every rank
    records: dict[torch.fx.Node, Record] = dataclasses.field(default_factory=dict)
    layouts: dict[torch.fx.Node, Shard | None] = dataclasses.field(default_factory=dict)
    outputs: dict[torch.fx.Node, list[Shard | None]] = dataclasses.field(default_factory=dict)
    partial: dict[torch.fx.Node, frozenset[torch.fx.Node]] = dataclasses.field(default_factory=dict)
    splits: dict[torch.fx.Node, Split] = dataclasses.field(default_factory=dict)  # colwise output splits (plan)
    wishes: list[Wish] = dataclasses.field(default_factory=list)
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    written: frozenset[torch.fx.Node] = frozenset()  # values an in-place op writes into
    # in-place writes into a gather of a Shard, copied back into that shard (the plan's rules.inplace.follow_writes):
    # the in-place node -> the value gathered
    write_backs: dict[torch.fx.Node, torch.fx.Node] = dataclasses.field(default_factory=dict)
    # Graph inputs held sharded because the graph writes Shards into them in place (KV caches):
    # placeholder -> its layout, seeded by the plan (Cuts.states) before the walk.
    states: dict[torch.fx.Node, Shard] = dataclasses.field(default_factory=dict)
    # values of states the graph allocates itself (rules.inplace.FACTORIES) that it returns: as shards
    held_outputs: dict[torch.fx.Node, Shard] = dataclasses.field(default_factory=dict)
    # low-rank updates (LoRA) by each member's node (match_adapters.find_low_rank_updates)
    updates: Mapping[torch.fx.Node, Any] = dataclasses.field(default_factory=dict)
    # weight -> (dim, split) an earlier graph cut it by (PlanContext.presplit): a rowwise weight's cut follows it
    presplit: Mapping[torch.fx.Node, tuple[int, Split]] = dataclasses.field(default_factory=dict)
    _gathered: set[tuple[Read, torch.fx.Node]] = dataclasses.field(default_factory=set)
    _summed: set[torch.fx.Node] = dataclasses.field(default_factory=set)

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def per_rank(self) -> bool:
        return self.mesh.per_rank

    @property
    def sequence(self) -> bool:
        return self.mesh.sequence

    @property
    def stacked(self) -> bool:
        return self.mesh.stacked

    def commit(self, node: torch.fx.Node, record: Record) -> None:
        """:meth:`place` ``node``'s record and :meth:`file` it, complete."""
        self.place(node, record)
        self.file(node, record)

    def file(self, node: torch.fx.Node, record: Record) -> None:
        """``node``'s record, final from here on (setting any of its fields raises)."""
        object.__setattr__(record, "filed", True)
        self.records[node] = record

    def place(self, node: torch.fx.Node, record: Record) -> None:
        """What later rules read of ``node`` (its layout, outputs, partial sums), and the collectives
        its reads imply (one per value and conversion, shared by every consumer), charged in graph
        order. A node on a linear's weight path is placed when visited and filed with its lowering
        once that linear is decided (``plan/propagate.py``)."""
        self.layouts[node] = record.layout
        if record.outputs is not None:
            self.outputs[node] = list(record.outputs)
        if record.partial is not None:
            self.partial[node] = record.partial
        for producer in record.reduced:
            if producer not in self._summed:
                self._summed.add(producer)
                self.collectives.append(
                    Collective(CollectiveKind.ALL_REDUCE, producer, self.partial[producer], op_name(node)))
        for producer, how in record.reads.items():
            self._charge(node, producer, how)
        self.collectives.extend(record.collectives)

    def read_of(self, consumer: torch.fx.Node, producer: torch.fx.Node) -> Read | None:
        record = self.records.get(consumer)
        return None if record is None else record.reads.get(producer)

    def weight_split(self, linear: torch.fx.Node) -> Split | None:
        record = self.records.get(linear)
        return None if record is None else record.weight_split

    def shard(self, split: Split, origins: frozenset[torch.fx.Node], dim: int = -1) -> Shard:
        return Shard(split, origins, dim, self.world, self.rank)

    def wish(self, origins: frozenset[torch.fx.Node], kind: WishKind, arg: Any, reason: str) -> None:
        if self.sequence:  # a sequence cut comes from a rowwise linear: nothing there to re-cut
            origins = frozenset(o for o in origins if self.styles.get(o) != Style.ROWWISE)
            if not origins:
                return
        self.wishes.append(Wish(origins, kind, arg, reason))

    def _charge(self, consumer: torch.fx.Node, producer: torch.fx.Node, how: Read) -> None:
        if how in (Read.LOCAL, Read.NARROW, Read.NARROW_GROUPS) or (how, producer) in self._gathered:
            return
        self._gathered.add((how, producer))
        lay = self.layouts[producer]
        if how == Read.GATHER:
            if lay.split.deals is not None:  # carved pieces only pay if they come back together
                self.wish(lay.origins, WishKind.REPLICATE, None,
                          f"pieces carved out of its heads are gathered before {op_name(consumer)}")
            kind = CollectiveKind.ALL_TO_ALL if self.per_rank else CollectiveKind.ALL_GATHER
            self.collectives.append(Collective(kind, producer, lay.origins, op_name(consumer)))
        elif how == Read.GLOBAL and lay is not None:
            self.collectives.append(Collective(CollectiveKind.ALL_GATHER, producer, lay.origins, op_name(consumer)))
        elif how == Read.GLOBAL:
            self.collectives.append(
                Collective(CollectiveKind.ALL_GATHER_ROWS, producer, frozenset([consumer]), op_name(consumer)))
        else:  # GLOBAL_NARROW of a replicated value
            self.collectives.append(
                Collective(CollectiveKind.ALL_TO_ALL, producer, frozenset([consumer]), op_name(consumer)))

    def reduce(self, linear: torch.fx.Node, scattered: bool = False) -> Collective:
        """A rowwise linear's (or vocab-parallel embedding's) partial sums, combined (``scattered``:
        each rank keeps its part of the sequence)."""
        kind = CollectiveKind.REDUCE_SCATTER if self.per_rank or scattered else CollectiveKind.ALL_REDUCE
        return Collective(kind, linear, frozenset([linear]), "")

    # Records shared by many rules.

    def gathered(self, node: torch.fx.Node) -> Record:
        """The default: every sharded operand gathered, the output replicated."""
        return Record(None, {a: Read.GATHER if self.layouts.get(a) is not None else Read.LOCAL for a in all_args(node)})

    def keep(self, node: torch.fx.Node, out: Shard | None, **fields: Any) -> Record:
        """Every operand used as it is; the output's layout is ``out``."""
        return Record(out, dict.fromkeys(all_args(node), Read.LOCAL), **fields)

    def as_shard(self, arg: torch.fx.Node, out: Shard) -> Read:
        """How a computation whose output is ``out`` reads ``arg`` (use a shard, slice or broadcast)."""
        v = val(arg)
        if self.layouts.get(arg) is not None:
            return Read.LOCAL
        if v is not None and v.dim() >= -out.dim and size_at(arg, out.dim) != 1:
            return Read.NARROW  # (a symbolic size is never 1: Dynamo specialises 0 and 1)
        return Read.LOCAL  # broadcasts over the sharded dim (size 1, or does not reach it)

    def can_read_as_shard(self, arg: torch.fx.Node, out: Shard, out_ndim: int) -> bool:
        lay = self.layouts.get(arg)
        if lay is not None:
            return out.alike(lay)
        v = val(arg)
        if self.per_rank and not (arg in self.uniform and (v.dim() < out_ndim or v.shape[0] == 1)):
            return False  # a Shard's rows are every rank's: only rank-uniform, row-broadcast values fit
        if self.per_rank and v.dim() >= -out.dim and size_at(arg, out.dim) not in (1, out.size):
            return False
        return True

    def input_shard(self, node: torch.fx.Node, whole_ok: bool = False) -> tuple[Shard, int, int] | None:
        """``(shard, ndim, cut dim from the left)`` of ``node``'s first operand, if it is sharded.
        A fused output with whole components is followed only by rules that say ``whole_ok``
        (its split into components); others gather it."""
        src_node = node.args[0] if node.args else None
        src = self.layouts.get(src_node) if isinstance(src_node, torch.fx.Node) else None
        if src is None or val(src_node) is None or (src.split.whole and not whole_ok):
            return None
        ndim = val(src_node).dim()
        return src, ndim, ndim + src.dim

    def unify(self, shards: list[Shard], where: str) -> None:
        """Shards of one dim cut differently meet (e.g. GQA keys against queries): wish for the
        coarsest common cut, when every rank still holds something of it."""
        if len({s.dim for s in shards}) != 1 or len({s.size for s in shards}) != 1:
            return
        if any(len(s.split.parts) != 1 for s in shards) and self._align_components(shards, where):
            return
        unit = math.lcm(*(s.split.unit for s in shards))
        for s in shards:
            target = s.split.coarsen(unit // s.split.unit)
            if target is not None and target.fewest_units(self.world) >= 1 and target != s.split:
                self.wish(s.origins, WishKind.COARSEN, unit // s.split.unit, f"{where} needs units of {unit}")

    def _align_components(self, shards: list[Shard], where: str) -> bool:
        """Shards of one dim meet, some cut into components the others lack (DiffLlama's queries in
        two halves of heads against keys cut as one): wish the others cut at those boundaries too,
        in their own units (keys in units of a group of query heads). Where that cut would leave a
        rank without anything it held, keep those origins whole instead (each rank narrows them).
        True when the components differ (then units are compared once they agree)."""
        if any(s.split.deals is not None or s.split.whole for s in shards):
            return True
        edges = set().union(*(s.split.boundaries() for s in shards))
        if all(s.split.boundaries() == edges for s in shards):
            return False
        for s in shards:
            extra = edges - s.split.boundaries()
            if not extra or any(e % s.split.unit for e in extra):
                continue
            cut = s.split.cut({e // s.split.unit for e in extra})
            if s.split.empties_a_rank(cut, self.world):
                self.wish(s.origins, WishKind.REPLICATE, None,
                          f"{where} needs components of {'/'.join(map(str, cut.parts))} units, fewer than "
                          f"{self.world} ranks; each rank narrows them to its part")
            else:
                self.wish(s.origins, WishKind.CUT, frozenset(e // s.split.unit for e in extra),
                          f"{where} meets a value cut into components")
        return True


def finest(shards: list[Shard]) -> Shard:
    """Of equally owned shards, the one cut in the smallest units (the most views fit it)."""
    return min(shards, key=lambda s: s.split.unit)


def union_origins(shards: list[Shard | None]) -> frozenset[torch.fx.Node]:
    return frozenset().union(*(s.origins for s in shards if s is not None))
