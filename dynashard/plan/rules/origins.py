"""Where shards come from: colwise and rowwise linears, vocab-parallel embeddings.

Before: ``up = addmm(b_up, x, t(w_up))`` colwise, ``down = mm(gelu(up), t(w_down))`` rowwise.
After: ``up`` is Shard(out_features) of this rank's weight rows (its bias narrowed); ``down``
reads its sharded input locally and its partial sums are all-reduced (the bias added once, after
the reduction). A replicated input of a rowwise linear is narrowed to this rank's features; an
input sharded another way is gathered first. An embedding "rowwise" is vocab-parallel: every rank
looks up every id in its slice of the vocabulary, and the rows are all-reduced.

Experts (a 3-D parameter, one ``[out, in]`` weight per expert, used by a batched or grouped
matmul) are cut alike in every expert: colwise gives a Shard on the matmul's output-feature dim;
rowwise leaves *partial sums* (each rank's term; see :mod:`dynashard.plan.rules.partial`), so the
routing weights, the token permutation and the top-k sum run before the one all_reduce.

Linears are found by :mod:`dynashard.capture.match` (any form: ``nn.Linear``, ``x @ W.t()``, HF Conv1D's
addmm), not by op, so the driver calls :func:`linear` for each matched node with its style.
"""

from __future__ import annotations

import math

import torch

from dynashard._torch import aten as private_aten
from dynashard.capture.match_adapters import joins_update
from dynashard.capture.records import (
    Embedding,
    Experts,
    Float8Scaled,
    GroupQuantized,
    LinearKind,
    LinearMatch,
    SpectralNormed,
    WeightNormed,
)
from dynashard.errors import UsageError
from dynashard.layout.nodes import size_at, val
from dynashard.layout.shard import Collective, CollectiveKind, LayoutMap, Read, Record, Shard, WishKind
from dynashard.layout.split import Split, even
from dynashard.options import Style
from dynashard.plan.rules.partial import stays_partial
from dynashard.plan.rules.quantized import rowwise_split
from dynashard.rewrite.lowerings import RowwiseExperts, RowwiseLinear, StackedColwise, VocabParallelLookup

aten = torch.ops.aten


def feeds_features(lm: LayoutMap, match: LinearMatch) -> bool:
    """The linear's input is sharded on exactly its input features (a rowwise input as it is);
    a shard on another dim (heads fed to a per-head linear, a merged dim) must be gathered."""
    return features_split(lm, match) is not None


def features_split(lm: LayoutMap, match: LinearMatch) -> Split | None:
    """How the linear's input is cut on its input features, if it is. A cut repeated over groups
    merged in front of it (HF Falcon's query heads of every KV group, each rank holding its part of
    each group: a Shard of one group's heads on the dim of all of them) is the same cut spelled out
    per group, so that the weight is cut to match."""
    src = lm.layouts.get(match.input)
    full = size_at(match.input, match.input_dim)
    if src is None or src.dim != match.input_dim or src.split.whole or match.in_features != full:
        return None
    if src.size == full:
        return src.split
    if not isinstance(full, int) or full % src.size:
        return None
    k, s = full // src.size, src.split
    return Split(s.parts * k, s.unit, deals=None if s.deals is None else s.deals * k)


def linear(lm: LayoutMap, match: LinearMatch, style: Style) -> Record:
    """The record of a matched linear cut ``style``: one function per (kind, style), gpt-fast's table."""
    if style == Style.REPLICATE:
        return lm.gathered(match.node)
    record = lm.keep(match.node, None)  # the weight's transpose reads the (already sharded) weight
    return _RECORDS[type(match.kind), style](lm, match, record)


def _vocab_parallel(lm: LayoutMap, match: LinearMatch, record: Record) -> Record:
    """A rowwise embedding: every rank looks up every id in its slice of the vocabulary."""
    record.weight_split = even(match.in_features)
    record.read(match.input, Read.GLOBAL if lm.per_rank else Read.LOCAL)
    record.layout = sequence_cut(lm, match.node)
    record.collectives.append(lm.reduce(match.node, record.layout is not None))
    record.lowering = VocabParallelLookup(match, lm.shard(record.weight_split, frozenset(), match.input_dim),
                                          record.layout)
    return record


