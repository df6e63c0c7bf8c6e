"""Analysis: trace a captured graph to aten, match its linears and plan it; nothing is touched.

Before: the Dynamo graph and its fake inputs. After: an :class:`Analysis` (the aten graph, which
inputs are parameters, the :class:`~dynashard.plan.plan.Plan`), shared by the backend and ``explain``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from dynashard import _torch as private
from dynashard._torch import aten as private_aten
from dynashard._torch import regions as private_regions
from dynashard.capture.linear_forms import normalise
from dynashard.capture.match import find_linears
from dynashard.capture.records import ParamInfo
from dynashard.capture.subclass_inputs import INNER
from dynashard.errors import InternalError
from dynashard.layout.nodes import PARAMETER, val
from dynashard.layout.split import Split
from dynashard.options import Options, Style
from dynashard.plan.decision import split_dim
from dynashard.plan.plan import Plan, make_plan
from dynashard.report import progress
from dynashard.weights.store import EarlierCuts

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Analysis:
    """Everything decided about one captured graph, before any weight is touched."""

    aten: torch.fx.GraphModule
    params: dict[int, tuple[str, torch.fx.Node]]  # input index -> (param FQN, aten placeholder)
    plan: Plan
    world: int
    rank: int
    stacked: bool  # weights="per_rank"
    inputs: list[torch.fx.Node]  # the aten placeholders, in input order
    names: dict[int, str]  # input index -> a name for it (an FQN, or where Dynamo found it)

    def sharded_inputs(self) -> dict[int, tuple[str, int, Split]]:
        """Input index -> (name, dim to split, how) for every input the plan shards.

        Weights always; with ``weights="per_rank"`` colwise biases too (every rank's differ); inputs
        written in place from a Shard (KV caches: ``LayoutMap.states``).
        """
        index = {node: i for i, (_, node) in self.params.items()}
        out: dict[int, tuple[str, int, Split]] = {}
        for node, shard in self.plan.layouts.states.items():
            if node.op != "placeholder":  # allocated by the graph: see held_outputs
                continue
            i = self.inputs.index(node)
            out[i] = (self.names[i], val(node).dim() + shard.dim, shard.split)
        for m in self.plan.sharded():
            style = self.plan.decisions[m.node].style
            dim = split_dim(m, style)
            if (refused := m.kind.refused_dim(dim)) is not None:  # (the plans never ask: a wrong value else)
                raise InternalError(f"dynashard: internal error: {m.fqn} planned {style}, but {refused}")
            split = self.plan.layouts.weight_split(m.node)
            companions = m.companions if m.kind.cuts_companions(dim) else ()
            out[index[m.weight]] = (self.params[index[m.weight]][0], dim, split)
            for p in companions:  # (weight_norm's g [out, 1] or [1, in] on its norm dim; a quantized weight's scales)
                out[index[p]] = (self.params[index[p]][0], dim, m.kind.companion_split(dim, m.in_dim, split,
                                                                                       self.world))
            if self.stacked and style == Style.COLWISE and m.bias in index:
                out[index[m.bias]] = (self.params[index[m.bias]][0], 0, split)
        return out

    def held_outputs(self) -> dict[int, tuple[int, Split]]:
        """Output index -> (dim, how) of each cache the graph allocates and returns as this rank's
        shard (``LayoutMap.held_outputs``): the program hands it back wrapped as a full-shape facade."""
        lm = self.plan.layouts
        output = next(n for n in self.aten.graph.nodes if n.op == "output")
        flat = private_aten.tree_leaves(output.args[0])
        return {i: (val(n).dim() + lm.held_outputs[n].dim, lm.held_outputs[n].split)
                for i, n in enumerate(flat) if isinstance(n, torch.fx.Node) and n in lm.held_outputs}


def _merge_duplicate_views(gm: torch.fx.GraphModule) -> None:
    """One node per distinct view of a value: ``nn.Linear`` on one input twice (q/k/v, gate/up)
    traces one ``view`` each, and a sharded layout would gather each of them separately.

    Views alias their input, so merging identical ones is safe even next to in-place ops.
    """
    seen: dict[tuple, torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.view.default, torch.ops.aten.t.default):
            continue
        key = (node.target, node.args[0], tuple(node.args[1]) if len(node.args) > 1 else ())
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node
    gm.recompile()


def _drop_dead_detaches(gm: torch.fx.GraphModule) -> None:
    """``detach`` nodes nothing reads: make_fx records one per tensor autograd would save, when
    traced with gradients enabled. They are no computation, but a rule that looks at a value's
    readers (loss parallel's "only nll_loss reads it") would count them.

    NOTE: torch 2.14's make_fx records them as ``aten.alias`` (2.13: ``aten.detach``); a dead alias is no
    computation either."""
    detaches = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in detaches and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def inline_regions(gm: torch.fx.GraphModule) -> int:
    """``torch.compiler.nested_compile_region`` calls flattened into ``gm``, so the plan sees the linears inside
    them (unflattened, it would see one opaque op per layer: every layer left whole, and training failing in the
    backward); each inlined node tagged with its call, so that the rewrite can put the regions back for the
    compiler (``rewrite/outline.py``). Returns the calls inlined."""
    calls, regions = private_regions.inline_regions(gm)
    if calls:
        log.log(progress.level(), "dynashard: inlined %d calls of %d nested_compile_region function(s) into the "
                "graph to plan the layers inside them (Dynamo traced each once)", calls, regions)
    return calls


def analyse(
    gm: torch.fx.GraphModule, fake_args: list[Any], options: Options, world: int, rank: int,
    earlier: EarlierCuts,
) -> Analysis:
    """This rank's plan for ``gm``: a function of the graph, the options, the world and ``earlier`` (what
    earlier compiles cut or read whole, ``WeightStore.earlier_cuts``), nothing else."""
    return analyse_ranks(gm, fake_args, options, world, [rank], earlier)[0]


def analyse_ranks(
    gm: torch.fx.GraphModule, fake_args: list[Any], options: Options, world: int, ranks: Sequence[int],
    earlier: EarlierCuts,
) -> list[Analysis]:
    """:func:`analyse` for each of ``ranks``, from one aten trace and one match (``explain(verify=True)``
    simulates every rank): they depend on the graph alone, and planning reads the aten graph without
    changing it, so the ranks' plans share it."""
    if inline_regions(gm):  # (run node by node, so that each aten node inherits its call's tag)
        aten_gm = private.trace_aten(private_regions.TaggingInterpreter(gm).run, fake_args)
    else:
        aten_gm = private.trace_aten(gm, fake_args)
    progress.stage("planning")
    dyn_phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    aten_phs = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    params: dict[int, tuple[str, torch.fx.Node]] = {}
    infos: dict[torch.fx.Node, ParamInfo] = {}
    names = {i: private.placeholder_source_name(dyn) or node.name
             for i, (dyn, node) in enumerate(zip(dyn_phs, aten_phs, strict=True))}
    for i, (dyn, node) in enumerate(zip(dyn_phs, aten_phs, strict=True)):
        source = private.placeholder_source_fqn(dyn)
        if source is None or not isinstance(private.example_value(dyn), torch.Tensor):
            continue  # (a symbolic size of a module's tensor has the tensor's source: not a parameter)
        module_fqn, attr = source
        inner = dyn.meta.get(INNER, "")  # (an inner tensor of a subclass parameter: subclass_inputs.py)
        attr = f"{attr}.{inner}" if inner else attr
        fqn = f"{module_fqn}.{attr}" if module_fqn else attr
        is_param = isinstance(private.example_value(dyn), torch.nn.Parameter) or "_parameters[" in str(
            private.placeholder_source_name(dyn)
        )
        infos[node] = ParamInfo(fqn=fqn, module_fqn=module_fqn, is_parameter=is_param, inner=inner)
        node.meta[PARAMETER] = is_param
        params[i] = (fqn, node)
        names[i] = fqn
    normalise(aten_gm, {n for n, info in infos.items() if info.is_parameter}, {n: i.fqn for n, i in infos.items()})
    _drop_dead_detaches(aten_gm)
    _merge_duplicate_views(aten_gm)
    linears, other_uses = find_linears(aten_gm.graph, infos)
    stacked = options.weights == "per_rank"
    uniform = frozenset() if stacked else frozenset(infos)
    # Weights an earlier graph (e.g. across a graph break) already split: later uses follow that split.
    presplit = {aten_phs[i]: cut for i, cut in earlier.split.items()}
    # Weights a graph compiled earlier reads whole: cutting them would free what it reads.
    prewhole = {aten_phs[i] for i in earlier.whole}
    return [Analysis(aten_gm, params, make_plan(linears, other_uses, aten_gm.graph, options, world, rank, uniform,
                                                presplit, prewhole), world, rank, stacked, aten_phs, names)
            for rank in ranks]


def shard_fakes(sharded: dict[int, tuple[str, int, Split]], fake_args: list[Any], world: int, rank: int,
                stacked: bool) -> list[Any]:
    """``fake_args`` with every input the plan cuts (``Analysis.sharded_inputs``) replaced by a fake of this
    rank's shard shape (stacked: ``[world, *shard]``)."""
    out = list(fake_args)
    fake_mode = private.fake_mode_of(fake_args)
    for i, (_, dim, split) in sharded.items():
        full = fake_args[i]
        shape = list(full.shape)
        shape[dim] = split.local(world, rank)
        if stacked:
            shape = [world, *shape]
        with fake_mode:
            out[i] = torch.empty(shape, dtype=full.dtype, device=full.device).requires_grad_(full.requires_grad)
    return out
