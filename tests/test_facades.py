"""Eager use of what dynashard leaves where a sharded tensor was (the table in docs/facades.md).

One process, torch's fake process group at world 2 (collectives move no data, so outputs are not
compared here; the shards dynashard holds are, against the cut of a full model that took the same
uses). Before facades, the reads below raised torch's storage error, returned garbage (``numpy``)
or killed the process (``sum``, ``+``, ``model.to``); copies into a compiled model were lost.
The two ``@on_ranks`` scenarios at the end (gloo tier) run on 2 real ranks and assert there
(tests/scenarios.py): a parallelized MLP against its twin, and HF generate's static cache.
"""

from __future__ import annotations

import copy
import io
import pickle
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dynashard
from dynashard import _torch as private
from dynashard.errors import UsageError
from dynashard.weights.facades import is_facade
from dynashard.weights.store import STORE, cut
from tests import models
from tests.scenarios import Scenarios


@pytest.fixture()
def compiled():
    """An MLP compiled at world 2 (rank 0 of a fake group, holding output features [0, 48) of up) and a
    twin that stays whole."""
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        torch.manual_seed(0)
        model = models.MLP(32, 96)
        twin = copy.deepcopy(model)
        fast = torch.compile(model, backend=dynashard.backend(min_shard_numel=0, compiler="eager"))
        with torch.no_grad():
            fast(torch.randn(4, 32))
        yield model, twin
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _shard(t):
    return STORE.shard_of(t)


def _cut_like(facade, full):
    spec = STORE.spec_of_any(facade)
    return cut(full.detach(), spec.dim, spec.split, spec.world, spec.rank)


@pytest.mark.unit
def test_metadata_reads_as_the_full_tensor(compiled):
    model, twin = compiled
    w, full = model.up.weight, twin.up.weight
    assert is_facade(w) and w.untyped_storage().nbytes() == 0
    assert (w.shape, w.dtype, w.device, w.numel(), w.stride(), w.dim(), w.requires_grad, w.is_contiguous()) == \
        (full.shape, full.dtype, full.device, full.numel(), full.stride(), full.dim(), True, True)
    assert len(w) == 96 and w.element_size() == 4 and w.grad is None


@pytest.mark.unit
def test_print_shows_shape_dtype_and_this_ranks_cut(compiled):
    text = repr(compiled[0].up.weight)
    assert "shape=[96, 32]" in text and "torch.float32" in text and "sharded by dynashard" in text, text
    assert "rank 0 of 2 holds [0:48] of dim 0" in text and f"{compiled[0].up.weight}" == text, text


USES_NEEDING_VALUES = {
    "sum": lambda m: m.up.weight.sum(),
    "add": lambda m: m.up.weight + 1,
    "numpy": lambda m: m.up.weight.detach().numpy(),
    "tolist": lambda m: m.up.weight.tolist(),
    "index": lambda m: m.up.weight[0],
    "item": lambda m: m.up.weight[0, 0].item(),
    "state_dict_math": lambda m: m.state_dict()["up.weight"] * 1,
    "linear": lambda m: F.linear(torch.randn(2, 32), m.up.weight),
    "uncompiled_module": lambda m: m(torch.randn(2, 32)),
    "random_init": lambda m: nn.init.normal_(m.up.weight),
    "copy_of_another_shape": lambda m: m.up.weight.copy_(torch.zeros(3)),
    "index_select_cut_dim": lambda m: m.up.weight.index_select(0, torch.tensor([1])),
}


@pytest.mark.unit
@pytest.mark.parametrize("use", sorted(USES_NEEDING_VALUES))
def test_a_use_that_needs_the_whole_value_raises_naming_the_tensor_and_the_fix(compiled, use):
    with pytest.raises(UsageError, match=r"'up\.weight' .*rank 0 of 2 holds \[0:48\].*|copy_ into 'up\.weight'"):
        USES_NEEDING_VALUES[use](compiled[0])


