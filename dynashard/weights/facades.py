"""Facades: the full-shape tensors dynashard leaves where a sharded tensor was, answering eager use.

After a compile a sharded weight keeps its metadata (Dynamo guards on it and re-traces it for new
shapes) but its storage is freed; after ``parallelize`` the full-shape tensor stays behind the
module's property; a KV cache a graph allocates comes back as one. Left plain, these are tensors with
no bytes: most eager reads refuse them with torch's storage error, and some (``w.sum()``, ``w + 1``,
``model.to(torch.float64)``) read them anyway: a segfault, or garbage (``w.numpy()``).

So each is a :class:`Facade` (or :class:`FacadeParameter`), whose ``__torch_function__`` passes
every call through while Dynamo traces (the graph sees a plain tensor) and otherwise answers:

- metadata (shape, dtype, device, requires_grad, ...) as any tensor;
- ``print``: the shape, dtype and how the tensor is cut;
- what this rank can do with its shard alone, on the shard: ``requires_grad_`` / ``register_hook``
  (the shard's gradient: this rank's part), ``copy_`` of a full-size tensor or of a facade cut alike
  (``load_state_dict``), ``zero_`` / ``fill_``, ``to`` / ``half`` / ``cuda`` (``model.to``),
  ``detach`` / ``.data`` / ``clone`` (facades of the shard, or of a copy of it; ``copy.deepcopy`` of a
  cache a graph returned too, as HF's prompt-cache reuse does), ``index_select`` or an index
  along a dim that is not cut (beam search reordering a cache);
- anything else reads values this rank does not hold: a :class:`UsageError` naming the tensor, its
  cut and the fix (``dynashard.full_tensor`` on every rank gathers the whole value).

Invariants: a facade holds no bytes; its shard lives in ``store.STORE`` under the facade (or an
alias of it); nothing here runs a collective except :func:`full_tensor`, which every rank calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dynashard import _torch as private
from dynashard._torch.subclass import is_traceable_subclass
from dynashard.comm.transport import gather_pieces
from dynashard.errors import ShardNotHeldError, UsageError
from dynashard.weights.store import STORE

# Read-only attributes and methods that only look at metadata (no values).
_GETTERS = frozenset({
    "shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "names",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
    "is_ipu", "is_hpu", "is_maia", "is_mtia", "is_vulkan", "itemsize", "nbytes", "_version", "output_nr",
    "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad", "_base", "is_sparse_csr",
})
_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "element_size", "is_floating_point", "is_complex", "is_signed", "untyped_storage", "_typed_storage",
    "storage", "data_ptr", "_is_view", "__len__", "is_pinned", "is_shared", "get_device", "is_inference",
    "has_names", "_is_zerotensor", "is_conj", "is_neg", "dim_order", "__hash__", "_nnz", "__dir__",
    "__setstate__", "__class__", "_has_compatible_shallow_copy_type",
})
_SETTERS = frozenset({"grad", "_backward_hooks", "_post_accumulate_grad_hooks"})
_CONVERSIONS = {"half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}


class _Answers:
    """The ``__torch_function__`` of every facade (module docstring)."""

    @classmethod
    @private.never_a_frame  # (eager use inside a compiled region: answered eagerly, not traced as a graph alone)
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if private.compiling():  # Dynamo's trace, the backend's analysis and rewrite: plain tensors
            return _plain(func, args, kwargs)
        kind, name = _name_of(func)
        if (kind, name) == ("get", "requires_grad"):  # the shard's: the one gradients follow (it may be frozen)
            shard = STORE.shard_of(args[0])
            return shard.requires_grad if isinstance(shard, nn.Parameter) else _plain(func, args, kwargs)
        if kind == "get" and name in _GETTERS or kind == "call" and name in _METHODS:
            return _plain(func, args, kwargs)
        if kind == "set" and name in _SETTERS:
            return _plain(func, args, kwargs)
        if _live(args):  # parallelize(dtensor=True): the values are the module's DTensor, not the store's shard
            raise UsageError(
                f"dynashard: {name} of a facade that stands for a DTensor parameter (parallelize(dtensor=True)); its "
                "values live in the module's parameter (FSDP2 swaps it), which eager code reads as module.<name>. "
                "Expected the module's attribute or model.parameters(), not a tensor kept from inside a compile.")
        answer = _EAGER.get((kind, name))
        if answer is not None:
            return answer(func, args, kwargs)
        raise _refusal(name, args, kwargs)

    # (nn.Parameter defines both itself, without __torch_function__: a copy would be a facade of nothing)
    def __deepcopy__(self, memo):
        entry = STORE.entry(self)
        if entry is None or not entry.held:  # a weight: the model's copy is made before compiling
            _refuse_copy(None, (), {})
        # a cache a graph returned (HF's prompt-cache reuse: copy.deepcopy(past_key_values)): a facade of a
        # copy of this rank's part
        memo[id(self)] = copied = _derived(self, lambda shard: shard.clone(), "a copy")
        return copied

    def __reduce_ex__(self, protocol):
        _refuse_save(None, (), {})


class Facade(_Answers, torch.Tensor):
    """A full-shape tensor without storage that stands for a shard in ``STORE`` (a held cache)."""


class FacadeParameter(_Answers, nn.Parameter):
    """A parameter's facade: the parameter object itself after a compile (its storage freed), or
    the full-shape parameter ``parallelize`` keeps behind the module's property."""


