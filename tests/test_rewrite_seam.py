"""Every lowering finishes inside its record, and the simulator drives the rewrite through its public seam.

- a lowering uses only the members ``Sharder.FOR_LOWERINGS`` lists (read from the source with ``ast``):
  not the interpreter's conversion cache, not its ``env``; what one lowering gives another is its node's
  value (loss parallel: ``LogSumExp`` returns the pieces ``VocabNll`` reads as its operand);
- ``explain(verify=True)`` builds the same public ``Sharder`` the backend traces, watching values through
  ``observe``: loss parallel's log_softmax is, on every simulated rank, the value its lowering returned.
(That report/ imports no private name of rewrite/ is tests/test_package_layout.py's.)
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dynashard
import dynashard.report.simulate as simulate
from dynashard.rewrite import lowerings
from dynashard.rewrite.interpreter import Sharder

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dynashard"
# A lowering outside rewrite/ still reading the interpreter's env: the exact members it uses beyond the seam,
# so the exemption neither hides a new one nor outlives its fix (then delete the entry).
PENDING: dict[str, set[str]] = {}


def lowering_modules() -> list[str]:
    """Every module that defines a Lowering (a class whose bases name ``Lowering``), and vocab.py, whose
    functions the lookups call with the sharder's values."""
    found = {"rewrite/vocab.py"}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Lowering" for b in node.bases):
                found.add(path.relative_to(PACKAGE).as_posix())
    return sorted(found)


def sharder_uses(source: str) -> set[str]:
    """Every ``sharder.<name>`` the source reads, and ``getattr(sharder, ...)`` as ``getattr``."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sharder":
            used.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "sharder":
            used.add("getattr")
    return used


def test_lowerings_use_only_the_sharders_seam():
    names = lowering_modules()
    assert {"rewrite/lowerings.py", *PENDING} <= set(names), names
    outside = {name: sharder_uses((PACKAGE / name).read_text()) - Sharder.FOR_LOWERINGS for name in names}
    assert not any(used != PENDING.get(name, set()) for name, used in outside.items()), (
        f"lowerings using members of the interpreter outside Sharder.FOR_LOWERINGS: {outside}. Expected each "
        "lowering to read its operands (sharder.read / held) and return its value; a value another lowering "
        "needs is its node's value, not an entry in the interpreter's cache.")


def test_the_seam_check_sees_a_value_passed_through_the_cache():
    """The check can fail: the old loss-parallel pair, which passed the log-sum-exp through the cache."""
    old = ('def emit(self, sharder, node):\n    x = sharder.env[node.args[0]]\n'
           '    sharder.converted[("lse", node)] = (x, x)\n    return getattr(sharder, node.op)(node.target, (), {})\n')
    assert sharder_uses(old) - Sharder.FOR_LOWERINGS == {"env", "converted", "getattr"}


class _LossHead(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.up, self.head = nn.Linear(hidden, 16), nn.Linear(16, vocab, bias=False)

    def forward(self, x, target):
        return F.cross_entropy(self.head(F.gelu(self.up(x))).flatten(0, 1), target.flatten(), ignore_index=3)


def test_loss_parallel_passes_its_log_sum_exp_as_the_log_softmax_value(monkeypatch):
    """Each simulated rank's log_softmax (loss parallel) holds what LogSumExp returned: this rank's
    slice of the logits and their log-sum-exp, which VocabNll reads as its operand; the loss equals the
    unsharded one (verify raises otherwise). Every member FOR_LOWERINGS names exists on the interpreter."""
    made: list[tuple[Sharder, dict]] = []

    def watched(gm, plan, group_name, *, observe=None, **kwargs):
        values: dict = {}

        def both(node, value):
            values[node] = value
            observe(node, value)

        sharder = Sharder(gm, plan, group_name, observe=both, **kwargs)
        made.append((sharder, values))
        return sharder

    monkeypatch.setattr(simulate, "Sharder", watched)
    torch.manual_seed(0)
    vocab, world = 10, 2
    x, target = torch.randn(2, 5, 8), torch.randint(0, vocab, (2, 5))
    dynashard.explain(_LossHead(8, vocab), x, target, world_size=world,
                      options={"min_shard_numel": 0, "plan": {"up": "colwise", "head": "colwise"}}, verify=True)
    assert len(made) == world, f"expected one simulated interpreter per rank, found {len(made)}"
    for rank, (sharder, values) in enumerate(made):
        assert not Sharder.FOR_LOWERINGS - set(dir(sharder)), Sharder.FOR_LOWERINGS - set(dir(sharder))
        lsms = [n for n in values if isinstance(sharder.lm.records[n].lowering, lowerings.LogSumExp)]
        assert len(lsms) == 1, f"rank {rank}: expected one loss-parallel log_softmax, found {lsms}"
        value = values[lsms[0]]
        assert isinstance(value, lowerings.LocalLogSumExp), f"rank {rank}: the log_softmax's value is {value!r}"
        assert value.logits.shape == (10, vocab // world), value.logits.shape  # this rank's slice, never gathered
        torch.testing.assert_close(value.lse, torch.logsumexp(value.logits, -1, keepdim=True), rtol=0, atol=0)