@pytest.mark.unit
def test_copies_and_saves_are_refused_naming_the_fix(compiled):
    model = compiled[0]
    with pytest.raises(UsageError, match="cannot copy this model"):
        copy.deepcopy(model)
    for what in (model, model.state_dict(), model.up.weight):
        with pytest.raises(UsageError, match="cannot save this tensor.*export_safetensors"):
            torch.save(what, io.BytesIO())
    with pytest.raises(UsageError, match="cannot save this tensor"):
        pickle.dumps(model.up.weight.detach())


@pytest.mark.unit
def test_load_state_dict_of_full_tensors_updates_the_shards(compiled):
    model, _ = compiled
    torch.manual_seed(1)
    other = models.MLP(32, 96)
    model.load_state_dict(other.state_dict())  # RL / EMA / hot reload into a compiled model
    for name in ("up.weight", "up.bias", "down.weight"):
        facade = model.get_parameter(name)
        assert torch.equal(_shard(facade), _cut_like(facade, other.get_parameter(name))), name
    assert torch.equal(model.down.bias, other.down.bias)  # (left whole: a plain copy)


@pytest.mark.unit
def test_in_place_fills_and_copies_act_on_the_shard(compiled):
    model, twin = compiled
    nn.init.zeros_(model.up.bias)
    assert not _shard(model.up.bias).any()
    model.up.weight.fill_(0.5)
    assert torch.equal(_shard(model.up.weight), torch.full((48, 32), 0.5))
    with torch.no_grad():
        model.down.weight.data.copy_(twin.down.weight * 2)  # (.data: a facade of the same shard)
    assert torch.equal(_shard(model.down.weight), _cut_like(model.down.weight, twin.down.weight * 2))


@pytest.mark.unit
def test_model_to_converts_the_shards_and_the_facades_follow(compiled):
    model, twin = compiled
    model.to(torch.float64)
    assert model.up.weight.dtype == torch.float64 and is_facade(model.up.weight)
    assert torch.equal(_shard(model.up.weight), _cut_like(model.up.weight, twin.up.weight).double())
    model.half()
    assert _shard(model.down.weight).dtype == torch.float16 and model.down.weight.dtype == torch.float16
    converted = model.up.weight.to(torch.float32)  # a new facade of a converted copy; the model's is unchanged
    assert is_facade(converted) and _shard(converted).dtype == torch.float32
    assert model.up.weight.dtype == torch.float16


@pytest.mark.unit
def test_detach_data_and_state_dict_are_facades_of_the_same_shard(compiled):
    model, _ = compiled
    w = model.up.weight
    for alias in (w.detach(), w.data, model.state_dict()["up.weight"]):
        assert is_facade(alias) and _shard(alias) is _shard(w) and alias.shape == w.shape


@pytest.mark.unit
def test_clone_is_a_facade_of_a_copy_of_the_shard(compiled):
    w = compiled[0].up.weight
    c = w.clone()
    assert is_facade(c) and torch.equal(_shard(c), _shard(w))
    assert _shard(c).untyped_storage().data_ptr() != _shard(w).untyped_storage().data_ptr()


@pytest.mark.unit
def test_requires_grad_and_hooks_reach_the_shard(compiled):
    model, _ = compiled
    w = model.up.weight
    w.requires_grad_(False)  # freezing a layer (LoRA): the shard that gets the gradient is frozen
    assert not STORE.as_parameter(w).requires_grad and not w.requires_grad
    w.requires_grad = True
    assert STORE.as_parameter(w).requires_grad
    handle = w.register_hook(lambda g: g)
    assert len(STORE.as_parameter(w)._backward_hooks) == 1
    handle.remove()


