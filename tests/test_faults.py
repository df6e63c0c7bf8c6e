"""The error catalogue's faults: each raises on every surviving rank, at compile time, no hang."""

from __future__ import annotations

import pytest

from tests.battery import faults, special_cases
from tests.multiproc import RankError, run_ranks, run_ranks_outcomes

pytestmark = pytest.mark.gloo

GLOO_TIMEOUT = 15  # seconds: a dead rank must surface as an error within about this long
# Each fault spawn takes 3-9 s on the quiet 2-core machine (two wait out GLOO_TIMEOUT); the deadline
# covers a 3x slower, busy machine with a 2x margin and stays under pytest-timeout's 300 s.
FAULT_DEADLINE_S = 180
SPECIAL_DEADLINE_S = 240  # one 4-rank spawn, 7 s quiet


def _outcome(which: str, world: int = 2) -> list:
    return run_ranks_outcomes(faults, world, which, timeout=FAULT_DEADLINE_S, gloo_timeout=GLOO_TIMEOUT)


def test_a_rank_failing_to_plan_fails_every_rank_naming_it():
    rank0, rank1 = _outcome("rank1_plan_typo")
    assert "plan key 'upp' matches no linear" in rank1["error"][1]
    kind, msg = rank0["error"]
    assert "rank 1 failed during planning" in msg and "plan key 'upp'" in msg, msg


def test_ranks_with_different_plans_are_told_so():
    for r in _outcome("rank_dependent_plan"):
        kind, msg = r["error"]
        assert "ranks compiled different graphs or plans" in msg, msg


def test_a_rank_dying_before_compile_is_a_timeout_error_not_a_hang():
    rank0, rank1 = _outcome("rank1_dies_before_compile")
    assert isinstance(rank1, RankError) and rank1.exc_type == "Died"
    kind, msg = rank0["error"]
    assert "not every rank reached the planning step" in msg and "ranks [1] did not get there" in msg, msg
    assert rank0["seconds"] < 3 * GLOO_TIMEOUT


def test_a_rank_dying_after_compile_fails_the_next_call():
    rank0, rank1 = _outcome("rank1_dies_after_compile")
    assert isinstance(rank1, RankError) and rank1.exc_type == "Died"
    assert rank0["error"] is not None, "rank 0 ran a collective against a dead rank without an error"
    assert "ranks [1] did not get there" in rank0["error"][1], rank0["error"]
    assert rank0["seconds"] < 3 * GLOO_TIMEOUT


def test_meta_device_model_is_refused_on_every_rank():
    for r in _outcome("meta"):
        kind, msg = r["error"]
        assert "is on the meta device" in msg and "to_empty" in msg, msg


@pytest.fixture(scope="module")
def special():
    return run_ranks(special_cases, 4, timeout=SPECIAL_DEADLINE_S)


# float32 (and bfloat16 for MixedDtypes's second pair): see test_numerics.TOLERANCE.
def test_linear_called_twice(special):
    for r in special:
        # Both calls of each layer split its weight the same way: sharded once, used twice.
        assert r["called_twice_auto"]["err"] <= 1e-5
        # (up's bias too: held cut like up's output, by both calls)
        assert r["called_twice_auto"]["freed"] == ["down.weight", "up.bias", "up.weight"]
        assert r["called_twice_plan"]["err"] <= 1e-5
        assert r["called_twice_plan"]["freed"] == ["down.weight", "up.bias", "up.weight"]


def test_mixed_dtypes(special):
    for r in special:
        assert r["mixed_dtypes"]["dtype_ok"] and r["mixed_dtypes"]["err"] <= 5e-2
        assert len(r["mixed_dtypes"]["freed"]) == 6  # 2 pairs' weights, and each up's bias (held cut)


def test_sub_group_leaves_other_ranks_untouched(special):
    for rank, r in enumerate(special):
        assert r["sub_group"]["err"] <= 1e-5
        assert r["sub_group"]["freed"] == (["down.weight", "up.bias", "up.weight"] if rank < 2 else [])


