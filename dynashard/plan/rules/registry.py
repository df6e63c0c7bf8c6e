"""One table from aten op to its propagation rule.

A rule is ``fn(lm, node) -> Record | None``: it reads the records of earlier nodes in the
:class:`~dynashard.layout.shard.LayoutMap` and returns ``node``'s :class:`~dynashard.layout.shard.Record` (how it
reads each operand, the layout of its output, a size argument to rewrite, a lowering where the op
is not emitted as itself); None means "no sharded form here", and the driver gathers every sharded
operand instead (always correct). The driver files the record and charges its collectives. A rule
may also leave wishes (``lm.wish``). Rules decide from sizes only, never from this rank's offsets,
so every rank takes the same collectives.

Register a rule next to its kin::

    @rule(aten.cumsum.default)                    # in rules/reductions.py: along one dim
    def _cumsum(lm, node): ...                    # -> lm.keep(node, shard) or None

``per_rank=True`` when the rule also holds under ``inputs="per_rank"`` (a Shard there holds
every rank's rows); other rules are not consulted in that mode. A tag rule (``torch.Tag.pointwise``)
applies to every op carrying the tag that has no rule of its own, and to an in-place op whose out-of-place
twin carries it: torch tags ``masked_fill_.Scalar``, ``gelu_``, ``lt_``... as in-place only, though each writes
what its pointwise twin computes (and torch 2.15 traces ``t[mask] = v`` to ``masked_fill_.Scalar``: gathered
first before, for want of a rule). A random op never borrows its twin's rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.layout.shard import LayoutMap, Record

Rule = Callable[[LayoutMap, torch.fx.Node], Record | None]


@dataclasses.dataclass(frozen=True)
class Registered:
    fn: Rule
    per_rank: bool  # holds under inputs="per_rank" too


RULES: dict[object, Registered] = {}
TAG_RULES: dict[torch.Tag, Registered] = {}


def rule(*ops: object, per_rank: bool = False, tags: tuple[torch.Tag, ...] = ()) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of ``ops`` (and of every op carrying one of ``tags``)."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            if op in RULES:
                raise AssertionError(f"two rules for {op}: {RULES[op].fn.__qualname__} and {fn.__qualname__}")
            RULES[op] = Registered(fn, per_rank)
        for tag in tags:
            TAG_RULES[tag] = Registered(fn, per_rank)
        return fn

    return register


def lookup(node: torch.fx.Node, per_rank: bool) -> Rule | None:
    """The rule for ``node`` (None: gather), honouring the input mode."""
    if node.op != "call_function":
        return None
    found = RULES.get(node.target)
    tags = getattr(node.target, "tags", ())
    if found is None:
        found = next((TAG_RULES[t] for t in tags if t in TAG_RULES), None)
    if found is None and private_aten.is_in_place(node.target) and torch.Tag.nondeterministic_seeded not in tags:
        twin = private_aten.out_of_place_twin(node.target)
        found = next((TAG_RULES[t] for t in getattr(twin, "tags", ()) if t in TAG_RULES), None)
    if found is None or (per_rank and not found.per_rank):
        return None
    return found.fn