@pytest.mark.unit
def test_full_tensor_of_a_dtensor_parameter_is_a_plain_tensor_of_the_whole_shape(fake_group):
    """``parallelize(..., dtensor=True)``: ``dynashard.full_tensor`` of a DTensor parameter gathers it by its own
    placements into a plain tensor of the whole shape (its values: tests/test_training_2d.py, on real ranks). It
    rebuilt a DTensor around the gathered local tensor: whole-sized rows under ``Shard(0)``, a tensor that claims
    twice the rows on 2 ranks. Here on the fake group: shapes and types only."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    model = models.MLP(32, 96, bias=False)
    dynashard.parallelize(model, torch.randn(4, 32), dtensor=True,
                          options={"compiler": "eager", "min_shard_numel": 0, "group": DeviceMesh("cpu", [0, 1])})
    assert isinstance(model.up.weight, DTensor) and model.up.weight.to_local().shape == (48, 32)
    whole = dynashard.full_tensor(model.up.weight)
    assert type(whole) is torch.Tensor and whole.shape == (96, 32), (type(whole), whole.shape)


@pytest.mark.unit
def test_a_cache_the_graph_returned_answers_index_select_along_an_uncut_dim():
    """HF's reorder_cache (beam search) runs ``cache.index_select(0, beam_idx)`` eagerly on the cache
    facade: each rank selects from its own heads. Along the cut (head) dim it needs values it lacks.
    An index that keeps the head dim whole (HF's crop, beam search's ``cache[idx]``) selects from each
    rank's part; ``copy.deepcopy`` of the cache copies this rank's part (a weight's deepcopy stays refused)."""
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        model = models.CachedDecoder(form="lazy")
        fast = torch.compile(model, backend=dynashard.backend(min_shard_numel=0, compiler="eager"))
        with torch.no_grad():
            fast(torch.randint(0, 96, (2, 5)), torch.arange(5))
        cache = model.layers[0].kv_cache.k_cache
        assert is_facade(cache) and "KV cache returned by the graph" in repr(cache)
        picked = cache.index_select(0, torch.tensor([1, 1]))
        assert is_facade(picked) and picked.shape == cache.shape
        assert torch.equal(_shard(picked), _shard(cache).index_select(0, torch.tensor([1, 1])))
        with pytest.raises(UsageError, match="index_select needs the values"):
            cache.index_select(1, torch.tensor([0]))
        cropped = cache[..., :-2, :]  # HF's crop (assisted decoding): each rank its part's positions
        assert is_facade(cropped) and cropped.shape == (2, 4, 30, 8)
        assert torch.equal(_shard(cropped), _shard(cache)[:, :, :-2])
        picked = cache[torch.tensor([1, 0])]  # beam search's batch_select_indices
        assert torch.equal(_shard(picked), _shard(cache)[[1, 0]])
        picked = cache[torch.tensor([1, 0]), ...]  # (HF's keys[indices, ...])
        assert torch.equal(_shard(picked), _shard(cache)[[1, 0]])
        for index in (0, (slice(None), 1), (slice(None), slice(0, 1))):  # an int, or the cut (head) dim itself
            with pytest.raises(UsageError, match="__getitem__ needs the values"):
                cache[index]
        copied = copy.deepcopy(cache)  # HF's prompt-cache reuse: a copy of this rank's part, not an alias
        assert is_facade(copied) and copied.shape == cache.shape and torch.equal(_shard(copied), _shard(cache))
        cache.zero_()  # HF StaticCache.reset()
        assert not _shard(cache).any() and _shard(copied).any()
        with pytest.raises(UsageError, match="A cache the compiled graph returned holds this rank's part only"):
            cache.sum()
        with pytest.raises(UsageError, match="cannot copy this model"):  # a weight's copy is the model's, made first
            copy.deepcopy(model.layers[0].wqkv.weight)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


# A property test: any sequence of eager uses either does what the table says, on the shard, or raises a
# UsageError and changes nothing. The twin takes the same uses whole; the shards must stay its cut.
WORKS = {
    "zero_bias": (lambda m: nn.init.zeros_(m.up.bias), lambda t: nn.init.zeros_(t.up.bias)),
    "fill": (lambda m: m.down.weight.fill_(0.25), lambda t: t.down.weight.data.fill_(0.25)),
    "load": (lambda m: m.load_state_dict(_other().state_dict()), lambda t: t.load_state_dict(_other().state_dict())),
    "copy_scaled": (lambda m: m.up.weight.data.copy_(_other().up.weight * 3),
                    lambda t: t.up.weight.data.copy_(_other().up.weight * 3)),
    "to64": (lambda m: m.to(torch.float64), lambda t: t.to(torch.float64)),
    "to32": (lambda m: m.to(torch.float32), lambda t: t.to(torch.float32)),
    "freeze": (lambda m: m.up.weight.requires_grad_(False), lambda t: t.up.weight.requires_grad_(False)),
}


def _other():
    g = torch.Generator().manual_seed(7)
    other = models.MLP(32, 96)
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return other


@pytest.mark.unit
@settings(max_examples=15, deadline=None, derandomize=True)
@given(uses=st.lists(st.sampled_from(sorted(WORKS) + sorted(USES_NEEDING_VALUES)), min_size=1, max_size=6))
def test_random_eager_uses_act_on_the_shards_or_raise(uses):
    torch._dynamo.reset()
    private.init_fake_process_group(2, 1)
    try:
        torch.manual_seed(0)
        model = models.MLP(32, 96)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            torch.compile(model, backend=dynashard.backend(min_shard_numel=0, compiler="eager"))(torch.randn(4, 32))
        for use in uses:
            if use in WORKS:
                WORKS[use][0](model)
                WORKS[use][1](twin)
            else:
                with pytest.raises(UsageError):
                    USES_NEEDING_VALUES[use](model)
            for name, full in twin.named_parameters():
                facade = model.get_parameter(name)
                got = _shard(facade) if is_facade(facade) else facade.detach()
                want = _cut_like(facade, full) if is_facade(facade) else full.detach()
                assert got.dtype == want.dtype and torch.equal(got, want), (uses, use, name)
                assert facade.requires_grad == full.requires_grad, (uses, use, name)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


# ---------------------------------------------------------------- on real gloo ranks (world 2)

# One spawn runs both scenarios below (an MLP and a tiny HF Llama compiled eagerly per rank): 18 s on the
# 2-core machine under a load of 4 (other jobs); deadline 240 s.
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=240)
OPTIONS = {"min_shard_numel": 0, "compiler": "eager"}


