"""The error catalogue's faults: each raises on every surviving rank, at compile time, no hang.

Each test runs on every rank and asserts there (tests/scenarios.py). Faults the group survives
share one spawn per world; a rank that dies takes its scenario's spawn with it, so each of those
runs alone, its gloo timeout short enough that a dead rank surfaces within about that long.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import dynashard
from dynashard.load import parallelize as parameters
from tests import models
from tests.battery import lose_rank1
from tests.scenarios import Scenarios, raised

pytestmark = pytest.mark.gloo

GLOO_TIMEOUT = 15  # seconds: a dead rank must surface as an error within about this long
# Each fault spawn takes 3-9 s on the quiet 2-core machine (two wait out GLOO_TIMEOUT); the deadline
# covers a 3x slower, busy machine with a 2x margin and stays under pytest-timeout's 300 s.
FAULT_DEADLINE_S = 180
# The shared spawns: the faults the group survives at world 2 (3 s quiet), the special cases at
# world 4 (7 s quiet); their gloo timeout is torch's 60 s.
SCENARIOS_DEADLINE_S = 240
on_ranks = Scenarios(__name__, worlds=(2, 4), deadline_s=SCENARIOS_DEADLINE_S)

EAGER = {"compiler": "eager", "min_shard_numel": 0}
X = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))


def _compile_mlp(**options):
    return torch.compile(models.MLP(32, 96), backend="dynashard", options={**EAGER, **options})


@on_ranks(worlds=(2,))
@torch.no_grad()
def test_a_rank_failing_to_plan_fails_every_rank_naming_it(rank, world):
    plan = {"upp": "colwise"} if rank == 1 else {"up": "colwise", "down": "rowwise"}
    msg = str(raised(lambda: _compile_mlp(plan=plan)(X)))
    if rank == 1:
        assert "plan key 'upp' matches no linear" in msg, msg
    else:
        assert "rank 1 failed during planning" in msg and "plan key 'upp'" in msg, msg


@on_ranks(worlds=(2,))
@torch.no_grad()
def test_ranks_with_different_plans_are_told_so(rank, world):
    plan = {"up": "colwise", "down": "rowwise"} if rank == 0 else {"up": "colwise"}  # each valid, not the same
    msg = str(raised(lambda: _compile_mlp(plan=plan)(X)))
    assert "ranks compiled different graphs or plans" in msg, msg


@on_ranks(worlds=(2,))
@torch.no_grad()
def test_meta_device_model_is_refused_on_every_rank(rank, world):
    with torch.device("meta"):
        meta_model = models.MLP(32, 96)
    msg = str(raised(lambda: torch.compile(meta_model, backend="dynashard", options=EAGER)(X.to("meta"))))
    assert "is on the meta device" in msg and "to_empty" in msg, msg


@on_ranks(worlds=(2,))
def test_an_unexpected_error_at_an_agreement_point_reaches_every_rank_at_once(rank, world):
    """Every agreement point (protocol.agreed) wraps what its work raises and shares it: the failing rank
    raises an InternalError naming the stage, the other a PeerError naming it, neither waiting out the
    group's timeout (before, rank 1 raised the bare KeyError and rank 0 waited in the exchange for it).
    Rank 1's argument check raises a KeyError: a stand-in for any bug in the work before an agreement
    point, not a UsageError the check meant to raise."""
    check = parameters._check_parallelizable

    def broken(*_args):
        raise KeyError("a bug")

    if rank == 1:
        parameters._check_parallelizable = broken
    try:
        start = time.monotonic()
        error = raised(lambda: dynashard.parallelize(models.MLP(32, 96), torch.randn(4, 32),
                                                     options={"compiler": "eager"}))
        seconds = time.monotonic() - start
    finally:
        parameters._check_parallelizable = check
    msg = str(error)
    if rank == 1:
        assert type(error).__name__ == "InternalError", repr(error)
        assert "internal error while checking parallelize's arguments: KeyError" in msg, msg
    else:
        assert type(error).__name__ == "PeerError", repr(error)
        assert "rank 1 failed during checking parallelize's arguments: InternalError" in msg, msg
    assert seconds < GLOO_TIMEOUT, seconds  # (this spawn's gloo timeout is 60 s: waiting it out fails here)


def _against_unsharded(cls, **options) -> tuple[float, bool, list[str]]:
    """``cls()`` compiled with dynashard against itself unsharded: the largest difference, whether the
    dtypes agree, and the parameters whose full-size storage was freed (what the plan sharded)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
        got = torch.compile(model, backend="dynashard", options={**EAGER, **options})(x)
    freed = sorted(n for n, p in model.named_parameters() if p.untyped_storage().nbytes() == 0)
    return float((got.float() - ref.float()).abs().max()), got.dtype == ref.dtype, freed


