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

import contextlib
import dataclasses
import sys
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dynashard import _torch_private as private
from dynashard.dynamo_backend import dynashard_backend
from dynashard.errors import UsageError
from dynashard.options import parse_options
from dynashard.weights import STORE, _refuse_copy

FACADES = "_dynashard_facades"  # module.__dict__ key: attribute name -> full-shape, storage-less tensor


def parallelize(model: nn.Module, *args: Any, options: Any = None, checkpoint: Any = None, **kwargs: Any
                ) -> nn.Module:
    """Plan ``model`` as ``torch.compile(model, backend="dynashard", options=options)`` would for
    these example inputs, cut every planned weight and register the shards as its parameters.
    With ``checkpoint`` (a path: safetensors file, directory or HF index, or a DCP directory) the
    model is one built on the meta device, and each rank reads only its pieces of each weight (and
    the weights left whole) from it. Returns ``model``. Every rank of the group must call it, with
    the same model and inputs."""
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
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if checkpoint is None and on_meta:
        raise UsageError(f"dynashard.parallelize: {on_meta[:3]} are on the meta device and no checkpoint= was given; "
                         "expected checkpoint=PATH to read this rank's slices from (or a model with real weights).")
    source = _Loader(model, checkpoint, _device_of(args, kwargs)) if checkpoint is not None else None
    run_options = dataclasses.replace(opts, compiler="eager")  # the plan does not depend on the compiler

    def dynashard_parallelize(gm, example_inputs):
        return dynashard_backend(gm, example_inputs, run_options)

    # A fresh code object per call: Dynamo's cache for it never fills, and the program compiled
    # here (eager, thrown away) never serves the user's own compile.
    run = types.FunctionType(_run.__code__.replace(), {"__builtins__": __builtins__})
    if source is not None:
        source.make_facades()
    STORE.source = source
    try:
        with torch.no_grad():
            torch.compile(run, backend=dynashard_parallelize, dynamic=False)(model, args, kwargs)
        STORE.materialize([p for p in model.parameters()])  # read by no graph (eager code): whole
    except Exception as e:
        cut = [n for n, p in model.named_parameters() if STORE.is_sharded(p)]
        if not cut:
            if source is not None:
                source.restore()
            raise  # nothing was cut: the model is as it was
        # A graph before a graph break was sharded (its full weights freed) before the error: keep
        # the model usable with what was cut, and say so.
        _register(model)
        raise UsageError(
            f"dynashard.parallelize: running the example failed ({type(e).__name__}: {e}) after {len(cut)} "
            f"weight(s) had been sharded (e.g. {cut[0]!r}); their full values are gone, and the model now holds "
            "this rank's shards of them. Fix the error, then compile with torch.compile(model, backend='dynashard') "
            "and the same options (or rebuild the model).") from e
    finally:
        STORE.source = None
    _register(model)
    return model


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


class _Loader:
    """Values for a meta model's parameters from a checkpoint: checked against the model before
    anything changes, then read a piece at a time (``STORE.source``)."""

    def __init__(self, model: nn.Module, path: Any, device: torch.device) -> None:
        from dynashard.checkpoint import open_checkpoint

        self.model, self.device, self.ck = model, device, open_checkpoint(path)
        real = [n for n, p in model.named_parameters() if not p.is_meta]
        if real:
            raise UsageError(f"dynashard.parallelize: checkpoint= expects a model built on the meta device (with "
                             f"torch.device('meta') or dynashard.empty_weights()); {real[:3]} hold real weights. "
                             "Build it on meta, or drop checkpoint= to shard the weights it holds.")
        persistent = set(model.state_dict().keys())
        self.names: dict[int, str] = {}  # parameter or buffer id -> its name in the checkpoint
        problems: list[str] = []
        tensors = [(n, t) for n, t in model.named_parameters(remove_duplicate=False)]
        tensors += [(n, t) for n, t in model.named_buffers(remove_duplicate=False) if t.is_meta]
        for name, t in tensors:
            if id(t) in self.names:
                continue
            owners = [n for n, u in tensors if u is t]
            found = next((n for n in owners if n in self.ck.keys()), None)
            if found is None:
                if not any(n in persistent for n in owners):
                    problems.append(f"{name!r} is a non-persistent buffer left on the meta device (build the model "
                                    "under dynashard.empty_weights(), which puts only parameters on meta)")
                else:
                    problems.append(f"{name!r} is not in the checkpoint")
            elif tuple(self.ck.shape(found)) != tuple(t.shape):
                problems.append(f"{name!r} is saved with shape {list(self.ck.shape(found))}, the model has "
                                f"{list(t.shape)}")
            elif self.ck.dtype(found).is_floating_point != t.dtype.is_floating_point:
                problems.append(f"{name!r} is saved as {self.ck.dtype(found)}, the model has {t.dtype}")
            else:
                self.names[id(t)] = found
        if problems:
            more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise UsageError(f"dynashard.parallelize: the checkpoint {self.ck.path} does not fit the model: "
                             f"{'; '.join(problems[:5])}{more}. Expected a checkpoint saved from this model's "
                             "architecture and config. Nothing was changed.")
        unused = sorted(self.ck.keys() - set(self.names.values()))
        if unused:
            warnings.warn(f"dynashard.parallelize: {len(unused)} tensor(s) in {self.ck.path} are not in the model "
                          f"and were not read: {unused[:5]}", UserWarning, stacklevel=3)

    def make_facades(self) -> None:
        """Meta parameters become storage-less tensors on the device (what a graph traces and the
        store keys shards by); meta buffers are read whole."""
        made: dict[int, torch.Tensor] = {}
        self.replaced: list[tuple[dict, str, torch.Tensor]] = []  # (module's dict, name, meta tensor)
        for module in self.model.modules():
            for attr, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                self.replaced.append((module._parameters, attr, p))
                if id(p) not in made:
                    facade = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                          requires_grad=p.requires_grad)
                    facade.untyped_storage().resize_(0)  # (empty: its pages were never touched)
                    facade.__deepcopy__ = _refuse_copy  # (copying a storage-less tensor kills the process)
                    self.names[id(facade)] = self.names[id(p)]
                    made[id(p)] = facade
                module._parameters[attr] = made[id(p)]
            for attr, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    self.replaced.append((module._buffers, attr, b))
                    module._buffers[attr] = self.ck.read(self.names[id(b)], dtype=b.dtype).to(self.device)
        STORE.trust(list(made.values()))  # every rank reads the same file: nothing to compare

    def restore(self) -> None:
        """The meta tensors back in place, after a run that failed before cutting anything."""
        for where, attr, meta in self.replaced:
            where[attr] = meta

    def __call__(self, t: torch.Tensor, dim: int | None, pieces: list[tuple[int, int]] | None) -> torch.Tensor:
        name = self.names[id(t)]
        with private.real_tensors():  # (called inside the backend, where Dynamo's fake mode is on)
            if dim is None:
                return self.ck.read(name, dtype=t.dtype).to(t.device)
            return self.ck.read(name, dim, pieces, dtype=t.dtype).to(t.device).contiguous()


@contextlib.contextmanager
def empty_weights():
    """Build a model with its parameters on the meta device and its buffers real (as accelerate's
    ``init_empty_weights`` does): buffers computed at construction, such as RoPE tables, are not in
    checkpoints, and ``parallelize(checkpoint=...)`` keeps them."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        p = module._parameters[name]
        if p is not None and not p.is_meta:  # (already on meta: a tied weight assigned again, kept as is)
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


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
