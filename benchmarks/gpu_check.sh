#!/usr/bin/env bash
# The one-GPU check, one command: `bash benchmarks/gpu_check.sh [--dry-run] [--stages 0,1,2,3,4]`.
#
# Written for the machine this project is lent now and then: one H200, 16 cores, torch 2.11.0+cu130,
# transformers 5.17, NCCL 2.28, Triton, no network, 10 minutes a command. Designed to finish in under
# 7 minutes there (GPU_CHECK_DEADLINE_S, 420 s: a stage that would start past it is a SKIP). Each stage
# is a process of its own under its own timeout; one failing does not stop the next. Each prints one
# verdict line, `[SN] PASS|FAIL|SKIP (seconds) what | ran: ... | not run: ...`, and writes
# gpu_check_sN.json; the run ends with gpu_check.json (every stage's verdict) and gpu_check.log, in $OUT
# when set, else benchmarks/results/ (a dry run without $OUT: a temporary directory; never a record).
#
#   S0 versions (torch, CUDA, cuDNN, NCCL, Triton, transformers, GPU), import dynashard, one compile
#   S1 pytest -m cuda with each SDPA backend forced (flash, efficient, cuDNN, math), one process each:
#      HF Llama, Qwen2, GPT-2 in bf16 under explain(verify=True) and under Inductor
#   S2 2 and 4 processes sharing cuda:0 over gloo: logits, 16 greedy tokens, a training step vs unsharded
#   S3 NCCL at world 1 with device_id and its host companion group; mode="reduce-overhead" replays
#   S4 a FORECAST of TP 2/4/8 decode speedups (fake process group timings + published latencies)
#
# Nothing is fetched. Setup: wheels in $GPU_CHECK_WHEELS (default .whl/, if any) are installed with
# --no-index into a private target; the checkout with `pip install --no-deps --no-build-isolation -e .`
# (its torch pin is never resolved: the machine's torch stays) for the 'dynashard' entry point, and
# PYTHONPATH names the checkout in any case. GPU_CHECK_INSTALL=0 skips the pip step.
# --dry-run: every stage on CPU at tiny sizes (gloo, CPU tensors; the parts that need CUDA are skipped,
# each naming what did not run); installs nothing. tests/test_gpu_check.py runs it in the default suite.
# Exit status: 0 if no stage failed, 1 otherwise, 2 if no Python with torch was found.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)

DRY=0
STAGES=${GPU_CHECK_STAGES:-0,1,2,3,4}
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --stages) STAGES=$2; shift ;;
        --stages=*) STAGES=${1#--stages=} ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1'; expected --dry-run, --stages 0,1,2,3,4 or --help" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then PY=$candidate; break; fi
    done
fi
[ -n "$PY" ] || { echo "gpu_check.sh: no python that imports torch (set PYTHON=...)" >&2; exit 2; }

if [ -n "${OUT:-}" ]; then
    DIR=$OUT
elif [ "$DRY" = 1 ]; then
    DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_dry.XXXXXX")
else
    DIR=$ROOT/benchmarks/results
fi
mkdir -p "$DIR" || exit 2
rm -f "$DIR"/gpu_check_s?.json "$DIR/gpu_check.json"

if [ "$DRY" = 1 ]; then
    DEADLINE=${GPU_CHECK_DEADLINE_S:-600}
    declare -A LIMIT=([0]=120 [1]=180 [2]=240 [3]=120 [4]=180)
else
    DEADLINE=${GPU_CHECK_DEADLINE_S:-420}
    # measured budgets come with the first GPU run; until then: S1's four processes run at once, S2's two worlds too
    declare -A LIMIT=([0]=60 [1]=150 [2]=150 [3]=90 [4]=180)
fi

run() {
    local start now left limit stage json rc
    start=$(date +%s)
    echo "== gpu_check: $([ "$DRY" = 1 ] && echo 'DRY RUN (CPU, tiny sizes) ')stages $STAGES, into $DIR, python $PY"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    if [ "$DRY" = 0 ]; then
        WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
        if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
            echo "== installing carried wheels from $WHEELS (no index)"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/gpu_check_site "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
        fi
        if [ "${GPU_CHECK_INSTALL:-1}" = 1 ]; then
            echo "== pip install --no-deps --no-build-isolation -e . (the 'dynashard' entry point; torch untouched)"
            timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
                || echo "   pip install failed: S0 will say whether the backend is registered"
        fi
    fi
    for stage in ${STAGES//,/ }; do
        json=$DIR/gpu_check_s$stage.json
        [ -n "${LIMIT[$stage]:-}" ] || { echo "gpu_check.sh: no stage $stage (0-4)"; continue; }
        now=$(date +%s)
        left=$(( DEADLINE - (now - start) ))
        limit=${LIMIT[$stage]}
        [ "$left" -lt "$limit" ] && limit=$left
        if [ "$limit" -lt 20 ]; then
            record "$stage" SKIP "not started: ${left}s left of the ${DEADLINE}s deadline (GPU_CHECK_DEADLINE_S)" "$json"
            continue
        fi
        timeout --kill-after=10 "$limit" "$PY" -m benchmarks.gpu_check "s$stage" --out "$DIR" \
            --timeout $(( limit - 15 > 10 ? limit - 15 : 10 )) $([ "$DRY" = 1 ] && echo --dry-run)
        rc=$?
        if [ ! -s "$json" ] || [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
            case $rc in
                124|137) why="timed out after ${limit}s" ;;
                *) why="the stage process exited $rc without writing its record" ;;
            esac
            record "$stage" FAIL "$why" "$json"
        fi
    done
    "$PY" - "$DIR" "$STAGES" "$(( $(date +%s) - start ))" "$DRY" <<'EOF'
import glob, json, os, sys
out, stages, secs, dry = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4] == "1"
recs = {}
for s in stages:
    path = os.path.join(out, f"gpu_check_s{s}.json")
    recs[f"S{s}"] = json.load(open(path)) if os.path.exists(path) else {"verdict": "FAIL", "line": "no record"}
verdicts = {k: r["verdict"] for k, r in recs.items()}
first = next(iter(r for r in recs.values() if "torch" in r), {})
summary = {"name": "gpu_check", "dry_run": dry, "seconds": secs, "verdicts": verdicts,
           "ok": "FAIL" not in verdicts.values(), "lines": {k: r.get("line") for k, r in recs.items()},
           **{k: first.get(k) for k in ("date", "commit", "torch", "gpu", "host")}}
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(f"== gpu_check{' (DRY RUN)' if dry else ''}: " + ", ".join(f"{k} {v}" for k, v in verdicts.items())
      + f" in {secs} s; records in {out}")
sys.exit(0 if summary["ok"] else 1)
EOF
}

# A stage that wrote nothing (killed, crashed, never started) still gets its verdict line and record.
record() {
    local stage=$1 verdict=$2 why=$3 json=$4
    echo "[S$stage] $verdict $why"
    "$PY" -c 'import json, sys; s, v, why, path, dry = sys.argv[1:6]
json.dump({"stage": "S" + s, "verdict": v, "dry_run": dry == "1", "line": f"[S{s}] {v} {why}",
           "checks": [{"name": "stage", "verdict": v, "detail": why}]}, open(path, "w"), indent=1)' \
        "$stage" "$verdict" "$why" "$json" "$DRY"
}

run 2>&1 | tee "$DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
