"""``dynashard.parallelize``: shards registered as the model's parameters, on 2 real gloo ranks.

For an MLP, nanoGPT (a fused qkv cut per component, an LM head tied to a vocab-parallel
embedding) and a Llama decoder (GQA, RoPE): the parameters and state_dict are the shards, a later
``torch.compile(model, backend="dynashard")`` matches the unsharded model without cutting again,
``dcp.save(model.state_dict())`` (or DCP's ``get_model_state_dict``) writes every layout at its
global offsets (loaded whole in one process, and read back piece by piece), and calling the model
eagerly, parallelizing twice, copying it, replacing a shard or compiling with a conflicting plan
raise clear errors; an example that fails after a graph break leaves the model usable.

Each ``@on_ranks`` test runs on both ranks and asserts there (tests/scenarios.py): one spawn runs
them all, in order, each after ``torch._dynamo.reset()`` and ``torch.manual_seed(0)``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file, save_model
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import dynashard
from dynashard.dynamo_backend import dynashard_backend
from dynashard.errors import DynashardError, UsageError
from dynashard.load.checkpoint import Checkpoint, open_checkpoint
from dynashard.load.registered import facades as facades_of
from dynashard.weights.store import STORE
from tests import models
from tests.battery import SHARDED
from tests.multiproc import run_ranks
from tests.scenarios import Scenarios, from_rank0, raised

pytestmark = pytest.mark.gloo

# One spawn runs every @on_ranks test (three models parallelized, saved and loaded in every format):
# about 45 s of CPU per rank, 122-214 s of wall on the 2-core machine shared with other jobs; 480 s
# keeps the 2x margin over a quiet run on a machine 3.5x slower. The first test waits for all of it.
SCENARIOS_DEADLINE_S = 480
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)

MODELS = ("mlp", "nanogpt", "llama")
EAGER = {"min_shard_numel": 0, "compiler": "eager"}
RANK0 = {**EAGER, "weights": "rank0"}
# float32 sums of <= 128 products in another order: a few ulps (see test_numerics.py)
ATOL = 1e-5


def _hidden(name: str) -> int:
    return 128 if name == "llama" else 64


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@on_ranks
def test_parallelize_registers_shards_that_compile_save_and_run_plain_calls_sharded(rank, world, tmp_path):
    for name in MODELS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = models.build(name, _hidden(name), 96).eval()
        reference = copy.deepcopy(model)
        ids = name in models.IDS_IN
        inputs = [torch.randint(0, 96, s) if ids else torch.randn(*s, 64) for s in ((2, 7), (3, 5))]
        assert dynashard.parallelize(model, inputs[0], options=EAGER) is model, f"{name}: another model returned"
        _check_holds_its_shards(name, model, reference)
        _check_compiles_and_calls_sharded(name, model, reference, inputs)
        _check_misuse_is_refused(name, model, inputs[0])
        _check_saves_every_layout(name, model, reference, rank, world, str(tmp_path))


@on_ranks
def test_the_users_compile_reuses_parallelizes_trace_compiled_at_its_first_call(rank, world):
    """parallelize's example run leaves its program (aot_eager, compiled at its first call after the run) for
    torch.compile with the same options: no second Dynamo trace for the example's shape, and the model's
    values (a second shape traces, dynamic)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.build("llama", _hidden("llama"), 96).eval()
    reference = copy.deepcopy(model)
    options = {**EAGER, "compiler": "aot_eager"}
    inputs = [torch.randint(0, 96, s) for s in ((2, 7), (3, 5))]
    with torch.no_grad():
        dynashard.parallelize(model, inputs[0], options=options)
        traced = counters["stats"]["unique_graphs"]
        compiled = torch.compile(model, backend="dynashard", options=dict(options))
        assert _err(compiled(inputs[0]), reference(inputs[0])) < ATOL
        assert counters["stats"]["unique_graphs"] == traced, "the user's compile traced the example's call again"
        assert _err(compiled(inputs[1]), reference(inputs[1])) < ATOL
        assert _err(model(inputs[0]), reference(inputs[0])) < ATOL  # a plain call: the same program


