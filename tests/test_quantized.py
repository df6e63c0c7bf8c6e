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
from typing import Any

import pytest
import torch
import torch.nn as nn
import transformers as T
from torchao.quantization import (
    Float8WeightOnlyConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    PerAxis,
    PerGroup,
    PerTensor,
    quantize_,
)

import dynashard
from tests.scenarios import Scenarios

# one spawn at world 2: ~15 s quiet before the DCP round trips (~5 s CPU each); 3x slower machine, 2x margin,
# plus startup
SCENARIOS_DEADLINE_S = 240
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


GROUP_CONFIGS = {  # torchao's group-wise forms that run on this CPU (Int4WeightOnlyConfig needs mslk or CUDA)
    "int8 PerGroup(32)": lambda: Int8WeightOnlyConfig(granularity=PerGroup(32)),
    "int4 PerGroup(32)": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
}


def _grouped_mlp(config: str, ffn: int = 256) -> nn.Module:
    torch.manual_seed(0)
    model = MLP(ffn=ffn)
    quantize_(model, GROUP_CONFIGS[config]())
    return model


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("config", list(GROUP_CONFIGS))
def test_group_wise_quantized_mlp_is_cut_on_group_boundaries(config, world):
    """qdata int8 [out, in] (int4 values one a byte), scale and zero point [out, in / 32]: up's rows cut with
    their scales (a group never spans rows); down's 256 columns are 8 groups of 32, dealt 4/4, 3/3/2 (up asked
    for units of 32: 86/85/85 columns would split groups) and 2/2/2/2."""
    report = dynashard.explain(_grouped_mlp(config), torch.randn(2, 5, 64), world_size=world, verify=True,
                               options=OPTIONS)  # (verify: every simulated rank's output against the model's)
    assert report.layers == {"up": "colwise", "down": "rowwise"}, str(report)
    groups = {2: 4, 3: 3, 4: 2}[world]  # rank 0's groups of 32 (of up's rows and of down's columns)
    assert {r.fqn: r.weight_bytes for r in report.rows} == {"up": groups * 32 * 64, "down": 64 * groups * 32}


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", ["int8 PerGroup(16)", "int4 PerGroup(32)"])
def test_group_wise_quantized_llama(config, world):
    """Heads of 8 features: o_proj's input cut in units of lcm(8, g). int8 in groups of 16 is cut as its float
    twin at 2 and 3 ranks. int4 in groups of 32: hidden 64 is 2 groups, so at 3 ranks no cut of o_proj's
    input (or of q/k/v's colwise partner) is in whole groups: attention kept whole with the reason, the MLP
    (128 = 4 groups, dealt 2/1/1) still cut."""
    torch.manual_seed(0)
    config_ = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                            vocab_size=96, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = T.LlamaForCausalLM(config_).eval()
    g = int(config.split("(")[1].rstrip(")"))
    quantize_(model, Int8WeightOnlyConfig(granularity=PerGroup(g)) if config.startswith("int8")
              else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(g)))
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    report = dynashard.explain(model, ids, world_size=world, verify=True, options=OPTIONS, use_cache=False)
    if config.startswith("int8") or world == 2:
        assert report.layers == LLAMA_PLAN, str(report)
        return
    want = {**LLAMA_PLAN, **{k: "replicate" for k in LLAMA_PLAN if ".self_attn." in k}}
    assert report.layers == want, str(report)
    reasons = {r.fqn: r.reason for r in report.rows}
    assert "groups of 32 input columns, and its input cannot be cut in whole groups over 3 ranks" in \
        reasons["model.layers.0.self_attn.o_proj"], str(report)