def _dies_later(rank: int, world: int, which: str) -> dict:
    """Two pairs of ranks, each its own group: in each pair the second rank dies at one stage, and the
    first must get a PeerError naming the rank and the stage (not a raw gloo error, not a hang)."""
    import os
    import time

    import torch
    import torch.distributed as dist

    import dynashard
    from dynashard.errors import DynashardError
    from tests import models

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, me = pairs[rank // 2], rank % 2
    stage = {"train": ("backward", "clip"), "io": ("export", "deal")}[which][rank // 2]
    options = {"min_shard_numel": 0, "compiler": "aot_eager", "group": group}
    torch.manual_seed(0)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(stage == "backward")  # (then the colwise input's gradient is all-reduced in the backward)
    start = time.monotonic()
    try:
        if stage == "deal":  # rank 0 of the pair deals its model's pieces; the other dies as they arrive
            options["weights"] = "rank0"
            if me == 1:
                dist.recv = lambda *args, **kwargs: os._exit(3)
            dynashard.parallelize(models.MLP(32, 96), x, options=options)
        else:
            model = dynashard.parallelize(models.MLP(32, 96), x, options=options)
            fast = torch.compile(model, backend=dynashard.backend(**options))
            loss = fast(x).pow(2).sum()
            dist.barrier(group)
            if me == 1:
                os._exit(3)
            if stage == "backward":
                loss.backward()
            elif stage == "clip":
                loss.backward()  # (no collective: the input needs no gradient)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                dynashard.export_safetensors(model, f"/tmp/dynashard-fault-{os.getpid()}.safetensors", group=group)
        return {"stage": stage, "error": None}
    except DynashardError as e:
        return {"stage": stage, "error": (type(e).__name__, str(e)), "seconds": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 - a raw error is what this test refuses
        return {"stage": stage, "error": (type(e).__name__, str(e)), "seconds": time.monotonic() - start}


@pytest.mark.parametrize("which", ["train", "io"])
def test_a_peer_dying_later_is_a_peer_error_naming_the_rank_and_the_stage(which):
    """In the backward (AOTAutograd's compiled backward, whose all_reduce meets a dead rank), in
    clip_grad_norm_, in export_safetensors and in rank 0's deal of weights="rank0"."""
    outcomes = run_ranks_outcomes(_dies_later, 4, which, timeout=FAULT_DEADLINE_S, gloo_timeout=GLOO_TIMEOUT)
    expected = {"backward": "the backward of the sharded program", "clip": "clip_grad_norm_",
                "export": "export_safetensors", "deal": "rank 0's deal"}
    for rank in (0, 2):
        r = outcomes[rank]
        assert not isinstance(r, RankError), r
        kind, msg = r["error"]
        # (a send to a dead rank may return before it fails: the deal's loss is then met at the next agreement)
        stage_named = expected[r["stage"]] in msg or r["stage"] == "deal" and "loading the shards" in msg
        assert kind == "PeerError" and stage_named and "did not get there" in msg, (rank, r)
        assert f"ranks [{rank + 1}]" in msg or "ranks [1]" in msg, (rank, msg)
        assert r["seconds"] < 3 * GLOO_TIMEOUT, r
    for rank in (1, 3):
        assert isinstance(outcomes[rank], RankError) and outcomes[rank].exc_type == "Died", outcomes[rank]


def _argument_check_bug(rank: int, world: int) -> dict:
    """parallelize on 2 ranks, rank 1's argument check raising a KeyError (a stand-in for any bug in the
    work before an agreement point, not a UsageError the check meant to raise)."""
    import time

    import torch

    import dynashard
    from dynashard import parameters
    from tests import models

    if rank == 1:
        def broken(*_args):
            raise KeyError("a bug")
        parameters._check_parallelizable = broken
    start = time.monotonic()
    try:
        dynashard.parallelize(models.MLP(32, 96), torch.randn(4, 32), options={"compiler": "eager"})
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - a raw error on one rank is what this test refuses
        return {"error": (type(e).__name__, str(e)), "seconds": time.monotonic() - start}


def test_an_unexpected_error_at_an_agreement_point_reaches_every_rank_at_once():
    """Every agreement point (protocol.agreed) wraps what its work raises and shares it: the failing rank
    raises an InternalError naming the stage, the other a PeerError naming it, neither waiting out the
    group's timeout (before, rank 1 raised the bare KeyError and rank 0 waited in the exchange for it)."""
    rank0, rank1 = run_ranks_outcomes(_argument_check_bug, 2, timeout=FAULT_DEADLINE_S, gloo_timeout=GLOO_TIMEOUT)
    assert rank1["error"][0] == "InternalError", rank1
    assert "internal error while checking parallelize's arguments: KeyError" in rank1["error"][1], rank1
    kind, msg = rank0["error"]
    assert kind == "PeerError" and "rank 1 failed during checking parallelize's arguments: InternalError" in msg, msg
    assert rank0["seconds"] < GLOO_TIMEOUT and rank1["seconds"] < GLOO_TIMEOUT, (rank0, rank1)
