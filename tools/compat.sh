#!/usr/bin/env bash
# tools/compat.sh VERSION [TIER]: dynashard's tests on torch VERSION (e.g. 2.11.0), in a venv of its own.
#
# TIER (default full):
#   full     `pytest -m "unit and not slow"` (the default run's unit tier; `-m unit` alone adds the slow
#            tier's unit tests: an hour here), then the gloo smoke below: what a release must pass to be
#            listed as supported
#            (README's support table, benchmarks/results/compat.md)
#   smoke    the gloo smoke and a few unit files (UNIT_FILES below): minutes, what .ci/run runs on a second release
#   install  build the venv only
# The gloo smoke: the README's demo on 2 ranks (its largest difference to the unsharded model checked),
# one HF generate against the unsharded model (GPT-2 through parallelize), SGD steps of a Llama against
# its unsharded twin (tests/test_serving.py, tests/test_training.py: one case each, on 2 gloo ranks).
#
# The venv: ${COMPAT_DIR:-$HOME/.cache/dynashard-compat}/VERSION, outside the checkout and reused (torch's
# CUDA builds are GBs): torch==VERSION, transformers==${TRANSFORMERS:-5.23.0}, this checkout installed
# editable with its test extras. Extra pytest arguments: COMPAT_PYTEST_ARGS (e.g. "-n 0" on a busy machine).
#
# NOTE: pip's own configuration may carry a constraints file (here /etc/xdg/pip/pip.conf caps torch at
# 2.14.1: `pip config list`). pip ignores an empty PIP_CONSTRAINT, so this script points PIP_CONSTRAINT
# at a file of its own (VENV/constraints.txt: the torch and transformers asked for), which replaces the
# configured one for these installs only.
#
# Exit status: 0 if every stage passed; the stages are independent (one failing does not stop the next),
# each prints a verdict line ("compat: ..."), and the last line sums them up.
set -uo pipefail

VERSION=${1:?"usage: tools/compat.sh VERSION [full|smoke|install], e.g. tools/compat.sh 2.11.0"}
TIER=${2:-full}
case "$TIER" in full|smoke|install) ;; *) echo "compat: unknown tier '$TIER' (expected full, smoke or install)" >&2; exit 2;; esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TRANSFORMERS=${TRANSFORMERS:-5.23.0}
VENV=${COMPAT_DIR:-$HOME/.cache/dynashard-compat}/$VERSION
PY=$VENV/bin/python
# (a few unit files for the smoke tier: the private-API checks, the graph goldens, planning, the lowering check)
UNIT_FILES=(tests/test_torch_private.py tests/test_graphs.py tests/test_planning.py tests/test_lowering.py)
GLOO_TESTS=(
  "tests/test_serving.py::test_hf_generate_matches_the_unsharded_model[world2-gpt2-dynamic-parallelize]"
  "tests/test_training.py::test_sgd_steps_match_the_unsharded_twin[world2-llama]"
)
FAILED=()

stage() {  # stage NAME COMMAND...: run it, print its verdict and seconds, remember a failure
  local name=$1 began=$SECONDS rc
  shift
  "$@"
  rc=$?
  if [ $rc -eq 0 ]; then echo "compat: $name ok ($((SECONDS - began)) s)"; else
    echo "compat: $name FAILED (exit $rc, $((SECONDS - began)) s)"; FAILED+=("$name"); fi
}

install() {
  mkdir -p "$VENV" || return
  [ -x "$PY" ] || python3 -m venv "$VENV" || return
  printf 'torch==%s\ntransformers==%s\n' "$VERSION" "$TRANSFORMERS" > "$VENV/constraints.txt"
  PIP_CONSTRAINT=$VENV/constraints.txt "$PY" -m pip install -q -e "$ROOT[test]" || return
  "$PY" -c "import torch, transformers; print('compat: torch', torch.__version__, 'transformers', transformers.__version__)"
}

demo() {  # the README's first command; the largest |sharded - unsharded| of each rank must be float32 noise
  local out
  out=$(cd "$ROOT" && OMP_NUM_THREADS=1 timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m dynashard.demo 2>&1) || { echo "$out" | tail -30; return 1; }
  echo "$out" | grep "max |sharded - unsharded|"
  # (the demo's float32 layers agree to ~1e-6 with the unsharded model; 1e-4 leaves room for other kernels)
  echo "$out" | "$PY" -c "
import re, sys
diffs = [float(d) for d in re.findall(r'max \|sharded - unsharded\| = (\S+) over', sys.stdin.read())]
sys.exit(0 if len(diffs) == 2 and max(diffs) < 1e-4 else f'expected 2 ranks within 1e-4, found {diffs}')"
}

tests() {  # tests ARGS...: pytest in the checkout with the venv's torch
  (cd "$ROOT" && "$PY" -m pytest -q -p no:cacheprovider ${COMPAT_PYTEST_ARGS:-} "$@" 2>&1 | tail -40)
}

stage "install torch $VERSION" install
[ -x "$PY" ] || { echo "compat: no venv at $VENV"; exit 1; }
if [ "$TIER" != install ]; then
  if [ "$TIER" = full ]; then
    stage "unit tier (pytest -m \"unit and not slow\")" tests -m "unit and not slow"
  else
    stage "unit files (${UNIT_FILES[*]})" tests -m "unit and not slow" "${UNIT_FILES[@]}"
  fi
  stage "demo on 2 gloo ranks" demo
  stage "HF generate and SGD steps against the unsharded model on 2 gloo ranks" tests -m "not slow" "${GLOO_TESTS[@]}"
fi
echo "compat: torch $VERSION, tier $TIER, $(date -u +%Y-%m-%d): ${#FAILED[@]} stage(s) failed${FAILED:+: ${FAILED[*]}}"
[ ${#FAILED[@]} -eq 0 ]
