"""The per-call handshake is finished inside the graph, just before its first collective
(``dynashard/runtime/gate.py``).

Unit: where ``gate.insert`` puts the gate (and where it refuses to). Gloo, 2 ranks, under Inductor: the
handshake is finished by the gate, inside the compiled graph, after the computation before the first
collective; ranks whose later call has other shapes (one dynamic graph: guards pass on both) or other
token ids raise the handshake's error on every rank from inside the graph, and the next call is right.
"""

from __future__ import annotations

import inspect
import operator

import pytest
import torch

from dynashard.comm.protocol import Handshake
from dynashard.runtime import gate
from tests import models
from tests.scenarios import Scenarios, raised
from tests.test_graphs import rewritten

DEADLINE_S = 240  # an Inductor compile per rank (two graphs), 10-30 s on the quiet 2-core machine; 3x slower, 2x margin
ATOL = 1e-5  # float32 sums over 2 ranks in another order than the unsharded matmul: ~1e-7 here
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=DEADLINE_S)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _order(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.unit
def test_the_gate_feeds_the_first_collective_after_the_computation_before_it():
    torch.manual_seed(0)
    gm = rewritten(models.MLP(32, 96), torch.randn(2, 3, 32))
    before = _order(gm)
    slot = gate.insert(gm)
    assert slot is not None
    after = _order(gm)
    first = next(i for i, t in enumerate(before) if "all_reduce" in t)
    # the gate and the add come right before the collective, after both matmuls; nothing else moved
    assert after[:first] == before[:first] and after[first + 2:] == before[first:], after
    assert after[first] == "dynashard.call_gate.default" and after[first + 1] == "aten.add.Tensor", after
    nodes = {n.name: n for n in gm.graph.nodes}
    (reduce,) = [n for n in gm.graph.nodes if "all_reduce" in str(n.target)]
    add = reduce.args[0]
    assert add.target is torch.ops.aten.add.Tensor and add.args[1].target is torch.ops.dynashard.call_gate.default
    assert add.args[0] is add.args[1].args[0] and add.args[0].target is torch.ops.aten.mm.default, nodes
    assert add.args[1].args[1] == slot


@pytest.mark.unit
def test_a_collective_that_does_not_follow_the_first_gets_a_gate_of_its_own():
    g = torch.fx.Graph()
    k, v = g.placeholder("k"), g.placeholder("v")
    gathers = []
    for x in (k, v):  # two independent all_gathers (k and v): a compiler may issue either first
        gather = g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
        gathers.append(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (gather,)))
    total = g.call_function(torch.ops.aten.add.Tensor, tuple(gathers))
    reduce = g.call_function(torch.ops._c10d_functional.all_reduce.default, (total, "sum", "0"))
    g.output(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduce,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    slot = gate.insert(gm)
    gates = [n for n in gm.graph.nodes if n.target is torch.ops.dynashard.call_gate.default]
    assert [n.args[1] for n in gates] == [slot, slot], gm.code  # one per gather; the all_reduce follows them
    for n in gm.graph.nodes:
        if "all_gather" in str(n.target):
            assert n.args[0].target is torch.ops.aten.add.Tensor and n.args[0].args[1] in gates, gm.code


@pytest.mark.unit
def test_graphs_that_write_their_inputs_or_have_no_collective_are_not_gated():
    g = torch.fx.Graph()
    cache, index, value = g.placeholder("cache"), g.placeholder("index"), g.placeholder("value")
    view = g.call_function(torch.ops.aten.view.default, (cache, [-1, 4]))
    g.call_function(torch.ops.aten.index_copy_.default, (view, 0, index, value))
    reduce = g.call_function(torch.ops._c10d_functional.all_reduce.default, (value, "sum", "0"))
    g.output(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduce,)))
    writes = torch.fx.GraphModule(torch.nn.Module(), g)
    assert gate.insert(writes) is None  # (the cache write, through a view, would come before the wait)
    assert _order(writes).count("dynashard.call_gate.default") == 0

    g = torch.fx.Graph()  # a write into one of a split's views of an input
    buffer, value = g.placeholder("buffer"), g.placeholder("value")
    part = g.call_function(operator.getitem, (g.call_function(torch.ops.aten.split.Tensor, (buffer, 2)), 0))
    g.call_function(torch.ops.aten.copy_.default, (part, value))
    reduce = g.call_function(torch.ops._c10d_functional.all_reduce.default, (value, "sum", "0"))
    g.output(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduce,)))
    assert gate.insert(torch.fx.GraphModule(torch.nn.Module(), g)) is None

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
    assert gate.insert(torch.fx.GraphModule(torch.nn.Module(), g)) is None


class _TokenMLP(torch.nn.Module):
    """Token ids in: a vocab-parallel embedding (its all_reduce is the first collective), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.mlp = models.MLP(32, 96)

    def forward(self, ids):
        return self.mlp(self.embed(ids))


@pytest.mark.gloo
@on_ranks
@torch.no_grad()
def test_the_handshake_is_finished_inside_the_graph_and_still_catches_ranks_that_differ(rank, world):
    finished_in = []
    finish = Handshake._finish

    def recording(self):
        finished_in.append("call_gate" in [f.function for f in inspect.stack()])
        return finish(self)

    Handshake._finish = recording
    try:
        model = _TokenMLP()
        reference = _TokenMLP()
        reference.load_state_dict(model.state_dict())
        fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0})
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        longer = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
        err = _err(fast(ids), reference(ids))  # compiles (a static graph)
        assert err <= ATOL, err
        err = _err(fast(longer), reference(longer))  # compiles the dynamic graph
        assert err <= ATOL, err
        finished_in.clear()
        err = _err(fast(longer), reference(longer))
        assert err <= ATOL, err
        # one handshake per call, finished by the gate inside the compiled graph (not before the call)
        assert finished_in == [True], finished_in
        other = torch.randint(0, 64, (2, 10 + rank), generator=torch.Generator().manual_seed(3))
        error = raised(lambda: fast(other))
        assert type(error).__name__ == "UsageError" and "found different shapes or dtypes" in str(error), error
        assert "rank 0: int64[2, 10]; rank 1: int64[2, 11]" in str(error), error
        ids_other = longer.clone()
        ids_other[0, 0] = (ids_other[0, 0] + rank) % 64
        error = raised(lambda: fast(ids_other))
        assert type(error).__name__ == "UsageError" and "values differ" in str(error), error
        err = _err(fast(longer), reference(longer))
        assert err <= ATOL, err  # the next call is right
    finally:
        Handshake._finish = finish
