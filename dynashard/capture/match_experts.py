"""Experts: matmuls on a 3-D parameter, one weight per expert, each a linear cut alike in every expert.

Before (the forms transformers 5.x and hand-written MoE code trace)::

    bmm(W[ids], x.unsqueeze(-1)) / bmm(x.unsqueeze(1), W[ids])   # HF batched_mm: one expert per row
    bmm(x.view(E, -1, hidden), W)                                # Llama4: W [E, in, out] whole, a batch per expert
    grouped_mm(x, W.transpose(-2, -1), offs)                     # HF grouped_mm (aten or transformers' fallback)
    mm(x, W[e].t())                                              # F.linear(x, W[e]) in a python loop
After: one :class:`~dynashard.capture.records.LinearMatch` of kind ``experts`` per matmul: the weight, the
nodes from it to the matmul (``chain``: the expert selection, a swap of the last two dims, a
dtype conversion under autocast, each at most once), the input and the dims of input and output
that hold the features. Every expert is cut alike: its own colwise / rowwise linear.

Invariants: matching never mutates the graph; a chain holds only ops that act on every expert's
weight alike (select or index the expert dim, transpose the last two, convert the dtype), so
they run on this rank's cut as on the whole weight.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.capture.linear_forms import converted_source
from dynashard.capture.records import EXPERTS, LinearMatch, ParamInfo, plan_name_of
from dynashard.layout.nodes import val

aten = torch.ops.aten


def _is_grouped_mm(node: torch.fx.Node) -> bool:
    """``aten._grouped_mm`` or transformers' fp32 fallback op (matched by name: no import)."""
    name = getattr(private_aten.schema_of(node.target), "name", "")
    return node.op == "call_function" and name in ("aten::_grouped_mm", "transformers::grouped_mm_fallback")


def _swaps_last_two(node: torch.fx.Node, ndim: int) -> bool:
    if node.target is aten.t.default:
        return ndim == 2
    if node.target is aten.transpose.int:
        return sorted(int(d) % ndim for d in node.args[1:3]) == [ndim - 2, ndim - 1]
    if node.target is aten.permute.default:
        return [int(d) % ndim for d in node.args[1]] == [*range(ndim - 2), ndim - 1, ndim - 2]
    return False


def _selects_experts(node: torch.fx.Node) -> str | None:
    """``"index"`` for ``W[ids]`` (1-D ids: one expert per row), ``"select"`` for ``W[e]``."""
    if node.target is aten.index.Tensor and len(node.args[1]) == 1 and val(node.args[1][0]) is not None:
        return "index" if val(node.args[1][0]).dim() == 1 else None
    if node.target is aten.select.int and int(node.args[1]) == 0:
        return "select"
    return None


def _expert_source(node: object, params: dict[torch.fx.Node, ParamInfo]):
    """``(W, chain, transposed, selection)`` when ``node`` is a 3-D parameter ``W`` reached through
    at most one expert selection (``"index"``, ``"select"`` or None), at most one swap of the
    last two dims and at most one dtype conversion (autocast's ``_to_copy``), in any order."""
    chain: list[torch.fx.Node] = []
    transposed, selection, converted = False, None, False
    while isinstance(node, torch.fx.Node) and node not in params:
        if node.op != "call_function" or not isinstance(node.args[0], torch.fx.Node) or val(node.args[0]) is None:
            return None
        if not converted and converted_source(node) is not None:
            converted = True
        elif not transposed and _swaps_last_two(node, val(node.args[0]).dim()):
            transposed = True
        elif selection is None and _selects_experts(node) is not None:
            selection = _selects_experts(node)
        else:
            return None
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or not params[node].is_parameter or val(node).dim() != 3:
        return None
    return node, tuple(reversed(chain)), transposed, selection


def find_experts(graph: torch.fx.Graph, params: dict[torch.fx.Node, ParamInfo]) -> list[LinearMatch]:
    """Matmuls on a 3-D expert parameter, one record per matmul: ``bmm`` of ``W[ids]``, a grouped
    matmul of ``W``, or ``mm`` of ``W[e]`` (a python loop over experts)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.bmm.default:
            a, b = node.args[0], node.args[1]
            src = _expert_source(a, params)
            # W[ids] @ x: [S, out, in] @ [S, in, n]; whole W: one batch per expert (Llama4's x @ W[E, in, out])
            if src is not None and src[3] in ("index", None):
                weight, chain, transposed, _ = src
                form, x, in_dim, out_dim = ("in_out" if transposed else "out_in"), b, -2, -2
            else:  # x @ W[ids]: [S, m, in] @ [S, in, out]
                src = _expert_source(b, params)
                if src is None or src[3] not in ("index", None):
                    continue
                weight, chain, transposed, _ = src
                form, x, in_dim, out_dim = ("out_in" if transposed else "in_out"), a, -1, -1
        elif node.target is aten.mm.default or _is_grouped_mm(node):
            # x @ W[e].t() (F.linear in a loop over experts), or x [S, in] grouped @ W [E, in, out]
            src = _expert_source(node.args[1], params)
            if src is None or src[3] != ("select" if node.target is aten.mm.default else None):
                continue
            weight, chain, transposed, _ = src
            form, x, in_dim, out_dim = ("out_in" if transposed else "in_out"), node.args[0], -1, -1
        else:
            continue
        experts, d1, d2 = (int(s) for s in weight.meta["val"].shape)
        out_f, in_f = (d1, d2) if form == "out_in" else (d2, d1)
        found.append(
            LinearMatch(node=node, fqn=plan_name_of(params[weight]), weight=weight, weight_form=form, transpose=None,
                        input=x, bias=None, in_features=in_f, out_features=out_f, kind=EXPERTS, chain=chain,
                        experts=experts, input_dim=in_dim, output_dim=out_dim)
        )
    return found
