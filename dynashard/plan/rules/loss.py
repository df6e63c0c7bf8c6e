"""Loss parallel: cross-entropy on vocab-sharded logits, without gathering them.

Before (``F.cross_entropy`` on a colwise LM head's output, cut on the vocab dim)::

    lsm = aten._log_softmax(logits, 1, False)      # [tokens, vocab]: gathered first
    loss, total = aten.nll_loss_forward(lsm, target, None, 1, -100)
After: each rank keeps its vocabulary slice. It takes, per token, the log-sum-exp of its logits
and its logit of the target (zero where the target is another rank's), and one all_gather of
``[tokens, 2 x world]`` gives every rank all of them: the loss is replicated, no
``[tokens, vocab]`` tensor is gathered, and the backward is local (the all_gather's backward
keeps this rank's columns). Megatron's vocab-parallel cross-entropy does the same with three
all_reduces (max, sum of exps, target logit); one gather of both numbers does it in one.

Applies when every reader of the ``_log_softmax`` along the cut dim is an ``nll_loss_forward``
without class weights (what ``F.cross_entropy`` traces to; label smoothing adds a sum over the
vocabulary, which gathers, as without this rule), on ``[tokens, vocab]`` logits of which every rank holds
some. The lowerings are :class:`~dynashard.rewrite.lowerings.LogSumExp` and
:class:`~dynashard.rewrite.lowerings.VocabNll`.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard.layout.nodes import all_args, norm_dim, size_at
from dynashard.layout.shard import Collective, CollectiveKind, LayoutMap, Record
from dynashard.plan.rules.reductions import along_one_dim
from dynashard.plan.rules.registry import rule
from dynashard.rewrite.lowerings import LogSumExp, VocabNll

aten = torch.ops.aten


@rule(aten._log_softmax.default)
def log_softmax(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """Along a dim that is not cut, each rank's own; along the cut vocab dim, loss parallel."""
    along = along_one_dim(lm, node, index=1)
    if along is not None:
        return along
    found = lm.input_shard(node)
    if found is None or lm.stacked:
        return None
    src, ndim, p = found
    if ndim != 2 or norm_dim(node.args[1], ndim) != p or p != 1 or size_at(node.args[0], -1) != src.size:
        return None  # [tokens, vocab] along the vocab only (a merged or batched dim: gather)
    if src.split.fewest_units(lm.world) < 1 or not node.users or not all(_plain_nll(u, node) for u in node.users):
        return None
    gather = Collective(CollectiveKind.ALL_GATHER, node, src.origins, "loss parallel", loss_parallel=True)
    return lm.keep(node, src, lowering=LogSumExp(), collectives=[gather])


@rule(aten.nll_loss_forward.default)
def nll_loss(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    """The negative log-likelihood of loss-parallel log-probabilities: replicated outputs."""
    record = lm.records.get(node.args[0])
    if record is None or not isinstance(record.lowering, LogSumExp):
        return None
    # the loss and the total weight, the same on every rank
    return lm.keep(node, None, outputs=(None, None), lowering=VocabNll(record.layout))


def _plain_nll(user: torch.fx.Node, lsm: torch.fx.Node) -> bool:
    """``nll_loss_forward(lsm, target, weight=None, ...)``: ``lsm`` as the input, no class weights."""
    if user.target is not aten.nll_loss_forward.default or user.args[0] is not lsm:
        return False
    weight = user.args[2] if len(user.args) > 2 else user.kwargs.get("weight")
    return weight is None and lsm not in all_args(user)[1:]
