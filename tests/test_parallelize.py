"""``dynashard.parallelize``: shards registered as the model's parameters, on 2 real gloo ranks.

For an MLP, nanoGPT (a fused qkv cut per component, an LM head tied to a vocab-parallel
embedding) and a Llama decoder (GQA, RoPE): the parameters and state_dict are the shards, a later
``torch.compile(model, backend="dynashard")`` matches the unsharded model without cutting again,
``dcp.save(model.state_dict())`` (or DCP's ``get_model_state_dict``) writes every layout at its
global offsets (loaded whole in one process, and read back piece by piece), and calling the model
eagerly, parallelizing twice, copying it, replacing a shard or compiling with a conflicting plan
raise clear errors; an example that fails after a graph break leaves the model usable.
"""

from __future__ import annotations

import pytest

from tests.battery import SHARDED
from tests.multiproc import run_ranks

pytestmark = pytest.mark.gloo

MODELS = ("mlp", "nanogpt", "llama")


def _parallelize_and_check(rank: int, world: int, path: str) -> dict:
    import copy
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import dynashard
    from dynashard.checkpoint import open_checkpoint
    from dynashard.errors import UsageError
    from dynashard.weights import STORE
    from tests import models

    out = {}
    for name in MODELS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = models.build(name, 128 if name == "llama" else 64, 96).eval()
        reference = copy.deepcopy(model)
        full = {n: p.detach().clone() for n, p in reference.named_parameters()}
        ids = name in models.IDS_IN
        inputs = [torch.randint(0, 96, s) if ids else torch.randn(*s, 64) for s in ((2, 7), (3, 5))]
        options = {"min_shard_numel": 0, "compiler": "eager"}
        r: dict = {"returned_model": dynashard.parallelize(model, inputs[0], options=options) is model}
        params = dict(model.named_parameters(remove_duplicate=False))  # a tied weight under each name
        r["sharded"] = sorted(n for n, p in model.named_parameters() if p.shape != full[n].shape)
        r["state_dict_is_shards"] = all(model.state_dict()[n].shape == p.shape for n, p in params.items())
        r["held_fraction"] = dynashard.held_bytes(model) / sum(t.numel() * t.element_size() for t in full.values())
        compiles = []

        def counting(gm, example_inputs, options=options, compiles=compiles):
            from dynashard.dynamo_backend import dynashard_backend

            compiles.append(1)
            return dynashard_backend(gm, example_inputs, options)

        with torch.no_grad():
            compiled = torch.compile(model, backend=counting)
            r["max_err"] = max(float((compiled(x) - reference(x)).abs().max()) for x in inputs)
        r["compiles"] = len(compiles)
        r["same_shards"] = all(STORE.shard_of(f) is params[n] for n, f in _facades(model))
        with torch.no_grad():  # a plain call runs through dynashard (parallelize's options): sharded, no error
            r["plain_call_err"] = max(float((model(x) - reference(x)).abs().max()) for x in inputs)
        r["plain_call_kept_shards"] = all(STORE.shard_of(f) is params[n] for n, f in _facades(model))
        try:  # a submodule called on its own has no values to run on
            with torch.no_grad():
                (model.up if name == "mlp" else model.layers[0].gate_proj if name == "llama" else model.h[0].c_fc)(
                    torch.randn(2, 128 if name == "llama" else 64))
            r["eager"] = "ran"
        except UsageError as e:
            r["eager"] = str(e)
        try:
            dynashard.parallelize(model, inputs[0], options=options)
            r["twice"] = "ran"
        except UsageError as e:
            r["twice"] = str(e)
        for label, act in (("copy", lambda m=model: copy.deepcopy(m)),
                           ("assign", lambda m=model: m.load_state_dict(m.state_dict(), assign=True))):
            try:
                act()
                r[label] = "ran"
            except (UsageError, RuntimeError) as e:  # load_state_dict re-raises ours inside a RuntimeError
                r[label] = str(e)
        # torch.save of the state_dict (this rank's shards) and of the model's parameters: plain tensors
        # on disk (the DCP protocol's closures are not pickled), loadable with weights_only
        torch.save({"state": model.state_dict(), "params": list(model.parameters())}, f"{path}/{name}.{rank}.pt")
        saved = torch.load(f"{path}/{name}.{rank}.pt", weights_only=True)
        r["torch_save_equal"] = (all(torch.equal(saved["state"][n], t) for n, t in model.state_dict().items())
                                 and all(torch.equal(a, b) for a, b in zip(saved["params"], model.parameters())))
        ckpt = f"{path}/{name}"
        # DCP's own state-dict API walks the FQNs with getattr: it reads the facades' metadata, saves the shards
        state = get_model_state_dict(model)
        r["dcp_api_is_state_dict"] = state.keys() == model.state_dict().keys()
        dcp.save(state, checkpoint_id=ckpt)
        dist.barrier()
        if rank == 0:  # the checkpoint loads into the plain, unsharded model in one process
            whole = {n: torch.zeros_like(t) for n, t in reference.state_dict().items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
                dcp.load(whole, checkpoint_id=ckpt, no_dist=True)
            r["dcp_whole_equal"] = all(torch.equal(whole[n], t) for n, t in reference.state_dict().items())
        reader = open_checkpoint(ckpt)  # and each rank reads its own pieces back
        r["dcp_pieces_equal"] = all(
            torch.equal(reader.read(n, STORE._shards[f].spec.dim,
                                    STORE._shards[f].spec.split.pieces(world, rank)), params[n].detach())
            for n, f in _facades(model))
        dist.barrier()
        out[name] = r
    # The example raising after a graph break, once a graph before it was sharded: the model keeps
    # what was cut (registered) and the error says so; it then compiles and runs.
    torch._dynamo.reset()
    torch.manual_seed(0)
    failing = _FailsAfterABreak()
    reference = copy.deepcopy(failing)
    x = torch.randn(2, 64)
    try:
        dynashard.parallelize(failing, x, options={"min_shard_numel": 0})
        out["failed_example"] = "ran"
    except UsageError as e:
        out["failed_example"] = str(e)
    failing.fail = False
    with torch.no_grad():
        out["after_failure_err"] = float((torch.compile(failing, backend=dynashard.backend(min_shard_numel=0))(x)
                                          - reference.mlp(x)).abs().max())
    # A compile asking another cut of a parallelized weight: an error naming it, on every rank.
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = dynashard.parallelize(models.build("mlp", 64, 96), torch.randn(2, 64), options={"min_shard_numel": 0})
    try:
        with torch.no_grad():
            torch.compile(mlp, backend=dynashard.backend(plan={"up": "rowwise", "down": "colwise"}))(torch.randn(2, 64))
        out["conflict"] = "ran"
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error
        out["conflict"] = str(e)
    return out


class _FailsAfterABreak(__import__("torch").nn.Module):
    def __init__(self):
        from tests import models

        super().__init__()
        self.mlp, self.fail = models.MLP(64, 96), True

    def forward(self, x):
        y = self.mlp(x)
        if self.fail:
            print("a graph break: the graph above is compiled, and its weights cut, first")
            raise RuntimeError("the model's own error")
        return y


def _facades(model):
    from dynashard.parameters import FACADES

    for prefix, module in model.named_modules():
        for attr, facade in module.__dict__.get(FACADES, {}).items():
            yield (f"{prefix}.{attr}" if prefix else attr), facade


@pytest.mark.timeout(420)
def test_parallelize_registers_shards_that_compile_save_and_run_plain_calls_sharded(tmp_path):
    results = run_ranks(_parallelize_and_check, 2, str(tmp_path), timeout=360)
    for rank, out in enumerate(results):
        for name in MODELS:
            r = out[name]
            assert r["returned_model"] and r["state_dict_is_shards"] and r["same_shards"], (rank, name, r)
            # a tied weight is one parameter: named_parameters() lists it once (nanoGPT: wte)
            assert set(r["sharded"]) == SHARDED[name], (rank, name, r)
            assert r["held_fraction"] < 0.75, (rank, name, r)
            # float32 sums of <= 128 products in another order: a few ulps (see test_numerics.py)
            assert r["max_err"] < 1e-5, (rank, name, r)
            assert r["compiles"] <= 2, (rank, name, r)  # the first shape, then Dynamo's dynamic recompile
            assert r["plain_call_err"] < 1e-5 and r["plain_call_kept_shards"], (rank, name, r)
            assert "dynashard.parallelize registered" in r["eager"] and "torch.compile" in r["eager"], r["eager"]
            assert "already parallelized" in r["twice"], r["twice"]
            assert "cannot copy this model" in r["copy"], r["copy"]  # (copying a freed tensor killed the process)
            assert "cannot be replaced" in r["assign"], r["assign"]  # (a new object would be ignored silently)
            assert r["dcp_api_is_state_dict"] and r["torch_save_equal"], (rank, name, r)
            assert r.get("dcp_whole_equal", True) and r["dcp_pieces_equal"], (rank, name, r)
        assert rank != 0 or all("dcp_whole_equal" in out[n] for n in MODELS)
        # (the inverted plan keeps up's bias whole, which parallelize cut: the first thing found)
        assert ("'up.weight' was sharded as" in out["conflict"] or "'up.bias' was sharded by" in out["conflict"]
                ) and "parallelize" in out["conflict"], out["conflict"]
        assert "the model's own error" in out["failed_example"] and "now holds" in out["failed_example"], out
        assert out["after_failure_err"] < 1e-5, out


def _load_from_checkpoints(rank: int, world: int, path: str) -> dict:
    import copy
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers as T
    from safetensors.torch import save_model

    import dynashard
    from dynashard.errors import UsageError
    from tests import models

    out: dict = {}
    options = {"min_shard_numel": 0, "compiler": "eager"}
    for name in MODELS:
        torch.manual_seed(0)
        reference = models.build(name, 128 if name == "llama" else 64, 96).eval()
        x = torch.randint(0, 96, (2, 7)) if name in models.IDS_IN else torch.randn(2, 5, 64)
        for fmt in ("safetensors", "dcp"):
            ckpt = f"{path}/{name}.{fmt}"
            if fmt == "dcp":
                dcp.save(reference.state_dict(), checkpoint_id=ckpt)
            elif rank == 0:
                save_model(reference, ckpt)  # (a tied weight once, under one of its names)
            dist.barrier()
            torch._dynamo.reset()
            with dynashard.empty_weights():  # parameters on meta; buffers (RoPE tables, masks) real
                model = models.build(name, 128 if name == "llama" else 64, 96).eval()
            dynashard.parallelize(model, x, options=options, checkpoint=ckpt)
            with torch.no_grad():
                got = torch.compile(model, backend=dynashard.backend(**options))(x)
            try:
                copy.deepcopy(model)  # (its facades were made storage-less: a copy would kill the process)
                out[f"{name}.{fmt}.copy"] = "ran"
            except UsageError as e:
                out[f"{name}.{fmt}.copy"] = str(e)
            out[f"{name}.{fmt}"] = (float((got - reference(x)).abs().max()),
                                    sorted(n for n, p in model.named_parameters()
                                           if p.shape != reference.get_parameter(n).shape))
            # each shard in a storage of its own bytes (a safetensors slice was a view of the whole tensor's)
            out[f"{name}.{fmt}.owned"] = [n for n, p in model.named_parameters()
                                          if p.untyped_storage().nbytes() != p.nbytes]
    # a bfloat16 checkpoint into a float32 model: read in the model's dtype (the values bf16 holds)
    torch.manual_seed(0)
    reference = models.build("mlp", 64, 96).eval()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({n: t.bfloat16() for n, t in reference.state_dict().items()}, f"{path}/mlp_bf16.safetensors")
    dist.barrier()
    with torch.no_grad():
        for t in reference.parameters():
            t.copy_(t.bfloat16().float())
    torch._dynamo.reset()
    with dynashard.empty_weights():
        model = models.build("mlp", 64, 96).eval()
    dynashard.parallelize(model, torch.randn(2, 64), options=options, checkpoint=f"{path}/mlp_bf16.safetensors")
    x = torch.randn(3, 64)
    with torch.no_grad():
        got = torch.compile(model, backend=dynashard.backend(**options))(x)
        out["bf16_into_fp32"] = (float((got - reference(x)).abs().max()),
                                 sorted({str(p.dtype) for p in model.parameters()}))
    # HF GPT-2 as save_pretrained writes it (several files and an index; the tied LM head absent)
    cfg = T.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=96)
    torch.manual_seed(0)
    reference = T.GPT2LMHeadModel(cfg).eval()
    if rank == 0:
        reference.save_pretrained(f"{path}/gpt2", max_shard_size="100KB")
    dist.barrier()
    torch._dynamo.reset()
    with dynashard.empty_weights():
        model = T.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 96, (2, 7))
    dynashard.parallelize(model, ids, options=options, checkpoint=f"{path}/gpt2", use_cache=False)
    with torch.no_grad():
        got = torch.compile(model, backend=dynashard.backend(**options))(ids, use_cache=False).logits
    out["hf_gpt2"] = float((got - reference(ids, use_cache=False).logits).abs().max())
    out["hf_gpt2_owned"] = [n for n, p in model.named_parameters() if p.untyped_storage().nbytes() != p.nbytes]
    # today's path on an HF checkpoint: from_pretrained on every rank maps the safetensors files (storage
    # that cannot be resized), then the first compiled call cuts and lets go of the full weights
    torch._dynamo.reset()
    mapped = T.AutoModelForCausalLM.from_pretrained(f"{path}/gpt2").eval()
    fast = torch.compile(mapped, backend=dynashard.backend(**options))
    with torch.no_grad():
        out["hf_gpt2_mapped"] = max(float((fast(x, use_cache=False).logits - reference(x, use_cache=False).logits)
                                          .abs().max()) for x in (ids, ids[:, :5]))
    out["hf_gpt2_mapped_held"] = dynashard.held_bytes(mapped) / sum(t.nbytes for t in reference.state_dict().values())
    # exported as an HF directory (several files and an index), read back by from_pretrained
    dynashard.export_safetensors(model, f"{path}/gpt2_export", max_shard_size="100KB")
    if rank == 0:
        again = T.AutoModelForCausalLM.from_pretrained(f"{path}/gpt2_export").eval()
        out["hf_gpt2_export"] = (float((again(ids, use_cache=False).logits
                                        - reference(ids, use_cache=False).logits).abs().max()),
                                 len([f for f in os.listdir(f"{path}/gpt2_export") if f.endswith(".safetensors")]))
    # exported again into that directory, now as one file, beside a tokenizer file: the earlier export's
    # files and index are gone (from_pretrained and parallelize would read different exports), the tokenizer kept
    if rank == 0:
        with open(f"{path}/gpt2_export/tokenizer.json", "w") as f:
            f.write("{}")
    dist.barrier()
    dynashard.export_safetensors(model, f"{path}/gpt2_export")
    if rank == 0:
        again = T.AutoModelForCausalLM.from_pretrained(f"{path}/gpt2_export").eval()
        out["hf_gpt2_export_again"] = (float((again(ids, use_cache=False).logits
                                              - reference(ids, use_cache=False).logits).abs().max()),
                                       sorted(os.listdir(f"{path}/gpt2_export")))
    # a stale copy on one rank: the same shapes, other values (rank 1's file); every rank refuses, nothing changes
    if rank == 1:
        torch.manual_seed(5)
        save_model(models.build("mlp", 64, 96), f"{path}/mlp_stale.safetensors")
    dist.barrier()
    with dynashard.empty_weights():
        model = models.build("mlp", 64, 96)
    try:
        ckpt = f"{path}/mlp.safetensors" if rank == 0 else f"{path}/mlp_stale.safetensors"
        dynashard.parallelize(model, torch.randn(2, 64, generator=torch.Generator().manual_seed(1)), options=options,
                              checkpoint=ckpt)
        out["stale_copy"] = "ran"
    except UsageError as e:
        out["stale_copy"] = str(e)
    out["stale_copy_unchanged"] = all(p.is_meta for p in model.parameters())
    # Errors, before anything changes
    for label, build, ckpt, width in (
            ("no_checkpoint", lambda: models.build("mlp", 64, 96), None, 64),
            ("other_model", lambda: models.build("mlp", 64, 80), f"{path}/mlp.safetensors", 64),
            ("real_weights", None, f"{path}/mlp.safetensors", 64),
            ("bad_input", lambda: models.build("mlp", 64, 96), f"{path}/mlp.safetensors", 65)):  # fails in the run
        if build is None:
            model = models.build("mlp", 64, 96)
        else:
            with dynashard.empty_weights():
                model = build()
        try:
            dynashard.parallelize(model, torch.randn(2, width), options=options, checkpoint=ckpt)
            out[label] = "ran"
        except Exception as e:  # noqa: BLE001 - UsageError, or the model's own error for bad_input
            out[label] = f"{type(e).__name__ if not isinstance(e, UsageError) else 'UsageError'}: {e}"
        out[label + "_unchanged"] = all(p.is_meta for p in model.parameters()) == (build is not None)
    return out


