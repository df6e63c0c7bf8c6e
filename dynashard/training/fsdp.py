"""``parallelize(..., dtensor=True)``: the parameters as DTensors on the tp mesh, so FSDP2 composes.

FSDP2's ``fully_shard`` composes with tensor parallelism when every parameter it is given is a
DTensor on the tp mesh: it makes each a 2-D (dp x tp) DTensor, ``clip_grad_norm_`` then sums over
both dims, and DCP writes 2-D chunks (torchtitan's recipe: TP, then ``fully_shard`` over dp). So
each shard ``parallelize`` registered becomes ``DTensor.from_local(shard, mesh, [Shard(dim)])`` and
each parameter left whole a ``Replicate()`` one; every one of them keeps a full-shape, storage-less
facade, which the module's property returns to Dynamo (eager code, FSDP among it, gets the
parameter).

FSDP swaps the module's parameter for a copy it gathers over dp before every forward, so a compiled
program cannot keep the tensor it was given once: for each facade it reads the module's *current*
parameter, through ``to_local()`` (:func:`current`), and the gradient flows back into that
parameter, where FSDP reduce-scatters it. (The facades of the plain ``parallelize`` are read from
the shard store instead; docs/design.md, "FSDP2 x dynashard".)

Layouts registered so (:func:`placement`): torch.chunk's contiguous blocks (8 heads on 2 or 4
ranks), ``Shard(dim)``; equal fused components each cut in such blocks (nanoGPT's ``[q | k | v]``,
gate/up), ``_StridedShard(dim, k)``, which ``fully_shard`` must shard over dp on another dim
(:func:`fsdp_shard_placement`, checked when it swaps the parameter in: :func:`refuse_fused_dim`); a
1-D fused one (its bias) whole on tp, cut per call (:class:`_PiecesOf`). DCP reads a strided layout
as one chunk at the wrong offset, so such DTensors carry the protocol of the blocks they hold
(:func:`checkpointable`). Heads dealt unevenly (6 heads on 4 ranks as 2/2/1/1), parts kept whole and
``weights="per_rank"`` are refused, naming the plain recipe.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dynashard import _torch as private
from dynashard.comm.protocol import agreed
from dynashard.errors import UsageError
from dynashard.weights.facades import storage_less
from dynashard.weights.freed import free
from dynashard.weights.store import STORE

# full-shape facade -> its live parameter, kept by the store (STORE.live) that facades ask
_LIVE = STORE.live


def mesh_of(options: Any) -> Any:
    """The 1-D DeviceMesh ``dtensor=True`` registers the parameters on: ``options["group"]``."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = options.get("group") if isinstance(options, dict) else None
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        found = type(mesh).__name__ if not isinstance(mesh, DeviceMesh) else f"a {mesh.ndim}-D DeviceMesh"
        raise UsageError(
            "dynashard.parallelize(dtensor=True) registers the parameters as DTensors on the tensor-parallel mesh, "
            f"and needs that mesh as options={{'group': mesh['tp']}} (a 1-D DeviceMesh); found {found}. Expected "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), then "
            "parallelize(model, x, options={'group': mesh['tp']}, dtensor=True), then fully_shard(model, "
            "mesh=mesh['dp'], shard_placement_fn=dynashard.fsdp_shard_placement).")
    return mesh


def register(model: nn.Module, mesh: Any, group: dist.ProcessGroup, facades_key: str,
             install: Any) -> None:
    """Each parameter of ``model`` (already parallelized: shards registered, facades kept under
    ``module.__dict__[facades_key]``) as a DTensor on ``mesh``; ``install(module, attr, facade)``
    puts a facade and its property on a module whose parameter was left whole."""
    from torch.distributed.tensor import DTensor, Replicate

    with agreed(group, "registering the parameters as DTensors (parallelize(dtensor=True))"):
        _check_layouts(model, facades_key)
    made: dict[int, nn.Parameter] = {}  # (a tied parameter: one DTensor, one facade, every owner)
    for prefix, module in model.named_modules():
        facades = module.__dict__.get(facades_key, {})
        for attr, p in list(private.parameter_slots(module).items()):
            if p is None:
                continue
            if id(p) not in made:
                facade = facades.get(attr)
                cut_per_call = None
                if facade is not None:  # cut: the shard (parallelize's Parameter) is the local tensor
                    spec = STORE.spec_of(facade)
                    where = placement(spec, facade.shape)
                    if isinstance(where, Replicate):  # a 1-D fused cut: whole on tp, cut at every call
                        strided = private.strided_shard(spec.dim, len(spec.split.parts))
                        whole = DTensor.from_local(p.detach(), mesh, [strided], run_check=False, shape=facade.shape,
                                                   stride=facade.stride()).full_tensor()
                        cut_per_call = (spec.split.pieces(spec.world, spec.rank), mesh.get_group())
                    dt = (DTensor.from_local(whole, mesh, [where], run_check=False) if cut_per_call else
                          DTensor.from_local(p.detach(), mesh, [where], run_check=False, shape=facade.shape,
                                             stride=facade.stride()))
                else:  # whole: the parameter becomes the facade, its values move to the DTensor
                    facade = p
                    local = p.detach().clone(memory_format=torch.contiguous_format)
                    dt = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
                    STORE.trust([facade])  # (checked when parallelize ran; its bytes are about to go)
                    free([facade], keep=[])
                made[id(p)] = checkpointable(nn.Parameter(dt, requires_grad=p.requires_grad))
                fqn = f"{prefix}.{attr}" if prefix else attr
                _LIVE[facade] = (weakref.ref(module), attr, fqn, tuple(dt.to_local().shape), cut_per_call)
            new = made[id(p)]
            if attr not in facades:
                install(module, attr, p)  # (the whole parameter is its own facade; tied: one for every owner)
            private.parameter_slots(module)[attr] = new


