#!/usr/bin/env bash
# One unattended check of Laya on a lent GPU machine, in under 8 minutes, ending in one summary.
#
#   tools/gpu_check.sh                 # on the GPU machine (an H200 with torch + CUDA, nvcc)
#   tools/gpu_check.sh --cpu-dry-run   # anywhere: the same plumbing, tiny models, on the CPU
#
# Stages (tools/gpu_check/*.py; each under a time limit, each recorded PASS / FAIL / SKIPPED
# with its reason, and a failure never stops the ones after it):
#   environment   the machine, the carried wheels installed, the source tree made importable
#   router_build  the C++ router (nanobind) compiled, in the background   [GPU run]
#   exl2_build    exllamav2's CUDA extension compiled, in the background  [GPU run]
#   models        random-weight Llama models of 1B and 8B shape, built on the GPU
#   logits        the torch backend on CUDA against transformers: logits and greedy tokens
#   throughput    laya serve against transformers' generate at c=1 and c=64, the battery
#   gpu_tests     the repository's GPU-only tests
#   exl2          the 1B model quantized to EXL2, served by the exl2 backend, the battery
# The results: $OUT/gpu_check.json, $OUT/summary.txt, and stages.log, builds.log and
# servers.log beside them.
#
# Environment: OUT (default tools/gpu_check/out), GPU_CHECK_WORK (models and builds, default
# /tmp/gpu_check_work), GPU_CHECK_SECONDS (the cap: 480, dry run 240), PYTHON (python3; in a
# dry run the repository's .venv if it has one), GPU_CHECK_ONLY (stages to run, comma
# separated; the rest are recorded as skipped), GPU_CHECK_EXL2_OPTIONS (the exl2 backend's
# [models.options], JSON), MAX_JOBS (exllamav2's compile jobs, 12), GPU_CHECK_ROUTER=1 (build
# the C++ router in a dry run too).
#
# The GPU machine reaches no package index: first, on a machine that does, run
# tools/gpu_check/prepare_wheels.sh (about 11 MiB of wheels for Python 3.12 into
# tools/gpu_check/wheels, which git ignores), and take that folder along with the tree.
# Exit status: 0 when no stage failed, else 1 (the summary says which and why).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HERE=$REPO/tools/gpu_check
[[ ${1:-} == --cpu-dry-run ]] && export GPU_CHECK_DRY=1
DRY=0
[[ ${GPU_CHECK_DRY:-0} != 0 && -n ${GPU_CHECK_DRY:-} ]] && DRY=1
export GPU_CHECK_DRY=$DRY

if (( DRY )); then
    CAP=${GPU_CHECK_SECONDS:-240}
    [[ -x $REPO/.venv/bin/python ]] && : "${PYTHON:=$REPO/.venv/bin/python}"
else
    CAP=${GPU_CHECK_SECONDS:-480}
fi
PYTHON=${PYTHON:-python3}
RESERVE=12  # seconds kept at the end for the summary and stopping what still runs
export OUT=${OUT:-$HERE/out}
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
WORK=$GPU_CHECK_WORK
SITE=$WORK/site
WHEELS=${GPU_CHECK_WHEELS:-$HERE/wheels}

START=$SECONDS
left() { echo $(( CAP - (SECONDS - START) )); }
report() { "$PYTHON" "$HERE/report.py" "$@"; }
selected() { [[ -z ${GPU_CHECK_ONLY:-} || ,$GPU_CHECK_ONLY, == *,$1,* ]]; }

