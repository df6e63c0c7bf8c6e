#!/usr/bin/env bash
# The GPU tier in one command: `bash benchmarks/gpu_check.sh` from anywhere in the checkout.
#
# Prints the machine's facts (GPUs, driver, torch / CUDA / cuDNN / NCCL versions), runs every test
# marked `cuda` (`python -m pytest -m cuda -rA`, tests/test_cuda.py: one GPU's checks; two GPUs' where
# there are two), prints one line per test (passed / failed / skipped, with the reason) and writes a
# JSON summary: $OUT/gpu_check.json if $OUT is set, else benchmarks/results/gpu_check.json on a
# machine with CUDA, else a temporary directory (a run without a GPU is never a record). Exit status:
# 0 if no test failed and at least one passed; 1 if any test failed or errored, none was collected, or
# the run passed GPU_CHECK_TIMEOUT_S (420 s); 3 if every test was skipped (no CUDA: nothing checked);
# 2 if torch cannot be imported.
# Installs nothing: it uses the python on PATH (or $PYTHON) as it is.
#
# Designed to take under 5 minutes on one GPU. NEVER RUN ON A GPU YET (written on a CPU-only machine,
# where every test reports skipped: no CUDA).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
LIMIT_S=${GPU_CHECK_TIMEOUT_S:-420}

if [ -n "${OUT:-}" ]; then
    DIR=$OUT
elif "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DIR=benchmarks/results
else
    DIR=${TMPDIR:-/tmp}/dynashard-gpu-check
fi
mkdir -p "$DIR" || exit 2
JUNIT=$DIR/gpu_check.junit.xml
SUMMARY=$DIR/gpu_check.json
FACTS=$DIR/gpu_check.facts.json
rm -f "$JUNIT" "$SUMMARY" "$FACTS"

echo "== machine"
"$PY" - "$FACTS" <<'EOF'
import datetime, json, os, platform, shutil, subprocess, sys
import torch

facts = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
         "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
         "cpus": os.cpu_count(), "gpus": []}
try:
    facts["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                     timeout=10).stdout.strip() or None
except (OSError, subprocess.SubprocessError):
    facts["commit"] = None
if torch.cuda.is_available():
    facts["cudnn"] = torch.backends.cudnn.version()
    facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        facts["gpus"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                              "memory_gib": round(p.total_memory / 2**30, 1)})
if shutil.which("nvidia-smi"):
    try:
        facts["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,mig.mode.current", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        facts["nvidia_smi"] = [f"failed: {e}"]
for key in ("date", "host", "commit", "python", "torch", "cuda_build", "cudnn", "nccl", "cpus"):
    print(f"{key:>12}: {facts.get(key)}")
for g in facts["gpus"]:
    print(f"{'gpu ' + str(g['index']):>12}: {g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)")
for line in facts.get("nvidia_smi", []):
    print(f"{'nvidia-smi':>12}: {line}")
if not torch.cuda.is_available():
    print("     no CUDA: torch.cuda.is_available() is False; every test below reports skipped")
with open(sys.argv[1], "w") as f:
    json.dump(facts, f)
EOF
[ -s "$FACTS" ] || { echo "gpu_check: could not import torch with $PY"; exit 2; }

echo "== python -m pytest -m cuda -rA (limit ${LIMIT_S}s)"
start=$(date +%s)
timeout --kill-after=15 "$LIMIT_S" "$PY" -m pytest -m cuda -rA -q --junitxml="$JUNIT"
pytest_rc=$?
elapsed=$(( $(date +%s) - start ))

echo "== summary"
"$PY" - "$JUNIT" "$FACTS" "$SUMMARY" "$pytest_rc" "$elapsed" "$LIMIT_S" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

junit, facts_path, summary, rc, elapsed, limit = sys.argv[1:7]
rc, elapsed = int(rc), int(elapsed)
facts = json.load(open(facts_path))
tests = []
if os.path.exists(junit):
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or node.text or "").strip()
                break
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail[:2000]})
counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
problems = []
if rc in (124, 137):
    problems.append(f"pytest ran past {limit} s and was stopped")
elif rc not in (0, 1, 5):
    problems.append(f"pytest exited {rc}")
if counts["failed"] or counts["error"]:
    problems.append(f"{counts['failed']} failed, {counts['error']} errors")
if not tests:
    problems.append("no test ran (none collected, or no report written)")
nothing = not problems and not counts["passed"]  # every test skipped: nothing was checked
for t in tests:
    line = t["detail"].splitlines()[0][:160] if t["detail"] else ""
    print(f"{t['outcome'].upper():>8}  {t['seconds']:6.1f}s  {t['test']}" + (f"\n{'':>18}{line}" if line else ""))
print(f"\n{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
      f"{counts['skipped']} skipped in {elapsed} s (pytest exit {rc})")
if not facts["cuda_available"]:
    print("no CUDA on this machine: the skips above are expected; nothing on a GPU was checked")
record = {"name": "gpu_check", **facts, "pytest_exit": rc, "seconds": elapsed, "limit_s": int(limit),
          "counts": counts, "ok": not problems and not nothing, "problems": problems, "tests": tests}
with open(summary, "w") as f:
    json.dump(record, f, indent=1)
print(f"wrote {summary} (junit: {junit})")
if problems:
    print("gpu_check: FAILED: " + "; ".join(problems))
elif nothing:
    print("gpu_check: NOTHING CHECKED: every test was skipped (exit 3)")
sys.exit(1 if problems else 3 if nothing else 0)
EOF