def _check_layouts(model: nn.Module, facades_key: str) -> None:
    """Every cut is one a DTensor placement describes (:func:`placement`)."""
    bad = []
    for name, module in model.named_modules():
        for attr, facade in module.__dict__.get(facades_key, {}).items():
            if placement(STORE.spec_of(facade), facade.shape) is None:
                bad.append(f"{name}.{attr}" if name else attr)
    if bad:
        raise UsageError(
            f"dynashard.parallelize(dtensor=True): {bad[:3]} are cut in a layout no DTensor placement describes "
            "(heads dealt unevenly; fused components of unequal sizes, or not divisible by the tensor-parallel size; "
            "parts kept whole; weights='per_rank'). Expected head counts divisible by the tensor-parallel size, or "
            "dtensor=False with DDP over mesh['dp'] (README, 'Several machines').")


def placement(spec: Any, shape: torch.Size) -> Any:
    """The DTensor placement of this rank's cut on the tp mesh, or None.

    ``Shard(dim)``: torch.chunk's block of the dim. ``_StridedShard(dim, k)``: k equal components side by
    side (nanoGPT's ``[q | k | v]``, gate/up), each cut in torch.chunk's blocks, a rank holding its block of
    each. Under FSDP2 such a weight must be sharded over dp on another dim: on the same one, the 2-D
    ``(_StridedShard(0, sf=2), _StridedShard(0, sf=3))`` FSDP makes reads back wrong through
    ``full_tensor()`` (measured, torch 2.13, 2x2 gloo: the parameters 0.25 off the twin's); with
    ``(Shard(1), _StridedShard(0, 3))`` it reads back right (measured, tools/proto_fused_fsdp2.py).
    ``Replicate()``: a 1-D fused tensor (a bias has no other dim for dp), held whole on tp and cut at
    every call (:class:`_PiecesOf`)."""
    from torch.distributed.tensor import Replicate, Shard

    if spec.stacked or spec.split.whole or spec.split.deals is not None:
        return None
    k, n = len(spec.split.parts), shape[spec.dim]
    if k > 1 and (len(set(spec.split.parts)) != 1 or spec.split.size != n or n % (k * spec.world)):
        return None
    part = n // k
    start, length = _block(part, spec.world, spec.rank)
    if spec.split.pieces(spec.world, spec.rank) != [(i * part + start, length) for i in range(k)]:
        return None
    if k == 1:
        return Shard(spec.dim)
    return Replicate() if len(shape) == 1 else private.strided_shard(spec.dim, k)


def _block(n: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of torch.chunk's block ``rank`` of ``n`` (DTensor's ``Shard``)."""
    block = -(-n // world)
    start = min(n, rank * block)
    return start, min(block, n - start)


def fsdp_shard_placement(param: Any) -> Any:
    """``fully_shard(..., shard_placement_fn=dynashard.fsdp_shard_placement)``: a fused weight
    (``_StridedShard`` on tp) sharded over dp on its first other dim, ``Shard(1)`` for a fused
    ``[3E, E]`` (on its fused dim no DTensor placement describes the 2-D layout: :func:`placement`);
    every other parameter FSDP's default, ``Shard(0)``."""
    from torch.distributed.tensor import Shard

    fused = {p.dim for p in getattr(param, "placements", ()) if private.is_strided_shard(p)}
    return Shard(next(d for d in range(param.ndim) if d not in fused)) if fused else None