# A rerun of some stages (GPU_CHECK_ONLY) keeps the models and the compiled extension.
rm -rf "$WORK/results" "$WORK/logs" "$WORK/pids" "$SITE" "$WORK/router_site"
selected models && rm -rf "$WORK/models"
mkdir -p "$OUT" "$WORK/results" "$WORK/logs" "$WORK/pids"
rm -f "$OUT/gpu_check.json" "$OUT/summary.txt" "$OUT"/*.log

GPU_CHECK_STARTED=$(date +%s)
export GPU_CHECK_STARTED
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export TRANSFORMERS_VERBOSITY=error
export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions MAX_JOBS=${MAX_JOBS:-12}
# The Python's own bin folder first: ninja, cmake and pip's scripts live there.
PATH=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')"):$PATH

# run_stage NAME BUDGET_S MIN_S COMMAND...: COMMAND under min(BUDGET_S, what the cap leaves),
# its output in $WORK/logs/NAME.log; skipped when less than MIN_S is left.
run_stage() {
    local name=$1 budget=$2 min=$3 limit rc
    shift 3
    limit=$(( $(left) - RESERVE ))
    (( budget < limit )) && limit=$budget
    if ! selected "$name"; then
        report record "$name" SKIPPED "not in GPU_CHECK_ONLY"
    elif [[ -n ${BLOCKED:-} ]]; then
        report record "$name" SKIPPED "$BLOCKED"
    elif (( limit < min )); then
        report record "$name" SKIPPED "no time left: ${limit} s of the ${CAP} s cap remained, it needs ${min} s"
    else
        echo "gpu_check: $name (at most ${limit} s, $(( SECONDS - START )) s in)"
        export GPU_CHECK_STAGE_DEADLINE=$(( $(date +%s) + limit ))
        timeout --kill-after=10 "$limit" "$@" >>"$WORK/logs/$name.log" 2>&1
        rc=$?
        if (( rc == 124 || rc == 137 )); then
            report record "$name" FAIL "ran past its ${limit} s and was stopped"
        else
            report record "$name" FAIL "exited with status $rc before recording a result"
        fi
    fi
    report collect
}

# start_bg NAME COMMAND...: COMMAND in a session of its own at low priority (it compiles
# while the GPU stages run), its id in $WORK/pids/NAME.pid.
start_bg() {
    local name=$1
    shift
    if ! selected "$name"; then
        report record "$name" SKIPPED "not in GPU_CHECK_ONLY"
        return
    fi
    echo "gpu_check: $name started in the background"
    setsid nice -n 10 "$@" >>"$WORK/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$WORK/pids/$name.pid"
}

# finish_bg NAME WAIT_S: wait up to WAIT_S for a background stage, then stop it; true when it passed.
finish_bg() {
    local name=$1 until=$(( SECONDS + $2 )) pid
    pid=$(cat "$WORK/pids/$name.pid" 2>/dev/null) || return 1
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < until )); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        kill -- "-$pid" 2>/dev/null
        report record "$name" FAIL "still running after $(( SECONDS - START )) s and was stopped"
    fi
    report record "$name" FAIL "ended without recording a result"
    rm -f "$WORK/pids/$name.pid"
    report collect
    [[ $(report status "$name") == PASS ]]
}

stop_all() {
    local f
    for f in "$WORK"/pids/*.pid; do
        [[ -f $f ]] && kill -- "-$(cat "$f")" 2>/dev/null
        rm -f "$f"
    done
}
trap 'stop_all; report collect --print; exit 130' INT TERM

run_stage environment 90 10 "$PYTHON" "$HERE/setup_env.py" "$SITE" "$WHEELS"
# shellcheck source=/dev/null
[[ -f $SITE/env.sh ]] && source "$SITE/env.sh"
if [[ $(report status environment) != PASS ]]; then
    BLOCKED="the environment stage did not pass (see its reason)"
fi

if [[ -z ${BLOCKED:-} ]] && (( ! DRY || ${GPU_CHECK_ROUTER:-0} )); then
    ROUTER_JOBS=4 start_bg router_build "$PYTHON" "$HERE/builds.py" router "$WORK/router_site"
else
    report record router_build SKIPPED "${BLOCKED:-dry run (GPU_CHECK_ROUTER=1 builds it too)}"
fi
if [[ -z ${BLOCKED:-} ]] && (( ! DRY )); then
    start_bg exl2_build "$PYTHON" "$HERE/builds.py" exl2
else
    report record exl2_build SKIPPED "${BLOCKED:-dry run: exllamav2 needs CUDA}"
fi

run_stage models 150 20 "$PYTHON" "$HERE/make_models.py" 1b 8b
# Every stage from here on serves with the C++ router where it built, else Python's.
if [[ -f $WORK/pids/router_build.pid ]] && finish_bg router_build 20; then
    export PYTHONPATH=$WORK/router_site:$PYTHONPATH
fi
run_stage logits 120 30 "$PYTHON" "$HERE/compare_logits.py"
run_stage throughput 200 60 "$PYTHON" "$HERE/throughput.py"
run_stage gpu_tests 60 15 "$PYTHON" "$HERE/gpu_tests.py"
run_stage exl2 600 90 "$PYTHON" "$HERE/exl2.py"  # all that is left: the conversion is long
[[ -f $WORK/pids/exl2_build.pid ]] && finish_bg exl2_build 0

stop_all
report collect --print
# 1 when a stage failed, so that a caller notices; the summary says which and why.
! grep -q '"status": "FAIL"' "$OUT/gpu_check.json"
