"""Lowerings: the nodes the rewrite emits other than as their own op on converted operands.

A rule that needs one puts it in its node's :class:`~dynashard.layout.shard.Record`; the rewrite calls
``record.lowering.emit(sharder, node)`` and never asks what kind of node it has. Each lowering
reads operands through the sharder (``sharder.read``, which applies the edge's conversion) and
communicates through ``sharder.comm`` (the real collectives, or ``explain(verify=True)``'s
simulated ones, with or without Megatron's backward), using only the members listed in
``Sharder.FOR_LOWERINGS`` (interpreter.py). A lowering finishes inside its record: what it needs
is in its record or in its node's operands, and what it returns is its node's value, which is all a
later lowering sees of it (loss parallel: ``LogSumExp`` returns a :class:`LocalLogSumExp` that
``VocabNll`` reads as its operand).

Before (a rowwise linear, ``RowwiseLinear``)::

    down = aten.addmm(b_down, g, t_1)
After::

    mm = aten.mm(g_local, t_1_shard); ar = all_reduce(mm); down = aten.add(ar, b_down)

Every emitted op is checked against its source node's arguments (``argument_check.py``): a lowering
that drops one (``padding_idx``) fails at compile time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from dynashard.capture.records import LinearMatch
from dynashard.errors import InternalError
from dynashard.layout.shard import Lowering, Read, Shard
from dynashard.rewrite import vocab
from dynashard.rewrite.local_conversions import take

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class AllocateLocal(Lowering):
    """A cache (or a tensor filled by slices) the graph allocates (``zeros``/``empty``/``full``/
    ``new_empty``...), at this rank's size: the size argument at ``at``."""

    shard: Shard
    at: int = 0

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        args, kwargs = sharder.args(node)
        size = list(args[self.at])
        size[len(size) + self.shard.dim] = self.shard.length
        return node.target(*args[: self.at], size, *args[self.at + 1 :], **kwargs)


