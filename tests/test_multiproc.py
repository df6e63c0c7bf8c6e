"""The test harness's own promises: a spawn shared by many tests runs once, even when it fails; a
scenario run on ranks in a shared spawn is reported by its own test, with its ranks' errors, once
per case; a scenario run alone passes when the ranks meant to die die and the others pass."""

from __future__ import annotations

import gc
import os
import types

import pytest
import torch
import torch.distributed as dist

from tests import gc_policy
from tests.multiproc import SharedRunFailed, shared_run
from tests.scenarios import ScenarioFailed, Scenarios


@pytest.mark.unit
def test_a_failed_shared_run_fails_every_reader_at_once_and_never_runs_again():
    calls = []

    @shared_run
    def battery(world):
        calls.append(world)
        raise TimeoutError(f"ranks [3] did not finish within 420s (world {world})")

    with pytest.raises(TimeoutError):
        battery(4)
    for _ in range(3):
        with pytest.raises(SharedRunFailed, match=r"battery\(4,\) failed .* TimeoutError: ranks \[3\]"):
            battery(4)
    assert calls == [4]


@pytest.mark.unit
def test_a_shared_run_stopped_by_pytest_timeout_is_remembered():
    calls = []

    @shared_run
    def battery(world):
        calls.append(world)
        pytest.fail("Timeout >480.0s")  # what pytest-timeout raises inside the running test

    with pytest.raises(pytest.fail.Exception):
        battery(2)
    with pytest.raises(SharedRunFailed, match="Failed: Timeout"):
        battery(2)
    assert calls == [2]


@pytest.mark.unit
def test_a_shared_run_result_is_computed_once_per_key():
    calls = []

    @shared_run
    def battery(world):
        calls.append(world)
        return [world] * world

    assert battery(2) == [2, 2] and battery(2) == [2, 2] and battery(4) == [4] * 4
    assert calls == [2, 4]


# Scenarios of the harness's own test: not named test_*, so pytest runs them only through the test below.
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=120)


@on_ranks
def scenario_passes(rank, world):
    assert world == 2 and rank in (0, 1)


@on_ranks
@torch.no_grad()
def scenario_fails_on_rank_1(rank, world):
    torch.manual_seed(5)  # (the next scenario starts from seed 0 again)
    assert rank != 1, f"rank {rank} saw something else"


@on_ranks
def scenario_raises_on_every_rank(rank, world):
    raise RuntimeError(f"the model's own error on rank {rank}")


COMPILES: list[int] = []


def _add_one(x):
    return x + 1


def _counting(gm, example_inputs):
    COMPILES.append(1)
    return gm


@on_ranks
def scenario_starts_afresh_and_shares_a_directory(rank, world, tmp_path):
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0))), "not seeded 0"
    torch.compile(_add_one, backend=_counting)(torch.ones(2))
    assert len(COMPILES) == 1, COMPILES
    if rank == 0:
        (tmp_path / "from_rank0").write_text("written")
    dist.barrier()
    assert (tmp_path / "from_rank0").read_text() == "written", "ranks do not share tmp_path"
    assert tmp_path.name == "scenario_starts_afresh_and_shares_a_directory", tmp_path


@on_ranks
def scenario_compiles_again_after_a_reset(rank, world):
    torch.compile(_add_one, backend=_counting)(torch.ones(2))  # Dynamo's cache was reset: compiled again
    assert len(COMPILES) == 2, COMPILES


@on_ranks
def scenario_starts_with_the_tests_collector_settings(rank, world):
    # (forked from the server after tests/forkserver_ready.py: its imports frozen, tests/gc_policy.py's thresholds)
    assert gc.get_threshold() == gc_policy.THRESHOLDS and gc.get_freeze_count() > 100_000, \
        (gc.get_threshold(), gc.get_freeze_count())


@on_ranks(cases=["a", ("b", 2)])
def scenario_of_each_case(rank, world, case):
    assert case in ("a", ("b", 2)), case
    assert case == "a" or rank == 0, f"case {case} on rank {rank}"


@on_ranks.alone(2, dies=(1,), gloo_timeout=10, deadline_s=60, cases=["dies", "lives"])
def scenario_alone_where_rank_1_is_to_die(rank, world, case):
    dist.barrier()
    if rank == 1 and case == "dies":
        os._exit(3)


