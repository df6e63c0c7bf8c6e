"""Partial sums: the ops that keep a value a sum of per-rank terms, so one all_reduce serves a block.

A rowwise expert matmul leaves each rank with a term of every token's output (its slice of the
expert's hidden features, contracted). Mixture-of-experts code then weights those rows by the
router, puts them back in token order and sums over top-k -- all linear, so the terms can be
summed once, at the end, on ``[tokens, hidden]`` instead of ``[tokens * top_k, hidden]`` per
expert matmul.

Before: ``down = bmm(W_down[ids], h)`` (h Shard), ``y = mul(down, w)``, ``z = sum(view(y), [1])``,
``out = add(z, residual)``.
After: ``down``, ``y``, ``z`` partial (each rank's term, no collective); ``add`` reads ``z``
all-reduced, since the residual must be added once.

An op keeps a partial when it is linear in it and every other tensor it reads is replicated:
views and copies of it, a product or quotient by a replicated value or a number (reading the
partial once: ``p * p`` is not linear), a selection of rows (``index``, ``select``, ``slice``),
sums over dims, a sum, difference or concatenation of partials only, or of zeros nothing writes
into (``p + 1.0`` would add the number once per rank), and ``p.add_(q)`` into memory nothing else
reads, of partials (Llama4's shared expert's output, added to in place) or of a whole ``q`` added
on rank 0 alone (HF's expert biases, ``out.add_(bias[ids])``: lowerings.AddOnce). Every other reader --
every other in-place op, any op with a Shard operand, the graph's outputs -- reads it all-reduced
(``Record.reduced``). A linear kept whole, without a bias, is linear in its input too: a LoRA's B
on a rowwise base applied to each rank's term of A's output (:func:`whole_linear_of_partial`).

With gradients, every replicated tensor such an op reads (B's weight, a router weight) goes through
Megatron's f in the rewrite: each rank's gradient of it is its own term's, summed in backward.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard.capture.aliases import aliases_input
from dynashard.capture.records import LinearMatch
from dynashard.layout.nodes import mutates_self, tensor_args, val
from dynashard.layout.shard import LayoutMap, Record
from dynashard.rewrite.lowerings import AddOnce

aten = torch.ops.aten

# Linear in their first operand, every other operand a shape, dim or index.
_LINEAR_IN_FIRST = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.unsqueeze.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.expand.default, aten.clone.default, aten.alias.default, aten.slice.Tensor, aten.select.int,
    aten.narrow.default, aten.index.Tensor, aten.sum.dim_IntList, aten.sum.default, aten.neg.default,
    aten.mul.Scalar, aten.div.Scalar,
}
_SCALED = {aten.mul.Tensor: (0, 1), aten.div.Tensor: (0,)}  # linear in one operand if the other is replicated
# linear only when every operand is partial (add_: see _adds_into_own)
_ALL_PARTIAL = {aten.add.Tensor, aten.sub.Tensor, aten.cat.default, aten.add_.Tensor}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


def _is_zeros(lm: LayoutMap, node: torch.fx.Node) -> bool:
    """A tensor of zeros is a partial sum too (every rank's term 0): ``out = zeros_like(x)`` then
    ``out = out + expert(x)`` in a loop over experts stays partial -- unless anything writes into
    its memory (``acc[:, :4] = 1``: the aten graph is not functionalized, so the node that made the
    zeros is no proof they are still zeros)."""
    if node in lm.written:
        return False
    if node.target in _ZEROS:
        return True
    fill = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}.get(node.target)
    return fill is not None and len(node.args) > fill and node.args[fill] == 0


def _widening_copy(node: torch.fx.Node) -> bool:
    """A dtype conversion that loses nothing summing later: to the same or a wider float type."""
    src, out = val(node.args[0]), val(node)
    return (src is not None and out is not None and out.dtype.is_floating_point
            and out.dtype.itemsize >= src.dtype.itemsize)


def stays_partial(lm: LayoutMap, node: object, depth: int = 4) -> bool:
    """``node`` is partial sums, or will be when the walk reaches it: a partial value through ops
    linear in it alone (views, sums; no other tensor operand), which keep it partial whatever
    the plan (a rowwise linear ahead of a routed sum asks, Llama4's shared expert)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node in lm.partial:
        return True
    return (depth > 0 and node.op == "call_function" and node.target in _LINEAR_IN_FIRST
            and tensor_args(node) == [node.args[0]] and stays_partial(lm, node.args[0], depth - 1))


def _adds_into_own(lm: LayoutMap, node: torch.fx.Node) -> bool:
    """``p.add_(q)`` where ``p`` is partial sums in memory nothing else reads (``p`` and each value
    it views, back to the op that made the memory, read once: by the next view, then this add):
    the sum is written where no all-reduced copy of ``p`` is read, so it stays partial (a later
    write into it is refused: inplace.follow_writes)."""
    target = node.args[0]
    if node.target is not aten.add_.Tensor or len(node.args) != 2 or set(node.kwargs) - {"alpha"}:
        return False
    if not isinstance(target, torch.fx.Node) or target not in lm.partial:
        return False
    while len(target.users) == 1 and aliases_input(target):  # (a squeeze of a bmm: HF's batched experts)
        target = target.args[0]
    return len(target.users) == 1 and not aliases_input(target)


def _operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every node argument, repeats kept (``mul(p, p)`` reads ``p`` twice: not linear in it)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def keeps_partial(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """``node``'s record when it reads partial operands and is linear in them (every operand read
    locally, the output partial with their origins); None otherwise."""
    if node.op != "call_function" or (mutates_self(node) and not _adds_into_own(lm, node)):
        return None
    args = tensor_args(node)
    reads = [a for a in _operands(node) if a in lm.partial]  # with repeats
    others = [a for a in args if a not in lm.partial]
    if not reads or any(lm.layouts.get(a) is not None for a in args):
        return None
    lowering = None
    if node.target in _LINEAR_IN_FIRST or (node.target is aten._to_copy.default and _widening_copy(node)):
        ok = reads == [node.args[0]]
    elif node.target in _SCALED:  # by a replicated tensor or a number: p * w, p / w, p * 2.0
        ok = len(reads) == 1 and any(node.args[i] is reads[0] for i in _SCALED[node.target])
    elif node.target in _ALL_PARTIAL:
        # partials and zeros only; p + 1.0 adds the number once per rank (a number is never partial)
        operands = node.args[0] if node.target is aten.cat.default else node.args[:2]
        ok = (all(isinstance(a, torch.fx.Node) for a in operands)
              and all(_is_zeros(lm, a) for a in others))
        if not ok and node.target is aten.add_.Tensor and reads == [node.args[0]] and others == [node.args[1]]:
            # p.add_(b), b whole (HF's expert biases: GPT-OSS): b added on one rank only. (Out of place,
            # ``x + p`` reads p reduced as before: a residual is added after the one all_reduce.)
            ok, lowering = True, AddOnce(at=1)
    else:
        ok = False
    if not ok:
        return None
    return lm.keep(node, None, partial=frozenset().union(*(lm.partial[a] for a in reads)), lowering=lowering)


def whole_linear_of_partial(lm: LayoutMap, match: LinearMatch) -> Record | None:
    """The record of a whole linear (style replicate) reading partial sums: ``p @ W'`` is each
    rank's term of the output, which stays partial (a LoRA's B on a rowwise base: its sum joins
    the base's one all_reduce). Not with a bias (added once per rank) or a weight read otherwise
    than by the matmul; None (the input all-reduced first) then."""
    node = match.node
    if match.bias is not None or match.kind.weight_dims or node.target is not aten.mm.default \
            or node.args[0] is not match.input or match.input not in lm.partial:
        return None
    if any(lm.layouts.get(a) is not None or (a is not match.input and a in lm.partial) for a in tensor_args(node)):
        return None
    return lm.keep(node, None, partial=lm.partial[match.input])