def is_facade(t: Any) -> bool:
    return isinstance(t, (Facade, FacadeParameter))


def become(t: torch.Tensor) -> None:
    """Make the (storage-less) ``t`` a facade, in place: the same object, the class swapped."""
    if is_facade(t):
        return
    if type(t) is nn.Parameter:
        t.__class__ = FacadeParameter
    elif type(t) is torch.Tensor:
        t.__class__ = Facade
    # (another subclass keeps its class: it is marked, copies and saves are refused, mark_storage_less)


def unbecome(t: torch.Tensor) -> None:
    """A facade whose tensor holds its whole value again (``freed.materialize``): a plain tensor."""
    if isinstance(t, FacadeParameter):
        t.__class__ = nn.Parameter
    elif isinstance(t, Facade):
        t.__class__ = torch.Tensor


def storage_less(shape: Any, dtype: torch.dtype, device: Any, requires_grad: bool = False,
                 parameter: bool = False) -> torch.Tensor:
    """A new facade of ``shape`` (no bytes: its pages are never touched)."""
    with private.real_tensors():
        t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    if parameter:
        t = nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    become(t)
    return t


def _plain(func: Any, args: tuple, kwargs: dict) -> Any:
    with private.plain_torch_functions():
        return func(*args, **kwargs)


def _name_of(func: Any) -> tuple[str, str]:
    """``("get" | "set", attribute)`` for a property access, ``("call", name)`` for a function."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and type(owner).__name__ == "getset_descriptor":
        return ("get" if func.__name__ == "__get__" else "set"), owner.__name__
    return "call", getattr(func, "__name__", str(func))


def _live(args: tuple) -> bool:
    return bool(args) and STORE.is_live(args[0])


def _derived(facade: torch.Tensor, make: Any, what: str) -> torch.Tensor:
    """A facade of ``make(shard)``, a tensor cut like ``facade`` (a clone, a selection along an uncut dim)."""
    entry = STORE.entry_of(facade)
    with torch.no_grad():
        local = make(entry.shard)
    shape = list(local.shape)
    shape[entry.spec.dim] = facade.shape[entry.spec.dim]
    out = storage_less(shape, local.dtype, local.device)
    STORE.add_held(out, entry.spec, local, f"{what} of {entry.fqn}")
    return out


# ---------------------------------------------------------------- what a facade does eagerly


def _repr(func, args, kwargs) -> str:
    t = args[0]
    entry = STORE.entry(t)
    cut = "" if entry is None else f", {_cut_of(entry)}"
    name = "" if entry is None else f" {entry.fqn!r}"
    grad = ", requires_grad=True" if t.requires_grad else ""
    return (f"dynashard.Facade{name}(shape={list(t.shape)}, dtype={t.dtype}, device={t.device}{grad}: sharded by "
            f"dynashard{cut})")


def _cut_of(entry: Any) -> str:
    spec = entry.spec
    pieces = spec.split.pieces(spec.world, spec.rank)
    held = ", ".join(f"[{s}:{s + n}]" for s, n in pieces if n) or "nothing"
    return f"rank {spec.rank} of {spec.world} holds {held} of dim {spec.dim}"


def _requires_grad(func, args, kwargs) -> Any:
    t = args[0]
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    _plain(func, args, kwargs)
    shard = STORE.shard_of(t)
    if isinstance(shard, nn.Parameter):  # (the leaf gradients land in; a plain shard takes the facade's when made one)
        shard.requires_grad_(bool(flag))
    return t if func.__name__ == "requires_grad_" else None


def _hook(func, args, kwargs) -> Any:
    """On the shard gradients land in (the parameter parallelize registered, or the one a training
    call passes): the hook sees this rank's part of the gradient."""
    t, hook = args[0], args[1] if len(args) > 1 else kwargs["hook"]
    if STORE.entry(t) is None:
        raise _refusal(func.__name__, args, kwargs)
    shard = STORE.as_parameter(t)
    return getattr(shard, func.__name__)(hook)


