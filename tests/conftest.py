"""Under pytest-xdist (setup.cfg's ``-n 2``) each worker computes on one intra-op thread: two workers on
two cores, plus the ranks a gloo test spawns (one thread each, tests/multiproc.py), would otherwise
oversubscribe the cores with OpenMP threads that spin while they wait."""

import os
from collections import Counter

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# dynashard's compile cache off in the test processes: every unit test traces and plans its graphs, whatever ran
# before it; tests/test_compile_cache.py turns it on in a directory of its own. Spawned gloo ranks turn it on, as
# a user's processes have it, in a directory per spawn (tests/multiproc.py).
os.environ["DYNASHARD_CACHE"] = "0"


@pytest.hookimpl(trylast=True)  # (after -m and -k have deselected: the files' counts are of what runs)
def pytest_collection_modifyitems(config, items):
    """A ``-m`` expression that does not name ``slow`` leaves the slow tier out, as the default run does:
    ``pytest -m unit`` replaces ``addopts``' ``-m "not slow"``, and would otherwise run the slow tier's
    unit tests too (duplicates and the fuzz's full counts: about 4x the time). ``-m slow`` or
    ``-m "unit or slow"`` keep it."""
    if "slow" not in (config.getoption("markexpr") or ""):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    _longest_files_first(items)


# The default run's longest files, longest first (their summed --durations on the 2-core machine, 2026-12-07,
# quiet: 154 s for test_lora.py, 108-116 s for the next three, 41-83 s for the rest). Under `--dist loadfile`
# each worker takes the next file when it finishes one; xdist's own order (most tests first) handed out
# test_gpu_check.py (2 tests, 50 s) among the last files and test_training_2d.py (8 tests, 88 s) late: one
# worker could run on alone at the end. Longest first, the many short files fill the gaps at the end
# (setup.cfg: --no-loadscope-reorder keeps this order). A file missing here only runs later: nothing is left out.
LONGEST_FIRST = ("test_lora.py", "test_serving.py", "test_training.py", "test_numerics.py", "test_quantized.py",
                 "test_parallelize.py", "test_training_2d.py", "test_gpu_check.py", "test_compile_cache.py",
                 "test_regional.py", "test_experts.py", "test_forms_linears.py", "test_hf_models.py")


def _longest_files_first(items) -> None:
    """The files of ``LONGEST_FIRST`` in its order, then the others, most tests first (xdist's own order);
    each file's tests keep their order."""
    counts = Counter(item.path.name for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], item.path.name))


def pytest_collection_finish(session):
    """A spawn of ``@on_ranks`` scenarios runs the selected ones only (``-k``: tests/scenarios.py). The test
    modules are imported now: the collector's settings for the tests (tests/gc_policy.py), and Dynamo's trace-rule
    maps kept across the fake groups they make (tests/dynamo_rules.py)."""
    from tests import dynamo_rules, gc_policy
    from tests.scenarios import select

    select(session.items)
    dynamo_rules.apply()
    gc_policy.apply()


@pytest.fixture
def fake_group():
    """A fake process group of 2 ranks (this process rank 0) with Dynamo reset around the test: one
    rank's compile of a sharded program, no spawned ranks."""
    import torch.distributed as dist

    from dynashard import _torch as private

    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


class PlanCounter:
    """Counts the backend's traced plans (``dynamo_backend._plan``: the aten trace and the plan)."""

    def __init__(self, monkeypatch) -> None:
        from dynashard import dynamo_backend

        self.count = 0
        plan = dynamo_backend._plan

        def counted(*args, **kwargs):
            self.count += 1
            return plan(*args, **kwargs)

        monkeypatch.setattr(dynamo_backend, "_plan", counted)


@pytest.fixture
def plans(monkeypatch) -> PlanCounter:
    """The number of plans the backend traced during the test (``plans.count``)."""
    return PlanCounter(monkeypatch)
