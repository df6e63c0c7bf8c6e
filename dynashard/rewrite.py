"""Rewrite: re-trace the aten graph with this rank's shards, emitting what the layout map says.

Before (aten graph, full weights)::

    t = aten.t(w_up); up = aten.addmm(b_up, x, t); g = aten.gelu(up)
    t_1 = aten.t(w_down); down = aten.mm(g, t_1); out = aten.add(down, b_down)
After (this rank's graph; ``w_up``/``w_down`` placeholders now carry shards)::

    t = aten.t(w_up_shard); b = aten.narrow(b_up, -1, start, len); up = aten.addmm(b, x, t)
    g = aten.gelu(up); t_1 = aten.t(w_down_shard); down = aten.mm(g, t_1)
    ar = _c10d_functional.all_reduce(down, "sum", group); down = _c10d_functional.wait_tensor(ar)
    out = aten.add(down, b_down)

With ``inputs="per_rank"`` the colwise input is first all-gathered along rows and the rowwise
output reduce-scattered back (see shard.py). With ``weights="per_rank"`` a sharded weight
placeholder holds ``[world, *block]`` (this rank's block of every rank's weight) and each
linear becomes a ``bmm`` over the rank-major row blocks.

The rewrite is an ``fx.Interpreter`` run under ``make_fx``: each node is re-executed on fake
tensors with its arguments converted as recorded (gather / narrow / local: the collectives are
``collectives.py``, the rest ``local_conversions.py``), so the new graph is traced, not spliced,
and every node has true shard shapes in ``meta["val"]``. A rewrite that does not type-check
fails here, at compile time, never mid-forward.

Invariants: the rewrite never re-decides; it reads :class:`~dynashard.plan.Plan` only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dynashard import _torch_private as private
from dynashard import _torch_private_aten as private_aten
from dynashard import collectives, vocab
from dynashard.errors import InternalError, UsageError
from dynashard.local_conversions import as_traced, take, take_groups
from dynashard.lowering import check as lowering_check
from dynashard.nodes import is_size
from dynashard.plan import Plan
from dynashard.rules.inplace import alias_roots, aliases_input, mutated_roots
from dynashard.shard import LayoutMap, Read, Shard

aten = torch.ops.aten


class _Sharder(torch.fx.Interpreter):
    def __init__(
        self, gm: torch.fx.GraphModule, plan: Plan, group_name: str, a2a_reduce: bool, comm: Any = None,
        train: bool = False,
    ) -> None:
        super().__init__(gm)
        self.a2a_reduce = a2a_reduce
        self.comm = comm if comm is not None else collectives  # explain(verify=True) simulates them
        self.lm: LayoutMap = plan.layouts
        # With gradients: every conversion with Megatron's backward (collectives.copy_to_shards etc.);
        # sharded weights (and their transposes, ``self.weights``) hold this rank's part, not a
        # replicated value. Under inputs="per_rank" nothing is replicated across ranks (each rank its
        # own rows), and funcol's own backwards -- all_gather <-> reduce_scatter, all_to_all reversed,
        # "the sum of every rank's loss" -- are the right ones: plain collectives, no f or g. The
        # parameters' gradients are then averaged over the ranks by parallelize's hooks (gradients.py).
        self.megatron = train and not self.lm.per_rank
        self.train = train
        self.group_name = group_name
        self.by_node = {m.node: m for m in plan.linears if self.lm.styles[m.node] != "replicate"}
        # (a dtype conversion of a cut weight, autocast's, is this rank's part too)
        self.weights = {n for m in self.by_node.values() for n in (m.weight, m.transpose, *m.operand_path)
                        if n is not None}
        # weights="per_rank": a stacked weight's own transpose is never evaluated (bmm reads it).
        self.skipped = {m.transpose for m in self.by_node.values() if self.lm.stacked and m.transpose is not None}
        self.renorms = {m.renorm: m for m in self.by_node.values() if m.renorm is not None}  # embeddings' max_norm
        self.converted: dict[tuple[str, torch.fx.Node], Any] = {}
        self.roots, self.written = alias_roots(gm.graph), mutated_roots(gm.graph)

    def _convert(self, how: str, producer: torch.fx.Node, value: Any, out: Shard | None) -> Any:
        lm, group = self.lm, self.group_name
        lay = lm.layouts[producer]
        if how == Read.NARROW:
            assert out is not None, f"narrow of {producer} without a sharded output"
            return take(value, out)
        if how == Read.GLOBAL_NARROW:
            if not lm.per_rank:
                return take(value, out)
            return self.comm.own_rows_to_shard(value, out.split.lengths(lm.world)[0], lm.rank, group)
        if how == Read.GLOBAL and lay is None:
            return self.comm.all_gather_rows(value, group) if lm.per_rank else value
        if how == Read.GATHER and lm.per_rank:
            return self.comm.shard_to_own_rows(value, lay.split.lengths(lm.world)[0], lm.rank, group)
        # GATHER / GLOBAL of a Shard: gather its cut dim (moved last, then back)
        moved = value if lay.dim == -1 else value.movedim(lay.dim, -1)
        # A batch dim merged in front ([B * h]): decided from the full graph's sizes, the same on
        # every rank. Shape rules only make merged shards where every rank holds a part, so the
        # outer size can be recovered from this rank's.
        merged = not is_size(producer.meta["val"].shape[lay.dim], lay.size)
        if merged:
            if lay.length == 0:
                raise InternalError(f"dynashard: internal error: merged shard of {producer} is empty on this rank")
            moved = moved.unflatten(-1, (moved.shape[-1] // lay.length, lay.length))
        if self.megatron:
            full = collectives.gather_from_shards(moved, lay.split.lengths(lm.world), lm.rank, group)
        else:
            full = self.comm.all_gather_last_dim(moved, lay.split.lengths(lm.world), lm.rank, group, lay.split.whole)
        if merged:
            full = full.flatten(-2)
        # NOTE: kernels called at aten level (e.g. CPU flash attention) assume a unit-stride last
        # dim, which a moved-back gather does not have: make it contiguous.
        return full if lay.dim == -1 else full.movedim(-1, lay.dim).contiguous()

    def _read(self, consumer: torch.fx.Node, producer: torch.fx.Node, out: Shard | None) -> Any:
        how = self.lm.reads.get((consumer, producer))
        value = self.env[producer]
        if (consumer, producer) in self.lm.reduced:  # partial sums: one all_reduce, shared by its readers
            key = ("sum", producer)
            if key not in self.converted:
                self.converted[key] = self._all_reduce(value)
            value = self.converted[key]
        # With gradients, a replicated value read by an op whose output is sharded goes through f: each
        # rank's gradient for it is its own part's contribution, all-reduced in backward. One f per value,
        # shared by such readers only (a reader with a replicated output must not be summed again).
        sharded_reader = self.megatron and out is not None and _differentiable(value)
        replicated = self.lm.layouts.get(producer) is None and producer not in self.weights
        if sharded_reader and replicated and (consumer, producer) not in self.lm.reduced:
            key = ("copy", producer)
            if key not in self.converted:
                self.converted[key] = collectives.copy_to_shards(value, self.group_name)
            value = self.converted[key]
        if how is None or how == Read.LOCAL:
            return value
        if how == Read.NARROW_GROUPS:
            return take_groups(value, out)
        if how in (Read.NARROW, Read.GLOBAL_NARROW):  # cheap or consumer-specific: not shared
            return self._convert(how, producer, value, out)
        key = (how, producer)
        if key not in self.converted:
            self.converted[key] = self._convert(how, producer, value, out)
        if sharded_reader and self.lm.layouts.get(producer) is not None:  # gathered, then read by a sharded op
            key = ("copy", how, producer)
            if key not in self.converted:
                self.converted[key] = collectives.copy_to_shards(self.converted[(how, producer)], self.group_name)
        return self.converted[key]

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op in ("placeholder", "get_attr"):
            return super().run_node(node)
        lowering = self._lowering(node)
        if lowering is None and node not in self.lm.view_sizes:
            return self._as_traced_op(node)  # the op itself on converted arguments: every argument carried
        with private_aten.recording_dispatch() as emitted:
            out = (lowering or self._as_traced_op)(node)
        lowering_check(node, emitted, lambda n: self.env[n])
        return out

    def _lowering(self, node: torch.fx.Node) -> Any:
        """The method that emits ``node`` other than as its own op on converted arguments, if any."""
        m = self.by_node.get(node)
        if node in self.skipped:
            return self._stacked_transpose
        if m is not None and m.kind == "experts":
            return self._experts_rowwise if self.lm.styles[node] == "rowwise" else None
        if m is not None and (self.lm.stacked or self.lm.styles[node] == "rowwise"):
            return self._linear
        if node in self.renorms:
            return self._renorm
        if node in self.lm.loss_parallel:
            return self._log_sum_exp
        if node.op != "call_function":
            return None
        if node.target is aten.nll_loss_forward.default and node.args[0] in self.lm.loss_parallel:
            return self._nll_loss
        if node in self.lm.states:
            return self._allocate_local
        if node.target in (aten.view.default, aten._unsafe_view.default):
            return self._view
        if node in self.lm.part_sizes:
            return self._parts
        return None

    def _args(self, node: torch.fx.Node) -> tuple[Any, Any]:
        """``node``'s arguments as this rank reads them, a size argument at this rank's size."""
        out = self.lm.layouts.get(node) or (self.lm.outputs.get(node) or [None])[0]
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda p: self._read(node, p, out))
        if node in self.lm.view_sizes:
            dim, full, local = self.lm.view_sizes[node]
            shape = list(args[1])
            if not is_size(shape[dim], -1):
                shape[dim] = local if is_size(shape[dim], full) else shape[dim] // full * local
                if local == 0:  # a -1 elsewhere cannot be inferred from an empty shard: the traced size
                    shape = [node.meta["val"].shape[i] if is_size(d, -1) else d for i, d in enumerate(shape)]
            if node in self.lm.view_rows_scaled and shape[0] != -1:
                shape[0] = shape[0] * self.lm.world
            args = (args[0], shape, *args[2:])
        return args, kwargs

    def _as_traced_op(self, node: torch.fx.Node) -> Any:
        args, kwargs = self._args(node)
        if node.op == "call_function" and not aliases_input(node):  # views and in-place ops keep theirs
            args, kwargs = as_traced(node, args, kwargs)
        return getattr(self, node.op)(node.target, args, kwargs)

    def _stacked_transpose(self, node: torch.fx.Node) -> Any:
        return self.env[node.args[0]]  # stands for the stacked weight (the bmm transposes it)

    def _allocate_local(self, node: torch.fx.Node) -> Any:
        """A cache allocated by the graph: at this rank's size."""
        args, kwargs = self._args(node)
        shard, size = self.lm.states[node], list(args[0])
        size[len(size) + shard.dim] = shard.length
        return node.target(size, *args[1:], **kwargs)

    def _parts(self, node: torch.fx.Node) -> Any:
        """A split or slice of the cut dim: this rank's parts (an index of consecutive positions: a slice)."""
        args, _ = self._args(node)
        sizes = self.lm.part_sizes[node]
        dim = self.lm.layouts[node.args[0]].dim
        if node.target in (aten.slice.Tensor, aten.index.Tensor):
            return aten.narrow(args[0], dim, *sizes)
        return aten.split_with_sizes(args[0], list(sizes), dim)

    def _log_sum_exp(self, node: torch.fx.Node) -> None:
        """Loss parallel (rules/loss.py): a log_softmax along the cut vocab dim is only read by
        nll_loss, which needs this rank's logits and their log-sum-exp per token, not the
        log-probabilities; so no value stands for the node (a reader the rule did not expect
        fails here, at compile time)."""
        x = self.env[node.args[0]]
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # in fp32, as the kernel accumulates
        self.converted[("lse", node)] = (x, torch.logsumexp(x, -1, keepdim=True))
        return None

    def _nll_loss(self, node: torch.fx.Node) -> Any:
        """``nll_loss_forward`` of vocab-sharded log-probabilities: every rank's per-token
        (log-sum-exp, target logit) in one all_gather, then the log-probability of each target,
        and torch's own nll_loss on it (so reduction, ignore_index and out-of-range targets
        behave as unsharded). With gradients, the gather's backward keeps this rank's columns:
        the backward of the logits is local."""
        lsm, target = node.args[0], self._read(node, node.args[1], None)
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        x, lse = self.converted[("lse", lsm)]
        shard, world = self.lm.layouts[lsm], self.lm.world
        index, inside, offset = torch.zeros_like(target), torch.zeros_like(target, dtype=torch.bool), 0
        for start, length in shard.pieces:  # the target's column among this rank's, if it holds it
            hit = (target >= start) & (target < start + length)
            index, inside, offset = torch.where(hit, target - start + offset, index), inside | hit, offset + length
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        picked = torch.where(inside, x.gather(-1, index.unsqueeze(-1)).squeeze(-1), zero)
        mine = torch.stack([lse.squeeze(-1), picked], -1)  # [tokens, 2]
        lengths = [[2] * world]
        if self.megatron:
            everyone = collectives.gather_from_shards(mine, lengths, self.lm.rank, self.group_name)
        else:
            everyone = self.comm.all_gather_last_dim(mine, lengths, self.lm.rank, self.group_name)
        everyone = everyone.unflatten(-1, (world, 2))
        logp = everyone[..., 1].sum(-1) - torch.logsumexp(everyone[..., 0], -1)  # of each target
        # torch's nll_loss over two columns, the target's log-probability in column ``col``: the
        # ignored targets stay ignored, an out-of-range target stays out of range (torch raises).
        col = 1 if ignore == 0 else 0
        inside_vocab = (target >= 0) & (target < shard.size)
        target2 = torch.where(target == ignore, target, torch.where(inside_vocab, col, target))
        zero = torch.zeros_like(logp)
        probs = torch.stack([logp, zero] if col == 0 else [zero, logp], -1).to(lsm.meta["val"].dtype)
        return aten.nll_loss_forward(probs, target2, None, reduction, ignore)

    def _all_reduce(self, value: Any) -> Any:
        if self.megatron:
            return collectives.reduce_from_shards(value, self.group_name)  # g: identity backward
        return self.comm.all_reduce_sum(value, self.group_name)

    def _view(self, node: torch.fx.Node) -> Any:
        """A view that may need a copy here: a gathered or head-sharded value can be laid out
        differently in memory than in the model, so ``reshape`` keeps it valid. A copy is only
        wrong if something writes through it, which is refused loudly."""
        args, _ = self._args(node)
        out = aten.reshape(args[0], args[1])
        if not private_aten.is_view(out) and self.roots.get(node, node.args[0]) in self.written:
            raise UsageError(
                f"dynashard: {node.name} must copy on this rank (its input is laid out differently once "
                "sharded), and an in-place op writes through it; expected out-of-place code there."
            )
        return out

    def _matmul(self, m, x: Any) -> Any:
        """``x @ W'`` for this rank's part of the weight (a bmm over row blocks when stacked)."""
        if not self.lm.stacked:
            return aten.mm(x, self.env[m.operand])
        w = self.env[m.operand]  # [world, *block]
        w = w.transpose(1, 2) if m.weight_form == "out_in" else w
        rows = x.shape[0]  # every rank's rows, rank-major; explicit sizes: a shard may be 0 wide
        y = aten.bmm(x.view(self.lm.world, rows // self.lm.world, x.shape[-1]), w)
        return y, y.reshape(rows, y.shape[-1])

    def _renorm(self, node: torch.fx.Node) -> Any:
        """``embedding_renorm_`` (``F.embedding`` with ``max_norm``) on this rank's cut (vocab.py)."""
        m = self.renorms[node]
        ids = self._read(m.node, m.input, None)  # as the lookup reads them
        if self.lm.styles[m.node] == "rowwise":
            shard = self.lm.shard(self.lm.weight_splits[m.node], frozenset(), -1)
            return vocab.renorm_rows(node, self.env[node.args[0]], ids, shard)
        world, rank = self.lm.world, self.lm.rank
        return vocab.renorm_rows(node, self.env[node.args[0]], ids, None, lambda part: self.comm.all_gather_last_dim(
            part, [[1] * world], rank, self.group_name))

    def _rowwise_input(self, node: torch.fx.Node, m) -> Any:
        """A rowwise layer's input: this rank's features (local, narrowed, or gathered then narrowed)."""
        lm = self.lm
        how = lm.reads.get((node, m.input))
        src = lm.layouts.get(m.input)
        in_shard = src if how == Read.LOCAL and src is not None else lm.shard(lm.weight_splits[node], frozenset(),
                                                                              m.input_dim)
        x = self._read(node, m.input, in_shard)
        if how == Read.GATHER and not lm.per_rank:  # sharded on another dim: gathered, now take this rank's features
            x = take(x, in_shard)
        return x, in_shard

    def _experts_rowwise(self, node: torch.fx.Node) -> Any:
        """Every expert's rowwise matmul on this rank's features: the output is this rank's partial sums."""
        m = self.by_node[node]
        x, _ = self._rowwise_input(node, m)
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda p: x if p is m.input else self._read(node, p, None))
        args, kwargs = as_traced(node, args, kwargs)
        return getattr(self, node.op)(node.target, args, kwargs)

    def _linear(self, node: torch.fx.Node) -> Any:
        m, lm = self.by_node[node], self.lm
        if lm.styles[node] == "colwise":  # only reached with stacked weights
            x = self._read(node, m.input, None)
            y3, y = self._matmul(m, x)
            if m.bias is not None:
                y = (y3 + self.env[m.bias].unsqueeze(1)).reshape(y.shape)
            return y
        x, in_shard = self._rowwise_input(node, m)
        if m.kind == "embedding":
            y = vocab.lookup(node, self.env[m.weight], x, in_shard, self.train, lm.world if lm.per_rank else 1)
        else:
            y = self._matmul(m, x)
            y = y[1] if lm.stacked else y
        if lm.per_rank:
            y = self.comm.reduce_scatter_rows(y, lm.world, self.group_name, self.a2a_reduce)
        else:
            y = self._all_reduce(y)
        if m.bias is not None:
            y = aten.add(y, self._read(node, m.bias, None))
        return y


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def rewrite(
    gm: torch.fx.GraphModule, plan: Plan, fake_args: list[Any], group_name: str, a2a_reduce: bool = False,
    train: bool = False,
) -> torch.fx.GraphModule:
    """This rank's sharded graph. ``fake_args`` carry shard shapes for sharded weights.

    ``a2a_reduce``: reduce-scatter as all-to-all + local sum (cheaper on gloo). ``train``: the graph
    will be differentiated: its conversions carry Megatron's backward (``collectives.copy_to_shards``).
    """
    sharder = _Sharder(gm, plan, group_name, a2a_reduce, train=train)
    traced = private.trace_aten(lambda *args: sharder.run(*args), fake_args)
    return collectives.bind_conversions(traced) if train else traced