def _colwise(lm: LayoutMap, match: LinearMatch, record: Record) -> Record:
    node, src = match.node, lm.layouts.get(match.input)
    if lm.per_rank:
        record.read(match.input, Read.GLOBAL)
    elif src is not None:
        record.read(match.input, Read.GATHER)
    out = lm.shard(lm.splits.get(node, even(match.out_features)), frozenset([node]))
    record.weight_split, record.layout = out.split, out
    if lm.stacked:
        record.lowering = StackedColwise(match)
    if match.renorm is not None:  # max_norm: each looked-up row's norm from every rank's part of it (vocab.py):
        # an fp32 per id and rank, charged as the int64 ids (the same bytes at world 2)
        record.collectives.append(Collective(CollectiveKind.ALL_GATHER, match.input, frozenset([node]), "max_norm"))
    if match.bias is None:
        return record
    bias = val(match.bias)
    if lm.stacked:
        if match.bias.op != "placeholder" or bias.dim() != 1:
            raise UsageError(
                f"dynashard: colwise {match.fqn!r} with weights='per_rank' needs its bias to be a "
                "1-D parameter (it is exchanged like the weight). Mark it 'replicate' in the plan."
            )
        return record.read(match.bias, Read.LOCAL)  # the rewrite adds every rank's bias block itself
    if lm.per_rank and not (match.bias in lm.uniform and bias.dim() <= 1):
        raise UsageError(
            f"dynashard: colwise {match.fqn!r} with inputs='per_rank' needs a 1-D bias that is the "
            f"same on every rank; found a {bias.dim()}-D bias. Mark it 'replicate' in the plan."
        )
    return record.read(match.bias, lm.as_shard(match.bias, out))