def refuse_fused_dim(facade: torch.Tensor, param: Any) -> None:
    """FSDP2 swapping in its 2-D shard of a fused weight sharded over dp on the fused dim: refused."""
    placements = param.placements
    fused = {p.dim for p in placements[-1:] if private.is_strided_shard(p)}
    if len(placements) > 1 and any(_shards(p) and p.dim in fused for p in placements[:-1]):
        raise UsageError(
            f"dynashard: {_LIVE[facade][2]!r} is a fused weight (such as [q | k | v] or gate/up) cut per "
            f"component over tp, and fully_shard shards it over dp on the same dim ({placements}), a layout no "
            "DTensor placement describes: full_tensor() and checkpoints would read it wrong. Expected "
            "fully_shard(module, mesh=mesh['dp'], shard_placement_fn=dynashard.fsdp_shard_placement) at every "
            "fully_shard call (it shards fused weights over dp on another dim).")


def checkpointable(value: Any) -> Any:
    """A DTensor with a ``_StridedShard`` (a fused layout) saved and loaded by DCP at its true offsets: its
    local tensor gets the protocol of the blocks it holds (``dcp_planners.make_checkpointable_blocks``). DCP's
    own reads it as one chunk at the wrong offset (measured, torch 2.13: ``dcp.save`` refuses "overlapping
    chunks", ``dcp.load`` fills it with other rows, silently)."""
    from torch.distributed.tensor import DTensor

    from dynashard.weights.dcp_planners import make_checkpointable_blocks  # lazy: imports DCP, only to checkpoint

    if not isinstance(value, DTensor) or not is_fused(value):
        return value
    local = private.dtensor_local(value)
    if not hasattr(local, "__create_chunk_list__"):
        make_checkpointable_blocks(local, value.shape, held_ranges(value))
    return value


def _shards(p: Any) -> bool:
    return p.is_shard() or private.is_strided_shard(p)  # (a _StridedShard is not a Shard: is_shard() is False)


def is_fused(t: Any) -> bool:
    """A DTensor of a fused layout: a ``_StridedShard`` on a dim no other mesh dim shards (FSDP2's own
    ``_StridedShard(0, tp)`` over dp, beside the tp ``Shard(0)`` of a colwise weight, is not one: DCP reads
    that right)."""
    placements = getattr(t, "placements", ())
    return any(private.is_strided_shard(p) and sum(_shards(q) and q.dim == p.dim for q in placements) == 1
               for p in placements)


def held_ranges(dt: Any) -> list[list[tuple[int, int]]]:
    """Per dim, the ``(global start, length)`` ranges a DTensor's local tensor holds, side by side, for
    placements that shard each dim over one mesh dim at most (``Shard``, ``_StridedShard``, ``Replicate``)."""
    mesh, coordinate = dt.device_mesh, dt.device_mesh.get_coordinate()
    runs = [[(0, n)] for n in dt.shape]
    sharded: set[int] = set()
    for m, p in enumerate(dt.placements):
        if not _shards(p):
            continue
        if p.dim in sharded:
            raise UsageError(f"dynashard: a DTensor of placements {dt.placements} shards dim {p.dim} over two mesh "
                             "dims together with a fused (_StridedShard) one; expected one mesh dim per tensor dim.")
        sharded.add(p.dim)
        k = p.split_factor if private.is_strided_shard(p) else 1
        part = dt.shape[p.dim] // k
        start, length = _block(part, mesh.size(m), coordinate[m])
        runs[p.dim] = [(i * part + start, length) for i in range(k)]
    local = private.dtensor_local(dt)
    assert [sum(n for _, n in r) for r in runs] == list(local.shape), (dt.placements, runs, local.shape)
    return runs


def is_live(t: Any) -> bool:
    return STORE.is_live(t)


def live_slots(inputs: list[Any]) -> frozenset[int]:
    """The input slots of a graph that hold facades of ``dtensor=True`` parameters."""
    if not len(_LIVE):
        return frozenset()
    return frozenset(i for i, t in enumerate(inputs) if is_live(t))


def compile_owners(model: nn.Module, facades_key: str, backend: Any) -> None:
    """Each module holding ``dtensor=True`` parameters itself (a linear, an embedding, a norm) gets its
    forward compiled with the dynashard backend, so that it runs sharded when eager code calls it.

    Why: ``fully_shard`` on each block as well as the root (torchtitan's way, one block gathered at a
    time) makes Dynamo break the graph at every block's FSDP hooks (torch 2.13 does not trace them), and
    a break inside the model's loop over its blocks makes Dynamo run that forward eagerly: its blocks are
    then compiled as frames of their own, but the modules it calls directly (the embedding, the final
    norm, the head) would run eagerly on DTensor parameters, which DTensor refuses ("got mixed
    torch.Tensor and DTensor"). Compiled each on its own, they run as small sharded graphs. Inside a
    traced frame (a block's, a whole model's) Dynamo inlines them: nothing changes there. (The model's
    own forward already runs through dynashard: parameters._run_calls_through_dynashard.)"""
    for module in model.modules():
        if module is not model and any(is_live(f) for f in module.__dict__.get(facades_key, {}).values()):
            module.forward = torch.compile(module.forward, backend=backend)


