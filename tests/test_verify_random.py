"""``explain(verify=True)`` on graphs that draw random numbers (sampling, dropout, noise).

Real ranks are seeded alike and each draws from its own generator, so ranks drawing the same
shapes draw what the unsharded model draws. The simulated ranks (threads of one process) must do
the same: each, and the reference, draws from its own stream starting at one common state.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynashard
from dynashard.report import simulate
from tests import models

pytestmark = pytest.mark.unit


class _SampleStep(nn.Module):
    """nanoGPT's ``generate`` step: the last position's logits, softmax, one token drawn."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = models.NanoGPT(vocab=96, n_embd=64, n_head=4, n_layer=1)

    def forward(self, idx):
        probs = F.softmax(self.gpt(idx)[:, -1, :], dim=-1)
        return torch.multinomial(probs, num_samples=3, replacement=True)


@pytest.mark.parametrize("world", [2, 3])
def test_multinomial_sampling_verifies_token_for_token(world):
    """Every simulated rank samples the tokens the unsharded model samples (integer outputs: an
    error of 0 is the only pass)."""
    torch.manual_seed(0)
    model = _SampleStep().eval()
    ids = torch.randint(0, 96, (4, 8))
    report = dynashard.explain(model, ids, world_size=world, verify=True, options={"min_shard_numel": 0})
    assert report.graphs[0].output_err == 0.0, report
    assert report.layers["gpt.h.0.c_fc"] == "colwise", report  # sharded, not trivially whole


class _Noisy(nn.Module):
    """A random op on a colwise output (a cut value)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.up, self.down, self.form = nn.Linear(16, 48), nn.Linear(48, 16), form

    def forward(self, x):
        h = self.up(x)
        if self.form == "rand_like":
            h = h * torch.rand_like(h)
        elif self.form == "bernoulli":
            h = h * torch.bernoulli(torch.sigmoid(h))
        elif self.form == "randint_like":
            h = h * torch.randint_like(h, 0, 3)
        elif self.form == "exponential_":  # gpt-fast's sampling: probs / Exp(1) noise, argmax
            h = h / torch.empty_like(h).exponential_(1)
        return self.down(F.gelu(h))


@pytest.mark.parametrize("form", ["rand_like", "bernoulli", "randint_like", "exponential_"])
def test_random_op_of_a_cut_value_is_drawn_whole_and_verifies(form):
    """No rule cuts a random op: its input is gathered and every rank draws the whole shape, as the
    unsharded model does, so the simulated ranks match it."""
    torch.manual_seed(0)
    report = dynashard.explain(_Noisy(form), torch.randn(2, 5, 16), world_size=3, verify=True,
                               options={"min_shard_numel": 0})
    up = next(r for r in report.rows if r.fqn == "up")  # (a mismatch raised VerificationError above)
    assert up.style == "colwise" and "all_gather (before" in up.collectives, report


def test_each_simulated_rank_draws_from_the_common_start_whatever_the_interleaving():
    """What a rank drawing its own part of a cut value would get: a part's count of numbers from
    the state every rank starts at (a real rank's generator), not numbers another rank moved past;
    and the caller's generator is left as it was."""
    torch.manual_seed(7)
    after_seed = torch.rand(4)
    torch.manual_seed(7)
    streams = simulate._RandomStreams(3)
    drawn: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    turns = [threading.Event() for _ in range(6)]

    def rank(index: int, sizes: list[int], order: list[int]) -> None:
        with streams.drawing(index):
            for size, turn in zip(sizes, order):  # the two ranks' draws interleaved
                if turn:
                    turns[turn - 1].wait(10)
                drawn[index].append(torch.rand(size))
                turns[turn].set()

    threads = [threading.Thread(target=rank, args=(0, [2, 3, 4], [0, 2, 4])),
               threading.Thread(target=rank, args=(1, [5, 1, 3], [1, 3, 5]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with streams.drawing(2):
        whole = torch.rand(9)
    assert torch.equal(torch.cat(drawn[0]), whole)
    assert torch.equal(torch.cat(drawn[1]), whole)
    assert torch.equal(torch.rand(4), after_seed), "the caller's generator moved"
