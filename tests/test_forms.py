"""Forms real models are written in, beyond ``nn.Linear`` and separate q/k/v, matched and sharded.

Weight-only int8 (gpt-fast's int8 mode): ``F.linear(x, w_int8.to(x.dtype)) * scales`` with the
int8 weight and the per-channel scales as buffers. The integer buffer converted on its way to the
matmul is the weight; the scales are a pointwise op on the output (narrowed for a colwise layer).

A fused qkv viewed with its parts as a dim of their own: timm's ViT and ModernBERT
(``qkv(x).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)``) and ``nn.MultiheadAttention``
(``unflatten(-1, (3, E))`` then ``proj[0]``, ``proj[1]``, ``proj[2]``): the projection is cut as three
components, each by heads, so every rank holds its heads of q, k and v (rules/views.py).

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
from tests.scenarios import Scenarios

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


class ViTAttention(nn.Module):
    """timm's ``Attention``: one qkv projection, its parts and heads taken apart by reshape + unbind."""

    def __init__(self, dim: int = 96, heads: int = 6) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


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
    plan = _plan(ViTAttention(), torch.randn(2, 5, 96), world)
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


@on_ranks
@torch.no_grad()
def test_int8_mlp_on_real_ranks_equals_unsharded(rank, world):
    model = Int8MLP()
    reference = copy.deepcopy(model)
    fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0})
    for shape in [(3, 5, 64), (7, 64)]:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        want = reference(x)
        # float32 sums of 256 products of up to 127 x O(1) in another order: relative 1e-6 of ~300
        assert float((fast(x) - want).abs().max()) <= 1e-5 * float(want.abs().max()), shape
    held, whole = dynashard.held_bytes(model), dynashard.held_bytes(reference)
    assert held < 0.6 * whole, (held, whole)  # the int8 weights cut in half; scales (1 KiB) whole


@on_ranks
@torch.no_grad()
def test_multihead_attention_on_real_ranks_equals_unsharded(rank, world):
    model = MultiheadAttention(need_weights=True)
    reference = copy.deepcopy(model)
    fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0})
    for shape in [(5, 2, 64), (7, 3, 64)]:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        (y, w), (y_ref, w_ref) = fast(x), reference(x)
        # float32 O(1) activations, sums in another order: a few ulps
        assert float((y - y_ref).abs().max()) <= 1e-5 and float((w - w_ref).abs().max()) <= 1e-6, shape
    assert dynashard.held_bytes(model) < 0.6 * dynashard.held_bytes(reference)