def _alias(func, args, kwargs) -> torch.Tensor:
    """``detach()`` / ``.data``: another facade of the same shard (``state_dict()`` detaches)."""
    t = args[0]
    out = storage_less(t.shape, t.dtype, t.device)
    STORE.alias(out, t)
    return out


def _set_data(func, args, kwargs) -> None:
    """``facade.data = value`` (``nn.Module._apply``, after ``model.to(...)`` made ``value``): a facade
    takes over the value's shard; a full-size tensor is cut into this rank's shard."""
    t, value = args
    STORE.rebind(t, value)
    with private.plain_torch_functions():
        t.data = storage_less(t.shape, value.dtype, value.device)


def _copy(func, args, kwargs) -> torch.Tensor:
    """``copy_`` of a full-size tensor (this rank's pieces of it) or of a facade cut alike, into the shard."""
    t, src = args[0], args[1]
    STORE.copy_into(t, src, non_blocking=bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
    return t


def _in_place(func, args, kwargs) -> torch.Tensor:
    """``zero_()``, ``fill_(number)``: elementwise, so the same on the shard."""
    t = args[0]
    if any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args[1:]):
        raise _refusal(func.__name__, args, kwargs)
    shard = STORE.local_of(t)
    with torch.no_grad():
        getattr(shard, func.__name__)(*args[1:], **kwargs)
    return t


def _convert(func, args, kwargs) -> torch.Tensor:
    """``to`` / ``half`` / ``float`` / ``cuda`` / ``cpu`` / ``type(dtype)``: a facade of the converted
    shard (the same facade when nothing changes, as ``Tensor.to`` returns ``self``)."""
    t, name = args[0], func.__name__
    device, dtype, copy = t.device, t.dtype, False
    if name in _CONVERSIONS:
        dtype = _CONVERSIONS[name]
    elif name in ("cuda", "cpu"):
        device = torch.device("cpu") if name == "cpu" else torch.device("cuda", *args[1:2]) if len(args) > 1 and \
            args[1] is not None else torch.device("cuda")
    elif name == "type":
        if len(args) < 2 and "dtype" not in kwargs:
            return _plain(func, args, kwargs)  # (the type's name: metadata)
        dtype = _dtype_of(args[1] if len(args) > 1 else kwargs["dtype"])
    else:  # to(...)
        rest = [a for a in args[1:] if not isinstance(a, torch.Tensor)]
        others = [a for a in args[1:] if isinstance(a, torch.Tensor)]
        if others:
            device, dtype = others[0].device, others[0].dtype
        else:
            to_device, to_dtype = private.parse_to(*rest, **{k: v for k, v in kwargs.items() if k != "copy"})
            device, dtype = to_device or device, to_dtype or dtype
        copy = bool(kwargs.get("copy", False))
    if device == t.device and dtype == t.dtype and not copy:
        return t
    return _derived(t, lambda shard: shard.to(device=device, dtype=dtype), "a conversion")


