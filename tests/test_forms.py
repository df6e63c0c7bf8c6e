"""Forms real models are written in, beyond ``nn.Linear`` and separate q/k/v, matched and sharded.

Weight-only int8 (gpt-fast's int8 mode): ``F.linear(x, w_int8.to(x.dtype)) * scales`` with the
int8 weight and the per-channel scales as buffers. The integer buffer converted on its way to the
matmul is the weight; the scales are a pointwise op on the output (narrowed for a colwise layer).

A fused qkv viewed with its parts as a dim of their own: timm's ViT and ModernBERT
(``qkv(x).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)``) and ``nn.MultiheadAttention``
(``unflatten(-1, (3, E))`` then ``proj[0]``, ``proj[1]``, ``proj[2]``): the projection is cut as three
components, each by heads, so every rank holds its heads of q, k and v (rules/views.py).

Low-rank factorisations (DeepSeek's MLA ``q_a_proj`` -> ``q_b_proj``, a LoRA's A -> B): the small
down projection stays whole and the up projection is cut like a colwise layer, so MLA's heads are
cut (vLLM and SGLang's plan), not reduced after ``q_b_proj`` (auto_plan.py).

Simulated at several world sizes, and on 2 real gloo ranks against the unsharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as T

import dynashard
from tests import models
from tests.scenarios import Scenarios
from tests.test_graphs import _count, rewritten

SCENARIOS_DEADLINE_S = 180  # one spawn at world 2: ~10 s quiet; 3x slower machine, 2x margin, plus startup
pytestmark = pytest.mark.timeout(SCENARIOS_DEADLINE_S + 60)
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)


class Int8Linear(nn.Module):
    """gpt-fast's ``WeightOnlyInt8Linear``: int8 weight and float scales per output channel, buffers."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        w = torch.randn(out_features, in_features)
        scales = w.abs().amax(1) / 127
        self.register_buffer("weight", (w / scales[:, None]).round().to(torch.int8))
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(dtype=x.dtype)) * self.scales


class Int8MLP(nn.Module):
    def __init__(self, hidden: int = 64, ffn: int = 256) -> None:
        super().__init__()
        self.up, self.down = Int8Linear(hidden, ffn), Int8Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class IntegerTable(nn.Module):
    """An integer buffer used in a matmul without a conversion (a counting matrix): no weight."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randint(0, 3, (64, 32)).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.table


class MultiheadAttention(nn.Module):
    def __init__(self, need_weights: bool, batch_first: bool = False) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.attention = nn.MultiheadAttention(64, 4, batch_first=batch_first)

    def forward(self, x: torch.Tensor):
        y, weights = self.attention(x, x, x, need_weights=self.need_weights)
        return y if weights is None else (y, weights)  # weights: averaged over the heads


def _plan(model: nn.Module, x: torch.Tensor, world: int, **kwargs) -> dict[str, tuple[str, str]]:
    """Style and collectives per layer, every rank simulated against the model (raises on a mismatch)."""
    report = dynashard.explain(model, x, world_size=world, options={"min_shard_numel": 0}, verify=True, **kwargs)
    return {r.fqn: (str(r.style), r.collectives) for r in report.rows}


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])  # 6 heads: 3/3, 2/2/2, 2/2/1/1 of each of q, k and v
def test_a_fused_qkv_reshaped_into_parts_and_heads_is_cut_by_heads(world):
    torch.manual_seed(0)
    plan = _plan(models.ViTAttention(), torch.randn(2, 5, 96), world)
    assert plan == {"qkv": ("colwise", "-"), "proj": ("rowwise", "all_reduce")}, plan  # nothing gathered


@pytest.mark.unit
@pytest.mark.parametrize("need_weights,batch_first,world", [(False, False, 2), (False, True, 4), (True, False, 2)])
def test_multihead_attention_is_cut_by_heads(need_weights, batch_first, world):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64) if batch_first else torch.randn(5, 2, 64)
    plan = _plan(MultiheadAttention(need_weights, batch_first), x, world)
    # the attention weights averaged over the heads: each rank's heads' share, one all_reduce
    assert plan == {"attention.in_proj_weight": ("colwise", "all_reduce" if need_weights else "-"),
                    "attention.out_proj": ("rowwise", "all_reduce")}, plan


@pytest.mark.unit
def test_modernbert_shards_every_linear():
    config = T.ModernBertConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    plan = _plan(T.ModernBertModel(config).eval(), torch.randint(3, 96, (2, 7)), 4)
    assert {fqn: style for fqn, (style, _) in plan.items()} == {
        "embeddings.tok_embeddings": "rowwise", "layers.0.attn.Wqkv": "colwise", "layers.0.attn.Wo": "rowwise",
        "layers.0.mlp.Wi": "colwise", "layers.0.mlp.Wo": "rowwise"}, plan
    assert all(c in ("-", "all_reduce") for _, c in plan.values()), plan


def _deepseek_v3() -> nn.Module:
    """2 layers (dense, then MoE with a shared expert); MLA at realistic ratios: q rank 16 -> 4 heads
    of 24 (6x), kv rank 32 -> 4 heads of 32 (4x); the shared expert 64 -> 32 -> 64 (a narrow MLP)."""
    config = T.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return T.AutoModelForCausalLM.from_config(config).eval()


class Logits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids, use_cache=False).logits


@pytest.mark.unit
def test_mla_cuts_heads_with_the_low_rank_projections_whole():
    torch.manual_seed(0)
    model = _deepseek_v3()
    ids = torch.randint(3, 96, (2, 7))
    plan = _plan(copy.deepcopy(model), ids, 2, use_cache=False)
    for layer in (0, 1):
        attention = {k.rsplit(".", 1)[-1]: v for k, v in plan.items() if f"layers.{layer}.self_attn" in k}
        assert attention == {"q_a_proj": ("replicate", "-"), "q_b_proj": ("colwise", "-"),
                             "kv_a_proj_with_mqa": ("replicate", "-"), "kv_b_proj": ("colwise", "-"),
                             "o_proj": ("rowwise", "all_reduce")}, plan
    # The embedding's, then per layer o_proj's and the MLP's: 1 + 2 + 2. The MoE layer's shared expert
    # is left partial and reduced with the routed experts' partial sums, one all_reduce for both. No
    # gather: MLA's keys (new_empty, then k_nope and k_rot copied in) are held by heads. Was 13 + 9.
    gm = rewritten(Logits(model), ids)
    assert (_count(gm, "all_reduce"), _count(gm, "all_gather")) == (1 + 2 + 2, 0), gm.code


class LoRALinear(nn.Module):
    """PEFT's form: the base layer plus ``lora_B(lora_A(x)) * scaling``."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = nn.Linear(in_features, out_features)
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        nn.init.normal_(self.lora_B.weight)  # (PEFT starts B at zero: the adapter would add nothing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * 0.5


class LoRAMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = LoRALinear(64, 256), LoRALinear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 4])
def test_lora_adapters_follow_their_base_layer(world):
    # up: A whole, B colwise like its base (no collective); down: A rowwise like its base, its
    # [tokens, 4] partial sums reduced, B whole (was: A colwise, B rowwise, a [tokens, 256] reduce)
    torch.manual_seed(0)
    plan = _plan(LoRAMLP(), torch.randn(2, 5, 64), world)
    assert plan == {"up.base_layer": ("colwise", "-"), "up.lora_A": ("replicate", "-"),
                    "up.lora_B": ("colwise", "-"), "down.base_layer": ("rowwise", "all_reduce"),
                    "down.lora_A": ("rowwise", "all_reduce"), "down.lora_B": ("replicate", "-")}, plan


def _gpt_oss() -> nn.Module:
    config = T.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            layer_types=["full_attention"])
    return T.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.unit
def test_gpt_oss_attention_with_sinks_is_cut_by_heads():
    # the sinks (one per head) are cat'ed next to the head-sharded scores, narrowed to this rank's heads,
    # and the max subtracted along the keys is each rank's own (was: q and k whole, gathered before cat)
    torch.manual_seed(0)
    plan = _plan(_gpt_oss(), torch.randint(3, 96, (2, 7)), 2, use_cache=False)
    attention = {k.rsplit(".", 1)[-1]: v for k, v in plan.items() if "self_attn" in k}
    assert attention == {"q_proj": ("colwise", "-"), "k_proj": ("colwise", "-"), "v_proj": ("colwise", "-"),
                         "o_proj": ("rowwise", "all_reduce")}, plan


class InterleavedGLU(nn.Module):
    """gate and up interleaved in one projection, taken apart by ``[..., ::2]`` and ``[..., 1::2]``."""

    def __init__(self, hidden: int = 32, ffn: int = 48) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(hidden, 2 * ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up(x)
        return self.down(F.silu(y[..., ::2]) * y[..., 1::2])


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
def test_interleaved_parts_are_cut_in_pairs(world):
    torch.manual_seed(0)
    plan = _plan(InterleavedGLU(), torch.randn(2, 5, 32), world)
    assert plan == {"gate_up": ("colwise", "-"), "down": ("rowwise", "all_reduce")}, plan


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
def test_weight_only_int8_linears_are_sharded_and_verified(world):
    torch.manual_seed(0)
    report = dynashard.explain(Int8MLP(), torch.randn(2, 5, 64), world_size=world, options={"min_shard_numel": 0},
                               verify=True)  # raises if any rank differs (tolerance relative to the ~300s here)
    assert report.layers == {"up": "colwise", "down": "rowwise"}, str(report)


@pytest.mark.unit
def test_a_float_buffer_in_a_matmul_is_not_a_weight():
    torch.manual_seed(0)
    report = dynashard.explain(IntegerTable(), torch.randn(2, 64), world_size=2, options={"min_shard_numel": 0})
    assert report.layers == {}, str(report)


# On real ranks under eager; the slow tier runs both under Inductor (the default compiler, which cost
# this spawn ~12 s more under a load of 4: its start-up and two C++ builds per rank). The sharded program
# and its collectives are the same under both (test_numerics.py lowers its cases under Inductor).
@on_ranks
def test_int8_mlp_on_real_ranks_equals_unsharded(rank, world):
    _int8_mlp_equals_unsharded("eager")


@on_ranks
def test_multihead_attention_on_real_ranks_equals_unsharded(rank, world):
    _multihead_attention_equals_unsharded("eager")


@on_ranks
@torch.no_grad()
def test_llama4_and_gpt_oss_experts_on_real_ranks_equal_unsharded(rank, world):
    """Llama4's experts (bmm of the whole [E, in, out] parameter, the shared expert added in place)
    and GPT-OSS's (interleaved gate_up, biases added in place into partial sums: once), cut on 2
    gloo ranks: the logits of the unsharded model, under 0.6 of its weight bytes per rank."""
    from tests.test_experts import _gpt_oss, _llama4

    for build in (_llama4, lambda: _gpt_oss("grouped_mm")):
        model = build()
        reference = copy.deepcopy(model)
        fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, "compiler": "eager"})
        ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
        got, want = fast(ids, use_cache=False).logits, reference(ids, use_cache=False).logits
        # float32 O(1) logits, partial sums added in another order: a few ulps (explain: ~1e-7)
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), type(model).__name__
        held, whole = dynashard.held_bytes(model), dynashard.held_bytes(reference)
        assert held <= 0.6 * whole, (type(model).__name__, held, whole)  # experts cut: ~0.5 (norms, router whole)
        torch._dynamo.reset()


