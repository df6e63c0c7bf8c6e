"""Weight-normed linears: a weight the graph computes by ``weight_norm`` from two parameters.

Before (what ``torch.nn.utils.parametrizations.weight_norm(nn.Linear(...), dim=d)`` traces to, in
float32; ``v`` stored ``[out, in]``, the gain ``g`` of v's shape with size 1 on every dim but ``d``)::

    wn = aten._weight_norm_interface(v, g, d)     # v * g / ||v|| over every dim but d
    w = getitem(wn, 0); t = aten.t(w); y = aten.addmm(b, x, t)

After: one :class:`~dynashard.match.LinearMatch` on ``v`` (its path: wn, getitem, t) of kind
:class:`WeightNormed`, whose ``companions`` hold ``g``, cut with v on the same dim and split.

Why only on ``d``: the norm of each slice along ``d`` sums over the other dims, so this rank's slices
of v and g give exactly this rank's slices of the weight (d=0: colwise; d=1: rowwise). Cut on another
dim, each rank would divide by the norm of its own columns only: that cut is refused
(:meth:`WeightNormed.refused_dim`), and the plan keeps such a linear whole rather than reduce the
sums of squares across ranks.

Left as written (the weight then whole, logged by linear_forms): ``weight_norm(dim=None)`` (one norm
over all of v, traced as ``v * (g / norm(v))``), a gain or norms read by anything else; a v read by
anything else stays whole by match.py's other uses.

Invariants: matching never mutates the graph (``drop_unread_norms`` runs in linear_forms.normalise).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from dynashard.nodes import val

aten = torch.ops.aten


def normed_source(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, int] | None:
    """``(v, g, wn, d)`` when ``node`` is ``getitem(_weight_norm_interface(v, g, d), 0)`` on a 2-D v
    whose norms are per slice along d (0 or 1) and a gain read by this op alone."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return None
    wn = node.args[0]
    if not isinstance(wn, torch.fx.Node) or wn.target is not aten._weight_norm_interface.default:
        return None
    v, g = wn.args[:2]
    d = wn.args[2] if len(wn.args) > 2 else wn.kwargs.get("dim", 0)
    vv, vg = val(v), val(g)
    if vv is None or vg is None or vv.dim() != 2 or d not in (0, 1):  # (-1: one norm over all of v)
        return None
    if tuple(vg.shape) != tuple(s if i == d else 1 for i, s in enumerate(vv.shape)):
        return None
    if g.op != "placeholder" or set(g.users) != {wn} or any(u is not node and u.users for u in wn.users):
        return None  # the gain or the norms read elsewhere: the weight is not this linear's alone
    return v, g, wn, d


def drop_unread_norms(graph: torch.fx.Graph) -> None:
    """The unread ``getitem(wn, 1)`` (the norms) of each weight norm: no computation, but a reader of
    the weight's path that match.py's other uses would count."""
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is operator.getitem and not node.users
                and isinstance(node.args[0], torch.fx.Node)
                and node.args[0].target is aten._weight_norm_interface.default):
            graph.erase_node(node)


def plan_name(module_fqn: str, fqn: str) -> str:
    """The parametrized module's FQN (``up`` for ``up.parametrizations.weight``), as plans name it; a
    tensor other than ``weight`` by its own name (``up.w``); ``fqn`` if no parametrization holds it."""
    head, found, tail = module_fqn.rpartition("parametrizations.")
    if not found or (head and not head.endswith(".")) or "." in tail:
        return fqn
    owner = head[:-1]
    return owner if tail == "weight" else f"{owner}.{tail}" if owner else tail
