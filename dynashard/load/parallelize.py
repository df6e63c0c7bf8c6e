"""Shards as first-class parameters: ``dynashard.parallelize``.

Before: a model whose every rank holds all of every weight; compiling it shards the weights into a
private store at the first call (``store.STORE``), where nothing else can see them.
After ``parallelize(model, *example_args)``:

- each planned weight's shard on this rank is the module's parameter: ``parameters()``,
  ``named_parameters()``, ``state_dict()`` and an optimizer built afterwards see the shards;
- the original full-shape parameter stays as a storage-less *facade* in
  ``module.__dict__[FACADES]``, returned by a property of a subclass swapped onto the module, so
  Dynamo (which traces ``self.weight``) still sees global shapes and guards on them, and the
  compiled program finds the shard by the facade, as for any compiled model;
- each shard carries DCP's checkpoint protocol (its pieces as chunks of the global tensor), so
  ``dcp.save(model.state_dict(), ...)`` writes every layout dynashard cuts at its global offsets
  (the slots, facades and state-dict hooks: registered.py).

How: the model is called once on the example inputs, as a plain call of the parallelized model, which runs
as ``torch.compile(model, backend="dynashard", options=options)`` would (planning, cross-rank agreement,
rewriting and cutting are the compile path's, and the program it leaves in Dynamo's cache serves that
compile: one trace, one plan); then the shards the store holds for the model's parameters are registered.
A later compile whose plan differs raises, naming the layer (the store refuses a second, different cut of a
freed weight).

A submodule called on its own reads a facade eagerly, which answers with a clear error naming the
fix (facades.py); a plain call of the parallelized model runs through dynashard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from dynashard import _torch as private
from dynashard._torch import regions as private_regions
from dynashard.capture.subclass_inputs import inner_tensors
from dynashard.comm.protocol import agreed, resolve_group
from dynashard.dynamo_backend import dynashard_backend, parallelizing
from dynashard.errors import ShardNotHeldError, UsageError
from dynashard.layout.placement import cut_placed, gather_placed
from dynashard.load import adapters, quantized_state
from dynashard.load.loader import Loader
from dynashard.load.registered import (
    FACADES,
    cut_to_pieces,
    facades,
    gather_whole,
    install,
    install_all,
    parallelized,
    register,
    uninstall_all,
)
from dynashard.options import parse_options
from dynashard.training import fsdp
from dynashard.training.gradients import average_over_ranks
from dynashard.weights.freed import materialize
from dynashard.weights.store import STORE


def parallelize(model: nn.Module, *args: Any, options: Any = None, checkpoint: Any = None, device: Any = None,
                dtensor: bool = False, **kwargs: Any) -> nn.Module:
    """Plan ``model`` as ``torch.compile(model, backend="dynashard", options=options)`` would for
    these example inputs, cut every planned weight and register the shards as its parameters.
    With ``checkpoint`` (a path: safetensors file, directory or HF index, or a DCP directory) the
    model is one built on the meta device, and each rank reads only its pieces of each weight (and
    the weights left whole) from it. With ``options={"weights": "rank0"}`` only rank 0 reads (its
    ``checkpoint``, or the weights its model holds) and sends every rank its pieces: the other ranks'
    models may be on meta, and their ``checkpoint`` is not read. ``device``: where the parameters read
    or dealt (those on meta) are put (default: the example inputs' device, else the CPU); weights the
    model holds are cut where they are. ``dtensor=True`` (``options["group"]`` a 1-D DeviceMesh, the tp
    dim of a dp x tp mesh): every parameter registered as a DTensor on that mesh (shards ``Shard(dim)``,
    the others ``Replicate()``), for FSDP2's ``fully_shard`` over the dp dim after it
    (training/fsdp.py). Returns ``model``. Every rank of the group must call it, with the same model
    and inputs."""
    opts = parse_options(options)
    mesh = fsdp.mesh_of(options) if dtensor else None
    if dtensor and opts.inputs == "per_rank":
        raise UsageError("dynashard.parallelize(dtensor=True) trains on replicated inputs within the tp group "
                         "(each dp replica its own batch, FSDP2 over mesh['dp']); found inputs='per_rank'. "
                         "Expected inputs='replicated' (the default).")
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("dynashard.parallelize: no process group is initialized. Expected "
                         "torch.distributed.init_process_group(...) on every rank first (torchrun).")
    group = resolve_group(opts.group)
    from_first = opts.weights == "rank0"
    reads = not from_first or dist.get_rank(group) == 0  # this rank reads the weights itself
    with agreed(group, "checking parallelize's arguments"):  # every rank raises, or none
        _check_parallelizable(model, opts, checkpoint, from_first, reads)
    source = None
    if checkpoint is not None or from_first:
        where = torch.device(device) if device is not None else _device_of(args, kwargs)
        if where.type == "cuda" and where.index is None:  # ("cuda" alone is GPU 0 to safetensors: this rank's)
            where = torch.device("cuda", torch.cuda.current_device())
        source = Loader(model, checkpoint if reads else None, where, group, from_first)
    one_trace = mesh is None  # (dtensor=True: FSDP2 compiles each owner on its own, fsdp.compile_owners)
    try:
        if source is not None:
            source.make_facades()
        with torch.no_grad(), adapters.every_adapter_active(model):  # (all of a PEFT model's adapters cut)
            if one_trace:
                # The example is a plain call of the parallelized model, which runs as the user's
                # torch.compile(model, backend="dynashard", options=options) would (the same frame, an equal
                # backend, the module already as parallelize leaves it for Dynamo's guards): the program this
                # run leaves in Dynamo's cache serves that compile, and later plain calls, without a second
                # trace or plan (compiled at its first call after this run: CompiledOnFirstCall).
                install_all(model)
                _run_calls_through_dynashard(model, options)
                for peft_model in [m for m in model.modules() if adapters.is_peft_model(m)]:
                    # (PEFT's generate calls its base model, not any forward above it)
                    _run_calls_through_dynashard(peft_model.get_base_model(), options)
                with parallelizing(source):
                    model(*args, **kwargs)
            else:
                run_options = dataclasses.replace(opts, compiler="eager")  # (the plan does not depend on it)

                def dynashard_parallelize(gm, example_inputs):  # (the loader reaches the backend here)
                    return dynashard_backend(gm, example_inputs, run_options, source=source)

                # A fresh code object per call: Dynamo's cache for it never fills, and the program compiled
                # here (eager, thrown away) never serves the user's own compile.
                run = types.FunctionType(_run.__code__.replace(), {"__builtins__": __builtins__})
                torch.compile(run, backend=dynashard_parallelize, dynamic=False)(model, args, kwargs)
        if source is not None:
            # read by no graph (eager code): whole (a quantized weight: its inner tensors)
            materialize([t for p in model.parameters() for t in inner_tensors(p)], source)
            source.agree_on_what_was_read_whole()
    except Exception as e:
        ours = private.backend_error(e) or e
        if source is not None:  # a load: the model goes back to what it was (its shards are dropped)
            uninstall_all(model)
            source.restore()
            raise ours from e
        cut = [n for n, p in model.named_parameters() if STORE.is_sharded(p)]
        if not cut:
            uninstall_all(model)
            raise ours from e  # nothing was cut: the model is as it was
        # A graph before a graph break was sharded (its full weights freed) before the error: keep
        # the model usable with what was cut, and say so.
        register(model)
        raise UsageError(
            f"dynashard.parallelize: running the example failed ({type(ours).__name__}: {ours}) after {len(cut)} "
            f"weight(s) had been sharded (e.g. {cut[0]!r}); their full values are gone, and the model now holds "
            "this rank's shards of them. Fix the error, then compile with torch.compile(model, backend='dynashard') "
            "and the same options (or rebuild the model).") from e
    register(model)
    quantized_state.install(model)  # (a quantized weight's cut inner tensors in its state dict: DCP saves them)
    # (DCP's full_state_dict: whole tensors)
    private.follow_placements_in_dcp(functools.partial(gather_placed, gather=gather_whole),
                                     functools.partial(cut_placed, cut=cut_to_pieces))
    if mesh is not None:
        fsdp.register(model, mesh, group, FACADES, install)
        _run_calls_through_dynashard(model, options)
        fsdp.compile_owners(model, FACADES, functools.partial(_sharded_backend, opts=opts))
    _refuse_save_pretrained(model)
    adapters.install(model, group)  # a PEFT model's save_pretrained gathers its adapters whole instead
    if opts.inputs == "per_rank" and opts.weights != "per_rank":
        _average_gradients(model, group)
    return model


def _sharded_backend(gm: Any, example_inputs: Any, opts: Any) -> Any:
    return dynashard_backend(gm, example_inputs, opts)


def _run_calls_through_dynashard(model: nn.Module, options: Any) -> None:
    """A call of the parallelized model outside ``torch.compile`` runs it sharded: as
    ``torch.compile(model, backend="dynashard", options=options)`` would (one Dynamo frame, this
    function's, with an equal backend: its cache entries serve both, and ``parallelize``'s example run
    is one of them). Code that calls the model both ways works unchanged (HF ``generate`` with a
    ``compile_config`` compiles only its decode step and calls the model plainly for prefill). Inside a
    compile the original forward is traced; a submodule called on its own still raises (its facades
    hold no values), as does this forward run eagerly inside its own call (a frame Dynamo left
    uncompiled)."""
    original = model.forward
    had = "forward" in model.__dict__
    compiled = None
    inside = threading.local()

    def forward(*args: Any, **kwargs: Any) -> Any:
        if private.compiling():
            return original(*args, **kwargs)
        if getattr(inside, "on", False):  # (Dynamo left this frame uncompiled: the call runs eagerly)
            _refuse_past_the_recompile_limit(model, code[0])
            with _said_as_uncompiled(model, code[0], eager=True):
                return original(*args, **kwargs)
        inside.on = True
        try:
            with _said_as_uncompiled(model, code[0], eager=False):  # (torch 2.11: a part compiled on its own)
                return compiled(*args, **kwargs)
        finally:
            inside.on = False

    # A code object of its own per model: Dynamo keeps its cache entries, and counts its recompile limit, per
    # code object (the frame every parallelized model would otherwise share). And globals of its own: Dynamo
    # binds each compiled graph (its program) as a global of the frame's function, which would keep every
    # model's programs alive in this module's namespace; in the model's own copy they go with the model.
    forward = types.FunctionType(forward.__code__.replace(), dict(forward.__globals__), forward.__name__, None,
                                 forward.__closure__)
    functools.update_wrapper(forward, original)
    # (had, what it was): uninstall_all puts it back; runtime/uncompiled_calls: its plain calls are not eager
    forward._dynashard_parallelized = (had, model.__dict__.get("forward"))
    code = [forward.__code__]
    compiled = torch.compile(forward, backend="dynashard", options=options)
    model.forward = forward


@contextlib.contextmanager
def _said_as_uncompiled(model: nn.Module, code: Any, eager: bool) -> Iterator[None]:
    """A shard read eagerly inside the model's call (``eager``: a frame Dynamo skipped), or read as an argument by
    a part of the call Dynamo compiled on its own after skipping the frame (torch 2.11; the backend raises it, in
    either branch): said as :func:`_uncompiled`. (A shard read by eager code between the graphs of a compiled call
    keeps the facade's own error.) Dynamo marked the frame to run uncompiled from now on: forgotten, so that the
    model's next call, one Dynamo can compile, runs sharded again instead of meeting the facades every time."""
    try:
        yield
    except Exception as e:
        shard_error = e if eager and isinstance(e, ShardNotHeldError) else private.backend_error(e)
        if not isinstance(shard_error, ShardNotHeldError):
            raise
        private_regions.forget_frame(code)
        raise _uncompiled(model, shard_error) from e


def _uncompiled(model: nn.Module, error: ShardNotHeldError) -> UsageError:
    """A call of the parallelized model that Dynamo ran uncompiled (below its recompile limit: it skipped the
    frame) and that then read a shard's values eagerly: said as that, not as the facade's "a submodule cannot run
    on its own" (the model itself was called)."""
    return UsageError(
        f"dynashard: Dynamo ran this call of {type(model).__name__} (parallelized) uncompiled: it skipped the "
        "model's frame, which it does for an error raised in the model's code while tracing (an op this device "
        "cannot run as asked, such as flex_attention's backward on CPU) or a graph break it could not handle "
        "(TORCH_LOGS=graph_breaks names it). A parallelized model holds only this rank's shards, so it cannot run "
        f"eagerly ({getattr(error, 'needs', 'a shard is read')}). Expected a call Dynamo compiles: the same "
        "call of the unsharded model raises the model's own error, if it is one.")


def _refuse_past_the_recompile_limit(model: nn.Module, code: Any) -> None:
    """A parallelized model whose forward Dynamo runs uncompiled because its frame has reached
    ``recompile_limit`` compiles (each new grad mode, train/eval flag, active adapter set or static size is
    one): said as that, not as the facade's "a submodule cannot run on its own" the eager run would raise."""
    compiles, limit = private_regions.frame_compiles(code), private_regions.recompile_limit()
    if compiles >= limit:
        raise UsageError(
            f"dynashard: {type(model).__name__} (parallelized) has been compiled {compiles} times, "
            f"torch._dynamo.config.recompile_limit ({limit}), so Dynamo runs this call uncompiled, and a "
            "parallelized model holds only this rank's shards. Expected fewer variants of the call (each grad "
            "mode, train/eval flag, set of active adapters or new static size is a compile of its own; "
            "TORCH_LOGS=recompiles says which guard failed), or torch._dynamo.config.recompile_limit raised to "
            "the number of variants, on every rank.")


def _refuse_save_pretrained(model: nn.Module) -> None:
    """HF ``save_pretrained`` of a parallelized model (or of an HF model inside it: a PEFT model's base)
    would write this rank's shards under the whole tensors' names (it saves ``state_dict()``, the shards,
    on the main process only): a checkpoint that is wrong without a word. It raises instead, naming the
    collective that writes the whole weights as an HF directory. (No collective here: it may be called on
    rank 0 alone.) PEFT models save their adapters whole (adapters.py)."""

    def save_pretrained(*args: Any, **kwargs: Any) -> None:
        raise UsageError(
            "dynashard: save_pretrained would write this rank's shards of the parallelized weights under the "
            "whole tensors' names. Expected dynashard.export_safetensors(model, save_directory) on every rank "
            "(an HF directory with config.json, the whole weights streamed by rank 0; max_shard_size= as "
            "save_pretrained takes it), or dcp.save(model.state_dict(), checkpoint_id=path) for the shards.")

    for module in model.modules():
        if callable(getattr(module, "save_pretrained", None)) and not adapters.is_peft_model(module):
            module.save_pretrained = save_pretrained


def _average_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """``inputs="per_rank"``: every parameter's gradient averaged over the ranks (gradients.py), and
    the facades marked so, which a training compile checks (dynamo_backend.check_trainable)."""
    for p in model.parameters():
        average_over_ranks(p, group, sharded=STORE.facade_of(p) is not None)
    for module in model.modules():
        for facade in facades(module).values():
            facade._dynashard_averaged = True


def _check_parallelizable(model: nn.Module, opts: Any, checkpoint: Any, from_first: bool, reads: bool) -> None:
    if parallelized(model):
        raise UsageError("dynashard.parallelize: this model is already parallelized; expected one call per model.")
    sharded = [n for n, p in model.named_parameters() if STORE.is_sharded(p)]
    if sharded:
        raise UsageError(f"dynashard.parallelize: {sharded[:3]} were already sharded by a dynashard compile of "
                         "this model. Expected parallelize before any torch.compile of it.")
    if opts.weights not in ("replicated", "rank0"):
        raise UsageError(f"dynashard.parallelize: weights={opts.weights!r} is not supported; expected "
                         "weights='replicated' (every rank holds or reads the same model) or 'rank0' (rank 0 "
                         "holds or reads it, and sends every rank its pieces).")
    if not reads:
        return  # weights="rank0" on another rank: its model's values are replaced by rank 0's
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if checkpoint is None and on_meta:
        who = "rank 0's model" if from_first else "the model"
        raise UsageError(f"dynashard.parallelize: {on_meta[:3]} of {who} are on the meta device and no checkpoint= "
                         "was given; expected checkpoint=PATH to read the weights from (or a model with real weights).")
    real = [n for n, p in model.named_parameters() if not p.is_meta]
    if checkpoint is not None and real:
        raise UsageError(f"dynashard.parallelize: checkpoint= expects a model built on the meta device (with "
                         f"torch.device('meta') or dynashard.empty_weights()); {real[:3]} hold real weights. "
                         "Build it on meta, or drop checkpoint= to shard the weights it holds.")


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


@contextlib.contextmanager
def empty_weights():
    """Build a model with its parameters on the meta device and its buffers real (as accelerate's
    ``init_empty_weights`` does): buffers computed at construction, such as RoPE tables, are not in
    checkpoints, and ``parallelize(checkpoint=...)`` keeps them.

    Only this thread's modules: torch's parameter-registration hook is process-wide, so it acts on the
    registrations made by the thread that entered the block (another thread building a model meanwhile
    gets real weights). Nests, and composes with other such hooks (no patch of ``nn.Module``)."""
    thread = threading.get_ident()

    def on_meta(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        if threading.get_ident() != thread or param.is_meta:  # (a tied weight assigned again: kept as is)
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(on_meta)
    try:
        yield
    finally:
        handle.remove()


def _run(model, args, kwargs):
    return model(*args, **kwargs)


