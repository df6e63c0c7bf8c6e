"""The per-call handshake, waited for inside the sharded graph, just before its first collective.

Every call starts the :class:`~dynashard.comm.protocol.Handshake` (the ranks' input check, one small
host-side all_reduce) and runs the graph at once; what the graph computes before its first
collective (a column-parallel projection, attention) overlaps the handshake's round trip, and the
handshake is finished before anything leaves the rank::

    before:  mm = mm(x, w1); ...; ar = all_reduce(mm, "sum", g)
    after:   mm = mm(x, w1); ...; z = dynashard.call_gate(mm, slot)   # waits; a 0-dim zero
             ar = all_reduce(mm + z, "sum", g)                       # ordered after the wait

Invariants:
- No collective of the graph starts before its call's handshake is finished (the ``+ z`` makes the
  wait a data dependency of the first collective; a later one that does not depend on it, a parallel
  branch, gets a gate of its own), so ranks whose inputs differ raise the handshake's error instead
  of sending collectives of other sizes.
- Nothing the graph writes outside itself comes before the wait: a graph that mutates one of its
  inputs (a KV cache, a buffer) is not gated (its handshake is finished before the call).
- ``x + 0`` is ``x`` (a ``-0.0`` becomes ``+0.0``, which every sum treats alike).
- The program finishes the handshake after the graph too, so a graph whose gate did not run (no
  collective, or an error before it) still raises its error, in the order the ranks issued it.
- Under CUDA graphs the gate would not run on replay: those programs wait before the call.
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx

from dynashard import _torch as private
from dynashard._torch import aten as private_aten
from dynashard._torch import regions as private_regions
from dynashard.comm.protocol import Handshake

# slot -> the handshake of the call in progress (one entry per program call in flight: popped after it)
_OPEN: dict[int, Handshake] = {}
_SLOTS = itertools.count()


@torch.library.custom_op("dynashard::call_gate", mutates_args=())
def call_gate(x: torch.Tensor, slot: int) -> torch.Tensor:
    """Finish the handshake of the call in progress of program ``slot``; a 0-dim zero of ``x``'s dtype."""
    handshake = _OPEN.get(slot)
    if handshake is not None:  # (None: the program waited before the call)
        handshake.wait()
    return torch.zeros((), dtype=x.dtype, device=x.device)


@call_gate.register_fake
def _(x: torch.Tensor, slot: int) -> torch.Tensor:
    return x.new_empty(())


def _collective(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not private.is_op_overload(node.target):
        return False
    name = private_aten.schema_of(node.target).name
    return name.startswith("_c10d_functional::") and name != "_c10d_functional::wait_tensor"


def _regions_follow(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], collectives: list[torch.fx.Node]) -> bool:
    """Whether every outlined region with collectives inside (``rewrite/outline.py``) reads the result of one of
    the graph's own collectives (so it follows a gate): else the graph is not gated."""
    after: set[torch.fx.Node] = set()
    for node in nodes:
        if node in collectives or any(a in after for a in node.all_input_nodes):
            after.add(node)
        elif (sub := private_regions.subgraph_of(gm, node)) is not None and any(map(_collective, sub.graph.nodes)):
            return False
    return True


def _mutates_input(node: torch.fx.Node) -> bool:
    """An op writing into (a view of) a graph input: a cache or a buffer changed outside the graph."""
    if node.op != "call_function" or not private.is_op_overload(node.target):
        return False
    schema = private_aten.schema_of(node.target)
    if not schema.is_mutable:
        return False
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
            if _base(value).op == "placeholder":
                return True
    return False


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """What ``node`` is a view of (through views, in-place results and getitem of a split's views)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        target = node.target
        schema = private_aten.schema_of(target) if private.is_op_overload(target) else None
        if target is operator.getitem:
            node = node.args[0]
        elif schema is not None and schema.returns and schema.returns[0].alias_info is not None:
            node = node.args[0]
        else:
            break
    return node


def insert(gm: torch.fx.GraphModule) -> int | None:
    """Gate ``gm``'s collectives on the call's handshake: the first one, and any other that does not
    already follow it (a parallel branch, which a compiler could issue first). The slot its program
    registers the handshake under, or None when the graph cannot be gated (it mutates an input, has no
    collective, or a collective whose input is not one tensor)."""
    nodes = list(gm.graph.nodes)
    collectives = [n for n in nodes if _collective(n)]
    if not collectives or any(_mutates_input(n) for n in nodes) or \
            not all(isinstance(n.args[0], torch.fx.Node) for n in collectives):
        return None
    if not _regions_follow(gm, nodes, collectives):
        return None
    slot = next(_SLOTS)
    gated: set[torch.fx.Node] = set()  # nodes that follow a gate
    for node in nodes:
        if any(isinstance(a, torch.fx.Node) and a in gated for a in node.all_input_nodes):
            gated.add(node)
        elif node in collectives:
            gated.update(_gate(gm, node, slot))
    gm.recompile()
    return slot


def _gate(gm: torch.fx.GraphModule, collective: torch.fx.Node, slot: int) -> list[torch.fx.Node]:
    """``collective(x + call_gate(x, slot))``: the nodes now behind the gate."""
    x = collective.args[0]
    with gm.graph.inserting_before(collective):
        zero = gm.graph.call_function(torch.ops.dynashard.call_gate.default, (x, slot))
        gated = gm.graph.call_function(torch.ops.aten.add.Tensor, (x, zero))
    if "val" in x.meta:
        zero.meta["val"], gated.meta["val"] = x.meta["val"].new_empty(()), x.meta["val"]
    collective.replace_input_with(x, gated)
    return [zero, gated, collective]


class Opened:
    """``with Opened(slot, handshake):`` the graph's gate finds the handshake while the call runs."""

    def __init__(self, slot: int | None, handshake: Handshake | None) -> None:
        self.slot, self.handshake = slot, handshake

    def __enter__(self) -> Handshake | None:
        if self.slot is not None and self.handshake is not None:
            _OPEN[self.slot] = self.handshake
        return self.handshake

    def __exit__(self, *exc: object) -> None:
        if self.slot is not None:
            _OPEN.pop(self.slot, None)
