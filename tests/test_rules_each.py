"""Each propagation rule on its own: one line per (op, operand layouts) -> the rule's decision.

DTensor's ``dimmap_test(op, args, expected)`` for dynashard (tests/rules_harness.py): every case
traces one op on fake tensors (no process group, no spawn), gives its operands a layout (``t(...,
cut=d)`` cut on dim d, ``partial=True`` partial sums, else replicated) and states what the rule
decides: the output's layout (``S(dim, *parts, unit=)``), how it reads each operand (L local, N
narrowed, G gathered, Q narrowed to K/V groups), partial sums, a lowering, the wishes it leaves, or
``gather()`` where it declines (the driver gathers: always correct, never free). World 2 unless said.

Where the record is something this rank can run by itself (no lowering, plain reads), the case is
also run on real tensors for every rank (``check_numerics``): the op on the operands as read equals
this rank's part of the op on whole tensors, or, for partial sums, the ranks' terms add up to it.
"""

from __future__ import annotations

import operator
import pkgutil

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import dynashard.plan.rules
from dynashard.options import Style
from dynashard.plan.rules.registry import RULES, TAG_RULES
from tests.rules_harness import (
    S,
    check_numerics,
    gather,
    k,
    keep,
    linear_of,
    outs,
    registered_ops,
    rule_of,
    summed,
    supports_numerics,
    t,
    whole,
)

# (make_fx traces flex_attention eagerly, which warns that it is not compiled: only its graph is used here)
pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]
aten = torch.ops.aten
MAX = 9223372036854775807  # what ``x[a:]`` traces to as slice's end
q4 = t(1, 4, 8, 16, cut=1)  # [B, H, T, Dh] cut by heads: 2 of 4 on each of 2 ranks


def case(name, op, args, expect, target=None, world=2, marks=(), **options):
    """One row: ``op(*args)``; ``options``: op keywords, or the layout map's modes (per_rank, ...)."""
    return pytest.param(op, tuple(args), expect, target, world, options, id=name, marks=marks)


