"""Logging through torch's system: silent by default, the plan with TORCH_LOGS, an artifact for tlparse;
a long compile's progress on rank 0 (dynashard/report/progress.py)."""

from __future__ import annotations

import functools
import glob
import io
import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from dynashard.errors import UsageError
from dynashard.report import progress
from tests.multiproc import SUBPROCESS_DEADLINE_S

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent(
    """
    import torch
    from dynashard import _torch as private
    from tests.models import MLP
    private.init_fake_process_group(2)   # single process; only graph shapes matter here
    torch.manual_seed(0)
    with torch.no_grad():
        torch.compile(MLP(32, 96), backend="dynashard", options={"compiler": "eager", "min_shard_numel": 0})(
            torch.randn(4, 32))
    print("done")
    """
)


# A first compile, a call the compiled graph serves (the same shape), then a new batch size: a recompile
RECOMPILE = textwrap.dedent(
    """
    import torch
    from dynashard import _torch as private
    from tests.models import MLP
    private.init_fake_process_group(2)
    torch.manual_seed(0)
    fast = torch.compile(MLP(32, 96), backend="dynashard", options={"compiler": "eager", "min_shard_numel": 0})
    with torch.no_grad():
        for batch in (4, 4, 3):
            fast(torch.randn(batch, 32))
    print("done")
    """
)


def _run(tmp_path, script=SCRIPT, **env):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    full_env.update(env, PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=SUBPROCESS_DEADLINE_S, env=full_env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_silent_by_default(tmp_path):
    done = _run(tmp_path)
    assert done.stdout.strip() == "done"
    assert "dynashard" not in done.stderr, done.stderr


@functools.cache
def _info_of_a_recompile() -> str:
    """RECOMPILE's stderr under TORCH_LOGS=dynashard (a Python process importing torch: seconds), read by
    the two tests of INFO lines."""
    return _run(None, RECOMPILE, TORCH_LOGS="dynashard").stderr


def test_torch_logs_shows_plan_and_graphs(tmp_path):
    info = _info_of_a_recompile()
    assert "dynashard plan (rank 0 of 2)" in info and "pairs with rowwise down" in info
    assert "rewritten graph" not in info  # graphs are debug level
    debug = _run(tmp_path, TORCH_LOGS="+dynashard").stderr
    assert "aten graph before the rewrite" in debug and "_c10d_functional.all_reduce" in debug


def test_structured_trace_artifact(tmp_path):
    _run(tmp_path, TORCH_TRACE=str(tmp_path))
    text = "".join(open(f).read() for f in glob.glob(str(tmp_path / "*")))
    assert "dynashard_rewritten_graph" in text and "all_reduce" in text


def test_each_compile_logs_one_line_naming_the_graph_the_reason_and_the_time(tmp_path):
    """A first compile and a recompile for a new batch size each log one INFO line: the graph, its
    inputs (static, then dynamic), why (a first compile; then the guard of the first compile that
    failed, as Dynamo words it), the plan in a few words and the seconds taken."""
    info = _info_of_a_recompile()
    lines = [line for line in info.splitlines() if "dynashard: compiled graph" in line]
    assert len(lines) == 2, info
    first, again = lines
    # (the frame's number counts the frames Dynamo compiled before it in the process: 0 on torch 2.13, 1 on
    # 2.11.0, which compiles another frame first)
    frame = re.search(r"compiled graph (\d+)/0 of forward \(models.py:", first)
    assert frame and "inputs float32[4, 32] (static shapes)" in first, first
    assert "first compile of this frame" in first and "plan: 2 of 2 linears sharded, 1 all_reduce" in first, first
    assert re.search(r"; \d+\.\d\d s \(planning \d+\.\d\d s\)$", first), first
    assert f"compiled graph {frame[1]}/1 of forward" in again, again
    assert re.search(r"inputs float32\[s\d+, 32\] \(dynamic", again), again
    assert (f"recompiled: a guard of {frame[1]}/0 failed: tensor 'x' size mismatch at index 0. expected 4, actual 3"
            in again), again


def test_the_plan_table_is_logged_once_for_two_compiles_with_the_same_plan():
    """RECOMPILE compiles twice with one plan (the bytes per call differ with the batch: no new plan); the
    summary line stays one per compile."""
    info = _info_of_a_recompile()
    assert info.count("dynashard plan (rank 0 of 2)") == 1, info
    assert info.count("dynashard: compiled graph") == 2, info


def test_rank_1_logs_nothing_at_info_and_its_plan_at_debug(tmp_path):
    """A fake group of 2 whose process is rank 1: no table, summary or progress at INFO (rank 0 says
    them); at +dynashard its own table and summary."""
    script = RECOMPILE.replace("init_fake_process_group(2)", "init_fake_process_group(2, 1)")
    debug = _run(tmp_path, script, TORCH_LOGS="+dynashard", DYNASHARD_PROGRESS_S="0").stderr
    # (torch's log lines open with "[rank1]:" and the level's letter: I for INFO, V for DEBUG)
    assert not re.findall(r"^\[rank1\]:[IWE].*dynashard", debug, re.MULTILINE), debug
    assert re.search(r"^\[rank1\]:V.*dynashard plan \(rank 1 of 2\)", debug, re.MULTILINE), debug
    # (the frame's id: 0 on torch 2.13-2.15, 1 on 2.11 for the same script)
    assert re.search(r"^\[rank1\]:V.*compiled graph \d/0 of forward \(models.py:", debug, re.MULTILINE), debug
    assert "compiling graph" not in debug, debug  # (no progress line)


def test_a_compile_past_the_threshold_shows_its_stages_without_torch_logs(tmp_path):
    """DYNASHARD_PROGRESS_S=0: every compile is "long"; its stages reach stderr with no TORCH_LOGS (a
    person waiting must see them), as plain lines (stderr is a pipe here), then the end. The default
    threshold (5 s) keeps the fast compile silent: test_silent_by_default."""
    done = _run(tmp_path, DYNASHARD_PROGRESS_S="0")
    err = done.stderr
    for stage in ("tracing the graph to aten ops", "planning", "rewriting the graph for this rank",
                  "compiling the sharded graph (eager, no compiler)", "cutting the weights"):
        assert re.search(rf"dynashard: compiling graph \d/0 of forward \(models.py:\d+\): {re.escape(stage)} "
                         r"\(\d+ s so far\)\n", err), (stage, err)
    assert re.search(r"dynashard: compiled graph \d/0 of forward \(models.py:\d+\) in \d+ s\n$", err), err
    assert "\r" not in err and done.stdout.strip() == "done"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [False, True])
