"""The collectives inside the sharded graph: funcol ops, and Megatron's conversions for training.

They are plain functions over ``torch.distributed._functional_collectives`` (the two whose names changed
between torch releases through ``_torch.funcol``); the rewrite calls them
while tracing, so the graph holds ``_c10d_functional.*`` + ``wait_tensor`` with symbolic batch sizes.
What runs outside the graph is elsewhere: the ranks' agreement in ``protocol`` (host-side), data
moves (rank 0's deal, gathers) in ``transport``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from dynashard import _torch as private
from dynashard import state
from dynashard._torch import funcol as private_funcol
from dynashard.comm.protocol import peer_guard
from dynashard.errors import InternalError


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", group_name)


def all_gather_last_dim(
    x: torch.Tensor, lengths: list[list[int]], rank: int, group_name: str, whole: frozenset[int] = frozenset()
) -> torch.Tensor:
    """Every rank's pieces of the last dim, back in order: ``lengths[c][r]`` is how many elements
    of component ``c`` rank ``r`` holds, and ``x`` holds this rank's pieces side by side.
    Components in ``whole`` are held whole by every rank and are not sent.

    Each piece is padded to the longest rank's (one all_gather of equal blocks), then the padding
    is cut away again: one narrow per run of ranks with equal lengths (two at most when balanced).
    """
    world = len(lengths[0])
    own, offset = [], 0
    for ls in lengths:
        own.append(x.narrow(-1, offset, ls[rank]) if len(lengths) > 1 else x)
        offset += ls[rank]
    cut = [c for c in range(len(lengths)) if c not in whole]
    chunks = {c: max(lengths[c]) for c in cut}
    pieces = [_pad_last(own[c], chunks[c]) for c in cut]
    x = pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)
    gathered = private_funcol.all_gather_single(x.contiguous(), 0, group_name)  # [world * d0, ...]
    blocks = gathered.view(world, *x.shape).movedim(0, -2)  # [..., world, sum(chunks)]
    out, offset = [], 0
    for c, ls in enumerate(lengths):
        if c in whole:
            out.append(own[c])
            continue
        chunk = chunks[c]
        block = blocks.narrow(-1, offset, chunk) if len(cut) > 1 else blocks
        offset += chunk
        r = 0
        while r < world:  # runs of ranks holding equally many
            end = next((e for e in range(r, world) if ls[e] != ls[r]), world)
            run = block if (r, end) == (0, world) else block.narrow(-2, r, end - r)
            run = run if ls[r] == chunk else run.narrow(-1, 0, ls[r])
            out.append(run.reshape(*run.shape[:-2], (end - r) * ls[r]))
            r = end
    return out[0] if len(out) == 1 else torch.cat(out, -1)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def rank_blocks(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``x``'s last dim cut into one block per rank (``lengths``), each padded to the longest:
    ``[world, ..., max(lengths)]``."""
    chunk, starts = max(lengths), [sum(lengths[:r]) for r in range(len(lengths))]
    if all(ln == chunk for ln in lengths):
        return x.reshape(*x.shape[:-1], len(lengths), chunk).movedim(-2, 0)
    return torch.stack([_pad_last(x.narrow(-1, s, ln), chunk) for s, ln in zip(starts, lengths)])


def reduce_scatter_last_dim(x: torch.Tensor, lengths: list[int], rank: int, group_name: str,
                            via_all_to_all: bool) -> torch.Tensor:
    """Every rank's partial sums ``x`` added up, this rank keeping its ``lengths[rank]`` elements of
    the last dim (rank r's come after those of ranks < r; sequence_parallel's rowwise output).
    Uneven lengths: each rank's block is padded to the longest, and the padding cut away after.
    ``via_all_to_all``: an all-to-all and a local sum (cheaper on gloo: reduce_scatter_rows)."""
    blocks = rank_blocks(x, lengths).contiguous()  # [world, ..., chunk]
    # (waited before any view of it: traced by AOTAutograd in a backward, a view of the lazy result
    # emitted the collective twice, measured)
    if via_all_to_all:
        y = funcol.wait_tensor(funcol.all_to_all_single(blocks, None, None, group_name)).sum(0)  # j: rank j's
    else:
        y = funcol.wait_tensor(private_funcol.reduce_scatter_single(blocks, "sum", 0, group_name))[0]
    # (contiguous: a training graph is traced on the conversion's fake output, which is contiguous)
    return y if lengths[rank] == blocks.shape[-1] else y.narrow(-1, 0, lengths[rank]).contiguous()


