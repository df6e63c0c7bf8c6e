"""The lowering check (dynashard/rewrite/argument_check.py): an op the rewrite emits itself carries every argument
its source node sets, or its lowering declares how it expresses it. It runs in every rewrite (each
golden, fuzz case and compile); these tests show it can fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dynashard
from dynashard.errors import InternalError
from dynashard.rewrite import argument_check as lowering
from dynashard.rewrite import vocab

pytestmark = pytest.mark.unit


class Tagger(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 16, **kw)
        self.out = nn.Linear(16, 8)

    def forward(self, ids):
        return self.out(self.emb(ids))


IDS = torch.tensor([[1, 2, 70, 1, 95]])


def _verify(model):
    return dynashard.explain(model, IDS, world_size=2, options={"min_shard_numel": 0, "plan": {"emb": "rowwise"}},
                             verify=True)


def test_every_embedding_option_passes_the_check():
    for kw in ({"padding_idx": 70}, {"scale_grad_by_freq": True}, {"sparse": True}, {"max_norm": 0.5}):
        assert _verify(Tagger(**kw)).layers["emb"] == "rowwise", kw


def test_a_lowering_that_drops_a_carried_argument_fails(monkeypatch):
    """The vocab-parallel lookup forgetting ``sparse`` (it emits aten.embedding without it)."""
    monkeypatch.setattr(vocab, "embedding_options", lambda node: (-1, False, False))
    with pytest.raises(InternalError, match=r"emits no aten.embedding.default carrying its argument sparse=True"):
        _verify(Tagger(sparse=True))


def test_an_argument_nobody_declared_fails(monkeypatch):
    """``padding_idx`` becomes this rank's row of it, so no emitted embedding carries the source's value:
    without its declaration, the check refuses the rewrite."""
    declared = dict(lowering.REEXPRESSED[torch.ops.aten.embedding.default])
    del declared["padding_idx"]
    monkeypatch.setitem(lowering.REEXPRESSED, torch.ops.aten.embedding.default, declared)
    with pytest.raises(InternalError, match="padding_idx=70"):
        _verify(Tagger(padding_idx=70))


def test_set_arguments_are_the_ones_off_their_defaults():
    g = torch.fx.Graph()
    w, ids = g.placeholder("w"), g.placeholder("ids")
    plain = g.call_function(torch.ops.aten.embedding.default, (w, ids))
    padded = g.call_function(torch.ops.aten.embedding.default, (w, ids, 3, False, True))
    scaled = g.call_function(torch.ops.aten.addmm.default, (w, ids, w), {"beta": 2})
    assert lowering.set_arguments(plain) == {}
    assert lowering.set_arguments(padded) == {"padding_idx": 3, "sparse": True}
    assert lowering.set_arguments(scaled) == {"beta": 2}
