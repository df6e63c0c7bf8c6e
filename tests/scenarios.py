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

``@on_ranks(worlds=(4,))`` runs a scenario in some of the spawns only; ``@on_ranks(cases=[...])``
(or ``cases={2: [...], 4: [...]}``, by world) runs it once per case, each a test of its own, the
scenario taking ``case``. ``@on_ranks.alone(2, dies=(1,))`` gives a scenario a spawn of its own,
for one the group does not survive: the ranks in ``dies`` must die (``os._exit``), the others pass.
A spawn runs only the scenarios pytest selected (``-k``, ``-m``: ``tests/conftest.py`` hands the selection
to :func:`select`), so ``pytest -k`` of one scenario does not run its whole file on the ranks.
``SCENARIO_TIMES=FILE pytest ...`` appends each scenario's seconds on rank 0 to ``FILE``, wall and CPU
(pytest's ``--durations`` charges a whole spawn to its first test); ``SCENARIO_PROFILE=DIR`` writes rank 0's
cProfile of each scenario there (``python -m pstats DIR/FILE``).
"""

from __future__ import annotations

import cProfile
import dataclasses
import importlib
import inspect
import os
import re
import shutil
import tempfile
import time
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


@dataclasses.dataclass(frozen=True)
class Run:
    """One test's scenario: the function, its case (None without cases), the worlds it runs at."""

    fn: Callable[..., None]
    case: object
    worlds: tuple[int, ...]


class Scenarios:
    """The scenarios of one test module, run in one spawn per world size (and those run alone)."""

    def __init__(self, module: str, *, worlds: Sequence[int], deadline_s: float,
                 marks: dict[int, pytest.MarkDecorator] | None = None) -> None:
        self.module, self.worlds, self.deadline_s = module, tuple(worlds), deadline_s
        self.marks = dict(marks or {})  # a world's tests' mark (pytest.mark.slow)
        self.runs: dict[str, Run] = {}  # by test key: the name, and "[case]" for a case
        self.alone_runs: dict[str, Run] = {}
        self.selected: frozenset[str] | None = None  # the keys pytest selected (None: every one)
        self.outcomes = shared_run(self._spawn_scenarios)  # {world: per rank, {key: Failure | None} or a RankError}
        _BY_MODULE[module] = self

    def __call__(self, fn: Callable[..., None] | None = None, *, worlds: Sequence[int] | None = None,
                 cases: Sequence | dict[int, Sequence] | None = None):
        """``@on_ranks``, or ``@on_ranks(worlds=..., cases=...)``: the scenario's pytest test(s)."""
        if fn is None:
            return lambda f: self(f, worlds=worlds, cases=cases)
        runs = self._plan(fn, worlds or self.worlds, cases)
        if {w for w, _, _ in runs} - set(self.worlds):
            raise ValueError(f"scenario {fn.__name__!r} runs at worlds {sorted({w for w, _, _ in runs})}; "
                             f"{self.module} spawns {list(self.worlds)}")
        self._register(self.runs, fn, runs)
        return self._test(fn, runs, self.check, self.deadline_s)

    def alone(self, world: int, *, dies: Sequence[int] = (), gloo_timeout: float = 60,
              deadline_s: float | None = None, cases: Sequence | None = None):
        """A scenario (or each of its cases) in a spawn of its own at ``world``, with that gloo timeout."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s

        def decorate(fn: Callable[..., None]) -> Callable[..., None]:
            runs = self._plan(fn, (world,), cases)
            self._register(self.alone_runs, fn, runs)

            def spawn_alone(key: str, world: int) -> None:
                __tracebackhide__ = True
                self._spawn_alone(key, world, dies, gloo_timeout, deadline_s)
            return self._test(fn, runs, spawn_alone, deadline_s)
        return decorate

    def _plan(self, fn: Callable[..., None], worlds: Sequence[int], cases) -> list[tuple[int, str | None, object]]:
        """(world, case id, case) of each test: one per world, or per world and case."""
        name, params = fn.__name__, set(inspect.signature(fn).parameters)
        unknown = params - {"rank", "world", "tmp_path"} - ({"case"} if cases is not None else set())
        if unknown:
            raise TypeError(f"scenario {name!r} takes {sorted(unknown)}; a scenario gets rank, world, tmp_path"
                            + (" and case" if cases is not None else ""))
        if cases is not None and "case" not in params:
            raise TypeError(f"scenario {name!r} has cases but takes no case")
        by_world = cases if isinstance(cases, dict) else {w: cases for w in worlds}
        return [(w, None, None) for w, cs in by_world.items() if cs is None] + [
            (w, _case_id(c), c) for w, cs in by_world.items() if cs is not None for c in cs]

    def _register(self, table: dict[str, Run], fn: Callable[..., None], runs: list) -> None:
        if any(_key(fn.__name__, cid) in self.runs or _key(fn.__name__, cid) in self.alone_runs for _, cid, _ in runs):
            raise ValueError(f"two scenarios named {fn.__name__!r} in {self.module}")
        for key in dict.fromkeys(_key(fn.__name__, cid) for _, cid, _ in runs):
            worlds = tuple(w for w, cid, _ in runs if _key(fn.__name__, cid) == key)
            case = next(c for _, cid, c in runs if _key(fn.__name__, cid) == key)
            table[key] = Run(fn, case, worlds)

    def _test(self, fn: Callable[..., None], runs: list, check: Callable[[str, int], None], deadline_s: float):
        """The pytest test of a scenario's runs: parametrized by world where it runs at several, and by case."""
        name = fn.__name__
        several = len({w for w, _, _ in runs}) > 1
        worlds = tuple(w if w not in self.marks else pytest.param(w, marks=self.marks[w]) for w, _, _ in runs)
        if runs[0][1] is not None:
            def test(world: int, case: str) -> None:
                __tracebackhide__ = True
                check(_key(name, case), world)
            params = [pytest.param(w, cid, marks=self.marks.get(w, ()), id=f"world{w}-{cid}" if several else cid)
                      for w, cid, _ in runs]
            test = pytest.mark.parametrize(("world", "case"), params)(test)
        elif several:
            def test(world: int) -> None:
                __tracebackhide__ = True
                check(name, world)
            test = pytest.mark.parametrize("world", worlds, ids=[f"world{w}" for w, _, _ in runs])(test)
        else:
            def test() -> None:
                __tracebackhide__ = True
                check(name, runs[0][0])
            if runs[0][0] in self.marks:
                test = self.marks[runs[0][0]](test)
        test.__name__ = test.__qualname__ = name
        test.__module__, test.__doc__ = fn.__module__, fn.__doc__
        return pytest.mark.timeout(deadline_s + 60)(test)  # the first test waits for the whole spawn

    def check(self, key: str, world: int) -> None:
        """Raise :class:`ScenarioFailed` if scenario ``key`` failed on any rank of the spawn at ``world``."""
        __tracebackhide__ = True
        _report(key, world, [
            (rank, _not_finished(outcome) if isinstance(outcome, RankError) else outcome[key])
            for rank, outcome in enumerate(self.outcomes(world))])

    def _spawn_scenarios(self, world: int) -> list:
        root = tempfile.mkdtemp(prefix="dynashard-scenarios-")
        try:
            return run_ranks_outcomes(_run_on_rank, world, self.module, root, self.selected, timeout=self.deadline_s)
        except TimeoutError as e:
            where = "; ".join(f"rank {r}: {_read(Path(root, f'rank{r}.running'))}" for r in range(world))
            raise TimeoutError(f"the scenario each rank was running: {where}\n{e}") from e
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _spawn_alone(self, key: str, world: int, dies: Sequence[int], gloo_timeout: float, deadline_s: float) -> None:
        __tracebackhide__ = True
        root = tempfile.mkdtemp(prefix="dynashard-scenario-")
        try:
            outcomes = run_ranks_outcomes(_run_alone, world, self.module, key, root, timeout=deadline_s,
                                          gloo_timeout=gloo_timeout)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        per_rank = []
        for rank, outcome in enumerate(outcomes):
            died = isinstance(outcome, RankError) and outcome.exc_type == "Died"
            if rank in dies and not died:
                outcome = outcome or Failure("Survived", "", "the rank was to die, but finished its scenario", "")
            per_rank.append((rank, None if died and rank in dies else
                             _not_finished(outcome) if isinstance(outcome, RankError) else outcome))
        _report(key, world, per_rank)


def select(items: Sequence[pytest.Item]) -> None:
    """Limit the spawns of each module with a scenario among ``items`` (pytest's selected tests) to those.
    (A module none of whose scenarios is a collected test, such as test_multiproc's own, keeps them all.)"""
    keys: dict[str, set[str]] = {}
    for item in items:
        fn = getattr(item, "function", None)
        scenarios = _BY_MODULE.get(getattr(fn, "__module__", None))
        case = item.callspec.params.get("case") if hasattr(item, "callspec") else None
        if scenarios is not None and _key(fn.__name__, case) in scenarios.runs:  # (not a plain test of the module)
            keys.setdefault(fn.__module__, set()).add(_key(fn.__name__, case))
    for module, selected in keys.items():
        _BY_MODULE[module].selected = frozenset(selected)


def _key(name: str, case_id: str | None) -> str:
    return name if case_id is None else f"{name}[{case_id}]"


def _case_id(case: object) -> str:
    return "-".join(map(str, case)) if isinstance(case, tuple) else str(case)


def _not_finished(error: RankError) -> Failure:
    return Failure("RankError", "", f"the rank did not finish its scenarios: {error}", "")


def _report(key: str, world: int, outcomes: list[tuple[int, Failure | None]]) -> None:
    """Raise :class:`ScenarioFailed` naming each failing rank, its error and traceback."""
    __tracebackhide__ = True
    failed = [(rank, f) for rank, f in outcomes if f is not None]
    if not failed:
        return
    lines = [f"{key} failed on rank(s) {[r for r, _ in failed]} of {world}"]
    first_rank, first = failed[0]
    for rank, f in failed:
        if rank != first_rank and f.traceback == first.traceback:
            lines.append(f"rank {rank}: the same as rank {first_rank}")
        elif rank != first_rank and f.where and f.where == first.where:
            lines.append(f"rank {rank}, at the same line: {f.exc_type}: {f.message}")
        else:
            lines.append(f"rank {rank}: {f.traceback}")
    raise ScenarioFailed("\n".join(lines))


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


def _run_on_rank(rank: int, world: int, module: str, root: str,
                 selected: frozenset[str] | None) -> dict[str, Failure | None]:
    importlib.import_module(module)  # (its decorators fill _BY_MODULE[module] on this rank)
    outcomes: dict[str, Failure | None] = {}
    for key, run in _BY_MODULE[module].runs.items():
        if world in run.worlds and (selected is None or key in selected):
            Path(root, f"rank{rank}.running").write_text(key)
            began, began_cpu = time.perf_counter(), time.process_time()
            if rank == 0 and os.environ.get("SCENARIO_PROFILE"):  # (a directory for rank 0's cProfile of each)
                with cProfile.Profile() as profile:
                    outcomes[key] = _run_one(key, run, rank, world, root)
                name = re.sub(r"[^\w.-]", "_", f"{module}.{key}.prof")
                Path(os.environ["SCENARIO_PROFILE"]).mkdir(parents=True, exist_ok=True)
                profile.dump_stats(Path(os.environ["SCENARIO_PROFILE"], name))
            else:
                outcomes[key] = _run_one(key, run, rank, world, root)
            if rank == 0 and os.environ.get("SCENARIO_TIMES"):  # (a file to append each scenario's seconds to)
                # (and rank 0's CPU seconds: on a shared machine the wall time follows the other jobs' load)
                cpu = time.process_time() - began_cpu
                with open(os.environ["SCENARIO_TIMES"], "a") as f:
                    f.write(f"{time.perf_counter() - began:7.1f} s  {cpu:6.1f} s cpu  {module} world {world} {key}\n")
    Path(root, f"rank{rank}.running").write_text("(finished)")
    return outcomes


def _run_alone(rank: int, world: int, module: str, key: str, root: str) -> Failure | None:
    importlib.import_module(module)
    return _run_one(key, _BY_MODULE[module].alone_runs[key], rank, world, root)


def _run_one(key: str, run: Run, rank: int, world: int, root: str) -> Failure | None:
    """Run one scenario afresh (Dynamo reset, seed 0): None if it returned, else what it raised."""
    import torch

    torch._dynamo.reset()
    torch.manual_seed(0)
    available = {"rank": rank, "world": world, "case": run.case, "tmp_path": Path(root, re.sub(r"[^\w.-]", "_", key))}
    wanted = {k: v for k, v in available.items() if k in inspect.signature(run.fn).parameters}
    if "tmp_path" in wanted:
        os.makedirs(wanted["tmp_path"], exist_ok=True)
    try:
        run.fn(**wanted)
        return None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - pytest.raises' "DID NOT RAISE" is a BaseException
        return _failure(e, run.fn)


def from_rank0(value: object) -> object:
    """Rank 0's ``value`` on every rank. A check only rank 0 can make (a file it alone wrote or
    read) is asserted on every rank, so that all of them stop at it together instead of the other
    ranks going on into collectives that rank 0 never joins."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
