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
weight per expert) are matched in :mod:`dynashard.match_experts`, as records of the same kind.

Invariants: matching never mutates the graph; every weight placeholder's other uses are
recorded so the plan can refuse to shard a weight it cannot account for.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

from dynashard.linear_forms import converted_source as _converted_source
from dynashard.linear_forms import squeezed_source
from dynashard.match_normed import Spectral, normed_source, plan_name, spectral_source
from dynashard.match_quantized import Dequantized, dequantized_source, groups_of
from dynashard.nodes import val
from dynashard.split import Split

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default)


class LinearKind:
    """What a matched computation is: the plan, the rules and the checks ask it, never its name.
    A dense linear (``nn.Linear``, ``x @ W.t()``, Conv1D) is the base kind."""

    name = "linear"
    weight_dims = 0  # weight dims in front of [out, in] (experts: one per expert)
    cuts_bias = True  # a colwise bias only colwise layers read is held cut with the weight
    experts = False  # one weight per expert: a loop's uses W[e] are re-cut together

    def __str__(self) -> str:
        return self.name

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        """Why this kind stays whole under weights="per_rank" (``stacked``) or inputs="per_rank"."""
        return None

    def auto_style(self, reduce: str) -> tuple[str, str] | None:
        """The auto plan's style and reason for this kind whatever its input (None: by pairing)."""
        return None

    def sparse(self, node: torch.fx.Node) -> bool:
        """Its backward makes sparse gradients (``embedding(..., sparse=True)``)."""
        return False

    def refused_dim(self, dim: int, per_rank: bool = False) -> str | None:
        """Why this kind's weight may not be cut on its ``dim`` (None: it may); ``per_rank``: under
        inputs="per_rank"."""
        return None

    def cuts_companions(self, dim: int) -> bool:
        """Whether the parameters its path reads besides the weight (``companions``) are cut with the
        weight when it is cut on ``dim``."""
        return True

    def refused_world(self, dim: int, world: int) -> str | None:
        """Why its weight may not be cut on ``dim`` over ``world`` ranks (None: it may)."""
        return None

    def refused_input(self, split: Split, world: int) -> str | None:
        """Why the auto plan should not cut it rowwise on an input cut by ``split`` (None: it may)."""
        return None

    def companion_split(self, dim: int, in_dim: int, split: Split, world: int) -> Split:
        """How the companions are cut when the weight is cut by ``split`` on ``dim`` (``in_dim``: its input dim)."""
        return split


class Embedding(LinearKind):
    """A lookup is ``one_hot(ids) @ W``, W stored ``[in=vocab, out]``: rowwise is vocab-parallel."""

    name = "embedding"
    cuts_bias = False

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        return "with weights='per_rank' every rank's own embedding stays whole" if stacked else None

    def auto_style(self, reduce: str) -> tuple[str, str] | None:
        return "rowwise", f"vocab-parallel embedding: masked local lookup, one {reduce}"

    def sparse(self, node: torch.fx.Node) -> bool:
        return embedding_options(node)[2]


class Experts(LinearKind):
    """One ``[out, in]`` weight per expert in a 3-D parameter, cut alike in every expert."""

    name = "experts"
    weight_dims = 1
    cuts_bias = False
    experts = True

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        if stacked or per_rank:
            return f"experts do not support {'weights' if stacked else 'inputs'}='per_rank' yet"
        return None


class WeightNormed(LinearKind):
    """``weight_norm``'s v and g (match_normed.py): v and g cut alike on the dim its norms are per slice
    of; v cut on the other dim (across the norms), g whole, and each norm's sum of squares all-reduced."""

    name = "weight_norm"

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        return "weight_norm's v and g stay whole under weights='per_rank'" if stacked else None

    def refused_dim(self, dim: int, per_rank: bool = False) -> str | None:
        if dim == self.dim or not per_rank:
            return None
        return (f"weight_norm(dim={self.dim}) divides each slice by a norm summed over weight dim {dim}, "
                f"and a cut there sums the norms over the ranks, which inputs='per_rank' does not support "
                f"(a cut on dim {self.dim} is exact)")

    def cuts_companions(self, dim: int) -> bool:
        return dim == self.dim  # (g is [out, 1] or [1, in]: nothing of it lies along the other dim)


class SpectralNormed(LinearKind):
    """``spectral_norm``'s W (match_normed.py): cut either way, sigma and the power steps on the cut."""

    name = "spectral_norm"

    def __init__(self, reads: Spectral) -> None:
        self.reads = reads

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        if stacked or per_rank:
            return f"spectral_norm's W stays whole under {'weights' if stacked else 'inputs'}='per_rank'"
        return None


