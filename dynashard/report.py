"""The plan as a table: one row per linear, shared by the backend's log and ``explain``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from dynashard import _torch_private as private
from dynashard.layout import shard_bounds


@dataclasses.dataclass(frozen=True)
class LayerRow:
    fqn: str
    weight_shape: tuple[int, ...]
    style: str
    reason: str
    collectives: str  # e.g. "all_reduce" / "all_gather (before sum)" / "-"
    comm_bytes: int  # collective payload per call at the example shape, charged to this layer
    weight_bytes: int  # bytes of this weight held by this rank


@dataclasses.dataclass
class GraphReport:
    rows: list[LayerRow]
    world: int
    rank: int

    @classmethod
    def build(cls, analysis: Any, example_inputs: list[Any]) -> GraphReport:
        plan, lm = analysis.plan, analysis.plan.layouts
        charged: dict[torch.fx.Node, list[tuple[str, int]]] = {m.node: [] for m in plan.linears}
        for c in lm.collectives:
            val = c.node.meta["val"]
            nbytes = math.prod(private.size_hint(s) for s in val.shape) * val.element_size()
            if c.kind in ("all_gather_rows", "reduce_scatter"):
                nbytes *= analysis.world  # the payload holds every rank's rows
            owners = sorted((o for o in c.origins if o in charged), key=lambda o: o.name)
            label = c.kind if c.kind in ("all_reduce", "reduce_scatter") else f"{c.kind} (before {c.reason})"
            for o in owners:
                charged[o].append((label, nbytes // max(1, len(owners))))
        rows = []
        for m in plan.linears:
            d = plan.decisions[m.node]
            val = m.weight.meta["val"]
            numel = val.numel()
            if d.style != "replicate":
                dim = m.out_dim if d.style == "colwise" else m.in_dim
                numel = numel // val.shape[dim] * shard_bounds(val.shape[dim], analysis.world, analysis.rank)[1]
                numel *= analysis.world if analysis.stacked else 1
            comms = charged[m.node]
            rows.append(
                LayerRow(
                    fqn=m.fqn,
                    weight_shape=tuple(int(s) for s in val.shape),
                    style=d.style,
                    reason=d.reason,
                    collectives=", ".join(sorted({c for c, _ in comms})) or "-",
                    comm_bytes=sum(b for _, b in comms),
                    weight_bytes=numel * val.element_size(),
                )
            )
        return cls(rows, analysis.world, analysis.rank)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(graphs: list[GraphReport]) -> str:
    header = ("layer", "weight", "style", "collectives", "comm/call", "weight/rank", "reason")
    lines = []
    for gi, g in enumerate(graphs):
        for r in g.rows:
            lines.append(
                (
                    r.fqn if len(graphs) == 1 else f"[g{gi}] {r.fqn}",
                    "x".join(map(str, r.weight_shape)),
                    r.style,
                    r.collectives,
                    _human(r.comm_bytes),
                    _human(r.weight_bytes),
                    r.reason,
                )
            )
    if not lines:
        return "(no linear layers on parameters found)"
    widths = [max(len(h), *(len(str(row[i])) for row in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    return "\n".join(line.rstrip() for line in out)