def _check_holds_its_shards(name, model, reference):
    full = dict(reference.named_parameters())
    # a tied weight is one parameter: named_parameters() lists it once (nanoGPT: wte)
    sharded = {n for n, p in model.named_parameters() if p.shape != full[n].shape}
    assert sharded == SHARDED[name], (name, sorted(sharded))
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied weight under each name
    assert all(model.state_dict()[n].shape == p.shape for n, p in params.items()), f"{name}: state_dict not shards"
    held = dynashard.held_bytes(model) / sum(t.numel() * t.element_size() for t in full.values())
    assert held < 0.75, (name, held)


def _check_compiles_and_calls_sharded(name, model, reference, inputs):
    params = dict(model.named_parameters(remove_duplicate=False))
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return dynashard_backend(gm, example_inputs, EAGER)

    with torch.no_grad():
        compiled = torch.compile(model, backend=counting)
        err = max(_err(compiled(x), reference(x)) for x in inputs)
    assert err < ATOL, (name, err)
    assert len(compiles) <= 2, (name, len(compiles))  # the first shape, then Dynamo's dynamic recompile
    assert all(STORE.shard_of(f) is params[n] for n, f in _facades(model)), f"{name}: the compile cut again"
    with torch.no_grad():  # a plain call runs through dynashard (parallelize's options): sharded, no error
        err = max(_err(model(x), reference(x)) for x in inputs)
    assert err < ATOL, (name, err)
    assert all(STORE.shard_of(f) is params[n] for n, f in _facades(model)), f"{name}: a plain call cut again"


def _check_misuse_is_refused(name, model, x):
    submodule = model.up if name == "mlp" else model.layers[0].gate_proj if name == "llama" else model.h[0].c_fc
    with torch.no_grad():  # a submodule called on its own has no values to run on
        error = raised(lambda: submodule(torch.randn(2, _hidden(name))))
    assert isinstance(error, UsageError), (name, repr(error))
    assert "dynashard.parallelize registered" in str(error) and "torch.compile" in str(error), (name, str(error))
    error = raised(lambda: dynashard.parallelize(model, x, options=EAGER))
    assert isinstance(error, UsageError) and "already parallelized" in str(error), (name, repr(error))
    # (copying a freed tensor killed the process; a new object would be ignored silently)
    # load_state_dict re-raises ours inside a RuntimeError
    for act, says in ((lambda: copy.deepcopy(model), "cannot copy this model"),
                      (lambda: model.load_state_dict(model.state_dict(), assign=True), "cannot be replaced")):
        error = raised(act)
        assert isinstance(error, (UsageError, RuntimeError)) and says in str(error), (name, repr(error))


