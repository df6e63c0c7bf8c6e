"""What planning one graph reads and never changes: one frozen :class:`PlanContext`, built once.

Before: ``make_plan`` spread a dict of string-keyed modes and ``world``/``rank`` into every step, 9 to
11 loose parameters each. After: each step takes ``ctx`` and what the planning loop changes (the
:class:`~dynashard.plan.recut.Cuts`, the decisions so far)::

    ctx = PlanContext.build(linears, other_uses, graph, options, world, rank, ...)
    ctx.mesh.per_rank, ctx.mesh.stacked, ctx.mesh.sequence   the modes, as layouts (layout/mesh.py)
    ctx.by_node[node], ctx.blocked[node], ctx.presplit, ...   the graph's facts

Invariants: frozen, its mappings read-only; built from the graph and the options alone, so every
rank builds the same one but for ``mesh.rank``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import torch.fx

from dynashard.capture.aliases import mutated_roots
from dynashard.capture.match_adapters import LowRankUpdate, find_low_rank_updates
from dynashard.capture.records import LinearMatch
from dynashard.layout.mesh import Mesh
from dynashard.layout.split import Split
from dynashard.options import Options


@dataclasses.dataclass(frozen=True)
class PlanContext:
    graph: torch.fx.Graph
    linears: tuple[LinearMatch, ...]  # in graph order
    by_node: Mapping[torch.fx.Node, LinearMatch]
    blocked: Mapping[torch.fx.Node, str | None]  # linear -> why it cannot be sharded (None: it can)
    options: Options
    mesh: Mesh
    # placeholders holding the same value on every rank (parameters under replicated weights); they
    # matter only with inputs="per_rank"
    uniform_inputs: frozenset[torch.fx.Node]
    presplit: Mapping[torch.fx.Node, tuple[int, Split]]  # weight -> the dim and split an earlier graph cut it by
    prewhole: frozenset[torch.fx.Node]  # weights a graph compiled earlier reads whole
    updates: Mapping[torch.fx.Node, LowRankUpdate]  # low-rank updates (LoRA), by each member's node
    written: frozenset[torch.fx.Node]  # values an in-place op writes into

    @classmethod
    def build(cls, linears: list[LinearMatch], other_uses: dict[torch.fx.Node, list[str]], graph: torch.fx.Graph,
              options: Options, world: int, rank: int, uniform_inputs: frozenset[torch.fx.Node] = frozenset(),
              presplit: dict[torch.fx.Node, tuple[int, Split]] | None = None,
              prewhole: set[torch.fx.Node] | frozenset[torch.fx.Node] = frozenset()) -> PlanContext:
        by_node = {m.node: m for m in linears}
        mesh = Mesh(world, rank, per_rank=options.inputs == "per_rank", sequence=options.sequence_parallel,
                    stacked=options.weights == "per_rank")
        return cls(graph, tuple(linears), types.MappingProxyType(by_node),
                   types.MappingProxyType({m.node: _why_unshardable(other_uses[m.weight]) for m in linears}),
                   options, mesh, frozenset(uniform_inputs), types.MappingProxyType(dict(presplit or {})),
                   frozenset(prewhole), types.MappingProxyType(find_low_rank_updates(graph, by_node)),
                   frozenset(mutated_roots(graph)))

    @property
    def auto(self) -> bool:
        return self.options.plan == "auto"


def _why_unshardable(other_uses: list[str]) -> str | None:
    return f"weight is also read by {', '.join(other_uses)}" if other_uses else None
