"""Attention written with ``flex_attention``: q/k/v/o cut by heads through Dynamo's higher-order op.

The score_mod adds an ALiBi-style bias whose slope is a captured per-head buffer read at the head
index ``h`` (and ``h`` itself, scaled): on a rank holding heads 3..5, ``h`` must be the global index
or the bias is another head's, a silent wrong answer that only ``explain(verify=True)`` against
the unsharded model sees. The block mask is causal for every head (H 1, kept) or a sliding window
per head (H heads, narrowed to this rank's; its mask_mod reads a per-head window at ``h``).

NOTE: torch 2.13 on CPU runs flex_attention without gradients only ("FlexAttention does not support
backward on CPU"): eagerly (its math path, which reads mask_mod and not the block tensors), under
``aot_eager``, and under Inductor where q/k/v are 4-D buffers (a view of a linear's 2-D output fails
Inductor's CPU template, the unsharded model too: "not enough values to unpack"). Hence no training
here; the block tensors' narrowing is checked on the rewritten graph, and numerically under Inductor
(whose kernel reads them) in the slow tier.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import dynashard
from tests import models
from tests.scenarios import Scenarios
from tests.test_graphs import _count, rewritten

SCENARIOS_DEADLINE_S = 180  # one spawn at world 2: ~15 s quiet; 3x slower machine, 2x margin, plus startup
pytestmark = pytest.mark.timeout(SCENARIOS_DEADLINE_S + 60)
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)


class FlexAttention(nn.Module):
    """``heads`` query heads of 16 features, ``kv_heads`` K/V heads (GQA when fewer), attention by
    ``models.flex_alibi``: mask "causal" (one block mask for every head), "window" (a block mask per
    head, head h reaching h + 1 keys back) or "two_rows" (no bias, a window mask built for 2 heads)."""

    def __init__(self, heads: int = 6, kv_heads: int | None = None, mask: str = "causal") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.mask = heads, kv_heads or heads, mask
        hidden = 16 * heads
        self.q, self.o = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.k, self.v = (nn.Linear(hidden, 16 * self.kv_heads, bias=False) for _ in range(2))
        self.register_buffer("slopes", 2.0 ** -torch.arange(1.0, heads + 1))  # ALiBi's, one per head
        self.register_buffer("windows", torch.arange(1, heads + 1))  # a window of h + 1 keys back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, 16).transpose(1, 2)
        k, v = (y(x).view(b, t, self.kv_heads, 16).transpose(1, 2) for y in (self.k, self.v))
        if self.mask == "two_rows":  # the window's mask built for 2 heads only
            block = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= self.windows[h], None, 2,
                                      t, t, device=x.device)
            y = flex_attention(q, k, v, block_mask=block)
        else:
            y = models.flex_alibi(q, k, v, self.slopes, self.windows if self.mask == "window" else None,
                                  gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def _plan(model: nn.Module, x: torch.Tensor, world: int) -> dict[str, tuple[str, str]]:
    """Style and collectives per layer, every rank simulated against the model (raises beyond the
    float32 tolerance: sums of 16-96 O(1) products in another order)."""
    with torch.no_grad():
        report = dynashard.explain(model, x, world_size=world, options={"min_shard_numel": 0}, verify=True)
    return {r.fqn: (str(r.style), r.collectives) for r in report.rows}


CUT = {"q": ("colwise", "-"), "k": ("colwise", "-"), "v": ("colwise", "-"), "o": ("rowwise", "all_reduce")}


@pytest.mark.unit
@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("world", [2, 3, 4])  # 6 heads: 3/3, 2/2/2, 2/2/1/1
def test_flex_attention_is_cut_by_heads_with_the_global_head_index(world, mask):
    torch.manual_seed(0)
    assert _plan(FlexAttention(mask=mask), torch.randn(2, 9, 96), world) == CUT


@pytest.mark.unit
@pytest.mark.parametrize("world,mask", [(2, "causal"), (4, "window")])  # 2 K/V heads: 1/1; whole, narrowed
def test_flex_attention_with_gqa_is_cut_by_query_heads(world, mask):
    torch.manual_seed(0)
    plan = _plan(FlexAttention(heads=8, kv_heads=2, mask=mask), torch.randn(2, 7, 128), world)
    # at world 4 the 2 K/V heads cannot be cut: k and v stay whole, each rank narrows its group's
    kv = ("colwise", "-") if world == 2 else ("replicate", "-")
    assert plan == {**CUT, "k": kv, "v": kv}, plan


class GivenMask(nn.Module):
    """The block mask built outside the compiled model and passed in (its tensors graph inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = FlexAttention()

    def forward(self, x: torch.Tensor, block) -> torch.Tensor:
        m, (b, t, _) = self.inner, x.shape
        q, k, v = (p(x).view(b, t, 6, 16).transpose(1, 2) for p in (m.q, m.k, m.v))
        slopes = m.slopes
        y = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i), block_mask=block)
        return m.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.unit