def _load_from_checkpoints_and_rank0(rank: int, world: int, path: str) -> dict:
    import os

    os.makedirs(f"{path}/rank0", exist_ok=True)
    return {**_load_from_checkpoints(rank, world, path), "rank0": _load_from_rank0(rank, world, f"{path}/rank0")}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """One spawn of 2 ranks for the loading tests below."""
    return run_ranks(_load_from_checkpoints_and_rank0, 2, str(tmp_path_factory.mktemp("load")), timeout=360)


@pytest.mark.timeout(420)
def test_models_built_on_meta_load_their_slices_from_checkpoints(loaded):
    """A model built under ``dynashard.empty_weights()`` (parameters on meta, buffers real) is
    parallelized from a checkpoint: safetensors (one file), DCP, and an HF directory with its index;
    each rank reads its pieces of the cut weights and the rest whole, and the compiled model equals
    the one that was saved."""
    for rank, out in enumerate(loaded):
        for name in MODELS:
            for fmt in ("safetensors", "dcp"):
                err, sharded = out[f"{name}.{fmt}"]
                assert err < 1e-5 and set(sharded) == SHARDED[name], (rank, name, fmt, err, sharded)
                assert "cannot copy this model" in out[f"{name}.{fmt}.copy"], out[f"{name}.{fmt}.copy"]
                assert out[f"{name}.{fmt}.owned"] == [], (rank, name, fmt, out[f"{name}.{fmt}.owned"])
        assert out["hf_gpt2"] < 1e-5 and out["hf_gpt2_owned"] == [], out
        assert rank != 0 or out["hf_gpt2_export_again"] == (
            0.0, ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]), out
        assert "ranks [1] read a checkpoint other than rank 0's" in out["stale_copy"], out["stale_copy"]
        assert out["stale_copy_unchanged"], out
        assert out["bf16_into_fp32"][0] < 1e-5 and out["bf16_into_fp32"][1] == ["torch.float32"], out
        assert out["hf_gpt2_mapped"] < 1e-5 and out["hf_gpt2_mapped_held"] < 0.75, out
        # the same weights bit for bit, so the same logits exactly; in 2+ files (100 KB each at most)
        assert rank != 0 or (out["hf_gpt2_export"][0] == 0.0 and out["hf_gpt2_export"][1] > 1), out
        assert all(out[k].startswith("UsageError") for k in ("no_checkpoint", "other_model", "real_weights")), out
        assert "on the meta device and no checkpoint=" in out["no_checkpoint"], out["no_checkpoint"]
        assert "'up.weight' is saved with shape [96, 64], the model has [80, 64]" in out["other_model"], out
        assert "expects a model built on the meta device" in out["real_weights"], out["real_weights"]
        assert out["bad_input"] != "ran", out
        assert all(out[k + "_unchanged"] for k in ("no_checkpoint", "other_model", "real_weights", "bad_input")), out


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


