"""Tensor-subclass inputs (torchao's quantized weights): flattened into their inner tensors first.

Before: a Dynamo graph whose parameter placeholder holds a traceable wrapper subclass, read whole::

    w: Int8Tensor(qdata int8 [out, in], scale [out, 1], zero_point [out, 1])
    y = linear(x, w, b)

After: one placeholder per inner tensor (FQNs ``<param>.qdata``, ``<param>.scale``, ...) and the subclass
rebuilt from them by its own ``__tensor_unflatten__`` inside the graph::

    w_qdata, w_scale, w_zero_point = placeholders
    w = rebuild(w_qdata, w_scale, w_zero_point)
    y = linear(x, w, b)

The retrace to aten then runs the subclass's own implementation on its inner tensors (torchao's weight-only
int8: ``mm(x, t(qdata).to(f32)) * view(scale)``, gpt-fast's int8 form), and everything after it (match,
plan, cut, store, program) sees plain tensors: the int8 rows or columns are cut as a float weight's, a
per-channel scale with its rows (``rules``: a pointwise operand of a cut output is cut alike).

Invariants: flattening is recursive (a subclass inside a subclass); the program Dynamo calls flattens
its arguments in the same order on every call, reading the subclass's current inner tensors (so the
store's shards, keyed by inner tensor, are found).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from dynashard import _torch as private
from dynashard._torch.subclass import copy_placeholder_origin, is_traceable_subclass

# Placeholder meta key: the attribute path of an inner tensor inside its parameter ("qdata", "scale").
INNER = "dynashard_inner"


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How one subclass tensor is rebuilt from its leaves (its inner tensors, depth first)."""

    cls: type
    names: tuple[str, ...]  # the inner attributes that are tensors, one spec each below
    ctx: Any
    inner: tuple[_Spec | None, ...]  # None: a plain inner tensor (one leaf)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    # inner attributes that are not tensors, as they were: (name, value) pairs, passed back as they are (torch 2.13's
    # DTensor names its ``device_mesh`` among its inner attributes)
    fixed: tuple[tuple[str, Any], ...] = ()

    def leaves(self) -> int:
        return sum(1 if s is None else s.leaves() for s in self.inner)


def _flatten(t: Any, path: str = "") -> tuple[list[tuple[str, Any]], _Spec | None]:
    """(attribute path, leaf) pairs of ``t`` and how to rebuild it; ``t`` itself if it is no subclass."""
    if not is_traceable_subclass(t):
        return [(path, t)], None
    names, ctx = t.__tensor_flatten__()
    leaves, inner, tensors, fixed = [], [], [], []
    for name in names:
        value = getattr(t, name)
        if not isinstance(value, torch.Tensor):  # (an opaque inner object: never a leaf, which is a tensor)
            fixed.append((name, value))
            continue
        sub, spec = _flatten(value, f"{path}.{name}" if path else name)
        leaves += sub
        inner.append(spec)
        tensors.append(name)
    return leaves, _Spec(type(t), tuple(tensors), ctx, tuple(inner), tuple(t.size()), tuple(t.stride()), tuple(fixed))


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a subclass tensor is made of (``[t]`` for a plain one; a DTensor: its local tensor)."""
    return [leaf for _, leaf in _flatten(t)[0]]


def rebuild(spec: _Spec, *leaves: torch.Tensor) -> torch.Tensor:
    """The subclass tensor ``spec`` describes, from its leaves (called inside the flattened graph)."""
    inner, k = dict(spec.fixed), 0
    for name, sub in zip(spec.names, spec.inner):
        n = 1 if sub is None else sub.leaves()
        inner[name] = leaves[k] if sub is None else rebuild(sub, *leaves[k : k + n])
        k += n
    return spec.cls.__tensor_unflatten__(inner, spec.ctx, spec.size, spec.stride)


def _rebuilder(spec: _Spec) -> Callable[..., torch.Tensor]:
    """A graph target rebuilding ``spec``'s subclass (fx's generated code names a function, not a spec)."""

    def fn(*leaves: torch.Tensor) -> torch.Tensor:
        return rebuild(spec, *leaves)

    fn.__name__ = fn.__qualname__ = f"rebuild_{spec.cls.__name__}"
    return fn


@dataclasses.dataclass(frozen=True)
class Flattened:
    """A Dynamo graph with its subclass inputs flattened, and how to flatten its arguments."""

    gm: torch.fx.GraphModule
    inputs: list[Any]
    origin: list[int]  # flat input index -> the Dynamo input it comes from
    subclassed: frozenset[int]  # Dynamo input indices that were subclasses

    def flat_args(self, args: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        for i, a in enumerate(args):
            out += inner_tensors(a) if i in self.subclassed else [a]
        return out

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        return _FlatCall(compiled, self)


class _FlatCall:
    """What Dynamo calls: the compiled program of the flattened graph, on flattened arguments."""

    def __init__(self, compiled: Callable[..., Any], flattened: Flattened) -> None:
        self.compiled, self._flat = compiled, flattened

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*self._flat.flat_args(args))

    def __getattr__(self, name: str) -> Any:  # (the program's own attributes: specs, live, ...)
        return getattr(self.compiled, name)


def flatten(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Flattened | None:
    """``gm`` with every subclass input flattened (module docstring); None if it has none."""
    slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
    subclassed = frozenset(i for i, n in enumerate(slots) if is_traceable_subclass(private.example_value(n)))
    if not subclassed:
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[Any] = []
    origin: list[int] = []
    for i, node in enumerate(slots):
        if i not in subclassed:
            env[node] = graph.node_copy(node, lambda n: env[n])
            inputs.append(example_inputs[i])
            origin.append(i)
            continue
        fakes, spec = _flatten(private.example_value(node))
        reals = inner_tensors(example_inputs[i])
        leaves = []
        for (path, fake), real in zip(fakes, reals, strict=True):
            leaf = graph.placeholder(f"{node.name}_{path.replace('.', '_')}")
            copy_placeholder_origin(node, leaf, path)
            leaf.meta["example_value"] = fake
            leaf.meta[INNER] = path
            leaves.append(leaf)
            inputs.append(real)
            origin.append(i)
        env[node] = graph.call_function(_rebuilder(spec), tuple(leaves))
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    flat_gm = torch.fx.GraphModule(gm, graph)
    flat_gm.meta.update(gm.meta)
    return Flattened(flat_gm, inputs, origin, subclassed)
