"""Every use of a private or semi-private torch API lives in ``dynashard/_torch/``, so a torch upgrade
breaks those files only: this one for Dynamo, AOTAutograd and Inductor, ``aten.py`` for reading aten
graphs and their symbolic sizes, ``c10d.py`` for process groups, ``dtensor.py``, ``funcol.py`` and
``subclass.py`` for DTensor, the renamed functional collectives and tensor-subclass inputs.

Each function says which torch behaviour it depends on; docs/design.md has the measurements.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from dynashard.errors import DynashardError

# (a module's _modules / _parameters / _buffers entry, also reached through its __dict__ as Dynamo names a
# module read by a class's own __getattr__ (PEFT's base_model.model), or a facade dynashard.parallelize keeps
# in its __dict__)
_SOURCE_PART = re.compile(
    r"(?:(?:__dict__\[')?(?:_modules|_parameters|_buffers)(?:'\])?|__dict__\['_dynashard_facades'\])\['([^']+)'\]")


# Dynamo's graphs and their fake inputs (torch._guards, torch._subclasses, make_fx).

def fake_mode_of(example_inputs: Sequence[Any]):
    """The fake mode Dynamo traced with (it owns the shape env, so guards land in Dynamo's)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs)

def placeholder_source_fqn(node: torch.fx.Node) -> tuple[str, str] | None:
    """(module FQN, attribute name) of a parameter/buffer placeholder, from Dynamo's grapharg.

    NOTE: Dynamo 2.13 names a parameter's source like
    ``L['self']._modules['mlp']._modules['up']._parameters['weight']``.
    """
    grapharg = node.meta.get("grapharg")
    if grapharg is None or grapharg.source is None:
        return None
    parts = _SOURCE_PART.findall(grapharg.source.name)
    if not parts:
        return None
    return ".".join(parts[:-1]), parts[-1]

def from_fsdp_module(node: torch.fx.Node) -> bool:
    """Whether a placeholder is a parameter of a module FSDP2's ``fully_shard`` manages (Dynamo 2.13 gives
    such a module an ``FSDPNNModuleSource``: its parameters are graph inputs FSDP swaps at every forward)."""
    grapharg = node.meta.get("grapharg")
    return grapharg is not None and grapharg.source is not None and grapharg.source.guard_source.is_fsdp_module()

def _compiling_before_2_13() -> bool:
    from torch._guards import CompileContext

    # (Dynamo folds the first to True while it traces; the second is its compile of a frame, backend included)
    return torch.compiler.is_compiling() or CompileContext.try_get() is not None


# NOTE: torch 2.13 holds ``torch.compiler.is_compiling()`` True for a whole compile (Dynamo's trace and the
# backend it calls: ``convert_frame``'s ``_compile_session_context``); 2.11 and 2.12 only while Dynamo
# traces, so inside a backend it is False there. Dynamo's ``CompileContext`` spans the whole compile on
# every supported release. Chosen by the presence of the 2.13 context manager.
# torch's own function, not a wrapper of it: a dynashard frame that calls it from eager code Dynamo's eval-frame
# hook sees (uncompiled_calls' pre-hook, run by the wrapped module's call) is compiled as a frame of its own,
# shifting every later compile's id (the user's forward logged as 1/0 instead of 0/0); torch's is skipped.
_COMPILING = (torch.compiler.is_compiling if hasattr(torch.compiler, "_compile_session_context")
              else _compiling_before_2_13)


def compiling() -> bool:
    """Whether torch.compile is compiling now: Dynamo tracing, or a backend (dynashard's analysis and rewrite,
    AOTAutograd, Inductor) running inside Dynamo's compile. False when compiled code runs."""
    return _COMPILING()


def never_a_frame(fn: Any) -> Any:
    """``fn`` is never compiled by Dynamo as a frame of its own, yet still inlined into a frame Dynamo traces
    (``torch._dynamo.eval_frame.skip_code``: the code's own frame runs eagerly). For code that branches on
    :func:`compiling`: called from eager code inside a compiled region (a frame Dynamo fell
    back from), Dynamo would otherwise trace it alone with ``compiling()`` true and hand the traced
    branch's result back to eager code."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)
    return fn

def placeholder_source_name(node: torch.fx.Node) -> str:
    """Dynamo's name for where a placeholder's value comes from (``""`` if it has none)."""
    grapharg = node.meta.get("grapharg")
    return "" if grapharg is None or grapharg.source is None else grapharg.source.name

def example_value(node: torch.fx.Node) -> Any:
    """The fake value Dynamo recorded for a placeholder (a FakeTensor or a SymInt)."""
    return node.meta["example_value"]

def backend_fakes(gm: torch.fx.GraphModule) -> list[Any]:
    """Fakes of a Dynamo graph's inputs in the fake mode a backend traces and compiles with.

    NOTE: Dynamo 2.13 hands a backend a fresh fake mode on its ShapeEnv (``TracingContext.fake_mode``,
    output_graph.py: its own fakes may have had their metadata mutated while tracing), so the
    placeholders' ``example_value`` belong to another mode. Re-faked here (SymInt sizes are kept: one
    ShapeEnv), the SymFloat Dynamo memoised for ``.item()`` of a float-attribute input under
    dynamic=True (``FakeTensor.item_memo``) is carried over: AOTAutograd uses a fake of its own mode as
    it is, and only a memo-less re-fake of the others, whose ``.item()`` is then data-dependent.
    """
    values = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    mode = fake_mode_of(values)
    return [_refake(v, mode) if is_fake(v) and v.fake_mode is not mode else v for v in values]

def _refake(fake: torch.Tensor, mode: Any) -> torch.Tensor:
    out = mode.from_tensor(fake)
    _carry_item_memo(fake, out)
    return out

def _carry_item_memo(src: torch.Tensor, dst: torch.Tensor) -> None:
    memo = getattr(src, "item_memo", None)
    if memo is not None:
        dst.item_memo = memo

def trace_aten(fn: Callable[..., Any], fake_args: Sequence[Any], keep_tags: bool = False) -> torch.fx.GraphModule:
    """Retrace ``fn`` into an aten-level graph with Dynamo's symbolic sizes kept symbolic. ``keep_tags``:
    each traced node inherits the checkpoint tags of the node ``fn`` runs (see :func:`recomputes`).

    NOTE: ``make_fx(tracing_mode="symbolic")`` reuses the fake mode of its fake inputs, so sizes
    stay the SymInts Dynamo created. ``torch.func.functionalize`` around it loses that tracking
    and burns the example sizes into the graph as constants (measured): do not add it.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = fake_mode_of(fake_args)

    # NOTE: make_fx(tracing_mode="symbolic") re-fakes every input, even one of its own fake mode: the
    # SymInt sizes survive (one ShapeEnv), the ``item_memo`` of a float-attribute input under
    # dynamic=True does not (see backend_fakes). Without it ``.item()`` made a fresh unbacked float,
    # and the first op needing its value (SDPA's ``scale``) raised GuardOnDataDependentSymNode.
    # AOTAutograd carries the memo across its own re-fake (``_detach_and_copy_item_memo``): so does this.
    def with_memos(*args: Any) -> Any:
        for given, traced in zip(fake_args, args, strict=True):
            if is_fake(given):
                _carry_item_memo(given, traced)
        return fn(*args)

    # A ``.item()`` of a computed tensor has no memo; Dynamo's own trace allows such scalar outputs.
    allowed = fake_mode.allow_scalar_outputs
    fake_mode.allow_scalar_outputs = True
    try:
        with fake_mode, keeping_tags() if keep_tags else contextlib.nullcontext():
            traced = make_fx(with_memos, tracing_mode="symbolic", record_module_stack=False)(*fake_args)
    finally:
        fake_mode.allow_scalar_outputs = allowed
    # NOTE: make_fx(tracing_mode="symbolic") sets ``traced.shape_env``, Dynamo's ShapeEnv (the fake
    # mode is Dynamo's). Inductor's FX graph cache pickles the graph module's attributes into its
    # key, and that ShapeEnv's tracked fakes are cyclic while Dynamo compiles: under dynamic=True
    # every such graph bypassed the cache ("can't pickle cyclic objects", a logged traceback each).
    # Nothing reads it: Inductor takes the ShapeEnv from the inputs' fake mode when it is None.
    traced.shape_env = None
    return traced

