"""The ranks a layout is dealt over, and what a value held on them means: the :class:`Mesh`.

Modes are layouts, as DTensor makes data and sequence parallelism placements on a mesh: the options
``inputs``, ``weights`` and ``sequence_parallel`` do not add cases beside the layouts, they say what
every layout of one graph means on these ranks::

    Mesh(world=2, rank=0)                   replicated: the whole value; Shard: this rank's columns
    Mesh(2, 0, per_rank=True)               replicated: this rank's rows (inputs sharded on the
                                            batch, Shard(0)); Shard: every rank's rows, this rank's columns
    Mesh(2, 0, sequence=True)               rowwise outputs reduce-scattered along the sequence
    Mesh(2, 0, stacked=True)                a sharded weight holds one block of every rank's weight

Invariants: one Mesh per graph, frozen; the layout map (``shard.py``), every rule and the rewrite read
the same one, as named attributes.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mesh:
    world: int
    rank: int
    per_rank: bool = False  # inputs="per_rank": replicated values are this rank's rows only
    # sequence_parallel: rowwise outputs are reduce-scattered along the sequence (a Shard of it)
    sequence: bool = False
    stacked: bool = False  # weights="per_rank": sharded weights hold one block of every rank's weight

    @property
    def reduce_name(self) -> str:
        """A rowwise output's collective, as the reasons name it (sequence_parallel: all_reduce where
        the sequence is shorter than the world; the collectives column says which)."""
        return "reduce_scatter" if self.per_rank or self.sequence else "all_reduce"