@pytest.mark.gloo
@on_ranks
def test_facades_of_a_parallelized_model_reach_its_shards(rank, world):
    """After parallelize: the facade's answers reach the registered shards, a full-size load and
    model.to change what the compiled model computes exactly as they change the twin; full_tensor
    gathers the whole value; a submodule called alone raises, naming the shard parallelize registered."""
    model = models.MLP(32, 96)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 32)
    dynashard.parallelize(model, x, options=OPTIONS)
    fast = torch.compile(model, backend=dynashard.backend(**OPTIONS))
    shards = dict(model.named_parameters())
    model.up.weight.requires_grad_(False)
    frozen = (shards["up.weight"].requires_grad, model.up.weight.requires_grad)
    assert frozen == (False, False), f"(shard, facade) requires_grad after freezing the facade: {frozen}"
    model.up.weight.requires_grad_(True)
    seen = []
    model.down.weight.register_hook(lambda g: seen.append(tuple(g.shape)))
    fast(x).pow(2).sum().backward()
    # fired, with this rank's part of the gradient (down is rowwise: [32, 48])
    assert seen == [(32, 48)], f"gradient shapes the facade's hook saw: {seen}"
    # float32 sums of <= 96 products in another order (see test_numerics.py); full_tensor copies exactly
    err = float((dynashard.full_tensor(model.up.weight) - twin.up.weight).abs().max())
    assert err == 0.0, f"full_tensor(up.weight facade) vs the twin's up.weight: max abs diff {err}"
    err = float((dynashard.full_tensor(shards["down.weight"]) - twin.down.weight).abs().max())
    assert err == 0.0, f"full_tensor(down.weight shard) vs the twin's down.weight: max abs diff {err}"
    # other handles of a shard's memory are whole too (a state_dict value was this rank's piece, returned as is)
    state = model.state_dict()
    for name, handle in [("state_dict()['up.weight']", state["up.weight"]),
                         ("down.weight shard .detach()", shards["down.weight"].detach())]:
        whole = dynashard.full_tensor(handle)
        reference = twin.up.weight if name.startswith("state") else twin.down.weight
        assert whole.shape == reference.shape and torch.equal(whole, reference), f"full_tensor({name}): {whole.shape}"
    with pytest.raises(UsageError, match="reads part of the memory of this rank's shard of 'up.weight'"):
        dynashard.full_tensor(shards["up.weight"][:2])
    torch.manual_seed(1)
    new = models.MLP(32, 96)
    model.load_state_dict(new.state_dict())  # full-size tensors into the shards (pre-hook)
    with torch.no_grad():
        err = float((fast(x) - new(x)).abs().max())
        assert err < 1e-5, f"compiled model after load_state_dict vs the loaded MLP: max abs diff {err}"
        model.to(torch.float64)
        new.to(torch.float64)
        err = float((fast(x.double()) - new(x.double())).abs().max())
    dtypes = (model.up.weight.dtype, shards["up.weight"].dtype)
    assert err < 1e-12, f"compiled model after model.to(float64) vs the loaded MLP in float64: max abs diff {err}"
    assert dtypes == (torch.float64,) * 2, f"(facade, shard) dtype after model.to(float64): {dtypes}"
    with pytest.raises(UsageError, match=re.escape("dynashard.parallelize registered this rank's shard")):
        model.up(x.double())  # a submodule alone: its facade answers


