"""Mixed precision: ``torch.autocast`` around a compiled model (a linear in other clothes: a cast weight).

Under autocast the weight reaches the matmul through a dtype conversion (``t(_to_copy(W, bf16))``); the
matcher sees through it, so the plan is the one without autocast. Unit: the 19 Hugging Face architectures
of ``test_hf_models.py`` under bfloat16 autocast plan exactly as without it and verify. Gloo, 2 ranks: an
HF Llama compiled under autocast holds about half its bytes and returns the unsharded model's logits; a
model parallelized in float32 then trained under autocast gets the unsharded twin's raw gradients, step
after step (a matcher blind to the conversion would match no linear under autocast and refuse the shards
parallelize cut); nanoGPT, whose colwise biases are held cut, too, parallelized in float32 or under autocast
(the autocast graph reads a held bias through ``_to_copy``, which must not refuse it).
"""

from __future__ import annotations

import copy

import pytest
import torch

import dynashard
from dynashard.weights.store import STORE, cut
from tests.hf_configs import CONFIGS, EXPECTED
from tests.scenarios import Scenarios

# bfloat16 keeps 8 bits of mantissa (unit roundoff 2^-8 = 3.9e-3); the sharded matmuls round each rank's
# partial sum to bf16 before adding, the unsharded one rounds once. Logits: measured 7.4e-3 relative to the
# largest; 3e-2 leaves room. Gradients go through more bf16 matmuls: they are held to 3x the noise floor
# measured in the run itself (how far bf16 moves the twin's own gradients from float32 at the same weights:
# 1.2e-2 measured, the sharded ones 1.4e-2 from the twin's). A wrong gradient (a term missing or doubled)
# is an O(1) relative error.
BF16_RTOL = 3e-2
NOISE_FACTOR = 3
DEADLINE_S = 240  # two tiny models compiled eagerly per rank, 5-20 s on the quiet 2-core machine; 3x, 2x margin
# One spawn runs both @on_ranks scenarios (the inference and the training one), each asserting on its ranks
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=DEADLINE_S)
OPTIONS = {"min_shard_numel": 0, "compiler": "eager"}


# One of each weight form in the default run (GQA; Conv1D's [in, out] weight and a tied head; fused qkv and
# gate_up; experts; Falcon's grouped qkv); the other 16 in the slow tier (all passed when
# this was written; DiffLlama when it was added).
DEFAULT_ARCHS = {"llama", "gpt2", "phi3", "mixtral", "falcon"}


@pytest.mark.unit
@pytest.mark.parametrize("arch", [a if a in DEFAULT_ARCHS else pytest.param(a, marks=pytest.mark.slow)
                                  for a in sorted(CONFIGS)])
def test_hf_architectures_plan_alike_under_autocast_and_verify(arch):
    import transformers as T

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    ids = torch.randint(3, 96, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = dynashard.explain(model, ids, world_size=2, verify=True, options={"min_shard_numel": 0},
                                   use_cache=False)  # raises if any rank's program differs (bf16 tolerance)
    whole = {r.fqn.rsplit(".", 1)[-1] for r in report.rows if r.style == "replicate"}
    gathers = {r.fqn.rsplit(".", 1)[-1]: r.collectives for r in report.rows
               if r.collectives not in ("-", "all_reduce")}
    assert (whole, gathers) == EXPECTED[arch][2], str(report)


def _llama():
    import transformers as T

    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=4, vocab_size=96))


def _ids() -> torch.Tensor:
    return torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@pytest.mark.gloo
