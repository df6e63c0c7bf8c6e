"""torchao's quantized weights (tensor-subclass parameters) cut like the float layers they replace.

``quantize_(model, Int8WeightOnlyConfig())`` makes each linear's weight an ``Int8Tensor`` (qdata int8
[out, in], scale [out, 1], zero_point [out, 1]). Dynamo hands the backend that subclass as one input;
dynashard flattens it into its inner tensors (subclass_inputs.py), so the aten graph reads
``mm(x, t(qdata).to(f32)) * scale``: qdata is cut as the float weight (rows colwise, columns rowwise),
the per-row scale narrowed with the rows it belongs to. Left as one input, the subclass crashes
capture: "'Int8Tensor' object has no attribute 'fake_mode'".

Simulated at 2 and 4 ranks (explain verify), and on 2 real gloo ranks against the quantized unsharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import transformers as T
from torchao.quantization import Int8WeightOnlyConfig, quantize_

import dynashard
from tests.scenarios import Scenarios

SCENARIOS_DEADLINE_S = 180  # one spawn at world 2: ~15 s quiet; 3x slower machine, 2x margin, plus startup
pytestmark = pytest.mark.timeout(SCENARIOS_DEADLINE_S + 60)
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)

OPTIONS = {"min_shard_numel": 0}  # (tiny layers: cut them all)


def _llama() -> nn.Module:
    """A tiny HF Llama with 8 heads and 4 KV heads (world 4: one KV head a rank), int8 weight-only."""
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                           vocab_size=96, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = T.LlamaForCausalLM(config).eval()
    quantize_(model, Int8WeightOnlyConfig())
    return model


class MLP(nn.Module):
    def __init__(self, hidden: int = 64, ffn: int = 256) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = MLP()
    quantize_(model, Int8WeightOnlyConfig())
    return model


LLAMA_PLAN = {
    **{f"model.layers.{i}.self_attn.{p}_proj": "colwise" for i in range(2) for p in "qkv"},
    **{f"model.layers.{i}.self_attn.o_proj": "rowwise" for i in range(2)},
    **{f"model.layers.{i}.mlp.{p}_proj": "colwise" for i in range(2) for p in ("gate", "up")},
    **{f"model.layers.{i}.mlp.down_proj": "rowwise" for i in range(2)},
    "model.embed_tokens": "rowwise", "lm_head": "replicate",  # (lm_head: no partner, in_features 64: whole)
}


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 4])
def test_int8_weight_only_llama_is_cut_as_its_float_twin(world):
    model = _llama()
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    # verify=True raises if any simulated rank's logits differ from the quantized model's beyond float32's
    # tolerance (the same int8 values and scales, partial sums added in another order)
    report = dynashard.explain(model, ids, world_size=world, verify=True, options=OPTIONS, use_cache=False)
    assert report.layers == LLAMA_PLAN, str(report)
    float_twin = dynashard.explain(T.LlamaForCausalLM(model.config).eval(), ids, world_size=world, options=OPTIONS,
                                   use_cache=False)
    assert report.layers == float_twin.layers
    assert not report.outside, report.outside  # every quantized weight is read by the graph (none left out)


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 4])
def test_int8_weight_only_mlp_is_cut_in_pairs(world):
    report = dynashard.explain(_mlp(), torch.randn(2, 5, 64), world_size=world, verify=True, options=OPTIONS)
    assert report.layers == {"up": "colwise", "down": "rowwise"}, str(report)
    # each rank holds its 1/world of the int8 data: 256 x 64 int8 bytes (a float32 weight: 4x that)
    assert {r.fqn: r.weight_bytes for r in report.rows} == {"up": 256 * 64 // world, "down": 64 * 256 // world}


@on_ranks
@torch.no_grad()
def test_int8_llama_on_real_ranks_equals_the_quantized_model(rank, world):
    model = _llama()
    reference = copy.deepcopy(model)
    fast = torch.compile(model, backend="dynashard", options={**OPTIONS, "compiler": "eager"})
    for length in (7, 5):  # (the second length recompiles: Dynamo re-traces the cut, freed inner tensors)
        ids = torch.randint(3, 96, (2, length), generator=torch.Generator().manual_seed(length))
        got, want = fast(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
        # float32 O(1) logits from the same int8 weights and scales, partial sums added in another order: ulps
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), length
    held, whole = dynashard.held_bytes(model), dynashard.held_bytes(reference)
    # Cut: the int8 q/k/v/o/gate/up/down weights (half each); whole: embedding half (vocab-parallel), lm_head,
    # norms, the float scales and zero points (5 bytes per output row against 64-128 int8 bytes)
    assert held <= 0.62 * whole, (held, whole)


@pytest.mark.unit
@pytest.mark.parametrize("config", ["int8 per group", "int4 per group"])
def test_group_wise_quantized_linears_are_kept_whole_with_the_reason(config):
    """torchao's group-wise forms that run on this CPU (int8 PerGroup(32), and int4 weight-only as
    IntxWeightOnlyConfig stores it: int4 values in int8, scales per 32 columns; Int4WeightOnlyConfig needs
    mslk or CUDA here) dequantize through views of the whole weight's shape: held whole, said in explain, the
    logits the quantized model's; each is matched, so explain shows a row for it."""
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    torch.manual_seed(0)
    model = MLP()
    quantize_(model, Int8WeightOnlyConfig(granularity=PerGroup(32)) if config.startswith("int8")
              else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    report = dynashard.explain(model, torch.randn(2, 5, 64), world_size=2, verify=True, options=OPTIONS)
    assert report.layers == {"up": "replicate", "down": "replicate"}, str(report)
    assert all("quantized by groups of 32 input columns" in r.reason for r in report.rows), str(report)
    with pytest.raises(ValueError, match="quantized by groups of 32"):  # a plan asking for a cut is refused
        dynashard.explain(model, torch.randn(2, 5, 64), world_size=2, options={**OPTIONS, "plan": {"up": "colwise"}})


@pytest.mark.unit
def test_int8_mlp_compiles_under_inductor():
    """The flattened inner tensors reach Inductor (the default compiler: AOTAutograd, then C++) each with a source
    of its own (``<weight>.qdata``): the parent's for all three raised "already in seen_sources". One process,
    a fake group of 2 (no data moves: the program's collectives are not run, its shards are checked)."""
    from dynashard import _torch as private

    private.init_fake_process_group(2)
    try:
        model = _mlp()
        whole = dynashard.held_bytes(model)
        x = torch.randn(2, 5, 64)
        dynashard.parallelize(model, x, options=OPTIONS)  # (Inductor, the default)
        assert model(x).shape == (2, 5, 64)  # (its first call compiles the cut program: where it raised)
        # the int8 data halved (2 x 8 KiB of 2 x 16 KiB); scales, zero points and biases whole (2.9 KiB)
        assert dynashard.held_bytes(model) == whole - 2 * 8192, (dynashard.held_bytes(model), whole)
    finally:
        torch.distributed.destroy_process_group()


@on_ranks
@torch.no_grad()
def test_int8_mlp_parallelized_under_inductor_equals_the_quantized_model(rank, world):
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3))
    dynashard.parallelize(model, x, options=OPTIONS)  # (Inductor underneath, the default compiler)
    want = reference(x)
    # float32 sums of 256 products in another order, and Inductor's fused kernels: relative 1e-5 of the output
    assert float((model(x) - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert dynashard.held_bytes(model) == dynashard.held_bytes(reference) - 2 * 8192  # the int8 data halved
