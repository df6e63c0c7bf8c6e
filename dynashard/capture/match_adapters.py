"""Low-rank updates (LoRA): ``base(x) + s * B(A(dropout(x)))``, found in the aten graph.

Before (PEFT's ``lora.Linear``, one adapter; views around each mm elided)::

    y = mm(x, t(W))                      base layer
    h = mm(dropout(x), t(A))             A: [r, in], r << in
    u = mm(h, t(B))                      B: [out, r]
    z = add(y, mul(u, s))
After: a :class:`LowRankUpdate` per adapter, keyed by each of its three linears' nodes. The plan
cuts A and B by the base's style so that the adapter adds no collective (plan/auto.py):

- colwise base: A whole (its input is replicated), B cut on its output rows like the base; the two
  shards are added locally;
- rowwise base: A cut on its input features like the base (both read the cut input), so A's output
  is this rank's partial sum; B, whole, is linear in it, so B's output is a partial sum too, and it
  joins the base's partial sum before the base's one all_reduce (rules/origins.py, rules/partial.py).

A base whose output is scaled per output feature before the add (torchao's per-row int8 weight-only
linear, gpt-fast's int8: ``mm(x, t(qdata).to(f32)) * scale``, PEFT's ``TorchaoLoraLinear`` on it) is the
same base: the scale is linear in its output, so a rowwise base's partial sums stay partial through it.

An embedding's LoRA (PEFT's ``lora.Embedding``: ``embed(ids) + s * embedding(A.T, ids) @ B.T``) has no A linear: A
is a table looked up by the base's ids. Its update has ``a`` None; B is held whole (plan/auto.py), applied to the
whole lookup of A (``r`` features a token), and added after the base's all_reduce: no collective.

Several adapters on one layer chain their adds (``(y + s1 u1) + s2 u2``): each add's base is the
previous add. Found by structure, not by name: any model whose graph has this shape (A and B
matched linears, A's output read only by B, r below both outer widths, the sum added to a linear of
the same input) is treated alike.

Invariants: a pure analysis (nothing is mutated); a wrong guess costs a collective, never a wrong
value (a partial sum read by anything else is all-reduced first).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from dynashard.capture.records import EMBEDDING, LinearMatch
from dynashard.layout.nodes import val

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# what may sit between x and A's input: dropout (``native_dropout(x)[0]``), PEFT's dtype cast, a copy
_INPUT_PATH = (*_VIEWS, aten.native_dropout.default, aten._to_copy.default, aten.clone.default,
               aten.alias.default)
# what may scale B's output on its way to the add: a number (PEFT's ``* scaling``), a cast
_SIZES = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default)
_SCALES = (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten._to_copy.default)


@dataclasses.dataclass(frozen=True)
class LowRankUpdate:
    base: torch.fx.Node  # the base linear's node, or the add of the adapter before it on the same layer
    base_linear: LinearMatch  # the base layer itself (the first of a chain)
    a: LinearMatch | None  # None: an embedding's LoRA, whose A is a table looked up (_looked_up_table)
    b: LinearMatch
    add: torch.fx.Node  # where the scaled update joins the base's output

    @property
    def rank(self) -> int:
        return self.b.in_features


def _source(node: object, path: tuple = _VIEWS) -> object:
    """``node`` with the ops of ``path`` (and a tuple op's first output) stripped off its front."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is operator.getitem and node.args[1] == 0 \
                and getattr(node.args[0], "target", None) in path:
            node = node.args[0]
        elif node.target in path:
            node = node.args[0]
        else:
            break
    return node


def _feature_scale(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``user`` is ``node * s`` (``s * node``), ``s`` one number or one value per output feature of ``node``
    (``[out]``, ``[1, out]``): linear in ``node`` (a per-row quantized linear's scales on its output)."""
    if user.target is not aten.mul.Tensor or len(user.args) != 2 or user.kwargs or node not in user.args:
        return False
    other = user.args[1] if user.args[0] is node else user.args[0]
    out, scale = val(node), val(other)
    if out is None or scale is None or other is node or out.dim() == 0:
        return False
    return scale.numel() == 1 or (scale.dim() <= out.dim() and tuple(scale.shape[:-1]) == (1,) * (scale.dim() - 1)
                                  and scale.shape[-1] == out.shape[-1])


def _base_source(node: object) -> object:
    """``node`` with views and per-feature scalings (:func:`_feature_scale`) stripped off its front."""
    while isinstance(node, torch.fx.Node):
        node = _source(node)
        scaled = next((a for a in node.args if isinstance(a, torch.fx.Node) and _feature_scale(node, a)), None) \
            if isinstance(node, torch.fx.Node) and node.op == "call_function" else None
        if scaled is None:
            break
        node = scaled
    return node


def _looked_up_table(node: object) -> torch.fx.Node | None:
    """The ids of ``node`` when it is ``embedding(A.T, ids)``, A a graph input (PEFT's ``lora_embedding_A``)."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.embedding.default):
        return None
    table = node.args[0]
    transposed = isinstance(table, torch.fx.Node) and (
        table.target is aten.t.default or (table.target is aten.permute.default and list(table.args[1]) == [1, 0])
        or (table.target is aten.transpose.int and sorted(d % 2 for d in table.args[1:3]) == [0, 1]))
    return node.args[1] if transposed and table.args[0].op == "placeholder" else None


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s users but size queries (``sym_size`` under dynamic shapes reads no values)."""
    return [u for u in node.users if u.target not in _SIZES]


def _only_into(node: torch.fx.Node, target: torch.fx.Node, depth: int = 3) -> bool:
    """Every reader of ``node`` is ``target``, or a view read only that way."""
    users = _readers(node)
    return bool(users) and all(u is target or (u.target in _VIEWS and depth > 0 and _only_into(u, target, depth - 1))
                               for u in users)


def _scaled_into_add(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(the add, the add's other operand) where ``node`` reaches an out-of-place add through views
    and scalings by a number, each its one reader."""
    for _ in range(6):
        users = _readers(node)
        if len(users) != 1:
            return None
        (user,) = users
        if user.target is aten.add.Tensor and len(user.args) == 2 and not user.kwargs:
            other = user.args[1] if user.args[0] is node else user.args[0]
            return (user, other) if isinstance(other, torch.fx.Node) and other is not node else None
        # (a number, or under dynamic shapes a symbolic float Dynamo made of it: no tensor value)
        scalar = user.target in _SCALES and user.args[0] is node and all(
            val(a) is None for a in user.args[1:]) and (not user.kwargs or user.target is aten._to_copy.default)
        if user.target not in _VIEWS and not scalar:
            return None
        node = user
    return None


def find_low_rank_updates(graph: torch.fx.Graph, linears: dict[torch.fx.Node, LinearMatch]
                          ) -> dict[torch.fx.Node, LowRankUpdate]:
    """Every low-rank update in ``graph``, keyed by its base's, A's and B's nodes (and its add)."""
    found: dict[torch.fx.Node, LowRankUpdate] = {}
    for node in graph.nodes:  # in order: an update's base may be an earlier update's add
        b = linears.get(node)
        if b is None or b.kind.weight_dims or b.bias is not None:
            continue
        a = linears.get(_source(b.input))
        ids = _looked_up_table(_source(b.input)) if a is None else None
        if ids is not None:  # an embedding's LoRA
            if not (b.in_features < b.out_features and _only_into(_source(b.input), b.input)):
                continue
        elif a is None or a.kind.weight_dims or a.bias is not None or (
                a.node is not b.input and not _only_into(a.node, b.input)):
            continue
        elif not (a.out_features == b.in_features and a.out_features < a.in_features
                  and a.out_features < b.out_features):
            continue
        joined = _scaled_into_add(b.node)
        if joined is None:
            continue
        add, other = joined
        base = _base_source(other)
        earlier = found.get(base) if base in found and found[base].add is base else None
        base_linear = earlier.base_linear if earlier is not None else linears.get(base)
        if base_linear is None or base_linear is a or base_linear is b or base_linear.out_features != b.out_features:
            continue
        if a is None and (base_linear.kind is not EMBEDDING or _source(base_linear.input) is not _source(ids)):
            continue
        if a is not None and _source(base_linear.input, _INPUT_PATH) is not _source(a.input, _INPUT_PATH):
            continue
        update = LowRankUpdate(base, base_linear, a, b, add)
        for key in (b.node, add) + (() if a is None else (a.node,)) + (() if earlier is not None else (base,)):
            found[key] = update
    return found


def joins_update(node: torch.fx.Node, updates: dict[torch.fx.Node, LowRankUpdate], depth: int = 3) -> bool:
    """Every reader of ``node`` (through views) is the add of an update whose base ``node`` is."""
    users = _readers(node)
    return bool(users) and all(
        ((u.target in _VIEWS or _feature_scale(u, node)) and depth > 0 and joins_update(u, updates, depth - 1))
        or (u in updates and updates[u].add is u and _base_source(updates[u].base) is _base_source(node))
        for u in users)
