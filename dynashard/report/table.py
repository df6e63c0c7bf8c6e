"""The plan as a table: one row per linear, shared by the backend's log and ``explain``."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import torch

from dynashard._torch import aten as private_aten
from dynashard.capture.aliases import alias_roots
from dynashard.layout.nodes import mutates_self, op_name
from dynashard.layout.shard import CollectiveKind
from dynashard.options import Style
from dynashard.plan.decision import split_dim


@dataclasses.dataclass(frozen=True)
class LayerRow:
    fqn: str
    weight_shape: tuple[int, ...]
    style: Style
    reason: str
    collectives: str  # e.g. "all_reduce" / "all_gather (before sum)" / "-"
    comm_bytes: int  # collective payload per call at the example shape, charged to this layer
    weight_bytes: int  # bytes of this weight held by this rank
    dtype: torch.dtype = torch.float32  # the matmul's (its tolerance under verify)
    verify_err: float | None = None  # explain(verify=True): max abs error of this layer's output


# Verification tolerance by dtype, relative to the reference's magnitude: a sharded matmul sums
# the same products in another order (and bf16/fp16 round each rank's partial sum first).
_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 4e-3}


def _matmul_dtype(m: Any, weight: torch.Tensor) -> torch.dtype:
    """What the matmul computes in: its operand's dtype (autocast's), or a float8 matmul's output dtype (its
    partial sums are rounded to that)."""
    dtype = m.operand.meta.get("val", weight).dtype
    out = m.node.meta.get("val")
    return out.dtype if dtype.itemsize == 1 and dtype.is_floating_point and out is not None else dtype


@dataclasses.dataclass
class GraphReport:
    rows: list[LayerRow]
    world: int
    rank: int
    output_err: float | None = None
    verified_ok: bool = True
    # Graph inputs held sharded because the graph writes Shards into them (KV caches): one row each,
    # style "cache", weight_bytes this rank's part
    caches: list[LayerRow] = dataclasses.field(default_factory=list)

    def with_errors(self, per_layer: dict[str, float], output_err: float,
                    scales: dict[str | None, float] | None = None) -> GraphReport:
        """The verified errors (absolute), judged against the dtype's tolerance times the reference's
        magnitude where it exceeds 1 (``scales``: per FQN, None for the outputs): a weight-only int8
        layer's raw matmul runs in the hundreds, a normalised activation near 1."""
        rows = [dataclasses.replace(r, verify_err=per_layer.get(r.fqn)) for r in self.rows]
        rtol = max((_RTOL.get(r.dtype, 1e-4) for r in rows), default=1e-4)
        scales = scales or {}
        checked = [(output_err, scales.get(None, 1.0)), *((e, scales.get(f, 1.0)) for f, e in per_layer.items())]
        # Absolute floor 1e-5 (fp32 outputs of O(1))
        ok = all(e <= 1e-5 + rtol * 10 * max(1.0, scale) for e, scale in checked)
        return GraphReport(rows, self.world, self.rank, output_err, ok, self.caches)

    @classmethod
    def build(cls, analysis: Any, example_inputs: list[Any]) -> GraphReport:
        plan, lm = analysis.plan, analysis.plan.layouts
        charged: dict[torch.fx.Node, list[tuple[str, int]]] = {m.node: [] for m in plan.linears}
        for c in lm.collectives:
            val = c.node.meta["val"]
            nbytes = math.prod(private_aten.size_hint(s) for s in val.shape) * val.element_size()
            if c.kind in (CollectiveKind.ALL_GATHER_ROWS, CollectiveKind.REDUCE_SCATTER):
                nbytes *= analysis.world  # the payload holds every rank's rows
            lay = lm.layouts.get(c.node)
            if c.kind == CollectiveKind.ALL_GATHER and lay is not None and lay.split.whole:  # whole parts are not sent
                cut = sum(p for i, p in enumerate(lay.split.parts) if i not in lay.split.whole)
                nbytes = nbytes * cut // sum(lay.split.parts)
            owners = sorted((o for o in c.origins if o in charged), key=lambda o: o.name)
            label = c.kind.value if c.kind.reduces else f"{c.kind.value} (before {c.reason})"
            if c.loss_parallel:  # per token, every rank's log-sum-exp and target logit (fp32)
                label = f"{c.kind.value} ({c.reason})"
                nbytes = math.prod(private_aten.size_hint(s) for s in val.shape[:-1]) * 2 * analysis.world * 4
            for o in owners:
                charged[o].append((label, nbytes // max(1, len(owners))))
        rows = []
        for m in plan.linears:
            d = plan.decisions[m.node]
            val = m.weight.meta["val"]
            numel = val.numel()
            if d.style != Style.REPLICATE:
                dim = split_dim(m, d.style)
                split = plan.layouts.weight_split(m.node)
                numel = numel // val.shape[dim] * split.local(analysis.world, analysis.rank)
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
                    dtype=_matmul_dtype(m, val),
                )
            )
        caches = []
        roots = alias_roots(analysis.aten.graph)
        for node, shard in lm.states.items():
            if node in analysis.plan.held_biases:  # (shown with its linear)
                continue
            allocated = node.op != "placeholder"  # by the graph (HF's lazy StaticCache): at this rank's size
            name = f"{node.name} (allocated by the graph)" if allocated else analysis.names[analysis.inputs.index(node)]
            full = node.meta["val"]
            sizes = [private_aten.size_hint(d) for d in full.shape]
            per_dim = math.prod(sizes) // max(1, sizes[shard.dim])  # elements per index of the cut dim
            how = ", ".join(sorted({op_name(n).removesuffix(".default") for n in analysis.aten.graph.nodes
                                    if n.op == "call_function" and mutates_self(n)
                                    and roots.get(n.args[0], n.args[0]) is node}))
            caches.append(LayerRow(
                fqn=name, weight_shape=tuple(sizes), style="cache",
                reason=f"written in place ({how}) from head-sharded values: held cut like them on dim "
                       f"{full.dim() + shard.dim}, no gather per step"
                       + ("; allocated at this rank's size, returned as its shard" if allocated else ""),
                collectives="-", comm_bytes=0, weight_bytes=per_dim * shard.length * full.element_size(),
                dtype=full.dtype))
        return cls(rows, analysis.world, analysis.rank, caches=caches)


