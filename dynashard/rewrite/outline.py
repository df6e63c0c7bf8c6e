"""Outline: the rewritten graph's nested compile regions put back as one shared subgraph, so the compiler
compiles each region once instead of once per call.

Before (this rank's rewritten graph: every call of a ``torch.compiler.nested_compile_region`` inlined to plan
it, each node tagged with its call, ``_torch/regions.py``)::

    pow = aten.pow(x, 2) ...  mm = aten.mm(v, t_w0)  ar = all_reduce(mm)  ...  add_5 = aten.add(add_3, v_14)  # call 0
    pow_3 = aten.pow(add_5, 2) ...  mm_7 = aten.mm(v_15, t_w1) ...                                             # call 1
After::

    r0 = invoke_subgraph(dynashard_region_0, "dynashard_subgraph_0", x, w0, ...); add_5 = r0[0]
    r1 = invoke_subgraph(dynashard_region_0, "dynashard_subgraph_0", add_5, w1, ...); ...

Invariants: the outlined graph computes what the flat one does, op for op (the subgraph is call 0's nodes, and
every call's nodes are the same ops on the same constants, collectives included, differing only by the outer
values they read: its operands, per-layer weights among them). A region whose calls differ (another plan for
one layer, a conversion that crosses a call's boundary, lost tags) stays flat, with the reason at DEBUG; so
does one the compiler would get wrong (in-place writes, an output aliasing an operand, checkpoint tags).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard._torch import regions as private_regions
from dynashard.capture.aliases import aliases_input
from dynashard.layout.nodes import mutates_self

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Call:
    """One call's nodes in the rewritten graph, in graph order, and what it reads and gives outside."""

    number: int
    nodes: list[torch.fx.Node]
    operands: list[torch.fx.Node]  # outer values its nodes read, in order of first read
    outputs: list[int]  # positions in ``nodes`` of the values read outside it

    @classmethod
    def of(cls, number: int, nodes: list[torch.fx.Node]) -> Call:
        inner, operands = set(nodes), {}
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in inner:
                    operands.setdefault(arg, None)
        outputs = [i for i, n in enumerate(nodes) if any(u not in inner for u in n.users)]
        return cls(number, nodes, list(operands), outputs)

    def key(self) -> list[Any]:
        """The call as ops on constants, inner values by position and outer ones by operand number: two calls
        with equal keys compute alike on their own operands (whose kinds, shapes and strides are in it too)."""
        position = {n: i for i, n in enumerate(self.nodes)}
        operand = {n: i for i, n in enumerate(self.operands)}

        def name(value: Any) -> Any:
            if isinstance(value, torch.fx.Node):
                return ("in", position[value]) if value in position else ("operand", operand[value])
            return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)

        ops = [(n.op, str(n.target), repr(torch.fx.node.map_aggregate(n.args, name)),
                repr(torch.fx.node.map_aggregate(n.kwargs, name))) for n in self.nodes]
        return [ops, [_describe(n.meta.get("val")) for n in self.operands]]


def outline_regions(gm: torch.fx.GraphModule, fake_args: list[Any]) -> torch.fx.GraphModule:
    """``gm`` with each region whose calls are alike outlined (in place); the others left flat, said at DEBUG.
    ``fake_args``: ``gm``'s inputs, to describe its values again where it has lost them (read from the cache)."""
    regions: dict[str, dict[int, list[torch.fx.Node]]] = {}
    for node in gm.graph.nodes:
        tag = private_regions.region_of(node)
        if tag is not None and node.op == "call_function":
            regions.setdefault(tag[0], {}).setdefault(tag[1], []).append(node)
    needed = {n for by_number in regions.values() for nodes in by_number.values() for node in nodes
              for n in (node, *node.all_input_nodes)}
    if any("val" not in n.meta for n in needed):
        private_regions.propagate_vals(gm, fake_args)
    outlined = []
    for identifier, by_number in regions.items():
        calls = [Call.of(number, _outer_sizes(nodes)) for number, nodes in sorted(by_number.items())]
        why = _why_flat(gm, calls)
        if why is not None:
            log.debug("dynashard: nested_compile_region %s left flat for the compiler: %s", identifier, why)
            continue
        name = private_regions.add_subgraph(gm, f"dynashard_region_{len(outlined)}", _subgraph(calls[0], calls))
        outputs = sorted({i for c in calls for i in c.outputs})
        for call in calls:
            _replace(gm, Call.of(call.number, call.nodes), name, f"dynashard_{identifier}", outputs)
        outlined.append(identifier)
    if outlined:
        gm.graph.lint()
        gm.recompile()
        log.debug("dynashard: %d nested_compile_region(s) outlined for the compiler (%s), %d call(s)",
                  len(outlined), ", ".join(outlined), sum(len(regions[i]) for i in outlined))
    return gm


