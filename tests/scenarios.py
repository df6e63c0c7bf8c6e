"""Scenarios that run on every rank and check there: one function holds a behaviour and its asserts.

A test file makes one ``Scenarios`` and decorates its rank-side tests with it::

    on_ranks = Scenarios(__name__, worlds=(2, 4), deadline_s=300)

    @on_ranks
    def test_typo_lists_the_closest_names(rank, world):
        error = raised(lambda: compile_with(plan={"upp": "colwise"}))
        assert "matches no linear" in str(error), error

One spawn per world runs all of the file's scenarios in the order they are written, on every
rank (a spawn's start costs seconds, a scenario usually less), each after ``torch._dynamo.reset()``
and ``torch.manual_seed(0)``. A scenario that raises (an assert, or anything else) is recorded
with its traceback and the next one runs. The decorator returns the pytest test of that scenario:
it reads the scenario's outcome on every rank and fails with each failing rank's error and
traceback. A scenario takes ``rank`` and ``world``, and ``tmp_path`` if it asks for it (a
directory of its own, shared by the ranks of the spawn).

A scenario that fails on some ranks only, before a collective the others reach, leaves those
waiting; then the spawn runs out of time and every test of it fails, naming the scenario each
rank was in. So a check that only some ranks make goes after the scenario's last collective, or
is shared first (``from_rank0``) and asserted on every rank.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.multiproc import RankError, run_ranks_outcomes, shared_run

_BY_MODULE: dict[str, Scenarios] = {}  # one per test module; its ranks find it again by the module's name


class ScenarioFailed(Exception):
    """A scenario raised on one rank or more; the message has each one's error and traceback."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a scenario raised on one rank, as text (the exception itself need not pickle)."""

    exc_type: str
    message: str
    traceback: str  # from the scenario's own frame on, ending with the exception (and its causes)
    where: str  # the frames alone: ranks that failed at the same line show only their message


class Scenarios:
    """The scenarios of one test module, run in one spawn per world size."""

    def __init__(self, module: str, *, worlds: Sequence[int], deadline_s: float) -> None:
        self.module, self.worlds, self.deadline_s = module, tuple(worlds), deadline_s
        self.functions: dict[str, Callable[..., None]] = {}
        self.outcomes = shared_run(self._spawn_scenarios)  # {world: per rank, {name: Failure | None} or a RankError}
        _BY_MODULE[module] = self

    def __call__(self, fn: Callable[..., None]) -> Callable[..., None]:
        name = fn.__name__
        if name in self.functions:
            raise ValueError(f"two scenarios named {name!r} in {self.module}")
        unknown = set(inspect.signature(fn).parameters) - {"rank", "world", "tmp_path"}
        if unknown:
            raise TypeError(f"scenario {name!r} takes {sorted(unknown)}; a scenario gets rank, world, tmp_path")
        self.functions[name] = fn

        if len(self.worlds) > 1:
            def test(world: int) -> None:
                __tracebackhide__ = True
                self.check(name, world)
        else:
            def test() -> None:
                __tracebackhide__ = True
                self.check(name, self.worlds[0])

        test.__name__ = test.__qualname__ = name
        test.__module__, test.__doc__ = fn.__module__, fn.__doc__
        test = pytest.mark.timeout(self.deadline_s + 60)(test)  # the first test waits for the whole spawn
        if len(self.worlds) > 1:
            test = pytest.mark.parametrize("world", self.worlds, ids=[f"world{w}" for w in self.worlds])(test)
        return test

    def check(self, name: str, world: int) -> None:
        """Raise :class:`ScenarioFailed` if scenario ``name`` failed on any rank of the spawn at ``world``."""
        __tracebackhide__ = True
        failed = []
        for rank, outcome in enumerate(self.outcomes(world)):
            if isinstance(outcome, RankError):
                failed.append((rank, Failure("RankError", "", f"the rank did not finish its scenarios: {outcome}", "")))
            elif outcome[name] is not None:
                failed.append((rank, outcome[name]))
        if not failed:
            return
        lines = [f"{name} failed on rank(s) {[r for r, _ in failed]} of {world}"]
        first_rank, first = failed[0]
        for rank, f in failed:
            if rank != first_rank and f.traceback == first.traceback:
                lines.append(f"rank {rank}: the same as rank {first_rank}")
            elif rank != first_rank and f.where and f.where == first.where:
                lines.append(f"rank {rank}, at the same line: {f.exc_type}: {f.message}")
            else:
                lines.append(f"rank {rank}: {f.traceback}")
        raise ScenarioFailed("\n".join(lines))

    def _spawn_scenarios(self, world: int) -> list:
        root = tempfile.mkdtemp(prefix="dynashard-scenarios-")
        try:
            return run_ranks_outcomes(_run_on_rank, world, self.module, root, timeout=self.deadline_s)
        except TimeoutError as e:
            where = "; ".join(f"rank {r}: {_read(Path(root, f'rank{r}.running'))}" for r in range(world))
            raise TimeoutError(f"the scenario each rank was running: {where}\n{e}") from e
        finally:
            shutil.rmtree(root, ignore_errors=True)


def raised(fn: Callable[[], object]) -> BaseException:
    """The exception ``fn()`` raises; an AssertionError if it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the scenario inspects type and message
        return e
    raise AssertionError("expected an error, but the call returned")


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else "(none started)"


def _failure(e: BaseException, fn: Callable[..., None]) -> Failure:
    tb = e.__traceback__
    code = inspect.unwrap(fn).__code__  # (skips this module's frame and decorators such as torch.no_grad)
    while tb is not None and tb.tb_frame.f_code is not code:
        tb = tb.tb_next
    tb = tb or e.__traceback__
    text = "".join(traceback.format_exception(type(e), e, tb)).rstrip()
    return Failure(type(e).__name__, str(e), text, "".join(traceback.format_tb(tb)))


def _run_on_rank(rank: int, world: int, module: str, root: str) -> dict[str, Failure | None]:
    import torch

    importlib.import_module(module)  # (its decorators fill _BY_MODULE[module] on this rank)
    scenarios = _BY_MODULE[module]
    outcomes: dict[str, Failure | None] = {}
    for name, fn in scenarios.functions.items():
        Path(root, f"rank{rank}.running").write_text(name)
        torch._dynamo.reset()
        torch.manual_seed(0)
        available = {"rank": rank, "world": world, "tmp_path": Path(root, name)}
        wanted = {k: v for k, v in available.items() if k in inspect.signature(fn).parameters}
        if "tmp_path" in wanted:
            os.makedirs(wanted["tmp_path"], exist_ok=True)
        try:
            fn(**wanted)
            outcomes[name] = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - pytest.raises' "DID NOT RAISE" is a BaseException
            outcomes[name] = _failure(e, fn)
    Path(root, f"rank{rank}.running").write_text("(finished)")
    return outcomes


def from_rank0(value: object) -> object:
    """Rank 0's ``value`` on every rank. A check only rank 0 can make (a file it alone wrote or
    read) is asserted on every rank, so that all of them stop at it together instead of the other
    ranks going on into collectives that rank 0 never joins."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
