"""Pointwise ops (``torch.Tag.pointwise``) and dtype/copy ops: a Shard passes through.

Before: ``gelu(addmm_up)`` with ``addmm_up`` Shard(ffn). After: ``gelu`` on this rank's columns,
its output Shard(ffn). A Shard is kept when every sharded operand holds the same elements on every
rank and spans the output's whole cut dim; replicated operands broadcast over the cut dim or are
narrowed. In-place ops keep their ``self`` operand's layout (writing into a replicated tensor needs
it whole). Operands cut differently (GQA keys against queries) gather, with a wish for a common cut.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard import _torch as private
from dynashard._torch import aten as private_aten
from dynashard.layout.nodes import all_args, mutates_self, op_name, tensor_args, val
from dynashard.layout.shard import LayoutMap, Read, Record, Shard, finest
from dynashard.plan.rules.inplace import wish_state
from dynashard.plan.rules.registry import rule
from dynashard.rewrite.lowerings import DropoutOfCut

aten = torch.ops.aten
COPIES = (aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default)


# masked_fill with a 0-d tensor value (``x.masked_fill(mask, torch.tensor(v))``), in and out of place: elementwise
# as the Scalar overload, which torch tags pointwise, though it tags neither of these
MASKED_FILL_TENSOR = (aten.masked_fill.Tensor, aten.masked_fill_.Tensor)


@rule(*COPIES, *MASKED_FILL_TENSOR, per_rank=True, tags=(torch.Tag.pointwise,))
def pointwise(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    args = tensor_args(node)
    sharded = [lm.layouts[a] for a in args if lm.layouts.get(a) is not None]
    first = finest(sharded) if sharded else None
    if first is not None and not all(first.alike(s) for s in sharded):
        lm.unify(sharded, op_name(node))
        return None
    out_val = val(node)
    ok = (
        first is not None
        and out_val is not None
        and out_val.dim() >= -first.dim
        # a shard never broadcasts: every sharded operand spans the output's whole cut dim
        and all(private_aten.known_equal(val(a).shape[lm.layouts[a].dim], out_val.shape[lm.layouts[a].dim])
                for a in args if lm.layouts.get(a) is not None)
        and all(lm.can_read_as_shard(a, first, out_val.dim()) for a in args)
    )
    if mutates_self(node) and lm.layouts.get(node.args[0]) is None:
        if first is not None:  # a Shard copied into a replicated graph input (a cache slice): hold it sharded
            wish_state(lm, node, node.args[0], first)
        ok = False  # writing into a replicated tensor needs it whole
    if not ok:
        return None
    out = Shard(first.split, frozenset().union(*(s.origins for s in sharded)), first.dim, lm.world, lm.rank)
    return Record(out, {arg: lm.as_shard(arg, out) if arg in args else Read.LOCAL for arg in all_args(node)})


@rule(aten.native_dropout.default)
def dropout(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """Dropout of a cut value keeps the cut (the residual branch under sequence_parallel, a LoRA's
    dropout before a rowwise base's A, attention probabilities cut by heads). Every rank draws the
    whole mask, as the unsharded model draws it from the same seed (the ranks' random streams stay in
    step, and the masks are the unsharded model's), and keeps its part (lowerings.DropoutOfCut): no
    collective, the cost of drawing the whole mask on every rank."""
    found = lm.input_shard(node)
    if found is None or not private.draws_random(node) or lm.per_rank:
        return None
    src = found[0]
    return lm.keep(node, None, outputs=(src, src), lowering=DropoutOfCut(src))