@pytest.mark.slow
@on_ranks.alone(2)
def test_int8_mlp_and_multihead_attention_on_real_ranks_under_inductor_equal_unsharded(rank, world):
    _int8_mlp_equals_unsharded("inductor")
    torch._dynamo.reset()
    torch.manual_seed(0)  # (as a scenario of its own starts)
    _multihead_attention_equals_unsharded("inductor")


@torch.no_grad()
def _int8_mlp_equals_unsharded(compiler: str) -> None:
    model = Int8MLP()
    reference = copy.deepcopy(model)
    fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, "compiler": compiler})
    for shape in [(3, 5, 64), (7, 64)]:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        want = reference(x)
        # float32 sums of 256 products of up to 127 x O(1) in another order: relative 1e-6 of ~300
        assert float((fast(x) - want).abs().max()) <= 1e-5 * float(want.abs().max()), shape
    held, whole = dynashard.held_bytes(model), dynashard.held_bytes(reference)
    assert held < 0.6 * whole, (held, whole)  # the int8 weights cut in half; scales (1 KiB) whole


@torch.no_grad()
def _multihead_attention_equals_unsharded(compiler: str) -> None:
    model = MultiheadAttention(need_weights=True)
    reference = copy.deepcopy(model)
    fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, "compiler": compiler})
    for shape in [(5, 2, 64), (7, 3, 64)]:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        (y, w), (y_ref, w_ref) = fast(x), reference(x)
        # float32 O(1) activations, sums in another order: a few ulps
        assert float((y - y_ref).abs().max()) <= 1e-5 and float((w - w_ref).abs().max()) <= 1e-6, shape
    assert dynashard.held_bytes(model) < 0.6 * dynashard.held_bytes(reference)


class OutWritesMLP(nn.Module):
    """up -> an ``out=`` op writing into a buffer -> down, in the forms a model writes it: into an
    ``empty_like`` / ``zeros_like`` of the cut activation, or into a buffer allocated at its global size, by
    pointwise ops and by a matmul reading up's weight a second time."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.up, self.down, self.form = nn.Linear(32, 96), nn.Linear(96, 32), form

    def forward(self, x):
        h = self.up(x)
        if self.form == "mul_into_empty_like":
            buf = torch.empty_like(h)
            torch.mul(h, 2, out=buf)
            return self.down(buf)
        if self.form == "add_into_global_zeros":
            buf = torch.zeros(x.shape[0], 96)
            torch.add(h, 1, out=buf)
            return self.down(buf)
        if self.form == "matmul_into_zeros_like":
            buf = torch.zeros_like(h)
            torch.matmul(x, self.up.weight.t(), out=buf)
            return self.down(buf + h)
        buf = torch.zeros(x.shape[0], 96)  # "matmul_into_global_zeros"
        torch.matmul(x, self.up.weight.t(), out=buf)
        return self.down(buf) + self.down(h)


@pytest.mark.unit
@pytest.mark.parametrize("form", ["mul_into_empty_like", "add_into_global_zeros", "matmul_into_zeros_like",
                                  "matmul_into_global_zeros"])
def test_out_writes_into_a_cut_activation_verify(form):
    """An ``out=`` write the rules do not model as a write (rules.inplace: an out= result is taken to alias
    its first argument): Dynamo functionalizes it, so the plan cuts up and down and every simulated rank
    equals the model (verify raises on a mismatch)."""
    torch.manual_seed(0)
    plan = _plan(OutWritesMLP(form), torch.randn(4, 32), 2)
    assert plan["up"][0] == "colwise" and plan["down"] == ("rowwise", "all_reduce"), plan
