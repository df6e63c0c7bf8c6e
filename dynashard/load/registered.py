"""A parallelized module's parameters: this rank's shards in its slots, the full-shape facades Dynamo reads.

Before: a module whose parameter slots hold the full weights. After :func:`register` (``parallelize``, once
its example run has cut them): each cut parameter's slot holds this rank's shard (``parameters()``,
``state_dict()`` and an optimizer see it), and ``module.__dict__[FACADES]`` the full-shape, storage-less facade,
answered for ``module.<attr>`` by a property of a subclass swapped onto the module (:func:`_swapped_class`, one
per class): Dynamo traces ``self.weight`` and sees global shapes. The subclass refuses a replaced shard and a
pickled module, and carries each facade through ``model.to(...)``. State-dict hooks keep DCP's checkpoint
protocol on the shards and take whole or this rank's own values on load, checked before anything is copied.

Invariants: a failed ``parallelize`` that cut nothing puts every module back (:func:`uninstall_all`); a load that
raises changes nothing (:func:`check_loads`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dynashard import _torch as private
from dynashard import state
from dynashard._torch.subclass import is_traceable_subclass
from dynashard.comm.transport import gather_pieces
from dynashard.errors import UsageError
from dynashard.layout.placement import check_loadable, words
from dynashard.layout.placement import of as placement_of
from dynashard.load import quantized_state
from dynashard.training import fsdp
from dynashard.weights.facades import storage_less
from dynashard.weights.store import STORE, cut

# module.__dict__ key: attribute name -> what Dynamo reads for it (a cut parameter's full-shape, storage-less
# facade; a parameter left whole, itself: facades() leaves those out)
FACADES = "_dynashard_facades"
_HANDLES = "_dynashard_hooks"  # module.__dict__ key: the hooks install registered (removed by uninstall_all)
_SWAPPED: dict[type, type] = {}  # a module class -> its subclass holding shards (_swapped_class)


def install_all(model: nn.Module) -> None:
    """Every parameter of ``model`` behind a facade entry before the example runs, each entry the parameter
    itself until the run cuts it: Dynamo's guards of that run read what they read once ``parallelize``
    returns (the swapped classes, the facades), so its cache entry serves the user's compile."""
    for module in model.modules():
        for attr, p in list(private.parameter_slots(module).items()):
            # (a quantized weight, a tensor subclass, keeps its slot: its inner tensors are what is cut)
            if p is not None and attr not in module.__dict__.get(FACADES, {}) and not is_traceable_subclass(p):
                install(module, attr, p)


def uninstall_all(model: nn.Module) -> None:
    """A failed ``parallelize`` that cut nothing: every module back to what it was (class, hooks, forward)."""
    for module in model.modules():
        if FACADES in module.__dict__:
            del module.__dict__[FACADES]
            for handle in module.__dict__.pop(_HANDLES, []):
                handle.remove()
        if getattr(type(module), "_dynashard_swapped", False) and type(module) in _SWAPPED.values():
            module.__class__ = type(module).__bases__[0]
    for module in model.modules():  # (the model's forward, and a PEFT model's base model's)
        restore = getattr(module.__dict__.get("forward"), "_dynashard_parallelized", None)
        if restore is not None:
            had, before = restore
            if had:
                module.forward = before
            else:
                del module.__dict__["forward"]


