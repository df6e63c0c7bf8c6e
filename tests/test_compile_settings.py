"""torch.compile's own settings through dynashard, single process (fake group): ``mode=`` and ``dynamic=True``.

torch passes ``mode`` to a custom backend as a keyword; dynashard applies it to Inductor as
``torch.compile(mode=...)`` applies it to its own Inductor backend. On CPU, Inductor ignores CUDA
graphs ("reduce-overhead", "max-autotune") and counts one skip per graph. What CPU can check of CUDA
graphs is which inputs Inductor is told are static (read in place by a replay, never copied into the
graph's memory): for the sharded graph, the slots the model compiled plainly has, its parameters'
(holding the shards). The replay's copies themselves need a GPU: not checked here.

HF models under ``dynamic=True``: tests/test_hf_models.py (planned, simulated) and tests/test_serving.py
(generate on gloo ranks); here, the AOT path that makes Dynamo trace the frame again, and the sharded
graph cached (AOTAutograd's and Inductor's FX graph caches) under dynamic=True.
"""

from __future__ import annotations

import ast
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dynashard
from dynashard import _torch as private
from dynashard.errors import OptionTypeError, UsageError
from dynashard.options import parse_options, with_mode
from tests import models

pytestmark = pytest.mark.unit

MODES = list(torch._inductor.list_mode_options())  # every mode torch.compile accepts for Inductor


def test_every_mode_torch_accepts_is_an_option_and_others_are_refused():
    assert MODES[0] == "default" and "reduce-overhead" in MODES and "max-autotune" in MODES
    assert [parse_options({"mode": m}).mode for m in MODES] == MODES
    assert parse_options({"mode": None}).mode == "default"  # (torch.compile's own default)
    with pytest.raises(UsageError, match="mode is 'fastest'; expected one of " + repr(MODES).replace("[", r"\[")):
        parse_options({"mode": "fastest"})
    with pytest.raises(OptionTypeError, match="option 'mode' is a int"):
        parse_options({"mode": 3})
    with pytest.warns(UserWarning, match="mode='max-autotune' has no effect with compiler='eager'"):
        parse_options({"mode": "max-autotune", "compiler": "eager"})
    bound = parse_options({"mode": "reduce-overhead"})
    assert with_mode(bound, None) is bound and with_mode(bound, "reduce-overhead") is bound
    assert with_mode(parse_options({}), "max-autotune").mode == "max-autotune"
    with pytest.raises(UsageError, match="mode 'max-autotune' passed to torch.compile, and mode 'reduce-overhead'"):
        with_mode(bound, "max-autotune")
    # torch.compile(options=...) given to a backend with bound options
    with pytest.raises(UsageError, match="a backend whose options are bound by dynashard.backend"):
        dynashard.backend(min_shard_numel=0)(None, [], options={"compiler": "eager"})


def _fake_group_compile(model, x, backend="dynashard", **kwargs):
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        with torch.no_grad():
            return torch.compile(model, backend=backend, **kwargs)(x)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharded", [True, False])
def test_every_mode_reaches_inductor_as_torch_compile_applies_it(monkeypatch, sharded):
    """torch.compile(model, backend="dynashard", mode=m) raises no TypeError (an unexpected keyword
    'mode'): Inductor gets the config torch.compile's own Inductor wrapper makes of m, for a sharded
    graph and for one left whole. (Inductor itself is replaced by a recorder: the config is the point.)"""
    patches = []

    def compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        patches.append(config_patches or {})
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", compile_fx)
    for mode in MODES:
        torch.manual_seed(0)
        model = models.MLP(256, 512) if sharded else models.MLP(16, 32)  # (under min_shard_numel: whole)
        _fake_group_compile(model, torch.randn(4, model.up.in_features), mode=mode)
        assert (model.up.weight.untyped_storage().nbytes() == 0) == sharded, mode
        # NOTE: torch 2.13's own Inductor backend for torch.compile(mode=m) holds its config here
        assert patches[-1] == torch._TorchCompileInductorWrapper(mode, None, False).config, mode
    assert len(patches) == len(MODES)
    with pytest.raises(Exception, match="mode is 'fastest'") as raised:
        _fake_group_compile(models.MLP(16, 32), torch.randn(4, 16), mode="fastest")
    assert isinstance(private.backend_error(raised.value), UsageError)