@pytest.mark.parametrize("rows", [None, 6])
def test_flex_attention_with_a_block_mask_passed_in_is_cut_by_heads(rows):
    torch.manual_seed(0)
    block = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j <= h + 1), None, rows, 9, 9, device="cpu")
    with torch.no_grad():
        report = dynashard.explain(GivenMask(), torch.randn(2, 9, 96), block, world_size=4, verify=True,
                                   options={"min_shard_numel": 0})
    assert {fqn.rsplit(".", 1)[-1]: str(s) for fqn, s in report.layers.items()} == {
        n: style for n, (style, _) in CUT.items()}, str(report)


@pytest.mark.unit
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_flex_attention_costs_one_all_reduce_and_narrows_a_per_head_block_mask(mask):
    torch.manual_seed(0)
    gm = rewritten(FlexAttention(mask=mask), torch.randn(2, 9, 96), world=4, rank=3)  # heads 5..5
    assert (_count(gm, "all_reduce"), _count(gm, "all_gather")) == (1, 0), gm.code
    (flex,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.flex_attention]
    assert flex.args[0].meta["val"].shape[1] == 1  # this rank's one query head
    block = [a.meta["val"] for a in flex.args[4] if isinstance(a, torch.fx.Node)
             and isinstance(a.meta.get("val"), torch.Tensor)]
    assert {t.shape[1] for t in block} == {1}, block  # causal: H 1 kept; window: 6 rows narrowed to this rank's
    # in buffers of their own: Inductor's CPU kernel ignores a view's offset (rows 0.. read instead)
    assert all(t.storage_offset() == 0 for t in block), [t.storage_offset() for t in block]


@pytest.mark.unit
def test_flex_attention_runs_on_every_head_with_a_block_mask_of_other_head_rows(caplog):
    # a block mask of 2 head rows for 6 heads (flex_attention accepts it): no rank's rows of it are
    # known, so q/k/v run whole (their gather costs more than keeping them whole), verified exact
    torch.manual_seed(0)
    with caplog.at_level(logging.DEBUG, logger="dynashard"):
        plan = _plan(FlexAttention(mask="two_rows"), torch.randn(2, 5, 96), 2)
    assert all(plan[name][0] == "replicate" for name in "qkv"), plan
    assert "its block mask has 2 head rows for 6 heads" in caplog.text, caplog.text


@on_ranks
@torch.no_grad()
def test_flex_attention_on_real_ranks_equals_unsharded(rank, world):
    for compiler, mask in [("eager", "window"), ("aot_eager", "causal")]:
        torch._dynamo.reset()
        model = FlexAttention(mask=mask)
        reference = copy.deepcopy(model)
        fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, "compiler": compiler})
        for shape in [(2, 9, 96), (3, 5, 96)]:
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
            want = reference(x)
            # float32 O(1) activations, sums of 96 products in another order: a few ulps of ~1
            assert float((fast(x) - want).abs().max()) <= 1e-5, (compiler, shape)
        assert dynashard.held_bytes(model) < 0.6 * dynashard.held_bytes(reference), compiler


class HeadWindows(nn.Module):
    """4 heads, a causal window of ``100 * h`` keys per head and a bias slope growing with ``h``, both
    computed from ``h`` (Inductor's CPU kernel took these mods, not the captured buffers above). At 256
    positions the block mask has 2 x 2 blocks of 128 and head 0's lower block is empty: a rank given
    another head's rows of the block mask skips or keeps the wrong blocks in the compiled kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # NOTE: contiguous: Inductor's CPU flex template reads q's layout as 4-D, and a view of the
        # linear's 2-D output is not ("not enough values to unpack", the unsharded model too; torch 2.13)
        q, k, v = (p(x).view(b, t, 4, 16).transpose(1, 2).contiguous() for p in (self.q, self.k, self.v))
        block = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j <= 100 * h), None, 4, t, t, device=x.device)
        y = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.05 * (h + 1) * (j - i), block_mask=block)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


# Inductor's flex kernel reads the block mask's tensors (the eager math path reads only mask_mod): this
# checks their narrowing numerically. Slow: an Inductor compile per rank (~20 s each on 2 loaded cores).
@pytest.mark.slow
@on_ranks.alone(2)
@torch.no_grad()
def test_flex_attention_with_a_per_head_block_mask_under_inductor_equals_unsharded(rank, world):
    model = HeadWindows()
    reference = copy.deepcopy(model)
    fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, "compiler": "inductor"})
    x = torch.randn(1, 256, 64, generator=torch.Generator().manual_seed(0))
    want = reference(x)
    # float32, sums of 64 O(1) products and softmaxes over up to 256 keys in another order: a few ulps of ~1
    assert float((fast(x) - want).abs().max()) <= 1e-5

