"""Match: find every linear computation on a weight parameter in an aten graph, in one record.

Before (what AOT-level tracing makes of ``nn.Linear``, ``F.linear``, ``x @ W.t() + b``,
``torch.matmul(x, W.T)`` and HF Conv1D's ``torch.addmm(b, x2d, W)``)::

    t = aten.t(W)            # or aten.permute(W, [1, 0]) / aten.transpose(W, 0, 1), or W itself
    y = aten.addmm(b, x, t)  # or aten.mm(x, t); N-D inputs arrive through aten.view

After: one :class:`LinearMatch` per mm/addmm whose second operand is a weight parameter, used
directly ("in_out", W stored [in, out]) or through one transpose ("out_in", W stored [out, in]),
and through at most one dtype conversion on either side of it (``torch.autocast`` traces
``t(_to_copy(W, dtype=bf16))``: the conversion of this rank's shard is this rank's part of it).

Embeddings (``aten.embedding(W, ids, padding_idx, scale_grad_by_freq, sparse)``) are matched
too, as a linear on one-hot ids: the vocabulary is the input dim, so "rowwise" is Megatron's
vocab-parallel embedding and a weight tied to a colwise LM head is split on the same dim by both.
``F.embedding(..., max_norm=m)`` first renormalises the rows it looks up in place
(``embedding_renorm_(detach(W), ids, m, p)``); that renorm belongs to the match.

Experts (mixture-of-experts weights stacked in one 3-D parameter, one ``[out, in]`` or ``[in, out]``
weight per expert) are matched in :mod:`dynashard.capture.match_experts`, as records of the same kind
(:mod:`dynashard.capture.records`).

Invariants: matching never mutates the graph; every weight placeholder's other uses are
recorded so the plan can refuse to shard a weight it cannot account for.
"""

from __future__ import annotations

import torch
import torch.fx

from dynashard.capture.linear_forms import converted_source, squeezed_source
from dynashard.capture.match_experts import find_experts
from dynashard.capture.match_normed import normed_source, plan_name, spectral_source
from dynashard.capture.match_quantized import dequantized_source, scaled_mm_source, scaled_source
from dynashard.capture.records import (
    DENSE,
    EMBEDDING,
    Float8Scaled,
    GroupQuantized,
    LinearMatch,
    ParamInfo,
    SpectralNormed,
    WeightNormed,
    plan_name_of,
)
from dynashard.layout.nodes import val

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default, aten._scaled_mm.default)


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


def _weight_path(mat2: torch.fx.Node) -> tuple[torch.fx.Node, tuple[torch.fx.Node, ...], torch.fx.Node | None]:
    """From a matmul's second operand back to what it computes from: (source, the nodes between it and
    the matmul in order, the transpose among them): through one dtype conversion on either side of
    one transpose, each optional, a pointwise Conv1d's squeeze of its [out, in, 1] weight, and
    weight_norm's ``getitem(_weight_norm_interface(v, g), 0)`` of v, spectral_norm's ``div(W, sigma)`` of W."""
    path, node, transpose, converted, squeezed, normed = [], mat2, None, False, False, False
    while True:
        source = converted_source(node) if not converted else None
        if source is not None:
            converted = True
        elif transpose is None and (source := _transposed_source(node)) is not None:
            transpose = node
        elif not squeezed and (source := squeezed_source(node)) is not None:
            squeezed = True
        elif not normed and (found := normed_source(node)) is not None:
            normed = True
            path.append(node)  # (the getitem; the norm op itself is appended below)
            node, source = found[2], found[0]
        elif not normed and (found := spectral_source(node)) is not None:
            normed = True
            source = found[0]
        else:
            return node, tuple(reversed(path)), transpose
        path.append(node)
        node = source


