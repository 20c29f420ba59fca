#!/usr/bin/env bash
# One prioritised check of fnmoe on a CUDA machine (one H200, under 6 minutes), run from the repo root:
#
#   bash tools/gpu_check.sh            # on the GPU machine
#   bash tools/gpu_check.sh --dry-run  # the same steps on CPU at tiny sizes (CI; < 60 s on 2 cores, cold cache;
#                                      # step 4 and 5's model eager there, steps 1 and 3 compile the MoE block once)
#
# Steps, in priority order, each its own process under a timeout (tools/gpu_check.py --step NAME runs
# tools/gpu_checks/NAME.py, one file a check; a crash or a hang in one does
# not stop the rest; rows finished before a timeout are kept):
#   1 correctness   grouped vs loop expert GEMMs, compiled MoE block, 3 tiny-preset training
#                   steps on cuda vs cpu, recompute, offload (when MemoryConfig has it)
#   2 k2layer       one Kimi-K2 MoE layer at the preset's per-GPU shapes (96 experts, one chunk), forward +
#                   recompute + backward: TFLOP/s beside the planner's expert-GEMM time, balanced and at
#                   plan.imbalance (~2 s of GPU at ~400 TFLOP/s, ~20 s with the process's start)
#   3 moe           tools/bench_moe.py on cuda (vs TorchTitan when it imports)
#   4 model         DeepSeek-V3-16B widths cut to 4 layers: tokens/s, MFU, peak memory per memory policy
#   5 determinism   tokens/s with and without torch.use_deterministic_algorithms
# then a summary table (tools/gpu_checks/summary.py), also written to $OUT/gpu_check.txt when $OUT is set.
#
# Needs Python with torch (no tyro, no torchtitan, no network). $PYTHON picks the interpreter;
# GPU_CHECK_BUDGET_S (default 350) caps the whole run; step timeouts shrink to fit it.
# Exit status: 0 when no check failed and no step died, else 1.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

DRY=""
case "${1:-}" in
  --dry-run) DRY="--dry-run" ;;
  "") ;;
  -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
  *) echo "usage: bash tools/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if command -v python >/dev/null 2>&1; then PY=python; else PY=python3; fi
fi
RESULTS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
export PYTHONUNBUFFERED=1
if [ -n "$DRY" ]; then
  BUDGET="${GPU_CHECK_BUDGET_S:-600}"   # generous: CI machines are slow and shared; the sizes keep it short
  # spinning OpenMP threads make a shared, oversubscribed CPU many times slower (measured 25x)
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
else
  BUDGET="${GPU_CHECK_BUDGET_S:-350}"
  # cuBLAS reads this when its handle is created: set for every step so step 5 can switch
  # deterministic mode on within one process (it is what --train.deterministic sets)
  export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
fi
START=$SECONDS
# each step prints its torch version and device when it starts (no extra interpreter start here)
echo "gpu_check: $PY is $(command -v "$PY") ($("$PY" -V 2>&1))"
echo "gpu_check: results in $RESULTS, budget ${BUDGET}s ${DRY}"

run_step() {  # run_step NAME CAP_SECONDS
  local name=$1 cap=$2 left t rc t0
  left=$(( BUDGET - (SECONDS - START) - 15 ))   # keep time for the summary
  t=$(( cap < left ? cap : left ))
  if [ "$t" -lt 20 ]; then
    echo "== step $name skipped: time budget spent"
    echo skipped > "$RESULTS/$name.rc"
    return
  fi
  echo "== step $name (timeout ${t}s, $(( SECONDS - START ))s elapsed)"
  t0=$SECONDS
  timeout -k 10 "$t" "$PY" tools/gpu_check.py --step "$name" --results "$RESULTS" --timeout "$t" $DRY
  rc=$?
  echo "$rc" > "$RESULTS/$name.rc"
  echo "== step $name: exit $rc after $(( SECONDS - t0 ))s"
}

if [ -n "$DRY" ]; then
  run_step correctness 150
  run_step k2layer 150
  run_step moe 150
  run_step model 150
  run_step determinism 150
else
  run_step correctness 80
  run_step k2layer 120
  run_step moe 50
  run_step model 90
  run_step determinism 50
fi

"$PY" tools/gpu_checks/summary.py --results "$RESULTS" $DRY   # imports no torch
rc=$?
[ -n "$DRY" ] && rm -rf "$RESULTS"   # CI: leave nothing behind (a GPU run keeps its per-step JSON files)
echo "gpu_check: total $(( SECONDS - START ))s"
exit $rc
