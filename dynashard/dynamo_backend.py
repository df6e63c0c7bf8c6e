"""The Dynamo backend: options -> analysis (match, plan) -> agree -> rewrite -> compile -> cut.

Registered through the ``torch_dynamo_backends`` entry point as ``"dynashard"``; Dynamo calls
``dynashard_backend(gm, example_inputs, options={...})`` once per captured graph and shape, and
then the :class:`~dynashard.runtime.program.ShardedProgram` it returns on every call.

Every rank reaches each agreement point, failed or not, so a failure on one rank is an error on
all of them instead of a hang in the next collective; the full weights are cut and freed only
once every rank compiled (a failed compile leaves the model whole).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from dynashard import _torch as private
from dynashard import state
from dynashard.analysis import Analysis, analyse, inline_regions, shard_fakes
from dynashard.capture import subclass_inputs
from dynashard.comm.collectives import BACKWARD, apply_conversion, group_name, reduce_scatter_is_slow
from dynashard.comm.protocol import COMPILE, agreed, peer_failure, resolve_group, wrap
from dynashard.errors import NotSupportedError, ShardNotHeldError, UsageError
from dynashard.options import Options, parse_options, with_mode
from dynashard.report import progress
from dynashard.report.table import GraphReport, plan_summary
from dynashard.rewrite.interpreter import rewrite
from dynashard.rewrite.lowerings import DropoutOfCut, RowwiseExperts
from dynashard.rewrite.outline import outline_regions
from dynashard.runtime import compile_cache, gate, regions
from dynashard.runtime.program import (
    CallCheck,
    CheckFirst,
    CompiledOnFirstCall,
    ShardedProgram,
    cut_and_free,
    drain_gloo_at_exit,
)
from dynashard.runtime.uncompiled_calls import watch
from dynashard.training import fsdp
from dynashard.weights.freed import materialize
from dynashard.weights.store import STORE, EarlierCuts, ShardSpec, Source

log = logging.getLogger(__name__)
# A model torch.compile wraps with this backend and then runs around the wrapper (model.generate) is
# warned about: torch.compile looks the backend up, importing this module, before it wraps the model.
# (Both names are looked up when a module is registered, after this module has run.)
watch(lambda backend: backend is dynashard_backend or isinstance(backend, BoundBackend))


def dynashard_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: Mapping[str, Any] | None = None,
                      mode: str | None = None, source: Source | None = None):
    """The Dynamo backend: plan, agree, rewrite and compile one captured graph for this rank.

    ``torch.compile(..., mode=m)`` calls it with ``mode=m`` (and never with ``options`` too).
    ``source``: ``parallelize``'s loader (a checkpoint, or rank 0's deal), where the storage-less
    parameters' values come from (by default, that of the ``parallelize`` run in progress on this
    thread: :func:`parallelizing`)."""
    started = time.perf_counter()
    opts = with_mode(parse_options(options), mode)
    if source is None:
        source = getattr(state.PARALLELIZING, "source", None)
    group = resolve_group(opts.group)
    outside = group is dist.GroupMember.NON_GROUP_MEMBER
    world, rank = (1, -1) if outside else (dist.get_world_size(group), dist.get_rank(group))
    if world == 1 or outside:
        log.info("dynashard: world size %d (rank %d in group): compiling unsharded", world, rank)
        if source is not None:  # (parallelize(checkpoint=...): nothing is cut here, every weight is read whole)
            materialize([leaf for t in example_inputs if isinstance(t, torch.Tensor)
                         for leaf in subclass_inputs.inner_tensors(t)], source)
        return _compile(opts.compiler, gm, _inputs_to_compile(gm, example_inputs), opts.mode, None)
    if (flat := subclass_inputs.flatten(gm, example_inputs)) is not None:  # torchao's quantized weights
        return flat.wrap(dynashard_backend(flat.gm, flat.inputs, options, mode, source))
    with progress.compiling():
        return _compile_sharded(gm, example_inputs, opts, group, world, rank, source, started)


def _compile_sharded(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options, group: dist.ProcessGroup,
                     world: int, rank: int, source: Source | None, started: float):
    """The backend for a graph on a group of more than one rank (``progress.stage`` names each step)."""
    check_data_parallel()
    fsdp.refuse_strays(gm, example_inputs)
    # Every rank reaches each agreement point, failed or not, so a failure on one rank is an
    # error on all of them instead of a hang in the next collective. A fake group moves no data.
    agree = not private.is_fake_group(group)
    drain_gloo_at_exit(group)
    check = CallCheck.for_graph(gm, opts)
    if agree and check is not None:
        progress.stage("waiting for the other ranks to reach this compile")
        check(COMPILE, example_inputs, group)
    key = regions.graph_key(gm, example_inputs, opts, group, world, rank) if source is None else None
    if (region := regions.find(key, group, agree)) is not None:  # a block compiled before, for the next block
        return regions.reuse(region, example_inputs, group, opts, agree, started)
    fake_args = private.backend_fakes(gm)
    train = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs)
    earlier = STORE.earlier_cuts(example_inputs)
    material, not_cached = compile_cache.key_material(gm, example_inputs, fake_args, opts, group, world, rank,
                                                      earlier, train) if compile_cache.enabled() else (None, "off")
    cached = compile_cache.load(material) if material is not None else None
    if cached is not None and not _still_valid(cached[0], example_inputs):
        cached = None  # (traced afresh: the trace's checks then say what is wrong)
    analysis = error = None
    if cached is not None:
        planned, cached_gm = cached
        inline_regions(gm)  # (the graph compiled whole below is the one a miss compiles)
        log.debug("dynashard: compile cache hit (rank %d): the plan and this rank's rewritten graph read from %s",
                  rank, compile_cache.directory())
        if planned.table is not None and _logs_plan_table():
            progress.log_plan_table(*planned.table, rank, world)
    else:
        progress.stage("tracing the graph to aten ops")
        facts = compile_cache.shape_facts(fake_args)
        analysis, table, error = _plan(gm, fake_args, example_inputs, opts, world, rank, earlier,
                                       tabled=material is not None)
        planned = None
        if analysis is not None:
            try:
                planned = _planned(analysis, fake_args, train, table)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank by the agreement below
                analysis, error = None, wrap(e, "planning")
    planned_at = time.perf_counter()
    sharded = planned.sharded if planned else {}
    _refuse_fsdp_managed(gm, sharded, example_inputs)
    named = [(fqn, example_inputs[i]) for i, fqn in planned.params.items()] if planned else []
    named += [(name, example_inputs[i]) for i, (name, _, _) in sharded.items() if i not in planned.params]
    fingerprint = planned.fingerprint if planned else None
    if agree:
        progress.stage("agreeing on the plan and weights with the other ranks")
        STORE.agree(named, fingerprint, group, opts.weights, check_values=bool(sharded), error=error)
    elif error is not None:
        raise error
    if planned is not None and source is not None:  # dynashard.parallelize(checkpoint=...): every rank reads
        with agreed(group, "reading the weights left whole from the checkpoint"):
            materialize([example_inputs[i] for i in planned.params if i not in sharded], source)
    grad_guard = torch.no_grad() if torch.is_grad_enabled() and not train else contextlib.nullcontext()
    live = fsdp.live_slots(example_inputs)
    cache_word = "hit" if cached is not None else "miss" if material is not None else f"not used ({not_cached})"
    if not sharded:  # left whole: compiled as it is (gradients included)
        progress.stage(_compiling("unsharded", opts.compiler))
        counts = private.inductor_cache_counts()
        compiled = _compile(opts.compiler, gm, _inputs_to_compile(gm, example_inputs, fake_args), opts.mode, group)
        if planned is not None:
            STORE.note_read_whole([example_inputs[i] for i in planned.params])
            if cached is None and material is not None and compile_cache.shape_facts(fake_args) == facts:
                _store(material, planned, None)
        progress.log_compile(gm, fake_args, planned.summary if planned else None, started, planned_at, counts,
                             cache_word)
        if live:
            compiled = fsdp.ReadLive(compiled, live)
        return CheckFirst(compiled, group, check) if agree and check is not None else compiled
    gate_slot = None
    with agreed(group, "compiling", doing="rewriting and compiling"):
        if train:
            check_trainable(planned, example_inputs, opts.compiler)
        new_fakes = shard_fakes(sharded, fake_args, world, rank, planned.stacked)
        if cached is not None:
            sharded_gm = cached_gm
        else:
            progress.stage("rewriting the graph for this rank")
            sharded_gm = rewrite(analysis.aten, analysis.plan, new_fakes, group_name(group),
                                 reduce_scatter_is_slow(group), train=train)
            if material is not None and compile_cache.shape_facts(fake_args) == facts:
                sharded_gm = _store(material, planned, sharded_gm) or sharded_gm
            elif material is not None:
                log.debug("dynashard: compile cache: not stored (tracing added shape guards, which a hit would lose)")
        if opts.compiler != "eager":  # (eager runs the graph as it is: nothing is compiled per call)
            sharded_gm = outline_regions(sharded_gm, new_fakes)
        log.debug("dynashard rewritten graph (rank %d):\n%s", rank, sharded_gm.code)
        private.log_artifact("dynashard_rewritten_graph", sharded_gm)
        # Each input slot keeps what Dynamo said of its value: a parameter's slot, now holding its shard
        # (a tensor the store keeps, at one address for the model's life), stays a static input of
        # CUDA graphs ("reduce-overhead"): a replay reads it in place instead of copying it in.
        private.carry_dynamo_inputs(gm, sharded_gm)
        if agree and check is not None and not train and not private.uses_cudagraphs(opts.compiler, opts.mode):
            gate_slot = gate.insert(sharded_gm)  # the call's handshake overlaps the graph up to its first collective
        compiler = opts.compiler
        if train and compiler == "eager" and private.recomputes(sharded_gm):
            compiler = "aot_eager"  # (AOTAutograd's partitioner recomputes a checkpointed region; eager keeps all)
        progress.stage(_compiling("sharded", compiler))
        counts = private.inductor_cache_counts()
        with grad_guard:
            compiled = _compile(compiler, sharded_gm, new_fakes, opts.mode, group,
                                on_backward_error=_name_dead_peers(group) if train and agree else None)
    specs = {
        i: (fqn, ShardSpec(dim, split, world, rank, group_name(group), stacked=planned.stacked))
        for i, (fqn, dim, split) in sharded.items()
    }
    progress.stage("cutting the weights" if source is None else "loading the shards")
    if source is None:
        cut_and_free(specs, example_inputs, group)
    else:  # dynashard.parallelize reads the shards from a checkpoint: a failed read fails every rank
        with agreed(group, "loading the shards (checkpoint reads, or rank 0's deal)", doing="loading the shards"):
            cut_and_free(specs, example_inputs, group, source)
    STORE.note_read_whole([example_inputs[i] for i in planned.params if i not in sharded])
    held = {i: ShardSpec(dim, split, world, rank, group_name(group)) for i, (dim, split) in planned.held.items()}
    progress.log_compile(gm, fake_args, planned.summary, started, planned_at, counts, cache_word)
    program = ShardedProgram(compiled, specs, sharded_gm, opts, group, fingerprint, check, train=train, held=held,
                             gate=gate_slot)
    program.live = live
    regions.remember(key, program, planned)
    return program


@contextlib.contextmanager
def parallelizing(source: Source | None) -> Iterator[None]:
    """Around ``dynashard.parallelize``'s example run, on this thread: the graphs it compiles read their
    weights from ``source`` (None: the model's own), and are compiled with the options' compiler at
    their first call after the run instead of now (:class:`CompiledOnFirstCall`)."""
    state.PARALLELIZING.source, state.PARALLELIZING.active = source, True
    try:
        yield
    finally:
        state.PARALLELIZING.source, state.PARALLELIZING.active = None, False


def _compile(compiler: str, graph: torch.fx.GraphModule, inputs: list[Any], mode: str,
             group: dist.ProcessGroup | None, on_backward_error: Callable[[BaseException], None] | None = None,
             ) -> Callable[..., Any]:
    """``graph`` compiled; during ``parallelize``'s example run, a program that runs it as it is in that run
    and compiles it at its first call after (``group``: where that compile is agreed on; None: a world of
    one)."""
    def compile() -> Callable[..., Any]:
        return private.compile_graph(compiler, graph, inputs, mode, on_backward_error=on_backward_error,
                                     cacheable=_cacheable_functions(graph))

    if compiler == "eager" or not _in_parallelize_run():
        return compile()
    return CompiledOnFirstCall(graph.forward, compile, group, compiler, active=_in_parallelize_run,
                               facts=lambda: private.shape_env_facts(private.fake_mode_of(inputs)))


def _inputs_to_compile(gm: torch.fx.GraphModule, example_inputs: list[Any], fake_args: list[Any] | None = None
                       ) -> list[Any]:
    """What a graph compiled as Dynamo captured it (left whole) is compiled with: Dynamo's example inputs, or,
    when it is compiled at its first call after ``parallelize``'s run (:func:`_compile`), Dynamo's fakes
    (``fake_args``: the backend's own, else made here), as the sharded graphs are. Outside Dynamo's compile, real
    inputs would reach AOTAutograd with no ShapeEnv: the graph compiled for their sizes alone (a later call of
    another length, which Dynamo's guards of a dynamic graph let through, failed Inductor's size assert) and
    bypassed by Inductor's FX graph cache ("No shape env": every restart compiled it again)."""
    if not _in_parallelize_run():
        return example_inputs
    return fake_args if fake_args is not None else private.backend_fakes(gm)


def _cacheable_functions(graph: torch.fx.GraphModule) -> dict[str, str]:
    """The functions of dynashard ``graph`` calls, each with what AOTAutograd's cache keys it by: a training
    graph calls ``collectives.apply_conversion`` (Megatron's conversions, traced through by AOTAutograd),
    which its cache refuses as an unknown function unless named; named with the digest of dynashard's
    source, an entry is never read by other code."""
    if not graph.graph.find_nodes(op="call_function", target=apply_conversion):
        return {}
    return {f"{apply_conversion.__module__}.{apply_conversion.__name__}": compile_cache.code_digest()}


def _compiling(which: str, compiler: str) -> str:
    if compiler != "eager" and _in_parallelize_run():
        return f"the {which} graph left to compile ({progress.compiler_name(compiler)}) at its first call"
    return f"compiling the {which} graph ({progress.compiler_name(compiler)})"


def _in_parallelize_run() -> bool:
    return getattr(state.PARALLELIZING, "active", False)


def _planned(analysis: Analysis, fake_args: list[Any], train: bool, table: tuple[str, str] | None
             ) -> compile_cache.Planned:
    """What the compile needs of ``analysis`` after planning (and what the compile cache keeps of it)."""
    return compile_cache.Planned(
        params={i: fqn for i, (fqn, _) in analysis.params.items()}, sharded=analysis.sharded_inputs(),
        held=analysis.held_outputs(), fingerprint=analysis.plan.fingerprint(
            [str(getattr(a, "shape", a)) for a in fake_args]),
        stacked=analysis.stacked, summary=plan_summary(analysis.plan),
        trainable=trainability(analysis) if train else None, table=table)


def _store(material: str, planned: compile_cache.Planned, graph: torch.fx.GraphModule | None,
           ) -> torch.fx.GraphModule | None:
    """The entry written; the graph as a later hit reads it (compiled in its place), or None."""
    back, why = compile_cache.store(material, planned, graph)
    if why is not None:
        log.debug("dynashard: compile cache: not stored: %s", why)
    return back


def _still_valid(planned: compile_cache.Planned, example_inputs: list[Any]) -> bool:
    """A cached plan meets the checks a traced one must pass (``_check_weights``); else the compile traces,
    and the trace's checks name what is wrong."""
    for i in planned.params:
        if example_inputs[i].is_meta:
            return False
    for i in planned.sharded:
        if i in planned.params and STORE.read_whole(example_inputs[i]):
            return False
    return not any(i not in planned.sharded and torch.is_tensor(t) and STORE.is_sharded(t)
                   for i, t in enumerate(example_inputs))


def _refuse_fsdp_managed(gm: torch.fx.GraphModule, sharded: dict[int, Any], example_inputs: list[Any]) -> None:
    """A weight FSDP2's ``fully_shard`` manages cannot be cut: FSDP gathers a fresh copy of it into the module
    before every forward and reduces the gradient that copy gets, so this rank's cut of the first copy would
    be read stale and its gradients lost (measured: every cut parameter ended the backward with no gradient).
    Unless it is a facade of ``parallelize(dtensor=True)``: the program reads FSDP's current parameter then
    (training/fsdp.py). Every rank plans the same graph alike, so every rank raises here."""
    slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
    managed = [sharded[i][0] for i in sorted(sharded)
               if private.from_fsdp_module(slots[i]) and not fsdp.is_live(example_inputs[i])]
    if managed:
        raise UsageError(
            f"dynashard: this graph would cut {managed[:3]}, parameters FSDP2's fully_shard manages; FSDP swaps them "
            "for gathered copies at every forward, so the cut ones would go stale and their gradients be lost. FSDP2 "
            "composes with dynashard's parameters registered as DTensors: expected dynashard.parallelize(model, x, "
            "options={'group': mesh['tp']}, dtensor=True) before fully_shard(model, mesh=mesh['dp']), or DDP over "
            "mesh['dp'] (README, 'Several machines'), or fully_shard without dynashard.")


def _name_dead_peers(group: dist.ProcessGroup) -> Callable[[BaseException], None]:
    """What the compiled backward does with an error: a dead or hung peer named (PeerError), else as it is."""

    ref = weakref.ref(group)  # (a compiled program must not keep the group alive: program._WeakGroup)

    def handler(error: BaseException) -> None:
        named = peer_failure(ref(), BACKWARD, error) if ref() is not None else None
        if named is not None:
            raise named from error

    return handler


def check_data_parallel() -> None:
    """A graph compiled inside DistributedDataParallel (data parallelism over other ranks, e.g. a mesh's
    "dp" dim, around tensor parallelism over the group): whole graphs only, and a warning where DDP's
    gradients lose their whole-gradient norm.

    Dynamo's DDPOptimizer (on by default) cuts a DDP model's graph at DDP's gradient-bucket boundaries
    and compiles each piece on its own; the plan pairs layers over the whole graph, and parallelize cut
    the weights by that plan, so a piece is planned otherwise (measured: nanoGPT at 1 MB buckets raises
    that a weight parallelize cut is now replicated). A model under one bucket (25 MB by default) is not
    cut, and is refused all the same, so that a recipe tried on a small model holds for a large one."""
    if private.active_ddp(splits_graphs=True) is not None:
        raise UsageError(
            "dynashard: this graph is compiled inside DistributedDataParallel with Dynamo's DDPOptimizer "
            "(torch._dynamo.config.optimize_ddp, on by default), which cuts the graph at DDP's gradient-bucket "
            "boundaries and compiles each piece on its own; dynashard plans the whole graph (a colwise layer "
            "with its rowwise partner). Expected torch._dynamo.config.optimize_ddp = False before the first "
            "call: one graph, whose gradients DDP all-reduces after the backward."
        )
    ddp = private.active_ddp()
    if ddp is not None and ddp.gradient_as_bucket_view:
        # DDP points each .grad at its bucket, a plain tensor, in place of the ShardGrad whose norm is the
        # whole gradient's: clip_grad_norm_ would clip each rank by its own norm, and the ranks drift apart
        warnings.warn(
            "dynashard: DistributedDataParallel(gradient_as_bucket_view=True) replaces each sharded "
            "parameter's .grad with a view of its bucket, so its norm is this rank's part only: "
            "clip_grad_norm_ would clip each rank by another factor. Expected gradient_as_bucket_view=False "
            "(the default) when clipping.",
            UserWarning,
            stacklevel=1,  # (the frames above are Dynamo's compile: none is the user's)
        )


def trainability(analysis: Analysis) -> compile_cache.Trainability:
    """What :func:`check_trainable` needs of the plan (kept in ``Planned``: a compile-cache hit has no analysis)."""
    lm = analysis.plan.layouts
    why = None
    if lm.stacked:
        why = "weights='per_rank' (its backward is not built yet)"
    elif (partial := _untrainable_partial(lm)) is not None:
        why = partial
    else:
        whole = [n for n, lay in lm.layouts.items() if lay is not None and lay.split.whole]
        if whole:
            why = (f"a fused weight with parts held whole on every rank ({whole[0].name}: K/V heads the ranks cannot "
                   "cut alongside their query heads, e.g. fewer K/V heads than ranks; explain() says why); each "
                   "rank's gradient of a whole part would be partial")
    return compile_cache.Trainability(
        sparse=tuple(m.fqn for m in analysis.plan.sharded() if m.kind.sparse(m.node)),
        per_rank=lm.per_rank and not lm.stacked, why=why, random=_random_on_shards(analysis))


def _random_on_shards(analysis: Analysis) -> str | None:
    """The first random op drawing for a sharded value ("<op> (<node>)"), or None.

    Random ops (dropout) on a sharded value: each rank draws for its own part, so the ranks' random
    streams drift apart (uneven parts draw different counts) and a later dropout of a replicated value
    would mask differently on each rank -- replicated values that differ across ranks, silently. On
    replicated values every rank draws the same, as the unsharded model does."""
    lm = analysis.plan.layouts
    for node in analysis.aten.graph.nodes:
        if isinstance(getattr(lm.records.get(node), "lowering", None), DropoutOfCut):
            continue  # the whole mask drawn on every rank (sequence_parallel): the streams stay in step
        if private.draws_random(node) and (lm.layouts.get(node) is not None
                                    or any(o is not None for o in lm.outputs.get(node) or [])):
            return f"{node.target} ({node.name})"
    return None


def check_trainable(planned: compile_cache.Planned, example_inputs: list[Any], compiler: str = "eager") -> None:
    """With gradients, only layouts whose backward dynashard gets right; anything else is refused here,
    at compile time, never a wrong gradient."""
    t = planned.trainable
    if t.sparse and compiler != "eager":
        # NOTE: AOTAutograd traces the sparse backward of aten.embedding, whose nonzero has a data-dependent
        # size (DynamicOutputShapeException, torch 2.13); an unsharded torch.compile then falls back to eager
        # through a graph break
        raise NotSupportedError(
            f"dynashard: training a sharded embedding with sparse=True ({t.sparse[0]!r}) under compiler={compiler!r}: "
            "AOTAutograd cannot trace its sparse backward (a data-dependent size). Expected options={'compiler': "
            "'eager'} (the sharded graph run eagerly: sparse gradients, this rank's rows), or sparse=False.")
    if t.per_rank:
        plain = [fqn for i, fqn in planned.params.items()
                 if example_inputs[i].requires_grad and not getattr(example_inputs[i], "_dynashard_averaged", False)]
        if plain:
            raise NotSupportedError(
                f"dynashard: training with inputs='per_rank' needs every parameter's gradient averaged over the "
                f"ranks, and {plain[0]!r} (of {len(plain)}) has no such hook: each rank's gradient of it would be "
                "its own batch's only. Expected dynashard.parallelize(model, example, options={'inputs': "
                "'per_rank', ...}) before training, which installs them (DDP-style: one all_reduce per "
                "replicated parameter per backward).")
    if t.why is not None:
        raise NotSupportedError(
            f"dynashard: training (a backward) through this plan is not supported: {t.why}. Gradients would be "
            "wrong, so none are computed. Run under torch.no_grad() for inference, or replicate those layers "
            "(options={'plan': {...: 'replicate'}}), or use a world size that divides the heads.")
    if t.random is not None:
        raise NotSupportedError(
            f"dynashard: training through random op {t.random} on a sharded value is not "
            "supported: each rank would draw its own part's random numbers, and the ranks' random streams, "
            "which replicated values rely on, would drift apart. Expected dropout off inside sharded layers "
            "(attention-probability dropout, e.g. HF attn_pdrop / attention_dropout = 0), or model.eval(); "
            "dropout on replicated values (the residual stream, embeddings) is fine.")


def _untrainable_partial(lm: Any) -> str | None:
    """Partial sums whose backward is not built: an expert's (the router weights scale it and pick
    its rows). Others are right: the all_reduce's backward is the identity (Megatron's g), and every
    replicated tensor an op keeping partial sums reads (a LoRA's whole B) goes through f
    (rewrite/interpreter.py), so its gradient is every rank's term summed. A sum or mean of a Shard over its cut
    dim (a norm over every head) reads only the shard: its gradient is each rank's own."""
    for record in lm.records.values():
        if record.partial is not None and isinstance(record.lowering, RowwiseExperts):
            return "mixture-of-experts partial sums (their backward is not built yet)"
    return None


def _plan(
    gm, fake_args, example_inputs, opts: Options, world: int, rank: int, earlier: EarlierCuts, tabled: bool = False,
) -> tuple[Analysis | None, tuple[str, str] | None, Exception | None]:
    """This rank's analysis and its plan table (made when logged, or ``tabled``: for the compile cache), or the
    error it raised (to be shared with every rank)."""
    try:
        analysis, table = analyse(gm, fake_args, opts, world, rank, earlier), None
        if tabled or _logs_plan_table():
            table = progress.plan_table(GraphReport.build(analysis, example_inputs), rank, world)
        if _logs_plan_table():
            progress.log_plan_table(*table, rank, world)
            log.debug("dynashard aten graph before the rewrite (rank %d):\n%s", rank, analysis.aten.code)
        _check_weights(analysis, example_inputs, analysis.sharded_inputs())
        return analysis, table, None
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by the agreement
        return None, None, wrap(e, "planning")


def _logs_plan_table() -> bool:
    return log.isEnabledFor(logging.DEBUG) or (log.isEnabledFor(logging.INFO) and progress.speaks())


def _check_weights(analysis: Analysis, example_inputs: list[Any], sharded: dict[int, Any]) -> None:
    """Real weights only, and a weight an earlier compile sharded (and freed) is sharded again."""
    for i, (fqn, _) in analysis.params.items():
        if example_inputs[i].is_meta:
            raise UsageError(
                f"dynashard: parameter {fqn!r} is on the meta device. Expected materialised weights "
                "(dynashard checks and cuts real values at compile time). Materialise the model first: "
                "model.to_empty(device=...) and load a checkpoint on every rank, or load it on rank 0 "
                "and pass options={'weights': 'rank0'}."
            )
    for i, (fqn, _, _) in sharded.items():
        if i in analysis.params and STORE.read_whole(example_inputs[i]):
            raise UsageError(
                f"dynashard: {fqn!r} is read whole by a graph compiled earlier (another shape, or a graph "
                "before a graph break), and this compile's plan shards it, which would free the full value "
                "that graph reads. Expected the same plan for every graph of a model: mark it 'replicate' in "
                "options={'plan': ...}, or shard it everywhere.")
    for i, (fqn, node) in analysis.params.items():
        if i not in sharded and STORE.is_sharded(example_inputs[i]):
            raise UsageError(
                f"dynashard: {fqn!r} was sharded by an earlier dynashard compile of this model (or by "
                f"dynashard.parallelize) and its full value freed, but this graph needs it whole: "
                f"{_why_whole(analysis, node)}. No rank holds its full value any more. Expected every graph to "
                "read a sharded weight only through linear layers cut alike, with the same options for every "
                "compile of a model; else keep it whole from the start (options={'plan': {<its layer>: "
                "'replicate'}} in parallelize and every compile), or rebuild the model."
            )
    for i, node in enumerate(analysis.inputs):
        t = example_inputs[i]
        if i not in sharded and i not in analysis.params and torch.is_tensor(t) and STORE.is_sharded(t):
            if (weight := STORE.weight_of(t)) is not None:
                # torch 2.11: after Dynamo skips a parallelized model's frame (an error raised while tracing it),
                # the frame runs eagerly and Dynamo compiles the calls inside it as frames of their own, which
                # get the weights as arguments (Linear.forward: "L['args'][1]")
                error = ShardNotHeldError(
                    f"dynashard: input {analysis.names[i]!r} is the weight {weight!r}, which dynashard sharded (its "
                    f"full value is gone), reached as an argument of a part of the model's call compiled on its own "
                    f"({_why_whole(analysis, node)}). Dynamo compiles such a part after it skipped the whole call's "
                    "frame: for an error raised in the model's code while tracing, or a graph break it could not "
                    "handle (TORCH_LOGS=graph_breaks names it). Expected the model's whole call compiled, which "
                    "reads its weights as parameters.")
                error.needs = f"{weight!r} is read whole by a part of the call Dynamo compiled on its own"
                raise error
            # (a compiled graph would read a storage-less tensor: Inductor's kernels do not ask the facade)
            raise UsageError(
                f"dynashard: input {analysis.names[i]!r} is a tensor an earlier dynashard graph returned as this "
                f"rank's part (a KV cache held by heads), and this graph needs it whole: "
                f"{_why_whole(analysis, node)}. Expected the graphs that read a held cache to read it as they wrote "
                "it (by heads); else read it with dynashard.full_tensor(t) on every rank first, or keep the "
                "layers writing it whole (options={'plan': {<k and v projections>: 'replicate'}}).")


def _why_whole(analysis: Analysis, weight: torch.fx.Node) -> str:
    """Why this graph's plan keeps ``weight`` whole: its linears' reasons, or the op reading it otherwise."""
    reasons = sorted({analysis.plan.decisions[m.node].reason for m in analysis.plan.linears if m.weight is weight})
    if reasons:
        return "; ".join(reasons)
    readers = sorted({str(u.target) for u in weight.users})
    return f"it is read by {', '.join(readers) or 'nothing'} here, not by a linear layer"



def backend(mode: str | None = None, **options: Any) -> Callable[..., Any]:
    """``torch.compile(model, backend=dynashard.backend(plan=..., mode=...))``: options and torch.compile's
    mode bound up front (torch.compile refuses ``mode=`` and ``options=`` together)."""
    return BoundBackend(parse_options({**options, "mode": mode}))


class BoundBackend:
    """The dynashard backend with its options bound. Two are equal when their options are: torch.compile
    compares backends with ``==``, so ``torch.compile(model, backend=dynashard.backend(**o))`` made twice (a
    server building its compiled model per request, HF's ``generate`` compiling per call) reuses the first
    one's trace and program instead of tracing and planning again. (A closure would be equal only to
    itself: every such compile would trace again.)"""

    __name__ = "dynashard_with_options"

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 options: Any = None):
        if options is not None:
            raise UsageError(
                f"dynashard: torch.compile(options={options!r}) given to a backend whose options are bound by "
                "dynashard.backend(...). Expected the options in one place: dynashard.backend(**options), or "
                "backend='dynashard' with torch.compile(options=...).")
        return dynashard_backend(gm, example_inputs, self.options, mode=mode)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BoundBackend) and self.options == other.options

    def __hash__(self) -> int:  # (the options may hold unhashable values: equal ones hash alike all the same)
        return hash((BoundBackend, self.options.compiler, self.options.mode))

    def __repr__(self) -> str:
        return f"dynashard.backend({self.options})"