def _why_flat(gm: torch.fx.GraphModule, calls: list[Call]) -> str | None:
    """Why the region's calls cannot share one subgraph, or None."""
    if len(calls) < 2:
        return "called once"
    first = calls[0].key()
    for call in calls:
        if (number := _symbolic_number(call)) is not None:
            return (f"call {call.number} reads the symbolic number {number.name} (a float Dynamo left unspecialized "
                    "under dynamic=True, e.g. a norm's eps; torch._dynamo.config.specialize_float = True makes it a "
                    "constant, and the region outlinable)")
        for node in call.nodes:
            if "recompute" in node.meta:
                return f"activation checkpoint tags inside it ({node.name}; the partitioner reads them per graph)"
            if mutates_self(node) or _mutable(node):
                return f"it writes in place ({node.name}: {node.target})"
        if (crossing := _crossing(gm, call)) is not None:
            return (f"call {call.number} reads {crossing.name}, computed outside the call from its own values "
                    "(a conversion that crosses the region's boundary)")
        inner, roots = set(call.nodes), {}
        for i in call.outputs:
            node = call.nodes[i]
            if not isinstance(node.meta.get("val"), torch.Tensor):
                return f"call {call.number} gives {node.name} (not one tensor) to the graph outside"
            root = _view_root(node, inner)
            if root not in inner:
                return f"call {call.number}'s output {node.name} is a view of one of its operands"
            if root in roots:  # (invoke_subgraph's outputs may not alias one another)
                return f"call {call.number}'s outputs {roots[root].name} and {node.name} share memory"
            roots[root] = node
        for operand in call.operands:
            if not isinstance(operand.meta.get("val"), (torch.Tensor, torch.SymInt)):
                return f"call {call.number} reads {operand.name}, neither a tensor nor a size"
        key = call.key()
        if key != first:
            return f"call {call.number} differs from call {calls[0].number}: {_difference(first, key, call)}"
    return None


def _difference(first: list[Any], other: list[Any], call: Call) -> str:
    (ops0, operands0), (ops, operands) = first, other
    if len(ops) != len(ops0):
        return f"{len(ops)} ops against {len(ops0)} (a different plan, or tags lost)"
    for i, (a, b) in enumerate(zip(ops0, ops)):
        if a != b:
            return f"its op {i} ({call.nodes[i].name}) is {b[1]}{b[2]}, call 0's {a[1]}{a[2]}"
    for i, (a, b) in enumerate(zip(operands0, operands)):
        if a != b:
            return f"its operand {i} ({call.operands[i].name}) is {b}, call 0's {a}"
    return "its operands"


def _outer_sizes(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """A call's nodes less its size arithmetic on outer values (``mul = s0 * s1`` of Dynamo's symbolic sizes,
    for a ``view``), which stays in the outer graph, ahead of the call, and reaches it as an operand.

    NOTE: under ``dynamic=True`` the aten trace computes each size expression once (make_fx reuses the proxy of
    an equal SymInt): call 0's ``mul`` is read by every later call. Kept in call 0, it was an output of the call
    that is not a tensor (invoke_subgraph gives tensors only), and every region stayed flat; an operand, every
    call reads it alike. Size arithmetic reading a value the call computes stays inside it."""
    inner, outer = set(nodes), set()
    for node in nodes:
        if _outer_size(node, inner, outer):
            outer.add(node)
    return [n for n in nodes if n not in outer]


def _outer_size(node: torch.fx.Node, inner: set[torch.fx.Node], outer: set[torch.fx.Node]) -> bool:
    """Whether ``node`` is size arithmetic (a SymInt) on values outside the call (or on such arithmetic)."""
    return (node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt)
            and all(a not in inner or a in outer for a in node.all_input_nodes))