# float32 (and bfloat16 for MixedDtypes's second pair): see test_numerics.TOLERANCE.
@on_ranks(worlds=(4,))
def test_linear_called_twice(rank, world):
    for plan in ({}, {"plan": {"up": "colwise", "down": "rowwise"}}):
        err, _, freed = _against_unsharded(models.CalledTwice, **plan)
        # Both calls of each layer split its weight the same way: sharded once, used twice.
        assert err <= 1e-5, (plan, err)
        # (up's bias too: held cut like up's output, by both calls)
        assert freed == ["down.weight", "up.bias", "up.weight"], (plan, freed)


@on_ranks(worlds=(4,))
def test_mixed_dtypes(rank, world):
    err, same_dtype, freed = _against_unsharded(models.MixedDtypes)
    assert same_dtype and err <= 5e-2, (same_dtype, err)
    assert len(freed) == 6, freed  # 2 pairs' weights, and each up's bias (held cut)


@on_ranks(worlds=(4,))
def test_sub_group_leaves_other_ranks_untouched(rank, world):
    err, _, freed = _against_unsharded(models.MLP, group=dist.new_group([0, 1]))
    assert err <= 1e-5, err
    assert freed == (["down.weight", "up.bias", "up.weight"] if rank < 2 else []), freed


@on_ranks.alone(2, dies=(1,), gloo_timeout=GLOO_TIMEOUT, deadline_s=FAULT_DEADLINE_S)
def test_a_rank_dying_before_compile_is_a_timeout_error_not_a_hang(rank, world):
    error, seconds = lose_rank1(rank, "before_compile")
    msg = str(error)
    assert "not every rank reached the planning step" in msg and "ranks [1] did not get there" in msg, msg
    assert seconds < 3 * GLOO_TIMEOUT, seconds


@on_ranks.alone(2, dies=(1,), gloo_timeout=GLOO_TIMEOUT, deadline_s=FAULT_DEADLINE_S)
def test_a_rank_dying_after_compile_fails_the_next_call(rank, world):
    error, seconds = lose_rank1(rank, "after_compile")
    assert "ranks [1] did not get there" in str(error), str(error)
    assert seconds < 3 * GLOO_TIMEOUT, seconds


@on_ranks.alone(4, dies=(1, 3), gloo_timeout=GLOO_TIMEOUT, deadline_s=FAULT_DEADLINE_S, cases=["train", "io"])
def test_a_peer_dying_later_is_a_peer_error_naming_the_rank_and_the_stage(rank, world, case, tmp_path):
    """In the backward (AOTAutograd's compiled backward, whose all_reduce meets a dead rank), in
    clip_grad_norm_, in export_safetensors and in rank 0's deal of weights="rank0". Two pairs of ranks,
    each its own group: in each pair the second rank dies at one stage, and the first must get a
    PeerError naming the rank and the stage (not a raw gloo error, not a hang)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, me = pairs[rank // 2], rank % 2
    stage = {"train": ("backward", "clip"), "io": ("export", "deal")}[case][rank // 2]
    options = {"min_shard_numel": 0, "compiler": "aot_eager", "group": group}
    x = X.clone().requires_grad_(stage == "backward")  # (then the colwise input's gradient is all-reduced)

    def until_the_peer_dies():
        if stage == "deal":  # rank 0 of the pair deals its model's pieces; the other dies as they arrive
            if me == 1:
                dist.recv = lambda *args, **kwargs: os._exit(3)
            dynashard.parallelize(models.MLP(32, 96), x, options={**options, "weights": "rank0"})
            return
        model = dynashard.parallelize(models.MLP(32, 96), x, options=options)
        loss = torch.compile(model, backend=dynashard.backend(**options))(x).pow(2).sum()
        dist.barrier(group)
        if me == 1:
            os._exit(3)
        if stage == "backward":
            loss.backward()
        elif stage == "clip":
            loss.backward()  # (no collective: the input needs no gradient)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            dynashard.export_safetensors(model, str(tmp_path / f"rank{rank}.safetensors"), group=group)

    start = time.monotonic()
    error = raised(until_the_peer_dies)
    msg, seconds = str(error), time.monotonic() - start
    expected = {"backward": "the backward of the sharded program", "clip": "clip_grad_norm_",
                "export": "export_safetensors", "deal": "rank 0's deal"}[stage]
    # (a send to a dead rank may return before it fails: the deal's loss is then met at the next agreement)
    stage_named = expected in msg or stage == "deal" and "loading the shards" in msg
    assert type(error).__name__ == "PeerError" and stage_named and "did not get there" in msg, (stage, msg)
    assert f"ranks [{rank + 1}]" in msg or "ranks [1]" in msg, msg
    assert seconds < 3 * GLOO_TIMEOUT, seconds