@on_ranks
def test_a_model_compiled_under_autocast_is_sharded_and_returns_the_unsharded_logits(rank, world):
    """An HF Llama compiled under bfloat16 autocast: bf16 logits within BF16_RTOL of the unsharded model's,
    about half the bytes held."""
    model = _llama().eval()
    reference = copy.deepcopy(model)
    whole = dynashard.held_bytes(model)
    fast = torch.compile(model, backend="dynashard", options=OPTIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, expected = fast(_ids()).logits, reference(_ids()).logits
    assert logits.dtype == torch.bfloat16, f"the compiled model's logits under autocast are {logits.dtype}"
    err = _rel(logits, expected)
    assert err < BF16_RTOL, f"logits vs the unsharded model's under autocast: {err} relative to the largest"
    # every linear but the small LM head cut in two (the embedding too): about half the bytes
    held = dynashard.held_bytes(model) / whole
    assert held < 0.6, f"this rank holds {held} of the unsharded model's bytes"


@pytest.mark.gloo
@on_ranks
def test_a_model_parallelized_in_float32_trains_under_autocast_as_the_unsharded_one(rank, world):
    """Parallelized in float32, 3 SGD steps under bfloat16 autocast: every sharded parameter's raw gradient is
    the same cut of the twin's, within NOISE_FACTOR times how far bf16 moves the twin's own gradients."""
    model = _llama()
    twin = copy.deepcopy(model)
    dynashard.parallelize(model, _ids(), options=OPTIONS)
    facades = _train_alike_under_autocast(model, twin, steps=3, logits=lambda out: out.logits)
    assert len(facades) >= 14, f"{len(facades)} parameters sharded: {sorted(facades)}"


@pytest.mark.gloo
@on_ranks(cases=["float32", "bfloat16"])
def test_colwise_biases_held_cut_train_under_autocast_whichever_precision_parallelize_ran_in(rank, world, case):
    """nanoGPT (biased c_attn and c_fc, colwise, their biases held cut): parallelized in float32 or under
    bfloat16 autocast, then 2 SGD steps under autocast, raw gradients as the twin's (as above). After a float32
    parallelize the autocast compile reads the held bias through ``_to_copy``; guards against refusing it there
    ("c_attn.bias is read by aten._to_copy")."""
    from tests.models import NanoGPT

    model = NanoGPT()
    twin = copy.deepcopy(model)
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bfloat16"):
        dynashard.parallelize(model, ids, options=OPTIONS)
    facades = _train_alike_under_autocast(model, twin, steps=2, logits=lambda out: out)
    held = {"h.0.attn.c_attn.bias", "h.1.attn.c_attn.bias", "h.0.c_fc.bias", "h.1.c_fc.bias"}
    assert held <= set(facades), f"colwise biases held whole: {sorted(held - set(facades))}"


def _train_alike_under_autocast(model, twin, steps, logits) -> dict:
    """``steps`` SGD steps of the parallelized ``model`` (compiled) and its unsharded ``twin`` under bfloat16
    autocast; asserts every raw gradient is the twin's cut within NOISE_FACTOR x the bf16 noise floor measured
    on the twin. Returns the sharded parameters' facades, by name."""
    facades = {n: STORE.facade_of(p) for n, p in model.named_parameters() if STORE.facade_of(p) is not None}
    fast = torch.compile(model, backend="dynashard", options=OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
    worst, noise, missing = 0.0, 0.0, []
    for step in range(steps):
        batch = torch.randint(3, 96, (2, 5 + step), generator=torch.Generator().manual_seed(10 + step))
        # how far bf16 itself moves the twin's gradients from float32 at these weights: the noise floor
        loss32 = torch.nn.functional.cross_entropy(logits(twin(batch)).flatten(0, 1), batch.flatten())
        grads32 = dict(zip([n for n, _ in twin.named_parameters()], torch.autograd.grad(loss32, twin.parameters())))
        for net in (fast, twin):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = logits(net(batch))
            torch.nn.functional.cross_entropy(out.float().flatten(0, 1), batch.flatten()).backward()
        reference = dict(twin.named_parameters())
        noise = max([noise] + [_rel(reference[n].grad, g) for n, g in grads32.items()])
        for name, p in model.named_parameters():
            g = reference[name].grad
            if p.grad is None or g is None:
                missing.append(name)
                continue
            if name in facades:
                spec = STORE.spec_of(facades[name])
                g = cut(g, spec.dim, spec.split, spec.world, spec.rank)
            worst = max(worst, _rel(p.grad, g))
        opt.step()
        opt_twin.step()
        opt.zero_grad()
        opt_twin.zero_grad()
    assert not missing, f"parameters without a gradient here or on the twin: {missing}"
    assert noise < 0.1, f"bf16 moves the twin's own gradients {noise} (relative) from float32"
    assert worst <= NOISE_FACTOR * noise, (
        f"raw gradients vs the twin's cut: {worst} relative, over {NOISE_FACTOR}x the bf16 noise floor {noise}")
    return facades
