"""The test harness's own promise: a spawn shared by many tests runs once, even when it fails."""

from __future__ import annotations

import pytest

from tests.multiproc import SharedRunFailed, shared_run

pytestmark = pytest.mark.unit


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


def test_a_shared_run_result_is_computed_once_per_key():
    calls = []

    @shared_run
    def battery(world):
        calls.append(world)
        return [world] * world

    assert battery(2) == [2, 2] and battery(2) == [2, 2] and battery(4) == [4] * 4
    assert calls == [2, 4]
