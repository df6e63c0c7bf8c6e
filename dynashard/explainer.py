"""``dynashard.explain``: the plan for a model on example inputs, without touching its weights.

Runs Dynamo with a capture-only backend that performs the same analysis as the real backend
(retrace, match, plan, layout propagation) and records a table; weights are neither checked,
cut nor freed. Without an initialized process group it uses a single-process fake group of
``world_size`` ranks and tears it down afterwards.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
import torch.distributed as dist

from dynashard import _torch as private
from dynashard.analysis import analyse_ranks
from dynashard.capture import subclass_inputs
from dynashard.comm.protocol import resolve_group
from dynashard.errors import UsageError, VerificationError
from dynashard.options import parse_options
from dynashard.report import simulate
from dynashard.report.table import GraphReport, LayerRow, format_table, human_bytes
from dynashard.weights.store import STORE


@dataclasses.dataclass
class Report:
    graphs: list[GraphReport]
    world: int
    rank: int
    # Parameters of the model no captured graph reads (FQN, bytes): code Dynamo ran eagerly (between
    # graph breaks), which dynashard never sees, so they stay whole on every rank.
    outside: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @property
    def rows(self) -> list[LayerRow]:
        return [r for g in self.graphs for r in g.rows]

    @property
    def layers(self) -> dict[str, str]:
        """Each linear's FQN mapped to its style ("colwise", "rowwise" or "replicate")."""
        return {r.fqn: r.style for r in self.rows}

    def __str__(self) -> str:
        head = f"dynashard plan: world size {self.world}, shown for rank {self.rank}, {len(self.graphs)} graph(s)"
        out = head + "\n" + format_table(self.graphs)
        if self.outside:
            names = ", ".join(n for n, _ in self.outside[:6]) + (", ..." if len(self.outside) > 6 else "")
            out += (f"\nread by no graph, so whole on every rank: {len(self.outside)} parameter(s), "
                    f"{human_bytes(sum(b for _, b in self.outside))} ({names}): Dynamo ran the code that uses them "
                    "eagerly (a graph break; TORCH_LOGS=graph_breaks says where)")
        return out


def explain(
    model, *args: Any, world_size: int | None = None, options: Any = None, verify: bool = False,
    dynamic: bool = False, train: bool = False, **kwargs: Any
) -> Report:
    """The plan per linear; with ``verify=True`` also every rank simulated and checked (see simulate.py).

    ``dynamic``: captured as ``torch.compile(..., dynamic=True)`` captures (symbolic sizes, and a
    module's float attributes as inputs); by default sizes are the example's. ``train``: verify
    the graph a training compile emits (its conversions carry Megatron's backward; their forwards
    are simulated, the backward is not).

    A verified mismatch beyond the dtype's tolerance raises ``RuntimeError`` with the table.
    """
    opts = parse_options(options)
    own_group = False
    if not (dist.is_available() and dist.is_initialized()):
        if world_size is None:
            raise UsageError(
                "dynashard.explain: no process group is initialized and world_size is None. "
                "Expected world_size=N to plan for N ranks in this process (a fake group is used)."
            )
        if world_size < 1:
            raise UsageError(f"dynashard.explain: world_size must be >= 1, found {world_size}.")
        private.init_fake_process_group(world_size)
        own_group = True
    try:
        group = resolve_group(opts.group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world_size is not None and world_size != world:
            raise UsageError(
                f"dynashard.explain: world_size={world_size} but the process group has {world} ranks. "
                "Pass world_size=None to use the group, or call explain before init_process_group."
            )
        graphs: list[GraphReport] = []
        seen: set[int] = set()  # ids of the parameters some graph reads (FQNs differ across graph breaks)

        def capture(gm, example_inputs):
            dynamo_gm, dynamo_inputs = gm, example_inputs
            if (flat := subclass_inputs.flatten(gm, example_inputs)) is not None:  # torchao's quantized weights
                gm, example_inputs = flat.gm, flat.inputs
            if any(torch.is_tensor(t) and STORE.is_sharded(t) for t in example_inputs):
                raise UsageError(
                    "dynashard.explain: this model's weights were sharded (and freed) by an earlier "
                    "dynashard compile or dynashard.parallelize; explain runs the model once on the example inputs "
                    "and needs them "
                    "whole. Expected an uncompiled model: call explain before torch.compile."
                )
            fake_args = private.backend_fakes(gm)
            earlier = STORE.earlier_cuts(example_inputs)
            # (with verify, every rank's plan from one trace of the graph: analysis.analyse_ranks)
            analyses = analyse_ranks(gm, fake_args, opts, world, range(world) if verify else [rank], earlier)
            analysis = analyses[rank] if verify else analyses[0]
            seen.update(id(example_inputs[i]) for i in analysis.params)
            if flat is not None:  # (a subclass parameter is read through its inner tensors)
                seen.update(id(dynamo_inputs[flat.origin[i]]) for i in analysis.params)
            report = GraphReport.build(analysis, example_inputs)
            if verify and world > 1:
                report = report.with_errors(*simulate.verify(analyses, example_inputs, train=train))
            graphs.append(report)
            return dynamo_gm.forward

        # A fresh code object per call: Dynamo's cache for it never fills, whatever was explained before.
        run = types.FunctionType(_run.__code__.replace(), {"__builtins__": __builtins__})
        with torch.no_grad():
            try:
                torch.compile(run, backend=capture, dynamic=dynamic)(model, args, kwargs)
            except Exception as e:
                raise private.backend_error(e) or e from None  # our own error as it is, not Dynamo's wrapper
        if not graphs:
            raise UsageError("dynashard.explain: Dynamo captured no graph for this model and inputs.")
        outside = [(n, p.numel() * p.element_size()) for n, p in getattr(model, "named_parameters", list)()
                   if id(p) not in seen and p.numel()]
        report = Report(graphs, world, rank, outside)
        if verify and not all(g.verified_ok for g in graphs):
            raise VerificationError(
                f"dynashard.explain(verify=True): the sharded computation differs from the model\n{report}")
        return report
    finally:
        if own_group:
            dist.destroy_process_group()


def _run(model, args, kwargs):
    return model(*args, **kwargs)