def all_gather_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's rows, rank-major (inputs="per_rank": a colwise input)."""
    return private_funcol.all_gather_single(x.contiguous(), 0, group_name)


def reduce_scatter_rows(x: torch.Tensor, world: int, group_name: str, via_all_to_all: bool) -> torch.Tensor:
    """Sum every rank's partial ``[world * rows, ...]`` and keep this rank's rows.

    gloo's reduce_scatter costs more than an all_reduce of the whole tensor, while an all-to-all of
    the row blocks followed by a local sum moves the same bytes once. benchmarks/bench_collectives.py,
    4 MiB on 4 ranks, medians: reduce_scatter 13.8 ms, all_reduce 9.3 ms, all_to_all + sum 7.5 ms.
    NCCL's reduce_scatter is the real one and is kept there.
    """
    if not via_all_to_all:
        return private_funcol.reduce_scatter_single(x.contiguous(), "sum", 0, group_name)
    y = funcol.all_to_all_single(x.contiguous(), None, None, group_name)  # block j: rank j's partial
    return y.view(world, x.shape[0] // world, *x.shape[1:]).sum(0)


def shard_to_own_rows(x: torch.Tensor, lengths: list[int], rank: int, group_name: str) -> torch.Tensor:
    """``[world * rows, ..., my cols]`` -> ``[rows, ..., all cols]``: one all-to-all over rows.

    ``lengths[r]``: the columns rank r holds."""
    world = len(lengths)
    chunk = max(lengths)
    x = _pad_last(x, chunk)
    y = funcol.all_to_all_single(x.contiguous(), None, None, group_name)  # block j: my rows, rank j's cols
    rows = x.shape[0] // world
    y = y.view(world, rows, *x.shape[1:]).movedim(0, -2)  # [rows, ..., world, chunk]
    if all(ln == chunk for ln in lengths):
        return y.reshape(rows, *x.shape[1:-1], world * chunk)
    return torch.cat([y.select(-2, r).narrow(-1, 0, ln) for r, ln in enumerate(lengths)], -1)


def own_rows_to_shard(x: torch.Tensor, lengths: list[int], rank: int, group_name: str) -> torch.Tensor:
    """``[rows, ..., all cols]`` -> ``[world * rows, ..., my cols]``: one all-to-all of feature blocks."""
    blocks = rank_blocks(x, lengths)  # [world, rows, ..., chunk]
    y = funcol.all_to_all_single(blocks.contiguous().flatten(0, 1), None, None, group_name)
    return y.narrow(-1, 0, lengths[rank]) if lengths[rank] != max(lengths) else y


# ---------------------------------------------------------------- training: Megatron's conversions
#
# With gradients, each conversion the rewrite emits needs the backward Megatron gives it
# (research/training.md 1), not funcol's own autograd, whose all_reduce and all_gather backwards
# have "sum of per-rank losses" semantics (world-size times the gradient here, measured):
#
# - copy_to_shards (f): identity forward; all_reduce backward. A replicated value read by an op
#   whose output is sharded: each rank's gradient for it is only its own part's contribution.
# - reduce_from_shards (g): all_reduce forward; identity backward (every rank's gradient of the sum
#   is the same replicated gradient).
# - gather_from_shards: all_gather forward; backward keeps this rank's pieces of the (replicated)
#   gradient, no communication.
# - reduce_scatter_to_shards (sequence_parallel): reduce_scatter forward; all_gather backward.
# - gather_to_shards (sequence_parallel, a gathered value read by a sharded op): all_gather forward;
#   reduce_scatter backward (a gather followed by f, in one collective each way).
#
# They are autograd.Functions, and make_fx (the rewrite's trace) would inline a Function and drop its
# backward. So the rewrite traces an opaque marker op, ``dynashard::tp_conversion(x, key)``, and
# then points each marker node at its Function (``bind_conversions``): AOTAutograd, tracing the
# rewritten graph for the compiler, runs the Function and keeps its backward (measured:
# tools/proto_train_fg.py, gradients equal the unsharded model's under eager, aot_eager and Inductor).

# The markers' keys name the rewrite that traced them (``TracedConversions``): two compiles' never meet, and
# the registry (``state.CONVERSIONS``) holds a compile's conversions only while it traces. A bound node calls
# ``apply_conversion(x, "<Function's name>", *args)``, a module-level function over plain values, so the
# bound graph's code names importable globals only and pickles (the compile cache stores it); its
# regather tags (node meta, which pickling drops) are made again by ``tag_regathers`` after a load.
_REGATHER_GRAPH_ID = 1 << 20  # (ids apart from the user's checkpointed regions')
aten = torch.ops.aten
_LAYOUT_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
               aten.transpose.int, aten.clone.default, aten.alias.default}