def _check_saves_every_layout(name, model, reference, rank, world, path):
    # torch.save of the state_dict (this rank's shards) and of the model's parameters: plain tensors
    # on disk (the DCP protocol's closures are not pickled), loadable with weights_only
    torch.save({"state": model.state_dict(), "params": list(model.parameters())}, f"{path}/{name}.{rank}.pt")
    saved = torch.load(f"{path}/{name}.{rank}.pt", weights_only=True)
    assert all(torch.equal(saved["state"][n], t) for n, t in model.state_dict().items()), name
    assert all(torch.equal(a, b) for a, b in zip(saved["params"], model.parameters())), name
    ckpt = f"{path}/{name}"
    # DCP's own state-dict API walks the FQNs with getattr: it reads the facades' metadata, saves the shards
    state = get_model_state_dict(model)
    assert state.keys() == model.state_dict().keys(), (name, state.keys())
    dcp.save(state, checkpoint_id=ckpt)
    dist.barrier()
    whole_equal = None
    if rank == 0:  # the checkpoint loads into the plain, unsharded model in one process
        whole = {n: torch.zeros_like(t) for n, t in reference.state_dict().items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
            dcp.load(whole, checkpoint_id=ckpt, no_dist=True)
        whole_equal = all(torch.equal(whole[n], t) for n, t in reference.state_dict().items())
    assert from_rank0(whole_equal), f"{name}: the DCP checkpoint loaded whole on rank 0 is not the model"
    reader = open_checkpoint(ckpt)  # and each rank reads its own pieces back
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(
        torch.equal(reader.read(n, STORE._shards[f].spec.dim, STORE._shards[f].spec.split.pieces(world, rank)),
                    params[n].detach())
        for n, f in _facades(model)), f"{name}: a piece read back differs from the shard"
    dist.barrier()


@on_ranks
def test_an_example_failing_after_a_graph_break_keeps_what_was_cut_and_compiles_later(rank, world):
    # The example raising after a graph break, once a graph before it was sharded: the model keeps
    # what was cut (registered) and the error says so; it then compiles and runs. (Under eager: what
    # parallelize keeps is decided before any compiler runs, and Inductor's start-up cost this spawn ~5 s
    # per rank; its lowering of a sharded program is test_numerics.py's.)
    failing = _FailsAfterABreak()
    reference = copy.deepcopy(failing)
    x = torch.randn(2, 64)
    error = raised(lambda: dynashard.parallelize(failing, x, options=EAGER))
    assert isinstance(error, UsageError), repr(error)
    assert "the model's own error" in str(error) and "now holds" in str(error), str(error)
    failing.fail = False
    with torch.no_grad():
        err = _err(torch.compile(failing, backend=dynashard.backend(**EAGER))(x), reference.mlp(x))
    assert err < ATOL, err


@on_ranks
def test_a_compile_asking_another_cut_of_a_parallelized_weight_is_refused(rank, world):
    # An error naming it, on every rank.
    mlp = dynashard.parallelize(models.build("mlp", 64, 96), torch.randn(2, 64), options={"min_shard_numel": 0})
    inverted = dynashard.backend(plan={"up": "rowwise", "down": "colwise"})
    with torch.no_grad():
        msg = str(raised(lambda: torch.compile(mlp, backend=inverted)(torch.randn(2, 64))))
    # (the inverted plan keeps up's bias whole, which parallelize cut: the first thing found)
    assert "'up.weight' was sharded as" in msg or "'up.bias' was sharded by" in msg, msg
    assert "parallelize" in msg, msg


class _FailsAfterABreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp, self.fail = models.MLP(64, 96), True

    def forward(self, x):
        y = self.mlp(x)
        if self.fail:
            print("a graph break: the graph above is compiled, and its weights cut, first")
            raise RuntimeError("the model's own error")
        return y


def _facades(model):
    for prefix, module in model.named_modules():
        for attr, facade in facades_of(module).items():
            yield (f"{prefix}.{attr}" if prefix else attr), facade


def _owned_storage_missing(model) -> list[str]:
    """Parameters not in a storage of their own bytes (a safetensors slice was a view of the whole tensor's)."""
    return [n for n, p in model.named_parameters() if p.untyped_storage().nbytes() != p.nbytes]


@on_ranks
def test_models_built_on_meta_load_their_slices_from_checkpoints(rank, world, tmp_path):
    """A model built under ``dynashard.empty_weights()`` (parameters on meta, buffers real) is
    parallelized from a checkpoint: safetensors (one file) and DCP; each rank reads its pieces of
    the cut weights and the rest whole, and the compiled model equals the one that was saved."""
    for name in MODELS:
        torch.manual_seed(0)
        reference = models.build(name, _hidden(name), 96).eval()
        x = torch.randint(0, 96, (2, 7)) if name in models.IDS_IN else torch.randn(2, 5, 64)
        for fmt in ("safetensors", "dcp"):
            ckpt = f"{tmp_path}/{name}.{fmt}"
            if fmt == "dcp":
                dcp.save(reference.state_dict(), checkpoint_id=ckpt)
            elif rank == 0:
                save_model(reference, ckpt)  # (a tied weight once, under one of its names)
            dist.barrier()
            torch._dynamo.reset()
            with dynashard.empty_weights():  # parameters on meta; buffers (RoPE tables, masks) real
                model = models.build(name, _hidden(name), 96).eval()
            dynashard.parallelize(model, x, options=EAGER, checkpoint=ckpt)
            with torch.no_grad():
                err = _err(torch.compile(model, backend=dynashard.backend(**EAGER))(x), reference(x))
            sharded = {n for n, p in model.named_parameters() if p.shape != reference.get_parameter(n).shape}
            assert err < ATOL and sharded == SHARDED[name], (name, fmt, err, sorted(sharded))
            # (its facades were made storage-less: a copy would kill the process)
            error = raised(lambda m=model: copy.deepcopy(m))
            assert isinstance(error, UsageError) and "cannot copy this model" in str(error), (name, fmt, repr(error))
            assert _owned_storage_missing(model) == [], (name, fmt, _owned_storage_missing(model))


@on_ranks
def test_a_bfloat16_checkpoint_is_read_in_the_float32_models_dtype(rank, world, tmp_path):
    reference = models.build("mlp", 64, 96).eval()
    ckpt = f"{tmp_path}/mlp_bf16.safetensors"
    if rank == 0:
        save_file({n: t.bfloat16() for n, t in reference.state_dict().items()}, ckpt)
    dist.barrier()
    with torch.no_grad():
        for t in reference.parameters():
            t.copy_(t.bfloat16().float())  # the values bf16 holds
    with dynashard.empty_weights():
        model = models.build("mlp", 64, 96).eval()
    dynashard.parallelize(model, torch.randn(2, 64), options=EAGER, checkpoint=ckpt)
    x = torch.randn(3, 64)
    with torch.no_grad():
        err = _err(torch.compile(model, backend=dynashard.backend(**EAGER))(x), reference(x))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    assert err < ATOL and dtypes == ["torch.float32"], (err, dtypes)


@on_ranks
def test_a_parameter_no_graph_reads_is_loaded_whole_from_the_checkpoint(rank, world, tmp_path):
    """A model built on meta whose forward never reads one of its parameters (the fuzz's attention: a per-head
    scale ``g`` its plain form leaves alone): ``parallelize(checkpoint=...)`` reads that one whole after the example,
    a plain tensor again. It raised "this tensor's storage was freed by dynashard, and its shard is gone" on every
    rank: its facade's ``copy_`` wrote into a shard it never had (found by tests/test_checkpoint_fuzz.py)."""
    from tests.test_fuzz import Attention

    torch.manual_seed(0)
    reference = Attention(8, 4).eval()
    ckpt = f"{tmp_path}/attention.safetensors"
    if rank == 0:
        save_file(reference.state_dict(), ckpt)
    dist.barrier()
    with dynashard.empty_weights():
        model = Attention(8, 4).eval()
    dynashard.parallelize(model, torch.randn(1, 5, 8), options=EAGER, checkpoint=ckpt)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        err = _err(model(x), reference(x))
    assert err < ATOL and type(model.g) is torch.nn.Parameter and torch.equal(model.g, reference.g), (err, model.g)


@on_ranks
def test_hf_gpt2_loads_from_save_pretrained_and_exports_back(rank, world, tmp_path):
    """HF GPT-2 as save_pretrained writes it (several files and an index; the tied LM head absent),
    and as from_pretrained maps it; exported back as an HF directory, then again as one file."""
    import transformers as T

    path = str(tmp_path)
    cfg = T.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=96)
    reference = T.GPT2LMHeadModel(cfg).eval()
    if rank == 0:
        reference.save_pretrained(f"{path}/gpt2", max_shard_size="100KB")
    dist.barrier()
    with dynashard.empty_weights():
        model = T.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 96, (2, 7))
    dynashard.parallelize(model, ids, options=EAGER, checkpoint=f"{path}/gpt2", use_cache=False)
    with torch.no_grad():
        got = torch.compile(model, backend=dynashard.backend(**EAGER))(ids, use_cache=False).logits
        err = _err(got, reference(ids, use_cache=False).logits)
    assert err < ATOL and _owned_storage_missing(model) == [], (err, _owned_storage_missing(model))
    # today's path on an HF checkpoint: from_pretrained on every rank maps the safetensors files (storage
    # that cannot be resized), then the first compiled call cuts and lets go of the full weights
    torch._dynamo.reset()
    mapped = T.AutoModelForCausalLM.from_pretrained(f"{path}/gpt2").eval()
    fast = torch.compile(mapped, backend=dynashard.backend(**EAGER))
    with torch.no_grad():
        err = max(_err(fast(x, use_cache=False).logits, reference(x, use_cache=False).logits)
                  for x in (ids, ids[:, :5]))
    held = dynashard.held_bytes(mapped) / sum(t.nbytes for t in reference.state_dict().values())
    assert err < ATOL and held < 0.75, (err, held)
    # exported as an HF directory (several files and an index), read back by from_pretrained
    dynashard.export_safetensors(model, f"{path}/gpt2_export", max_shard_size="100KB")
    read_back = _read_back(rank, reference, ids, f"{path}/gpt2_export")
    # the same weights bit for bit, so the same logits exactly; in 2+ files (100 KB each at most)
    assert read_back[0] == 0.0 and len([f for f in read_back[1] if f.endswith(".safetensors")]) > 1, read_back
    # exported again into that directory, now as one file, beside a tokenizer file: the earlier export's
    # files and index are gone (from_pretrained and parallelize would read different exports), the tokenizer kept
    if rank == 0:
        with open(f"{path}/gpt2_export/tokenizer.json", "w") as f:
            f.write("{}")
    dist.barrier()
    dynashard.export_safetensors(model, f"{path}/gpt2_export")
    read_back = _read_back(rank, reference, ids, f"{path}/gpt2_export")
    assert read_back == (0.0, ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]), (
        read_back)


