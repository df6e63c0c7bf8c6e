"""LoRA adapters (PEFT) cut with the layers they belong to: no extra collective, the twin's gradients.

A PEFT ``lora.Linear`` computes ``base(x) + s * B(A(dropout(x)))``. On a colwise base (q, k, v, gate,
up) A stays whole and B is cut on its output rows like the base; on a rowwise base (o, down) A is cut
on its input features like the base, and B, whole, is applied to each rank's partial sums of A's
output, so the adapter's sum joins the base's one all_reduce (match_adapters.py). The unit test
counts collectives in the rewritten graph (fake group); the gloo scenarios train the adapters at
world 2 against the unsharded twin on raw gradients (SGD: Adam would hide a wrong scale).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dynashard
from tests.scenarios import Scenarios

# One spawn at world 2 runs the scenarios: the first 4 took ~230 s on the 2-core machine under a load of other
# jobs (the unit test ~90 s beside it); the whole file with 6 took 146 s here under a lighter load (the
# several-adapters one ~70 s of it alone). 600 s leaves a 2x margin.
SCENARIOS_DEADLINE_S = 600
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)
pytestmark = pytest.mark.timeout(SCENARIOS_DEADLINE_S + 60)  # (the first scenario's test waits for the spawn)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTIONS = {"min_shard_numel": 0, "compiler": "eager"}
# float32: the sharded matmuls sum the same products in another order, forward and backward
# (measured < 1e-6 relative to each gradient's largest element over 3 steps); a defect this file
# guards against (a partial gradient, a missing all_reduce) is of the order of 1.
RTOL = 1e-4


class Logits(nn.Module):
    """A causal LM as the tests call it: ids in, logits out (no cache)."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, use_cache=False).logits


def llama(layers: int = 2, seed: int = 0):
    import transformers as T

    torch.manual_seed(seed)
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=96))


def lora(model, dropout: float = 0.0, seed: int = 1, **kw):
    """PEFT LoRA on every projection, B initialised at random (PEFT's zeros would hide B's cut)."""
    import peft

    lm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                    target_modules=TARGETS, **kw))
    randomise_b(lm, seed)
    return lm


def randomise_b(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _count(gm, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


@pytest.mark.unit
def test_lora_on_every_projection_costs_no_collective():
    """2 layers of HF Llama: 5 all_reduces (2 per layer and the embedding's) with or without LoRA on
    its 7 projections, no gather; the plan says why each adapter is cut as it is."""
    from tests.test_graphs import rewritten

    ids = torch.randint(0, 96, (2, 7))
    plain = rewritten(Logits(llama()), ids)
    adapted = rewritten(Logits(lora(llama())), ids)
    assert (_count(plain, "all_reduce"), _count(plain, "all_gather")) == (5, 0)
    assert (_count(adapted, "all_reduce"), _count(adapted, "all_gather")) == (5, 0)
    plan = dynashard.explain(Logits(lora(llama(layers=1))), ids, world_size=2, options=OPTIONS)
    layers = {r.fqn.split("layers.0.")[-1]: r for r in plan.rows}
    o_a, o_b = layers["self_attn.o_proj.lora_A.default"], layers["self_attn.o_proj.lora_B.default"]
    q_a, q_b = layers["self_attn.q_proj.lora_A.default"], layers["self_attn.q_proj.lora_B.default"]
    assert (o_a.style, o_b.style, q_a.style, q_b.style) == ("rowwise", "replicate", "replicate", "colwise"), str(plan)
    assert "joins the base's one all_reduce" in o_a.reason or "join the base's" in o_a.reason, o_a.reason


def int8(model):
    """``model`` with torchao's per-row int8 weight-only linears (``(x @ qdata.t()) * scale``)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())
    return model


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:TorchaoLoraLinear was instantiated")  # (PEFT: merge needs HF's TorchAoConfig)
def test_lora_on_an_int8_base_costs_no_collective():
    """QLoRA's layout: LoRA on per-row int8 base layers (PEFT's ``TorchaoLoraLinear``), whose output is scaled per
    feature after the matmul. The adapters are cut by their bases as on a float model: 5 all_reduces for 2
    layers, none added. Before: the scale between the base's matmul and the add hid the base from the adapter
    matcher, A and B were planned as layers of their own, and the plan ran 28 all_reduces."""
    from tests.test_graphs import rewritten

    ids = torch.randint(0, 96, (2, 7))
    adapted = rewritten(Logits(lora(int8(llama()))), ids)
    assert (_count(adapted, "all_reduce"), _count(adapted, "all_gather")) == (5, 0)  # (as float LoRA's, above)


def gpt2_lora(bias: str = "none"):
    """PEFT LoRA on a 2-layer HF GPT-2's Conv1D layers (``fan_in_fan_out``), whose rowwise ones (both
    ``c_proj``) have a bias; ``bias="all"``: the biases train too. B at random; no dropout (a model built from a
    config is in train mode)."""
    import peft
    import transformers as T

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # (the twin's draws)
    lm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                                                    fan_in_fan_out=True, bias=bias))
    randomise_b(lm, 1)
    return lm


@pytest.mark.unit
def test_lora_on_a_rowwise_base_with_a_bias_costs_no_collective():
    """GPT-2's rowwise layers (``c_proj``, attention's and the MLP's) have a bias: their LoRA's partial sums join
    the base's one all_reduce, the bias added by rank 0 alone, as many collectives as GPT-2 without LoRA. Before:
    a biased base kept its own all_reduce and A's ``r`` features had one more (10 all_reduces instead of 6)."""
    import transformers as T

    from tests.test_graphs import rewritten

    ids = torch.randint(0, 96, (2, 7))
    torch.manual_seed(0)
    plain = rewritten(Logits(T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96,
                                                            n_positions=32))), ids)
    adapted = rewritten(Logits(gpt2_lora()), ids)
    assert (_count(adapted, "all_reduce"), _count(adapted, "all_gather")) == \
        (_count(plain, "all_reduce"), _count(plain, "all_gather")) == (6, 1)


