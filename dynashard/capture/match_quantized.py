"""Group-wise quantized linears: an integer weight dequantized by groups of input columns before the matmul.

Before (torchao's ``Int8WeightOnlyConfig(granularity=PerGroup(g))`` and ``IntxWeightOnlyConfig(weight_dtype=
torch.int4, granularity=PerGroup(g))`` on CPU, flattened by subclass_inputs.py; both hold qdata int8 ``[out, in]``
(int4 values unpacked one per byte), scale float ``[out, in / g]``, zero_point int8 ``[out, in / g]``, and
``block_size (1, g)``)::

    q3 = aten.view(qdata, [out, G, g]); z3 = aten.view(zero_point, [out, G, 1]); s3 = aten.view(scale, [out, G, 1])
    w = aten.view(aten.mul(aten.sub(q3.to(f32), z3.to(f32)), s3), [out, in])    # (no sub: symmetric)
    y = aten.mm(x, aten.t(w))

(one group a row, ``g = in``: ``PerAxis(0)`` or ``PerGroup(in)``, the views are ``[out, in]`` and ``[out, 1]``.)

After: one :class:`~dynashard.capture.records.LinearMatch` on ``qdata`` (its path: the dequantization, then ``t``) of
kind :class:`~dynashard.capture.records.GroupQuantized`, whose companions are scale and zero_point. A cut of the
weight's rows (colwise) never splits a group: qdata, scale and zero_point are cut alike on dim 0. A cut of its
columns (rowwise) is exact only where every rank's columns are whole groups: then scale and zero_point are cut
on dim 1 by the same split counted in groups (:func:`groups_of`), and the rowwise rule asks the partner that
feeds it for units of whole groups (plan/rules/origins.py). The dequantization's views name the whole weight's
sizes; each is re-emitted at this rank's (:func:`~dynashard.plan.rules.quantized.dequantization_resizes`).

Invariants: a cut is only lowered when everything the dequantization reads is one of these three inner tensors,
read nowhere else (:attr:`Dequantized.refused` otherwise: the layer is kept whole with that reason); a split
of the columns that is not in whole groups is never used (:func:`groups_of` answers None).

(Per-row int8, torchao's default, is no group form: ``mm(x, t(qdata).to(f32)) * scale``, gpt-fast's int8
form, matched and cut in match.py.)

Float8 weight-only (torchao's ``Float8WeightOnlyConfig``: ``Float8Tensor``, qdata float8 ``[out, in]``, scale f32
``[out, 1]`` per row (``PerRow()``, the default) or ``[1, 1]`` (``PerTensor()``)) dequantizes the transposed weight
before the matmul, no views (:func:`scaled_source`)::

    w = aten.mul(aten._to_copy(aten.t(qdata), dtype=f32), aten.t(scale))     # (then ._to_copy(bf16) for bf16)
    y = aten.mm(x, w)

One :class:`~dynashard.capture.records.LinearMatch` on ``qdata`` of kind ``Float8Scaled``: rows cut with their
scales (colwise), columns cut with every scale whole (rowwise: a row's scale covers all its columns); a scale
for the whole tensor is held whole either way. Every rank dequantizes its elements exactly as the unsharded
model does. ``PerGroup(g)`` expands its ``[out, in / g]`` scales through views of fixed sizes: matched, kept whole
with that reason (``Scaled.refused``).

Float8 with dynamic float8 activations (``Float8DynamicActivationFloat8WeightConfig``, the same ``Float8Tensor``
with the input quantized in the graph) multiplies in float8 (:func:`scaled_mm_source`)::

    xq = to(clamp(x / x_scale), float8); y = aten._scaled_mm(xq, aten.t(qdata), x_scale, aten.t(scale), bias, ...)

matched on qdata with the same companions. The input's scale (``amax`` over the whole input, or over each row's
features) is computed before the matmul from the input as the graph holds it: a rowwise layer's cut input is
gathered for that ``amax`` (rules/reductions.py), so each rank quantizes its features with the whole row's scale.
A float weight cast to float8 in the graph (torchao's training ``Float8Linear``: the weight's scale is the max over
the whole weight, a cut would take each rank's own) is matched and kept whole with that reason.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from dynashard.capture.linear_forms import converted_source
from dynashard.layout.split import Split

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Dequantized:
    qdata: torch.fx.Node
    path: tuple[torch.fx.Node, ...]  # from qdata's view to the [out, in] view, in order
    group: int
    companions: tuple[torch.fx.Node, ...] = ()  # scale, then zero_point if subtracted: [out, G] placeholders
    views: tuple[torch.fx.Node, ...] = ()  # the [out, G, g] / [out, G, 1] views of qdata and companions
    refused: str | None = None  # why no cut of it is lowered (something else in the dequantization)


def _view_of(node: torch.fx.Node) -> torch.fx.Node | None:
    is_view = node.op == "call_function" and node.target in (aten.view.default, aten.reshape.default)
    return node.args[0] if is_view else None


def _grouped_input(node: object, shape: tuple[int, int, int]) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(placeholder, view)`` when ``node`` is ``view(p, shape)`` of a 2-D placeholder ``p`` read by that view
    alone, the view read once (a scale or a zero point is then this dequantization's only)."""
    if not isinstance(node, torch.fx.Node):
        return None
    p = _view_of(node)
    if p is None or p.op != "placeholder" or len(p.users) != 1 or len(node.users) != 1:
        return None
    v = node.meta.get("val")
    if v is None or tuple(v.shape) != shape or p.meta["val"].dim() != 2:
        return None
    return p, node