def _read_back(rank, reference, ids, directory) -> tuple[float, list[str]]:
    """Rank 0 loads ``directory`` with from_pretrained: its logits' largest difference from
    ``reference``'s and the directory's files, on every rank."""
    import os

    import transformers as T

    found = None
    if rank == 0:
        again = T.AutoModelForCausalLM.from_pretrained(directory).eval()
        found = (_err(again(ids, use_cache=False).logits, reference(ids, use_cache=False).logits),
                 sorted(os.listdir(directory)))
    return from_rank0(found)


@on_ranks
def test_a_stale_checkpoint_on_one_rank_is_refused_on_every_rank(rank, world, tmp_path):
    # The same shapes, other values (rank 1's file): every rank refuses, nothing changes.
    if rank == 1:
        torch.manual_seed(5)
    ckpt = f"{tmp_path}/mlp.safetensors" if rank == 0 else f"{tmp_path}/mlp_stale.safetensors"
    save_model(models.build("mlp", 64, 96), ckpt)
    dist.barrier()
    with dynashard.empty_weights():
        model = models.build("mlp", 64, 96)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    error = raised(lambda: dynashard.parallelize(model, x, options=EAGER, checkpoint=ckpt))
    assert isinstance(error, UsageError), repr(error)
    assert "ranks [1] read a checkpoint other than rank 0's" in str(error), str(error)
    assert all(p.is_meta for p in model.parameters()), "the model changed"


