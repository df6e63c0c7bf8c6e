"""Linears in other clothes: rewritten, before matching, into the form match.py reads.

Before (what make_fx traces) -> after (each traced from the line of torch in ``_LINEAR``, so the
graph's symbolic sizes stay its own)::

    einsum("bsd,hd->bsh", x, W)          bmm(view(x', [1, M, K]), view(permute(unsqueeze(W)), [1, K, N]))
    bmm(x, W.t().expand(B, -1, -1))      bmm(x, expand(t(W), [B, -1, -1]))
        -> view(mm(view(x, [-1, K]), t(W)), [.., M, N])     (W stored [out, in]; [in, out]: mm(.., W))
    einsum("hd,bds->bhs", W, x)          bmm(view(W', [1, M, K]), view(x', [1, K, N]))   (W on the left)
        -> transpose(view(mm(view(clone(transpose(x')), [-1, K]), t(W)), [1, N, M]), -1, -2)
    Conv1d(k=1) on [B, C, L]             convolution(x, W[out, in, 1], b, [1], [0], [1], False, [0], 1)
        -> transpose(view(addmm(b, view(clone(transpose(x))), t(squeeze(W, -1)))), 1, 2)
    Conv2d(k=1) on [B, C, H, W]          convolution(x, W[out, in, 1, 1], b, [1, 1], [0, 0], ...)
        -> permute(view(addmm(b, view(clone(permute(x))), t(squeeze(W, [2, 3])))), [0, 3, 1, 2])
    F.linear(h, W.t()) (a tied decoder)  mm(h, t(t(W)))  ->  mm(h, W)
        (under autocast)                 mm(h, t(_to_copy(t(W))))  ->  mm(h, _to_copy(W))

The weight side of a bmm is recognised by its strides, not by the ops' names: the chain of views
from the 2-D parameter is replayed on a meta tensor, and the per-batch matrix is W.t() or W
exactly when it is a [K, N] view with W.t()'s (or W's) strides at offset 0, on the left a [M, K]
view with W's (or W.t()'s) (einsum's unsqueeze/permute/view chains differ by equation; the strides
do not). A broadcast over the batch (an ``expand`` of one matrix) is the same matrix in every
batch, so the bmm is one linear.

``weight_norm``'s ``_weight_norm_interface(v, g)`` is matched on v, and ``spectral_norm``'s
``div(W, sigma)`` on W, its sigma and power iteration lowered on the cut (match_normed.py; the
unread norms output of weight_norm is dropped here). Any other linear whose weight the graph
computes from parameters (``weight_norm(dim=None)``'s ``v * (g / norm(v))``, ``spectral_norm(dim=1)``'s
permuted W) is left whole, with the reason logged at debug level: dynashard cuts parameters a linear
reads as stored, or through one of those two.

Invariants: the only step of analysis that changes what the graph computes as written, and it
never changes a value: each replacement computes the same products and sums (a matmul kernel's
own order aside). A node that is not exactly one of these forms is left as it is.
"""

from __future__ import annotations

import logging

import torch
import torch.fx
import torch.nn.functional as F

from dynashard import _torch as private
from dynashard._torch import aten as private_aten
from dynashard.capture.match_normed import drop_unread_norms, normed_source, spectral_source
from dynashard.layout.nodes import val

aten = torch.ops.aten
log = logging.getLogger(__name__)

# Ops that only re-view their first argument (the chain from a weight to a bmm)
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.permute.default, aten.transpose.int, aten.t.default, aten.alias.default}
_DEAD = _VIEWS | {aten.expand.default, aten._to_copy.default}  # what a rewritten form leaves unread (erased)
# What each form becomes, as the model could have written it ("out_in": W stored [out, in])
# (contiguous: a matmul reads a non-contiguous 3-D input as an expand and a bmm, not a view and an mm)
_LINEAR = {
    "out_in": lambda x, w: F.linear(x.contiguous(), w),
    "in_out": lambda x, w: torch.matmul(x.contiguous(), w),
    # the weight on the left, ``W @ x`` on x ``[B, K, N]`` (einsum("hd,bds->bhs")): ``(x^T W^T)^T``
    "out_in_left": lambda x, w: F.linear(x.transpose(-1, -2).contiguous(), w).transpose(-1, -2),
    "in_out_left": lambda x, w: torch.matmul(x.transpose(-1, -2).contiguous(), w).transpose(-1, -2),
    "conv1x1": lambda x, w, b: F.linear(x.transpose(1, 2).contiguous(), w.squeeze(-1), b).transpose(1, 2),
    "conv1x1_no_bias": lambda x, w: F.linear(x.transpose(1, 2).contiguous(), w.squeeze(-1)).transpose(1, 2),
    "conv2d1x1": lambda x, w, b: _channels_last(F.linear, x, w.squeeze((2, 3)), b),
    "conv2d1x1_no_bias": lambda x, w: _channels_last(F.linear, x, w.squeeze((2, 3))),
}