def _load_resharded(rank: int, world: int, path: str) -> dict:
    import torch

    import dynashard
    from tests import models

    out = {}
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
            out[name] = float((got - reference(ids)).abs().max())
        dynashard.export_safetensors(model, f"{path}/{name}.world4.safetensors")
        if rank == 0:  # every layout saved at world 2 and loaded at world 4: bit for bit the model's
            out[f"{name}.bitwise"] = _same_as_saved(f"{path}/{name}.world4.safetensors", reference)
    return out


@pytest.mark.timeout(420)
def test_a_checkpoint_saved_at_world_2_loads_at_world_4(tmp_path):
    """dcp.save of a parallelized model's state_dict at world 2 (3/3 heads, fused qkv cut per component,
    a tied head, 1/1 KV heads), then a meta model parallelized from it at world 4 (2/2/1/1 heads; 2 KV
    heads held whole, each rank narrowing them): the same outputs, and every tensor exported bit for bit."""
    assert run_ranks(_save_parallelized, 2, str(tmp_path), timeout=300) == [True, True]
    for rank, out in enumerate(run_ranks(_load_resharded, 4, str(tmp_path), timeout=300)):
        assert all(out[name] < 1e-5 for name in RESHARD), (rank, out)
        assert rank != 0 or all(out[f"{name}.bitwise"] == [] for name in RESHARD), out