@on_ranks
def test_a_bad_checkpoint_model_or_input_is_refused_before_anything_changes(rank, world, tmp_path):
    ckpt = f"{tmp_path}/mlp.safetensors"
    if rank == 0:
        save_model(models.build("mlp", 64, 96), ckpt)
    dist.barrier()
    for label, build, checkpoint, width, says in (  # says: the UsageError's words (None: any error)
            ("no checkpoint", lambda: models.build("mlp", 64, 96), None, 64, "on the meta device and no checkpoint="),
            ("other model", lambda: models.build("mlp", 64, 80), ckpt, 64,
             "'up.weight' is saved with shape [96, 64], the model has [80, 64]"),
            ("real weights", None, ckpt, 64, "expects a model built on the meta device"),
            ("bad input", lambda: models.build("mlp", 64, 96), ckpt, 65, None)):  # the model's own error, in the run
        if build is None:
            model = models.build("mlp", 64, 96)
        else:
            with dynashard.empty_weights():
                model = build()
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(1))
        error = raised(lambda: dynashard.parallelize(model, x, options=EAGER, checkpoint=checkpoint))  # noqa: B023
        assert says is None or (isinstance(error, UsageError) and says in str(error)), (label, repr(error))
        assert all(p.is_meta for p in model.parameters()) == (build is not None), f"{label}: the model changed"