def test_the_progress_line_repeats_while_a_stage_lasts(monkeypatch, tty):
    """The timer thread: a stage that lasts 0.5 s, shown every 0.05 s from the start, is shown several
    times; a terminal gets one line rewritten in place (\r, one newline at the end), a pipe plain lines."""
    assert not progress.log.isEnabledFor(logging.INFO)  # (else the lines go to the log)
    stream = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    line = progress.Progress("0/0 of f", after_s=0.0, every_s=0.05)
    line.stage("slow")
    time.sleep(0.5)
    line.close(failed=False)
    text = stream.getvalue()
    assert len(re.findall(r"dynashard: compiling graph 0/0 of f: slow \(\d s so far\)", text)) >= 3, text
    assert re.search(r"dynashard: compiled graph 0/0 of f in \d s *\n$", text), text  # (padded over the longer line)
    if tty:
        assert text.count("\n") == 1 and text.startswith("\r"), text
    else:
        assert "\r" not in text and text.count("\n") >= 4, text


def test_no_progress_under_the_threshold_and_a_clear_error_for_a_bad_setting(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    line = progress.Progress("0/0 of f", after_s=5.0, every_s=0.05)
    line.stage("quick")
    line.close(failed=False)
    assert sys.stderr.getvalue() == ""
    monkeypatch.setenv(progress.AFTER_ENV, "soon")
    with pytest.raises(UsageError, match="DYNASHARD_PROGRESS_S='soon'. Expected a number of seconds >= 0, or 'off'"):
        progress._seconds(progress.AFTER_ENV, 5.0)
    monkeypatch.setenv(progress.AFTER_ENV, "off")
    assert progress._seconds(progress.AFTER_ENV, 5.0) is None


def test_the_summary_says_what_inductors_cache_did(monkeypatch):
    """The counts of Inductor's FX graph cache lookups before and after the compile: their difference
    (measured with compiler='inductor': '1 miss' in a fresh process, '1 hit' in the next, 50 s then 20 s
    here, too slow for this file); nothing when no lookup happened (compiler='eager')."""
    monkeypatch.setattr(progress.private, "inductor_cache_counts", lambda: (3, 1, 0))
    assert progress.cache_words((2, 1, 0)) == "; Inductor cache: 1 hit"
    assert progress.cache_words((3, 0, 0)) == "; Inductor cache: 1 miss"
    assert progress.cache_words((3, 1, 0)) == ""