def embedding_lora(model, seed: int = 1):
    """PEFT LoRA on the embedding (``lora.Embedding``) and every projection, both B factors at random."""
    import peft

    lm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", *TARGETS]))
    randomise_b(lm, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return lm


@pytest.mark.unit
def test_lora_on_the_embedding_costs_no_collective():
    """An embedding's LoRA (``embed(ids) + s * embedding(A.T, ids) @ B.T``: A a table, no A linear): B held whole,
    added after the vocab-parallel lookup's all_reduce, and the rest of the plan as without it: 5 all_reduces for 2
    layers. Before: B ([hidden, r]) was planned as a colwise layer of its own, the residual stream cut after the
    embedding and every layer's pairs turned around (19 all_reduces)."""
    from tests.test_graphs import rewritten

    ids = torch.randint(0, 96, (2, 7))
    adapted = rewritten(Logits(embedding_lora(llama())), ids)
    assert (_count(adapted, "all_reduce"), _count(adapted, "all_gather")) == (5, 0)


@pytest.mark.unit
def test_plan_dicts_and_hf_plans_reach_peft_base_layers():
    """HF Llama's own base_model_tp_plan on a PEFT model (module names gain ``base_model.model.`` and
    ``.base_layer``): the base layers are cut as the plan says and each adapter by its base, so LoRA adds no
    collective (2 all_reduces a layer, the embedding not in the plan: whole). A dict of PEFT's own module
    names plans the same; a key naming no module is still refused."""
    import transformers as T

    from tests.test_graphs import rewritten

    ids = torch.randint(0, 96, (2, 7))
    hf = dict(T.LlamaConfig.base_model_tp_plan)
    plain = rewritten(Logits(llama()), ids, plan=hf)
    adapted = rewritten(Logits(lora(llama())), ids, plan=hf)
    assert (_count(plain, "all_reduce"), _count(plain, "all_gather")) == (4, 0)
    assert (_count(adapted, "all_reduce"), _count(adapted, "all_gather")) == (4, 0)
    model = Logits(lora(llama(layers=1)))
    peft_names = {n + ".base_layer" if n.endswith("_proj") else n: hf[k] for n, _ in model.named_modules()
                  for k in hf if n.endswith(k.removeprefix("layers.*"))}
    assert len(peft_names) == len(hf), peft_names
    for plan in (hf, peft_names):
        layers = dynashard.explain(model, ids, world_size=2, options={**OPTIONS, "plan": plan}).layers
        styles = {fqn.split("layers.0.")[-1]: style for fqn, style in layers.items() if "layers.0." in fqn}
        for key, style in hf.items():
            name = key.removeprefix("layers.*.")
            a, b = ("replicate", "colwise") if style == "colwise" else ("rowwise", "replicate")
            assert (styles[f"{name}.base_layer"], styles[f"{name}.lora_A.default"], styles[f"{name}.lora_B.default"]
                    ) == (style, a, b), (plan, styles)
    typo = {"layers.*.self_attn.qq_proj": "colwise"}
    with pytest.raises(ValueError, match="plan key 'layers.*.self_attn.qq_proj' matches no linear"):
        dynashard.explain(model, ids, world_size=2, options={**OPTIONS, "plan": typo})


def two_adapters(layers: int = 1):
    """A PEFT Llama with adapter "default" on every projection and "other" (another rank and scale) on
    three, "default" active; both B's random."""
    import peft

    lm = lora(llama(layers=layers))
    lm.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "up_proj", "down_proj"]))
    randomise_b(lm, 2)
    return lm