@dataclasses.dataclass(frozen=True)
class AddOnce(Lowering):
    """``p + b`` (or ``p.add_(b)``) on partial sums ``p``, ``b`` whole on every rank: rank 0 adds
    ``b``, the others add zeros, so the all-reduced sum holds ``b`` once (rules/partial.py)."""

    at: int  # the argument that is ``b``

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        args, kwargs = sharder.args(node)
        if sharder.lm.rank != 0:
            args = (*args[: self.at], torch.zeros_like(args[self.at]), *args[self.at + 1 :])
        return node.target(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class TakeParts(Lowering):
    """A split or slice of the cut dim (an index of consecutive positions: a slice): this rank's
    parts, ``sizes`` long (a slice: ``(start, length)``)."""

    sizes: tuple[int, ...]
    dim: int

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        args, _ = sharder.args(node)
        if node.target in (aten.slice.Tensor, aten.index.Tensor):
            return aten.narrow(args[0], self.dim, *self.sizes)
        return aten.split_with_sizes(args[0], list(self.sizes), self.dim)


@dataclasses.dataclass(frozen=True)
class LocalLogSumExp:
    """Loss parallel: a log_softmax's value on this rank, ``[tokens, vocab]`` log-probabilities as the
    pieces they are made of here: this rank's slice of the logits and their log-sum-exp per token
    (``[tokens, 1]``), both in float32 for half types, as the kernel accumulates. Not a tensor: a
    reader other than the nll_loss its rule planned fails at compile time."""

    logits: Any
    lse: Any


@dataclasses.dataclass(frozen=True)
class LogSumExp(Lowering):
    """Loss parallel (rules/loss.py): a log_softmax along the cut vocab dim is only read by
    nll_loss, which needs this rank's logits and their log-sum-exp per token, not the
    log-probabilities: its value is a :class:`LocalLogSumExp` of them."""

    def emit(self, sharder: Any, node: torch.fx.Node) -> LocalLogSumExp:
        x = sharder.held(node.args[0])
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # in fp32, as the kernel accumulates
        return LocalLogSumExp(x, torch.logsumexp(x, -1, keepdim=True))


@dataclasses.dataclass(frozen=True)
class VocabNll(Lowering):
    """``nll_loss_forward`` of vocab-sharded log-probabilities ``shard``: every rank's per-token
    (log-sum-exp, target logit) in one all_gather, then the log-probability of each target, and
    torch's own nll_loss on it (so reduction, ignore_index and out-of-range targets behave as
    unsharded). With gradients, the gather's backward keeps this rank's columns: the backward of
    the logits is local."""

    shard: Shard

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        lsm, target = node.args[0], sharder.read(node, node.args[1], None)
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        pieces = sharder.read(node, lsm, None)  # its log_softmax's value: LogSumExp's
        if not isinstance(pieces, LocalLogSumExp):
            raise InternalError(f"dynashard: internal error: loss-parallel {node.name} reads {lsm.name}, whose value "
                                f"on this rank is {type(pieces).__name__}, not its LogSumExp lowering's")
        x, lse = pieces.logits, pieces.lse
        shard, world = self.shard, self.shard.world
        index, inside, offset = torch.zeros_like(target), torch.zeros_like(target, dtype=torch.bool), 0
        for start, length in shard.pieces:  # the target's column among this rank's, if it holds it
            hit = (target >= start) & (target < start + length)
            index, inside, offset = torch.where(hit, target - start + offset, index), inside | hit, offset + length
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        picked = torch.where(inside, x.gather(-1, index.unsqueeze(-1)).squeeze(-1), zero)
        mine = torch.stack([lse.squeeze(-1), picked], -1)  # [tokens, 2]
        everyone = sharder.gather_last_dim(mine, [[2] * world]).unflatten(-1, (world, 2))
        logp = everyone[..., 1].sum(-1) - torch.logsumexp(everyone[..., 0], -1)  # of each target
        # torch's nll_loss over two columns, the target's log-probability in column ``col``: the
        # ignored targets stay ignored, an out-of-range target stays out of range (torch raises).
        col = 1 if ignore == 0 else 0
        inside_vocab = (target >= 0) & (target < shard.size)
        target2 = torch.where(target == ignore, target, torch.where(inside_vocab, col, target))
        zero = torch.zeros_like(logp)
        probs = torch.stack([logp, zero] if col == 0 else [zero, logp], -1).to(lsm.meta["val"].dtype)
        return aten.nll_loss_forward(probs, target2, None, reduction, ignore)


@dataclasses.dataclass(frozen=True)
class ShareOfMean(Lowering):
    """A mean over the cut dim as a partial sum: this rank's mean of its part, weighted by its
    share of the dim (``length / size``); the ranks' terms add up to the mean."""

    share: float

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        return aten.mul(sharder.run_op(node), self.share)


@dataclasses.dataclass(frozen=True)
class StackedTranspose(Lowering):
    """weights="per_rank": a stacked weight's own transpose stands for the weight (the bmm
    transposes it)."""

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        return sharder.held(node.args[0])


class NormOfSlices(Lowering):
    """weight_norm on this rank's slices of v and g (match_normed.py): the op itself, but on a rank that
    holds none of them the empty ``v * g``: torch's kernel (2.13, CPU) kills the process with a
    floating-point exception on an empty v."""

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        args, kwargs = sharder.args(node)
        v, g = args[:2]
        return (v * g, g) if v.numel() == 0 else node.target(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class NormAcrossCut(Lowering):
    """weight_norm with v cut across its norms (match_normed.py): ``dim=0`` rowwise, ``dim=1`` colwise.
    Each norm sums squares over the cut dim: this rank's partial sums (a component every rank holds
    whole counted on rank 0 only), one all_reduce of the ``[out, 1]`` (``[1, in]``) vector, then
    ``v * (g / norms)`` on this rank's slices, g whole. With gradients the backward sums too
    (``copy_to_shards``, of the norms and of g): a rank's gradient of either holds its own slices' part."""

    cut: Shard
    across: int  # v's dim each norm sums over: the cut one

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        (v, g, *_), _ = sharder.args(node)
        # (in float32 for half types, as torch's kernel accumulates)
        wide = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
        squares = wide * wide
        if self.cut.split.whole and sharder.lm.rank != 0:
            pieces, at = [], 0
            for i, (_, length) in enumerate(self.cut.pieces):
                piece = aten.narrow(squares, self.across, at, length)
                pieces.append(aten.zeros_like(piece) if i in self.cut.split.whole else piece)
                at += length
            squares = torch.cat(pieces, self.across)
        norms = sharder.all_reduce(squares.sum(self.across, keepdim=True))
        if sharder.megatron:
            norms, g = (sharder.comm.copy_to_shards(t, sharder.group_name) for t in (norms, g))
        norms = norms.sqrt().to(v.dtype)
        return v * (g / norms), norms


@dataclasses.dataclass(frozen=True)
class CutMatVec(Lowering):
    """spectral_norm (match_normed.py): ``mv`` of this rank's cut of W (or of its transpose); ``cut``: the
    rank's part of the cut dim. Contracting the cut dim, the vector is narrowed to that part and the
    product is a partial sum; else the product is this rank's block. ``whole``: a power step, run
    under no_grad in the model (W detached here), whose product is made whole (all_reduce or
    all_gather) for the normalisation and the buffer write; else sigma's, read by SigmaOfCut."""

    cut: Shard
    contracted: bool
    whole: bool

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        (matrix, x), _ = sharder.args(node)
        x = _counted_once(x, self.cut, sharder.lm.rank) if self.contracted else x
        if not self.whole:
            return aten.mv(matrix, x)
        y, lm, comm = aten.mv(aten.detach(matrix), x), sharder.lm, sharder.comm
        if self.contracted:
            return comm.all_reduce_sum(y, sharder.group_name)
        return comm.all_gather_last_dim(y, self.cut.split.lengths(lm.world), lm.rank, sharder.group_name,
                                        self.cut.split.whole)


@dataclasses.dataclass(frozen=True)
class SigmaOfCut(Lowering):
    """spectral_norm's ``sigma = vdot(u, W v)``: this rank's term (``block``: its block of u against its
    block of ``W v``, W's rows cut; else u against its partial ``W v``), all-reduced. With gradients the
    backward sums too (``copy_to_shards``): a rank's gradient of sigma holds its own part of ``W / sigma``
    only, and every part of W needs the whole of it."""

    cut: Shard
    block: bool

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        (u, wv), _ = sharder.args(node)
        sigma = sharder.all_reduce(aten.vdot(_counted_once(u, self.cut, sharder.lm.rank) if self.block else u, wv))
        return sharder.comm.copy_to_shards(sigma, sharder.group_name) if sharder.megatron else sigma


def _counted_once(x: Any, cut: Shard, rank: int) -> Any:
    """This rank's pieces of a whole vector ``x``, to be multiplied by its cut of W and the products summed
    over the ranks: a component every rank holds whole (a fused q|k|v's k and v, fewer heads than ranks) is
    zeroed but on rank 0, so the sum counts it once."""
    if not cut.split.whole or rank == 0:
        return take(x, cut)
    pieces = [aten.narrow(x, -1, start, length) for start, length in cut.pieces]
    return torch.cat([aten.zeros_like(p) if i in cut.split.whole else p for i, p in enumerate(pieces)], -1)


@dataclasses.dataclass(frozen=True)
class Renorm(Lowering):
    """``embedding_renorm_`` (``F.embedding`` with ``max_norm``) on this rank's cut (vocab.py):
    a vocab-parallel table's rows are whole (``rows``); a colwise one's norms need every rank's
    part of each looked-up row."""

    match: LinearMatch
    rows: Shard | None

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        ids = sharder.read(self.match.node, self.match.input, None)  # as the lookup reads them
        weight = sharder.held(node.args[0])
        if self.rows is not None:
            return vocab.renorm_rows(node, weight, ids, self.rows)
        return vocab.renorm_rows(node, weight, ids, None, lambda part: sharder.gather_last_dim(
            part, [[1] * sharder.lm.world]))


@dataclasses.dataclass(frozen=True)
class RowwiseLinear(Lowering):
    """This rank's features times its rows of the weight, the partial sums combined (all_reduce;
    reduce_scatter of every rank's rows under ``inputs="per_rank"``), the bias added once after.

    ``reduce=False`` (reduced with other partial sums later: a LoRA's on this base): left partial, a bias added
    by rank 0 alone (``b * 1`` there, ``b * 0`` on the others: with gradients, every rank's ``b`` is read through
    Megatron's f, whose backward all_reduce then runs on every rank and sums rank 0's gradient with zeros)."""

    match: LinearMatch
    in_shard: Shard  # this rank's input features
    reduce: bool = True  # False: left as this rank's partial sums (the bias on rank 0), reduced with others later
    seq: Shard | None = None  # sequence_parallel: the part of the sequence this rank keeps of the sum

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        y = _matmul(sharder, self.match, _rowwise_input(sharder, node, self.match, self.in_shard))
        y = y[1] if sharder.lm.stacked else y
        if self.reduce:
            return _combined(sharder, node, self.match, y, self.seq)
        if self.match.bias is not None:
            once = aten.mul(sharder.read(node, self.match.bias, None), 1.0 if sharder.lm.rank == 0 else 0.0)
            y = aten.add(y, once)
        return y


@dataclasses.dataclass(frozen=True)
class VocabParallelLookup(Lowering):
    """A rowwise embedding: every id looked up in this rank's slice of the vocabulary (zero rows
    for the ids of other ranks, vocab.py), the rows combined as a rowwise linear's."""

    match: LinearMatch
    in_shard: Shard  # this rank's rows of the table
    seq: Shard | None = None  # sequence_parallel: the part of the sequence this rank keeps

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        m, lm = self.match, sharder.lm
        x = _rowwise_input(sharder, node, m, self.in_shard)
        y = vocab.lookup(node, sharder.held(m.weight), x, self.in_shard, sharder.train, lm.world if lm.per_rank else 1)
        return _combined(sharder, node, m, y, self.seq)


def _combined(sharder: Any, node: torch.fx.Node, m: LinearMatch, y: Any, seq: Shard | None = None) -> Any:
    """Every rank's partial sums ``y`` added up, then the bias (once). ``seq``: each rank keeps its
    part of the sequence, and adds the bias to it (read as a sharded op reads a replicated value:
    with gradients, its gradient is then summed over the ranks' parts)."""
    lm = sharder.lm
    if lm.per_rank:
        y = sharder.comm.reduce_scatter_rows(y, lm.world, sharder.group_name, sharder.a2a_reduce)
    elif seq is not None:
        y = sharder.scatter_sequence(y, seq)
    else:
        y = sharder.all_reduce(y)
    if m.bias is not None:
        y = aten.add(y, sharder.read(node, m.bias, seq))
    return y


@dataclasses.dataclass(frozen=True)
class DropoutOfCut(Lowering):
    """``native_dropout`` of a cut value: the whole mask drawn (the same random numbers the unsharded
    model draws, in the same order: ``native_dropout`` of ones of the whole shape and dtype is its
    mask times the scale), this rank's part of it applied. ``x * (mask * scale)`` is bitwise
    ``x * mask * scale`` for a mask of 0 and 1."""

    shard: Shard

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        x = sharder.read(node, node.args[0], self.shard)
        whole = node.args[0].meta["val"]
        ones = aten.ones(list(whole.shape), dtype=x.dtype, device=x.device)
        kept, mask = aten.native_dropout(ones, *node.args[1:], **node.kwargs)
        return aten.mul(x, take(kept, self.shard)), take(mask, self.shard)


@dataclasses.dataclass(frozen=True)
class StackedColwise(Lowering):
    """weights="per_rank": a colwise linear as a bmm over every rank's rows and its weight blocks."""

    match: LinearMatch

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        m = self.match
        y3, y = _matmul(sharder, m, sharder.read(node, m.input, None))
        if m.bias is not None:
            y = (y3 + sharder.held(m.bias).unsqueeze(1)).reshape(y.shape)
        return y


@dataclasses.dataclass(frozen=True)
class RowwiseExperts(Lowering):
    """Every expert's rowwise matmul on this rank's features: the output is this rank's partial sums."""

    match: LinearMatch
    in_shard: Shard

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        m = self.match
        x = _rowwise_input(sharder, node, m, self.in_shard)
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda p: x if p is m.input else sharder.read(node, p, None))
        return sharder.run_op(node, args, kwargs)


def _rowwise_input(sharder: Any, node: torch.fx.Node, m: LinearMatch, in_shard: Shard) -> Any:
    """A rowwise layer's input: this rank's features (local, narrowed, or gathered then narrowed)."""
    x = sharder.read(node, m.input, in_shard)
    if sharder.lm.read_of(node, m.input) == Read.GATHER and not sharder.lm.per_rank:
        x = take(x, in_shard)  # sharded on another dim: gathered, now this rank's features
    return x


def _matmul(sharder: Any, m: LinearMatch, x: Any) -> Any:
    """``x @ W'`` for this rank's part of the weight (a bmm over row blocks when stacked)."""
    lm = sharder.lm
    if m.node.target is aten._scaled_mm.default:  # (float8: its scales as the node reads them; bias: _combined)
        args = [sharder.read(m.node, a, None) if isinstance(a, torch.fx.Node) else a for a in m.node.args]
        kwargs = {k: sharder.read(m.node, a, None) if isinstance(a, torch.fx.Node) else a
                  for k, a in m.node.kwargs.items() if k != "bias"}
        return aten._scaled_mm(x, sharder.held(m.operand), *args[2:4], None, *args[5:], **kwargs)
    if not lm.stacked:
        return aten.mm(x, sharder.held(m.operand))
    w = sharder.held(m.operand)  # [world, *block]
    w = w.transpose(1, 2) if m.weight_form == "out_in" else w
    rows = x.shape[0]  # every rank's rows, rank-major; explicit sizes: a shard may be 0 wide
    y = aten.bmm(x.view(lm.world, rows // lm.world, x.shape[-1]), w)
    return y, y.reshape(rows, y.shape[-1])
