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

Invariants: the rewrite never re-decides; it reads :class:`~dynashard.plan.plan.Plan` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from dynashard import _torch as private
from dynashard._torch import aten as private_aten
from dynashard._torch import regions as private_regions
from dynashard.capture.aliases import alias_roots, aliases_input, mutated_roots
from dynashard.comm import collectives
from dynashard.errors import InternalError, UsageError
from dynashard.layout.nodes import is_size
from dynashard.layout.shard import LayoutMap, Read, Shard
from dynashard.options import Style
from dynashard.plan.plan import Plan
from dynashard.rewrite.argument_check import check as lowering_check
from dynashard.rewrite.local_conversions import as_traced, take, take_groups

aten = torch.ops.aten


class Sharder(torch.fx.Interpreter):
    """This rank's interpreter of the aten graph: each node run on its operands as its record says
    (converted per edge, or emitted by its record's lowering), with ``comm``'s collectives.

    The one seam between the rewrite and what drives it: :func:`rewrite` runs it under ``make_fx`` on
    fake tensors with the real collectives (the trace is this rank's graph); ``explain(verify=True)``
    (``report/simulate.py``) runs the same interpreter on real tensors, every rank a thread, with
    simulated collectives, and watches each node's value through ``observe``.

    ``comm``: an object with the functions of :mod:`dynashard.comm.collectives` the rewrite calls
    (default: that module). ``observe(node, value)``: called with each node's value as this rank
    computes it (the interpreter frees a value after its last reader: an observer keeps what it needs,
    a copy if a later in-place op may write into it). ``a2a_reduce``: reduce-scatter as all-to-all + a
    local sum (cheaper on gloo). ``train``: the graph will be differentiated; its conversions carry
    Megatron's backward (``collectives.copy_to_shards`` etc.).

    A lowering (``lowerings.py``) emits through the members in :attr:`FOR_LOWERINGS` only. What it
    returns is its node's value: the interpreter keeps it under that node, and the readers its rule
    planned read it there (through :meth:`read`, as any operand). Nothing else passes between lowerings;
    the conversion cache (one gather or all_reduce per value, shared by its readers) is the interpreter's.
    """

    FOR_LOWERINGS = frozenset({
        "lm", "comm", "group_name", "megatron", "train", "a2a_reduce",  # what this rank is, and how it talks
        "read", "args", "held", "run_op", "all_reduce", "scatter_sequence", "gather_last_dim",
    })

    def __init__(
        self, gm: torch.fx.GraphModule, plan: Plan, group_name: str, *, a2a_reduce: bool = False, comm: Any = None,
        train: bool = False, observe: Callable[[torch.fx.Node, Any], None] | None = None,
    ) -> None:
        super().__init__(gm)
        self.a2a_reduce = a2a_reduce
        self.comm = comm if comm is not None else collectives
        self.lm: LayoutMap = plan.layouts
        # With gradients: every conversion with Megatron's backward (comm.copy_to_shards etc.);
        # sharded weights (and their transposes, ``self._weights``) hold this rank's part, not a
        # replicated value. Under inputs="per_rank" nothing is replicated across ranks (each rank its
        # own rows), and funcol's own backwards -- all_gather <-> reduce_scatter, all_to_all reversed,
        # "the sum of every rank's loss" -- are the right ones: plain collectives, no f or g. The
        # parameters' gradients are then averaged over the ranks by parallelize's hooks (gradients.py).
        self.megatron = train and not self.lm.per_rank
        self.train = train
        self.group_name = group_name
        self._observe = observe
        sharded = [m for m in plan.linears if self.lm.styles[m.node] != Style.REPLICATE]
        # (a dtype conversion of a cut weight, autocast's, is this rank's part too)
        self._weights = {n for m in sharded for n in (m.weight, m.transpose, *m.operand_path) if n is not None}
        self._from_inputs = _from_inputs(gm.graph)
        # (kind, producer) -> the converted value: "sum", "copy", "to_shards" or a Read; (one per value)
        self._conversions: dict[tuple[Any, ...], Any] = {}
        self._roots, self._written = alias_roots(gm.graph), mutated_roots(gm.graph)
        self._local_of_gathered: dict[torch.fx.Node, Any] = {}  # write-back targets' shards, as gathered

    def _convert(self, how: str, producer: torch.fx.Node, value: Any, out: Shard | None, to_shards: bool = False
                 ) -> Any:
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
        if to_shards:
            full = self.comm.gather_to_shards(moved, lay.split.lengths(lm.world)[0], lm.rank, group, self.a2a_reduce)
        else:
            full = self.gather_last_dim(moved, lay.split.lengths(lm.world), lay.split.whole)
        if merged:
            full = full.flatten(-2)
        # NOTE: kernels called at aten level (e.g. CPU flash attention) assume a unit-stride last
        # dim, which a moved-back gather does not have: make it contiguous.
        return full if lay.dim == -1 else full.movedim(-1, lay.dim).contiguous()

    def read(self, consumer: torch.fx.Node, producer: torch.fx.Node, out: Shard | None) -> Any:
        """``producer``'s value as ``consumer`` reads it (its record's conversion; ``out``: the
        consumer's output layout, which a narrow takes)."""
        record = self.lm.records.get(consumer)
        how = None if record is None else record.reads.get(producer)
        reduced = record is not None and producer in record.reduced
        value = self.env[producer]
        if reduced:  # partial sums: one all_reduce, shared by its readers
            key = ("sum", producer)
            if key not in self._conversions:
                self._conversions[key] = self.all_reduce(value)
            value = self._conversions[key]
        # With gradients, a replicated value read by an op whose output is sharded, or partial sums (a
        # whole LoRA B's weight applied to A's terms), goes through f: each rank's gradient for it is its
        # own part's or term's contribution, all-reduced in backward. One f per value, shared by such
        # readers only (a reader with a replicated output must not be summed again). A partial value
        # all-reduced here is replicated from then on: a sharded reader reads the sum through f too.
        # A value no graph input reaches (a causal mask made from ``arange``) has no gradient: no f.
        differentiable = _differentiable(value) and producer in self._from_inputs
        sharded_reader = self.megatron and out is not None and differentiable
        partial_reader = self.megatron and record is not None and record.partial is not None and differentiable
        replicated = self.lm.layouts.get(producer) is None and producer not in self._weights \
            and (reduced or producer not in self.lm.partial)
        if (sharded_reader or partial_reader) and replicated:
            key = ("copy", producer)
            if key not in self._conversions:
                self._conversions[key] = self.comm.copy_to_shards(value, self.group_name)
            value = self._conversions[key]
        if how is None or how == Read.LOCAL:
            return value
        if how == Read.NARROW_GROUPS:
            return take_groups(value, out)
        if how in (Read.NARROW, Read.GLOBAL_NARROW):  # cheap or consumer-specific: not shared
            return self._convert(how, producer, value, out)
        lay = self.lm.layouts.get(producer)
        if sharded_reader and how == Read.GATHER and self.lm.sequence and len(lay.split.parts) == 1 \
                and not lay.split.whole:
            # (sequence_parallel: a colwise input) one conversion, Megatron's: reduce_scatter backward,
            # where a gather then f would all_reduce the whole gradient and keep a piece of it
            key = ("to_shards", producer)
            if key not in self._conversions:
                self._conversions[key] = self._convert(how, producer, value, out, to_shards=True)
            return self._conversions[key]
        key = (how, producer)
        if key not in self._conversions:
            self._conversions[key] = self._convert(how, producer, value, out)
            if how == Read.GATHER and producer in self.lm.write_backs.values():
                self._local_of_gathered[producer] = value
        if sharded_reader and self.lm.layouts.get(producer) is not None:  # gathered, then read by a sharded op
            key = ("copy", how, producer)
            if key not in self._conversions:
                self._conversions[key] = self.comm.copy_to_shards(self._conversions[(how, producer)], self.group_name)
        return self._conversions[key]

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op in ("placeholder", "get_attr"):
            value = super().run_node(node)
        else:
            # (what is emitted for a node a checkpoint recomputes is recomputed too; for a node of a nested
            # region's call, is that call's: rewrite/outline.py)
            with private.as_node(node), private_regions.tagging(node):
                value = self._run(node)
        if self._observe is not None:
            self._observe(node, value)
        return value

    def held(self, producer: torch.fx.Node) -> Any:
        """``producer``'s value as this rank holds it, unconverted (a lowering that reads a shard as it
        is: a weight, the logits of a loss-parallel log_softmax)."""
        return self.env[producer]

    def _run(self, node: torch.fx.Node) -> Any:
        out = self._emit(node)
        gathered = self.lm.write_backs.get(node)
        if gathered is not None:  # a write into a gather: this rank's part of it copied into the shard
            part = take(self._conversions[(Read.GATHER, gathered)], self.lm.layouts[gathered])
            self._local_of_gathered[gathered].copy_(part)
        return out

    def _emit(self, node: torch.fx.Node) -> Any:
        record = self.lm.records[node]
        if record.lowering is None and record.resize is None and node.target not in _VIEWS:
            return self.run_op(node)  # the op itself on converted arguments: every argument carried
        with private_aten.recording_dispatch() as emitted:
            if record.lowering is not None:
                out = record.lowering.emit(self, node)
            elif node.target in _VIEWS:
                out = self._view(node)
            else:
                out = self.run_op(node)
        lowering_check(node, emitted, lambda n: self.env[n])
        return out

    def args(self, node: torch.fx.Node) -> tuple[Any, Any]:
        """``node``'s arguments as this rank reads them, a size argument at this rank's size."""
        record = self.lm.records[node]
        out = record.layout or (record.outputs or [None])[0]
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda p: self.read(node, p, out))
        resize = record.resize
        if resize is not None:
            shape = list(args[1])
            if not is_size(shape[resize.dim], -1):
                shape[resize.dim] = (resize.local if is_size(shape[resize.dim], resize.full)
                                     else shape[resize.dim] // resize.full * resize.local)
                if resize.local == 0:  # a -1 elsewhere cannot be inferred from an empty shard: the traced size
                    shape = [node.meta["val"].shape[i] if is_size(d, -1) else d for i, d in enumerate(shape)]
            if resize.rows_scaled and shape[0] != -1:
                shape[0] = shape[0] * self.lm.world
            args = (args[0], shape, *args[2:])
        return args, kwargs

    def run_op(self, node: torch.fx.Node, args: tuple | None = None, kwargs: dict | None = None) -> Any:
        """``node``'s own op on its converted arguments, or on ``args``/``kwargs`` a lowering read
        itself (the traced memory layout restored)."""
        if args is None:
            args, kwargs = self.args(node)
        if node.op == "call_function" and not aliases_input(node):  # views and in-place ops keep theirs
            args, kwargs = as_traced(node, args, kwargs)
        return getattr(self, node.op)(node.target, args, kwargs)

    def all_reduce(self, value: Any) -> Any:
        if self.megatron:
            return self.comm.reduce_from_shards(value, self.group_name)  # g: identity backward
        return self.comm.all_reduce_sum(value, self.group_name)

    def scatter_sequence(self, value: Any, seq: Shard) -> Any:
        """sequence_parallel: every rank's partial sums added up, this rank keeping its part of the
        sequence dim (``seq.dim``; a batch merged in front of it, ``[B*S]``, is taken apart first).
        With gradients, Megatron's backward: every rank's parts all-gathered."""
        lm = self.lm
        full = value.shape[seq.dim]
        merged = not is_size(full, seq.size)
        moved = value.movedim(seq.dim, -1)
        if merged:
            moved = moved.unflatten(-1, (full // seq.size, seq.size))
        lengths = seq.split.lengths(lm.world)[0]
        scatter = self.comm.reduce_scatter_to_shards if self.megatron else self.comm.reduce_scatter_last_dim
        part = scatter(moved, lengths, lm.rank, self.group_name, self.a2a_reduce)
        if merged:
            part = part.flatten(-2)
        return part.movedim(-1, seq.dim).contiguous()

    def gather_last_dim(self, value: Any, lengths: list[list[int]], whole: frozenset[int] = frozenset()) -> Any:
        """Every rank's ``value`` side by side on the last dim (with gradients: Megatron's, the
        backward keeping this rank's columns)."""
        lm = self.lm
        if self.megatron:
            return self.comm.gather_from_shards(value, lengths, lm.rank, self.group_name, whole)
        return self.comm.all_gather_last_dim(value, lengths, lm.rank, self.group_name, whole)

    def _view(self, node: torch.fx.Node) -> Any:
        """A view that may need a copy here: a gathered or head-sharded value can be laid out
        differently in memory than in the model, so ``reshape`` keeps it valid. A copy is only
        wrong if something writes through it, which is refused loudly."""
        args, _ = self.args(node)
        out = aten.reshape(args[0], args[1])
        if not private_aten.is_view(out) and self._roots.get(node, node.args[0]) in self._written:
            raise UsageError(
                f"dynashard: {node.name} must copy on this rank (its input is laid out differently once "
                "sharded), and an in-place op writes through it; expected out-of-place code there."
            )
        return out


_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _from_inputs(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes a gradient may reach: those some placeholder reaches, and every alias of a value some op writes
    into (``zeros`` then ``copy_(x)``: the buffer then holds ``x``'s values). The rest are computed from no input
    (constants, ``arange``, a causal mask), so no gradient flows to or from them."""
    roots = alias_roots(graph)
    written = mutated_roots(graph)
    for node in graph.nodes:  # (an out= or other written argument, besides the first)
        schema = private_aten.schema_of(node.target) if node.op == "call_function" else None
        for i, arg in enumerate(schema.arguments if schema is not None else ()):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.update(roots.get(v, v) for v in (value if isinstance(value, (list, tuple)) else [value])
                               if isinstance(v, torch.fx.Node))
    reached: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or roots.get(node, node) in written \
                or any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def rewrite(
    gm: torch.fx.GraphModule, plan: Plan, fake_args: list[Any], group_name: str, a2a_reduce: bool = False,
    train: bool = False,
) -> torch.fx.GraphModule:
    """This rank's sharded graph. ``fake_args`` carry shard shapes for sharded weights.

    ``a2a_reduce``: reduce-scatter as all-to-all + local sum (cheaper on gloo). ``train``: the graph
    will be differentiated: its conversions carry Megatron's backward (``collectives.copy_to_shards``).
    """
    sharder = Sharder(gm, plan, group_name, a2a_reduce=a2a_reduce, train=train)
    with collectives.TracedConversions():  # (released once bound: the graph then holds each conversion)
        traced = private.trace_aten(lambda *args: sharder.run(*args), fake_args, keep_tags=private.recomputes(gm))
        return collectives.bind_conversions(traced) if train else traced
