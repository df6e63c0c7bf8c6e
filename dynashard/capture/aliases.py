"""Which values of an aten graph share memory: a graph fact the plan, the rewrite, the report and the
program read alike.

The graph dynashard plans on is not functionalized: a view or an in-place op returns (a view of) its
first argument. :func:`alias_roots` maps each such node to the value whose memory it shares;
:func:`mutated_roots` names the values some in-place op writes into, through any alias.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.layout.nodes import mutates_self


def aliases_input(node: torch.fx.Node) -> bool:
    """True when ``node``'s output may share memory with its first argument (views, in-place ops)."""
    schema = private_aten.schema_of(node.target)
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