class GroupQuantized(LinearKind):
    """An integer weight dequantized by groups of input columns (match_quantized.py): its scale and zero point
    (``companions``, ``[out, in / group]``) cut with its rows, or with its columns in whole groups."""

    name = "group-quantized"

    def __init__(self, source: Dequantized) -> None:
        self.source, self.group = source, source.group

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        if self.source.refused is not None:
            return self.source.refused
        if stacked or per_rank:
            return (f"quantized by groups of {self.group} input columns: kept whole under "
                    f"{'weights' if stacked else 'inputs'}='per_rank' (cut under the default 'replicated')")
        return None

    def refused_world(self, dim: int, world: int) -> str | None:
        groups = self.source.qdata.meta["val"].shape[1] // self.group
        if dim == 1 and groups < world:  # (its columns: [out, in] qdata)
            return (f"its {groups} group(s) of {self.group} input columns (the unit of its quantization) cannot give "
                    f"all {world} ranks some")
        return None

    def refused_input(self, split: Split, world: int) -> str | None:
        if groups_of(split, self.group, world) is not None:
            return None
        k = math.lcm(split.unit, self.group) // split.unit
        coarser = split.coarsen(k)
        if coarser is not None and coarser.fewest_units(world) >= 1:
            return None  # (rules/quantized.py asks its input's origins for whole groups)
        return (f"quantized by groups of {self.group} input columns, and its input cannot be cut in whole groups "
                f"over {world} ranks ({split.size} features in units of {split.unit})")

    def companion_split(self, dim: int, in_dim: int, split: Split, world: int) -> Split:
        """How the scale and zero point are cut when the weight is cut by ``split`` on ``dim``."""
        if dim != in_dim:
            return split
        groups = groups_of(split, self.group, world)
        assert groups is not None, f"columns cut across groups of {self.group}: {split}"  # (rules/quantized.py)
        return groups


DENSE, EMBEDDING, EXPERTS = LinearKind(), Embedding(), Experts()


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter placeholder: its FQN as in the compiled module's ``named_parameters()``."""

    fqn: str
    module_fqn: str
    is_parameter: bool
    inner: str = ""  # an inner tensor of a subclass parameter (torchao's "qdata", "scale"): fqn ends with it


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
    kind: LinearKind = DENSE
    # experts: the nodes from the 3-D weight to the matmul (expert selection, transposes), the dim of
    # ``input`` that is contracted and the output dim that holds output features (from the end)
    chain: tuple[torch.fx.Node, ...] = ()
    experts: int = 0
    input_dim: int = -1
    output_dim: int = -1
    # embedding with max_norm: the in-place ``embedding_renorm_`` of the looked-up rows, on ``detach(W)``
    renorm: torch.fx.Node | None = None
    # linear: the nodes from the weight to the matmul, in order (a dtype conversion, the transpose)
    operand_path: tuple[torch.fx.Node, ...] = ()
    # parameters the path reads besides the weight, cut with it on the same dim where the kind
    # cuts them (weight_norm's g: cut on its norm dim, whole on the other)
    companions: tuple[torch.fx.Node, ...] = ()

    @property
    def operand(self) -> torch.fx.Node:
        """What the matmul reads: the weight, or the last node of its path (this rank's part, once cut)."""
        return self.operand_path[-1] if self.operand_path else self.weight

    @property
    def out_dim(self) -> int:
        """The weight dim that holds output features (sharded by colwise)."""
        return (0 if self.weight_form == "out_in" else 1) + self.kind.weight_dims

    @property
    def in_dim(self) -> int:
        return (1 if self.weight_form == "out_in" else 0) + self.kind.weight_dims

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features * max(1, self.experts)


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
        source = _converted_source(node) if not converted else None
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
            and any(_converted_source(n) is weight for n in path))


def _plan_name(info: ParamInfo) -> str:
    fqn = info.fqn.removesuffix(f".{info.inner}") if info.inner else info.fqn  # (a quantized weight's qdata)
    return info.module_fqn if fqn.endswith(".weight") or fqn == "weight" else fqn


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
        form = "out_in" if transpose is not None else "in_out"
        grouped = dequantized_source(weight) if transpose is not None and weight not in params else None
        if grouped is not None:  # (a group-wise quantized weight: its integer data is the weight)
            weight, path = grouped.qdata, (*grouped.path, *path)
        if weight not in params or not (params[weight].is_parameter or _quantized(weight, path)):
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
                     else _plan_name(params[weight])),
                weight=weight,
                weight_form=form,
                transpose=transpose,
                input=node.args[1] if is_addmm else node.args[0],
                bias=node.args[0] if is_addmm else None,
                in_features=int(in_f),
                out_features=int(out_f),
                operand_path=path,
                kind=(WeightNormed(normed[3]) if normed else SpectralNormed(spectral) if spectral
                      else GroupQuantized(grouped) if grouped is not None else DENSE),
                companions=(normed[1],) if normed else grouped.companions if grouped is not None else (),
            )
        )
    from dynashard.match_experts import find_experts  # (it builds this module's records)

    order = {n: i for i, n in enumerate(graph.nodes)}
    matches = sorted(matches + _embeddings(graph, params) + find_experts(graph, params), key=lambda m: order[m.node])
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


def embedding_options(node: torch.fx.Node) -> tuple[int, bool, bool]:
    """``(padding_idx, scale_grad_by_freq, sparse)`` of an ``aten.embedding`` node (-1: no padding;
    ``F.embedding`` already turned a negative padding index into its row)."""
    names, defaults = ("padding_idx", "scale_grad_by_freq", "sparse"), (-1, False, False)
    given = node.args[2:5]
    out = [given[i] if i < len(given) else node.kwargs.get(n, d) for i, (n, d) in enumerate(zip(names, defaults))]
    return int(out[0]), bool(out[1]), bool(out[2])


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
