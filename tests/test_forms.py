"""Linear forms beyond ``nn.Linear``, as real models write them, matched and sharded.

Weight-only int8 (gpt-fast's int8 mode): ``F.linear(x, w_int8.to(x.dtype)) * scales`` with the
int8 weight and the per-channel scales as buffers. The integer buffer converted on its way to the
matmul is the weight; the scales are a pointwise op on the output (narrowed for a colwise layer).
Simulated at several world sizes, and on 2 real gloo ranks against the unsharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

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