@pytest.mark.unit
def test_two_active_adapters_cost_no_collective():
    """Two adapters active at once (PEFT's ``base_model.set_adapter([...])``: their adds chained on each
    layer): each cut by its base, still 5 all_reduces for 2 layers and no gather."""
    from tests.test_graphs import rewritten

    lm = two_adapters(layers=2)
    lm.base_model.set_adapter(["default", "other"])
    adapted = rewritten(Logits(lm), torch.randint(0, 96, (2, 7)))
    assert (_count(adapted, "all_reduce"), _count(adapted, "all_gather")) == (5, 0)


def _grads(model, twin) -> tuple[float, list[str]]:
    """Worst relative error of the LoRA parameters' raw gradients against the twin's (whole:
    dynashard.full_tensor of a sharded one), and the trainable parameters without a gradient."""
    reference = dict(twin.named_parameters())
    worst, missing = 0.0, []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            missing.append(name)
            continue
        got, want = dynashard.full_tensor(p.grad), reference[name].grad
        assert got.shape == want.shape, (name, got.shape, want.shape)
        worst = max(worst, float((got - want).abs().max()) / (float(want.abs().max()) or 1.0))
    return worst, missing


def _train(model, twin, batches, seeds=None, options=OPTIONS) -> tuple[float, float, list[str]]:
    """SGD steps on both; the worst forward difference, the worst gradient error, missing grads."""
    fast = torch.compile(model, backend=dynashard.backend(**options))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    opt_twin = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.1)
    out_err, grad_err, missing = 0.0, 0.0, []
    for step, (ids, target) in enumerate(batches):
        if seeds is not None:
            torch.manual_seed(seeds[step])
        out = fast(ids)
        if seeds is not None:
            torch.manual_seed(seeds[step])
        want = twin(ids)
        out_err = max(out_err, float((out - want).abs().max()))
        F.cross_entropy(out.flatten(0, 1), target.flatten()).backward()
        F.cross_entropy(want.flatten(0, 1), target.flatten()).backward()
        err, step_missing = _grads(model, twin)
        grad_err, missing = max(grad_err, err), missing + step_missing
        opt.step()
        opt_twin.step()
        opt.zero_grad()
        opt_twin.zero_grad()
    return out_err, grad_err, missing


def _trains_as_twin(model, twin, options=OPTIONS) -> None:
    """3 SGD steps of ``model`` (parallelized) and ``twin``: logits within 1e-5, raw gradients within RTOL, every
    trainable parameter given one."""
    out_err, grad_err, missing = _train(model, twin, _batches(), options=options)
    assert not missing, missing
    assert out_err < 1e-5 and grad_err < RTOL, (out_err, grad_err)


def _merge_refused(model, reason: str) -> None:
    """PEFT's merge_adapter of the parallelized ``model.lm`` raises naming ``reason`` (a regex), logits unchanged."""
    ids = _batches(1)[0][0]
    with torch.no_grad():
        before = model(ids)
        with pytest.raises(ValueError, match=reason):
            model.lm.merge_adapter()
        assert torch.equal(model(ids), before)


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 96, (2, 7), generator=g), torch.randint(0, 96, (2, 7), generator=g)) for _ in range(n)]


