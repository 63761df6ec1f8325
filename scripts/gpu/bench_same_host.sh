#!/usr/bin/env bash
# The same-host transport's device flavour on ONE GPU (bench/bench_same_host_one_gpu.cu): the
# trainer and the engine as two processes on GPU 0, for the Qwen2.5-0.5B, Llama-3-8B and
# Qwen2.5-14B layouts; then its plot. Run from anywhere (it works from the repository root); it
# configures build-gpu/ as scripts/gpu/run.sh tests does and builds only bench_same_host_one_gpu.
#
#   bash scripts/gpu/run.sh bench-same-host [--commit SHA] [-- BENCH_ARGS...]
#
#   --commit SHA   stamped into every artefact (default: $SHADOWSYNC_COMMIT, else git, else unknown;
#                  pass it when the tree is a copy without .git)
#   BENCH_ARGS     passed to bench_same_host_one_gpu (e.g. --models llama3-8b, --updates 100,
#                  --sources shared, --checksums, --budget 120)
#
# Writes to ${OUT:-./gpu-out} (6 files): env.log (the machine, its compute mode), build.log,
# bench.log (progress lines and tables), and the run's bench-same-host-<UTC>.json, .md and .png.
# The benchmark keeps to a 200 s budget (watchdog at 235 s); building it on a fresh machine adds
# one to three minutes.
# Exit status: the benchmark's (0 every model ran; 1 a model failed; 3 watchdog; 77 no GPU), or 1
# when the build failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly ROOT=$PWD

COMMIT="${SHADOWSYNC_COMMIT:-}"
BENCH_ARGS=()
while (($#)); do
  case "$1" in
    --commit) COMMIT="${2:?--commit needs a value}"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu/run.sh bench-same-host: unknown argument '$1' (see --help)" >&2; exit 2 ;;
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
log() { echo "[gpu_bench_same_host $(printf '%3d' "$SECONDS")s] $*"; }

# shellcheck source=scripts/gpu/common.sh
source "$ROOT/scripts/gpu/common.sh"

# --- the machine ---------------------------------------------------------------------------------
{
  echo "== command"; echo "bash scripts/gpu/run.sh bench-same-host --commit $COMMIT ${BENCH_ARGS[*]:+-- ${BENCH_ARGS[*]}}"
  gpu_machine_report
  # Two processes on one GPU share it by time slices unless MPS runs; say which.
  echo "== compute mode"; nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader
  echo "== MPS"; if ls /tmp/nvidia-mps/control >/dev/null 2>&1 || [[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]]; then echo "an MPS control pipe is present"; else echo "no MPS control pipe (/tmp/nvidia-mps, \$CUDA_MPS_PIPE_DIRECTORY)"; fi
} >"$OUT_DIR/env.log" 2>&1
if ! nvidia-smi -L >/dev/null 2>&1; then
  log "SKIP: no GPU (nvidia-smi -L failed)"
  exit 77
fi
MACHINE="1x $(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null || echo 'unknown GPU')"
log "machine: $MACHINE; commit $COMMIT"

# --- build (as scripts/gpu/run.sh tests configures build-gpu/) -------------------------------------
readonly BUILD="$ROOT/build-gpu"
if ! gpu_unpack_deps "$ROOT"; then
  log "FAIL: $DEPS_MESSAGE"
  exit 1
fi
log "$DEPS_MESSAGE"
: >"$OUT_DIR/build.log"
# Configured every time (seconds when build-gpu/ exists): a build-gpu/ configured before this
# benchmark existed would not know its target yet.
log "configuring $BUILD"
if ! gpu_configure "$ROOT" "$BUILD" "$OUT_DIR/build.log" 180; then
  tail -30 "$OUT_DIR/build.log"
  log "FAIL: configure (see build.log)"
  exit 1
fi
log "building bench_same_host_one_gpu with -j$(nproc)"
if ! timeout 300 cmake --build "$BUILD" -j "$(nproc)" --target bench_same_host_one_gpu >>"$OUT_DIR/build.log" 2>&1; then
  grep -E 'error|Error' "$OUT_DIR/build.log" | head -30
  log "FAIL: build (see build.log)"
  exit 1
fi
log "built"

# --- run ------------------------------------------------------------------------------------------
BENCH=("$BUILD/bench/bench_same_host_one_gpu" --out "$OUT_DIR" --commit "$COMMIT" --machine "$MACHINE" "${BENCH_ARGS[@]}")
log "running: ${BENCH[*]}"
timeout 280 "${BENCH[@]}" 2>&1 | tee "$OUT_DIR/bench.log"
rc=${PIPESTATUS[0]}
log "bench_same_host_one_gpu exit status $rc"

# --- plot -----------------------------------------------------------------------------------------
json=$(ls -t "$OUT_DIR"/bench-same-host-*.json 2>/dev/null | head -1)
if [[ -n "$json" ]]; then
  if ! python3 "$ROOT/bench/plot_same_host.py" "$json"; then
    log "plot failed (matplotlib missing?); the JSON and Markdown are there"
  fi
else
  log "no results JSON in $OUT_DIR"
fi
log "done: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit "$rc"