def dequantized_source(node: torch.fx.Node) -> Dequantized | None:
    """The integer weight ``node`` dequantizes by groups (module docstring), if it is exactly that."""
    mul = _view_of(node)
    if mul is None or mul.op != "call_function" or mul.target is not aten.mul.Tensor:
        return None
    for operand in mul.args:
        if not isinstance(operand, torch.fx.Node):
            continue
        between, sub = [mul], None
        if operand.op == "call_function" and operand.target is aten.sub.Tensor:  # (minus the zero point)
            between.append(operand)
            sub, operand = operand, operand.args[0]
        grouped = converted_source(operand) if isinstance(operand, torch.fx.Node) else None
        qdata = _view_of(grouped) if grouped is not None else None
        if qdata is None or qdata.op != "placeholder" or qdata.meta["val"].dtype.is_floating_point:
            continue
        shape, whole = tuple(grouped.meta["val"].shape), tuple(qdata.meta["val"].shape)
        if qdata.meta["val"].dim() != 2 or len(shape) != 3 and shape != whole:  # ([out, in]: one group a row)
            continue
        path = (grouped, operand, *reversed(between), node)
        return _with_companions(Dequantized(qdata, path, int(shape[-1])), mul, operand, sub)
    return None


def _with_companions(found: Dequantized, mul: torch.fx.Node, converted: torch.fx.Node, sub: torch.fx.Node | None
                     ) -> Dequantized:
    """``found`` with its scale and zero point, or with the reason a cut of it would not be exact."""
    out, in_f = (int(s) for s in found.qdata.meta["val"].shape)
    groups, g = in_f // found.group, found.group
    whole = tuple(int(s) for s in found.path[-1].meta["val"].shape)
    per_group = (out, groups, 1) if found.path[0].meta["val"].dim() == 3 else (out, 1)
    left = [a for a in mul.args if a is not (sub if sub is not None else converted)]
    scale = _grouped_input(left[0], per_group) if len(left) == 1 else None
    zero = None
    if sub is not None:
        z = sub.args[1]
        zero = _grouped_input(converted_source(z), per_group) if isinstance(z, torch.fx.Node) \
            and len(z.users) == 1 and converted_source(z) is not None else None
    if in_f % g or whole != (out, in_f) or scale is None or (sub is not None and zero is None) \
            or len(found.path[0].users) != 1:
        return dataclasses.replace(found, refused=(
            f"quantized by groups of {g} input columns, but its dequantization reads more than its integer data, "
            "one [out, in / group] scale and zero point (or views them otherwise): no cut of it is exact"))
    companions = (scale[0],) + ((zero[0],) if zero is not None else ())
    views = (found.path[0], scale[1]) + ((zero[1],) if zero is not None else ())
    return dataclasses.replace(found, companions=companions, views=views)


