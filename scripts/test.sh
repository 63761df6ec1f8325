#!/usr/bin/env bash
# The CI test run: three builds, each configured, built and tested with ctest, and the Python
# package's pytest suite.
#   build/       RelWithDebInfo, CUDA AUTO (CUDA/NCCL sources compile where nvcc+NCCL exist),
#                warnings are errors; then the gpu-labelled tests, which must skip without a GPU;
#                then pytest python/tests against build/libshadowsync_c.so (scripts/python_deps.sh
#                installs numpy and pytest if missing)
#   build-asan/  address,undefined sanitizers, -O1, CUDA OFF
#   build-tsan/  thread sanitizer, -O1, CUDA OFF
#   build-fuzz/  the control channel's frame parser under libFuzzer (clang, ASan+UBSan), 30 s:
#                scripts/fuzz.sh; runs on every run, any crash fails
# Environment:
#   SHADOWSYNC_TEST_SKIP_SANITIZERS=1   only the default build (quick local iterations)
#   SHADOWSYNC_JOBS=N                   build and ctest parallelism (default 2)
#   SHADOWSYNC_WERROR=OFF               do not turn warnings into errors
#   SHADOWSYNC_FUZZ_SECONDS=N           how long the fuzz target runs (default 30)
# Exits non-zero if any build or test failed; ends with each build's ctest result line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="$PWD"
readonly JOBS="${SHADOWSYNC_JOBS:-2}"

log() { echo "==> $*"; }

log "dependencies"
./scripts/deps.sh

common_args=()
if [[ -d .deps/prefix/usr ]]; then  # libraries unpacked by deps.sh on an offline machine
  common_args+=("-DCMAKE_PREFIX_PATH=$ROOT/.deps/prefix/usr")
fi
if command -v ccache >/dev/null; then
  common_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

summary=()
failed=0

# configure_and_build NAME DIR CMAKE_ARGS...
configure_and_build() {
  local name="$1" dir="$2"
  shift 2
  local generator=()
  if [[ ! -f "$dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
    generator=(-G Ninja)
  fi
  log "[$name] configure $dir"
  mkdir -p "$dir"
  # Called from an `if`, where set -e is off: check each step.
  cmake -S . -B "$dir" "${generator[@]}" "${common_args[@]}" "$@" 2>&1 | tee "$dir/configure.log" ||
    return 1
  log "[$name] build"
  cmake --build "$dir" -j "$JOBS" || return 1
}

# run_ctest NAME DIR LOG CTEST_ARGS...  (ctest runs under the ctest_wrapper command, if set)
run_ctest() {
  local name="$1" dir="$2" logfile="$3"
  shift 3
  local rc=0
  log "[$name] ctest $*"
  (cd "$dir" && "${ctest_wrapper[@]}" ctest --output-on-failure "$@") 2>&1 | tee "$logfile" ||
    rc=$?
  local result
  result=$(grep -E "tests passed|No tests were found" "$logfile" | tail -n 1 || true)
  local skipped
  skipped=$(grep -cE "\*\*\*Skipped|Not Run" "$logfile" || true)
  summary+=("$name: ${result:-no ctest result line} (skipped: $skipped)")
  if ((rc != 0)); then
    summary+=("$name: FAILED (ctest exit $rc)")
    failed=1
  fi
  return 0
}

print_summary() {
  echo
  log "summary"
  local line
  for line in "${summary[@]}"; do
    echo "    $line"
  done
  if ((failed)); then
    echo "    RESULT: FAILED"
  else
    echo "    RESULT: OK"
  fi
}

ctest_wrapper=()

# A compile error repeats in every build: stop at the first one.
build_or_stop() {
  if ! configure_and_build "$@"; then
    summary+=("$1: BUILD FAILED")
    failed=1
    print_summary
    exit 1
  fi
}

# --- default build --------------------------------------------------------------------------
build_or_stop default build \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSHADOWSYNC_WITH_CUDA=AUTO \
  -DSHADOWSYNC_SANITIZE= \
  "-DSHADOWSYNC_WERROR=${SHADOWSYNC_WERROR:-ON}"
summary+=("default: $(grep -o 'CUDA/NCCL backend.*' build/configure.log | tail -n 1)")
run_ctest default build build/ctest.log -j "$JOBS" -LE '^gpu$'

# GPU tests: on a machine without a usable GPU every one must skip (exit 77), never pass.
has_gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  has_gpu=1
fi
run_ctest gpu build build/ctest-gpu.log -L '^gpu$' --no-tests=ignore
if ((!has_gpu)) && grep -E "Test +#[0-9]+: .*Passed" build/ctest-gpu.log; then
  summary+=("gpu: FAILED: a gpu test passed on a machine without a GPU (it must exit 77)")
  failed=1
fi

# --- the Python package, against the default build's C ABI library ---------------------------
run_pytest() {
  log "[python] dependencies"
  if ! ./scripts/python_deps.sh; then
    summary+=("python: FAILED (numpy/pytest could not be installed: see scripts/python_deps.sh)")
    failed=1
    return 0
  fi
  log "[python] pytest python/tests"
  local rc=0
  # -rs lists each skipped test with its reason (the torch tests, where torch is absent).
  SHADOWSYNC_LIBRARY="$ROOT/build/libshadowsync_c.so" PYTHONDONTWRITEBYTECODE=1 \
    python3 -m pytest python/tests -q -rs -p no:cacheprovider 2>&1 | tee build/pytest.log || rc=$?
  local result
  result=$(grep -E "[0-9]+ (passed|failed|errors?)" build/pytest.log | tail -n 1 || true)
  summary+=("python: ${result:-no pytest result line}")
  if ((rc != 0)); then
    summary+=("python: FAILED (pytest exit $rc)")
    failed=1
  fi
}
run_pytest

# --- fuzzing: the control channel's frame parser ----------------------------------------------
log "[fuzz] scripts/fuzz.sh"
if ./scripts/fuzz.sh 2>&1 | tee build/fuzz.log; then
  summary+=("fuzz: $(grep -E '^fuzz: ' build/fuzz.log | tail -n 1 | sed 's/^fuzz: //')")
else
  summary+=("fuzz: FAILED (see build/fuzz.log and build-fuzz/)")
  failed=1
fi

# --- sanitizer builds -----------------------------------------------------------------------
if [[ "${SHADOWSYNC_TEST_SKIP_SANITIZERS:-0}" != "1" ]]; then
  sanitizer_args=(
    -DCMAKE_BUILD_TYPE=Debug
    "-DCMAKE_CXX_FLAGS_DEBUG=-g -O1"
    -DSHADOWSYNC_WITH_CUDA=OFF
    -DSHADOWSYNC_WERROR=OFF
    -DSHADOWSYNC_BUILD_BENCH=OFF
  )

  build_or_stop asan build-asan "${sanitizer_args[@]}" "-DSHADOWSYNC_SANITIZE=address,undefined"
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    run_ctest asan build-asan build-asan/ctest.log -j "$JOBS" -LE '^(gpu|install)$'

  build_or_stop tsan build-tsan "${sanitizer_args[@]}" -DSHADOWSYNC_SANITIZE=thread
  # GCC 12's TSan cannot map its shadow memory when the kernel randomizes mmap with more than 28
  # bits (newer kernels); running without address randomization avoids that.
  if [[ $(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 28) -gt 28 ]] && command -v setarch >/dev/null; then
    ctest_wrapper=(setarch "$(uname -m)" -R)
  fi
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    run_ctest tsan build-tsan build-tsan/ctest.log -j "$JOBS" -LE '^(gpu|install)$'
  ctest_wrapper=()
fi

print_summary
exit "$failed"