@on_ranks
def test_lora_training_matches_the_twin(rank, world):
    """3 SGD steps on the adapters of a 2-layer HF Llama (base frozen): logits within 1e-5 and the
    adapters' raw gradients within RTOL of the unsharded twin's every step, each rank's cut of the
    rowwise layers' A and the colwise layers' B gathered whole; then PEFT's ``generate``, the twin's tokens."""
    model = Logits(lora(llama()))
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, _batches(1)[0][0], options=OPTIONS)
    _trains_as_twin(model, twin)
    # PEFT's generate calls its base HF model, not the parallelized forward above it: that call runs sharded too
    # (before: the facade's "a submodule cannot run on its own"). Greedy tokens: the trained twin's.
    ids = _batches(1)[0][0]
    with torch.no_grad():
        kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 4, "do_sample": False}
        assert torch.equal(model.lm.generate(input_ids=ids, **kwargs), twin.lm.generate(input_ids=ids, **kwargs))


@on_ranks
def test_lora_on_an_int8_base_trains_as_the_twin(rank, world):
    """QLoRA's layout (PEFT's LoRA on torchao per-row int8 base layers): 3 SGD steps on the adapters, the
    twin's logits and raw adapter gradients, the adapters cut by their bases (held: half of q's B rows, half
    of o's A columns). Merging them after parallelize is refused, naming the quantized base."""
    from dynashard.weights.store import STORE

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated")  # (merge needs HF's TorchAoConfig)
        model = Logits(lora(int8(llama())))
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, _batches(1)[0][0], options=OPTIONS)
    attn = model.lm.base_model.model.model.layers[0].self_attn
    adapters = (attn.q_proj.lora_B.default.weight, attn.o_proj.lora_A.default.weight)
    held = tuple(STORE.shard_of(w).shape for w in adapters)
    assert held == ((32, 4), (4, 32)), held
    _trains_as_twin(model, twin)
    # A merge after parallelize would quantize again from each rank's part of a weight: refused, nothing changed
    # (before: refused for "B cut, base whole", the base's cut inner tensors unseen).
    _merge_refused(model, "base's weight is quantized \\(Int8Tensor\\)")


@on_ranks
def test_lora_on_biased_rowwise_bases_trains_as_the_twin(rank, world):
    """GPT-2 with LoRA and its biases trained (PEFT ``bias="all"``): the rowwise bases' biases are added by rank 0
    alone inside the partial sums, each read through Megatron's f, so every rank's gradient of a bias is the
    whole one. 3 SGD steps: the twin's logits and raw gradients (adapters and biases)."""
    model = Logits(gpt2_lora(bias="all"))
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, _batches(1)[0][0], options=OPTIONS)
    _trains_as_twin(model, twin)


@on_ranks
def test_lora_on_the_embedding_trains_as_the_twin(rank, world):
    """LoRA on the embedding and every projection of HF Llama: 3 SGD steps, the twin's logits and raw adapter
    gradients (the embedding's A and B whole on every rank, their gradients computed whole). Merging them after
    parallelize is refused before anything changes (the merge is the whole [vocab, hidden] product, which the cut
    embedding holds part of; before: PEFT's own "size of tensor a (48) must match ... (96)")."""
    model = Logits(embedding_lora(llama()))
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, _batches(1)[0][0], options=OPTIONS)
    _trains_as_twin(model, twin)
    _merge_refused(model, "an embedding's adapter.*merge_adapter\\(\\) or merge_and_unload\\(\\) before "
                          "dynashard.parallelize")