def _load_from_rank0(rank: int, world: int, path: str) -> dict:
    """weights="rank0": only rank 0 holds the model (or reads the checkpoint); the others are built
    on meta and get their pieces from it."""
    import torch
    from safetensors.torch import save_model

    import dynashard
    from dynashard.checkpoint import Checkpoint
    from dynashard.errors import DynashardError
    from tests import models

    out: dict = {}
    options = {"min_shard_numel": 0, "compiler": "eager", "weights": "rank0"}
    for name in ("nanogpt", "llama"):  # a fused qkv and a tied head; GQA and RoPE
        torch.manual_seed(0)
        reference = models.build(name, 96, 96).eval()
        ids = torch.randint(0, 96, (2, 7))
        full = {n: p.detach().clone() for n, p in reference.named_parameters()}
        if rank == 0:
            save_model(reference, f"{path}/{name}.safetensors")
        for source in ("model", "checkpoint"):
            torch._dynamo.reset()
            if rank == 0 and source == "model":
                torch.manual_seed(0)
                model = models.build(name, 96, 96).eval()
            else:
                with dynashard.empty_weights():
                    model = models.build(name, 96, 96).eval()
            # other ranks' checkpoint= is not read (it need not exist there)
            ckpt = f"{path}/{name}.safetensors" if rank == 0 else "/nonexistent/on/this/rank"
            dynashard.parallelize(model, ids, options=options, checkpoint=ckpt if source == "checkpoint" else None)
            with torch.no_grad():
                got = torch.compile(model, backend=dynashard.backend(**options))(ids) - reference(ids)
            out[f"{name}.{source}"] = (
                float(got.abs().max()),
                dynashard.held_bytes(model) / sum(t.nbytes for t in full.values()),
                sorted(n for n, p in model.named_parameters() if p.shape != full[n].shape))
        # exported back to one file (rank 0 gathers a tensor at a time): the saved model, bit for bit
        dynashard.export_safetensors(model, f"{path}/{name}.export.safetensors")
        if rank == 0:
            out[f"{name}.export"] = _same_as_saved(f"{path}/{name}.export.safetensors", reference)
    # Rank 0's read fails halfway (a file that goes bad while loading): every rank raises rank 0's
    # error at the same tensor, and every model is back on meta.
    torch._dynamo.reset()
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
        dynashard.parallelize(model, same_ids, options=options,
                              checkpoint=f"{path}/nanogpt.safetensors" if rank == 0 else None)
        out["read_fails"] = "ran"
    except DynashardError as e:
        out["read_fails"] = f"{type(e).__name__}: {e}"
    finally:
        Checkpoint.read = real_read
    out["read_fails_unchanged"] = all(p.is_meta for p in model.parameters())
    # A tensor missing from rank 0's checkpoint: refused on every rank before anything changes
    torch._dynamo.reset()
    with dynashard.empty_weights():
        model = models.build("mlp", 64, 96)
    try:
        dynashard.parallelize(model, torch.randn(2, 64, generator=torch.Generator().manual_seed(1)), options=options,
                              checkpoint=f"{path}/nanogpt.safetensors" if rank == 0 else None)
        out["wrong_checkpoint"] = "ran"
    except DynashardError as e:
        out["wrong_checkpoint"] = f"{type(e).__name__}: {e}"
    out["wrong_checkpoint_unchanged"] = all(p.is_meta for p in model.parameters())
    return out


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