def _symbolic_number(call: Call) -> torch.fx.Node | None:
    """A symbolic float the call reads (an operand) or makes (``.item()`` of a tensor), or None: invoke_subgraph
    takes tensors and integers only, and a call that takes the ``.item()`` of an operand inside is not alike its
    later calls, which Dynamo gives the number taken outside (``_torch/regions.py``)."""
    for node in (*call.operands, *call.nodes):
        if isinstance(node.meta.get("val"), torch.SymFloat):
            return node
    return None


def _crossing(gm: torch.fx.GraphModule, call: Call) -> torch.fx.Node | None:
    """An outer node that a node of the call reads and that reads one of the call's nodes (through any path):
    the call could not be one op."""
    inner, downstream = set(call.nodes), set()
    for node in gm.graph.nodes:
        if node in inner:
            for arg in node.all_input_nodes:
                if arg in downstream:
                    return arg
        elif any(a in inner or a in downstream for a in node.all_input_nodes):
            downstream.add(node)
    return None


def _mutable(node: torch.fx.Node) -> bool:
    schema = private_aten.schema_of(node.target)
    return bool(schema is not None and schema.is_mutable)


def _view_root(node: torch.fx.Node, inner: set[torch.fx.Node]) -> torch.fx.Node:
    """The value whose memory ``node`` shares, through the call's views (an operand where it is outside)."""
    while node in inner and node.op == "call_function" and aliases_input(node):
        node = node.args[0]
    return node


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), str(value.device), tuple(map(str, value.shape)),
                tuple(map(str, value.stride())), value.requires_grad)
    return type(value).__name__


def _subgraph(call: Call, calls: Iterable[Call]) -> torch.fx.Graph:
    """Call 0's nodes as a graph of their own: its operands the placeholders, every value any call gives outside
    the outputs (one tuple)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, operand in enumerate(call.operands):
        env[operand] = graph.placeholder(f"operand_{i}")
        env[operand].meta["val"] = operand.meta.get("val")
    for node in call.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    outputs = sorted({i for c in calls for i in c.outputs})
    for i in outputs:
        private_regions.forget_grad_state(env[call.nodes[i]])
    graph.output(tuple(env[call.nodes[i]] for i in outputs))
    return graph


def _replace(gm: torch.fx.GraphModule, call: Call, subgraph: str, identifier: str, outputs: list[int]) -> None:
    """The call's nodes replaced by one ``invoke_subgraph`` after its last node; the outer nodes between its
    first and last that read its results (none of which it reads: ``_crossing``) moved after it, in order."""
    inner, last = set(call.nodes), call.nodes[-1]
    downstream: list[torch.fx.Node] = []
    seen = set(inner)
    node = call.nodes[0]
    while node is not last:
        if node not in inner and any(a in seen for a in node.all_input_nodes):
            downstream.append(node)
            seen.add(node)
        node = node.next
    with gm.graph.inserting_before(last.next):
        results = private_regions.call_subgraph(gm.graph, subgraph, identifier, call.operands,
                                                [call.nodes[i] for i in outputs])
    anchor = results[-1]
    for node in downstream:
        anchor.append(node)
        anchor = node
    for i, result in zip(outputs, results, strict=True):
        call.nodes[i].replace_all_uses_with(result, delete_user_cb=lambda user: user not in inner)
        if not result.users:
            gm.graph.erase_node(result)
    for node in reversed(call.nodes):
        gm.graph.erase_node(node)