def plan_summary(plan: Any) -> str:
    """The plan in a few words, for the compile's log line: ``2 of 3 linears sharded, 1 all_reduce``."""
    kinds = collections.Counter(c.kind.value for c in plan.layouts.collectives)
    collectives = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "no collective"
    return f"{len(plan.sharded())} of {len(plan.linears)} linears sharded, {collectives}"


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(graphs: list[GraphReport]) -> str:
    verified = any(g.output_err is not None for g in graphs)
    header = ("layer", "weight", "style", "collectives", "comm/call", "weight/rank") + (
        ("max err",) if verified else ()
    ) + ("reason",)
    lines = []
    for gi, g in enumerate(graphs):
        for r in g.rows + g.caches:
            err = ("-" if r.verify_err is None else f"{r.verify_err:.1e}",) if verified else ()
            lines.append(
                (
                    r.fqn if len(graphs) == 1 else f"[g{gi}] {r.fqn}",
                    "x".join(map(str, r.weight_shape)),
                    r.style,
                    r.collectives,
                    human_bytes(r.comm_bytes),
                    human_bytes(r.weight_bytes),
                    *err,
                    r.reason,
                )
            )
        if g.output_err is not None:
            lines.append((f"[g{gi}] outputs", "", "", "", "", "", f"{g.output_err:.1e}", "all ranks simulated"))
    if not lines:
        return "(no linear layers on parameters found)"
    widths = [max(len(h), *(len(str(row[i])) for row in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    return "\n".join(line.rstrip() for line in out)