def _channels_last(f, x: torch.Tensor, *args) -> torch.Tensor:
    """``f`` on ``x [B, C, H, W]``'s channels, as the last dim, the result's put back in front."""
    return f(x.permute(0, 2, 3, 1).contiguous(), *args).permute(0, 3, 1, 2)


def normalise(gm: torch.fx.GraphModule, params: set[torch.fx.Node], module_tensors: dict[torch.fx.Node, str]) -> None:
    """Rewrite every linear on a parameter in ``params`` written in another form (above) in place;
    ``module_tensors``: every input that is a module's parameter or buffer, with its FQN."""
    graph = gm.graph
    drop_unread_norms(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.bmm.default:
            found = _broadcast_weight(node.args[1], params)
            if found is not None:
                _replace(gm, node, found[1], [node.args[0], found[0]], found[2])
            elif (found := _broadcast_weight(node.args[0], params, left=True)) is not None:
                _replace(gm, node, found[1], [node.args[1], found[0]], found[2])
        elif node.target is aten.convolution.default and _pointwise_conv(node, params):
            x, w, b = node.args[:3]
            form = "conv1x1" if val(w).dim() == 3 else "conv2d1x1"
            _replace(gm, node, form if b is not None else f"{form}_no_bias", [x, w] + ([b] if b is not None else []))
        elif node.target in (aten.mm.default, aten.addmm.default):
            _cancel_double_transpose(graph, node, params)
            _log_computed_weight(node, params, module_tensors)
    gm.recompile()


def _log_computed_weight(node: torch.fx.Node, params: set[torch.fx.Node], module_tensors: dict[torch.fx.Node, str]
                         ) -> None:
    """Say why a matmul on a weight computed from parameters alone (no activation) is no linear here."""
    operand = node.args[-1]
    while isinstance(operand, torch.fx.Node) and operand.target in (aten.t.default, aten._to_copy.default):
        operand = operand.args[0]
    if (not isinstance(operand, torch.fx.Node) or operand.op != "call_function" or normed_source(operand)
            or spectral_source(operand)):
        return
    seen, todo, ops = set(), [operand], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n not in module_tensors:
            return  # an activation: attention's scores, not a weight
        if n.op == "call_function":
            ops.add(getattr(n.target, "__name__", str(n.target)))
            todo += n.all_input_nodes
    sources = sorted(module_tensors[n] for n in seen & params)
    if sources:
        log.debug("dynashard: %s reads a weight computed from parameters %s by %s: left whole (dynashard cuts "
                  "parameters a linear reads as stored; of computed weights only weight_norm(dim=0 or 1)'s and "
                  "spectral_norm(dim=0)'s are cut)",
                  node.name, sources, sorted(ops))


def _broadcast_weight(operand: torch.fx.Node, params: set[torch.fx.Node], left: bool = False
                      ) -> tuple[torch.fx.Node, str, torch.dtype | None] | None:
    """``(W, form, cast)`` when a bmm's second operand ``[B, K, N]`` is one matrix, W.t() ("out_in") or W
    ("in_out") of a 2-D parameter W (or what ``_weight_like`` accepts), in every batch: views of W and at
    most one expand over the batch (``torch.matmul`` of a non-contiguous 3-D x and a W that needs no gradient
    traces ``view(expand(t(W)))``), and at most one dtype conversion among them (autocast's, returned: the
    rewritten linear converts W). ``left``: the first operand ``[B, M, K]``, W ("out_in_left") or W.t()
    ("in_out_left")."""
    node, chain, cast = operand, [], None
    if node.op == "call_function" and node.target is aten.expand.default:
        node = node.args[0]  # (a broadcast: the rest must be one matrix, checked by its shape below)
    expanded = node is not operand
    while node.op == "call_function" and isinstance(node.args[0], torch.fx.Node) and (
            node.target in _VIEWS or node.target is aten.expand.default and not expanded
            or cast is None and _conversion(node) is not None):
        expanded |= node.target is aten.expand.default
        cast = _conversion(node) if cast is None else cast
        chain.append(node)
        node = node.args[0]
    weight = val(node)
    if not _weight_like(node, params):
        return None
    if weight is None or weight.dim() != 2 or not all(isinstance(s, int) for s in weight.shape):
        return None
    replayed, hinted = torch.empty(weight.shape, device="meta"), []

    def hint(n: torch.fx.Node) -> int:  # a symbolic batch size at its example value (see the broadcast check)
        hinted.append(n)
        return private_aten.size_hint(n.meta.get("val"))

    try:
        for step in reversed(chain):  # (a conversion copies: which element of W each index reads stays)
            if step.target is not aten._to_copy.default:
                replayed = step.target(replayed, *torch.fx.node.map_arg(step.args[1:], hint), **step.kwargs)
    except (TypeError, RuntimeError):  # no view fits
        return None
    # one matrix for every batch: each batch dim expanded (stride 0), or of size 1 (not merely at the
    # example value of a symbolic size)
    while replayed.dim() > 2 and (replayed.stride(0) == 0 or replayed.shape[0] == 1 and not hinted):
        replayed = replayed[0]
    if replayed.dim() != 2 or replayed.storage_offset() != 0:
        return None
    (k, n), (out_f, in_f) = replayed.shape, weight.shape
    if tuple(d if isinstance(d, int) else None for d in val(operand).shape[-2:]) != (k, n):
        return None  # an expand over more than the batch (a column repeated): not one linear
    strides = _steps(replayed.shape, replayed.stride())
    if (k, n) == (in_f, out_f) and strides == _steps((k, n), (1, in_f)):  # W.t()
        return node, "in_out_left" if left else "out_in", cast
    if (k, n) == (out_f, in_f) and strides == _steps((k, n), (in_f, 1)):  # W
        return node, "out_in_left" if left else "in_out", cast
    return None


def _conversion(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype ``node`` converts its input to, if it is exactly that (autocast's ``_to_copy``)."""
    if (node.op == "call_function" and node.target is aten._to_copy.default and len(node.args) == 1
            and set(node.kwargs) == {"dtype"}):
        return node.kwargs["dtype"]
    return None


def _weight_like(node: torch.fx.Node, params: set[torch.fx.Node]) -> bool:
    """A parameter, weight_norm's or spectral_norm's weight of one, or autocast's dtype conversion of any:
    what match.py reads a linear's weight through (a conversion, the norm)."""
    node = node.args[0] if _conversion(node) is not None else node
    return node in params or normed_source(node) is not None or spectral_source(node) is not None


def _steps(shape, strides) -> tuple:
    """The strides that step (a size-1 dim's stride is no layout: W.t() and W.view(in, 1) are one tensor)."""
    return tuple(s if d > 1 else None for d, s in zip(shape, strides))


def _pointwise_conv(node: torch.fx.Node, params: set[torch.fx.Node]) -> bool:
    """``convolution(x[B, in, L], W[out, in, 1], b)`` or ``(x[B, in, H, W], W[out, in, 1, 1], b)`` with
    stride 1, no padding, no dilation, one group."""
    x, w, _, stride, padding, dilation, transposed, _, groups = node.args
    vx, vw = val(x), val(w)
    if not _weight_like(w, params) or vx is None or vw is None or vx.dim() not in (3, 4) or vw.dim() != vx.dim():
        return False
    spatial = vx.dim() - 2
    return (list(vw.shape[2:]) == [1] * spatial and list(stride) == [1] * spatial and list(padding) == [0] * spatial
            and list(dilation) == [1] * spatial and not transposed and groups == 1)


def _cancel_double_transpose(graph: torch.fx.Graph, node: torch.fx.Node, params: set[torch.fx.Node]) -> None:
    """``mm(h, t(t(W)))``: ``F.linear(h, W.t())``, a tied decoder reading its encoder's W as stored. Under
    autocast ``mm(h, t(_to_copy(t(W))))`` (the transposed view converted): ``mm(h, _to_copy(W))``, the
    conversion moved onto W, elementwise, so the same values in the same [out, in] layout."""
    mat2 = node.args[-1]
    if not (isinstance(mat2, torch.fx.Node) and mat2.target is aten.t.default):
        return
    inner, cast = mat2.args[0], None
    if isinstance(inner, torch.fx.Node) and len(inner.users) == 1 and converted_source(inner) is not None:
        inner, cast = converted_source(inner), inner
    if not (isinstance(inner, torch.fx.Node) and inner.target is aten.t.default and inner.args[0] in params):
        return
    weight = inner.args[0]
    if cast is not None:
        with graph.inserting_before(node):
            weight = graph.call_function(aten._to_copy.default, (weight,), dict(cast.kwargs))
        weight.meta = dict(mat2.meta)  # (W's shape and contiguous strides, the conversion's dtype)
    node.replace_input_with(mat2, weight)
    _erase_dead(graph, mat2)


def converted_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``node`` converts to another dtype, if it is exactly that (autocast's ``_to_copy``)."""
    if node.op == "call_function" and node.target is aten._to_copy.default and len(node.args) == 1 \
            and set(node.kwargs) <= {"dtype"}:
        return node.args[0]
    return None


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, form: str, inputs: list[torch.fx.Node],
             cast: torch.dtype | None = None) -> None:
    """``node`` replaced by the aten trace of ``_LINEAR[form]`` on ``inputs`` (the weight, second, converted
    to ``cast`` first if given), copied in before it."""
    linear = _LINEAR[form]
    fn = linear if cast is None else lambda x, w, *rest: linear(x, w.to(cast), *rest)
    sub = private.trace_aten(fn, [val(i) for i in inputs])
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    sizes = _sizes_before(gm.graph, node)
    copied = dict(zip(placeholders, inputs, strict=True))
    with gm.graph.inserting_before(node):
        out = gm.graph.graph_copy(sub.graph, copied)
    # The trace reads sizes off its own inputs (a sym_size of a layer's output, which a cut layout
    # would gather first): each is read from the graph's own node for that size where it has one.
    for new in [copied[n] for n in sub.graph.nodes if n.target is aten.sym_size.int]:
        same = sizes.get(_symbol(new))
        if same is not None:
            new.replace_all_uses_with(same)
            gm.graph.erase_node(new)
    old_args = list(node.all_input_nodes)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    for arg in old_args:
        _erase_dead(gm.graph, arg)


def _symbol(node: torch.fx.Node):
    v = node.meta.get("val")
    return v.node.expr if isinstance(v, torch.SymInt) else None


def _sizes_before(graph: torch.fx.Graph, node: torch.fx.Node) -> dict:
    """The graph's nodes before ``node`` that hold a symbolic size, by its expression (the first of each)."""
    found: dict = {}
    for n in graph.nodes:
        if n is node:
            return found
        if _symbol(n) is not None:
            found.setdefault(_symbol(n), n)
    return found


def _erase_dead(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``node`` and the views before it, once nothing reads them."""
    while node.op == "call_function" and not node.users and node.target in _DEAD:
        source = node.args[0]
        graph.erase_node(node)
        if not isinstance(source, torch.fx.Node):
            return
        node = source


def squeezed_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``[out, in, 1]`` (``[out, in, 1, 1]``) weight that ``node`` squeezes to ``[out, in]`` (a
    pointwise Conv1d's (Conv2d's), above)."""
    if node.op != "call_function" or node.target not in (aten.squeeze.dim, aten.squeeze.dims):
        return None
    source = val(node.args[0])
    if source is None or source.dim() not in (3, 4) or list(source.shape[2:]) != [1] * (source.dim() - 2):
        return None
    dims = [node.args[1]] if node.target is aten.squeeze.dim else list(node.args[1])
    return node.args[0] if sorted(int(d) % source.dim() for d in dims) == list(range(2, source.dim())) else None
