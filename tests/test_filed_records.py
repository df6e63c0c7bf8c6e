"""Every record is filed complete: no node's lowering or resize changes after the layout map files it.

The nodes on a linear's weight path (an embedding's ``max_norm`` renorm, weight_norm's norm, spectral_norm's
power steps and sigma, a stacked weight's transpose, a group-quantized weight's dequantization views) are
emitted at the cut their linear chooses, which the walk decides after them (graph order). The walk files
them with their lowerings once that linear is decided; it never reaches back into a filed record.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dynashard
from dynashard.layout.mesh import Mesh
from dynashard.layout.shard import LayoutMap, Record
from dynashard.plan import propagate as propagate_module
from tests import models

pytestmark = pytest.mark.unit


class _Watching(dict):
    """A layout map's ``records``, remembering each record and its lowering and resize as filed."""

    def __init__(self) -> None:
        super().__init__()
        self.as_filed: dict = {}

    def __setitem__(self, node, record) -> None:
        self.as_filed[node] = (record, record.lowering, record.resize)
        super().__setitem__(node, record)


@pytest.fixture
def walks(monkeypatch) -> list[LayoutMap]:
    """Every layout map the planning walks build, their records watched."""
    made: list[LayoutMap] = []

    class Watched(LayoutMap):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.records = _Watching()
            made.append(self)

    monkeypatch.setattr(propagate_module, "LayoutMap", Watched)
    return made


class _MaxNormEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 16, max_norm=0.5)
        self.head = nn.Linear(16, 8)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _grouped_mlp() -> nn.Module:
    quantization = pytest.importorskip("torchao.quantization")
    model = models.MLP(hidden=64, ffn=256)
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(granularity=quantization.PerGroup(32)))
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 5))


CASES = {  # name -> (model, input, options, the lowerings (or Resize) the weight paths get)
    "max_norm_rowwise": (_MaxNormEmbedding, _ids, {"plan": {"emb": "rowwise"}}, {"Renorm"}),
    "max_norm_colwise": (_MaxNormEmbedding, _ids, {"plan": {"emb": "colwise"}}, {"Renorm"}),
    # up: weight_norm(dim=0) colwise (on its norm dim); down: dim=0 rowwise (across its norms)
    "weight_norm": (lambda: models.ClothedMLP(16, 40, "weight_norm", "weight_norm"), lambda: torch.randn(2, 3, 16),
                    {}, {"NormOfSlices", "NormAcrossCut"}),
    "spectral_norm": (lambda: models.ClothedMLP(16, 40, "spectral_norm", "spectral_norm").train(),
                      lambda: torch.randn(2, 3, 16), {}, {"CutMatVec", "SigmaOfCut"}),
    "stacked": (models.MLP, lambda: torch.randn(2, 5, 32), {"weights": "per_rank", "inputs": "per_rank"},
                {"StackedTranspose"}),
    "group_quantized": (_grouped_mlp, lambda: torch.randn(2, 5, 64), {}, {"Resize"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_record_changes_after_it_is_filed(case, walks):
    make, inputs, options, expected = CASES[case]
    torch.manual_seed(0)
    dynashard.explain(make(), inputs(), world_size=2, options={"min_shard_numel": 0, **options})
    assert walks, "expected explain to plan through propagate"
    seen, changed = set(), []
    for lm in walks:
        for node, record in lm.records.items():
            filed, lowering, resize = lm.records.as_filed[node]
            if record is not filed or record.lowering is not lowering or record.resize is not resize:
                changed.append(f"{node}: lowering {type(lowering).__name__} -> {type(record.lowering).__name__}, "
                               f"resize {resize} -> {record.resize}")
            seen |= {type(record.lowering).__name__} | ({"Resize"} if record.resize is not None else set())
    assert not changed, f"records changed after they were filed: {changed}"
    assert expected <= seen, f"expected the weight paths' {sorted(expected)} in the plan; found {sorted(seen)}"


def test_a_filed_record_is_final():
    lm = LayoutMap(Mesh(2, 0), styles={})
    node = torch.fx.Graph().placeholder("x")
    record = Record()
    lm.commit(node, record)
    with pytest.raises(AssertionError, match="filed"):
        record.lowering = object()