def groups_of(split: Split, group: int, world: int) -> Split | None:
    """``split`` of a weight's columns counted in groups of ``group`` (how its scales are cut); None unless
    every rank's every piece starts and ends on a group boundary (a cut that would split a group)."""
    if split.unit % group == 0:
        return dataclasses.replace(split, unit=split.unit // group)
    counts = split.counts(world)
    if any(p * split.unit % group for p in split.parts) or any(c * split.unit % group for cs in counts for c in cs):
        return None
    per = split.unit / group
    return Split(tuple(int(p * per) for p in split.parts), 1, split.whole,
                 tuple(tuple(int(c * per) for c in cs) for cs in counts))


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A float8 weight dequantized by one scale a row, or one for the whole tensor (module docstring)."""

    qdata: torch.fx.Node
    transpose: torch.fx.Node  # t(qdata)
    path: tuple[torch.fx.Node, ...]  # t(qdata), its conversion to the scale's dtype, the mul
    scale: torch.fx.Node | None  # the [out, 1] or [1, 1] placeholder (None when refused)
    per_row: bool = False
    refused: str | None = None  # why no cut of it is lowered


def _float8_placeholder(node: object) -> bool:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v is not None and node.op == "placeholder" and v.dim() == 2 and v.dtype in _FLOAT8


_FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                    if hasattr(torch, n))


_UNSCALED = ("a float8 weight whose scales are not one a row nor one for the whole tensor (torchao's PerRow or "
             "PerTensor; PerGroup's are expanded through views of fixed sizes), or are read elsewhere: no cut of it "
             "is lowered")


def _scaled(qdata: torch.fx.Node, transpose: torch.fx.Node, path: tuple[torch.fx.Node, ...], operand: object
            ) -> Scaled:
    """How float8 ``qdata`` is scaled by ``operand`` (``t`` of an ``[out, 1]`` or ``[1, 1]`` placeholder read by
    nothing else), or refused."""
    out = int(qdata.meta["val"].shape[0])
    scale = operand.args[0] if isinstance(operand, torch.fx.Node) and operand.target is aten.t.default else None
    shape = tuple(scale.meta["val"].shape) if isinstance(scale, torch.fx.Node) and "val" in scale.meta else None
    if scale is None or scale.op != "placeholder" or shape not in ((out, 1), (1, 1)) or len(scale.users) != 1 \
            or len(operand.users) != 1:
        return Scaled(qdata, transpose, path, None, refused=_UNSCALED)
    return Scaled(qdata, transpose, path, scale, per_row=shape == (out, 1) and out != 1)


def scaled_source(node: torch.fx.Node) -> Scaled | None:
    """The float8 weight ``node`` dequantizes, ``mul(to(t(qdata)), t(scale))`` (module docstring), if it is that."""
    if node.op != "call_function" or node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    for converted, other in (node.args, node.args[::-1]):
        transpose = converted_source(converted) if isinstance(converted, torch.fx.Node) else None
        if transpose is None or transpose.op != "call_function" or transpose.target is not aten.t.default:
            continue
        qdata = transpose.args[0]
        if _float8_placeholder(qdata) and len(transpose.users) == 1 and len(converted.users) == 1:
            return _scaled(qdata, transpose, (transpose, converted, node), other)
    return None


_FLOAT8_CAST = (aten._to_copy.default, aten.clamp.default, aten.mul.Tensor, aten.t.default)


def scaled_mm_source(node: torch.fx.Node) -> Scaled | None:
    """How a ``_scaled_mm``'s second operand reads its weight (module docstring); None if it reads no 2-D
    placeholder through ``t`` (and, for a weight cast in the graph, pointwise casting ops)."""
    mat2 = node.args[1]
    if len(node.args) < 4 or node.args[5:6] not in ((), (None,)) or not isinstance(mat2, torch.fx.Node):
        return None  # (scale_result: an output scaled again is no linear layer's)
    if mat2.target is aten.t.default and _float8_placeholder(mat2.args[0]) and len(mat2.users) == 1:
        return _scaled(mat2.args[0], mat2, (mat2,), node.args[3])
    walked, cast = mat2, []
    while isinstance(walked, torch.fx.Node) and walked.op == "call_function" and walked.target in _FLOAT8_CAST:
        cast.append(walked)
        walked = walked.args[0]
    transpose = next((n for n in cast if n.target is aten.t.default), None)
    if transpose is None or not isinstance(walked, torch.fx.Node) or walked.op != "placeholder" \
            or walked.meta["val"].dim() != 2 or not walked.meta["val"].dtype.is_floating_point:
        return None
    return Scaled(walked, transpose, tuple(reversed(cast)), None, refused=(
        "a float weight cast to float8 in the graph (torchao's Float8Linear, convert_to_float8_training): its scale "
        "is the max over the whole weight, which a cut would take over each rank's part: kept whole"))