class _StaticInputs(logging.Handler):
    """The static input slots Inductor compiles each graph with (its cudagraph_static_inputs log)."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[list[int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("static input idxs compile_fx_inner:"):
            self.graphs.append(ast.literal_eval(message.split(":", 1)[1].strip()))


def test_reduce_overhead_on_cpu_behaves_as_inductor_with_the_shards_as_static_inputs():
    """Compiled for real with mode="reduce-overhead": plain Inductor and dynashard (world 2, weights cut)
    both skip CUDA graphs on CPU, once per graph, and compile with the same static input slots, the
    parameters' (with none for the sharded graph, every replay on a GPU would copy every shard)."""
    handler = _StaticInputs()
    logger = logging.getLogger("torch._inductor.compile_fx.__cudagraph_static_inputs")
    logger.addHandler(handler)
    torch._logging.set_logs(cudagraph_static_inputs=True)
    def skips() -> int:  # (looked up each time: Dynamo may replace its counters' dicts)
        return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]

    try:
        # (a hit in the FX graph or AOTAutograd cache skips the compile that logs its static inputs)
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            torch.manual_seed(0)
            plain, model = models.MLP(32, 64), models.MLP(32, 64)
            model.load_state_dict(plain.state_dict())
            before = skips()
            with torch.no_grad():
                torch.compile(plain, mode="reduce-overhead")(torch.randn(4, 32))
            plain_skips = skips() - before
            _fake_group_compile(model, torch.randn(4, 32), backend=dynashard.backend(mode="reduce-overhead",
                                                                                     min_shard_numel=0))
            ours_skips = skips() - before - plain_skips
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    assert model.up.weight.untyped_storage().nbytes() == 0  # sharded, the shards in those slots
    assert plain_skips == ours_skips == 1, (plain_skips, ours_skips)
    (plain_static, ours_static) = handler.graphs
    assert ours_static == plain_static and len(plain_static) == 4, handler.graphs  # up and down: weight, bias


class _ScaledAttention(nn.Module):
    """Attention whose SDPA scale is a float attribute, as HF's (``self.scaling``)."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.scale = heads, (hidden // heads) ** -0.5
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return x + self.o(y.transpose(1, 2).reshape(b, t, c))


def test_dynamic_shapes_through_aot_let_dynamo_trace_again():
    """Under dynamic=True the float scale is a graph input; AOTAutograd's tensorify pass cannot turn SDPA's
    float argument into a tensor op and asks Dynamo to trace again with it a constant (raising
    TensorifyScalarRestartAnalysis inside the backend). dynashard lets that request through (not wrapped
    as an InternalError): the second trace compiles, sharded, and a new shape compiles nothing."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(len(example_inputs))
        return dynashard.backend(compiler="aot_eager", min_shard_numel=0)(gm, example_inputs)

    torch.manual_seed(0)
    model = _ScaledAttention()
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        compiled = torch.compile(model, backend=backend, dynamic=True)
        with torch.no_grad():
            shapes = [compiled(torch.randn(b, t, 32)).shape for b, t in ((2, 5), (3, 7))]
    finally:
        dist.destroy_process_group()
    assert shapes == [torch.Size([2, 5, 32]), torch.Size([3, 7, 32])]
    # traced twice for the first shape (the scale an input, then a constant: one input fewer), never again
    assert len(calls) == 2 and calls[1] == calls[0] - 1, calls
    assert model.q.weight.untyped_storage().nbytes() == 0  # cut: the sharded program runs



