#!/usr/bin/env bash
# The one-GPU benchmarks, on a GPU machine, after scripts/gpu/run.sh tests configured build-gpu/
# with CUDA on (see docs/benchmarks.md):
#
#   bash scripts/gpu/run.sh bench-one-gpu [--updates N] [--link-gbps G] [--skip-swap] [--commit SHA]
#
#   bench_integrity_one_gpu --updates N [--link-gbps G]   the receiver's checks: kernels alone and
#                                                         inside a receive (default N = 10)
#   bench_swap_one_gpu --swaps N                          the swap strategies' stall (unless
#                                                         --skip-swap)
#   --commit SHA   the commit to print (default: git's; pass it when the tree is a copy without
#                  .git)
#
# Output: ${OUT:-./gpu-out}/bench_one_gpu.txt (the machine, the commit, each command and its
# tables). Exit status: 0, 1 if a build or a program failed, 77 without a GPU.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly ROOT=$PWD
readonly BUILD="$ROOT/build-gpu"

UPDATES=10
LINK=()
SWAP=1
COMMIT=""
while (($#)); do
  case "$1" in
    --updates) UPDATES="${2:?--updates needs a number}"; shift ;;
    --link-gbps) LINK=(--link-gbps "${2:?--link-gbps needs GB/s}"); shift ;;
    --skip-swap) SWAP=0 ;;
    --commit) COMMIT="${2:?--commit needs a SHA}"; shift ;;
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu/run.sh bench-one-gpu: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -f "$BUILD/CMakeCache.txt" ]] || { echo "gpu/run.sh bench-one-gpu: $BUILD is not configured; run scripts/gpu/run.sh tests first" >&2; exit 1; }
nvidia-smi -L >/dev/null 2>&1 || { echo "SKIP: no GPU (nvidia-smi -L failed)"; exit 77; }

OUT_DIR="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT_DIR"
readonly REPORT="$OUT_DIR/bench_one_gpu.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: ${COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} >"$REPORT"

targets=(bench_integrity_one_gpu)
((SWAP)) && targets+=(bench_swap_one_gpu)
if ! cmake --build "$BUILD" -j "$(nproc)" --target "${targets[@]}" >>"$REPORT.build" 2>&1; then
  tail -30 "$REPORT.build"
  echo "FAIL build of ${targets[*]}" | tee -a "$REPORT"
  exit 1
fi
rm -f "$REPORT.build"

FAILED=0
run() {
  echo "\$ $*" | tee -a "$REPORT"
  "$@" 2>&1 | tee -a "$REPORT"
  local rc=${PIPESTATUS[0]}
  ((rc == 0)) || { echo "FAIL ($rc): $*" | tee -a "$REPORT"; FAILED=1; }
}
run "$BUILD/bench/bench_integrity_one_gpu" --updates "$UPDATES" "${LINK[@]}"
((SWAP)) && run "$BUILD/bench/bench_swap_one_gpu" --swaps "$UPDATES"
exit "$FAILED"
