"""Ops that work along some dims: softmax, reductions, layer norm (and scans, when added).

Before (q/k RMSNorm over head_dim, heads cut: Qwen3's q_norm)::

    var = mean(pow(q, 2), [-1], True); q = q * rsqrt(var + eps) * w
After: each rank reduces its own heads; the cut (on the head dim) is kept.

A sum or mean over the cut dim itself (an RMSNorm over every head of q: OLMo2, OLMoE, BitNet) is
each rank's term of the whole: a partial sum (rules/partial.py). Its first reader that is not
linear in it (``var + eps``) reads it all-reduced, one ``[tokens, 1]`` all_reduce where a gather
of ``[tokens, hidden]`` would be. Other reductions along the cut dim gather. A scan along one dim
(``aten.cumsum``) belongs in ``_ALONG_ONE_DIM``.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard.layout.nodes import norm_dim
from dynashard.layout.shard import LayoutMap, Record, Shard
from dynashard.plan.rules.registry import rule
from dynashard.rewrite.lowerings import ShareOfMean

aten = torch.ops.aten

_ALONG_ONE_DIM = {  # op -> index of its dim argument; the op works along that dim only
    aten._softmax.default: 1,
    aten._safe_softmax.default: 1,  # SDPA's math path
}  # (aten._log_softmax: rules/loss.py, which also keeps it sharded along the cut vocab dim)
# Reductions over the dims in args[1] (keepdim in args[2] or kwargs): local when the cut dim is
# not reduced (q/k RMSNorm over head_dim: Qwen3's q_norm, Gemma's; variance over the last dim).
_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
               aten.std.correction, aten.logsumexp.default)


@rule(*_ALONG_ONE_DIM)
def along_one_dim(lm: LayoutMap, node: torch.fx.Node, index: int | None = None) -> Record | None:
    """Along a dim that is not cut: each rank works on its own part (``index``: of the dim argument)."""
    found = lm.input_shard(node)
    if found is None:
        return None
    src, ndim, p = found
    index = _ALONG_ONE_DIM[node.target] if index is None else index
    d = norm_dim(node.args[index] if len(node.args) > index else 0, ndim)
    return lm.keep(node, src) if d != p else None


@rule(*_REDUCTIONS)
def reduce(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """A reduction over dims that do not include the cut dim: each rank reduces its own part."""
    found = lm.input_shard(node)
    if found is None:
        return None
    src, ndim, p = found
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None  # every dim reduced
    dims = {norm_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    if p in dims:
        return _partial_sum(lm, node, src)
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    new = p if keepdim else p - sum(1 for d in dims if d < p)
    return lm.keep(node, src.moved(new - (ndim if keepdim else ndim - len(dims))))


@rule(aten.max.dim, aten.min.dim)
def extreme(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """``x.max(dim)`` (values and indices) along a dim that is not cut: each rank's own (a softmax
    written out, as GPT-OSS subtracts the max of its scores and sinks)."""
    found = lm.input_shard(node)
    if found is None:
        return None
    src, ndim, p = found
    d = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), ndim)
    if d == p:
        return None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    new = p if keepdim else p - (d < p)
    out = src.moved(new - (ndim if keepdim else ndim - 1))
    return lm.keep(node, None, outputs=(out, out))


def _partial_sum(lm: LayoutMap, node: torch.fx.Node, src: Shard) -> Record | None:
    """A sum or mean over the cut dim: each rank's (a mean's weighted by its share of the dim) is a
    term of the whole. Not for parts held whole by every rank (they would be counted once per
    rank), nor a rank without elements (its mean is nan)."""
    if node.target not in (aten.sum.dim_IntList, aten.mean.dim) or lm.stacked or src.split.whole:
        return None
    if node.target is aten.sum.dim_IntList:
        return lm.keep(node, None, partial=src.origins)
    if src.split.fewest_units(lm.world) < 1:
        return None
    return lm.keep(node, None, partial=src.origins, lowering=ShareOfMean(src.length / src.size))


@rule(aten.native_layer_norm.default)
def layer_norm(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """LayerNorm over trailing dims that are not cut (Phi / StableLM qk_layernorm)."""
    found = lm.input_shard(node)
    if found is None:
        return None
    src, ndim, p = found
    if p >= ndim - len(node.args[1]) or any(lm.layouts.get(a) is not None for a in node.args[2:4]):
        return None  # the cut dim normalized, or a weight / bias that is itself cut: gather
    # weight and bias span the normalized dims only; out, mean, rstd: the same dims before them
    return lm.keep(node, None, outputs=(src, src, src))