@on_ranks(cases=["float", "int8", "rank0"])
def test_a_peft_model_built_on_meta_loads_its_base_from_the_base_checkpoint(rank, world, tmp_path, case):
    """QLoRA's recipe for a model larger than one rank: the base built on meta, PEFT's LoRA attached, then
    parallelize(checkpoint=the base model's save_pretrained directory). The base's parameters are read under their
    base names (``base_model.model.`` and ``.base_layer`` off), each rank its slices; the adapters, which the
    checkpoint does not hold, are initialised by PEFT's own init from rank 0's seed, alike on every rank though the
    ranks' generators differ here. An SGD step's loss and raw adapter gradients equal the unsharded twin's (the base
    read whole, the same adapters). ``int8``: the base checkpoint HF's TorchAoConfig wrote (per-row int8, lm_head
    float), the meta model quantized alike: QLoRA's layout. ``rank0``: ``weights="rank0"``, rank 0 alone reading
    the checkpoint and making the adapters, every rank dealt its pieces. Before: refused, every parameter "not in
    the checkpoint"."""
    import peft
    import transformers as T
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from tests.scenarios import from_rank0

    path = str(tmp_path / "base")
    if rank == 0:
        llama().save_pretrained(path)
        if case == "int8":
            T.LlamaForCausalLM.from_pretrained(path, quantization_config=T.TorchAoConfig(Int8WeightOnlyConfig())
                                               ).save_pretrained(path + "_int8")
    torch.distributed.barrier()
    path = path + "_int8" if case == "int8" else path
    ids = _batches(1)[0][0]
    torch.manual_seed(100 + rank)  # (each rank's own generator: the adapters must still be alike)
    with dynashard.empty_weights():
        base = T.LlamaForCausalLM(T.AutoConfig.from_pretrained(path))
    if case == "int8":  # (as HF's TorchAoConfig quantized it: every linear but lm_head)
        quantize_(base, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated")  # (no merge here)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    options = {**OPTIONS, "weights": "rank0"} if case == "rank0" else OPTIONS
    dynashard.parallelize(model, input_ids=ids, labels=ids, use_cache=False, options=options,
                          checkpoint=path if case != "rank0" or rank == 0 else None)
    adapters = {n: dynashard.full_tensor(p).detach() for n, p in model.named_parameters() if "lora_" in n}
    a = adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    assert float(a.abs().sum()) > 0 and torch.equal(from_rank0(a), a)  # (PEFT's kaiming init, rank 0's draw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated")
        twin = peft.get_peft_model(T.LlamaForCausalLM.from_pretrained(path), peft.LoraConfig(r=4, lora_alpha=8,
                                                                                             target_modules=TARGETS))
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if "lora_" in n:
                p.copy_(adapters[n])
    fast = torch.compile(model, backend=dynashard.backend(**options))
    loss, want = fast(input_ids=ids, labels=ids, use_cache=False).loss, twin(input_ids=ids, labels=ids,
                                                                              use_cache=False).loss
    loss.backward()
    want.backward()
    err, missing = _grads(model, twin)
    assert not missing and abs(float(loss) - float(want)) < 1e-5 and err < RTOL, (float(loss), float(want), err)
    if case == "float":  # DoRA's magnitude starts as the base rows' norms, which a meta model does not have yet
        with dynashard.empty_weights():
            base = T.LlamaForCausalLM(T.AutoConfig.from_pretrained(path))
        dora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True))
        with pytest.raises(ValueError, match="a DoRA adapter on the meta device"):
            dynashard.parallelize(dora, input_ids=ids, use_cache=False, checkpoint=path, options=OPTIONS)


@on_ranks
def test_lora_under_the_models_own_tp_plan_trains_as_the_twin(rank, world):
    """The HF model's own base_model_tp_plan on the PEFT model: the base layers and the adapters are held
    cut as the plan and their bases say (each rank half of q's and B's rows, half of o's and A's columns),
    and 3 SGD steps give the twin's logits and raw adapter gradients, as under plan="auto"."""
    import transformers as T

    from dynashard.weights.store import STORE

    options = {**OPTIONS, "plan": dict(T.LlamaConfig.base_model_tp_plan)}
    model = Logits(lora(llama()))
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, _batches(1)[0][0], options=options)
    attn = model.lm.base_model.model.model.layers[0].self_attn
    held = tuple(STORE.shard_of(w).shape for w in (attn.q_proj.base_layer.weight, attn.q_proj.lora_B.default.weight,
                                                    attn.o_proj.base_layer.weight, attn.o_proj.lora_A.default.weight))
    assert held == ((32, 64), (32, 4), (64, 32), (4, 32)), held
    _trains_as_twin(model, twin, options=options)


