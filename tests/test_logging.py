"""Logging through torch's system: silent by default, the plan with TORCH_LOGS, an artifact for tlparse."""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.multiproc import SUBPROCESS_DEADLINE_S

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent(
    """
    import torch
    from dynashard import _torch_private as private
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
    from dynashard import _torch_private as private
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
