"""A parallelized model's quantized weights in its state dict: one entry per inner tensor, so DCP saves them.

Before: after ``parallelize``, a torchao weight (``Int8Tensor``: ``qdata [out, in]``, ``scale [out, 1]``) keeps its
module slot, and its cut inner tensors are storage-less facades whose values are this rank's shards (the store
holds them). ``state_dict()`` hands DCP the subclass whole: ``dcp.save`` pickles it, reads the freed ``qdata``
and fails on every rank after some files are written.
After (:func:`install`): ``state_dict()`` holds, for each such weight, one plain tensor per inner tensor, named
``<module>.<attr>.<inner>`` (``q_proj.weight.qdata``: the name ``get_state_dict`` resolves by attribute)::

    q_proj.weight              Int8Tensor [64, 64]        ->  q_proj.weight.qdata   shard [32, 64], DCP chunks
                                                              q_proj.weight.scale   [64, 1] (whole: held whole)
                                                              q_proj.weight.zero_point ...

each cut one this rank's shard with DCP's protocol (its chunks of the global tensor, as a plain weight's), each
whole one the tensor itself. ``dcp.load(..., planner=dynashard.LoadPlanner())`` reads into them in place, at any
world size; ``load_state_dict`` (``set_state_dict``) copies such entries into the shards (a whole value cut to
this rank's pieces, a piece checked to be this rank's) and does not ask for the subclass's own key.

Invariants: every value is checked before any is copied, every module's before any module's (``check``,
run by ``registered.check_loads``): a load that raises changes nothing; the subclass
object and its quantization (class, block size) are never replaced: a checkpoint holds integers and scales
only, so it loads into a model quantized as the saved one was (as a ``save_pretrained`` directory does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dynashard import _torch as private
from dynashard._torch.subclass import is_traceable_subclass
from dynashard.errors import UsageError
from dynashard.layout.placement import check_loadable
from dynashard.weights.store import STORE, cut

_DONE = "_dynashard_quantized_loaded"  # module.__dict__ key: the subclass keys a load filled through their inners


def quantized_slots(module: nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``{attr: [(inner name, inner tensor), ...]}`` of ``module``'s quantized (torchao subclass) parameters."""
    out = {}
    for attr, p in private.parameter_slots(module).items():
        if p is not None and is_traceable_subclass(p):
            names, _ = p.__tensor_flatten__()
            out[attr] = [(n, getattr(p, n)) for n in names]
    return out


def install(model: nn.Module) -> None:
    """Every module of ``model`` holding a quantized parameter saves and loads it as its inner tensors (the
    module docstring); one held whole too (an ``lm_head`` the plan leaves whole: DCP cannot plan a subclass
    torchao does not give ``is_pinned``)."""
    for module in model.modules():
        if quantized_slots(module):
            module.register_state_dict_post_hook(_flattened_state)
            module.register_load_state_dict_pre_hook(_inner_into_shards)
            module.register_load_state_dict_post_hook(_subclass_keys_loaded)


def _value(t: torch.Tensor) -> torch.Tensor:
    """What the state dict holds for inner tensor ``t``: its shard, checkpointable, or ``t`` itself."""
    return STORE.checkpointable(t, STORE.shard_of(t)) if STORE.is_sharded(t) else t


def _flattened_state(module: nn.Module, state: dict, prefix: str, _metadata: Any) -> None:
    for attr, inner in quantized_slots(module).items():
        if state.pop(prefix + attr, None) is not None:
            for name, t in inner:
                state[f"{prefix}{attr}.{name}"] = _value(t)


def check(module: nn.Module, state: dict, prefix: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], set[str]]:
    """``state``'s entries for ``module``'s quantized weights' inner tensors, each checked (raises, changing
    nothing): ``([(tensor to fill, value), ...], the subclass keys they fill)``. A weight with some of its
    inner tensors in ``state`` and not all is refused: loading its integers without their scales (or the
    reverse) would compute with a mix of two checkpoints. ``registered.check_loads`` runs this for every
    module before any is loaded."""
    copies, done = [], set()
    for attr, inner in quantized_slots(module).items():
        keys = [f"{prefix}{attr}.{name}" for name, _ in inner]
        present = [isinstance(state.get(k), torch.Tensor) for k in keys]
        if not any(present):
            continue  # (none: load_state_dict reports the subclass's own key as missing)
        if not all(present):
            missing = [k for k, here in zip(keys, present) if not here]
            raise UsageError(f"dynashard: load_state_dict of the quantized weight {prefix + attr!r}: the state dict "
                             f"holds some of its inner tensors and not {missing}. Expected all of "
                             f"{[k.removeprefix(prefix) for k in keys]} (a state dict of a model quantized the same "
                             "way). Nothing was loaded.")
        for key, (_, t) in zip(keys, inner):
            value = state[key]
            target = STORE.shard_of(t) if STORE.is_sharded(t) else t
            if value is target:
                continue  # (dcp.load filled the state dict's own values in place)
            if STORE.is_sharded(t):
                check_loadable(key, value, t.shape, target.shape, STORE.placement(t))
                if list(value.shape) == list(t.shape) and value.shape != target.shape:
                    spec = STORE.spec_of(t)
                    value = cut(value, spec.dim, spec.split, spec.world, spec.rank)
            elif value.shape != target.shape:
                raise UsageError(f"dynashard: load_state_dict of {key!r}: expected shape {list(target.shape)}, found "
                                 f"{list(value.shape)}. Nothing was loaded.")
            copies.append((target, value))
        done.add(prefix + attr)
    return copies, done


def _inner_into_shards(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
    """Each inner tensor's entry checked (all before any copy), then copied into the shard or the tensor."""
    copies, done = check(module, state, prefix)
    for attr, inner in quantized_slots(module).items():
        for name, _ in inner:
            state.pop(f"{prefix}{attr}.{name}", None)
    with torch.no_grad():
        for target, value in copies:
            target.copy_(value)
    module.__dict__[_DONE] = done


def _subclass_keys_loaded(module: nn.Module, incompatible: Any) -> None:
    """The subclass keys loaded through their inner tensors are not missing (``strict=True``)."""
    done = module.__dict__.pop(_DONE, set())
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in done]