def _dtype_of(spec: Any) -> torch.dtype:
    if isinstance(spec, torch.dtype):
        return spec
    names = {"torch.FloatTensor": torch.float32, "torch.DoubleTensor": torch.float64, "torch.HalfTensor": torch.float16,
             "torch.BFloat16Tensor": torch.bfloat16}
    if spec in names:
        return names[spec]
    raise UsageError(f"dynashard: Facade.type({spec!r}): expected a torch.dtype.")


def _clone(func, args, kwargs) -> torch.Tensor:
    return _derived(args[0], lambda shard: shard.clone(), "a clone")


def _index_select(func, args, kwargs) -> torch.Tensor:
    """Along a dim that is not cut each rank selects from its own part: a facade of that (HF's
    ``reorder_cache`` for beam search: ``cache.index_select(0, beam_idx)``)."""
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    index = args[2] if len(args) > 2 else kwargs["index"]
    spec = STORE.spec_of_any(t)
    if spec is None or is_facade(index) or dim % t.dim() == spec.dim % t.dim():
        raise _refusal("index_select", args, kwargs)
    return _derived(t, lambda shard: shard.index_select(dim, index), "a selection")


def _getitem(func, args, kwargs) -> torch.Tensor:
    """``cache[..., :-n, :]`` (HF's ``crop`` in assisted decoding), ``cache[beam_idx]`` (beam search): an
    index that keeps the cut dim whole and in place (slices, one 1-D index tensor before it) acts on
    each rank's part: a facade of that. Anything else needs values this rank does not hold."""
    t, index = args[0], args[1]
    spec = STORE.spec_of_any(t)
    items = list(index) if isinstance(index, tuple) else [index]
    ellipses = [at for at, i in enumerate(items) if i is Ellipsis]  # (by identity: == on a tensor is elementwise)
    if spec is None or len(ellipses) > 1:
        raise _refusal("__getitem__", args, kwargs)
    if ellipses:  # the dims the ellipsis stands for
        items[ellipses[0]:ellipses[0] + 1] = [slice(None)] * (t.dim() - len(items) + 1)
    items += [slice(None)] * (t.dim() - len(items))
    cut = spec.dim % t.dim()
    tensors = [i for i in items if torch.is_tensor(i)]
    keeps = all(isinstance(i, slice) or (torch.is_tensor(i) and i.dim() == 1 and not is_facade(i)) for i in items)
    whole = isinstance(items[cut], slice) and items[cut] == slice(None)  # the cut dim untouched
    if not keeps or len(tensors) > 1 or not whole or any(torch.is_tensor(i) for i in items[cut:]):
        raise _refusal("__getitem__", args, kwargs)
    return _derived(t, lambda shard: shard[tuple(items)], "a selection")


def _refuse_copy(func, args, kwargs):
    raise UsageError(
        "dynashard: cannot copy this model: dynashard sharded its weights and freed their full values. Expected "
        "the copy made before torch.compile or dynashard.parallelize, e.g. reference = copy.deepcopy(model) "
        "first.")


SAVE_REFUSED = (
    "dynashard: cannot save this tensor: dynashard sharded it and freed its full values (this rank holds "
    "only its shard), so torch.save would write an empty storage. Expected a checkpoint of the shards: "
    "dynashard.parallelize(model, ...), then dcp.save(model.state_dict(), checkpoint_id=path) "
    "(torch.distributed.checkpoint, loadable at any world size); or the whole weights in one file with "
    "dynashard.export_safetensors(model, path), which works after a plain compile too.")


def _refuse_save(func, args, kwargs):
    raise UsageError(SAVE_REFUSED)