@pytest.mark.gloo
@pytest.mark.timeout(180)
def test_each_scenario_reports_its_own_outcome_on_every_rank():
    """One spawn runs every scenario of a module; each test reads its own: a failure names its rank(s),
    message and the line of the scenario that raised, and does not hide the scenarios after it."""
    scenario_passes()
    with pytest.raises(ScenarioFailed) as failed:
        scenario_fails_on_rank_1()
    text = str(failed.value)
    assert text.startswith("scenario_fails_on_rank_1 failed on rank(s) [1] of 2\n"), text
    assert text.endswith("AssertionError: rank 1 saw something else") and "rank 0" not in text, text
    # the traceback from the scenario's own frame (not the runner's, nor its decorators'), with its line
    assert text.split("\n")[2].endswith(", in scenario_fails_on_rank_1") and "_run_on_rank" not in text, text
    assert 'assert rank != 1, f"rank {rank} saw something else"' in text, text
    with pytest.raises(ScenarioFailed) as failed:
        scenario_raises_on_every_rank()
    text = str(failed.value)
    assert "\nrank 0: Traceback" in text and "RuntimeError: the model's own error on rank 0\n" in text, text
    assert text.endswith("\nrank 1, at the same line: RuntimeError: the model's own error on rank 1"), text
    scenario_starts_afresh_and_shares_a_directory()
    scenario_compiles_again_after_a_reset()
    scenario_starts_with_the_tests_collector_settings()
    scenario_of_each_case(world=2, case="a")
    with pytest.raises(ScenarioFailed) as failed:
        scenario_of_each_case(world=2, case="b-2")
    text = str(failed.value)
    assert text.startswith("scenario_of_each_case[b-2] failed on rank(s) [1] of 2\n"), text
    assert text.endswith("AssertionError: case ('b', 2) on rank 1"), text


@pytest.mark.gloo
@pytest.mark.timeout(180)
def test_a_scenario_run_alone_passes_only_if_the_ranks_meant_to_die_die():
    scenario_alone_where_rank_1_is_to_die(world=2, case="dies")
    with pytest.raises(ScenarioFailed) as failed:
        scenario_alone_where_rank_1_is_to_die(world=2, case="lives")
    text = str(failed.value)
    assert text == ("scenario_alone_where_rank_1_is_to_die[lives] failed on rank(s) [1] of 2\n"
                    "rank 1: the rank was to die, but finished its scenario"), text


@pytest.mark.unit
def test_a_scenario_test_is_one_pytest_test_per_world_with_the_spawns_deadline():
    scenarios = Scenarios("tests.not_spawned", worlds=(2, 4), deadline_s=100)

    @scenarios
    def test_something(rank, world):
        pass

    marks = {m.name: m for m in test_something.pytestmark}
    assert marks["parametrize"].args == ("world", (2, 4)) and marks["parametrize"].kwargs["ids"] == ["world2", "world4"]
    assert marks["timeout"].args == (160,) and test_something.__name__ == "test_something"
    with pytest.raises(TypeError, match=r"takes \['path'\]"):
        scenarios(lambda rank, path: None)

    @scenarios(worlds=(4,))
    def test_at_four(rank, world):
        pass

    @scenarios(cases={2: ["x"], 4: ["x", ("y", 1)]})
    def test_cases(rank, world, case):
        pass

    marks = {m.name: m for m in test_at_four.pytestmark}
    assert set(marks) == {"timeout"}, marks  # one world: one test
    marks = {m.name: m for m in test_cases.pytestmark}
    assert marks["parametrize"].args[0] == ("world", "case"), marks
    assert [(p.values, p.id) for p in marks["parametrize"].args[1]] == [
        ((2, "x"), "world2-x"), ((4, "x"), "world4-x"), ((4, "y-1"), "world4-y-1")]
    assert scenarios.runs["test_cases[x]"].worlds == (2, 4) and scenarios.runs["test_cases[y-1]"].case == ("y", 1)
    with pytest.raises(ValueError, match=r"runs at worlds \[8\]; tests.not_spawned spawns \[2, 4\]"):
        scenarios(worlds=(8,))(lambda rank: None)
    with pytest.raises(TypeError, match="has cases but takes no case"):
        scenarios(cases=["x"])(lambda rank: None)


@pytest.mark.unit
def test_a_spawn_runs_only_the_scenarios_pytest_selected(tmp_path):
    """``pytest -k`` of one scenario runs that one on the ranks, not its whole file (tests/conftest.py hands
    pytest's selection to ``select``; tools/compat.sh's smoke picks one HF generate and one training step so)."""
    from tests.scenarios import _BY_MODULE, _run_on_rank, select

    item = types.SimpleNamespace(function=scenario_of_each_case, callspec=types.SimpleNamespace(params={"case": "a"}))
    plain = types.SimpleNamespace(function=test_a_spawn_runs_only_the_scenarios_pytest_selected)  # (no scenario)
    select([item, types.SimpleNamespace(function=scenario_passes), plain])
    try:
        assert _BY_MODULE[__name__].selected == {"scenario_of_each_case[a]", "scenario_passes"}
        # (in this process, as rank 0 of 2: the two selected scenarios need no process group)
        outcomes = _run_on_rank(0, 2, __name__, str(tmp_path), _BY_MODULE[__name__].selected)
        assert outcomes == {"scenario_passes": None, "scenario_of_each_case[a]": None}, outcomes
    finally:
        _BY_MODULE[__name__].selected = None