@on_ranks
def test_several_adapters_switch_train_and_merge_as_the_twin(rank, world):
    """Three adapters on one model ("default", "other", and "mix", PEFT's weighted combination of the two),
    parallelized with "default" active: every adapter is planned and cut by its base, so switching
    (set_adapter, base_model.set_adapter([...]) for two at once) gives the twin's logits, and "other", made
    active after parallelize, trains as the twin's (raw gradients, SGD). Merged after that (merge_adapter,
    unmerge_adapter, merge_and_unload: PEFT's merge of the shards), the twin's logits; an adapter a plan cut
    otherwise than its base is refused, naming the fix, unmerged. Merged before parallelize, the adapters are
    plain linears: cut, the twin's logits."""
    import transformers as T

    from dynashard.weights.store import STORE
    from tests.scenarios import raised

    ids = _batches(1)[0][0]
    lm = two_adapters()
    lm.base_model.add_weighted_adapter(["default", "other"], [0.7, 0.3], "mix", combination_type="cat")
    lm.set_adapter("default")
    model = Logits(lm)
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, ids, options=OPTIONS)
    layer = model.lm.base_model.model.model.layers[0]
    held = [STORE.shard_of(w) for w in (layer.self_attn.q_proj.lora_B.other.weight,
                                        layer.mlp.down_proj.lora_A.other.weight, layer.mlp.down_proj.lora_A.mix.weight)]
    # (inactive when parallelize ran, cut by their bases all the same: q colwise, down rowwise over 128 features)
    assert [None if h is None else tuple(h.shape) for h in held] == [(32, 2), (2, 64), (6, 64)], held
    errs = {}
    with torch.no_grad():
        # (each active set, and each merge state below, is a compile of its own: Dynamo's recompile_limit, 8 a frame,
        # bounds them; past it the frame runs eagerly, where a parallelized model cannot run)
        for active in ("other", ["default", "other"], "mix"):
            for m in (model, twin):
                m.lm.base_model.set_adapter(active)
            errs[str(active)] = float((model(ids) - twin(ids)).abs().max())
    assert max(errs.values()) < 1e-5, errs
    for m in (model, twin):
        m.lm.set_adapter("other")
    out_err, grad_err, missing = _train(model, twin, _batches(2))
    assert not missing and out_err < 1e-5 and grad_err < RTOL, (out_err, grad_err, missing)
    errs = {}
    with torch.no_grad():  # (merged into the shards: each rank's part of the unsharded merge)
        for what in ("merge_adapter", "unmerge_adapter", "merge_and_unload"):
            done = [getattr(m.lm, what)() for m in (model, twin)]
            if what == "merge_and_unload":
                model.lm, twin.lm = done
            errs[what] = float((model(ids) - twin(ids)).abs().max())
    assert max(errs.values()) < 1e-5, errs

    # an adapter a plan cuts otherwise than its base (A colwise on its r features): no merge of the shards
    plan = {**T.LlamaConfig.base_model_tp_plan, "layers.*.self_attn.q_proj.lora_A.*": "colwise"}
    odd = Logits(lora(llama(layers=1)))
    dynashard.parallelize(odd, ids, options={**OPTIONS, "plan": plan})
    refused = raised(odd.lm.merge_adapter)
    assert "is not cut by its base layer's style" in str(refused) and "before dynashard.parallelize" in str(refused)
    assert not odd.lm.base_model.model.model.layers[0].self_attn.q_proj.merged

    merged, unloaded = two_adapters(), two_adapters()
    merged.merge_adapter()
    merged, unloaded = Logits(merged), Logits(unloaded.merge_and_unload())
    for plain, weight in ((merged, lambda m: m.lm.base_model.model.model.layers[0].self_attn.q_proj.base_layer),
                          (unloaded, lambda m: m.lm.model.layers[0].self_attn.q_proj)):
        plain_twin = copy.deepcopy(plain)
        dynashard.parallelize(plain, ids, options=OPTIONS)
        assert STORE.shard_of(weight(plain).weight).shape == (32, 64)
        with torch.no_grad():
            assert float((plain(ids) - plain_twin(ids)).abs().max()) < 1e-5


class Chain(nn.Module):
    """Two MLPs back to back, no residual: the first's output (its down projection's partial sums
    with its LoRA's) is read by the second's colwise up projection directly, all-reduced first."""

    def __init__(self, hidden: int = 32, ffn: int = 64) -> None:
        super().__init__()
        self.up1, self.down1 = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)
        self.up2, self.down2 = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down2(F.gelu(self.up2(self.down1(F.gelu(self.up1(x))))))


@on_ranks
def test_partial_sums_all_reduced_into_a_sharded_layer_train_as_the_twin(rank, world):
    """down1's partial sums (with its LoRA's) are all-reduced where up2, colwise, reads them: with
    gradients that read goes through f (identity forward, all_reduce backward), or the gradient
    reaching down1 and its adapter would be each rank's part of it only."""
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(Chain(), peft.LoraConfig(r=4, target_modules=["down1"]))
    randomise_b(model, 1)
    for p in model.parameters():  # the base layers train too: up1 and down1 sit before the read
        p.requires_grad_(True)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 32)
    plan = str(dynashard.explain(copy.deepcopy(model), x, options=OPTIONS))
    assert plan.count("all_reduce") >= 1 and "all_gather" not in plan, plan
    dynashard.parallelize(model, x, options=OPTIONS)
    fast = torch.compile(model, backend=dynashard.backend(**OPTIONS))
    fast(x).pow(2).mean().backward()
    twin(x).pow(2).mean().backward()
    err, missing = _grads(model, twin)
    assert not missing and err < RTOL, (err, missing)


