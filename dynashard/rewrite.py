"""Rewrite: re-trace the aten graph with this rank's shards, emitting what the layout map says.

Before (aten graph, full weights)::

    t = aten.t(w_up); up = aten.addmm(b_up, x, t); g = aten.gelu(up)
    t_1 = aten.t(w_down); down = aten.mm(g, t_1); out = aten.add(down, b_down)
After (this rank's graph; ``w_up``/``w_down`` placeholders now carry shards)::

    t = aten.t(w_up_shard); b = aten.narrow(b_up, -1, start, len); up = aten.addmm(b, x, t)
    g = aten.gelu(up); t_1 = aten.t(w_down_shard); down = aten.mm(g, t_1)
    ar = _c10d_functional.all_reduce(down, "sum", group); down = _c10d_functional.wait_tensor(ar)
    out = aten.add(down, b_down)

The rewrite is an ``fx.Interpreter`` run under ``make_fx``: each node is re-executed on fake
tensors with its arguments converted as recorded (gather / narrow / local), so the new graph
is traced, not spliced, and every node has true shard shapes in ``meta["val"]``. A rewrite
that does not type-check fails here, at compile time, never mid-forward.

Invariants: the rewrite never re-decides; it reads :class:`~dynashard.plan.Plan` only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dynashard import _torch_private as private
from dynashard import collectives
from dynashard.layout import GATHER, NARROW, LayoutMap, Shard
from dynashard.plan import Plan

aten = torch.ops.aten


class _Sharder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, plan: Plan, group_name: str) -> None:
        super().__init__(gm)
        self.plan = plan
        self.lm: LayoutMap = plan.layouts
        self.group_name = group_name
        self.by_node = {m.node: m for m in plan.linears}
        self.gathered: dict[torch.fx.Node, Any] = {}

    def _read(self, consumer: torch.fx.Node, producer: torch.fx.Node, out: Shard | None) -> Any:
        value = self.env[producer]
        how = self.lm.reads.get((consumer, producer))
        if how == GATHER:
            if producer not in self.gathered:
                lay = self.lm.layouts[producer]
                self.gathered[producer] = collectives.all_gather_last_dim(
                    value, lay.size, lay.chunk, self.lm.world, self.group_name
                )
            return self.gathered[producer]
        if how == NARROW:
            assert out is not None, f"narrow of {producer} without a sharded output"
            return aten.narrow(value, -1, out.start, out.length)
        return value

    def _args(self, node: torch.fx.Node, out: Shard | None) -> tuple[tuple, dict]:
        args = torch.fx.node.map_arg(node.args, lambda p: self._read(node, p, out))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda p: self._read(node, p, out))
        return args, kwargs

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op in ("placeholder", "get_attr"):
            return super().run_node(node)
        out = self.lm.layouts.get(node)
        if node in self.by_node and self.lm.styles[node] == "rowwise":
            return self._rowwise(node)
        # A rowwise linear narrows its replicated input to the input's shard.
        args, kwargs = self._args(node, out)
        if node in self.lm.view_last_dim and args[1][-1] != -1:
            args = (args[0], [*args[1][:-1], self.lm.view_last_dim[node]], *args[2:])
        return getattr(self, node.op)(node.target, args, kwargs)

    def _rowwise(self, node: torch.fx.Node) -> Any:
        m = self.by_node[node]
        src = self.lm.layouts.get(m.input)
        in_shard = src if src is not None else self.lm.shard(m.in_features, frozenset())
        x = self._read(node, m.input, in_shard)
        mat2 = self.env[m.transpose if m.transpose is not None else m.weight]
        y = collectives.all_reduce_sum(aten.mm(x, mat2), self.group_name)
        if m.bias is not None:
            y = aten.add(y, self._read(node, m.bias, None))
        return y


def rewrite(gm: torch.fx.GraphModule, plan: Plan, fake_args: list[Any], group_name: str) -> torch.fx.GraphModule:
    """This rank's sharded graph. ``fake_args`` carry shard shapes for sharded weights."""
    sharder = _Sharder(gm, plan, group_name)
    return private.trace_aten(lambda *args: sharder.run(*args), fake_args)