def facades(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s facades of what its slots hold in their place (a shard, a DTensor): the entries of the
    parameters left whole, which are the parameters themselves, left out."""
    slots = private.parameter_slots(module)
    return {attr: f for attr, f in module.__dict__.get(FACADES, {}).items() if slots.get(attr) is not f}


def parallelized(model: nn.Module) -> bool:
    return any(FACADES in m.__dict__ for m in model.modules())


def register(model: nn.Module) -> None:
    """Each sharded parameter's shard registered in its place (every owner of a tied weight), the
    full-shape parameter kept as the facade Dynamo reads."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in private.parameter_slots(module).items():
            if p is not None and STORE.is_sharded(p):
                owners.setdefault(id(p), []).append((module, attr))
    for entries in owners.values():
        facade = private.parameter_slots(entries[0][0])[entries[0][1]]
        shard = STORE.as_parameter(facade)
        for module, attr in entries:
            private.parameter_slots(module)[attr] = shard
            install(module, attr, facade)
    for module in model.modules():  # (a load into any of them checks all of its shards' values first)
        if any(FACADES in m.__dict__ for m in module.modules()) and not getattr(module, "_dynashard_checks", False):
            module.register_load_state_dict_pre_hook(_check_whole_load)
            module.__dict__["_dynashard_checks"] = True


def install(module: nn.Module, attr: str, facade: torch.Tensor) -> None:
    """``facade`` kept for ``module.<attr>`` (whose slot holds what the model trains: a shard, a DTensor),
    answered by a property of a subclass swapped onto the module."""
    if FACADES not in module.__dict__:
        module.__dict__[FACADES] = {}
        # state_dict() detaches each parameter, and a detached tensor loses the checkpoint
        # protocol: put it back, or DCP would save this rank's shard as the whole tensor
        module.__dict__[_HANDLES] = [module.register_state_dict_post_hook(_checkpointable_state)]
    module.__dict__[FACADES][attr] = facade
    cls = type(module)
    if not getattr(cls, "_dynashard_swapped", False):
        if cls not in _SWAPPED:  # (one subclass per class: its modules share it, and Dynamo's guards on it)
            _SWAPPED[cls] = _swapped_class(cls)
        module.__class__ = _SWAPPED[cls]
        module.__dict__[_HANDLES].append(module.register_load_state_dict_pre_hook(_full_size_into_shards))
    setattr(type(module), attr, _facade_property(attr))


def _checkpointable_state(module: nn.Module, state: dict, prefix: str, _metadata: Any) -> None:
    for attr, facade in facades(module).items():
        if prefix + attr in state and not _is_dtensor(state[prefix + attr]):
            state[prefix + attr] = STORE.checkpointable(facade, state[prefix + attr])
        elif prefix + attr in state:  # (DTensor: DCP's own protocol, but for a fused layout)
            fsdp.checkpointable(state[prefix + attr])


def _register_parameter(self, name: str, param) -> None:
    """A sharded parameter is not replaced (``module.weight = ...``, ``load_state_dict(assign=True)``):
    the compiled program reads the shard registered by ``parallelize``, so a new object would be
    ignored silently. A parameter left whole is replaced as in any module (Dynamo reads the new one)."""
    entries = self.__dict__.get(FACADES, {})
    if param is not None and param is private.parameter_slots(self).get(name):
        return  # (the parameter it holds, assigned again: PEFT's merge_and_unload hands a base layer its own)
    if name in entries and entries[name] is private.parameter_slots(self).get(name) and not _is_dtensor(param):
        entries[name] = param
        nn.Module.register_parameter(self, name, param)
        return
    facade = entries.get(name)
    if facade is not None and fsdp.is_live(facade) and _is_dtensor(param) and param.shape == facade.shape:
        fsdp.refuse_fused_dim(facade, param)  # (FSDP's 2-D shard of a fused weight)
        fsdp.checkpointable(param)  # (a fused one read by DCP from the module, not its state_dict)
        fsdp.follow(facade, param)  # (FSDP's MixedPrecisionPolicy: the gathered copy's dtype)
        nn.Module.register_parameter(self, name, param)  # FSDP2's swap of a dtensor=True parameter (sharded, gathered)
        return
    if name in self.__dict__.get(FACADES, {}) and _is_dtensor(param):  # (FSDP2's fully_shard swapping it)
        raise UsageError(
            f"dynashard: {type(self).__name__}.{name} is a shard registered by dynashard.parallelize, and a DTensor "
            "(FSDP2's fully_shard, or DTensor's parallelize_module) is replacing it. FSDP2 does not compose with "
            "plain shards. Expected parallelize(model, x, options={'group': mesh['tp']}, dtensor=True) before "
            "fully_shard(model, mesh=mesh['dp']) (the shards registered as DTensors on mesh['tp']), or data "
            "parallelism by DDP over mesh['dp'] (README, 'Several machines').")
    if name in self.__dict__.get(FACADES, {}):
        raise UsageError(
            f"dynashard: {type(self).__name__}.{name} is a shard registered by dynashard.parallelize and cannot be "
            "replaced by another parameter (the compiled model would keep reading the old one). Expected an "
            "in-place update: load_state_dict(..., assign=False), or param.data.copy_(...).")
    nn.Module.register_parameter(self, name, param)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _facade_property(attr: str) -> property:
    @private.never_a_frame  # (Dynamo tracing it alone would hand eager code the facade: compiling() is true)
    def get(self):
        facades = self.__dict__.get(FACADES, {})
        if attr not in facades:  # another instance of the class, whose parameter was not sharded
            return nn.Module.__getattr__(self, attr)
        facade = facades[attr]
        if not private.compiling() and (fsdp.is_live(facade) or getattr(state.MERGING, "on", False)):
            # dtensor=True: eager code (FSDP2) gets the DTensor; a merge of LoRA layers, the shards (adapters.merging)
            return private.parameter_slots(self)[attr]
        return facade  # (eager use of it is answered by the facade itself: facades.py)

    return property(get, doc=f"the full-shape facade of the sharded parameter {attr!r} (Dynamo reads it)")


def _swapped_class(cls: type) -> type:
    """``cls`` with what a module holding shards needs: a sharded parameter cannot be replaced, its
    facade follows the shard through ``model.to(...)``, and pickling the module is refused."""

    def _apply(self, fn, recurse=True):
        slots, entries = private.parameter_slots(self), self.__dict__.get(FACADES, {})
        whole = [attr for attr, entry in entries.items() if slots.get(attr) is entry]
        out = cls._apply(self, fn, recurse)
        for attr in whole:  # (a parameter left whole: its entry is what the slot holds now)
            entries[attr] = slots[attr]
        for attr, facade in facades(self).items():  # the shard converted: its facade follows
            shard = private.parameter_slots(self)[attr]
            if (facade.dtype, facade.device) != (shard.dtype, shard.device):
                with private.plain_torch_functions():
                    facade.data = storage_less(facade.shape, shard.dtype, shard.device)
        return out

    def __reduce_ex__(self, protocol):
        raise UsageError(
            f"dynashard: cannot copy this model or pickle it (copy.deepcopy, torch.save(model); a {cls.__name__} of it "
            + ("holds shards): dynashard.parallelize registered this rank's shards as its parameters" if facades(self)
               else "was parallelized: its parameters are what this model's compiled forward reads") +
            ". Expected a copy made before parallelize; to save, dcp.save(model.state_dict(), checkpoint_id=path) for "
            "the shards (loadable at any world size), or dynashard.export_safetensors(model, path) for the whole "
            "weights.")

    def __setattr__(self, name: str, value: Any) -> None:
        # (its own __setattr__, so FSDP2's fully_shard assigns parameters through it, not into _parameters
        # directly, and a sharded one reaches register_parameter's refusal)
        cls.__setattr__(self, name, value)

    body = {"__module__": cls.__module__, "register_parameter": _register_parameter, "_apply": _apply,
            "__reduce_ex__": __reduce_ex__, "__setattr__": __setattr__, "_dynashard_swapped": True}
    return type(cls.__name__, (cls,), body)


def _full_size_into_shards(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` into a parallelized module: each sharded parameter's value is checked first
    (whole, or this rank's own pieces: placement.check_loadable), then a full-size one (the unsharded
    model's, an RL trainer's, an EMA's) becomes this rank's pieces, which the load copies into the shard."""
    check_loads(module, state_dict, prefix, recurse=False)
    for attr, facade in facades(module).items():
        key = prefix + attr
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and list(value.shape) == list(facade.shape) and \
                value.shape != private.parameter_slots(module)[attr].shape:
            spec = STORE.spec_of(facade)
            state_dict[key] = cut(value, spec.dim, spec.split, spec.world, spec.rank)


def check_loads(module: nn.Module, state_dict: dict, prefix: str = "", recurse: bool = True, *_: Any) -> None:
    """Every value ``state_dict`` holds for a shard of ``module`` (and of its submodules, with ``recurse``)
    is whole or this rank's own pieces (placement.check_loadable), checked before anything is copied:
    a load that raises changes nothing."""
    modules = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
    for name, sub in modules:
        quantized_state.check(sub, state_dict, prefix + (f"{name}." if name else ""))  # (its inner tensors)
        for attr, facade in facades(sub).items():
            key = prefix + (f"{name}." if name else "") + attr
            value, shard = state_dict.get(key), private.parameter_slots(sub).get(attr)
            spec = STORE.spec_of(facade)
            if not isinstance(value, torch.Tensor) or _is_dtensor(value) or _is_dtensor(shard) or spec is None or \
                    spec.stacked:
                continue  # (DTensors: DTensor's own checks; weights="per_rank": every rank's own blocks)
            check_loadable(key, value, facade.shape, shard.shape, STORE.placement(facade))


def gather_whole(t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``t``, a tensor carrying the placement of this rank's pieces of a parallelized weight
    (a state_dict() value, an optimizer state): every rank's pieces gathered (a collective)."""
    facade = STORE.placed_facade(t)
    facade = STORE.facade_sharing_memory(t) if facade is None else facade
    entry = STORE.entry(facade) if facade is not None else None
    if entry is None:
        raise UsageError(f"dynashard: a full state dict was asked of a tensor holding {words(placement_of(t))}, "
                         "which belongs to no live parallelized model here (read from a file?): it cannot be "
                         "gathered. Expected the state dict of the parallelized model itself.")
    return gather_pieces(t.detach(), list(facade.shape), entry.spec, private.group_by_name(entry.spec.group_name))


def cut_to_pieces(full: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """This rank's pieces of ``full``, a whole value for ``local`` (a tensor carrying a placement)."""
    facade = STORE.placed_facade(local)
    facade = STORE.facade_sharing_memory(local) if facade is None else facade
    spec = STORE.spec_of(facade) if facade is not None else None
    if spec is None:
        raise UsageError(f"dynashard: a full state dict was loaded into a tensor holding {words(placement_of(local))} "
                         "that belongs to no live parallelized model here. Expected the parallelized model's own.")
    return STORE.checkpointable(facade, cut(full, spec.dim, spec.split, spec.world, spec.rank))


def _check_whole_load(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    if not prefix:  # (the module load_state_dict was called on: everything below it, before any copy)
        check_loads(module, state_dict, prefix)