def refuse_strays(gm: torch.fx.GraphModule, inputs: list[Any]) -> None:
    """A ``dtensor=True`` facade reaching a graph other than as its module's attribute (an argument of a
    frame Dynamo resumed after a graph break; measured with ``fully_shard`` on each block before
    :func:`compile_owners`, where Dynamo traced the facade's own ``__torch_function__`` alone). Such a
    graph cannot tell which module's current parameter to read: refused."""
    slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
    stray = [private.placeholder_source_name(slots[i]) or slots[i].name for i in live_slots(inputs)
             if private.placeholder_source_fqn(slots[i]) is None]
    if stray:
        raise UsageError(
            f"dynashard: graph inputs {stray[:3]} are parameters of parallelize(dtensor=True) that reach this graph "
            "as values, not as a module's attributes (Dynamo broke the graph around them), so it cannot read the "
            "module's current parameter (FSDP2 swaps it every forward). Expected each parameter read by the "
            "module that holds it (module.weight inside its forward); torch.compile(..., fullgraph=True) names "
            "the graph break.")


def current(facade: torch.Tensor) -> torch.Tensor:
    """The module's current parameter for ``facade``, as this rank's local tensor (differentiable: its
    gradient lands in the parameter, FSDP's gathered copy under FSDP2)."""
    ref, attr, fqn, local_shape, cut_per_call = _LIVE[facade]
    module = ref()
    param = None if module is None else private.parameter_slots(module).get(attr)
    if param is None:
        raise UsageError(f"dynashard: the module holding {fqn!r} was deleted or the parameter removed; expected "
                         "the parallelized model alive while its compiled program runs.")
    local = param.to_local() if hasattr(param, "to_local") else param
    if tuple(local.shape) != local_shape:
        raise UsageError(
            f"dynashard: {fqn!r} holds a local tensor of shape {list(local.shape)}, and the "
            f"compiled program expects this rank's tensor-parallel part, {list(local_shape)}. Under FSDP2 the "
            "module must be called as the model's own forward (FSDP gathers its parameters before it); expected "
            "fully_shard on the module the compiled forward belongs to, or on a parent it is called from.")
    if local.dtype != facade.dtype:  # (a compiled kernel reading another dtype's bytes would compute garbage)
        raise UsageError(
            f"dynashard: {fqn!r} is {local.dtype} at this call, and the graph was compiled for {facade.dtype} (the "
            "parameter was cast outside dynashard's sight, not by model.to() or FSDP2's MixedPrecisionPolicy, which "
            "the facade follows). Expected the model converted with model.to(dtype), or torch.autocast.")
    return local if cut_per_call is None else _PiecesOf.apply(local, *cut_per_call)


class _PiecesOf(torch.autograd.Function):
    """This rank's pieces of a 1-D tensor every tp rank holds whole (a fused bias). Backward: the pieces'
    gradient in place in a zero tensor, summed over tp, so every rank holds the whole gradient (each element's
    from the one rank that used it), as a ``Replicate()`` parameter's gradient must be."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, pieces: list[tuple[int, int]], group: Any) -> torch.Tensor:
        ctx.pieces, ctx.group, ctx.size = pieces, group, whole.shape[0]
        return torch.cat([whole.narrow(0, start, length) for start, length in pieces])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        whole, at = grad.new_zeros(ctx.size), 0
        for start, length in ctx.pieces:
            whole.narrow(0, start, length).copy_(grad.narrow(0, at, length))
            at += length
        dist.all_reduce(whole, group=ctx.group)
        return whole, None, None


def follow(facade: torch.Tensor, param: torch.Tensor) -> None:
    """FSDP2 put ``param`` in the facade's slot: when it is the gathered tp parameter (a DTensor on the 1-D tp
    mesh, not FSDP's 2-D shard) in another dtype, FSDP's ``MixedPrecisionPolicy(param_dtype=...)`` cast it,
    and the facade takes that dtype, so Dynamo (guarding on it) compiles the forward for what it will read."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or mesh.ndim != 1 or param.dtype == facade.dtype:
        return
    with private.plain_torch_functions():
        facade.data = storage_less(facade.shape, param.dtype, facade.device)


class ReadLive:
    """A compiled graph left whole whose inputs include ``dtensor=True`` facades: each call passes the
    current parameters' local tensors in their place."""

    def __init__(self, compiled: Any, slots: frozenset[int]) -> None:
        self.compiled, self.slots = compiled, slots

    def __call__(self, *args: Any) -> Any:
        args = list(args)
        for i in self.slots:
            if is_live(args[i]):
                args[i] = current(args[i])
        return self.compiled(*args)