@on_ranks
def test_rank0_holds_or_reads_the_weights_and_deals_every_rank_its_pieces(rank, world, tmp_path):
    """weights="rank0": rank 0 holds the model (or reads a safetensors file), rank 1 is built on meta
    and never holds it whole; outputs equal the unsharded model's, and the model exported back to one
    file (a fused qkv, a tied head) is the saved one bit for bit (uneven deals at world 4: the
    resharding test)."""
    for name in ("nanogpt", "llama"):  # a fused qkv and a tied head; GQA and RoPE
        torch.manual_seed(0)
        reference = models.build(name, 96, 96).eval()
        ids = torch.randint(0, 96, (2, 7))
        full = {n: p.detach().clone() for n, p in reference.named_parameters()}
        if rank == 0:
            save_model(reference, f"{tmp_path}/{name}.safetensors")
        for source in ("model", "checkpoint"):
            torch._dynamo.reset()
            if rank == 0 and source == "model":
                torch.manual_seed(0)
                model = models.build(name, 96, 96).eval()
            else:
                with dynashard.empty_weights():
                    model = models.build(name, 96, 96).eval()
            # other ranks' checkpoint= is not read (it need not exist there)
            ckpt = f"{tmp_path}/{name}.safetensors" if rank == 0 else "/nonexistent/on/this/rank"
            dynashard.parallelize(model, ids, options=RANK0, checkpoint=ckpt if source == "checkpoint" else None)
            with torch.no_grad():
                err = _err(torch.compile(model, backend=dynashard.backend(**RANK0))(ids), reference(ids))
            held = dynashard.held_bytes(model) / sum(t.nbytes for t in full.values())
            sharded = sorted(n for n, p in model.named_parameters() if p.shape != full[n].shape)
            # float32 sums of <= 96 products in another order: a few ulps (see test_numerics.py)
            assert err < ATOL and sharded and held < 0.6, (name, source, err, held, sharded)
        # exported back to one file (rank 0 gathers a tensor at a time): the saved model, bit for bit
        dynashard.export_safetensors(model, f"{tmp_path}/{name}.export.safetensors")
        differ = from_rank0(_same_as_saved(f"{tmp_path}/{name}.export.safetensors", reference) if rank == 0 else None)
        assert differ == [], (name, differ)


@on_ranks
def test_a_read_failing_halfway_on_rank0_raises_its_error_on_every_rank(rank, world, tmp_path):
    # A file that goes bad while loading: every rank raises rank 0's error at the same tensor, and
    # every model is back on meta.
    ckpt = _nanogpt_on_rank0(rank, tmp_path)
    with dynashard.empty_weights():
        model = models.build("nanogpt", 96, 96).eval()
    real_read = Checkpoint.read

    def failing(self, fqn, *args, **kwargs):
        if "c_fc" in fqn:
            raise OSError(f"disk gone while reading {fqn}")
        return real_read(self, fqn, *args, **kwargs)

    Checkpoint.read = failing if rank == 0 else real_read
    try:
        same_ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))  # (ranks' RNGs differ)
        error = raised(lambda: dynashard.parallelize(model, same_ids, options=RANK0, checkpoint=ckpt))
    finally:
        Checkpoint.read = real_read
    fails = f"{type(error).__name__}: {error}"
    assert isinstance(error, DynashardError) and "disk gone while reading" in fails and "c_fc" in fails, fails
    assert all(p.is_meta for p in model.parameters()), "the model changed"
    assert rank == 0 or fails.startswith("PeerError: dynashard: rank 0 failed while reading"), fails


@on_ranks
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank_before_anything_changes(rank, world, tmp_path):
    # A tensor missing from rank 0's checkpoint (a nanoGPT's, for an MLP).
    ckpt = _nanogpt_on_rank0(rank, tmp_path)
    with dynashard.empty_weights():
        model = models.build("mlp", 64, 96)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    error = raised(lambda: dynashard.parallelize(model, x, options=RANK0, checkpoint=ckpt))
    assert isinstance(error, DynashardError), repr(error)
    assert "does not fit the model" in str(error) and "'up.weight' is not in the checkpoint" in str(error), str(error)
    assert all(p.is_meta for p in model.parameters()), "the model changed"


