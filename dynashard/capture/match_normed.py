"""Normed linears: a weight the graph computes by ``weight_norm`` (from two parameters) or ``spectral_norm``.

Before (what ``torch.nn.utils.parametrizations.weight_norm(nn.Linear(...), dim=d)`` traces to, in
float32; ``v`` stored ``[out, in]``, the gain ``g`` of v's shape with size 1 on every dim but ``d``)::

    wn = aten._weight_norm_interface(v, g, d)     # v * g / ||v|| over every dim but d
    w = getitem(wn, 0); t = aten.t(w); y = aten.addmm(b, x, t)

After: one :class:`~dynashard.capture.records.LinearMatch` on ``v`` (its path: wn, getitem, t) of kind
:class:`WeightNormed`, whose ``companions`` hold ``g``, cut with v on the same dim and split.

On ``d`` (d=0 colwise, d=1 rowwise): the norm of each slice along ``d`` sums over the other dim, so
this rank's slices of v and g give exactly this rank's slices of the weight, no collective
(lowerings.NormOfSlices). On the other dim (across the norms: d=0 rowwise, d=1 colwise): v alone is
cut, g (``[out, 1]`` or ``[1, in]``, nothing along that dim) stays whole, and each norm is this rank's
partial sum of squares, all-reduced (one vector of g's shape), its backward summed as well
(lowerings.NormAcrossCut, set by propagate.py). Under inputs="per_rank" that cut is refused
(:meth:`WeightNormed.refused_dim`): the layer is kept whole.

Left as written (the weight then whole, logged by linear_forms): ``weight_norm(dim=None)`` (one norm
over all of v, traced as ``v * (g / norm(v))``), a gain or norms read by anything else; a v read by
anything else stays whole by match.py's other uses (the deprecated hook form ``torch.nn.utils.weight_norm``
stores the computed weight on the module, which Dynamo returns: its reason says so).
spectral_norm's left-as-written forms follow.

``spectral_norm`` (``torch.nn.utils.parametrizations``, a 2-D weight, dim=0), before::

    # train mode only, n_power_iterations times, under no_grad, written into the buffers u and v:
    u = div.out(mv(W, v), expand(clamp_min_(linalg_vector_norm(mv(W, v)), eps)), out=u)
    v = div.out(mv(transpose(W), u), ..., out=v)
    sigma = vdot(clone(u), mv(W, clone(v)))
    w = div.Tensor(W, sigma); t = aten.t(w); y = aten.addmm(b, x, t)

After: one LinearMatch on W (its path: div, t) of kind SpectralNormed; W alone is cut, u and v stay
whole on every rank (vectors of out and in elements). Every read of W is lowered on this rank's
cut (lowerings.CutMatVec and SigmaOfCut, set by propagate.py): sigma is this rank's term of
``u . W v`` (its rows of W with its block of u, or its columns with its block of v) and one scalar
all_reduce; a power step's ``W v`` or ``W^T u`` is this rank's block all-gathered, or its partial
sum all-reduced (the cut dim contracted), so the normalisation and the buffer writes run on the
whole vector as written.
Matched only when every read of W is one of those: the divide, sigma's ``mv`` (read by its
``vdot`` alone), a power step's ``mv`` (of W or of a transpose of W read by power steps alone)
whose value a ``div.out`` writes into a buffer (an ``out=`` op never runs on a value with a
gradient: the step ran under no_grad, which the aten graph does not record, so the lowering detaches
W there). ``spectral_norm(dim=1)`` (W read through a permute), a conv's (through a view) and a W
read by anything else are left as written.

Invariants: matching never mutates the graph (``drop_unread_norms`` runs in linear_forms.normalise).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from dynashard.layout.nodes import val

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


@dataclasses.dataclass(frozen=True)
class Spectral:
    """spectral_norm's reads of W besides the divide: sigma's ``vdot(a, mv(W, b))`` and the power steps."""

    sigma: torch.fx.Node  # the vdot
    sigma_mv: torch.fx.Node  # mv(W, b), read by the vdot alone
    steps: tuple[torch.fx.Node, ...]  # the power steps' mv(W, x) and mv(transpose(W), x)
    transposes: tuple[torch.fx.Node, ...]

    @property
    def nodes(self) -> tuple[torch.fx.Node, ...]:
        return (*self.transposes, *self.steps, self.sigma_mv, self.sigma)


def spectral_source(node: torch.fx.Node) -> tuple[torch.fx.Node, Spectral] | None:
    """``(W, reads)`` when ``node`` is spectral_norm's ``div.Tensor(W, vdot(a, mv(W, b)))`` on a 2-D W
    every read of which is one of those above (module docstring)."""
    if node.op != "call_function" or node.target is not aten.div.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    w, sigma = node.args
    if not isinstance(w, torch.fx.Node) or w.op != "placeholder" or val(w) is None or val(w).dim() != 2:
        return None
    if not (isinstance(sigma, torch.fx.Node) and sigma.target is aten.vdot.default and len(sigma.args) == 2):
        return None
    sigma_mv = sigma.args[1]
    if not (_mv_of(sigma_mv, w) and set(sigma_mv.users) == {sigma} and sigma.args[0] is not sigma_mv):
        return None
    steps, transposes = [], []
    for user in w.users:
        if user is node or user is sigma_mv:
            continue
        if _mv_of(user, w) and _power_step(user):
            steps.append(user)
        elif _transpose_of(user, w) and all(_mv_of(u, user) and _power_step(u) for u in user.users):
            transposes.append(user)
            steps += list(user.users)
        else:
            return None
    return w, Spectral(sigma, sigma_mv, tuple(steps), tuple(transposes))


def _mv_of(node: object, matrix: torch.fx.Node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.target is aten.mv.default and len(node.args) == 2
            and node.args[0] is matrix and node.args[1] is not matrix and not node.kwargs)


def _transpose_of(node: torch.fx.Node, w: torch.fx.Node) -> bool:
    """``W.H`` of a real 2-D W, as torch traces it (transpose of the last two dims) or ``t``."""
    if node.target is aten.t.default:
        return True
    return node.target is aten.transpose.int and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]


def _power_step(mv: torch.fx.Node) -> bool:
    """``mv`` normalised into a buffer: read by ``div.out`` (and the norm of it) only."""
    users = set(mv.users)
    writes = {u for u in users if u.target is aten.div.out and u.args[0] is mv}
    return bool(writes) and all(u in writes or u.target is aten.linalg_vector_norm.default for u in users)