# The marker's output has the shape and the strides of its conversion's output: the ops the rewrite traces
# after a marker (a ``view``, where a ``reshape`` finds the value laid out for it) run on the Function's own
# output once the marker is bound. A gather's output is laid out as its blocks land (``[..., world, d]``
# moved to the last dim: not contiguous); a contiguous marker made a sequence-parallel gather's ``flatten``
# of a merged batch a ``view``, which the bound graph could not take ("Cannot view a tensor with shape").
@torch.library.custom_op("dynashard::tp_conversion", mutates_args=())
def tp_conversion(x: torch.Tensor, key: str) -> torch.Tensor:
    with torch.no_grad():
        return apply_conversion(x, *state.CONVERSIONS[key]).clone()  # (preserve_format: a dense output's strides)


@tp_conversion.register_fake
def _tp_conversion_fake(x: torch.Tensor, key: str) -> torch.Tensor:
    out = apply_conversion(x.detach(), *state.CONVERSIONS[key])
    return out.new_empty_strided(out.shape, out.stride())


class TracedConversions:
    """``with TracedConversions():`` the conversions this thread's rewrite traces, registered under keys that
    name this scope (a conversion traced twice in it is one entry) and removed when it ends."""

    def __init__(self) -> None:
        self.prefix, self.keys, self.outer = f"{id(self):x}:", [], None

    def __enter__(self) -> TracedConversions:
        self.outer = getattr(state.TRACING, "conversions", None)
        state.TRACING.conversions = self
        return self

    def __exit__(self, *exc: object) -> None:
        state.TRACING.conversions = self.outer
        for key in self.keys:
            del state.CONVERSIONS[key]