@pytest.mark.timeout(420)
def test_rank0_holds_or_reads_the_weights_and_deals_every_rank_its_pieces(loaded):
    """weights="rank0": rank 0 holds the model (or reads a safetensors file), rank 1 is built on meta
    and never holds it whole; outputs equal the unsharded model's, and the model exported back to one
    file (a fused qkv, a tied head) is the saved one bit for bit (uneven deals at world 4: the
    resharding test). A read failing on rank 0 halfway and a checkpoint that does not fit are errors
    on every rank, models left on meta."""
    for rank, out in enumerate(r["rank0"] for r in loaded):
        for name in ("nanogpt", "llama"):
            for source in ("model", "checkpoint"):
                err, held, sharded = out[f"{name}.{source}"]
                # float32 sums of <= 96 products in another order: a few ulps (see test_numerics.py)
                assert err < 1e-5 and sharded and held < 0.6, (rank, name, source, out[f"{name}.{source}"])
        fails = out["read_fails"]
        assert "disk gone while reading" in fails and "c_fc" in fails, (rank, fails)
        assert rank == 0 or fails.startswith("PeerError: dynashard: rank 0 failed while reading"), (rank, fails)
        assert out["read_fails_unchanged"], (rank, out)
        wrong = out["wrong_checkpoint"]
        assert "does not fit the model" in wrong and "'up.weight' is not in the checkpoint" in wrong, (rank, wrong)
        assert out["wrong_checkpoint_unchanged"], (rank, out)
        assert rank != 0 or out["nanogpt.export"] == out["llama.export"] == [], out
