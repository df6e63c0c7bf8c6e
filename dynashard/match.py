"""Match: find every linear computation on a weight parameter in an aten graph, in one record.

Before (what AOT-level tracing makes of ``nn.Linear``, ``F.linear``, ``x @ W.t() + b``,
``torch.matmul(x, W.T)`` and HF Conv1D's ``torch.addmm(b, x2d, W)``)::

    t = aten.t(W)            # or aten.permute(W, [1, 0]) / aten.transpose(W, 0, 1), or W itself
    y = aten.addmm(b, x, t)  # or aten.mm(x, t); N-D inputs arrive through aten.view

After: one :class:`LinearMatch` per mm/addmm whose second operand is a weight parameter, used
directly ("in_out", W stored [in, out]) or through one transpose ("out_in", W stored [out, in]).

Embeddings (``aten.embedding(W, ids)``) are matched too, as a linear on one-hot ids: the
vocabulary is the input dim, so "rowwise" is Megatron's vocab-parallel embedding and a weight
tied to a colwise LM head is split on the same dim by both.

Invariants: matching never mutates the graph; every weight placeholder's other uses are
recorded so the plan can refuse to shard a weight it cannot account for.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default)


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter placeholder: its FQN as in the compiled module's ``named_parameters()``."""

    fqn: str
    module_fqn: str
    is_parameter: bool


@dataclasses.dataclass(frozen=True)
class LinearMatch:
    """One linear computation ``y = x @ W' (+ b)`` normalised from whatever the model wrote."""

    node: torch.fx.Node  # the aten.mm / aten.addmm
    fqn: str  # the name plans use: the owning module's FQN (or the parameter's, if not "weight")
    weight: torch.fx.Node  # the weight placeholder
    weight_form: str  # "out_in" (used transposed, nn.Linear) or "in_out" (used as is, Conv1D)
    transpose: torch.fx.Node | None
    input: torch.fx.Node
    bias: torch.fx.Node | None
    in_features: int
    out_features: int
    kind: str = "linear"  # or "embedding": a lookup is one_hot(ids) @ W, W stored [in=vocab, out]

    @property
    def out_dim(self) -> int:
        """The weight dim that holds output features (sharded by colwise)."""
        return 0 if self.weight_form == "out_in" else 1

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim


def _transposed_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The 2-D tensor that ``node`` transposes, if it is exactly a 2-D transpose."""
    if node.op != "call_function":
        return None
    if node.target is aten.t.default:
        return node.args[0]
    if node.target is aten.permute.default and list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
        return node.args[0]
    if node.target is aten.transpose.int and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]:
        return node.args[0]
    return None


def _plan_name(info: ParamInfo) -> str:
    return info.module_fqn if info.fqn.endswith(".weight") or info.fqn == "weight" else info.fqn


def find_linears(
    graph: torch.fx.Graph, params: dict[torch.fx.Node, ParamInfo]
) -> tuple[list[LinearMatch], dict[torch.fx.Node, list[str]]]:
    """All linears on parameters in ``graph``, and for each parameter its uses that are not one.

    Returns ``(matches, other_uses)`` where ``other_uses[weight]`` lists the ops (by name)
    that read a matched weight in any way besides a matched linear.
    """
    matches: list[LinearMatch] = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        is_addmm = node.target is aten.addmm.default
        if is_addmm and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
            continue  # a scaled addmm is not a linear layer; it stays as written
        mat2 = node.args[2] if is_addmm else node.args[1]
        source = _transposed_source(mat2)
        weight, form, transpose = (source, "out_in", mat2) if source is not None else (mat2, "in_out", None)
        if weight not in params or not params[weight].is_parameter:
            continue
        shape = weight.meta["val"].shape
        if len(shape) != 2:
            continue
        out_f, in_f = (shape[0], shape[1]) if form == "out_in" else (shape[1], shape[0])
        matches.append(
            LinearMatch(
                node=node,
                fqn=_plan_name(params[weight]),
                weight=weight,
                weight_form=form,
                transpose=transpose,
                input=node.args[1] if is_addmm else node.args[0],
                bias=node.args[0] if is_addmm else None,
                in_features=int(in_f),
                out_features=int(out_f),
            )
        )
    order = {n: i for i, n in enumerate(graph.nodes)}
    matches = sorted(matches + _embeddings(graph, params), key=lambda m: order[m.node])
    return matches, _other_uses(matches)


def _embeddings(graph: torch.fx.Graph, params: dict[torch.fx.Node, ParamInfo]) -> list[LinearMatch]:
    """``aten.embedding(W, ids)`` on a parameter, as a linear on one-hot ids (W in "in_out" form)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        weight, ids = node.args[0], node.args[1]
        if weight not in params or not params[weight].is_parameter or weight.meta["val"].dim() != 2:
            continue
        vocab, dim = weight.meta["val"].shape
        found.append(
            LinearMatch(node=node, fqn=_plan_name(params[weight]), weight=weight, weight_form="in_out",
                        transpose=None, input=ids, bias=None, in_features=int(vocab), out_features=int(dim),
                        kind="embedding")
        )
    return found


def _other_uses(matches: list[LinearMatch]) -> dict[torch.fx.Node, list[str]]:
    """Uses of each matched weight outside a matched linear (a tied embedding, a norm, ...)."""
    allowed: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for m in matches:
        allowed.setdefault(m.weight, set()).add(m.transpose or m.node)
        if m.transpose is not None:
            allowed.setdefault(m.transpose, set()).add(m.node)
    other: dict[torch.fx.Node, list[str]] = {}
    for m in matches:
        found = []
        for user in m.weight.users:
            if user not in allowed[m.weight]:
                found.append(str(user.target))
            elif user is m.transpose:
                found += [str(u.target) for u in user.users if u not in allowed[user]]
        other[m.weight] = sorted(set(found))
    return other
