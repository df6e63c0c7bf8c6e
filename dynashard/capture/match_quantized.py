"""Group-wise quantized linears: an integer weight dequantized by groups of input columns before the matmul.

Before (torchao's ``Int8WeightOnlyConfig(granularity=PerGroup(g))`` and ``IntxWeightOnlyConfig(weight_dtype=
torch.int4, granularity=PerGroup(g))`` on CPU, flattened by subclass_inputs.py; qdata int8 ``[out, in]``,
scale and zero_point ``[out, in / g]``)::

    q3 = aten.view(qdata, [out, G, g]); z3 = aten.view(zero_point, [out, G, 1]); s3 = aten.view(scale, [out, G, 1])
    w = aten.view(aten.mul(aten.sub(q3.to(f32), z3.to(f32)), s3), [out, in])    # (no sub: symmetric)
    y = aten.mm(x, aten.t(w))

After: one :class:`~dynashard.capture.records.LinearMatch` on ``qdata`` (its path: the dequantization, then ``t``) of
kind :class:`GroupQuantized`, held whole on every rank with the reason in ``explain``: the dequantization's
views name the whole weight's shape, and no lowering re-emits them for a cut yet (a cut on group boundaries,
rows with their scales, or whole groups of columns, is the next step). Never cut with a wrong shape.

(Per-row int8, torchao's default, is no group form: ``mm(x, t(qdata).to(f32)) * scale``, gpt-fast's int8
form, matched and cut in match.py.)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from dynashard.capture.linear_forms import converted_source

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Dequantized:
    qdata: torch.fx.Node
    path: tuple[torch.fx.Node, ...]  # from qdata's view to the [out, in] view, in order
    group: int


def _view_of(node: torch.fx.Node) -> torch.fx.Node | None:
    is_view = node.op == "call_function" and node.target in (aten.view.default, aten.reshape.default)
    return node.args[0] if is_view else None


def dequantized_source(node: torch.fx.Node) -> Dequantized | None:
    """The integer weight ``node`` dequantizes by groups (module docstring), if it is exactly that."""
    mul = _view_of(node)
    if mul is None or mul.op != "call_function" or mul.target is not aten.mul.Tensor:
        return None
    for operand in mul.args:
        if not isinstance(operand, torch.fx.Node):
            continue
        between = [mul]
        if operand.op == "call_function" and operand.target is aten.sub.Tensor:  # (minus the zero point)
            between.append(operand)
            operand = operand.args[0]
        grouped = converted_source(operand) if isinstance(operand, torch.fx.Node) else None
        qdata = _view_of(grouped) if grouped is not None else None
        if qdata is None or qdata.op != "placeholder" or qdata.meta["val"].dtype.is_floating_point:
            continue
        shape = grouped.meta["val"].shape
        if len(shape) != 3 or qdata.meta["val"].dim() != 2:
            continue
        return Dequantized(qdata, (grouped, operand, *reversed(between), node), int(shape[2]))
    return None
