"""In-place writes into the LM head's logits: planned like their out-of-place twin.

Sampling code masks logits in place: ``logits[mask] = -inf``, ``logits[:, [3, 5]] = -inf``,
``logits[..., 0] = -inf``, nanoGPT's top-k ``logits[logits < v[:, [-1]]] = -Inf``, each also on a
``.clone()``. The head's output is cut on the vocabulary; a write either stays on this rank's part
(a mask cut alike) or lands in the gather the indexing needs anyway, which every later read then
shares (a later read of this rank's part sees it copied back). A plan that keeps the head whole for
such a write while its tied embedding still cuts the shared weight crashes at compile time ("shape
'[2, 1, 96]' is invalid for input of size 96"). A write the layout cannot follow (a read
sharing a gather made before it) keeps the head whole, and its tied embedding with it.

Simulated ranks (``explain(verify=True)``) for every form, real gloo ranks for two.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dynashard
from tests import models
from tests.multiproc import SUBPROCESS_DEADLINE_S, run_ranks

VOCAB = 96
OPTIONS = {"min_shard_numel": 0}


def _write(logits: torch.Tensor, form: str, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` masked in place as sampling code writes it (``masked_fill``: the out-of-place twin)."""
    if form == "mask":
        logits[logits < 0] = -float("inf")
    elif form == "input_mask":  # a mask that arrives whole: each rank writes its part of it
        logits[mask] = -float("inf")
    elif form == "rows":  # a mask of whole rows, a vector written into each
        logits[mask[:, 0]] = torch.arange(VOCAB, dtype=logits.dtype)
    elif form == "list":
        logits[:, [3, 5]] = -float("inf")
    elif form == "ellipsis":
        logits[..., 0] = -float("inf")
    elif form == "topk":  # nanoGPT's generate
        v, _ = torch.topk(logits, min(5, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("Inf")
    elif form == "masked_fill":
        logits = logits.masked_fill(logits < 0, -float("inf"))
    else:
        raise AssertionError(form)
    return logits


class _Step(nn.Module):
    """One sampling step: the last position's logits, written in place, then softmax."""

    def __init__(self, form: str, clone: bool) -> None:
        super().__init__()
        self.gpt = models.NanoGPT(vocab=VOCAB, n_embd=64, n_head=4, n_layer=1)
        self.form, self.clone = form, clone

    def forward(self, idx, mask):
        logits = self.gpt(idx)[:, -1, :]
        if self.clone:
            logits = logits.clone()
        return F.softmax(_write(logits, self.form, mask), dim=-1)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (3, 8), generator=g), torch.rand(3, VOCAB, generator=g) < 0.3


def _styles(report) -> list[tuple[str, str]]:
    return sorted((r.fqn, str(r.style)) for r in report.rows)


@pytest.mark.unit
@pytest.mark.parametrize("clone", [False, True], ids=["logits", "clone"])
@pytest.mark.parametrize("form", ["mask", "input_mask", "rows", "list", "ellipsis", "topk"])
def test_write_into_logits_is_planned_like_masked_fill_and_verifies(form, clone):
    """Every simulated rank of world 2 against the unsharded model (explain raises past the fp32
    tolerance, 1e-5 + 1e-3 x the outputs' magnitude: probabilities, at most 1); the plan is the
    out-of-place twin's: the head stays cut on the vocabulary, its tied embedding too."""
    torch.manual_seed(0)
    twin = dynashard.explain(_Step("masked_fill", clone), *_inputs(), world_size=2, options=OPTIONS)
    torch.manual_seed(0)
    report = dynashard.explain(_Step(form, clone), *_inputs(), world_size=2, verify=True, options=OPTIONS)
    assert _styles(report) == _styles(twin), report
    assert ("gpt.wte", "colwise") in _styles(report), report
    assert report.graphs[0].output_err <= 1e-5, report  # softmax of O(1) logits, fp32


class _ReadAround(nn.Module):
    """Reads around a write. ``write_back``: ``logits[..., 0] = -inf`` lands in the gather of the
    logits' cut dim, and the pointwise read after it reads this rank's part, which the write is
    copied back into. ``stale``: a gather made before a write into this rank's part (``logits[0]``)
    is all a read after it could share: the head stays whole, and ``wte`` with it (tied)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.gpt = models.NanoGPT(vocab=VOCAB, n_embd=64, n_head=4, n_layer=1)
        self.form = form

    def forward(self, idx):
        logits = self.gpt(idx)
        if self.form == "write_back":
            logits[..., 0] = -float("inf")
            return F.softmax(logits * 2, dim=-1)
        before = F.softmax(logits, dim=-1)
        logits[0] = 0.0
        return before, F.softmax(logits, dim=-1)


@pytest.mark.unit
def test_write_into_a_gather_is_copied_back_into_the_shard_a_later_read_uses():
    torch.manual_seed(0)
    report = dynashard.explain(_ReadAround("write_back"), _inputs()[0], world_size=2, verify=True, options=OPTIONS)
    assert ("gpt.wte", "colwise") in _styles(report), report
    assert report.graphs[0].output_err <= 1e-5, report  # softmax of O(1) logits, fp32


@pytest.mark.unit
def test_write_the_layout_cannot_follow_keeps_the_head_and_its_tied_embedding_whole():
    torch.manual_seed(0)
    report = dynashard.explain(_ReadAround("stale"), _inputs()[0], world_size=2, verify=True, options=OPTIONS)
    wte = [r for r in report.rows if r.fqn == "gpt.wte"]
    assert len(wte) == 2 and all(r.style == "replicate" for r in wte), report  # embedding and head: one weight
    assert any("in-place aten.fill_" in r.reason for r in wte), report
    assert report.layers["gpt.h.0.c_fc"] == "colwise", report  # the rest still cut
    assert report.graphs[0].output_err <= 1e-5, report


def _generate(model: nn.Module, idx: torch.Tensor, steps: int, form: str, clone: bool):
    """nanoGPT's ``generate`` (block-size crop, temperature, the in-place mask, softmax), greedy so that
    both sides pick the same tokens: the probabilities of every step are compared."""
    probs_seen = []
    for _ in range(steps):
        logits = model(idx[:, -32:])[:, -1, :] / 0.8
        if clone:
            logits = logits.clone()
        probs = F.softmax(_write(logits, form, None), dim=-1)
        probs_seen.append(probs)
        idx = torch.cat((idx, probs.argmax(-1, keepdim=True)), dim=1)
    return idx, torch.stack(probs_seen)


def _generate_on_ranks(rank: int, world: int, form: str, clone: bool, compiler: str):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=VOCAB, n_embd=64, n_head=4, n_layer=2).eval()
    idx = torch.randint(0, VOCAB, (2, 6))
    full = dynashard.held_bytes(model)
    with torch.no_grad():
        want_idx, want_probs = _generate(model, idx, 3, form, clone)
        fast = torch.compile(lambda i: _generate(model, i, 3, form, clone),
                             backend=dynashard.backend(compiler=compiler, **OPTIONS))
        got_idx, got_probs = fast(idx)
    err = float((got_probs - want_probs).abs().max())
    return torch.equal(got_idx, want_idx), err, dynashard.held_bytes(model) / full


@pytest.mark.gloo
@pytest.mark.parametrize(("form", "clone", "compiler"), [("topk", False, "eager"), ("list", True, "eager")])
def test_generate_writing_logits_matches_the_unsharded_model_on_real_ranks(form, clone, compiler):
    """Two gloo ranks, three tokens generated in one compiled function: the same tokens,
    probabilities within 1e-5 (fp32 softmax; sums in another order), and the weights held cut as for
    one forward (0.51 of the model: LayerNorms and rowwise biases whole; tests/test_run_twice.py)."""
    for same, err, held in run_ranks(_generate_on_ranks, 2, form, clone, compiler, timeout=SUBPROCESS_DEADLINE_S):
        assert same and err <= 1e-5, (same, err)
        assert held < 0.52, held