def _alignment(match: LinearMatch) -> int:
    """Elements per unit a cut must keep: ``aten._grouped_mm`` needs 16-byte strides (its CPU and
    CUDA kernels refuse others), so every rank's part must be a multiple of 16 bytes."""
    if getattr(private_aten.schema_of(match.node.target), "name", None) != "aten::_grouped_mm":
        return 1
    return max(1, 16 // val(match.node).element_size())


def _align(lm: LayoutMap, shard: Shard, match: LinearMatch) -> None:
    """Ask for units of 16 bytes where the kernel needs them, or for the origin whole when that
    would leave a rank without any (3 units of 8 over 4 ranks)."""
    unit = _alignment(match)
    if unit == 1:
        return
    k = math.lcm(unit, shard.split.unit) // shard.split.unit
    target = shard.split.coarsen(k)
    if target is not None and target.fewest_units(lm.world) >= 1:
        if k > 1:
            lm.wish(shard.origins, WishKind.COARSEN, k, f"{match.fqn}'s grouped_mm needs parts of 16 bytes")
        return
    lm.wish(shard.origins, WishKind.REPLICATE, 0 if target is None else k,
            f"{match.fqn}'s grouped_mm needs parts of 16 bytes ({unit} elements), too few to give all "
            f"{lm.world} ranks some")


def _experts_colwise(lm: LayoutMap, match: LinearMatch, record: Record) -> Record:
    """Every expert's own colwise linear (the weight chain runs on this rank's cut)."""
    node, src = match.node, lm.layouts.get(match.input)
    if src is not None:
        record.read(match.input, Read.GATHER)
    out = lm.shard(lm.splits.get(node, even(match.out_features)), frozenset([node]), match.output_dim)
    _align(lm, out, match)
    record.weight_split, record.layout = out.split, out
    return record


def _experts_rowwise(lm: LayoutMap, match: LinearMatch, record: Record) -> Record:
    """Every expert's own rowwise linear: this rank's partial sums."""
    node, src = match.node, lm.layouts.get(match.input)
    usable = feeds_features(lm, match) and src.size == match.in_features
    unit = _alignment(match)
    split = even(match.in_features)
    if usable:
        _align(lm, src, match)
        split = src.split
    elif unit > 1 and match.in_features // unit < lm.world:
        raise UsageError(
            f"dynashard: experts {match.fqn!r} run by aten._grouped_mm need every rank's part in whole 16 bytes: "
            f"{match.in_features} input features are {match.in_features // unit} parts of {unit}, fewer than "
            f"{lm.world} ranks; expected 'replicate' for it in the plan.")
    elif match.in_features % unit == 0:
        split = Split((match.in_features // unit,), unit)
    record.weight_split = split
    # an input sharded some other way is gathered, then this rank's features taken (lowerings.py)
    record.read(match.input, Read.LOCAL if usable else Read.GATHER if src is not None else Read.NARROW)
    record.partial = frozenset([node])
    record.lowering = RowwiseExperts(match, _input_shard(lm, match, record, usable))
    return record


def _rowwise(lm: LayoutMap, match: LinearMatch, record: Record) -> Record:
    node, src = match.node, lm.layouts.get(match.input)
    usable = feeds_features(lm, match)
    if src is not None and not usable and lm.per_rank:
        raise UsageError(
            f"dynashard: rowwise {match.fqn!r} with inputs='per_rank' needs its input sharded on its "
            f"{match.in_features} input features; found it sharded on dim {src.dim}. Mark it 'colwise' or "
            "'replicate' in the plan."
        )
    record.weight_split = features_split(lm, match) if usable else even(match.in_features)
    if isinstance(match.kind, GroupQuantized):  # (columns in whole groups of the quantization)
        record.weight_split = rowwise_split(lm, match, record.weight_split if usable else None)
        usable = usable and record.weight_split == features_split(lm, match)
    earlier = lm.presplit.get(match.weight)
    if earlier is not None and earlier[0] == match.in_dim:  # cut by an earlier graph (and freed): that cut
        usable = usable and earlier[1] == features_split(lm, match)
        record.weight_split = earlier[1]
    # an input sharded some other way is gathered, then this rank's features taken (lowerings.py)
    if usable:
        how = Read.LOCAL
    elif src is not None:
        how = Read.GATHER
    else:
        how = Read.GLOBAL_NARROW if lm.per_rank else Read.NARROW
    record.read(match.input, how)
    if match.bias is not None and lm.layouts.get(match.bias) is not None:
        record.read(match.bias, Read.GATHER)
    if _joins_partial_sums(lm, match) or _joins_low_rank_update(lm, match):
        record.partial = frozenset([node])  # reduced once with the others, where first read otherwise
        record.lowering = RowwiseLinear(match, _input_shard(lm, match, record, usable), reduce=False)
        return record
    record.layout = sequence_cut(lm, node)
    record.collectives.append(lm.reduce(node, record.layout is not None))
    record.lowering = RowwiseLinear(match, _input_shard(lm, match, record, usable), seq=record.layout)
    return record


def sequence_cut(lm: LayoutMap, node: torch.fx.Node) -> Shard | None:
    """Under sequence_parallel, what each rank keeps of a rowwise output's sum: its part of the
    sequence dim, the one before the features (``[B, S, H]``'s S; a 2-D ``[B*S, H]`` that the
    graph views back to ``[B, S, H]`` is cut on S with B merged in front, else on its tokens).
    Cut balanced (S = 10 on 4 ranks: 3/3/2/2). None (an all_reduce, the output whole) for a
    sequence shorter than the world: a rank without rows has nothing a merged cut can hold."""
    if not lm.sequence:
        return None
    out = val(node)
    if out is None or out.dim() < 2:
        return None
    size = out.shape[-2]
    views = [u for u in node.users if u.target in _VIEWS and val(u) is not None and val(u).dim() >= 3]
    if out.dim() == 2 and views and len(views) == len(node.users):
        if len({str(val(u).shape[-2]) for u in views}) == 1 and all(
                private_aten.known_equal(val(u).shape[-1], out.shape[-1]) for u in views):
            size = val(views[0]).shape[-2]
    if not isinstance(size, int):
        raise UsageError(
            f"dynashard: sequence_parallel cuts {node.name}'s output along its sequence, whose length is "
            f"symbolic here ({size}: dynamic=True, or a recompile after the length changed); expected a "
            "static length. Compile with torch.compile(..., dynamic=False) (one compile per length), or "
            "drop sequence_parallel.")
    if size < lm.world:
        return None
    return lm.shard(Split((size,), 1), frozenset([node]), -2)


def _joins_partial_sums(lm: LayoutMap, match: LinearMatch) -> bool:
    """Every reader adds the output to partial sums (DeepSeek's and Qwen2-MoE's shared expert, added
    to the routed experts' output): left partial itself, the two take one all_reduce, not two. Not
    with a bias (it would be added once per rank) or per-rank inputs (a reduce_scatter of rows)."""
    if match.bias is not None or lm.per_rank or lm.stacked or lm.sequence:
        return False

    def added(value: torch.fx.Node, depth: int = 3) -> bool:  # (through the views of a 3-D linear)
        users = list(value.users)
        return bool(users) and all(
            (u.target in _VIEWS and depth > 0 and added(u, depth - 1))
            or (u.target is aten.add.Tensor and len(u.args) == 2 and not u.kwargs
                and any(a is not value and a in lm.partial for a in u.args))
            # Llama4: ``shared.add_(routed.view(k, -1, h).sum(0))``, the routed sum not walked yet
            or (u.target is aten.add_.Tensor and value is match.node and len(users) == 1 and not u.kwargs
                and len(u.args) == 2 and u.args[0] is value and stays_partial(lm, u.args[1])) for u in users)

    return added(match.node)


def _joins_low_rank_update(lm: LayoutMap, match: LinearMatch) -> bool:
    """A LoRA on a rowwise base (match_adapters.py): the base, whose every reader adds the update to
    it, and A, once its base is partial sums, are left partial: A's terms go through B (whole, linear
    in them) into the base's, and one all_reduce serves the layer. A base's bias is then added to rank 0's
    partial sums alone (RowwiseLinear), so the sum holds it once (GPT-2's ``c_proj``, OPT's ``out_proj``)."""
    update = lm.updates.get(match.node)
    if update is None or lm.per_rank or lm.stacked or lm.sequence:
        return False
    if update.a is match:
        return update.base in lm.partial
    return update.base_linear is match and joins_update(match.node, lm.updates)


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _input_shard(lm: LayoutMap, match: LinearMatch, record: Record, usable: bool) -> Shard:
    """This rank's input features of a rowwise linear: its input's own shard when it feeds them as
    it is, else the weight's cut on the input's feature dim (narrowed or gathered, then taken)."""
    if usable:
        return lm.layouts[match.input]
    return lm.shard(record.weight_split, frozenset(), match.input_dim)


_RECORDS = {
    (LinearKind, Style.COLWISE): _colwise, (LinearKind, Style.ROWWISE): _rowwise,
    (Embedding, Style.COLWISE): _colwise, (Embedding, Style.ROWWISE): _vocab_parallel,
    (Experts, Style.COLWISE): _experts_colwise, (Experts, Style.ROWWISE): _experts_rowwise,
    (WeightNormed, Style.COLWISE): _colwise, (WeightNormed, Style.ROWWISE): _rowwise,  # (v and g cut alike)
    (SpectralNormed, Style.COLWISE): _colwise, (SpectralNormed, Style.ROWWISE): _rowwise,  # (sigma: propagate.py)
    (GroupQuantized, Style.COLWISE): _colwise, (GroupQuantized, Style.ROWWISE): _rowwise,  # (scales: propagate.py)
    (Float8Scaled, Style.COLWISE): _colwise, (Float8Scaled, Style.ROWWISE): _rowwise,  # (scales: analysis.py)
}
