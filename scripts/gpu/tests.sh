#!/usr/bin/env bash
# Builds and runs the GPU tests on a GPU machine, in one command, from the repository root. The
# build dependencies come from the system (scripts/deps.sh), or from .deps/ if it holds Debian
# packages (scripts/gpu/common.sh). See docs/testing.md.
#
#   bash scripts/gpu/run.sh tests [--sanitize] [--receivers R] [--all] [--no-examples] [--no-faults]
#                           [--budget SECONDS]
#
#   (always)       unpack .deps/*.deb into .deps/prefix if there are any, print the GPUs and their
#                  topology, configure build-gpu/ with CUDA on, build the GPU tests, and run
#                  `ctest --output-on-failure -L gpu` (test_cuda_transport_smoke, test_gpu_updates
#                  with its defaults: 1 receiver, 1000 updates, both engine modes, medium layout).
#   (unless --no-examples) build control_channel and shadowsync_c and run scripts/gpu/examples.sh:
#                  the two-process example (trainer GPU 0, engine GPU 1, 50 rounds, torn=0) and
#                  the mini vLLM-like worker's pytest (cpu and cuda cases). Skipped below 2 GPUs.
#   (unless --no-faults) build control_channel and run scripts/gpu/faults.sh: trainer processes
#                  SIGKILLed and SIGSTOPped mid-update, 20 kill/restart cycles with the engine's
#                  device memory printed (its log is appended to examples.log). Skipped below 2 GPUs.
#   --sanitize     also run test_gpu_updates --layout small --updates 50 under compute-sanitizer,
#                  --tool memcheck and --tool racecheck (NCCL's own kernels excluded).
#   --receivers R  also run test_gpu_updates --receivers R (needs R+1 GPUs; skipped otherwise).
#   --all          build every target (CPU tests too), not only the GPU tests.
#   --no-examples  do not build or run the examples step.
#   --no-faults    do not build or run the fault step.
#   --budget S     stop starting new steps once S seconds have passed (default 540, so that the
#                  whole run stays within ten minutes).
#
# Logs go to ${OUT:-./gpu-out} (eight files at most): env.log,
# build.log, ctest.log, examples.log, memcheck.log, racecheck.log, receivers.log, summary.txt.
# Exit status: 0 if every step that ran passed (a test that skips for lack of GPUs passes), else 1.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly ROOT=$PWD

SANITIZE=0
RECEIVERS=""
BUILD_ALL=0
EXAMPLES=1
FAULTS=1
BUDGET=540
while (($#)); do
  case "$1" in
    --sanitize) SANITIZE=1 ;;
    --receivers) RECEIVERS="${2:?--receivers needs a number}"; shift ;;
    --all) BUILD_ALL=1 ;;
    --no-examples) EXAMPLES=0 ;;
    --no-faults) FAULTS=0 ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu/run.sh tests: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -n "$RECEIVERS" && ! "$RECEIVERS" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu/run.sh tests: --receivers needs a positive number, got '$RECEIVERS'" >&2
  exit 2
fi

OUT_DIR="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT_DIR"
readonly SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
FAILED=0
SECONDS=0

log() { echo "[gpu_run $(printf '%3d' "$SECONDS")s] $*"; }
note() { log "$*"; echo "$*" >>"$SUMMARY"; }
left() { echo $((BUDGET - SECONDS)); }
# step_timeout WANT: WANT seconds, or what is left of the budget (minus a margin) if less.
step_timeout() {
  local want=$1 rest
  rest=$(($(left) - 15))
  ((rest < want)) && want=$rest
  echo "$want"
}

# shellcheck source=scripts/gpu/common.sh
source "$ROOT/scripts/gpu/common.sh"

# --- 1. dependencies: the system's, or .deps/*.deb ------------------------------------------------
if gpu_unpack_deps "$ROOT"; then
  note "ok   deps: $DEPS_MESSAGE"
else
  note "FAIL deps: $DEPS_MESSAGE"
  exit 1
fi

