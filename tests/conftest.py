"""Under pytest-xdist (setup.cfg's ``-n 2``) each worker computes on one intra-op thread: two workers on
two cores, plus the ranks a gloo test spawns (one thread each, tests/multiproc.py), would otherwise
oversubscribe the cores with OpenMP threads that spin while they wait."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """A ``-m`` expression that does not name ``slow`` leaves the slow tier out, as the default run does:
    ``pytest -m unit`` replaces ``addopts``' ``-m "not slow"``, and would otherwise run the slow tier's
    unit tests too (duplicates and the fuzz's full counts: about 4x the time). ``-m slow`` or
    ``-m "unit or slow"`` keep it."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


def pytest_collection_finish(session):
    """A spawn of ``@on_ranks`` scenarios runs the selected ones only (``-k``: tests/scenarios.py)."""
    from tests.scenarios import select

    select(session.items)