@pytest.mark.unit
@pytest.mark.parametrize("config", list(GROUP_CONFIGS))
def test_rowwise_group_quantized_never_splits_a_group(config, monkeypatch):
    """Where the input's cut is not in whole groups and its partner is not re-cut (here: the wish suppressed),
    a plan asking rowwise gathers down's input and cuts its own whole groups, 3/3/2 of 8 (the auto plan keeps
    such a layer whole: the Llama test); a plan with a replicated input narrows it to whole groups; fewer
    groups than ranks is refused."""
    x = torch.randn(2, 5, 64)
    plan = {"up": "colwise", "down": "rowwise"}
    with monkeypatch.context() as patched:  # (up not re-cut in groups: 86/85/85 of down's 256 input features)
        patched.setattr("dynashard.plan.rules.quantized._ask_for_groups", lambda *args: None)
        report = dynashard.explain(_grouped_mlp(config), x, world_size=3, verify=True,
                                   options={**OPTIONS, "plan": plan})
    assert report.layers == plan, str(report)
    rows = {r.fqn: r for r in report.rows}
    assert rows["down"].weight_bytes == 64 * 3 * 32, str(report)  # (rank 0: 3 groups)
    assert "all_gather" in rows["up"].collectives, str(report)  # (charged to the origin gathered)
    report = dynashard.explain(_grouped_mlp(config), x, world_size=3, verify=True,
                               options={**OPTIONS, "plan": {"down": "rowwise"}})
    assert {r.fqn: r.weight_bytes for r in report.rows} == {"up": 256 * 64, "down": 64 * 3 * 32}, str(report)
    with pytest.raises(ValueError, match="2 group.s. of 32 input columns .the unit of its quantization. cannot give "
                                         "all 4 ranks some"):
        dynashard.explain(_grouped_mlp(config), x, world_size=4, options={**OPTIONS, "plan": {"up": "rowwise"}})


@pytest.mark.unit
def test_one_group_a_row_is_matched_and_cut_by_rows():
    """IntxWeightOnlyConfig(PerAxis(0)): one scale a row, whose dequantization views are 2-D ([out, in], [out,
    1]). Before: no linear matched at all (no row in explain, a plan naming it refused as matching nothing).
    Rows cut like any group; columns never (one group: a rank would hold all or nothing)."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 5, 64)
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerAxis(0)))
    report = dynashard.explain(model, x, world_size=2, verify=True, options={**OPTIONS, "plan": {"up": "colwise"}})
    assert report.layers == {"up": "colwise", "down": "replicate"}, str(report)
    report = dynashard.explain(model, x, world_size=2, verify=True, options=OPTIONS)
    assert report.layers == {"up": "replicate", "down": "replicate"}, str(report)  # (down: 1 group of 256)
    assert "quantized by groups of 256 input columns, and its input cannot be cut in whole groups" in \
        report.rows[1].reason, str(report)
    with pytest.raises(ValueError, match="1 group.s. of 256 input columns"):
        dynashard.explain(model, x, world_size=2, options={**OPTIONS, "plan": {"down": "rowwise"}})


@pytest.mark.unit
def test_group_quantized_kept_whole_under_per_rank_weights():
    with pytest.raises(ValueError, match="quantized by groups of 32 input columns: kept whole under "
                                         "weights='per_rank'"):
        dynashard.explain(_grouped_mlp("int4 PerGroup(32)"), torch.randn(2, 5, 64), world_size=2,
                          options={**OPTIONS, "plan": {"up": "colwise"}, "weights": "per_rank", "inputs": "per_rank"})


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", list(GROUP_CONFIGS))
def test_group_quantized_held_bytes(config, world):
    """Each rank holds its groups of qdata, scale and zero point (a fake group: the shards are real tensors)."""
    from dynashard import _torch as private

    private.init_fake_process_group(world)
    try:
        model = _grouped_mlp(config)
        whole = dynashard.held_bytes(model)
        x = torch.randn(2, 5, 64)
        dynashard.parallelize(model, x, options={**OPTIONS, "compiler": "eager"})
        assert model(x).shape == (2, 5, 64)
        # per layer 8 groups of 32 x 64 int8 values, f32 scales and int8 zero points; rank 0 holds 4 (3) of 8
        quantized = 2 * 8 * (32 * 64 + 64 * 4 + 64)
        held_groups = {2: 4, 3: 3}[world]
        cut = quantized * (8 - held_groups) // 8
        # (+ up's colwise bias, held cut too when the graph adds it in addmm (int4's), not after a view (int8's))
        assert whole - dynashard.held_bytes(model) in (cut, cut + 256 * 4 * (8 - held_groups) // 8), \
            (whole, dynashard.held_bytes(model), cut)
    finally:
        torch.distributed.destroy_process_group()


@on_ranks
@torch.no_grad()
def test_group_quantized_llama_on_real_ranks_equals_the_quantized_model(rank, world):
    # cut: q/k/v/o/gate/up/down's int4 data (one a byte), scales and zero points, halved; the embedding half;
    # whole: lm_head, norms
    _quantized_llama_equals_the_quantized_model(
        IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)), held_at_most=0.62)


def _quantized_llama_equals_the_quantized_model(config: Any, held_at_most: float) -> None:
    """A 2-layer HF Llama quantized with ``config``, compiled on these ranks: its logits at two lengths equal the
    quantized unsharded model's (the same quantized values and scales dequantized on each rank, partial sums added
    in another order: ulps), and it holds at most ``held_at_most`` of the quantized model's bytes."""
    torch.manual_seed(0)
    llama = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                          vocab_size=96, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = T.LlamaForCausalLM(llama).eval()
    quantize_(model, config)
    reference = copy.deepcopy(model)
    fast = torch.compile(model, backend="dynashard", options={**OPTIONS, "compiler": "eager"})
    for length in (7, 5):
        ids = torch.randint(3, 96, (2, length), generator=torch.Generator().manual_seed(length))
        got, want = fast(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), length
    held, whole = dynashard.held_bytes(model), dynashard.held_bytes(reference)
    assert held <= held_at_most * whole, (held, whole)


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


