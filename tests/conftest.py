"""Under pytest-xdist (setup.cfg's ``-n 2``) each worker computes on one intra-op thread: two workers on
two cores, plus the ranks a gloo test spawns (one thread each, tests/multiproc.py), would otherwise
oversubscribe the cores with OpenMP threads that spin while they wait."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    """A spawn of ``@on_ranks`` scenarios runs the selected ones only (``-k``: tests/scenarios.py)."""
    from tests.scenarios import select

    select(session.items)