_EAGER = {
    ("call", "__repr__"): _repr, ("call", "__format__"): lambda f, a, k: repr(a[0]),
    ("call", "requires_grad_"): _requires_grad, ("set", "requires_grad"): _requires_grad,
    ("call", "register_hook"): _hook, ("call", "register_post_accumulate_grad_hook"): _hook,
    ("call", "detach"): _alias, ("get", "data"): _alias, ("set", "data"): _set_data,
    ("call", "copy_"): _copy, ("call", "zero_"): _in_place, ("call", "fill_"): _in_place,
    **{("call", n): _convert for n in ("to", "cuda", "cpu", "type", *_CONVERSIONS)},
    ("call", "clone"): _clone, ("call", "index_select"): _index_select, ("call", "__getitem__"): _getitem,
    ("call", "__deepcopy__"): _refuse_copy, ("call", "__reduce_ex__"): _refuse_save,
}


def _refusal(name: str, args: tuple, kwargs: dict) -> ShardNotHeldError:
    """What a use that needs values this rank does not hold is told: which tensor, its cut, the fix."""
    facade = next((a for a in (*args, *kwargs.values()) if is_facade(a)), None)
    entry = STORE.entry(facade) if facade is not None else None
    what = "a tensor dynashard sharded" if entry is None else f"{entry.fqn!r} ({_cut_of(entry)})"
    if entry is not None and STORE.facade_of(entry.shard) is not None:
        fix = ("dynashard.parallelize registered this rank's shard as the module's parameter (model.named_parameters() "
               "lists it); a submodule cannot run on its own: call the parallelized model (it runs through dynashard) "
               "or torch.compile(model, backend='dynashard')")
    elif entry is not None and entry.held:
        fix = "A cache the compiled graph returned holds this rank's part only"
    else:
        fix = ("The module can only run through the compiled model (torch.compile(model, backend='dynashard')), "
               "which Dynamo runs eagerly once a frame hits its recompile limit (TORCH_LOGS=recompiles says; "
               "torch._dynamo.config.recompile_limit); dynashard.export_safetensors(model, path) writes the whole "
               "weights")
    error = ShardNotHeldError(
        f"dynashard: {name} needs the values of {what}, which this rank does not hold: dynashard sharded it and "
        f"freed its full value. {fix}. Expected dynashard.full_tensor(t) on every rank (a collective) to read the "
        "whole value, or the use before compiling.")
    error.needs = f"{name} needs the values of {what}"
    return error


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor dynashard sharded (a facade, or a shard ``parallelize`` registered, or
    another handle of that shard's memory: ``.detach()``, ``.data``, a ``state_dict()`` value, or such a
    parameter's ``.grad``), gathered
    from every rank of its group: every rank must call it, in the same order. Any other tensor is returned
    as it is. A tensor subclass (torchao's quantized weights) is rebuilt from its inner tensors, each
    gathered so. A DTensor (``parallelize(..., dtensor=True)``, FSDP2) is gathered by its own placements
    (``DTensor.full_tensor``): rebuilt around its gathered local tensor, it would claim its shard's placements
    for the whole value."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    if is_traceable_subclass(t) and not is_facade(t):
        names, ctx = t.__tensor_flatten__()
        inner = {name: full_tensor(getattr(t, name)) for name in names}  # (the same order on every rank)
        if all(inner[name] is getattr(t, name) for name in names):
            return t
        return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
    facade = STORE.facade_of(t) if not is_facade(t) else t
    owner = getattr(t, "_dynashard_param", None)  # a sharded parameter's gradient (gradients.ShardGrad)
    piece = None
    if facade is None and owner is not None and owner() is not None:
        facade, piece = STORE.facade_of(owner()), t  # (without it: this rank's piece, returned as if whole)
    if facade is None and not is_facade(t) and isinstance(t, torch.Tensor):
        facade = STORE.facade_sharing_memory(t)  # (without it: this rank's piece, returned as if whole)
    entry = STORE.entry(facade) if facade is not None else None
    if entry is None:
        return t
    if entry.spec.stacked:
        raise UsageError("dynashard.full_tensor: a weight of weights='per_rank' is every rank's own; there is no "
                         "one whole value to gather.")
    group = private.group_by_name(entry.spec.group_name)
    shard = entry.shard if piece is None else piece.as_subclass(torch.Tensor)
    return gather_pieces(shard.detach(), list(facade.shape), entry.spec, group)