# Activation checkpointing. Dynamo captures a checkpointed block as a tag_activation_checkpoint region,
# and the retrace to aten inlines it with each op tagged (meta "recompute", a CheckpointPolicy, and
# "ac_graph_id": the region; a selective policy asked op by op). The rewrite runs the aten graph node by
# node under fx.traceback.preserve_node_meta, and both fields are among those a traced node inherits from
# the node being run (torch.fx.proxy._COPY_META_FIELDS), so all it emits for a tagged op (collectives
# included) is tagged alike; AOTAutograd's min-cut partitioner then recomputes the region in the backward.
# Without this the rewrite dropped the tags, and the user's checkpointing with them, without a word.

def recomputes(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` has ops a checkpointed region asks to recompute in the backward."""
    return any("recompute" in n.meta for n in gm.graph.nodes)


class LeafCallsTracer(torch.fx.Tracer):
    """A tracer that keeps each call of the functions in ``leaves`` (a subclass's, module-level) as one node
    instead of tracing into it: for :func:`unpickled_by`."""

    leaves: tuple[Callable[..., Any], ...] = ()

    def __init__(self) -> None:
        super().__init__(autowrap_functions=self.leaves)

    def trace(self, root: Any, concrete_args: Any = None) -> torch.fx.Graph:
        graph = super().trace(root, concrete_args)
        # NOTE: fx marks a node made for an autowrapped call ``meta["is_wrapped"]``, and the code generated
        # from such a graph calls ``torch.fx.wrap`` on its own globals as it runs, which adds them to a
        # process-wide table (``_symbolic_trace._wrapped_fns_to_patch``): one entry per graph read back
        for node in graph.nodes:
            node.meta.pop("is_wrapped", None)
        return graph


def unpickled_by(gm: torch.fx.GraphModule, tracer_cls: type) -> None:
    """Unpickling ``gm`` (or a GraphModule made from its graph) rebuilds the graph by tracing its code with
    ``tracer_cls``, a module-level ``torch.fx.Tracer`` subclass (one that keeps a function's calls as nodes).

    NOTE: a GraphModule pickles its code, not its graph, and unpickling traces that code symbolically
    (``fx.graph_module._deserialize_graph_module``), into every plain Python function it calls, with the
    tracer class the graph names (``Graph._tracer_cls``, which ``GraphModule.__init__`` copies)."""
    gm.graph._tracer_cls = tracer_cls
    gm._tracer_cls = tracer_cls


def keeping_tags() -> contextlib.AbstractContextManager:
    """Around a retrace: each traced node inherits the checkpoint tags of the node being run."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.preserve_node_meta()


def as_node(node: torch.fx.Node) -> contextlib.AbstractContextManager:
    """Inside :func:`keeping_tags`: what is traced now inherits ``node``'s tags."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.set_current_meta(node) if "recompute" in node.meta else contextlib.nullcontext()


def is_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(x, torch.Tensor) and _is_fake(x)

@contextlib.contextmanager
def real_tensors():
    """A context where tensors are real even inside a backend call. ``torch.load`` (DCP's reader)
    returns meta-backed tensors whenever ``torch._guards.detect_fake_mode()`` finds a fake mode, and
    inside a backend Dynamo's tracing context holds one: both the fake mode and the context go."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), tracing(None):
        yield


# Compiling a rewritten graph: AOTAutograd, Inductor, and what Dynamo does around a backend.

def compile_graph(compiler: str, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str = "default",
                  on_backward_error: Callable[[BaseException], None] | None = None,
                  cacheable: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """Hand a (rewritten) graph to the chosen compiler; fake example inputs are fine for both AOT paths.

    ``mode`` (Inductor only): torch.compile's mode, applied as ``torch.compile(mode=...)`` applies it.
    NOTE: torch 2.13's ``_TorchCompileInductorWrapper`` turns a mode other than "default" into
    ``torch._inductor.list_mode_options(mode)`` (e.g. ``{"triton.cudagraphs": True}`` for
    "reduce-overhead") and passes it to ``compile_fx`` as ``config_patches``: so does this.

    ``on_backward_error(e)``: called with an error the compiled backward raises (it may raise another
    in its place: a dead peer named), before it propagates out of ``loss.backward()``.
    NOTE: the backward AOTAutograd compiles is reached through its ``bw_compiler`` (aot_eager) and
    Inductor's ``inner_compile`` (called with ``is_backward=True`` for it, torch 2.13
    ``compile_fx_backward``); each compiled backward is called boxed (``_boxed_call``, a list of
    arguments), which the wrapper keeps. A wrapped backward is not an ``OutputCode``, so AOTAutograd's
    cache skips that graph.

    ``cacheable``: the non-torch functions ``gm`` calls ("module.name") that AOTAutograd's cache may key by
    the value given (a digest of their source), instead of refusing the graph.
    NOTE: torch 2.13's ``AOTAutogradCache`` bypasses a graph with a ``call_function`` of any function it does
    not know ("Unsupported call_function target"; measured: every training graph, whose conversions are
    ``apply_conversion`` calls, so a warm restart traced and partitioned its joint graph again); it allows
    the names in ``torch._inductor.config.unsafe_marked_cacheable_functions``, whose values are part of
    the FX graph hash (the inductor config). Patched for this compile only. A backward loaded from the cache
    is AOTAutograd's own callable: ``on_backward_error`` does not reach it (the error propagates as torch
    raised it)."""
    if compiler == "eager":
        return gm.forward
    # NOTE: make_fx(tracing_mode="symbolic") leaves the ShapeEnv on the graph it returns (``gm.shape_env``),
    # and AOTAutograd's cache key pickles the graph module whole: under dynamic shapes, torch 2.11 and 2.12
    # fail to pickle its fake-tensor dispatch cache (OpOverloads: "pybind11 ... is not pickleable"), warn
    # with a traceback on every such compile and skip the cache. Nothing compiles from it (AOTAutograd takes
    # the ShapeEnv from the fake inputs), so the graph goes without it.
    gm.__dict__.pop("shape_env", None)
    with _no_cse():
        return _compile_graph(compiler, gm, example_inputs, mode, on_backward_error, cacheable)


# NOTE: AOTAutograd's min-cut partitioner (aot_eager's and Inductor's; read in torch 2.13, 2.14 and 2.15:
# ``min_cut_rematerialization_partition``) runs ``fx_graph_cse`` on the joint graph first when
# ``torch._functorch.config.cse`` is on (the default), and that CSE does not spare collectives: two of them with the
# same input become one. Each rank compiles its own graph, and where two of a rank's pieces coincide (ranks holding
# no K/V head gather K and V from the rank that holds them: both their inputs are the same empty piece, padded
# alike) that rank alone loses a collective, and the ranks' collectives no longer pair up (a hang, an abort, or
# data swapped between collectives). Off for dynashard's sharded graphs; the partitioner is otherwise unchanged.
def _no_cse() -> contextlib.AbstractContextManager:
    import torch._functorch.config as functorch_config

    return functorch_config.patch(cse=False)


def _compile_graph(compiler: str, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str,
                   on_backward_error: Callable[[BaseException], None] | None,
                   cacheable: Mapping[str, str] | None) -> Callable[..., Any]:
    if compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def bw(graph, inputs):
            return _guarded(boxed_nop(graph, inputs), on_backward_error)

        return aot_eager(gm, example_inputs, bw_compiler=bw if on_backward_error else None)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches = {} if mode == "default" else dict(list_mode_options(mode))
    import torch._inductor.config as inductor_config

    if cacheable and hasattr(inductor_config, "unsafe_marked_cacheable_functions"):  # (torch 2.8+)
        patches["unsafe_marked_cacheable_functions"] = {**inductor_config.unsafe_marked_cacheable_functions,
                                                        **cacheable}
    if on_backward_error is None:
        return compile_fx(gm, example_inputs, config_patches=patches)

    def inner(graph, inputs, **kwargs):
        compiled = compile_fx_inner(graph, inputs, **kwargs)
        return _guarded(compiled, on_backward_error) if kwargs.get("is_backward") else compiled

    return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

class _GuardedBackward:
    """A compiled backward whose errors pass through a handler first (compile_graph)."""

    def __init__(self, inner: Any, handler: Callable[[BaseException], None]) -> None:
        self._inner, self._handler = inner, handler
        # (an instance attribute: AOTAutograd wraps the backward in torch._dynamo.disable, whose
        # functools.wraps copies the instance's __dict__, not its class's attributes)
        self._boxed_call = True
        # NOTE: AOTAutograd's cache (torch 2.13 ``_should_save_cache``, ``AOTAutogradCache.make_entry``) saves
        # an entry only when the backward it holds (``torch._dynamo.disable`` of this object, whose
        # ``functools.wraps`` copies this __dict__) has the FX graph cache's key, and stores the backward it
        # reaches by following ``__wrapped__``: the compiled backward itself (a warm start's backward then
        # runs without this handler)
        self.__wrapped__ = inner
        for name in ("_fx_graph_cache_key", "_fx_graph_cache_debug_lines", "_time_taken_ns"):
            if getattr(inner, name, None) is not None:
                setattr(self, name, getattr(inner, name))

    def __call__(self, args: list[Any]) -> Any:
        try:
            return self._inner(args)
        except Exception as e:  # noqa: BLE001 - the handler raises its own, or lets this one go on
            self._handler(e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

def _guarded(compiled: Any, handler: Callable[[BaseException], None] | None) -> Any:
    if handler is None:
        return compiled
    if not getattr(compiled, "_boxed_call", False):
        from torch._functorch.aot_autograd import make_boxed_func

        compiled = make_boxed_func(compiled)
    return _GuardedBackward(compiled, handler)

def carry_dynamo_inputs(dynamo_gm: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> None:
    """Give ``gm`` (a retrace of ``dynamo_gm`` with the same inputs, in order) what Dynamo's graph says of
    its inputs: where each comes from, and which are static (parameters, ``mark_static_address``).

    NOTE: AOTAutograd (``_try_get_metadata_from_dynamo``, torch 2.13) takes a graph's static inputs --
    those CUDA graphs read in place instead of copying into their own memory on every replay -- from
    ``gm.meta["dynamo_compile_id"]`` and each placeholder's ``_dynamo_source`` and
    ``meta["tensor_dict"]["_dynamo_static_input_type"]``; a graph without them has none, so every weight
    would be copied on every replay. Dynamo's DDPOptimizer carries them to the graphs it makes the same
    way (``propagate_metadata``, ``propagate_dynamo_source``). Inductor also skips its runtime alignment
    check of a static input: the shards in those slots are fresh contiguous tensors (``weights.cut`` +
    clone), aligned as Inductor assumes.
    """
    if "dynamo_compile_id" not in dynamo_gm.meta or next(gm.named_parameters(), None) is not None or \
            next(gm.named_buffers(), None) is not None:
        return  # (AOTAutograd's inputs are then not the placeholders alone: left as it is, every input copied)
    ours = [n for n in gm.graph.nodes if n.op == "placeholder"]
    theirs = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    gm.meta["dynamo_compile_id"] = dynamo_gm.meta["dynamo_compile_id"]
    gm._param_name_to_source = {}  # (the names of parameters held as attributes: gm has none)
    for node, source in zip(ours, theirs, strict=True):
        node._dynamo_source = getattr(source, "_dynamo_source", None)
        static = source.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
        if static is not None:
            node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = static

def uses_cudagraphs(compiler: str, mode: str = "default") -> bool:
    """Whether Inductor will run the compiled graph as a CUDA graph (whose replay skips host-side ops)."""
    if compiler != "inductor":
        return False
    from torch._inductor import config, list_mode_options

    return bool(list_mode_options(mode).get("triton.cudagraphs", config.triton.cudagraphs))

def inductor_modes() -> list[str]:
    """The modes ``torch.compile`` accepts for Inductor (``torch._inductor.list_mode_options``'s keys)."""
    from torch._inductor import list_mode_options

    return list(list_mode_options())

def log_artifact(name: str, gm: torch.fx.GraphModule) -> None:
    """A structured-trace artifact (``TORCH_TRACE=dir``; view with tlparse) of a graph's code."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: gm.print_readable(print_output=False),
    )

def compile_info() -> tuple[str, str | None, str | None]:
    """What Dynamo is compiling, called from inside a backend: the frame's function (its name, file and
    first line: ``TracingContext.traced_code[0]``, the frame whose bytecode is traced), the compile's id
    (``"frame/compile"``, as Dynamo's own logs print it: ``CompileContext``) and, on a recompile, the
    guard that failed first (None on a frame's first compile).

    NOTE: Dynamo 2.13 (``convert_frame._compile``) records that guard, formatted as its ``recompiles``
    log shows it, in the compile's metrics context before tracing, under ``"recompile_reason"``; the
    context has no getter, so its dictionary is read (none: no reason, rather than a failed compile)."""
    import os

    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, TracingContext

    tracing = TracingContext.try_get()
    code = (getattr(tracing, "traced_code", None) or [None])[0]
    name = f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code else "a graph"
    compile_id = CompileContext.current_compile_id()
    context = get_metrics_context()
    reason = getattr(context, "_metrics", {}).get("recompile_reason") if context.in_progress() else None
    return name, None if compile_id is None else str(compile_id), reason

def compile_started() -> float | None:
    """When Dynamo began the compile in progress (``time.time()``'s clock), called from inside a backend:
    the backend's own time plus Dynamo's trace before it. None outside a compile.

    NOTE: Dynamo 2.13 (``convert_frame._compile``) opens a ``MetricsContext`` per compile, which stamps
    ``_start_time_ns`` (``time.time_ns()``) when entered; it has no getter."""
    from torch._dynamo.utils import get_metrics_context

    context = get_metrics_context()
    start = getattr(context, "_start_time_ns", 0) if context.in_progress() else 0
    return start / 1e9 if start else None

def inductor_cache_counts() -> tuple[int, int, int]:
    """Inductor's FX graph cache lookups so far in this process: (hits, misses, bypasses).

    NOTE: Inductor 2.13 counts them in ``torch._dynamo.utils.counters["inductor"]`` under
    ``fxgraph_cache_hit`` / ``_miss`` / ``_bypass`` (``codecache.FxGraphCache``); no public getter."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"], inductor["fxgraph_cache_bypass"]

def is_dynamo_restart(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo asking to trace the frame again, not a failure.

    NOTE: under dynamic=True, Inductor's AOT pass ``tensorify_python_scalars`` (torch 2.13) turns the
    float inputs it can into tensor ops and, for the ones it cannot (an op that needs a Python float,
    such as SDPA's ``scale``), raises ``TensorifyScalarRestartAnalysis`` from inside the backend: Dynamo
    catches it, re-traces with those floats as constants and calls the backend again. Every rank
    compiles the same graph, so every rank raises it alike and re-traces alike."""
    from torch._dynamo.exc import RestartAnalysis

    return isinstance(error, RestartAnalysis)

def backend_error(error: BaseException) -> BaseException | None:
    """The dynashard error a compile raised, unwrapped from Dynamo's ``BackendCompilerFailed``."""
    from torch._dynamo.exc import BackendCompilerFailed

    inner = getattr(error, "inner_exception", None) if isinstance(error, BackendCompilerFailed) else None
    return inner if isinstance(inner, DynashardError) else None

def active_ddp(splits_graphs: bool = False) -> Any:
    """The ``DistributedDataParallel`` whose forward is running (the graph being compiled is traced
    inside it), or None; with ``splits_graphs``, only if Dynamo's DDPOptimizer is on for it.

    NOTE: Dynamo 2.13 (``convert_frame.py``) hands a frame traced inside DDP's forward to DDPOptimizer
    when ``get_optimize_ddp_mode()`` is ``"ddp_optimizer"`` (``torch._dynamo.config.optimize_ddp``'s
    default): it cuts the graph at DDP's gradient-bucket boundaries and calls the backend once per piece.
    DDP sets ``_active_ddp_module`` for the length of its forward, compiled or not."""
    from torch._dynamo.utils import get_optimize_ddp_mode
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if splits_graphs and get_optimize_ddp_mode() != "ddp_optimizer":
        return None
    return ddp


def backend_wrapping(parent: Any, name: str) -> Any:
    """The backend of the ``OptimizedModule`` ``torch.compile(module)`` is building when ``parent`` is one
    and ``name`` the slot it keeps the wrapped module in; else None. Called from a module registration hook.

    NOTE: ``OptimizedModule.__init__(self, mod, dynamo_ctx)`` (``torch._dynamo.eval_frame``, 2.13) registers
    ``mod`` as ``_orig_mod`` (through ``Module.__setattr__``, which runs the registration hooks) before it
    sets ``self.dynamo_ctx``: the context is read from that frame's argument (a few frames up)."""
    import sys

    from torch._dynamo.eval_frame import OptimizedModule

    if name != "_orig_mod" or not isinstance(parent, OptimizedModule):
        return None
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code is OptimizedModule.__init__.__code__ and frame.f_locals.get("self") is parent:
            return compiled_backend(types.SimpleNamespace(dynamo_ctx=frame.f_locals.get("dynamo_ctx")))
        frame = frame.f_back
    return None


def compiled_backend(compiled: Any) -> Any:
    """The backend an ``OptimizedModule`` compiles with, as the user passed it (a function, or a callable
    object), or None if not found.

    NOTE: Dynamo 2.13 keeps it behind ``dynamo_ctx.callback``: ``CatchErrorsWrapper`` ->
    ``ConvertFrame`` -> ``WrapBackendDebug``, each holding the next as ``_torchdynamo_orig_backend``,
    the last holding it as ``compiler_fn`` (a ``_TorchCompileWrapper`` in between when torch.compile got a
    mode or options)."""
    found = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        inner = getattr(found, "_torchdynamo_orig_backend", None) or getattr(found, "compiler_fn", None)
        if inner is None:
            return found
        found = inner
    return None


def in_compiled_module_call() -> bool:
    """Whether an ``OptimizedModule``'s ``__call__`` is running (the module it wraps called through it).

    NOTE: ``torch._dynamo.eval_frame._is_in_optimized_module`` (2.13), set by ``OptimizedModule.__call__``."""
    from torch._dynamo.eval_frame import _is_in_optimized_module

    return _is_in_optimized_module()


def never_a_frame_of_its_own(fn: Callable) -> None:
    """Dynamo neither compiles nor guards ``fn`` when it runs as a frame of its own (a forward pre-hook
    called by ``Module._call_impl`` outside a trace); inlined in a traced frame it is traced as usual (so no
    graph break, ``fullgraph=True`` included). Without it, the first call of a compiled module spends a
    Dynamo frame (and its guards on every call) on a hook that returns at once.

    NOTE: ``torch._dynamo.eval_frame.skip_code`` (2.11-2.15: a SKIP exec strategy for the code object);
    absent, nothing is done (the hook still works, at the cost of that frame)."""
    from torch._dynamo import eval_frame

    skip = getattr(eval_frame, "skip_code", None)
    if skip is not None:
        skip(fn.__code__)


# Ops and tensors (OpOverload tags and schemas, torch-function subclasses, weak references).

def draws_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: an op tagged ``nondeterministic_seeded`` (dropout, rand,
    SDPA kernels) unless its dropout probability is 0 or it runs with ``train=False``.

    NOTE: reads the OpOverload's tags and schema (``op._schema``)."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    values = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
              for i, a in enumerate(op._schema.arguments)}
    if values.get("train") is False:
        return False
    return not any(isinstance(values.get(name), (int, float)) and values[name] == 0 for name in ("dropout_p", "p"))

def is_op_overload(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload)

def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """The (device, dtype) that ``Tensor.to(*args, **kwargs)`` names, each None if not given
    (``torch._C._nn._parse_to``: the parser ``Tensor.to`` uses itself; ``copy=`` not accepted)."""
    parsed = torch._C._nn._parse_to(*args, **kwargs)
    return parsed[0], parsed[1]


def parameter_slots(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own parameters by attribute, None entries included (``nn.Module._parameters``): a
    write replaces one without ``register_parameter`` (its hooks, checks and a swapped class's refusal)."""
    return module._parameters


def buffer_slots(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own buffers by attribute (``nn.Module._buffers``), written as :func:`parameter_slots`."""
    return module._buffers


def plain_torch_functions():
    """A context where a tensor subclass's ``__torch_function__`` is off: ops return plain tensors
    (``torch._C.DisableTorchFunctionSubclass``, the pattern torch's subclass docs use)."""
    return torch._C.DisableTorchFunctionSubclass()

def weak_id_dict() -> Any:
    """A dictionary keyed by tensor identity that does not keep the tensor alive."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


# Process groups: _torch/c10d.py, re-exported here.
from dynashard._torch.c10d import default_store as default_store  # noqa: E402
from dynashard._torch.c10d import group_by_name as group_by_name  # noqa: E402
from dynashard._torch.c10d import group_count as group_count  # noqa: E402
from dynashard._torch.c10d import group_timeout as group_timeout  # noqa: E402
from dynashard._torch.c10d import init_fake_process_group as init_fake_process_group  # noqa: E402
from dynashard._torch.c10d import is_fake_group as is_fake_group  # noqa: E402
from dynashard._torch.c10d import moves_cpu_tensors as moves_cpu_tensors  # noqa: E402
from dynashard._torch.dtensor import dtensor_local as dtensor_local  # noqa: E402
from dynashard._torch.dtensor import follow_placements_in_dcp as follow_placements_in_dcp  # noqa: E402
from dynashard._torch.dtensor import is_strided_shard as is_strided_shard  # noqa: E402
from dynashard._torch.dtensor import strided_shard as strided_shard  # noqa: E402


def attention_state(inputs: Sequence[Any]) -> tuple:
    """What the aten trace of ``F.scaled_dot_product_attention`` reads besides its inputs to pick a kernel: the
    kernels allowed (``torch.backends.cuda``'s flags, which ``torch.nn.attention.sdpa_kernel`` sets; CPU's choice
    reads them too: flash off traces the math decomposition) and the compute capability of each GPU an input is on.
    NOTE: torch 2.11-2.15 ``torch.backends.cuda.{flash,mem_efficient,math,cudnn}_sdp_enabled``."""
    flags = torch.backends.cuda
    allowed = tuple(bool(getattr(flags, f"{kind}_sdp_enabled", lambda: None)())
                    for kind in ("flash", "mem_efficient", "math", "cudnn"))
    gpus = sorted({t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    return allowed, tuple((i, torch.cuda.get_device_capability(i)) for i in gpus)


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_<user>``).

    NOTE: torch 2.13 resolves it in ``torch._inductor.runtime.cache_dir_utils.cache_dir`` (2.11-2.15 alike)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def caches_disabled() -> bool:
    """``torch._inductor.config.force_disable_caches`` (also set by ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``):
    the user asked that no compile cache be read or written."""
    from torch._inductor import config

    return bool(config.force_disable_caches)


def shape_env_facts(fake_mode: Any) -> Any:
    """A snapshot of what a fake mode's ShapeEnv knows (guards, replacements, ranges, runtime asserts), to tell
    whether a trace changed it; None without a ShapeEnv.

    NOTE: torch 2.13's ``ShapeEnv`` keeps them in ``guards`` (a list), ``replacements`` and ``var_to_range``
    (dicts) and ``deferred_runtime_asserts`` (symbol -> list), the same in 2.11-2.15; no public view."""
    env = getattr(fake_mode, "shape_env", None)
    if env is None:
        return None
    return (len(env.guards), repr(env.replacements), repr(env.var_to_range),
            sum(len(v) for v in env.deferred_runtime_asserts.values()))