def test_inductor_caches_the_sharded_graph_under_dynamic_shapes(monkeypatch, tmp_path):
    """Inductor with dynamic=True, compiled twice (torch._dynamo.reset() between, a fresh cache directory):
    the second compile hits AOTAutograd's cache and the FX graph cache under it, and nothing is logged
    about pickling. make_fx leaves Dynamo's ShapeEnv on the sharded graph module (``gm.shape_env``); left
    there, AOTAutograd pickles it into its cache key, and its tracked fakes are cyclic while Dynamo compiles:
    "Failed to pickle cache key ... can't pickle cyclic objects", a warning with a traceback for each graph
    (here two: Dynamo traces the frame twice, see the test above), and the cache bypassed."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    logged: list[logging.LogRecord] = []  # every record of every logger (torch's do not propagate to the root)
    call_handlers = logging.Logger.callHandlers
    monkeypatch.setattr(logging.Logger, "callHandlers", lambda self, r: (logged.append(r), call_handlers(self, r)))

    def cache(group: str, what: str) -> int:  # (looked up each time: Dynamo may replace its counters' dicts)
        return torch._dynamo.utils.counters[group][what]

    names = [("aot_autograd", f"autograd_cache_{w}") for w in ("hit", "bypass")] + [("inductor", "fxgraph_cache_hit")]
    counts = []
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            before = [cache(*n) for n in names]
            torch.manual_seed(0)
            model = _ScaledAttention()
            _fake_group_compile(model, torch.randn(2, 5, 32), backend=dynashard.backend(min_shard_numel=0),
                                dynamic=True)
            assert model.q.weight.untyped_storage().nbytes() == 0  # cut: the sharded graph is the one cached
            counts.append([cache(*n) - b for n, b in zip(names, before)])
    warned = [r.getMessage() for r in logged if r.levelno >= logging.WARNING or "pickle" in r.getMessage()]
    assert not warned, warned
    # (AOTAutograd hit, bypassed, FX graph hit) per compile
    assert counts == [[0, 0, 0], [1, 0, 1]], counts

@pytest.mark.parametrize("guarded", [False, True])
def test_a_training_graph_is_cached_by_aotautograd(monkeypatch, tmp_path, guarded):
    """A training compile under Inductor, twice (torch._dynamo.reset() between, a fresh cache directory), each
    with its backward run (AOTAutograd saves an entry once the backward is compiled): the first saves an
    AOTAutograd cache entry, the second hits it. A training graph calls dynashard's conversions
    (``collectives.apply_conversion``: Megatron's f and g), which AOTAutograd's cache refused as an unknown
    function ("Unsupported call_function target"): every warm restart of training traced and partitioned its
    joint graph again (15 of 36 s of an 8-layer Llama's first step, ``bench_start.py --train``). ``guarded``:
    the backward wrapped to name dead peers, as on real ranks (a fake group has none), which AOTAutograd did
    not save (no FX graph cache key on the wrapper)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    if guarded:
        from dynashard import dynamo_backend

        compile_ = dynamo_backend._compile

        def with_handler(compiler, graph, inputs, mode, group, on_backward_error=None):
            return compile_(compiler, graph, inputs, mode, group, on_backward_error=on_backward_error or print)

        monkeypatch.setattr(dynamo_backend, "_compile", with_handler)

    def cache(what: str) -> int:  # (looked up each time: Dynamo may replace its counters' dicts)
        return torch._dynamo.utils.counters["aot_autograd"][f"autograd_cache_{what}"]

    names = ("bypass", "saved", "hit")
    counts, grads = [], []
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            before = [cache(n) for n in names]
            torch.manual_seed(0)
            model, x = models.MLP(32, 96), torch.randn(4, 32, requires_grad=True)
            torch._dynamo.reset()
            private.init_fake_process_group(2, 0)
            try:
                out = torch.compile(model, backend=dynashard.backend(min_shard_numel=0, compiler="inductor"))(x)
                out.pow(2).sum().backward()
            finally:
                dist.destroy_process_group()
            assert model.up.weight.untyped_storage().nbytes() == 0  # cut: the sharded training graph is the one
            grads.append(x.grad)
            counts.append([cache(n) - b for n, b in zip(names, before)])
    # (bypassed, saved, hit) per compile
    assert counts == [[0, 1, 0], [0, 0, 1]], counts
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)  # (the graph read back computes the same)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# slow tier (an Inductor compile, ~40 s on the 2-core machine): on torch 2.13 the test above fails if the
# graph keeps its ShapeEnv (the cache bypassed); this one is the check that fails on 2.11 and 2.12 then
# (tools/compat.sh)
@pytest.mark.slow
def test_a_dynamic_recompile_under_inductor_hands_over_a_graph_its_cache_can_key():
    """The sharded graph is make_fx's, which keeps its ShapeEnv as ``gm.shape_env``; AOTAutograd's cache key
    pickles the graph module whole. On torch 2.11 and 2.12 the ShapeEnv's fake-tensor cache does not pickle
    under dynamic shapes: every recompile would warn "Failed to pickle cache key" with a traceback (the demo
    four times) and skip the cache. No graph dynashard hands to Inductor carries one, and a dynamic recompile
    logs no such warning (with the ShapeEnv left on, on 2.11 both checks fail; on 2.13 the second)."""
    handed, records = [], _Records()
    real = private.compile_graph

    def recording(compiler, gm, *args, **kwargs):
        compiled = real(compiler, gm, *args, **kwargs)
        handed.append("shape_env" in gm.__dict__)
        return compiled

    logger = logging.getLogger("torch._inductor.codecache")
    logger.addHandler(records)
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(private, "compile_graph", recording)
            torch.manual_seed(0)
            compiled = torch.compile(models.MLP(64, 128), backend="dynashard",
                                     options={"compiler": "inductor", "min_shard_numel": 0})
            with torch.no_grad():
                for batch in (4, 5):  # (the second: Dynamo's recompile with a dynamic batch)
                    compiled(torch.randn(batch, 64))
    finally:
        dist.destroy_process_group()
        logger.removeHandler(records)
    assert not [m for m in records.messages if "Failed to pickle" in m], records.messages
    assert handed == [False, False], handed


def test_a_graph_parallelize_leaves_whole_is_cached_by_inductor(monkeypatch, tmp_path):
    """A graph with nothing to cut (an MLP under ``min_shard_numel``) that ``parallelize`` leaves to compile at its
    first call after its run: that compile, outside Dynamo's, is keyed by Inductor's FX graph cache and AOTAutograd's,
    so a restart loads it (here: a second parallelize after ``torch._dynamo.reset()``, on the same cache directory).
    It was bypassed, "No shape env" (real inputs outside Dynamo's compile reach AOTAutograd with no ShapeEnv), and
    every restart compiled it again; the sharded graphs were cached (their inputs are Dynamo's fakes)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    names = [("aot_autograd", "autograd_cache_hit"), ("inductor", "fxgraph_cache_miss"),
             ("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_bypass")]
    counts, outputs = [], []
    x = torch.randn(4, 16)
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            private.init_fake_process_group(2, 0)
            try:
                torch.manual_seed(0)
                model = models.MLP(16, 32)
                dynashard.parallelize(model, x)  # (compiler: Inductor, the default)
                assert model.up.weight.untyped_storage().nbytes() > 0  # left whole: nothing to cut at this size
                before = [torch._dynamo.utils.counters[g][w] for g, w in names]
                with torch.no_grad():
                    outputs.append(model(x))  # the first call after parallelize: the deferred compile
                counts.append([torch._dynamo.utils.counters[g][w] - b for (g, w), b in zip(names, before)])
            finally:
                dist.destroy_process_group()
                torch._dynamo.reset()
    # (AOTAutograd hit, FX graph miss, hit, bypass) per parallelize: compiled, then loaded
    assert counts == [[0, 1, 0, 0], [1, 0, 1, 0]], counts
    with torch.no_grad():
        torch.manual_seed(0)
        expected = models.MLP(16, 32)(x)
    # (Inductor's kernels against eager's, float32: a few ulps of a 16-wide reduction)
    assert all(torch.allclose(out, expected, atol=1e-5, rtol=1e-5) for out in outputs)


@pytest.mark.parametrize("world", [1, 2])
def test_a_dynamic_graph_parallelize_leaves_whole_serves_every_length(world):
    """An input marked dynamic before ``parallelize`` (Dynamo traces its length as a symbol), a graph with nothing
    to cut (world 2: under ``min_shard_numel``; world 1: nothing is cut), compiled by Inductor at its first call
    after the run: it serves every length Dynamo's guards let through. Compiled on the real inputs of that call,
    outside Dynamo's compile, it was compiled for their sizes alone, and a call of another length failed Inductor's
    size assert ("expected size 7==5")."""
    torch._dynamo.reset()
    private.init_fake_process_group(world, 0)
    try:
        torch.manual_seed(0)
        model, twin = models.MLP(16, 32), models.MLP(16, 32)
        twin.load_state_dict(model.state_dict())
        x = torch.randn(2, 5, 16)
        torch._dynamo.mark_dynamic(x, 1)
        dynashard.parallelize(model, x)
        with torch.no_grad():
            for length in (5, 7, 3):
                y = torch.randn(2, length, 16)
                # (Inductor's kernels against eager's, float32: a few ulps of a 16-wide reduction)
                torch.testing.assert_close(model(y), twin(y), atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_a_first_call_compile_that_adds_shape_guards_is_not_used(monkeypatch, fake_group):
    """``parallelize``'s graphs compile at their first call after its run, when Dynamo's guards for them are built
    already: a compile that added a guard (here a stand-in that specialises the traced length after compiling, and
    returns a program that must not run) would serve other lengths unchecked. That compile is not used: the graph
    runs as traced, with a warning, and every length gets the model's output."""
    compile_graph = private.compile_graph

    def specialising(compiler, gm, inputs, *args, **kwargs):
        compile_graph(compiler, gm, inputs, *args, **kwargs)
        length = next(d for t in inputs if isinstance(t, torch.Tensor) for d in t.shape if isinstance(d, torch.SymInt))
        int(length)  # (a guard on the ShapeEnv, length == 5, that Dynamo's entry never checks)

        def specialised(*call_args):
            raise AssertionError("the program compiled with a guard Dynamo does not check ran")
        return specialised

    monkeypatch.setattr(private, "compile_graph", specialising)
    torch.manual_seed(0)
    model, twin = models.MLP(16, 32), models.MLP(16, 32)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 16)
    torch._dynamo.mark_dynamic(x, 1)
    dynashard.parallelize(model, x)  # (nothing cut at this size: the whole graph, compiled at its first call)
    with torch.no_grad(), pytest.warns(UserWarning, match="added shape guards .* the compiled graph is not used"):
        outputs = [(model(y), twin(y)) for y in (torch.randn(2, n, 16) for n in (5, 7))]
    for out, expected in outputs:
        torch.testing.assert_close(out, expected)  # (the graph as traced: eager's ops, float32)