def _traced_as(op, *args):
    """The op make_fx records for ``op(*args)`` on this torch."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return next(n.target for n in make_fx(op)(*args).graph.nodes if n.op == "call_function")


# (torch 2.14 records aten.detach as aten.alias: no graph it traces holds a detach, and the alias row covers it)
_DETACH_UNTRACED = pytest.mark.skipif(_traced_as(aten.detach.default, torch.ones(2)) is not aten.detach.default,
                                      reason="this torch traces aten.detach as aten.alias (the alias row covers it)")


def _split_then_take(x):
    return aten.split.Tensor(x, 4, 0)[1]


def _cross_entropy(x, target):
    return aten.nll_loss_forward.default(aten._log_softmax.default(x, 1, False), target, None, 1, -100)


def _flex_by_heads(q, k_, v):
    return flex_attention(q, k_, v, score_mod=lambda s, b, h, qi, ki: s + h)  # reads the head index


def _cat_then_neg(tensors, dim):
    return aten.neg.default(aten.cat.default(tensors, dim))


def _add_zeros(p):
    return aten.add.Tensor(p, aten.zeros.default([4, 8]))


CASES = [
    # pointwise: a Shard passes through; replicated operands broadcast (size 1, or not reaching the cut) or are narrowed
    case("gelu", aten.gelu.default, [t(4, 8, cut=-1)], keep(S(-1, 8))),
    case("add-row-narrowed", aten.add.Tensor, [t(4, 8, cut=-1), t(8)], keep(S(-1, 8), reads="LN")),
    case("add-column-broadcast", aten.add.Tensor, [t(4, 8, cut=-1), t(4, 1)], keep(S(-1, 8))),
    case("mul-alike", aten.mul.Tensor, [t(4, 8, cut=-1), t(4, 8, cut=-1)], keep(S(-1, 8))),
    case("add-leading-broadcast", aten.add.Tensor, [t(4, 8, cut=0), t(2, 4, 8)], keep(S(-2, 4), reads="LN")),
    case("add-alike-finer-units", aten.add.Tensor, [t(4, 8, cut=-1, unit=4), t(4, 8, cut=-1, unit=2)],
         keep(S(-1, 4, unit=2))),
    case("add-cut-on-other-dims", aten.add.Tensor, [t(4, 8, cut=-1), t(4, 8, cut=0)], gather()),
    case("add-cut-unlike", aten.add.Tensor, [t(4, 12, cut=-1, unit=2), t(4, 12, cut=-1, unit=4)], gather("coarsen")),
    case("where-cond-narrowed", aten.where.self, [t(4, 8, dtype=torch.bool), t(4, 8, cut=-1), t(4, 8, cut=-1)],
         keep(S(-1, 8), reads="NLL")),
    case("mul_-into-cut", aten.mul_.Tensor, [t(4, 8, cut=-1), t(8)], keep(S(-1, 8), reads="LN")),
    # in-place twins torch does not tag pointwise (registry.lookup: their twin's rule): ``t[mask] = v`` on torch 2.15
    case("masked_fill_-into-cut", aten.masked_fill_.Scalar, [t(4, 8, cut=-1), t(4, 8, dtype=torch.bool), 0.5],
         keep(S(-1, 8), reads="LN")),
    case("masked_fill-tensor-value", aten.masked_fill.Tensor, [t(4, 8, cut=-1), t(8, dtype=torch.bool), t()],
         keep(S(-1, 8), reads="LNL")),
    case("gelu_-into-cut", aten.gelu_.default, [t(4, 8, cut=-1)], keep(S(-1, 8))),
    case("masked_fill_-tensor-value", aten.masked_fill_.Tensor, [t(4, 8, cut=-1), t(8, dtype=torch.bool), t()],
         keep(S(-1, 8), reads="LNL")),
    case("add_-into-replicated-input", aten.add_.Tensor, [t(4, 8), t(4, 8, cut=-1)], gather("state")),
    case("clone", aten.clone.default, [t(4, 8, cut=-1)], keep(S(-1, 8))),
    case("to-float64", aten._to_copy.default, [t(4, 8, cut=-1)], keep(S(-1, 8)), dtype=torch.float64),
    case("alias", aten.alias.default, [t(4, 8, cut=-1)], keep(S(-1, 8))),
    case("detach", aten.detach.default, [t(4, 8, cut=-1)], keep(S(-1, 8)), marks=_DETACH_UNTRACED),
    case("per-rank-add-uniform-row", aten.add.Tensor, [t(4, 8, cut=-1), t(8, uniform=True)],
         keep(S(-1, 8), reads="LN"), per_rank=True),
    case("per-rank-add-rows", aten.add.Tensor, [t(4, 8, cut=-1), t(4, 8)], gather(), per_rank=True),
    case("dropout", aten.native_dropout.default, [t(4, 8, cut=-1), 0.5, True],
         outs(S(-1, 8), S(-1, 8), lowering="DropoutOfCut")),
    # views: the cut follows each dim map; a reshape regroups it in whole units or wishes for coarser ones
    case("transpose-moves-cut", aten.transpose.int, [t(2, 4, 8, cut=-1), 1, 2], keep(S(-2, 8))),
    case("transpose-other-dims", aten.transpose.int, [t(2, 4, 8, cut=-1), 0, 1], keep(S(-1, 8))),
    case("permute", aten.permute.default, [t(2, 4, 8, cut=1), [2, 0, 1]], keep(S(-1, 4))),
    case("unsqueeze-front", aten.unsqueeze.default, [t(4, 8, cut=-1), 0], keep(S(-1, 8))),
    case("unsqueeze-back", aten.unsqueeze.default, [t(4, 8, cut=-1), -1], keep(S(-2, 8))),
    case("squeeze", aten.squeeze.dim, [t(4, 1, 8, cut=-1), 1], keep(S(-1, 8))),
    case("select-other-dim", aten.select.int, [t(4, 8, cut=-1), 0, 1], keep(S(-1, 8))),
    case("select-cut-dim", aten.select.int, [t(4, 8, cut=-1), 1, 3], gather()),
    case("expand-new-dims", aten.expand.default, [t(4, 8, cut=0), [3, 4, 8]], keep(S(-2, 4))),
    case("expand-broadcast-dim", aten.expand.default, [t(1, 8, cut=-1), [4, 8]], keep(S(-1, 8))),
    case("view-as-complex", aten.view_as_complex.default, [t(4, 8, 2, cut=1)], keep(S(-1, 8))),
    case("view-as-complex-pair-cut", aten.view_as_complex.default, [t(4, 8, 2, cut=2)], gather()),
    case("view-as-real", aten.view_as_real.default, [t(4, 8, cut=-1, dtype=torch.complex64)], keep(S(-2, 8))),
    case("view-merge-leading", aten.view.default, [t(2, 4, 8, cut=-1), [8, 8]], keep(S(-1, 8))),
    case("view-split-heads", aten.view.default, [t(4, 8, cut=-1, unit=4), [4, 2, 4]], keep(S(-2, 2))),
    case("view-split-heads-units-too-fine", aten.view.default, [t(4, 8, cut=-1), [4, 2, 4]], gather("coarsen")),
    case("view-merge-heads", aten.view.default, [t(4, 2, 4, cut=1), [4, 8]], keep(S(-1, 2, unit=4))),
    case("view-batch-into-cut", aten.view.default, [t(2, 4, 8, cut=1), [8, 8]], keep(S(-2, 4))),
    case("view-cut-outer-merged", aten.view.default, [t(2, 4, 8, cut=0), [8, 8]], keep(S(-2, 2, unit=4))),
    case("unsafe-view", aten._unsafe_view.default, [t(2, 4, 8, cut=-1), [8, 8]], keep(S(-1, 8))),
    case("reshape", aten.reshape.default, [t(4, 8, cut=-1, unit=4), [4, 2, 4]], keep(S(-2, 2)),
         traced_as=aten.view.default),
    case("per-rank-view-keeps-last-dim", aten.view.default, [t(4, 8, cut=-1), [2, 2, 8]], keep(S(-1, 8)),
         per_rank=True),
    case("per-rank-view-changes-last-dim", aten.view.default, [t(4, 8, cut=-1, unit=4), [4, 2, 4]], gather(),
         per_rank=True),
    # shapes: taking apart and putting together
    case("getitem-of-split", _split_then_take, [t(8, 8, cut=-1)], keep(S(-1, 8), reads="-"),
         target=operator.getitem),
    case("split-other-dim", aten.split.Tensor, [t(8, 8, cut=-1), 4, 0], outs(S(-1, 8), S(-1, 8))),
    case("split-fused-components", aten.split.Tensor, [t(4, 12, cut=-1, parts=(4, 4, 4)), 4, -1],
         outs(S(-1, 4), S(-1, 4), S(-1, 4), lowering="TakeParts")),
    case("split-inside-component", aten.split.Tensor, [t(4, 12, cut=-1), 4, -1], gather("cut")),
    case("split-with-sizes-fused", aten.split_with_sizes.default, [t(4, 16, cut=-1, parts=(8, 4, 4)), [8, 4, 4], -1],
         outs(S(-1, 8), S(-1, 4), S(-1, 4), lowering="TakeParts")),
    case("unbind-before-cut", aten.unbind.int, [t(3, 4, 8, cut=-1), 0], outs(S(-1, 8), S(-1, 8), S(-1, 8))),
    case("unbind-after-cut", aten.unbind.int, [t(4, 3, 8, cut=0), 1], outs(S(-2, 4), S(-2, 4), S(-2, 4))),
    case("unbind-cut-dim", aten.unbind.int, [t(4, 3, 8, cut=1), 1], gather()),
    case("repeat-other-dim", aten.repeat.default, [t(4, 8, cut=-1), [2, 1]], keep(S(-1, 8))),
    case("repeat-cut-dim-tiles", aten.repeat.default, [t(4, 8, cut=-1), [1, 2]], keep(S(-1, 8, 8))),
    case("slice-other-dim", aten.slice.Tensor, [t(8, 8, cut=-1), 0, 2, 6], keep(S(-1, 8))),
    case("slice-fused-component", aten.slice.Tensor, [t(4, 12, cut=-1, parts=(4, 4, 4)), -1, 4, 8],
         keep(S(-1, 4), lowering="TakeParts")),
    case("slice-inside-component", aten.slice.Tensor, [t(4, 12, cut=-1), -1, 4, 8], gather("cut")),
    case("slice-every-2nd", aten.slice.Tensor, [t(4, 8, cut=-1, unit=2), -1, 0, MAX, 2], keep(S(-1, 4))),
    case("slice-every-2nd-units-too-fine", aten.slice.Tensor, [t(4, 8, cut=-1), -1, 1, MAX, 2], gather("coarsen")),
    case("index-other-dim", aten.index.Tensor, [t(4, 8, cut=-1), [k(1, 2, 2), None]], keep(S(-1, 8))),
    case("index-fused-component", aten.index.Tensor, [t(4, 12, cut=-1, parts=(4, 4, 4)), [None, k(8, 9, 10, 11)]],
         keep(S(-1, 4), lowering="TakeParts")),
    case("index-cut-dim-scattered", aten.index.Tensor, [t(4, 8, cut=-1), [None, k(0, 5)]], gather()),
    case("cat-other-dim", aten.cat.default, [[t(2, 8, cut=-1), t(3, 8, cut=-1)], 0], keep(S(-1, 8))),
    case("cat-narrows-replicated", _cat_then_neg, [[t(2, 8, cut=-1), t(3, 8)], 0], keep(S(-1, 8), reads="LN"),
         target=aten.cat.default),
    # (a returned cat of a shard and a replicated input is a cache grown by cat, HF's DynamicCache: held cut)
    case("cat-grows-returned-input", aten.cat.default, [[t(3, 8), t(2, 8, cut=-1)], 0],
         keep(S(-1, 8), reads="NL", wishes=("state",))),
    case("cat-along-cut", aten.cat.default, [[t(4, 4, cut=-1), t(4, 4, cut=-1)], -1],
         keep(S(-1, 4, 4, deals=((2, 2), (2, 2))))),
    case("cat-along-cut-with-replicated", aten.cat.default, [[t(4, 4, cut=-1), t(4, 4)], -1], gather()),
    case("cat-skips-empty", aten.cat.default, [[t(0), t(4, 8, cut=-1)], 0], keep(S(-1, 8))),
    case("stack-front", aten.stack.default, [[t(4, 8, cut=-1), t(4, 8, cut=-1)], 0], keep(S(-1, 8))),
    case("stack-back", aten.stack.default, [[t(4, 8, cut=-1), t(4, 8, cut=-1)], -1], keep(S(-2, 8))),
    # reductions: along dims that are not cut each rank reduces its own part; a sum over the cut is partial
    case("softmax-other-dim", aten._softmax.default, [t(4, 8, cut=0), -1, False], keep(S(-2, 4))),
    case("softmax-cut-dim", aten._softmax.default, [t(4, 8, cut=-1), -1, False], gather()),
    case("safe-softmax", aten._safe_softmax.default, [t(4, 8, cut=0), -1], keep(S(-2, 4))),
    case("sum-cut-dim-partial", aten.sum.dim_IntList, [t(4, 8, cut=-1), [-1]], summed()),
    case("sum-cut-and-other-dims", aten.sum.dim_IntList, [t(4, 8, cut=-1), [0, 1]], summed()),
    case("sum-other-dim", aten.sum.dim_IntList, [t(2, 4, 8, cut=1), [0]], keep(S(-2, 4))),
    case("sum-other-dim-keepdim", aten.sum.dim_IntList, [t(2, 4, 8, cut=1), [0], True], keep(S(-2, 4))),
    case("sum-all-dims", aten.sum.dim_IntList, [t(4, 8, cut=-1), []], gather()),
    case("sum-cut-dim-stacked", aten.sum.dim_IntList, [t(4, 8, cut=-1), [-1]], gather(), stacked=True),
    case("mean-cut-dim-partial", aten.mean.dim, [t(4, 8, cut=-1), [-1]], summed(lowering="ShareOfMean")),
    case("mean-cut-dim-rank-without", aten.mean.dim, [t(4, 2, cut=-1), [-1]], gather(), world=3),
    case("mean-other-dim", aten.mean.dim, [t(4, 8, cut=-1), [0], True], keep(S(-1, 8))),
    case("amax-other-dim", aten.amax.default, [t(4, 8, cut=-1), [0]], keep(S(-1, 8))),
    case("amax-cut-dim", aten.amax.default, [t(4, 8, cut=-1), [1]], gather()),
    case("amin-other-dim", aten.amin.default, [t(4, 8, cut=0), [1], True], keep(S(-2, 4))),
    case("var-other-dim", aten.var.correction, [t(4, 8, cut=0), [1]], keep(S(-1, 4))),
    case("var-cut-dim", aten.var.correction, [t(4, 8, cut=0), [0]], gather()),
    case("std-other-dim", aten.std.correction, [t(4, 8, cut=0), [1]], keep(S(-1, 4))),
    case("logsumexp-other-dim", aten.logsumexp.default, [t(4, 8, cut=0), [1]], keep(S(-1, 4))),
    case("max-dim-other", aten.max.dim, [t(4, 8, cut=0), 1], outs(S(-1, 4), S(-1, 4))),
    case("max-dim-cut", aten.max.dim, [t(4, 8, cut=0), 0], gather()),
    case("min-dim-keepdim", aten.min.dim, [t(4, 8, cut=0), 1, True], outs(S(-2, 4), S(-2, 4))),
    case("layer-norm-rows-cut", aten.native_layer_norm.default, [t(2, 4, 8, cut=1), [8], t(8), t(8), 1e-5],
         outs(S(-2, 4), S(-2, 4), S(-2, 4))),
    case("layer-norm-over-cut", aten.native_layer_norm.default, [t(4, 8, cut=-1), [8], t(8), t(8), 1e-5], gather()),
    # loss parallel: cross-entropy on vocab-cut logits, never gathered
    case("log-softmax-other-dim", aten._log_softmax.default, [t(4, 8, cut=0), 1, False], keep(S(-2, 4))),
    case("log-softmax-vocab-then-nll", _cross_entropy, [t(4, 8, cut=-1), t(4, dtype=torch.int64)],
         keep(S(-1, 8), reads="L-", lowering="LogSumExp", collectives=("all_gather",)),
         target=aten._log_softmax.default),
    case("log-softmax-vocab-alone", aten._log_softmax.default, [t(4, 8, cut=-1), 1, False], gather()),
    case("nll-of-loss-parallel", _cross_entropy, [t(4, 8, cut=-1), t(4, dtype=torch.int64)],
         outs(None, None, reads="-L", lowering="VocabNll"), target=aten.nll_loss_forward.default),
    case("nll-of-replicated", _cross_entropy, [t(4, 8), t(4, dtype=torch.int64)], gather(),
         target=aten.nll_loss_forward.default),
    # attention: SDPA kernels and bmm on this rank's heads
    case("sdpa-cpu-by-heads", aten._scaled_dot_product_flash_attention_for_cpu.default, [q4, q4, q4],
         outs(S(-3, 4), S(-2, 4))),
    case("sdpa-cpu-kv-narrowed", aten._scaled_dot_product_flash_attention_for_cpu.default,
         [q4, t(1, 4, 8, 16), t(1, 4, 8, 16)], outs(S(-3, 4), S(-2, 4), reads="LNN")),
    case("sdpa-cpu-gqa-kv-cut", aten._scaled_dot_product_flash_attention_for_cpu.default,
         [q4, t(1, 2, 8, 16, cut=1), t(1, 2, 8, 16, cut=1)], outs(S(-3, 4), S(-2, 4))),
    case("sdpa-cpu-gqa-kv-whole", aten._scaled_dot_product_flash_attention_for_cpu.default,
         [q4, t(1, 2, 8, 16), t(1, 2, 8, 16)], outs(S(-3, 4), S(-2, 4), reads="LQQ")),
    case("sdpa-cpu-cut-on-head-dim", aten._scaled_dot_product_flash_attention_for_cpu.default,
         [q4, t(1, 4, 8, 16, cut=-1), q4], gather("replicate")),
    case("sdpa-cpu-mask-narrowed", aten._scaled_dot_product_flash_attention_for_cpu.default,
         [q4, q4, q4], outs(S(-3, 4), S(-2, 4), reads="LLLN"), attn_mask=t(1, 4, 8, 8)),
    case("sdpa-flash-cuda", aten._scaled_dot_product_flash_attention.default, [q4, q4, q4],
         outs(S(-3, 4), S(-2, 4), None, None, None, None, None, None, None)),
    case("sdpa-efficient-cuda", aten._scaled_dot_product_efficient_attention.default, [q4, q4, q4, None, True],
         outs(S(-3, 4), S(-2, 4), None, None)),
    case("sdpa-cudnn-cuda", aten._scaled_dot_product_cudnn_attention.default, [q4, q4, q4, None, True, False],
         outs(S(-3, 4), S(-3, 4), None, None, None, None, None, None, None)),
    case("bmm-merged-heads", aten.bmm.default, [t(8, 4, 16, cut=0), t(8, 16, 4, cut=0)], keep(S(-3, 8))),
    case("bmm-one-replicated", aten.bmm.default, [t(8, 4, 16, cut=0), t(8, 16, 4)], keep(S(-3, 8), reads="LN")),
    case("bmm-contracted-cut", aten.bmm.default, [t(8, 4, 16, cut=-1), t(8, 16, 4, cut=-2)], gather()),
    case("baddbmm-bias-narrowed", aten.baddbmm.default, [t(8, 1, 4), t(8, 4, 16, cut=0), t(8, 16, 4, cut=0)],
         keep(S(-3, 8), reads="NLL")),
    case("baddbmm-bias-broadcast", aten.baddbmm.default, [t(1, 4, 4), t(8, 4, 16, cut=0), t(8, 16, 4, cut=0)],
         keep(S(-3, 8))),
    case("flex-by-heads", _flex_by_heads, [t(1, 4, 128, 16, cut=1)] * 3,
         outs(S(-3, 4), S(-2, 4), S(-2, 4), lowering="FlexOnHeads"), target=torch.ops.higher_order.flex_attention),
    # in-place writes the layout can follow (a KV cache)
    case("index-put-cache", aten.index_put_.default, [t(1, 4, 16, 8, cut=1), [None, None, k(3, 5)],
                                                      t(1, 4, 2, 8, cut=1)], keep(S(-3, 4))),
    case("index-put-cut-dim", aten.index_put_.default, [t(4, 8, cut=-1), [None, k(3, 5)], t(4, 2)], gather()),
    case("index-put-mask-narrowed", aten.index_put_.default, [t(4, 8, cut=-1), [t(4, 8, dtype=torch.bool)], t()],
         keep(S(-1, 8), reads="LNL")),
    case("index-put-rows-mask", aten.index_put_.default, [t(4, 8, cut=-1), [t(4, dtype=torch.bool)], t(8)],
         keep(S(-1, 8), reads="LLN")),
    case("index-copy-cache", aten.index_copy_.default, [t(1, 4, 16, 8, cut=1), 2, k(3, 5), t(1, 4, 2, 8, cut=1)],
         keep(S(-3, 4))),
    case("index-copy-cut-dim", aten.index_copy_.default, [t(1, 4, 16, 8, cut=1), 1, k(0, 1), t(1, 2, 16, 8)],
         gather()),
    case("copy-alike", aten.copy_.default, [t(4, 8, cut=-1), t(4, 8, cut=-1)], keep(S(-1, 8))),
    case("copy-replicated-narrowed", aten.copy_.default, [t(4, 8, cut=-1), t(4, 8)], keep(S(-1, 8), reads="LN")),
    case("copy-shard-into-input", aten.copy_.default, [t(4, 8), t(4, 8, cut=-1)], gather("state")),
    # partial sums: ops linear in them keep them (rules/partial.py); any other reader reads them all-reduced
    case("partial-times-replicated", aten.mul.Tensor, [t(4, 8, partial=True), t(8)], summed()),
    case("partial-times-partial", aten.mul.Tensor, [t(4, 8, partial=True), t(4, 8, partial=True)],
         gather(reduced=True)),
    case("partial-over-replicated", aten.div.Tensor, [t(4, 8, partial=True), t(8)], summed()),
    case("replicated-over-partial", aten.div.Tensor, [t(8), t(4, 8, partial=True)], gather(reduced=True)),
    case("partial-plus-partial", aten.add.Tensor, [t(4, 8, partial=True), t(4, 8, partial=True)], summed()),
    case("partial-plus-replicated", aten.add.Tensor, [t(4, 8, partial=True), t(4, 8)], gather(reduced=True)),
    case("partial-plus-zeros", _add_zeros, [t(4, 8, partial=True)], summed(), target=aten.add.Tensor),
    case("partial-view", aten.view.default, [t(4, 8, partial=True), [32]], summed()),
    case("partial-sum", aten.sum.dim_IntList, [t(4, 8, partial=True), [0]], summed()),
    case("partial-widened", aten._to_copy.default, [t(4, 8, partial=True)], summed(), dtype=torch.float64),
    case("partial-narrowed-dtype", aten._to_copy.default, [t(4, 8, partial=True)], gather(reduced=True),
         dtype=torch.bfloat16),
    case("partial-add_-bias-once", aten.add_.Tensor, [t(4, 8, partial=True), t(8)], summed(lowering="AddOnce")),
    case("partial-exp", aten.exp.default, [t(4, 8, partial=True)], gather(reduced=True)),
]


# Matched linears (rules/origins.py; found by dynashard.capture.match, not by op): ``F.linear(x, W[, b])`` with
# W [out, in] (``embedding``: ``F.embedding(ids, W)``, W [vocab, dim]); reads of x, W (read through its
# transpose: -) and b. Weight cuts and the emitted matmuls are the rewrite's: goldens and verify check them.
LINEAR_CASES = [
    pytest.param(t(4, 8), 6, Style.COLWISE, {"bias": True}, keep(S(-1, 6), reads="L-N"), id="colwise-bias-narrowed"),
    pytest.param(t(4, 8, cut=-1), 6, Style.COLWISE, {}, keep(S(-1, 6), reads="G-"), id="colwise-cut-input-gathered"),
    pytest.param(t(4, 8, cut=-1), 6, Style.ROWWISE, {},
                 whole(reads="L-", lowering="RowwiseLinear", collectives=("all_reduce",)), id="rowwise-features-cut"),
    pytest.param(t(4, 8), 6, Style.ROWWISE, {},
                 whole(reads="N-", lowering="RowwiseLinear", collectives=("all_reduce",)), id="rowwise-narrows"),
    pytest.param(t(4, 8, cut=0), 6, Style.ROWWISE, {},
                 whole(reads="G-", lowering="RowwiseLinear", collectives=("all_reduce",)), id="rowwise-rows-cut"),
    pytest.param(t(4, 8, cut=-1), 6, Style.ROWWISE, {"sequence": True},
                 keep(S(-2, 4), reads="L-", lowering="RowwiseLinear", collectives=("reduce_scatter",)),
                 id="rowwise-sequence-parallel"),
    pytest.param(t(4, 3, dtype=torch.int64), 6, Style.ROWWISE, {"embedding": True},
                 whole(reads="LL", lowering="VocabParallelLookup", collectives=("all_reduce",)), id="embedding-vocab"),
    pytest.param(t(4, 3, dtype=torch.int64), 6, Style.COLWISE, {"embedding": True}, keep(S(-1, 6), reads="LL"),
                 id="embedding-colwise"),
    # rules/quantized.py: torchao's group-wise int8 (groups of 16 of 64 input columns; operands x, qdata, scale,
    # zero point, read through the dequantization: -). Colwise cuts rows (no group split); rowwise reads an input
    # cut in whole groups as it is, else cuts the weight in whole groups (the input narrowed or gathered to them)
    # and asks the input's origin for units of 16 (a COARSEN wish)
    pytest.param(t(4, 64), 6, Style.COLWISE, {"group": 16}, keep(S(-1, 6), reads="L---"), id="colwise-group-quantized"),
    pytest.param(t(4, 64, cut=-1), 6, Style.ROWWISE, {"group": 16},
                 whole(reads="L---", lowering="RowwiseLinear", collectives=("all_reduce",)),
                 id="rowwise-group-quantized-whole-groups"),
    pytest.param(t(4, 64), 6, Style.ROWWISE, {"group": 16, "world": 3},
                 whole(reads="N---", lowering="RowwiseLinear", collectives=("all_reduce",)),
                 id="rowwise-group-quantized-narrows-to-groups"),
    pytest.param(t(4, 64, cut=-1), 6, Style.ROWWISE, {"group": 16, "world": 3},
                 whole(reads="G---", lowering="RowwiseLinear", collectives=("all_reduce",), wishes=("coarsen",)),
                 id="rowwise-group-quantized-asks-for-groups"),
    # rules/partial.py's whole_linear_of_partial: a whole linear is linear in its input (a LoRA's B)
    pytest.param(t(4, 8, partial=True), 6, Style.REPLICATE, {}, summed(reads="L-"), id="whole-of-partial"),
    pytest.param(t(4, 8, partial=True), 6, Style.REPLICATE, {"bias": True}, whole(reads="L-L", reduced=True),
                 id="whole-of-partial-bias-reduced"),
]

# Registered ops no case here names, and why. Empty: every rule is traced on fake tensors (the CUDA
# attention kernels through their meta kernels), though the CUDA kernels' records are not run
# numerically here (no CPU kernel: supports_numerics says so).
UNTESTED: dict[object, str] = {}


def _named_ops() -> set:
    return {p.values[3] or p.values[0] for p in CASES}


def test_every_registered_rule_is_named_by_a_case():
    """A new rule (or op added to one) without a case here fails, unless listed in UNTESTED with why."""
    named = _named_ops()
    missing = sorted(f"{op} ({rule})" for op, rule in registered_ops().items()
                     if op not in named and op not in UNTESTED)
    assert not missing, f"rules without a case in tests/test_rules_each.py: {missing}"
    stale = [op for op in UNTESTED if op in named or op not in RULES]
    assert not stale, f"UNTESTED lists ops that have a case or no rule: {stale}"
    for tag in TAG_RULES:  # a tag rule: some case's op carries the tag and has no rule of its own
        assert any(tag in getattr(op, "tags", ()) and op not in RULES for op in named), tag


def test_every_rule_module_has_cases():
    modules = {m.name for m in pkgutil.iter_modules(dynashard.plan.rules.__path__)} - {"registry"}
    named = _named_ops()
    covered = {RULES[op].fn.__module__.rsplit(".", 1)[-1] for op in named if op in RULES}
    covered |= {reg.fn.__module__.rsplit(".", 1)[-1] for reg in TAG_RULES.values()}
    covered |= {"origins"} if LINEAR_CASES else set()
    covered |= {"quantized"} if any(p.values[3].get("group") for p in LINEAR_CASES) else set()
    covered |= {"partial"} if any(s.partial for p in CASES for s in _operands(p.values[1])) else set()
    assert modules <= covered, f"rule modules without cases: {sorted(modules - covered)}"


def _operands(args):
    return [a for a in args if hasattr(a, "partial")] + [x for a in args if isinstance(a, list) for x in _operands(a)]


@pytest.mark.parametrize(("x", "out_features", "style", "options", "expect"), LINEAR_CASES)
def test_linear(x, out_features, style, options, expect):
    got = linear_of(x, out_features, style, **options)
    expect.check(got)
    if options.get("group") and style == Style.ROWWISE:  # (the weight's columns: whole groups on every rank)
        split = got.record.weight_split
        assert all(c * split.unit % options["group"] == 0 for cs in split.counts(got.lm.world) for c in cs), split


@pytest.mark.parametrize(("op", "args", "expect", "target", "world", "options"), CASES)
def test_rule(op, args, expect, target, world, options):
    modes = {m: options.pop(m) for m in ("per_rank", "sequence", "stacked") if m in options}
    got = rule_of(op, *args, world=world, target=target, **modes, **options)
    expect.check(got)
    if supports_numerics(got) is None:
        check_numerics(op, *args, world=world, target=target, **options)


def test_every_in_place_twin_of_a_pointwise_op_has_the_pointwise_rule():
    """An in-place op torch leaves untagged while its out-of-place twin is tagged pointwise (``masked_fill_``,
    ``gelu_``, ``lt_``... on this torch) is looked up to the pointwise rule: without it a cut value it writes was
    gathered first (what torch 2.15 made of ``t[mask] = v``). A random one (``rrelu_``) is not."""
    from dynashard.plan.rules import pointwise
    from dynashard.plan.rules.registry import lookup

    untagged, random = [], []
    for name in dir(aten):
        if not name.endswith("_") or name.startswith("_") or not hasattr(aten, name[:-1]):
            continue
        inplace, twin = getattr(aten, name), getattr(aten, name[:-1])
        for overload in set(inplace.overloads()) & set(twin.overloads()):
            op = getattr(inplace, overload)
            if torch.Tag.pointwise in getattr(twin, overload).tags and torch.Tag.pointwise not in op.tags:
                (random if torch.Tag.nondeterministic_seeded in op.tags else untagged).append(op)
    assert aten.masked_fill_.Scalar in untagged and aten.gelu_.default in untagged, untagged  # (the walk works)
    graph = torch.fx.Graph()
    missing = sorted(str(op) for op in untagged
                     if lookup(graph.call_function(op, ()), False) is not pointwise.pointwise)
    assert missing == [], missing
    assert all(lookup(graph.call_function(op, ()), False) is None for op in random), random