def conversion(x: torch.Tensor, function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """``function.apply(x, *args)`` in a traced graph as a marker that :func:`bind_conversions` turns
    back into it. ``args``: plain values (group name, lengths, rank), which name the conversion."""
    scope = getattr(state.TRACING, "conversions", None)
    if scope is None:
        raise InternalError(f"dynashard: {function.__name__} traced outside a rewrite's TracedConversions")
    if _FUNCTIONS.get(function.__name__) is not function:
        raise InternalError(f"dynashard: conversion {function.__name__} is not in collectives._FUNCTIONS")
    key = scope.prefix + repr((function.__name__, args))
    if key not in state.CONVERSIONS:
        state.CONVERSIONS[key] = (function.__name__, *args)
        scope.keys.append(key)
    return torch.ops.dynashard.tp_conversion(x, key)


def apply_conversion(x: torch.Tensor, name: str, *args: Any) -> torch.Tensor:
    """What a bound marker node calls: the conversion named ``name`` (an autograd.Function below)."""
    return _FUNCTIONS[name].apply(x, *args)


class ConversionTracer(private.LeafCallsTracer):
    """The tracer that rebuilds a bound graph from its code when it is unpickled: each
    :func:`apply_conversion` call stays a node (a plain tracer traces into the Function's forward: its
    collectives inlined, its backward gone)."""

    leaves = (apply_conversion,)


def bind_conversions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each marker node calls its conversion (an autograd.Function, through :func:`apply_conversion`)
    instead, and the regathers are tagged (:func:`tag_regathers`)."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.dynashard.tp_conversion.default):
        node.target, node.args = apply_conversion, (node.args[0], *state.CONVERSIONS[node.args[1]])
    tag_regathers(gm)
    private.unpickled_by(gm, ConversionTracer)
    gm.recompile()
    return gm


def tag_regathers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A sequence_parallel colwise input's gather (``_GatherToShards``), and the layout ops after it up to
    the matmuls that read it, tagged to be recomputed in the backward (Megatron all-gathers it again there):
    AOTAutograd's partitioner then saves this rank's part, not the gathered whole. Run on a bound graph,
    after binding and after a compile-cache load (node meta does not survive pickling); a gather inside the
    user's checkpointed region keeps the region's tags."""
    from torch.utils.checkpoint import CheckpointPolicy

    gathers = [n for n in gm.graph.find_nodes(op="call_function", target=apply_conversion)
               if n.args[1] == _GatherToShards.__name__]
    for i, node in enumerate(gathers):
        if "recompute" in node.meta:
            continue
        todo = [node]
        while todo:
            n = todo.pop()
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = _REGATHER_GRAPH_ID + i
            todo += [u for u in n.users if u.target in _LAYOUT_OPS and "recompute" not in u.meta]
    return gm


class _CopyToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # (waited: run eagerly, funcol returns an AsyncCollectiveTensor, which would land in a .grad)
        with peer_guard(_group_named(ctx.group_name), BACKWARD):
            return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group_name)), None


class _ReduceFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: list[list[int]], rank: int, group_name: str,
                whole: tuple[int, ...]) -> torch.Tensor:
        ctx.lengths, ctx.rank, ctx.whole = lengths, rank, whole
        with torch.no_grad():
            return all_gather_last_dim(x, lengths, rank, group_name, frozenset(whole))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pieces, offset = [], 0
        for c, ls in enumerate(ctx.lengths):  # component by component: this rank's pieces of each
            if c in ctx.whole:  # held whole by every rank (computed alike on each): all of it
                pieces.append(grad.narrow(-1, offset, ls[ctx.rank]))
                offset += ls[ctx.rank]
                continue
            pieces.append(grad.narrow(-1, offset + sum(ls[: ctx.rank]), ls[ctx.rank]))
            offset += sum(ls)
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)), None, None, None, None


class _ReduceScatterToShards(torch.autograd.Function):
    """sequence_parallel's rowwise output: reduce_scatter forward; all_gather backward (each rank's
    gradient of its part of the sum is the gradient of every rank's partial sums there)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: list[int], rank: int, group_name: str, via_all_to_all: bool):
        ctx.lengths, ctx.rank, ctx.group_name = lengths, rank, group_name
        with torch.no_grad():
            return reduce_scatter_last_dim(x, lengths, rank, group_name, via_all_to_all)  # (waited inside)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with peer_guard(_group_named(ctx.group_name), BACKWARD):
            full = all_gather_last_dim(grad.contiguous(), [ctx.lengths], ctx.rank, ctx.group_name)
            return funcol.wait_tensor(full.contiguous()), None, None, None, None


class _GatherToShards(torch.autograd.Function):
    """sequence_parallel's colwise input: all_gather forward; reduce_scatter backward (each rank's
    gradient of the gathered value is its own features' contribution: summed, each keeps its part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: list[int], rank: int, group_name: str, via_all_to_all: bool):
        ctx.lengths, ctx.rank, ctx.group_name, ctx.via_all_to_all = lengths, rank, group_name, via_all_to_all
        with torch.no_grad():  # (not waited again: a wait of the gathered copy re-emitted the gather, measured)
            return all_gather_last_dim(x, [lengths], rank, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with peer_guard(_group_named(ctx.group_name), BACKWARD):
            part = reduce_scatter_last_dim(grad.contiguous(), ctx.lengths, ctx.rank, ctx.group_name, ctx.via_all_to_all)
            return part.contiguous(), None, None, None, None


BACKWARD = "the backward of the sharded program"
# name -> conversion, for apply_conversion (a bound graph's code names each conversion by its class's name)
_FUNCTIONS = {f.__name__: f for f in (_CopyToShards, _ReduceFromShards, _GatherFromShards, _ReduceScatterToShards,
                                      _GatherToShards)}


def _group_named(name: str) -> dist.ProcessGroup:
    return private.group_by_name(name)


def copy_to_shards(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return conversion(x, _CopyToShards, group_name)


def reduce_from_shards(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return conversion(x, _ReduceFromShards, group_name)


def gather_from_shards(
    x: torch.Tensor, lengths: list[list[int]], rank: int, group_name: str, whole: frozenset[int] = frozenset()
) -> torch.Tensor:
    return conversion(x, _GatherFromShards, [list(ls) for ls in lengths], rank, group_name, tuple(sorted(whole)))


def reduce_scatter_to_shards(x: torch.Tensor, lengths: list[int], rank: int, group_name: str,
                             via_all_to_all: bool) -> torch.Tensor:
    return conversion(x, _ReduceScatterToShards, list(lengths), rank, group_name, via_all_to_all)


def gather_to_shards(x: torch.Tensor, lengths: list[int], rank: int, group_name: str,
                     via_all_to_all: bool) -> torch.Tensor:
    return conversion(x, _GatherToShards, list(lengths), rank, group_name, via_all_to_all)


def group_name(group: dist.ProcessGroup) -> str:
    return group.group_name


def reduce_scatter_is_slow(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"
