#!/usr/bin/env bash
# Runs the update benchmark (bench/bench_gpu.cu) on a GPU machine with two GPUs, then plots it.
# Run it from the repository root; it configures build-gpu/ as scripts/gpu/run.sh tests does and
# builds bench_gpu.
#
#   bash scripts/gpu/run.sh bench [--commit SHA] [-- BENCH_ARGS...]
#
#   --commit SHA   stamped into every artefact (default: $SHADOWSYNC_COMMIT, else git, else unknown;
#                  pass it when the tree is a copy without .git)
#   BENCH_ARGS     passed to bench_gpu (e.g. --no-sweep, --models llama3-8b, --budget 120)
#
# Writes to ${OUT:-./gpu-out} (6 files): env.log, build.log, bench.log, and the run's
# bench-gpu-<UTC>.json, .md and .png. The benchmark itself keeps to a 210 s budget (watchdog at
# 235 s); building bench_gpu on a fresh machine adds about a minute.
# Exit status: the benchmark's (0 every phase ran; 1 a phase failed; 3 watchdog; 77 < 2 GPUs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly ROOT=$PWD

COMMIT="${SHADOWSYNC_COMMIT:-}"
BENCH_ARGS=()
while (($#)); do
  case "$1" in
    --commit) COMMIT="${2:?--commit needs a value}"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu/run.sh bench: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "$COMMIT" ]]; then
  COMMIT=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  if [[ "$COMMIT" != unknown ]] && [[ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]]; then
    COMMIT="$COMMIT-dirty"
  fi
fi

OUT_DIR="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT_DIR"
SECONDS=0
log() { echo "[gpu_bench $(printf '%3d' "$SECONDS")s] $*"; }

# shellcheck source=scripts/gpu/common.sh
source "$ROOT/scripts/gpu/common.sh"

# --- the machine ---------------------------------------------------------------------------------
{
  echo "== command"; echo "bash scripts/gpu/run.sh bench --commit $COMMIT ${BENCH_ARGS[*]:+-- ${BENCH_ARGS[*]}}"
  gpu_machine_report
} >"$OUT_DIR/env.log" 2>&1
GPU_COUNT=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
log "gpus: $GPU_COUNT; commit $COMMIT"
# The machine as nvidia-smi names it (GPU 0 and GPU 1: the two the benchmark uses).
mapfile -t NAMES < <(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -2)
MACHINE="unknown GPUs"
if ((${#NAMES[@]} == 2)) && [[ "${NAMES[0]}" == "${NAMES[1]}" ]]; then
  MACHINE="2x ${NAMES[0]}"
elif ((${#NAMES[@]} >= 1)); then
  MACHINE=$(IFS=+; echo "${NAMES[*]}")
fi

# --- build bench_gpu (as scripts/gpu/run.sh tests configures build-gpu/) ------------------------
readonly BUILD="$ROOT/build-gpu"
if ! gpu_unpack_deps "$ROOT"; then
  log "FAIL: $DEPS_MESSAGE"
  exit 1
fi
log "$DEPS_MESSAGE"

: >"$OUT_DIR/build.log"
# Configured every time (seconds when build-gpu/ exists): a build-gpu/ configured before
# bench/bench_gpu.cu existed would not know the target yet.
log "configuring $BUILD"
if ! gpu_configure "$ROOT" "$BUILD" "$OUT_DIR/build.log" 180; then
  tail -30 "$OUT_DIR/build.log"
  log "FAIL: configure (see build.log)"
  exit 1
fi
log "building bench_gpu with -j$(nproc)"
if ! timeout 300 cmake --build "$BUILD" -j "$(nproc)" --target bench_gpu >>"$OUT_DIR/build.log" 2>&1; then
  grep -E 'error|Error' "$OUT_DIR/build.log" | head -30
  log "FAIL: build (see build.log)"
  exit 1
fi
log "built"

# --- run ------------------------------------------------------------------------------------------
BENCH=("$BUILD/bench/bench_gpu" --out "$OUT_DIR" --commit "$COMMIT" --machine "$MACHINE" "${BENCH_ARGS[@]}")
log "running: ${BENCH[*]}"
timeout 280 "${BENCH[@]}" 2>&1 | tee "$OUT_DIR/bench.log"
rc=${PIPESTATUS[0]}
log "bench_gpu exit status $rc"

# --- plot -----------------------------------------------------------------------------------------
json=$(ls -t "$OUT_DIR"/bench-gpu-*.json 2>/dev/null | head -1)
if [[ -n "$json" ]]; then
  if ! python3 "$ROOT/bench/plot_bench.py" "$json"; then
    log "plot failed (matplotlib missing?); the JSON and Markdown are there"
  fi
else
  log "no results JSON in $OUT_DIR"
fi
log "done: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit "$rc"