def _nanogpt_on_rank0(rank: int, tmp_path) -> str | None:
    """A nanoGPT checkpoint only rank 0 has (the others pass checkpoint=None, as for a deal)."""
    if rank != 0:
        return None
    ckpt = f"{tmp_path}/nanogpt.safetensors"
    save_model(models.build("nanogpt", 96, 96).eval(), ckpt)
    return ckpt


def _same_as_saved(file: str, reference) -> list[str]:
    """Names whose tensor in ``file`` is not bitwise ``reference``'s (a tied weight once, under its
    first name), plus any name missing or extra."""
    import torch
    from safetensors.torch import load_file

    saved = load_file(file)
    state, seen = {}, set()
    for n, t in reference.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            state[n] = t.detach()
    bad = sorted(set(saved) ^ set(state))
    return bad + [n for n in state if n in saved and not torch.equal(saved[n], state[n])]




# a fused qkv and a tied head; 6 heads: 3/3 on 2 ranks, 2/2/1/1 on 4; 2 KV heads: 1/1 on 2 ranks, whole on 4
RESHARD = ("nanogpt", "llama_6_heads", "llama_few_kv")


def _save_parallelized(rank: int, world: int, path: str) -> bool:
    import torch
    import torch.distributed.checkpoint as dcp

    import dynashard
    from tests import models

    for name in RESHARD:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = models.build(name, 96, 96).eval()
        dynashard.parallelize(model, torch.randint(0, 96, (2, 7)), options={"min_shard_numel": 0, "compiler": "eager"})
        dcp.save(model.state_dict(), checkpoint_id=f"{path}/{name}")
    return True


def _load_resharded(rank: int, world: int, path: str) -> None:
    """At world 4, each model of ``_save_parallelized`` parallelized from its world-2 checkpoint onto the
    meta device: its outputs within 1e-5 of the unsharded model's, and (rank 0) every tensor it exports
    bit for bit the model's. Asserted on the rank, after its last collective."""
    import torch

    import dynashard
    from tests import models

    errors, differ = {}, {}
    for name in RESHARD:
        torch._dynamo.reset()
        torch.manual_seed(0)
        reference = models.build(name, 96, 96).eval()
        with dynashard.empty_weights():
            model = models.build(name, 96, 96).eval()
        ids = torch.randint(0, 96, (2, 7))
        options = {"min_shard_numel": 0, "compiler": "eager"}
        dynashard.parallelize(model, ids, options=options, checkpoint=f"{path}/{name}")
        with torch.no_grad():
            got = torch.compile(model, backend=dynashard.backend(**options))(ids)
            errors[name] = float((got - reference(ids)).abs().max())
        dynashard.export_safetensors(model, f"{path}/{name}.world4.safetensors")
        if rank == 0:  # every layout saved at world 2 and loaded at world 4: bit for bit the model's
            differ[name] = _same_as_saved(f"{path}/{name}.world4.safetensors", reference)
    assert all(e < 1e-5 for e in errors.values()), f"outputs loaded at world 4 vs the unsharded model's: {errors}"
    assert not any(differ.values()), f"tensors exported at world 4 that are not the model's, by model: {differ}"


@pytest.mark.timeout(420)
def test_a_checkpoint_saved_at_world_2_loads_at_world_4(tmp_path):
    """dcp.save of a parallelized model's state_dict at world 2 (3/3 heads, fused qkv cut per component,
    a tied head, 1/1 KV heads), then a meta model parallelized from it at world 4 (2/2/1/1 heads; 2 KV
    heads held whole, each rank narrowing them): the same outputs, and every tensor exported bit for bit.
    (Two spawns, one per world, the second reading what the first saved: Scenarios' spawns have a
    directory each, so this stays a run_ranks pair; _load_resharded asserts on its ranks.)"""
    assert run_ranks(_save_parallelized, 2, str(tmp_path), timeout=300) == [True, True]
    run_ranks(_load_resharded, 4, str(tmp_path), timeout=300)  # (raises the lowest failing rank's error)


