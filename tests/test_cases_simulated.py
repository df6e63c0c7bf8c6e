"""Every numerics case, simulated at world 4 in one process (``explain(verify=True)``).

``tests/test_numerics.py`` runs every case on 2 real gloo ranks but only the cases where real
ranks add something (empty ranks, uneven heads, few KV heads, per-rank weights...) on 4: four
processes on the machine's 2 cores are what makes the suite slow. Here each case's model, first
input and options are planned for 4 ranks, every rank's rewritten graph is run in a thread
against the unsharded model (layer by layer and at the output, within ``report.py``'s dtype
tolerance), and the plan must shard what the gloo test expects it to shard.
"""

from __future__ import annotations

import pytest
import torch

import dynashard
from tests import models
from tests.battery import CASES, SHARDED, SHARDED_BY_CASE, _options

pytestmark = pytest.mark.unit


def _sharded_layers(param_names: set[str]) -> set[str]:
    """The layer FQNs of the weights a case must shard ("up.weight" -> "up"; a bare "w1" is its own)."""
    layers = set()
    for name in param_names:
        if name.endswith("bias") or name == "b1":
            continue  # (colwise biases are held cut with their weight: "functional"'s is the bare "b1")
        layers.add(name.removesuffix("weight").removesuffix(".") if name.endswith("weight") else name)
    return layers


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_at_world_4(case):
    model_name, hidden, ffn, shapes, extra = CASES[case]
    torch.manual_seed(0)
    model = models.build(model_name, hidden, ffn)
    torch.manual_seed(100)
    x = torch.randint(0, ffn, shapes[0]) if model_name in models.IDS_IN else torch.randn(shapes[0])
    options = _options(extra, "eager")
    options.pop("compiler")
    report = dynashard.explain(model, x, world_size=4, options=options, verify=True)  # raises on a mismatch
    sharded = {fqn for fqn, style in report.layers.items() if style != "replicate"}
    assert sharded == _sharded_layers(SHARDED_BY_CASE.get(case, SHARDED[model_name])), str(report)
