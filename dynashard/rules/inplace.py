"""In-place writes: which ones the layout can follow, which ones it cannot.

The aten graph dynashard plans on is not functionalized, so an in-place op (``add_``, ``copy_``,
``index_copy_``) writes through whatever alias it is given. A write into a Shard through a
shard-preserving alias is safe (the pointwise rule keeps ``self``'s layout); a write into a
gathered copy, or between two reads sharing one gather, would be lost or seen stale: the plan
keeps the written-to layers whole (auto) or refuses (a user plan). A rule for an in-place op
that is not pointwise (a KV cache's ``index_copy_``) belongs here, registered with ``@rule``.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard.shard import LayoutMap, Read, mutates_self


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
        if n.op == "call_function" and mutates_self(n) and isinstance(n.args[0], torch.fx.Node)
    }


def unsafe_mutations(graph: torch.fx.Graph, lm: LayoutMap) -> list[tuple[torch.fx.Node, frozenset[torch.fx.Node]]]:
    """In-place writes the layout cannot follow (the aten graph is not functionalized).

    Safe: a write into a Shard through a shard-preserving alias, as long as no gather of that
    memory is shared across the write. Unsafe, returned with the origins of the Shard whose memory
    it touches: a write through an alias that was gathered (it would change a copy, not the shard),
    or a write between two reads that share one cached gather of the same memory. A write into
    partial sums (or into memory a partial value aliases) is unsafe too: the reads see one
    all-reduced copy.
    """
    root = alias_roots(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    gathers: dict[torch.fx.Node, list[int]] = {}
    for (consumer, producer), how in lm.reads.items():
        if how in (Read.GATHER, Read.GLOBAL) and lm.layouts.get(producer) is not None:
            gathers.setdefault(producer, []).append(order[consumer])
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or not mutates_self(node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        base = root.get(node.args[0], node.args[0])
        members = [n for n in graph.nodes if root.get(n, n) is base]
        partial = frozenset().union(*(lm.partial[m] for m in members if m in lm.partial))
        if partial:
            found.append((node, partial))
            continue
        shard = next((lm.layouts[m] for m in members if lm.layouts.get(m) is not None), None)
        if shard is None:
            continue
        # a write into a copy: of a replicated alias of the shard, or of a gather the op itself reads
        read = lm.reads.get((node, node.args[0]))
        through_copy = lm.layouts.get(node.args[0]) is None or read in (Read.GATHER, Read.GLOBAL)
        stale = any(min(gathers.get(m, [order[node]])) < order[node] < max(gathers.get(m, [0])) for m in members)
        if through_copy or stale:
            found.append((node, shard.origins))
    return found
