"""Shards as first-class parameters: ``dynashard.parallelize``.

Before: a model whose every rank holds all of every weight; compiling it shards the weights into a
private store at the first call (``weights.STORE``), where nothing else can see them.
After ``parallelize(model, *example_args)``:

- each planned weight's shard on this rank is the module's parameter: ``parameters()``,
  ``named_parameters()``, ``state_dict()`` and an optimizer built afterwards see the shards;
- the original full-shape parameter stays as a storage-less *facade* in
  ``module.__dict__[FACADES]``, returned by a property of a subclass swapped onto the module, so
  Dynamo (which traces ``self.weight``) still sees global shapes and guards on them, and the
  compiled program finds the shard by the facade, as for any compiled model;
- each shard carries DCP's checkpoint protocol (its pieces as chunks of the global tensor), so
  ``dcp.save(model.state_dict(), ...)`` writes every layout dynashard cuts at its global offsets.

How: the model runs once on the example inputs through the dynashard backend itself (``compiler=
"eager"``: planning, cross-rank agreement, rewriting and cutting are the compile path's, so the
plan is the one a later ``torch.compile(model, backend="dynashard", options=...)`` makes); then the
shards the store holds for the model's parameters are registered. A later compile whose plan
differs raises, naming the layer (the store refuses a second, different cut of a freed weight).

Calling the model outside ``torch.compile`` reads a facade eagerly, which raises a clear error
naming the fix (its storage is gone; before, torch's "setStorage ... size 0").
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dynashard.dynamo_backend import dynashard_backend
from dynashard.errors import UsageError
from dynashard.options import parse_options
from dynashard.weights import STORE

FACADES = "_dynashard_facades"  # module.__dict__ key: attribute name -> full-shape, storage-less tensor


def parallelize(model: nn.Module, *args: Any, options: Any = None, **kwargs: Any) -> nn.Module:
    """Plan ``model`` as ``torch.compile(model, backend="dynashard", options=options)`` would for
    these example inputs, cut every planned weight and register the shards as its parameters.
    Returns ``model``. Every rank of the group must call it, with the same model and inputs."""
    opts = parse_options(options)
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("dynashard.parallelize: no process group is initialized. Expected "
                         "torch.distributed.init_process_group(...) on every rank first (torchrun).")
    if _parallelized(model):
        raise UsageError("dynashard.parallelize: this model is already parallelized; expected one call per model.")
    sharded = [n for n, p in model.named_parameters() if STORE.is_sharded(p)]
    if sharded:
        raise UsageError(f"dynashard.parallelize: {sharded[:3]} were already sharded by a dynashard compile of "
                         "this model. Expected parallelize before any torch.compile of it.")
    if opts.weights != "replicated":
        raise UsageError(f"dynashard.parallelize: weights={opts.weights!r} is not supported yet; expected the "
                         "default weights='replicated' (every rank holds the same model before parallelize).")
    run_options = dataclasses.replace(opts, compiler="eager")  # the plan does not depend on the compiler

    def dynashard_parallelize(gm, example_inputs):
        return dynashard_backend(gm, example_inputs, run_options)

    # A fresh code object per call: Dynamo's cache for it never fills, and the program compiled
    # here (eager, thrown away) never serves the user's own compile.
    run = types.FunctionType(_run.__code__.replace(), {"__builtins__": __builtins__})
    try:
        with torch.no_grad():
            torch.compile(run, backend=dynashard_parallelize, dynamic=False)(model, args, kwargs)
    except Exception as e:
        cut = [n for n, p in model.named_parameters() if STORE.is_sharded(p)]
        if not cut:
            raise  # nothing was cut: the model is as it was
        # A graph before a graph break was sharded (its full weights freed) before the error: keep
        # the model usable with what was cut, and say so.
        _register(model)
        raise UsageError(
            f"dynashard.parallelize: running the example failed ({type(e).__name__}: {e}) after {len(cut)} "
            f"weight(s) had been sharded (e.g. {cut[0]!r}); their full values are gone, and the model now holds "
            "this rank's shards of them. Fix the error, then compile with torch.compile(model, backend='dynashard') "
            "and the same options (or rebuild the model).") from e
    _register(model)
    return model


def _run(model, args, kwargs):
    return model(*args, **kwargs)


def _parallelized(model: nn.Module) -> bool:
    return any(FACADES in m.__dict__ for m in model.modules())


def _register(model: nn.Module) -> None:
    """Each sharded parameter's shard registered in its place (every owner of a tied weight), the
    full-shape parameter kept as the facade Dynamo reads."""
    swapped: dict[type, type] = {}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None and STORE.is_sharded(p):
                owners.setdefault(id(p), []).append((module, attr))
    for entries in owners.values():
        facade = entries[0][0]._parameters[entries[0][1]]
        if FACADES in entries[0][0].__dict__ and facade is entries[0][0].__dict__[FACADES].get(entries[0][1]):
            continue  # registered before (a failed call registered what it had cut)
        shard = STORE.as_parameter(facade)
        for module, attr in entries:
            module._parameters[attr] = shard
            if FACADES not in module.__dict__:
                module.__dict__[FACADES] = {}
                # state_dict() detaches each parameter, and a detached tensor loses the checkpoint
                # protocol: put it back, or DCP would save this rank's shard as the whole tensor
                module.register_state_dict_post_hook(_checkpointable_state)
            module.__dict__[FACADES][attr] = facade
            cls = type(module)
            if cls not in swapped.values():
                body = {"__module__": cls.__module__, "register_parameter": _register_parameter}
                new = swapped.setdefault(cls, type(cls.__name__, (cls,), body))
                module.__class__ = new
            setattr(type(module), attr, _facade_property(attr))


def _checkpointable_state(module: nn.Module, state: dict, prefix: str, _metadata: Any) -> None:
    for attr, facade in module.__dict__[FACADES].items():
        if prefix + attr in state:
            state[prefix + attr] = STORE.checkpointable(facade, state[prefix + attr])


def _register_parameter(self, name: str, param) -> None:
    """A sharded parameter is not replaced (``module.weight = ...``, ``load_state_dict(assign=True)``):
    the compiled program reads the shard registered by ``parallelize``, so a new object would be
    ignored silently."""
    if name in self.__dict__.get(FACADES, {}):
        raise UsageError(
            f"dynashard: {type(self).__name__}.{name} is a shard registered by dynashard.parallelize and cannot be "
            "replaced by another parameter (the compiled model would keep reading the old one). Expected an "
            "in-place update: load_state_dict(..., assign=False), or param.data.copy_(...).")
    nn.Module.register_parameter(self, name, param)


def _in_module_call() -> bool:
    """Whether a module's ``__call__`` is on the stack: a forward running eagerly."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            return True
        frame = frame.f_back
    return False


_CALL_IMPL = nn.Module._call_impl.__code__


def _facade_property(attr: str) -> property:
    def get(self):
        facades = self.__dict__.get(FACADES, {})
        if attr not in facades:  # another instance of the class, whose parameter was not sharded
            return nn.Module.__getattr__(self, attr)
        if not torch.compiler.is_compiling() and _in_module_call():
            # (outside a forward -- get_parameter(), DCP's FQN walk, hasattr -- the facade is returned:
            # full-shape metadata, no storage; reading its values fails loudly)
            raise UsageError(
                f"dynashard: {type(self).__name__}.{attr} was sharded by dynashard.parallelize; this rank holds "
                f"only its shard (model.named_parameters() lists it), so the module cannot run outside the "
                "compiled model. Expected calls through torch.compile(model, backend='dynashard') with the "
                "options parallelize was given.")
        return facades[attr]

    return property(get, doc=f"the full-shape facade of the sharded parameter {attr!r} (Dynamo reads it)")
