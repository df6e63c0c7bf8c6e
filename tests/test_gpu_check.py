"""``bash benchmarks/gpu_check.sh --dry-run`` keeps running: every stage of the one-GPU check on CPU at tiny
sizes, each with its verdict line and JSON record, none failed, and every part that needs CUDA reported as
not run with its reason. It checks the script and the stages' code, nothing about a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(900)  # about 1 minute of CPU; 2-5 minutes of wall time on a loaded 2-core machine
def test_gpu_check_dry_run_gives_every_stage_a_verdict_and_a_record(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=880)
    said = done.stdout + done.stderr
    for s in range(5):
        line = re.search(rf"^\[S{s}\] (PASS|FAIL|SKIP) \(\d+ s, dry run\)", done.stdout, re.M)
        assert line, f"no verdict line for S{s}:\n{said[-4000:]}"
        rec = json.loads((tmp_path / f"gpu_check_s{s}.json").read_text())
        assert rec["stage"] == f"S{s}" and rec["dry_run"] and rec["verdict"] == line.group(1), rec
        assert rec["verdict"] != "FAIL", rec["line"] + "\n" + "\n".join(
            c["detail"] for c in rec["checks"] if c["verdict"] == "FAIL")
        assert any(c["verdict"] == "PASS" for c in rec["checks"]), f"S{s} ran nothing: {rec['line']}"
        skipped = [c for c in rec["checks"] if c["verdict"] == "SKIP"]
        assert skipped and all("no CUDA" in c["detail"] and "not run" in c["detail"] for c in skipped), rec["line"]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["ok"] and summary["dry_run"] and set(summary["verdicts"]) == {f"S{s}" for s in range(5)}, summary
    assert (tmp_path / "gpu_check.log").exists()
    assert done.returncode == 0, said[-4000:]


def test_a_stage_that_dies_is_a_fail_and_the_next_stage_still_runs(tmp_path):
    """S1's process exits at once without a record (a crash, as a CUDA error can cause): its verdict line and
    record say FAIL with the exit status, S3 runs after it, and the script exits 1. S3 here is a stand-in that
    writes a PASS record at once (the script's handling of a stage that dies is what this checks; the dry run
    above runs the real S3: a Python and a pytest process, 5 s of this test's CPU)."""
    python = tmp_path / "python"
    s3 = '{"stage": "S3", "verdict": "PASS", "dry_run": true, "line": "[S3] PASS (0 s, dry run) stand-in"}'
    python.write_text(f'#!/bin/sh\ncase "$*" in\n'
                      f'  *"benchmarks.gpu_check s1 "*) echo "died"; exit 3;;\n'
                      f'  *"benchmarks.gpu_check s3 "*) echo \'{s3}\' > "$OUT/gpu_check_s3.json"; '
                      f'echo "[S3] PASS (0 s, dry run) stand-in"; exit 0;;\n'
                      f'esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(python), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--stages", "1,3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^\[S1\] FAIL the stage process exited 3 without writing its record$", done.stdout, re.M)
    assert json.loads((out / "gpu_check_s1.json").read_text())["verdict"] == "FAIL"
    assert re.search(r"^\[S3\] PASS ", done.stdout, re.M), done.stdout[-3000:]
    assert json.loads((out / "gpu_check.json").read_text())["verdicts"] == {"S1": "FAIL", "S3": "PASS"}
