#!/usr/bin/env bash
# vLLM runs on a GPU machine: builds the C library with CUDA into build-gpu/ (and EXTRA_TARGETS),
# then runs what the environment asks for, each with its log under $OUT (default ./gpu-out).
# vLLM comes from the Python environment; a vLLM installed into a folder of its own (pip install
# --target DIR) is found when VLLM_SITE names that folder.
#   GPU_TESTS="a b"  tests/gpu/<a>, tests/gpu/<b> (built as gpu_<a>; Catch2 filters: GPU_TEST_ARGS)
#   SAME_HOST=1      tests/gpu/test_same_host_gpu and the mini worker's same-host cases
#   MEMCHECK=1       compute-sanitizer memcheck on test_same_host_gpu "[conformance]"
#   QUICK_START=1    the README's vLLM quick start on GPU 0 (python/tests/test_readme_quick_start.py)
#   E2E_RUNS="A;B"   scripts/vllm_e2e.py --device cuda with each ;-separated argument list
#   KV_CHECK="ARGS"  scripts/gpu/check_live_arena_kv.py ARGS (the live arena's KV-cache sizing)
#   BENCH_VLLM="A;B" bench/bench_vllm_update.py with each ;-separated argument list (one run:
#                    outputs in $OUT; several: in $OUT/bench-vllm-<i>/)
#   BENCH_PACING="..." bench/bench_vllm_pacing.py with these arguments (BENCH_TIMEOUT, default 420)
#   SKIP_BUILD=1     build-gpu is already built (two of these scripts running side by side on
#                    different GPUs must not configure the same build folder at once)
#
#   E2E_RUNS="--arch llama;--arch qwen2 --live-arena" bash scripts/gpu/vllm_runs.sh
#
# Each step has its own timeout; a failed step does not stop the next.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
source scripts/gpu/common.sh
gpu_unpack_deps "$PWD" >/dev/null
# with_vllm COMMAND...: COMMAND with VLLM_SITE, when set, first on PYTHONPATH.
VLLM_SITE="${VLLM_SITE:-}"
if [[ -n "$VLLM_SITE" && ! -d "$VLLM_SITE" ]]; then
  echo "vllm_runs.sh: VLLM_SITE=$VLLM_SITE is not a folder (a pip install --target folder of vLLM)" >&2
  exit 2
fi
with_vllm() {
  if [[ -n "$VLLM_SITE" ]]; then
    PYTHONPATH="$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH}" "$@"
  else
    "$@"
  fi
}
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  gpu_configure "$PWD" build-gpu "$OUT/cfg.log" 300
  targets=(shadowsync_c ${EXTRA_TARGETS:-})
  [[ "${SAME_HOST:-0}" == 1 || "${MEMCHECK:-0}" == 1 ]] && targets+=(gpu_test_same_host_gpu)
  for t in ${GPU_TESTS:-}; do targets+=("gpu_$t"); done
  cmake --build build-gpu -j16 --target "${targets[@]}" >"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
fi
export SHADOWSYNC_LIBRARY=$PWD/build-gpu/libshadowsync_c.so VLLM_USE_FLASHINFER_SAMPLER=0
export CUDA_DEVICE_MAX_CONNECTIONS=32
for t in ${GPU_TESTS:-}; do
  timeout 240 "./build-gpu/tests/gpu/$t" ${GPU_TEST_ARGS:-} >"$OUT/$t.log" 2>&1
  echo "$t exit $?: $(grep -E "swaps|test cases" "$OUT/$t.log" | tr '\n' ' ')"
done
if [[ "${SAME_HOST:-0}" == 1 ]]; then
  timeout 150 ./build-gpu/tests/gpu/test_same_host_gpu >"$OUT/same-host-gpu.log" 2>&1
  echo "test_same_host_gpu exit $?: $(tail -3 "$OUT/same-host-gpu.log" | tr '\n' ' ')"
  grep -E "processes updates=|detected|synchron" "$OUT/same-host-gpu.log" | head -5
  SHADOWSYNC_REQUIRE_GPU_TESTS=1 timeout 120 python3 -m pytest python/tests/test_mini_worker.py -q -rs \
    -p no:cacheprovider -k same_host >"$OUT/mini-worker.log" 2>&1
  echo "mini worker same_host: exit $? $(grep -E '[0-9]+ (passed|failed)' "$OUT/mini-worker.log" | tail -1)"
fi
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    ./build-gpu/tests/gpu/test_same_host_gpu "[conformance]" >"$OUT/memcheck.log" 2>&1
  echo "memcheck [conformance] exit $?: $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
fi
if [[ "${QUICK_START:-0}" == 1 ]]; then
  QUICK_START_DEVICE=cuda with_vllm timeout 400 python3 -m pytest python/tests/test_readme_quick_start.py \
    -q -rs -p no:cacheprovider >"$OUT/quick-start.log" 2>&1
  echo "README quick start on the GPU: exit $? $(grep -E '[0-9]+ (passed|failed|skipped)' \
    "$OUT/quick-start.log" | tail -1)"
fi
IFS=';' read -r -a runs <<<"${E2E_RUNS:-}"
for i in "${!runs[@]}"; do
  read -r -a run_args <<<"${runs[$i]}"
  with_vllm timeout "${E2E_TIMEOUT:-300}" \
    python3 scripts/vllm_e2e.py --device cuda "${run_args[@]}" >"$OUT/vllm-e2e-$i.log" 2>&1
  echo "vllm_e2e ${runs[$i]}: exit $?"
  grep -E "\[vllm-e2e\]" "$OUT/vllm-e2e-$i.log" | head -20
done
if [[ -n "${KV_CHECK+set}" ]]; then
  read -r -a kv_args <<<"$KV_CHECK"
  with_vllm timeout 400 \
    python3 scripts/gpu/check_live_arena_kv.py "${kv_args[@]}" >"$OUT/live-arena-kv.log" 2>&1
  echo "check_live_arena_kv $KV_CHECK: exit $?"
  grep -E "^\[live-arena-kv\]" "$OUT/live-arena-kv.log" || tail -20 "$OUT/live-arena-kv.log"
fi
# run_bench SCRIPT LOG "ARGS" [OUT_DIR]: one benchmark with vLLM on the path, its log and outputs
# under OUT_DIR (default $OUT), its tail.
run_bench() {
  local script=$1 log=$2 out=${4:-$OUT} args
  read -r -a args <<<"$3"
  mkdir -p "$out"
  with_vllm timeout "${BENCH_TIMEOUT:-420}" \
    python3 "$script" --out "$out" "${args[@]}" >"$out/$log" 2>&1
  local status=$?  # before any command substitution resets $?
  echo "$(basename "$script") ${args[*]}: exit $status"
  tail -${BENCH_TAIL:-30} "$out/$log"
}
IFS=';' read -r -a benches <<<"${BENCH_VLLM:-}"
for i in "${!benches[@]}"; do
  if (( ${#benches[@]} == 1 )); then
    run_bench bench/bench_vllm_update.py bench-vllm.log "${benches[$i]}"
  else
    run_bench bench/bench_vllm_update.py bench-vllm.log "${benches[$i]}" "$OUT/bench-vllm-$i"
  fi
done
if [[ -n "${BENCH_PACING:-}" ]]; then
  run_bench bench/bench_vllm_pacing.py bench-pacing.log "$BENCH_PACING"
  python3 bench/plot_pacing.py "$OUT/bench_vllm_pacing.json" >>"$OUT/bench-pacing.log" 2>&1 ||
    echo "plot_pacing failed (see bench-pacing.log)"
fi
