"""Lowerings keep their source's arguments: a mechanical check on every op the rewrite emits itself.

The rewrite re-runs most nodes as they are, on converted arguments, which carries every argument
of the source node by construction. Some nodes it emits another way (a *lowering*): a rowwise
linear as ``mm`` + all_reduce + ``add``, a vocab-parallel embedding as a masked local lookup, a
view at this rank's size. A lowering that forgets an argument is a silent wrong answer in the
worst place: the vocab-parallel lookup once dropped ``padding_idx`` and ``scale_grad_by_freq``,
which change nothing forward and every gradient of the padding row backward.

Before (source node, and what its lowering dispatched)::

    embedding(W, ids, 1)              ->  embedding(W_shard, clamp(ids - start), ...)
After: :func:`check` binds both to the op's schema. Every argument the source sets (a required
non-tensor argument, or an optional one not at its default) must be carried, with an equal
value, by an emitted op of the source's own target, or be declared in :data:`REEXPRESSED` with
how the lowering expresses it instead. Anything else raises :class:`InternalError` at compile
time (and in ``explain(verify=True)``), naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dynashard import _torch as private
from dynashard._torch import aten as private_aten
from dynashard.errors import InternalError

aten = torch.ops.aten

_PART_SIZES = "this rank's part of the range or sizes (lowerings.TakeParts)"
_LOCAL_SHAPE = "this rank's shape (a Record.resize / lowerings.AllocateLocal)"
_STACKED = "weights='per_rank': the bmm reads the stacked weight's transpose itself"

# Source op -> {argument: how its lowering expresses it, other than passing it to the same op}.
REEXPRESSED: dict[Any, dict[str, str]] = {
    aten.embedding.default: {
        "padding_idx": "this rank's row of it (-1 on a rank that holds none: its ids are masked out there)",
        "scale_grad_by_freq": "with gradients, each row's gradient divided by its id's count here "
                              "(the local lookup's own counts would include other ranks' ids)",
    },
    # (a rank that holds slices of v cut on the norm dim emits the op itself, every argument carried)
    aten._weight_norm_interface.default: dict.fromkeys(("v", "g", "dim"), "a rank holding none of the slices: "
                                                      "the empty v * g (lowerings.NormOfSlices); v cut across "
                                                      "the norms: v * g / the norms summed over the ranks "
                                                      "(lowerings.NormAcrossCut)"),
    aten.embedding_renorm_.default: {
        "max_norm": "the looked-up rows this rank holds renormalised here",
        "norm_type": "the looked-up rows this rank holds renormalised here",
    },
    aten._log_softmax.default: {
        "dim": "loss parallel: the rule takes [tokens, vocab] along the cut vocab dim only",
        "half_to_float": "loss parallel: computed in float32, returned in the traced dtype",
    },
    aten.slice.Tensor: {"dim": _PART_SIZES, "start": _PART_SIZES, "end": _PART_SIZES},
    aten.split.Tensor: {"split_size": _PART_SIZES, "dim": _PART_SIZES},
    aten.split_with_sizes.default: {"split_sizes": _PART_SIZES, "dim": _PART_SIZES},
    **{op: {"size": _LOCAL_SHAPE} for op in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                                            aten.expand.default, aten.zeros.default, aten.empty.memory_format,
                                            aten.full.default, aten.new_empty.default, aten.new_zeros.default)},
    aten._scaled_mm.default: {"bias": "a rowwise float8 linear: added once, after the partial sums are combined "
                                      "(lowerings.RowwiseLinear)"},
    aten.permute.default: {"dims": _STACKED},
    aten.transpose.int: {"dim0": _STACKED, "dim1": _STACKED},
}


def _is_tensor_type(arg: Any) -> bool:
    return "Tensor" in str(arg.type)


def _bound(schema: Any, args: tuple, kwargs: dict, resolve: Any = None) -> dict[str, Any]:
    """``{name: value}`` of every argument passed (defaults filled in), ``resolve`` mapping fx nodes."""
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        elif a.has_default_value():
            value = a.default_value
        else:
            continue
        out[a.name] = resolve(value) if resolve is not None and isinstance(value, torch.fx.Node) else value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.SymInt, int)) and isinstance(b, (torch.SymInt, int)) and not isinstance(a, bool):
        return private_aten.known_equal(a, b)
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) or isinstance(b, (torch.SymInt, torch.SymFloat)):
        return False  # (not provably equal without a guard)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False


def set_arguments(node: torch.fx.Node, resolve: Any = None) -> dict[str, Any]:
    """The arguments ``node`` sets: required non-tensor ones, optional ones not at their default
    (an optional tensor: not None)."""
    schema = private_aten.schema_of(node.target)
    bound = _bound(schema, node.args, node.kwargs, resolve)
    out = {}
    for a in schema.arguments:
        if a.name not in bound:
            continue
        value = bound[a.name]
        if _is_tensor_type(a):
            if a.has_default_value() and value is not None:
                out[a.name] = value  # an optional tensor given (a class weight, a bias)
            continue
        if not a.has_default_value() or not _same(value, a.default_value):
            out[a.name] = value
    return out


def check(node: torch.fx.Node, calls: list[tuple[Any, tuple, dict]], resolve: Any = None) -> None:
    """Raise if the ops a lowering emitted for ``node`` drop an argument it sets (module docstring).

    ``calls``: what :func:`dynashard._torch.aten.recording_dispatch` recorded while it ran."""
    if not private.is_op_overload(node.target):
        return
    declared = REEXPRESSED.get(node.target, {})
    schema = private_aten.schema_of(node.target)
    same = [_bound(schema, args, kwargs) for func, args, kwargs in calls if func is node.target]
    for name, value in set_arguments(node, resolve).items():
        if name in declared:
            continue
        if isinstance(value, torch.Tensor) or any(isinstance(v, torch.Tensor) for v in _flat(value)):
            if any(b.get(name) is not None for b in same):
                continue
        elif any(name in b and _same(b[name], value) for b in same):
            continue
        raise InternalError(
            f"dynashard: internal error: the rewrite of {node.name} ({node.target}) emits no "
            f"{node.target} carrying its argument {name}={value!r}, and its lowering does not declare how it "
            "expresses it (dynashard/rewrite/argument_check.py REEXPRESSED): the sharded graph would compute something "
            "else. Please report this model."
        )


def _flat(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