@on_ranks
def test_lora_dropout_in_train_mode_matches_the_twin_from_the_same_seed(rank, world):
    """lora_dropout=0.1 in train mode: every rank draws each dropout's whole mask (the rowwise layers'
    dropout reads a cut input: each keeps its part, rules/pointwise.dropout), as the unsharded model
    draws it from the same seed, so the masks, logits and gradients are the twin's."""
    model = Logits(lora(llama(layers=1), dropout=0.1)).train()
    twin = copy.deepcopy(model)
    ids = _batches(1)[0][0]
    plan = str(dynashard.explain(copy.deepcopy(model), ids, options=OPTIONS))
    assert "all_gather" not in plan, plan
    dynashard.parallelize(model, ids, options=OPTIONS)
    out_err, grad_err, missing = _train(model, twin, _batches(2), seeds=[11, 12])
    assert not missing, missing
    assert out_err < 1e-5 and grad_err < RTOL, (out_err, grad_err)


@on_ranks
def test_adapters_save_whole_and_load_in_every_order(rank, world, tmp_path):
    """After a step of training at world 2, PEFT's save_pretrained (every rank calls it, rank 0 writes)
    writes the whole adapters, the twin's; they load into a fresh base before parallelize
    (PeftModel.from_pretrained), into a parallelized model's adapter (set_peft_model_state_dict: whole
    values cut on load) and as a second adapter after parallelize (load_adapter; inference), each giving
    the trained twin's logits. Adapters attached after parallelize run sharded but are refused by the
    optimizer (they were cut by the compile, not registered); the base's save_pretrained is refused."""
    import peft
    from safetensors.torch import load_file

    from tests.scenarios import from_rank0, raised

    ids = _batches(1)[0][0]
    model = Logits(lora(llama(layers=1)))
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, ids, options=OPTIONS)
    _train(model, twin, _batches(1))
    path = str(tmp_path / "adapter")
    model.lm.save_pretrained(path)
    torch.distributed.barrier()
    saved = load_file(f"{path}/adapter_model.safetensors")
    want = peft.utils.get_peft_model_state_dict(twin.lm)
    # (float32: one SGD step from equal values, the gradients summed in another order)
    err = from_rank0(max(float((saved[k] - want[k]).abs().max()) if saved[k].shape == want[k].shape else float("inf")
                         for k in want) if sorted(saved) == sorted(want) else float("inf"))
    assert err < 1e-6, err
    base_save = raised(lambda: model.lm.base_model.model.save_pretrained(str(tmp_path / f"base{rank}")))
    assert "export_safetensors" in str(base_save), base_save
    with torch.no_grad():
        reference = twin(ids)

        loaded_first = Logits(peft.PeftModel.from_pretrained(llama(layers=1), path))
        dynashard.parallelize(loaded_first, ids, options=OPTIONS)
        first_err = float((loaded_first(ids) - reference).abs().max())

        into = Logits(lora(llama(layers=1), seed=5))
        dynashard.parallelize(into, ids, options=OPTIONS)
        peft.set_peft_model_state_dict(into.lm, load_file(f"{path}/adapter_model.safetensors"))
        into_err = float((into(ids) - reference).abs().max())
        into.lm.load_adapter(path, adapter_name="second")
        into.lm.set_adapter("second")
        second_err = float((into(ids) - reference).abs().max())

        after = Logits(llama(layers=1))
        after_twin = copy.deepcopy(after)
        dynashard.parallelize(after, ids, options=OPTIONS)
        torch.manual_seed(3)
        after.lm = lora(after.lm)
        torch.manual_seed(3)
        after_twin.lm = lora(after_twin.lm)
        after_err = float((after(ids) - after_twin(ids)).abs().max())
    assert max(first_err, into_err, second_err, after_err) < 1e-5, (first_err, into_err, second_err, after_err)
    opt = torch.optim.SGD([p for p in after.parameters() if p.requires_grad], lr=0.1)
    torch.compile(after, backend=dynashard.backend(**OPTIONS))(ids).sum().backward()
    refused = raised(opt.step)
    assert "attach adapters before parallelize" in str(refused), refused