@pytest.mark.gloo
@on_ranks
def test_hf_generates_static_cache_is_a_facade_read_whole_and_reordered_by_beam_search(rank, world):
    """HF generate's static cache (held by heads): greedy tokens equal the unsharded model's, the cache a
    facade of this rank's heads, read whole by full_tensor, refused by a reduction, and reordered eagerly
    by beam search."""
    import transformers as T

    cfg = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    lm, ref = T.LlamaForCausalLM(cfg).eval(), T.LlamaForCausalLM(cfg).eval()
    ref.load_state_dict(lm.state_dict())
    ids = torch.randint(3, 96, (1, 6))
    lm.forward = torch.compile(lm.forward, backend=dynashard.backend(**OPTIONS))
    kw = {"max_new_tokens": 4, "do_sample": False, "cache_implementation": "static"}
    got, want = (net.generate(ids, return_dict_in_generate=True, **kw) for net in (lm, ref))
    keys, ref_keys = got.past_key_values.layers[0].keys, want.past_key_values.layers[0].keys
    assert torch.equal(got.sequences, want.sequences), f"greedy tokens {got.sequences}, unsharded {want.sequences}"
    assert is_facade(keys), f"the static cache's keys are not a facade: {type(keys)}"
    # whole again through full_tensor: the same float32 values, 1e-5 as the logits
    err = float((dynashard.full_tensor(keys) - ref_keys).abs().max())
    assert err < 1e-5, f"full_tensor(cache keys) vs the unsharded model's cache keys: max abs diff {err}"
    with pytest.raises(UsageError, match="holds this rank's part only"):
        keys.sum()
    # beam search reorders the cache eagerly (index_select on the batch)
    beams, ref_beams = lm.generate(ids, num_beams=2, **kw), ref.generate(ids, num_beams=2, **kw)
    assert torch.equal(beams, ref_beams), f"beam search tokens {beams} vs the unsharded {ref_beams}"