FLOAT8_CONFIGS = {  # torchao's float8 weight-only (Float8Tensor: float8 qdata [out, in], f32 scale; runs on CPU)
    "per row": lambda: Float8WeightOnlyConfig(),
    "per tensor": lambda: Float8WeightOnlyConfig(granularity=PerTensor()),
}


def _float8_mlp(config: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = MLP().to(dtype)
    quantize_(model, FLOAT8_CONFIGS[config]())
    return model


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(FLOAT8_CONFIGS))
def test_float8_weight_only_mlp_is_cut_as_its_float_twin(config, dtype, world):
    """Float8WeightOnlyConfig dequantizes ``t(qdata).to(f32) * t(scale)`` before the matmul. Before: no linear
    matched (no row in explain, both layers silently whole). Now up's float8 rows are cut with their scales, down's
    columns with every scale whole (a row's scale covers its columns); a [1, 1] scale is whole either way."""
    model = _float8_mlp(config, dtype)
    x = torch.randn(2, 5, 64, dtype=dtype)
    # verify=True raises if a simulated rank's output differs from the float8 model's beyond the dtype's tolerance
    # (the same float8 values and scales dequantized on every rank; down's partial sums added in another order)
    report = dynashard.explain(model, x, world_size=world, verify=True, options=OPTIONS)
    assert report.layers == {"up": "colwise", "down": "rowwise"}, str(report)
    rows = -(-256 // world)  # rank 0's rows of up (and columns of down): 128, 86, 64; one float8 byte each
    assert {r.fqn: r.weight_bytes for r in report.rows} == {"up": rows * 64, "down": 64 * rows}, str(report)
    twin = MLP().to(dtype)
    assert dynashard.explain(twin, x, world_size=world, options=OPTIONS).layers == report.layers


@pytest.mark.unit
def test_float8_per_group_is_kept_whole_with_the_reason():
    """Float8WeightOnlyConfig(PerGroup(32)) expands its [out, in / 32] scales through views of fixed sizes, which
    no cut re-sizes yet: matched, kept whole with the reason (auto), a plan asking a cut refused."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 5, 64)
    quantize_(model, Float8WeightOnlyConfig(granularity=PerGroup(32)))
    report = dynashard.explain(model, x, world_size=2, verify=True, options=OPTIONS)
    assert report.layers == {"up": "replicate", "down": "replicate"}, str(report)
    assert all("float8 weight whose scales are not one a row nor one for the whole tensor" in r.reason
               for r in report.rows), str(report)
    with pytest.raises(ValueError, match="float8 weight whose scales are not one a row"):
        dynashard.explain(model, x, world_size=2, options={**OPTIONS, "plan": {"up": "colwise"}})


@pytest.mark.unit
@pytest.mark.parametrize("config", list(FLOAT8_CONFIGS))
def test_float8_held_bytes(config):
    """Each rank holds its half of the float8 data, and of the per-row scales (a fake group of 2: the shards are
    real tensors); a per-tensor scale is held whole."""
    from dynashard import _torch as private

    private.init_fake_process_group(2)
    try:
        model = _float8_mlp(config)
        whole = dynashard.held_bytes(model)
        x = torch.randn(2, 5, 64)
        dynashard.parallelize(model, x, options={**OPTIONS, "compiler": "eager"})
        assert model(x).shape == (2, 5, 64)
        # 2 x 256 x 64 float8 bytes, halved; up's 256 f32 row scales halved (down's 64: whole, it is rowwise)
        cut = 2 * 256 * 64 // 2 + (256 * 4 // 2 if config == "per row" else 0)
        # (+ up's colwise bias, held cut when the graph reads it only through the cut: 256 f32, halved)
        assert whole - dynashard.held_bytes(model) in (cut, cut + 256 * 4 // 2), (whole, dynashard.held_bytes(model))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 4])
def test_float8_llama_is_cut_as_its_float_twin(world):
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                           vocab_size=96, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = T.LlamaForCausalLM(config).eval()
    quantize_(model, Float8WeightOnlyConfig())
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    report = dynashard.explain(model, ids, world_size=world, verify=True, options=OPTIONS, use_cache=False)
    assert report.layers == LLAMA_PLAN, str(report)
    assert not report.outside, report.outside


# Per tensor in the slow tier, a spawn of its own: the default run compiles the per-row Llama here, and loads
# and runs the per-tensor one on these ranks (test_quantized_hf_checkpoint_loads_sharded[float8 per tensor]:
# its float8 data cut, its [1, 1] scale whole, the logits the quantized model's); the second length's recompile
# with freed inner tensors runs for int8, int4 and float8 per row here.
@on_ranks
@torch.no_grad()
def test_float8_llama_on_real_ranks_equals_the_quantized_model(rank, world):
    # cut: q/k/v/o/gate/up/down's float8 data and per-row scales, halved; the embedding half; whole: lm_head, norms
    _quantized_llama_equals_the_quantized_model(FLOAT8_CONFIGS["per row"](), held_at_most=0.62)


@pytest.mark.slow
@on_ranks.alone(2)
@torch.no_grad()
def test_float8_per_tensor_llama_on_real_ranks_equals_the_quantized_model(rank, world):
    """test_float8_llama_on_real_ranks_equals_the_quantized_model with one scale for each weight."""
    _quantized_llama_equals_the_quantized_model(FLOAT8_CONFIGS["per tensor"](), held_at_most=0.62)


@pytest.fixture
def float8_on_cpu(monkeypatch):
    """Float8DynamicActivationFloat8WeightConfig on this CPU. torchao asserts CUDA SM 8.9+ (or MI300, XPU) when
    quantizing, but torch 2.13's CPU ``_scaled_mm`` runs the float8 matmul it traces: with that check skipped
    (torchao's own function, replaced here only), the quantized tensor, its graph and kernel are torchao's and
    torch's. The GPU check (benchmarks/gpu_check.py) runs the same config on CUDA unpatched."""
    import torchao.quantization.quant_api as quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig

    return {"per tensor": (lambda: Float8DynamicActivationFloat8WeightConfig(), torch.float32),
            "per row": (_rowwise_scaled_mm_on_cpu, torch.bfloat16)}


def _rowwise_scaled_mm_on_cpu():
    """Per row's config, where this torch's CPU ``_scaled_mm`` takes a scale per row (2.13 on; torch 2.11's asserts
    "only supports per-tensor scaling for CPU backend", unsharded as sharded): skipped with that reason otherwise."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    a, b = torch.ones(2, 16).to(torch.float8_e4m3fn), torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, torch.ones(2, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no scale per row: {str(e)[:120]}")
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", ["per tensor", "per row"])
def test_float8_dynamic_activation_mlp_is_cut(float8_on_cpu, config, world):
    """_scaled_mm(quantized x, t(qdata), x_scale, t(w_scale), bias): before, no linear matched (both whole, no row).
    Now up's float8 rows are cut with their scales (its bias too), down's columns with every scale whole; down's
    input scale (amax over the whole input, or each row's features) is taken from the gathered input, so each
    rank quantizes its features exactly as the unsharded model does; the bias added once after the all_reduce.
    (per row needs bf16 weights in torchao: its partial sums are rounded to bf16, as the float twin's.)"""
    make, dtype = float8_on_cpu[config]
    torch.manual_seed(0)
    model = MLP().to(dtype)
    quantize_(model, make())
    x = torch.randn(2, 5, 64, dtype=dtype)
    report = dynashard.explain(model, x, world_size=world, verify=True, options=OPTIONS)  # (each rank vs the model)
    assert report.layers == {"up": "colwise", "down": "rowwise"}, str(report)
    rows = {r.fqn: r for r in report.rows}
    assert "all_gather (before amax.default)" in rows["up"].collectives, str(report)  # (the input's scale)
    assert rows["up"].weight_bytes == -(-256 // world) * 64, str(report)


@pytest.mark.unit
def test_float8_training_linear_is_kept_whole_with_the_reason():
    """torchao's Float8Linear (convert_to_float8_training) casts its float weight to float8 in the graph, scaled
    by the max over the whole weight: a cut would scale each rank's part by its own max. Before: no row (not
    matched); now each is kept whole with that reason, and a plan asking a cut is refused naming it."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 5, 64)
    convert_to_float8_training(model)
    report = dynashard.explain(model, x, world_size=2, verify=True, options=OPTIONS)
    assert report.layers == {"up": "replicate", "down": "replicate"}, str(report)
    assert all("torchao's Float8Linear" in r.reason for r in report.rows), str(report)
    with pytest.raises(ValueError, match="a float weight cast to float8 in the graph"):
        dynashard.explain(model, x, world_size=2, options={**OPTIONS, "plan": {"up": "colwise"}})


@on_ranks
@torch.no_grad()
def test_float8_dynamic_activation_on_real_ranks_equals_the_quantized_model(rank, world):
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    # (float8_on_cpu's why; a scenario runs in a rank process of its own: the patch ends with it)
    quant_api._check_hardware_support = lambda granularity: None
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    reference = copy.deepcopy(model)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    dynashard.parallelize(model, x, options={**OPTIONS, "compiler": "eager"})
    got, want = model(x).float(), reference(x).float()
    # the same float8 values and scales; down's two bf16 partial sums (rounded to bf16 each, as a bf16 float twin's)
    # added: a few bf16 ulps (2**-8 relative) of the output's magnitude
    assert float((got - want).abs().max()) <= 2 ** -6 * max(1.0, float(want.abs().max()))
    assert dynashard.held_bytes(model) < dynashard.held_bytes(reference) - 256 * 64  # (half of 2 x 16 KiB float8)


def _save_quantized(directory, config) -> T.LlamaConfig:
    """A tiny Llama saved float, loaded through HF's TorchAoConfig (quantized as HF does it) and saved again:
    HF writes each quantized weight flattened (``<module>._weight_qdata``, ``_weight_scale``, ...) with torchao's
    description of it in the safetensors metadata."""
    torch.manual_seed(0)
    config_ = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                            vocab_size=96, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    T.LlamaForCausalLM(config_).save_pretrained(directory / "float")
    quantized = T.LlamaForCausalLM.from_pretrained(directory / "float", quantization_config=T.TorchAoConfig(config),
                                                   dtype=torch.float32)
    quantized.save_pretrained(directory / "quantized")
    return config_


def _meta_quantized(config_, config) -> nn.Module:
    with dynashard.empty_weights():
        model = T.LlamaForCausalLM(config_).eval()
    # as HF's TorchAoConfig quantizes (on meta: the subclasses' shapes and attributes, no values): lm_head left float
    quantize_(model, config, filter_fn=lambda module, fqn: isinstance(module, nn.Linear) and fqn != "lm_head")
    return model


LOAD_CONFIGS = {
    "int8 per row": lambda: Int8WeightOnlyConfig(),
    "int8 PerGroup(16)": lambda: Int8WeightOnlyConfig(granularity=PerGroup(16)),
    "int4 PerGroup(16)": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)),
    **{f"float8 {k}": v for k, v in FLOAT8_CONFIGS.items()},  # (qdata and scale, no zero point)
}


def _expected_reads(weights: dict[str, torch.Tensor], world: int, case: str) -> dict[str, int]:
    """The elements a rank reads of each flattened inner tensor (``<module>._weight_<inner>``) of the quantized
    reference weights, from their shapes and LLAMA_PLAN's styles: a colwise layer's inner tensors cut on dim 0, a
    rowwise layer's on dim 1 (its groups of columns); one of length 1 there (a per-tensor [1, 1] scale, a per-row
    [out, 1] scale of a rowwise layer) is read whole. Int8 per row reads its [out, 1] scales and zero points whole
    on either side (held whole, narrowed in the graph: a pointwise op on the output)."""
    want = {}
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        style = LLAMA_PLAN.get(module)
        if style not in ("colwise", "rowwise") or not hasattr(weight, "__tensor_flatten__"):  # (plain: embedding)
            continue
        for inner in weight.__tensor_flatten__()[0]:
            part = getattr(weight, inner)
            cut = part.shape[0 if style == "colwise" else 1] > 1 and not (case == "int8 per row" and inner != "qdata")
            want[f"{module}._weight_{inner}"] = part.numel() // world if cut else part.numel()
    return want


# float8 per row in the slow tier, a spawn of its own: float8 per tensor loads the same Float8Tensor (its float8
# data read by rows and by columns, gathered whole by full_tensor over gloo), and a per-row scale's reads are
# the others': cut with the rows of a colwise layer (as int8 and int4 PerGroup(16)'s [out, groups] scales), read
# whole for a rowwise one (a scale of length 1 on the cut dim, as per tensor's [1, 1])
LOAD_SLOW = ("float8 per row",)


@on_ranks(cases=[c for c in LOAD_CONFIGS if c not in LOAD_SLOW])
@torch.no_grad()
def test_quantized_hf_checkpoint_loads_sharded(rank, world, tmp_path, case):
    """parallelize(meta model quantized alike, checkpoint=save_pretrained dir): each rank reads its rows or
    whole groups of qdata, scale and zero point; the logits equal the HF-loaded quantized model's. Float8 (qdata
    and scale): before, the load was right, but full_tensor's gloo all_gather of its float8 qdata raised "Invalid
    scalar type"."""
    _load_sharded(rank, world, tmp_path, case)


@pytest.mark.slow
@on_ranks.alone(2, cases=list(LOAD_SLOW))
@torch.no_grad()
def test_quantized_hf_checkpoint_loads_sharded_float8_per_row(rank, world, tmp_path, case):
    """test_quantized_hf_checkpoint_loads_sharded for float8 with a scale for each row."""
    _load_sharded(rank, world, tmp_path, case)


def _load_sharded(rank, world, tmp_path, case):
    import torch.distributed as dist

    if rank == 0:
        config_ = _save_quantized(tmp_path, LOAD_CONFIGS[case]())
    dist.barrier()
    config_ = T.LlamaConfig.from_pretrained(tmp_path / "quantized")
    reference = T.LlamaForCausalLM.from_pretrained(tmp_path / "quantized", dtype=torch.float32).eval()
    model = _meta_quantized(config_, LOAD_CONFIGS[case]())
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    from dynashard.load.checkpoint import SafetensorsCheckpoint

    read, real_read = {}, SafetensorsCheckpoint._read

    def counted(self, fqn, dim, pieces, dtype, device):  # (every slice any rank reads from the files)
        out = real_read(self, fqn, dim, pieces, dtype, device)
        read[fqn] = read.get(fqn, 0) + sum(t.numel() for t in out)
        return out

    SafetensorsCheckpoint._read = counted
    try:
        dynashard.parallelize(model, ids, checkpoint=tmp_path / "quantized", options=OPTIONS, use_cache=False)
    finally:
        SafetensorsCheckpoint._read = real_read
    weights = dict(reference.named_parameters())
    # each rank read exactly its half of every quantized inner tensor (rows, or whole groups of columns), the rest
    # whole: every inner tensor of the 2 x 7 linears (qdata, scale, zero point: what the reference holds)
    want = _expected_reads(weights, world, case)
    assert len(want) == 2 * 7 * len(weights["model.layers.0.mlp.up_proj.weight"].__tensor_flatten__()[0]), sorted(want)
    assert {k: n for k, n in read.items() if "._weight_" in k} == want, \
        {k: (read.get(k), n) for k, n in want.items() if read.get(k) != n}
    got, want = model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
    # the same integers (or float8 values) and scales, read in slices; partial sums added in another order: ulps of
    # O(1) float32 logits
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    # full_tensor of a cut quantized weight: its inner tensors gathered, the subclass rebuilt (the same integers)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        whole = dynashard.full_tensor(dict(model.named_parameters())[name])
        assert type(whole) is type(weights[name]) and torch.equal(whole.dequantize(), weights[name].dequantize()), name
    # cut: the q/k/v/o/gate/up/down data, scales, zero points and the embedding, halved; whole: lm_head, norms
    assert dynashard.held_bytes(model) <= 0.62 * dynashard.held_bytes(reference)


@on_ranks
@torch.no_grad()
def test_a_quantized_checkpoint_of_another_config_is_refused(rank, world, tmp_path):
    """The same shapes, another quantization (int4 asymmetric per group into an int8 per-group model): the
    integers would dequantize to other values. Refused on every rank, naming the difference; the model kept."""
    import torch.distributed as dist

    if rank == 0:
        _save_quantized(tmp_path, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)))
    dist.barrier()
    config_ = T.LlamaConfig.from_pretrained(tmp_path / "quantized")
    model = _meta_quantized(config_, Int8WeightOnlyConfig(granularity=PerGroup(16)))
    before = {n: type(p) for n, p in model.named_parameters()}
    ids = torch.randint(3, 96, (2, 7))
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.weight' is saved as "
                                         "IntxUnpackedToInt8Tensor, the model has Int8Tensor"):
        dynashard.parallelize(model, ids, checkpoint=tmp_path / "quantized", options=OPTIONS, use_cache=False)
    assert {n: type(p) for n, p in model.named_parameters()} == before
    assert all(p.is_meta for p in model.parameters())
    model = _meta_quantized(config_, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    with pytest.raises(ValueError, match="_weight_scale' is saved as torch.float32 .64, 4., the model's "
                                         "model.layers.0.self_attn.q_proj.weight.scale is torch.float32 .64, 2."):
        dynashard.parallelize(model, ids, checkpoint=tmp_path / "quantized", options=OPTIONS, use_cache=False)
    with pytest.raises(ValueError, match="holds none of .'model.layers.0.self_attn.q_proj._weight_qdata'"):
        dynashard.parallelize(model, ids, checkpoint=tmp_path / "float", options=OPTIONS, use_cache=False)
    with pytest.raises(ValueError, match="weights='rank0' does not deal"):
        dynashard.parallelize(_meta_quantized(config_, IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                           granularity=PerGroup(16))),
                              ids, checkpoint=tmp_path / "quantized", options={**OPTIONS, "weights": "rank0"},
                              use_cache=False)


