"""Private torch APIs for reading and emitting aten graphs: symbolic sizes without guards, views,
tensor constants, and the ops a traced function dispatches.

What the propagation rules, the rewrite, the lowering check and the report read of an aten graph
(``_torch/__init__.py`` holds the rest: Dynamo, AOTAutograd, Inductor, process groups). Each function
says which torch behaviour it depends on.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.fx


def size_hint(x: Any) -> int:
    """A concrete example value for a possibly symbolic size, without adding a guard."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else 0
    return int(x)


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` for sizes that may be symbolic, provable without adding a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return _statically_true(lambda: a == b)


def known_multiple(a: Any, k: int) -> bool:
    """``a % k == 0`` for a size that may be symbolic, provable without adding a guard."""
    if isinstance(a, int):
        return a % k == 0
    return _statically_true(lambda: a % k == 0)


def _statically_true(condition: Any) -> bool:
    """``condition()`` (a comparison of symbolic sizes) provably true, decided outside any trace.

    NOTE: called while the rewrite traces (make_fx), on sizes of the graph being rewritten, which that
    trace never produced. torch 2.11's proxy mode records a SymInt comparison made under it, and
    fails on such a size ("Max(1, ((s27 + 127)//128)) ... is not tracked with proxy": a per-head block
    mask under dynamic shapes); 2.13's does not. The comparison is a question, not part of the program."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    with disable_proxy_modes_tracing():
        return bool(statically_known_true(condition()))


def schema_of(target: Any) -> Any:
    """An op's schema (``OpOverload._schema``: name, arguments, returns and their alias info), or None
    for a target that has none (a Python function, ``operator.getitem``)."""
    return getattr(target, "_schema", None)


@functools.cache
def is_in_place(op: Any) -> bool:
    """Whether ``op`` is an in-place aten op (one that writes its first argument: ``masked_fill_.Scalar``).

    NOTE: torch 2.13 tags them ``torch.Tag.inplace``; torch 2.11 has no such tag (its ``torch.Tag`` lists
    ``inplace_view`` only), and there the schema's name says it (``aten::masked_fill_``; a dunder such as
    ``aten::__iand__`` is not one of them)."""
    inplace = getattr(torch.Tag, "inplace", None)
    if inplace is not None:
        return inplace in getattr(op, "tags", ())
    name = getattr(getattr(op, "_schema", None), "name", "")
    return name.startswith("aten::") and name.endswith("_") and not name.endswith("__")


def out_of_place_twin(op: Any) -> Any:
    """The out-of-place overload of an in-place aten op (``masked_fill_.Scalar`` -> ``masked_fill.Scalar``), or
    None (not an in-place aten op, or no twin on this torch).

    NOTE: an OpOverload's ``_schema.name`` (``"aten::masked_fill_"``) and ``_overloadname``."""
    schema = getattr(op, "_schema", None)
    name = getattr(schema, "name", "")
    if not name.startswith("aten::") or not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(torch.ops.aten, name.removeprefix("aten::")[:-1], None)
    overload = getattr(op, "_overloadname", None)
    if packet is None or overload not in packet.overloads():
        return None
    return getattr(packet, overload)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a graph's nested output, in the order Dynamo flattens it (``torch.utils._pytree``)."""
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(tree)


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` (a fake or real tensor) shares its base's memory (``Tensor._is_view``)."""
    return t._is_view()


def constant_value(node: Any) -> torch.Tensor | None:
    """The value of a tensor constant in an aten graph (``x[..., [-2]]`` traces the list to
    ``lift_fresh_copy(get_attr _tensor_constant0)``), or None if ``node`` is not one or only a fake
    of it is held."""
    if isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.lift_fresh_copy.default:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return None
    value = getattr(node.graph.owning_module, str(node.target), None)
    from torch._subclasses.fake_tensor import is_fake

    if not isinstance(value, torch.Tensor) or is_fake(value) or value.dtype.is_floating_point:
        return None
    return value


@contextlib.contextmanager
def recording_dispatch():
    """``with recording_dispatch() as calls:`` every aten op dispatched inside, as ``(op, args,
    kwargs)``, with the arguments the caller passed (a lowering's emitted ops, lowering.check).

    NOTE: a ``TorchDispatchMode`` (``torch.utils._python_dispatch``) pushed inside make_fx's proxy
    and fake modes sees each op first and re-dispatches it to them, so the trace is unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[Any, tuple, dict]] = []

    class Recorder(TorchDispatchMode):
        # NOTE: a higher-order op (flex_attention) refuses a mode without this flag; with it the op
        # comes here whole and is re-dispatched, like an aten op, to the modes below.
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            calls.append((func, args, kwargs))
            return func(*args, **kwargs)

    with Recorder():
        yield calls



@contextlib.contextmanager
def random_ops_through(hook):
    """Inside, every op that draws random numbers (tagged ``nondeterministic_seeded``: dropout, rand,
    randn, randint, bernoulli, multinomial, ``uniform_``...) runs as ``hook(op, args, kwargs)``, on
    this thread only; every other op runs as it is.

    NOTE: the ``TorchDispatchMode`` stack (``torch.utils._python_dispatch``) is thread-local, so each
    simulated rank's thread pushes its own; ops a lowering emits under ``recording_dispatch`` come here
    when that inner mode re-dispatches them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Random(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                return hook(func, args, kwargs)
            return func(*args, **kwargs)

    with Random():
        yield

# flex_attention, as Dynamo hands it over: a higher-order op whose score_mod and mask_mod are
# subgraphs (get_attr GraphModules) of the graph that calls it.
# NOTE: torch 2.13's argument layout (trace_flex_attention, torch/_higher_order_ops/flex_attention.py),
# every argument positional: (q, k, v, score_mod, block_mask, scale, kernel_options,
# score_mod_other_buffers, mask_mod_other_buffers). block_mask is BlockMask.as_tuple(): (Q_LEN, KV_LEN,
# kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
# full_q_num_blocks, full_q_indices, <dQ write-order metadata: 4 optional entries>, Q_BLOCK_SIZE,
# KV_BLOCK_SIZE, mask_mod); those eight block tensors are [B, H, ...] (H 1: one mask for every head).
# score_mod(score, b, h, q_idx, kv_idx, *buffers) and mask_mod(b, h, q_idx, kv_idx, *buffers) get the
# query head index h as a 0-d int tensor; outputs: (out [B, H, L, Ev], logsumexp [B, H, L], max [B, H, L]).
FLEX_ATTENTION = torch.ops.higher_order.flex_attention
FLEX_SCORE_MOD, FLEX_BLOCK_MASK, FLEX_SCORE_BUFFERS, FLEX_MASK_BUFFERS = 3, 4, 7, 8
FLEX_BLOCK_TENSORS = range(2, 10)  # in block_mask; what lies between them and the block sizes: dQ metadata
FLEX_SCORE_HEAD, FLEX_MASK_HEAD = 2, 1  # h's position among score_mod's / mask_mod's arguments


def subgraph(node: Any) -> torch.fx.GraphModule | None:
    """The GraphModule a get_attr node names (a higher-order op's score_mod / mask_mod)."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return None
    found = getattr(node.graph.owning_module, str(node.target), None)
    return found if isinstance(found, torch.fx.GraphModule) else None
