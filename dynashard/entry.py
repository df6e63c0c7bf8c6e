"""The Dynamo backend: options -> analysis (match, plan) -> weights -> rewrite -> compiler.

Registered through the ``torch_dynamo_backends`` entry point as ``"dynashard"``; Dynamo calls
``dynashard_backend(gm, example_inputs, options={...})`` once per captured graph and shape.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from dynashard import _torch_private as private
from dynashard.collectives import (
    RollCall,
    CALL,
    COMPILE,
    content_digest,
    describe_missing,
    exchange_status,
    group_name,
    handshake,
    reduce_scatter_is_slow,
)
from dynashard.shard import Split
from dynashard.match import ParamInfo, find_linears
from dynashard.options import Options, parse_options
from dynashard.plan import Plan, make_plan
from dynashard.report import GraphReport, format_table
from dynashard.rewrite import rewrite
from dynashard.weights import STORE, ShardSpec

log = logging.getLogger(__name__)


def resolve_group(options: Options) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "dynashard: no process group is initialized. Expected torch.distributed to be set up "
            "before the first call of the compiled model: call dist.init_process_group() (launched "
            "with torchrun, e.g. `torchrun --nproc-per-node 2 app.py`), or use dynashard.explain() "
            "to inspect a plan in a single process."
        )
    return options.group if options.group is not None else dist.group.WORLD


@dataclasses.dataclass
class Analysis:
    """Everything decided about one captured graph, before any weight is touched."""

    aten: torch.fx.GraphModule
    params: dict[int, tuple[str, torch.fx.Node]]  # input index -> (param FQN, aten placeholder)
    plan: Plan
    world: int
    rank: int
    stacked: bool  # weights="per_rank"

    def sharded_inputs(self) -> dict[int, tuple[str, int, Split]]:
        """Input index -> (FQN, dim to split, how) for every parameter the plan shards.

        Weights always; with ``weights="per_rank"`` colwise biases too (every rank's differ).
        """
        index = {node: i for i, (_, node) in self.params.items()}
        out: dict[int, tuple[str, int, Split]] = {}
        for m in self.plan.sharded():
            style = self.plan.decisions[m.node].style
            dim = m.out_dim if style == "colwise" else m.in_dim
            split = self.plan.layouts.weight_splits[m.node]
            out[index[m.weight]] = (self.params[index[m.weight]][0], dim, split)
            if self.stacked and style == "colwise" and m.bias in index:
                out[index[m.bias]] = (self.params[index[m.bias]][0], 0, split)
        return out


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


def analyse(
    gm: torch.fx.GraphModule, fake_args: list[Any], options: Options, world: int, rank: int, real_args: list[Any]
) -> Analysis:
    aten_gm = private.trace_aten(gm, fake_args)
    _merge_duplicate_views(aten_gm)
    dyn_phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    aten_phs = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    params: dict[int, tuple[str, torch.fx.Node]] = {}
    infos: dict[torch.fx.Node, ParamInfo] = {}
    for i, (dyn, node) in enumerate(zip(dyn_phs, aten_phs, strict=True)):
        source = private.placeholder_source_fqn(dyn)
        if source is None:
            continue
        module_fqn, attr = source
        fqn = f"{module_fqn}.{attr}" if module_fqn else attr
        is_param = isinstance(private.example_value(dyn), torch.nn.Parameter) or "_parameters[" in str(
            dyn.meta["grapharg"].source.name
        )
        infos[node] = ParamInfo(fqn=fqn, module_fqn=module_fqn, is_parameter=is_param)
        params[i] = (fqn, node)
    linears, other_uses = find_linears(aten_gm.graph, infos)
    stacked = options.weights == "per_rank"
    uniform = frozenset() if stacked else frozenset(infos)
    # Weights an earlier graph (e.g. across a graph break) already split: later uses follow that split.
    split = {node: STORE.split_dim(real) for real, node in zip(real_args, aten_phs) if torch.is_tensor(real)}
    presplit = {node: dim for node, dim in split.items() if dim is not None}
    plan = make_plan(linears, other_uses, aten_gm.graph, options, world, rank, uniform, presplit)
    return Analysis(aten_gm, params, plan, world, rank, stacked)


def shard_fakes(analysis: Analysis, fake_args: list[Any]) -> list[Any]:
    """``fake_args`` with every sharded weight replaced by a fake of this rank's shard shape."""
    out = list(fake_args)
    fake_mode = private.fake_mode_of(fake_args)
    for i, (_, dim, split) in analysis.sharded_inputs().items():
        full = fake_args[i]
        shape = list(full.shape)
        shape[dim] = split.local(analysis.world, analysis.rank)
        if analysis.stacked:
            shape = [analysis.world, *shape]
        with fake_mode:
            out[i] = torch.empty(shape, dtype=full.dtype, device=full.device)
    return out


def _check_weights(analysis: Analysis, example_inputs: list[Any], sharded: dict[int, Any]) -> None:
    """Real weights only, and a weight an earlier compile sharded (and freed) is sharded again."""
    for i, (fqn, _) in analysis.params.items():
        if example_inputs[i].is_meta:
            raise ValueError(
                f"dynashard: parameter {fqn!r} is on the meta device. Expected materialised weights "
                "(dynashard checks and cuts real values at compile time). Materialise the model first: "
                "model.to_empty(device=...) and load a checkpoint on every rank, or load it on rank 0 "
                "and pass options={'weights': 'rank0'}."
            )
    for i, (fqn, _) in analysis.params.items():
        if i not in sharded and STORE.is_sharded(example_inputs[i]):
            raise ValueError(
                f"dynashard: {fqn!r} was sharded by an earlier dynashard compile of this model and its "
                "full value freed, but this compile's plan replicates it (were the options different?). "
                "Expected the same options for every compile of a model: compile it once and reuse "
                "the compiled module, or rebuild the model to change the plan."
            )


@dataclasses.dataclass(frozen=True)
class CallCheck:
    """What a rank tells the others before every call and every compile of a graph: its input
    shapes (and, with ``check_inputs``, a checksum of their values), in one small all_reduce.

    Ranks that differ meet there and all raise, naming each rank's shapes, before any collective
    of the graph (gloo aborts the process on collectives of different sizes) and before a rank
    whose guards failed enters the compile agreement while the others run the graph.
    """

    module_state: frozenset[int]  # parameter and buffer slots: checked once, at compile time
    per_rank: bool
    values: bool

    @classmethod
    def for_graph(cls, gm: torch.fx.GraphModule, options: Options) -> CallCheck | None:
        """None with ``check_inputs="off"``: no per-call collective (a mismatch then aborts or hangs)."""
        if options.check_inputs == "off":
            return None
        slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
        state = frozenset(i for i, n in enumerate(slots) if private.placeholder_source_fqn(n) is not None)
        return cls(state, options.inputs == "per_rank", options.check_inputs == "values")

    def __call__(self, phase: int, args: Any, group: dist.ProcessGroup) -> None:
        inputs = [a for i, a in enumerate(args) if i not in self.module_state]
        tensors = [a for a in inputs if torch.is_tensor(a)]  # (symbolic sizes arrive as ints: in these shapes)
        values = content_digest(tensors) if self.values else 0
        described = [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors]
        handshake(phase, described, group, self.per_rank, values)


class ShardedProgram:
    """What Dynamo calls: swaps this rank's shards in for the (freed) full weights.

    Looks the shard up by the parameter passed in each slot (the store is keyed weakly by
    parameter, so shards die with the model): Dynamo reuses one compiled program for every
    instance of a module class (two models, or each block of a model compiled on its own), and a
    parameter it has not seen yet is adopted -- agreed across ranks, cut and freed -- on first use.
    """

    def __init__(
        self,
        compiled: Callable[..., Any],
        specs: dict[int, tuple[str, ShardSpec]],
        graph: torch.fx.GraphModule,
        options: Options,
        group: dist.ProcessGroup,
        fingerprint: str,
        check: CallCheck | None,
    ) -> None:
        self.compiled = compiled
        self.specs = specs  # input slot -> (FQN, how that parameter is cut)
        self.fqns = sorted({fqn for fqn, _ in specs.values()})
        self.graph = graph  # this rank's rewritten aten graph, before the compiler
        self._group = _WeakGroup(group)  # adoption, naming missing ranks after a failed call
        self.check = None if private.is_fake_group(group) else check  # a fake group moves no data
        self.options, self.fingerprint = dataclasses.replace(options, group=None), fingerprint
        self.failures = 0

    @property
    def group(self) -> dist.ProcessGroup:
        return self._group()

    def __call__(self, *args: Any) -> Any:
        group = self.group  # a clear error if it was destroyed, not a failed lookup inside the graph
        if self.check is not None:
            self.check(CALL, args, group)
        args = list(args)
        shards = {i: STORE.shard_for(args[i], spec, fqn) for i, (fqn, spec) in self.specs.items()}
        fresh = [i for i, s in shards.items() if s is None]
        if fresh:
            self._adopt(args, fresh)
            shards.update({i: STORE.shard_of(args[i]) for i in fresh})
        for i, shard in shards.items():
            args[i] = shard
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
            try:
                outs = self.compiled(*args)
            except RuntimeError as e:
                self._diagnose(e)
                raise
        if not torch.is_grad_enabled():
            return outs
        anchors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not anchors:
            return outs
        return type(outs)(_NoBackward.apply(o, anchors[0], self.fqns) if _float(o) else o for o in outs)


    def _adopt(self, args: list[Any], fresh: list[int]) -> None:
        """Parameters of another instance of the compiled module class: check them across ranks
        like a compile does, then cut and free them. Every rank calls with its instance, so every
        rank adopts at the same call."""
        if not private.is_fake_group(self.group):
            named = [(self.specs[i][0], args[i]) for i in fresh]
            STORE.agree(named, f"adopt:{self.fingerprint}", self.group, self.options.weights, check_values=True)
        _cut_and_free({i: self.specs[i] for i in fresh}, args, self.group)

    def _diagnose(self, error: RuntimeError) -> None:
        """After a failed call, name the ranks that did not fail with us (dead or hung ones)."""
        group = self._group.get()
        if group is None or private.is_fake_group(group):
            return
        self.failures += 1
        roll = RollCall(group, f"failed-call-{self.failures}")
        missing = roll.missing(wait_s=5.0)
        if missing == []:
            return  # every rank failed in this call alike: the model's own error, raised as it is
        raise RuntimeError(
            f"dynashard: the sharded program failed on rank {dist.get_rank(group)}: "
            f"{describe_missing(missing)}. The process group said: {error}"
        ) from error


class _CheckFirst:
    """A graph left whole: no shards and no collectives, but every call still meets the other ranks
    in the :class:`CallCheck`, so a rank that recompiles on other shapes is an error, not a hang in
    the next graph's collectives."""

    def __init__(self, compiled: Callable[..., Any], group: dist.ProcessGroup, check: CallCheck) -> None:
        self.compiled, self._group, self.check = compiled, _WeakGroup(group), check

    def __call__(self, *args: Any) -> Any:
        self.check(CALL, args, self._group())
        return self.compiled(*args)


_GLOO_GROUPS: weakref.WeakSet = weakref.WeakSet()  # gloo groups compiled for (alive at exit?)
_GLOO_EXIT_GRACE_S = 0.2
_EXIT_HOOK: list[bool] = []  # registered once


def _drain_gloo_at_exit(group: dist.ProcessGroup) -> None:
    """Give gloo's worker threads time to let go of finished collectives before the interpreter
    shuts down.

    NOTE: torch 2.13 keeps a process group alive past ``destroy_process_group()`` once Dynamo is
    imported after ``init_process_group()`` (it holds references to the group object), so its
    worker threads outlive the script. A worker that drops a finished collective's tensors takes
    the GIL; if the interpreter is already finalizing, the thread is ended inside a destructor
    and the process aborts ("terminate called without an active exception", SIGABRT), after a
    run that succeeded. Seen in CI; reproduced 3 times in 30 four-rank runs of a bare funcol loop.
    Sleeping here (GIL released, before finalization) lets them finish.
    """
    if private.is_fake_group(group) or dist.get_backend(group) != "gloo":
        return
    if not _EXIT_HOOK:
        atexit.register(_let_gloo_workers_finish)
        _EXIT_HOOK.append(True)
    _GLOO_GROUPS.add(group)


def _let_gloo_workers_finish() -> None:
    if len(_GLOO_GROUPS):
        time.sleep(_GLOO_EXIT_GRACE_S)


class _WeakGroup:
    """A compiled program's process group, held weakly.

    Dynamo keeps compiled programs until the interpreter exits. A strong reference would keep the
    group alive past ``dist.destroy_process_group()``, and with it gloo's worker threads, which
    then free a collective's tensors during interpreter shutdown and abort the process
    ("terminate called without an active exception").
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._ref = weakref.ref(group)
        self._name = getattr(group, "group_name", "?")

    def get(self) -> dist.ProcessGroup | None:
        return self._ref()

    def __call__(self) -> dist.ProcessGroup:
        group = self._ref()
        if group is None:
            raise RuntimeError(
                f"dynashard: the process group {self._name!r} this model was compiled for has been destroyed "
                "(dist.destroy_process_group). Expected the group to outlive every call of the compiled "
                "model; after a new init_process_group, compile again (torch._dynamo.reset() first)."
            )
        return group


def _float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class _NoBackward(torch.autograd.Function):
    """Forward is the identity; backward explains that sharded training is not supported yet."""

    @staticmethod
    def forward(ctx, out, anchor, fqns):  # noqa: ARG004
        ctx.fqns = fqns
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # noqa: ARG004
        raise RuntimeError(
            "dynashard: backward through a tensor-parallel graph is not supported yet (sharded "
            f"layers: {ctx.fqns[:4]}{'...' if len(ctx.fqns) > 4 else ''}); gradients would be wrong, "
            "so none are computed. Run inference under torch.no_grad()/torch.inference_mode(), or "
            "compile training code with options={'plan': {}} (everything replicated)."
        )


def dynashard_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: Mapping[str, Any] | None = None):
    """The Dynamo backend: plan, agree, rewrite and compile one captured graph for this rank."""
    opts = parse_options(options)
    group = resolve_group(opts)
    outside = group is dist.GroupMember.NON_GROUP_MEMBER
    world, rank = (1, -1) if outside else (dist.get_world_size(group), dist.get_rank(group))
    if world == 1 or outside:
        log.info("dynashard: world size %d (rank %d in group): compiling unsharded", world, rank)
        return private.compile_graph(opts.compiler, gm, example_inputs)
    # Every rank reaches each agreement point, failed or not, so a failure on one rank is an
    # error on all of them instead of a hang in the next collective. A fake group moves no data.
    agree = not private.is_fake_group(group)
    _drain_gloo_at_exit(group)
    check = CallCheck.for_graph(gm, opts)
    if agree and check is not None:
        check(COMPILE, example_inputs, group)
    fake_args = [private.example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    analysis, error = _plan(gm, fake_args, example_inputs, opts, world, rank)
    sharded = analysis.sharded_inputs() if analysis else {}
    named = [(fqn, example_inputs[i]) for i, (fqn, _) in analysis.params.items()] if analysis else []
    fingerprint = analysis.plan.fingerprint([str(getattr(a, "shape", a)) for a in fake_args]) if analysis else None
    if agree:
        STORE.agree(named, fingerprint, group, opts.weights, check_values=bool(sharded), error=error)
    elif error is not None:
        raise error
    grad_guard = torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()
    if not sharded:  # left whole: compiled as it is (gradients included)
        compiled = private.compile_graph(opts.compiler, gm, example_inputs)
        return _CheckFirst(compiled, group, check) if agree and check is not None else compiled
    sharded_gm = compiled = None
    try:
        new_fakes = shard_fakes(analysis, fake_args)
        sharded_gm = rewrite(analysis.aten, analysis.plan, new_fakes, group_name(group), reduce_scatter_is_slow(group))
        log.debug("dynashard rewritten graph (rank %d):\n%s", rank, sharded_gm.code)
        private.log_artifact("dynashard_rewritten_graph", sharded_gm)
        with grad_guard:
            compiled = private.compile_graph(opts.compiler, sharded_gm, new_fakes)
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by the agreement below
        error = _loud(e, "rewriting and compiling")
    if agree:
        exchange_status(None, error, group, "compiling")
    elif error is not None:
        raise error
    specs = {
        i: (fqn, ShardSpec(dim, split, world, rank, group_name(group), stacked=analysis.stacked))
        for i, (fqn, dim, split) in sharded.items()
    }
    _cut_and_free(specs, example_inputs, group)
    return ShardedProgram(compiled, specs, sharded_gm, opts, group, fingerprint, check)


def _loud(error: Exception, stage: str) -> Exception:
    """Our own errors as they are; anything else wrapped in a RuntimeError naming the stage.

    NOTE: Dynamo turns some backend exceptions (e.g. fake-tensor ``DataDependentOutputException``)
    into a graph break and runs the frame eagerly -- unsharded, with only a warning. Wrapped, it
    is an error like any other.
    """
    if isinstance(error, (ValueError, TypeError, RuntimeError)) and str(error).startswith("dynashard"):
        return error
    wrapped = RuntimeError(f"dynashard: internal error while {stage}: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def _plan(gm, fake_args, example_inputs, opts: Options, world: int, rank: int) -> tuple[Analysis | None, Exception | None]:
    """This rank's analysis, or the error it raised (to be shared with every rank)."""
    try:
        analysis = analyse(gm, fake_args, opts, world, rank, example_inputs)
        if log.isEnabledFor(logging.INFO):
            table = format_table([GraphReport.build(analysis, example_inputs)])
            log.info("dynashard plan (rank %d of %d):\n%s", rank, world, table)
            log.debug("dynashard aten graph before the rewrite (rank %d):\n%s", rank, analysis.aten.code)
        _check_weights(analysis, example_inputs, analysis.sharded_inputs())
        return analysis, None
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by the agreement
        return None, _loud(e, "planning")


def _cut_and_free(specs: dict[int, tuple[str, ShardSpec]], inputs: list[Any], group) -> None:
    """Cut this rank's shards into the store and free the full weights, one at a time (peak:
    model + one shard).

    At compile time this runs only once the sharded program compiled on every rank: a failed
    compile leaves the model whole.
    """
    keep = [a for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and i not in specs]
    freed = 0
    order = sorted(specs.items())
    for n, (i, (fqn, spec)) in enumerate(order):
        STORE.shard(inputs[i], spec, fqn, group)
        later = [inputs[j] for j, _ in order[n + 1 :]]  # may share this one's storage: cut them first
        freed += STORE.free([inputs[i]], keep + later)
    freed += STORE.free([inputs[i] for i, _ in order], keep)
    log.info("dynashard: freed %.1f MiB of full weights", freed / 2**20)


def backend(**options: Any) -> Callable[..., Any]:
    """``torch.compile(model, backend=dynashard.backend(plan=..., ...))``: options bound up front."""
    bound = parse_options(options)

    def dynashard_with_options(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        return dynashard_backend(gm, example_inputs, bound)

    return dynashard_with_options