def _quantized_llama(config, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                             num_key_value_heads=4, vocab_size=96, num_hidden_layers=2)).eval()
    quantize_(model, config)
    return model


DCP_SLOW = ("int8 PerGroup(16)", "float8 per row")  # (15-20 s each under load: the slow tier)


@on_ranks(cases=["int8 per row", "int4 PerGroup(16)"])
@torch.no_grad()
def test_dcp_round_trip_of_a_parallelized_quantized_model(rank, world, tmp_path, case):
    _dcp_round_trip(rank, world, tmp_path, case)


def _dcp_round_trip(rank, world, tmp_path, case):
    """get_model_state_dict + dcp.save of a parallelized quantized Llama, then dcp.load (LoadPlanner) +
    set_model_state_dict into another, quantized alike from other weights: the saved model's logits. The state
    dict holds each weight's inner tensors (``q_proj.weight.qdata``: this rank's rows), not the subclass, whose
    freed qdata DCP would pickle (before: every rank raised inside dcp.save, after writing its files). A
    checkpoint of another quantization is refused by DCP on every rank, the model left as it was. A full state
    dict (``full_state_dict=True``) holds the whole inner tensors, and loads back cut."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    model = _quantized_llama(LOAD_CONFIGS[case](), seed=0)
    reference = copy.deepcopy(model)
    dynashard.parallelize(model, ids, options=OPTIONS, use_cache=False)
    state = get_model_state_dict(model)
    assert state["model.layers.0.self_attn.q_proj.weight.qdata"].shape == (32, 64), sorted(state)[:8]
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    other = _quantized_llama(LOAD_CONFIGS[case](), seed=5)
    dynashard.parallelize(other, ids, options=OPTIONS, use_cache=False)
    loaded = get_model_state_dict(other)
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"), planner=dynashard.LoadPlanner())
    set_model_state_dict(other, loaded)
    got, want = other(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
    # the same integers and scales, partial sums added in another order: ulps of O(1) float32 logits
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    if case == "int4 PerGroup(16)":  # (full_state_dict: every inner tensor gathered whole, and cut again on load)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        scale = reference.model.layers[0].mlp.down_proj.weight.scale  # (cut by groups of columns: rowwise)
        assert torch.equal(full["model.layers.0.mlp.down_proj.weight.scale"], scale)
        third = _quantized_llama(LOAD_CONFIGS[case](), seed=7)
        dynashard.parallelize(third, ids, options=OPTIONS, use_cache=False)
        set_model_state_dict(third, full, options=StateDictOptions(full_state_dict=True))
        got = third(ids, use_cache=False).logits
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    if case == "int8 per row":
        regrouped = _quantized_llama(Int8WeightOnlyConfig(granularity=PerGroup(16)), seed=5)
        dynashard.parallelize(regrouped, ids, options=OPTIONS, use_cache=False)
        before = regrouped(ids, use_cache=False).logits
        with pytest.raises(dcp.api.CheckpointException) as refused:  # (DCP's plan, before anything is read)
            dcp.load(get_model_state_dict(regrouped), checkpoint_id=str(tmp_path / "ck"),
                     planner=dynashard.LoadPlanner())
        assert all("Size mismatch" in str(e) for e in refused.value.failures.values()), refused.value.failures
        assert torch.equal(regrouped(ids, use_cache=False).logits, before)


@pytest.mark.slow
@on_ranks.alone(2, cases=list(DCP_SLOW))
@torch.no_grad()
def test_dcp_round_trip_of_a_parallelized_quantized_model_slow_tier(rank, world, tmp_path, case):
    """test_dcp_round_trip_of_a_parallelized_quantized_model for int8 by groups (scales and zero points cut with
    their groups) and float8 with a scale for each row (no zero point)."""
    _dcp_round_trip(rank, world, tmp_path, case)


@pytest.mark.unit
@torch.no_grad()
def test_a_quantized_load_missing_an_inner_tensor_changes_nothing(fake_group):
    """load_state_dict of a parallelized int8 Llama from another one's state dict, the last layer's down_proj
    scale left out: refused naming the missing key, and no module loaded (the first layer's int8 shard is as
    it was). Before: each module checked and copied its own entries as the load reached it, so the earlier
    layers were loaded before the refusal, and a weight's qdata loaded without its scale was not reported
    missing at all (its subclass key was marked loaded): integers of one checkpoint with scales of another."""
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    model, other = _quantized_llama(Int8WeightOnlyConfig(), seed=0), _quantized_llama(Int8WeightOnlyConfig(), seed=5)
    for m in (model, other):
        dynashard.parallelize(m, ids, options=OPTIONS, use_cache=False)
    first = "model.layers.0.self_attn.q_proj.weight.qdata"
    before = model.state_dict()[first].clone()
    state = other.state_dict()
    assert not torch.equal(state[first], before)  # (a load would change it)
    del state["model.layers.1.mlp.down_proj.weight.scale"]
    from dynashard.errors import UsageError

    with pytest.raises(UsageError, match=r"'model.layers.1.mlp.down_proj.weight'.*not "
                                                   r"\['model.layers.1.mlp.down_proj.weight.scale'\]"):
        model.load_state_dict(state)
    assert torch.equal(model.state_dict()[first], before)