def _quantized(weight: torch.fx.Node, path: tuple[torch.fx.Node, ...]) -> bool:
    """An integer buffer converted to a float dtype on its way to the matmul: a weight-only quantized
    linear as gpt-fast's int8 mode writes it (``F.linear(x, w_int8.to(x.dtype)) * scales``; the
    per-channel scales are a pointwise op on the output). Other buffers (tables, masks) are no weight."""
    v = val(weight)
    return (v is not None and not v.dtype.is_floating_point and not v.dtype.is_complex and v.dtype != torch.bool
            and any(converted_source(n) is weight for n in path))


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
        weight, path, transpose = _weight_path(mat2)
        scaled = scaled_source(weight) if transpose is None and weight not in params else None
        if node.target is aten._scaled_mm.default:  # (float8: the kernel reads the float8 weight and its scale)
            scaled, path = scaled_mm_source(node), ()
            if scaled is None:
                continue
        if scaled is not None:  # (a float8 weight, dequantized transposed: its float8 data is the weight)
            weight, path, transpose = scaled.qdata, (*scaled.path, *path), scaled.transpose
        form = "out_in" if transpose is not None else "in_out"
        grouped = dequantized_source(weight) if transpose is not None and weight not in params else None
        if grouped is not None:  # (a group-wise quantized weight: its integer data is the weight)
            weight, path = grouped.qdata, (*grouped.path, *path)
        if weight not in params or not (params[weight].is_parameter or scaled or _quantized(weight, path)):
            continue
        shape = weight.meta["val"].shape
        if len(shape) != 2 and not any(squeezed_source(n) is not None for n in path):  # (a 1x1 conv's: checked there)
            continue
        out_f, in_f = (shape[0], shape[1]) if form == "out_in" else (shape[1], shape[0])
        normed = next((found for n in path if (found := normed_source(n)) is not None), None)
        spectral = next((found[1] for n in path if (found := spectral_source(n)) is not None), None)
        matches.append(
            LinearMatch(
                node=node,
                fqn=(plan_name(params[weight].module_fqn, params[weight].fqn) if normed or spectral
                     else plan_name_of(params[weight])),
                weight=weight,
                weight_form=form,
                transpose=transpose,
                input=node.args[1] if is_addmm else node.args[0],
                bias=node.args[0] if is_addmm else _scaled_mm_bias(node),
                in_features=int(in_f),
                out_features=int(out_f),
                operand_path=path,
                kind=(WeightNormed(normed[3]) if normed else SpectralNormed(spectral) if spectral
                      else GroupQuantized(grouped) if grouped is not None
                      else Float8Scaled(scaled) if scaled is not None else DENSE),
                companions=((normed[1],) if normed else grouped.companions if grouped is not None
                            else (scaled.scale,) if scaled is not None and scaled.scale is not None else ()),
            )
        )
    order = {n: i for i, n in enumerate(graph.nodes)}
    matches = sorted(matches + _embeddings(graph, params) + find_experts(graph, params), key=lambda m: order[m.node])
    return matches, _other_uses(matches)


def _scaled_mm_bias(node: torch.fx.Node) -> torch.fx.Node | None:
    """``_scaled_mm``'s bias (its fifth argument), None for ``mm``."""
    if node.target is not aten._scaled_mm.default:
        return None
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("bias")


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
            LinearMatch(node=node, fqn=plan_name_of(params[weight]), weight=weight, weight_form="in_out",
                        transpose=None, input=ids, bias=None, in_features=int(vocab), out_features=int(dim),
                        kind=EMBEDDING, renorm=_renorm_before(weight, ids))
        )
    return found


def _renorm_before(weight: torch.fx.Node, ids: torch.fx.Node) -> torch.fx.Node | None:
    """The ``embedding_renorm_(detach(W), ids, max_norm, norm_type)`` that ``F.embedding`` with
    ``max_norm`` runs just before this lookup, on the same ids (None if there is none).

    NOTE: torch 2.14's make_fx records ``F.embedding``'s ``weight.detach()`` as ``aten.alias`` (2.13: ``detach``)."""
    for user in weight.users:
        if user.op != "call_function" or user.target not in (aten.detach.default, aten.alias.default):
            continue
        for renorm in user.users:
            if renorm.target is aten.embedding_renorm_.default and renorm.args[0] is user and renorm.args[1] is ids:
                return renorm
    return None


def _other_uses(matches: list[LinearMatch]) -> dict[torch.fx.Node, list[str]]:
    """Uses of each matched weight outside a matched linear (a tied embedding, a norm, ...)."""
    allowed: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for m in matches:
        path = [m.weight, *_between(m), m.node]
        paths = [path] + ([[m.weight, m.renorm.args[0], m.renorm]] if m.renorm is not None else [])
        if isinstance(m.kind, SpectralNormed):  # W's other reads, each lowered on the cut
            paths += [[m.weight, n] for n in m.kind.reads.nodes if m.weight in n.args]
        for p in paths:
            for here, nxt in zip(p, p[1:]):
                allowed.setdefault(here, set()).add(nxt)
    other: dict[torch.fx.Node, list[str]] = {}
    for m in matches:
        found = []
        renorm_path = [m.renorm.args[0]] if m.renorm is not None else []
        for here in [m.weight, *_between(m), *renorm_path]:
            found += [_reader(here, u) for u in here.users if u not in allowed[here]]
        other[m.weight] = sorted(set(found))
    return other


def _reader(value: torch.fx.Node, reader: torch.fx.Node) -> str:
    """How a reason names ``reader``: its op, and why a computed weight is a graph output."""
    if reader.op == "output" and isinstance(value.args[0] if value.args else None, torch.fx.Node) \
            and value.args[0].target is aten._weight_norm_interface.default:
        return ("output (weight_norm's weight, which the deprecated torch.nn.utils.weight_norm's hook stores "
                "on the module: its torch.nn.utils.parametrizations.weight_norm form is cut)")
    return str(reader.target)


def _between(m: LinearMatch) -> list[torch.fx.Node]:
    """The nodes from a match's weight to its matmul."""
    if m.operand_path:
        return list(m.operand_path)
    return [*([m.transpose] if m.transpose is not None else []), *m.chain]