# --- 2. the machine ------------------------------------------------------------------------------
gpu_machine_report >"$OUT_DIR/env.log" 2>&1
cat "$OUT_DIR/env.log"
GPU_COUNT=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
note "info gpus: $GPU_COUNT"

# --- 3. configure and build ----------------------------------------------------------------------
readonly BUILD="$ROOT/build-gpu"
JOBS=$(nproc)
log "configuring $BUILD"
: >"$OUT_DIR/build.log"
if ! gpu_configure "$ROOT" "$BUILD" "$OUT_DIR/build.log" "$(step_timeout 180)"; then
  tail -40 "$OUT_DIR/build.log"
  note "FAIL configure (see build.log)"
  exit 1
fi
grep -E 'shadowsync: CUDA' "$OUT_DIR/build.log" | tee -a "$SUMMARY"

build_failed=()
if ((BUILD_ALL)); then
  log "building all targets with -j$JOBS"
  if ! timeout "$(step_timeout 360)" cmake --build "$BUILD" -j "$JOBS" >>"$OUT_DIR/build.log" 2>&1; then
    build_failed+=(all)
  fi
else
  # The library and the test kit first, then one target per tests/gpu file (gpu_<stem>, see
  # cmake/ShadowsyncTesting.cmake), each on its own so that one that does not compile (work in
  # progress elsewhere) does not keep the others from running.
  log "building shadowsync_testkit with -j$JOBS"
  if ! timeout "$(step_timeout 300)" cmake --build "$BUILD" -j "$JOBS" --target shadowsync_testkit \
      >>"$OUT_DIR/build.log" 2>&1; then
    build_failed+=(shadowsync_testkit)
  else
    for f in "$ROOT"/tests/gpu/*.cpp "$ROOT"/tests/gpu/*.cu; do
      [[ -e "$f" ]] || continue
      stem=$(basename "$f"); stem=${stem%.*}
      log "building gpu_$stem"
      if ! timeout "$(step_timeout 300)" cmake --build "$BUILD" -j "$JOBS" --target "gpu_$stem" \
          >>"$OUT_DIR/build.log" 2>&1; then
        build_failed+=("gpu_$stem")
      fi
    done
    # What scripts/gpu/examples.sh runs: the two-process example and the C ABI for Python.
    if ((EXAMPLES || FAULTS)); then
      for target in control_channel shadowsync_c; do
        log "building $target"
        if ! timeout "$(step_timeout 300)" cmake --build "$BUILD" -j "$JOBS" --target "$target" \
            >>"$OUT_DIR/build.log" 2>&1; then
          build_failed+=("$target")
        fi
      done
    fi
  fi
fi
if ((${#build_failed[@]})); then
  grep -E 'error|Error' "$OUT_DIR/build.log" | head -40
  note "FAIL build: ${build_failed[*]} (see build.log)"
  FAILED=1
  [[ -x "$BUILD/tests/gpu/test_gpu_updates" ]] || exit 1
else
  note "ok   build ($SECONDS s so far)"
fi

# --- 4. ctest -L gpu -----------------------------------------------------------------------------
t=$(step_timeout 300)
if ((t < 60)); then
  note "SKIP ctest -L gpu: only $(left) s of the budget left"
  FAILED=1
else
  log "ctest -L gpu (timeout $t s)"
  (cd "$BUILD" && timeout "$t" ctest --output-on-failure -L gpu --timeout "$t") >"$OUT_DIR/ctest.log" 2>&1
  rc=$?
  cat "$OUT_DIR/ctest.log"
  # ctest keeps a passing test's output in LastTest.log only.
  grep -hE '^gpu_updates: (receivers|transfer)|^receiver ' "$OUT_DIR/ctest.log" \
    "$BUILD/Testing/Temporary/LastTest.log" 2>/dev/null | sort -u >>"$SUMMARY"
  if ((rc == 0)); then note "ok   ctest -L gpu"; else note "FAIL ctest -L gpu (rc $rc, see ctest.log)"; FAILED=1; fi
fi

readonly TEST_BIN="$BUILD/tests/gpu/test_gpu_updates"

# run_step NAME LOG WANT_SECONDS COMMAND...: runs with a timeout; 77 counts as skipped.
run_step() {
  local name=$1 logfile=$2 want=$3 t rc
  shift 3
  t=$(step_timeout "$want")
  if ((t < 30)); then
    note "SKIP $name: only $(left) s of the budget left"
    return
  fi
  log "$name (timeout $t s): $*"
  timeout "$t" "$@" >"$logfile" 2>&1
  rc=$?
  tail -25 "$logfile"
  case $rc in
    0) note "ok   $name" ;;
    77) note "skip $name: $(grep -m1 '^SKIP' "$logfile")" ;;
    124) note "FAIL $name: timed out after $t s (see $(basename "$logfile"))"; FAILED=1 ;;
    *) note "FAIL $name (rc $rc, see $(basename "$logfile"))"; FAILED=1 ;;
  esac
}

# --- 5. the examples on two GPUs ------------------------------------------------------------------
if ((EXAMPLES)); then
  run_step "examples (two-process, mini worker)" "$OUT_DIR/examples.log" 300 \
    bash "$ROOT/scripts/gpu/examples.sh" "$BUILD"
  grep -E '^(two_process|mini_worker): ' "$OUT_DIR/examples.log" >>"$SUMMARY" 2>/dev/null
fi

# --- 5b. the fault runs on two GPUs --------------------------------------------------------------
if ((FAULTS)); then
  # Its log joins examples.log afterwards, to keep the logs to eight files.
  run_step "faults (SIGKILL, SIGSTOP, 20 kill/restart cycles)" "$OUT_DIR/faults.tmp" 300 \
    bash "$ROOT/scripts/gpu/faults.sh" "$BUILD"
  grep -E '^(fault |cycle |faults: )' "$OUT_DIR/faults.tmp" >>"$SUMMARY" 2>/dev/null
  { echo "===== scripts/gpu/faults.sh"; cat "$OUT_DIR/faults.tmp"; } >>"$OUT_DIR/examples.log" 2>/dev/null
  rm -f "$OUT_DIR/faults.tmp"
fi

# --- 6. optional: more receivers -----------------------------------------------------------------
if [[ -n "$RECEIVERS" ]]; then
  run_step "test_gpu_updates --receivers $RECEIVERS" "$OUT_DIR/receivers.log" 240 \
    "$TEST_BIN" --receivers "$RECEIVERS"
  grep -E '^gpu_updates: (receivers|transfer)|^receiver ' "$OUT_DIR/receivers.log" >>"$SUMMARY" 2>/dev/null
fi

# --- 7. optional: compute-sanitizer --------------------------------------------------------------
if ((SANITIZE)); then
  SANITIZER=$(command -v compute-sanitizer || true)
  for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [[ -z "$SANITIZER" && -x "$candidate" ]] && SANITIZER=$candidate
  done
  if [[ -z "$SANITIZER" ]]; then
    note "FAIL sanitize: compute-sanitizer not found"
    FAILED=1
  else
    # NCCL's kernels are excluded: they are not ours, and they spin on peers, which is slow there.
    # API errors are not reported: NCCL probes (cudaFuncGetAttributes on kernels it has no sm_90
    # image of, enabling peer access that is already enabled) and each probe would count as an
    # error; memory errors in kernels and racecheck hazards are what these runs are for.
    for tool in memcheck racecheck; do
      run_step "compute-sanitizer --tool $tool" "$OUT_DIR/$tool.log" 180 \
        "$SANITIZER" --tool "$tool" --error-exitcode 1 --kernel-name-exclude kns=nccl \
        --report-api-errors no \
        "$TEST_BIN" --layout small --updates 50
      grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^gpu_updates: receivers' "$OUT_DIR/$tool.log" >>"$SUMMARY" 2>/dev/null
    done
  fi
fi

log "summary ($SECONDS s):"
cat "$SUMMARY"
exit "$FAILED"
