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

Only layouts ``Shard(dim)`` describes are registered so: torch.chunk's contiguous blocks (8 heads
on 2 or 4 ranks). Heads dealt unevenly (6 heads on 4 ranks as 2/2/1/1), fused components cut one by
one (:func:`placement` says why) and ``weights="per_rank"`` are refused, naming the plain recipe.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dynashard import _torch_private as private
from dynashard.errors import UsageError
from dynashard.facades import storage_less
from dynashard.protocol import agreed
from dynashard.weights import STORE

# full-shape facade -> (weak reference to the module holding the live parameter, its attribute, its FQN, the
# local shape every call must find: a parameter FSDP has not gathered yet has another)
_LIVE = private.weak_id_dict()


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
            "mesh=mesh['dp']).")
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
                if facade is not None:  # cut: the shard (parallelize's Parameter) is the local tensor
                    spec = STORE.spec_of(facade)
                    dt = DTensor.from_local(p.detach(), mesh, [placement(spec, facade.shape)], run_check=False,
                                            shape=facade.shape, stride=facade.stride())
                else:  # whole: the parameter becomes the facade, its values move to the DTensor
                    facade = p
                    local = p.detach().clone(memory_format=torch.contiguous_format)
                    dt = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
                    STORE.trust([facade])  # (checked when parallelize ran; its bytes are about to go)
                    STORE.free([facade], keep=[])
                made[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
                fqn = f"{prefix}.{attr}" if prefix else attr
                _LIVE[facade] = (weakref.ref(module), attr, fqn, tuple(dt.to_local().shape))
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
            "(fused components cut one by one, such as a fused q/k/v or gate/up; heads dealt unevenly; parts kept "
            "whole; weights='per_rank'). Expected separate projections and head counts divisible by the "
            "tensor-parallel size, or dtensor=False with DDP over mesh['dp'] (README, 'Several machines').")


def placement(spec: Any, shape: torch.Size) -> Any:
    """The DTensor placement of this rank's cut, ``Shard(dim)`` for torch.chunk's block of the dim, or None.

    Fused equal components (nanoGPT's ``[q | k | v]``) have one too, ``_StridedShard(dim, split_factor=3)``,
    and a 1-D DTensor with it gathers right; but under FSDP2 (measured, torch 2.13, 2x2 gloo, nanoGPT) the
    2-D ``(_StridedShard(0, sf=2), _StridedShard(0, sf=3))`` it makes of it reads back wrong through
    ``full_tensor()`` (the parameters 0.25 off the twin's while the gradient norms agreed), so a checkpoint
    of it would be wrong without a word, and DCP refuses strided chunks anyway: refused."""
    from torch.distributed.tensor import Shard

    if spec.stacked or spec.split.whole or spec.split.deals is not None or len(spec.split.parts) != 1:
        return None
    n = shape[spec.dim]
    block = -(-n // spec.world)
    start = min(n, spec.rank * block)
    if spec.split.pieces(spec.world, spec.rank) != [(start, min(block, n - start))]:
        return None
    return Shard(spec.dim)


def is_live(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t in _LIVE


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
    ref, attr, fqn, local_shape = _LIVE[facade]
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
    return local


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
