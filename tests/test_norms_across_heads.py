"""A norm over every head (OLMo2's q_norm / k_norm over the whole projection): an all_reduce of
``[tokens, 1]`` instead of a gather of ``[tokens, hidden]``.

Each rank's sum (or share of the mean) of its heads' squares is a term of the whole; the first
reader that is not linear in it (``var + eps``) reads it all-reduced (rules/reductions.py). The
graph tests count the collectives on the fake group; ``explain(verify=True)`` simulates every rank
(forward, and the forward of a training compile); the gloo scenario trains HF OLMo2 against its
unsharded twin and compares raw gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st

import dynashard
from dynashard.errors import NotSupportedError
from tests import models
from tests.scenarios import Scenarios
from tests.test_graphs import _count, rewritten

SCENARIOS_DEADLINE_S = 240  # one spawn at world 2: ~20 s quiet; 3x slower machine, 2x margin, plus startup
pytestmark = pytest.mark.timeout(SCENARIOS_DEADLINE_S + 60)
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)


class WholeProjectionNorm(nn.Module):
    """OLMo2's attention, written out: RMSNorm over all of q (and of k), then heads."""

    def __init__(self, hidden: int = 64, heads: int = 4, reduction: str = "mean", keepdim: bool = True) -> None:
        super().__init__()
        self.heads, self.reduction, self.keepdim = heads, reduction, keepdim
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.Parameter(1 + torch.rand(hidden)), nn.Parameter(1 + torch.rand(hidden))

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        sq = x.float().pow(2)
        var = sq.mean(-1, keepdim=self.keepdim) if self.reduction == "mean" else sq.sum(-1, keepdim=self.keepdim)
        var = var if self.keepdim else var.unsqueeze(-1)
        return (x * torch.rsqrt(var + 1e-6)) * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = self._norm(self.q(x), self.q_norm), self._norm(self.k(x), self.k_norm)
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.unit
def test_a_norm_over_every_head_costs_an_all_reduce_not_a_gather():
    # q norm, k norm ([tokens, 1] each) and o's all_reduce; no all_gather (not one per norm)
    torch.manual_seed(0)
    gm = rewritten(WholeProjectionNorm(), torch.randn(2, 5, 64))
    assert (_count(gm, "all_reduce"), _count(gm, "all_gather")) == (3, 0), gm.code
    sizes = sorted(tuple(n.meta["val"].shape[-1:]) for n in gm.graph.nodes if "all_reduce" in str(n.target))
    assert sizes == [(1,), (1,), (64,)], sizes


class NormedMLP(nn.Module):
    """An RMSNorm over a colwise output, written out, before its rowwise partner."""

    def __init__(self, hidden: int = 16, ffn: int = 3) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.unit
def test_a_rank_without_features_gathers_instead():
    # 3 features over 4 ranks: rank 3 holds none, its mean would be nan: the norm gathers (still right)
    torch.manual_seed(0)
    options = {"min_shard_numel": 0}

    def up_collectives(world: int) -> str:
        report = dynashard.explain(NormedMLP(), torch.randn(2, 5, 16), world_size=world, options=options, verify=True)
        return next(r.collectives for r in report.rows if r.fqn == "up")

    assert up_collectives(4) == "all_gather (before mean.dim)"
    assert up_collectives(3) == "all_reduce"  # 1 feature each: the partial sums'


@pytest.mark.unit
@settings(max_examples=10, deadline=None, derandomize=True)
@given(world=st.integers(2, 4), heads=st.sampled_from([2, 3, 4, 6]), reduction=st.sampled_from(["mean", "sum"]),
       keepdim=st.booleans(), train=st.booleans())
def test_random_norms_over_heads_verify(world, heads, reduction, keepdim, train):
    """Uneven cuts (3 or 6 heads over 4 ranks), sum or mean, keepdim or not: every rank simulated
    against the unsharded model, for inference and for a training compile's forward."""
    torch.manual_seed(0)
    model = WholeProjectionNorm(hidden=8 * heads, heads=heads, reduction=reduction, keepdim=keepdim)
    dynashard.explain(model, torch.randn(2, 5, 8 * heads), world_size=world, options={"min_shard_numel": 0},
                      verify=True, train=train)  # raises if any rank's program differs


@pytest.mark.unit
def test_training_through_expert_partial_sums_is_refused(monkeypatch):
    """Partial sums an expert's rowwise matmul leaves are scaled by the router's weights, whose
    gradient would be each rank's term only: refused at compile time (a norm's are not)."""
    from tests.test_training_graphs import step_graphs

    torch.manual_seed(0)
    with pytest.raises(Exception, match="mixture-of-experts partial sums") as info:
        step_graphs(monkeypatch, models.MoE(hidden=32, ffn=16), torch.randn(2, 5, 32))
    assert isinstance(info.value, NotSupportedError) or "NotSupportedError" in str(info.value), info.value


def _olmo2() -> nn.Module:
    config = T.Olmo2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                           vocab_size=96, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return T.AutoModelForCausalLM.from_config(config)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@on_ranks
def test_olmo2_trains_as_its_unsharded_twin(rank, world):
    from dynashard.load.registered import facades as facades_of
    from dynashard.weights.store import STORE, cut

    model = _olmo2()
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    options = {"compiler": "eager", "min_shard_numel": 0}
    report = str(dynashard.explain(twin, ids, options=options, use_cache=False))
    assert "before mean.dim" not in report and "all_reduce" in report, report
    dynashard.parallelize(model, ids, options=options)
    facades = {f"{prefix}.{attr}" if prefix else attr: facade for prefix, module in model.named_modules()
               for attr, facade in facades_of(module).items()}
    assert len(facades) == 2 * 7 + 1, sorted(facades)  # every linear of both layers, and the embedding
    fast = torch.compile(model, backend="dynashard", options=options)
    for step in range(3):  # SGD: a 2x gradient would show in the next step's gradients too
        loss, loss_twin = _loss(fast, ids), _loss(twin, ids)
        loss.backward()
        loss_twin.backward()
        # float32, same sums in another order across 2 ranks: relative errors of a few 1e-6
        assert abs(float(loss) - float(loss_twin)) <= 1e-5 * abs(float(loss_twin)), (float(loss), float(loss_twin))
        reference = dict(twin.named_parameters())
        for name, p in model.named_parameters():
            g = reference[name].grad
            if name in facades:
                spec = STORE.spec_of(facades[name])
                g = cut(g, spec.dim, spec.split, spec.world, spec.rank)
            err = float((p.grad - g).abs().max()) / max(float(g.abs().max()), 1e-12)
            assert err <= 1e-4, (step, name, err)  # float32 gradients summed in another order
        for net in (model, twin):
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
