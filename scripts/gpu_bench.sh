#!/usr/bin/env bash
# Runs the update benchmark (bench/bench_gpu.cu) on a GPU machine with two GPUs, then plots it.
# Run it from the repository root after scripts/gpu_run.sh built build-gpu/ (or let it build
# bench_gpu the same way: it needs the .deb files of scripts/gpu_collect_debs.sh in .deps/).
#
#   bash scripts/gpu_bench.sh [--commit SHA] [-- BENCH_ARGS...]
#
# With the device tool (the working tree has no .git there, so pass the commit):
#   run(kind="nvidia-h200-x2", carry=[".deps"], timeout_s=600,
#       command="bash scripts/gpu_bench.sh --commit <sha>")
#
#   --commit SHA   stamped into every artefact (default: $SHADOWSYNC_COMMIT, else git, else unknown)
#   BENCH_ARGS     passed to bench_gpu (e.g. --no-sweep, --models llama3-8b, --budget 120)
#
# Writes to ${OUT:-./gpu-out} (6 files): env.log, build.log, bench.log, and the run's
# bench-gpu-<UTC>.json, .md and .png. The benchmark itself keeps to a 210 s budget (watchdog at
# 235 s); building bench_gpu on a fresh machine adds about a minute.
# Exit status: the benchmark's (0 every phase ran; 1 a phase failed; 3 watchdog; 77 < 2 GPUs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
readonly ROOT=$PWD

COMMIT="${SHADOWSYNC_COMMIT:-}"
BENCH_ARGS=()
while (($#)); do
  case "$1" in
    --commit) COMMIT="${2:?--commit needs a value}"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_bench.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
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

# NVLink multicast (NVLS) off: see .library/device KINDS.md and docs/gpu.md.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# --- the machine ---------------------------------------------------------------------------------
{
  echo "== date"; date -u
  echo "== command"; echo "bash scripts/gpu_bench.sh --commit $COMMIT ${BENCH_ARGS[*]:+-- ${BENCH_ARGS[*]}}"
  echo "== nvidia-smi -L"; nvidia-smi -L
  echo "== nvidia-smi topo -m"; nvidia-smi topo -m
  echo "== nvidia-smi"
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,clocks.max.sm,clocks.sm,power.limit,temperature.gpu --format=csv
  echo "== tools"; command -v nvcc && nvcc --version | tail -2; cmake --version | head -1; g++ --version | head -1
  echo "== nccl.h"; grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' /usr/include/nccl.h 2>/dev/null
  echo "== env"; env | grep -E '^(NCCL_|TORCH_SYMM|NVSHMEM_|CUDA_VISIBLE)' | sort
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

# --- build bench_gpu (as scripts/gpu_run.sh configures build-gpu/) -------------------------------
readonly BUILD="$ROOT/build-gpu"
readonly PREFIX="$ROOT/.deps/prefix"
readonly FMT_DIR="$PREFIX/usr/lib/x86_64-linux-gnu/cmake/fmt"
readonly CATCH2_DIR="$PREFIX/usr/lib/cmake/Catch2"
readonly CQ_DIR="$PREFIX/usr/include/concurrentqueue"
if [[ ! -f "$FMT_DIR/fmt-config.cmake" || ! -f "$CQ_DIR/blockingconcurrentqueue.h" ]]; then
  shopt -s nullglob
  debs=("$ROOT"/.deps/*.deb)
  shopt -u nullglob
  if ((${#debs[@]} == 0)); then
    log "FAIL: no .deb files in .deps/ (run scripts/gpu_collect_debs.sh on the dev machine and carry .deps)"
    exit 1
  fi
  mkdir -p "$PREFIX"
  for deb in "${debs[@]}"; do dpkg -x "$deb" "$PREFIX" || { log "FAIL: dpkg -x $deb"; exit 1; }; done
fi
export CPLUS_INCLUDE_PATH="$PREFIX/usr/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

: >"$OUT_DIR/build.log"
# Configured every time (seconds when build-gpu/ exists): a build-gpu/ configured before
# bench/bench_gpu.cu existed would not know the target yet.
generator=()
if [[ ! -f "$BUILD/CMakeCache.txt" ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
log "configuring $BUILD"
if ! timeout 180 cmake -S "$ROOT" -B "$BUILD" "${generator[@]}" \
    -DSHADOWSYNC_WITH_CUDA=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$PREFIX/usr" \
    -Dfmt_DIR="$FMT_DIR" \
    -DCatch2_DIR="$CATCH2_DIR" \
    -DSHADOWSYNC_CONCURRENTQUEUE_INCLUDE_DIR="$CQ_DIR" \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    >>"$OUT_DIR/build.log" 2>&1; then
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
