#!/usr/bin/env bash
# Breaks each invariant on purpose and checks that the test guarding it fails. A test that still
# passes with its invariant broken guards nothing.
#   ./scripts/mutation_check.sh              all mutations
#   ./scripts/mutation_check.sh 2 5          only these
#   ./scripts/mutation_check.sh --applies    only check that every patch (or those named) still
#                                            applies to the tree: no build, about a second
# Prints one line per mutation and exits non-zero if any mutation went unnoticed, and at once,
# before building anything, if a mutation's patch no longer applies to the tree.
#
# Each mutation is a patch, tests/mutations/NN-name.patch (a unified diff against the tree, applied
# with patch -p1 --fuzz=0: its context must match exactly). Its header names the invariant, and
# names the guarding test in one of two ways. A C++ test (Catch2):
#   Test: test_invariants          the executable, tests/integration/<name> (or tests/unit/)
#   Filter: invariant 1*           the Catch2 test filter that selects the guarding test
# or a Python test (pytest):
#   Pytest: python/tests/test_x.py::test_name    pytest's arguments (node ids, -k word ...),
#                                                split at spaces (no quoting), paths relative to
#                                                the repository root
# and optionally
#   Timeout: 900                   seconds the guard may run (default 180 for C++, 600 for pytest);
#                                  a guard stopped by it counts as caught (it hung)
# The shipped code holds no trace of the mutations.
#
# The tree under test is a copy of this checkout as it is (HEAD plus uncommitted changes and new
# files that git does not ignore), made in $SHADOWSYNC_MUTATION_DIR (default build-mutation/,
# ignored by git; its path stays the same from run to run so that ccache can reuse the objects).
# Each mutation is applied to that copy, only its test is built (CUDA off), the test is run, and
# the patch is reversed again. For a pytest guard, the C library is built from the mutated copy
# (libshadowsync_c_testing.so: the library and its test hooks, which fault-injecting tests use)
# and pytest runs in the copy (its python/ and engine_adapters/, as python/tests/conftest.py
# finds them) with SHADOWSYNC_LIBRARY pointing at that library, as scripts/test.sh runs pytest. The python that runs it: $SHADOWSYNC_MUTATION_PYTHON, else
# build-vllm/venv/bin/python where scripts/test.sh's vllm step made it (vLLM's tests need it),
# else python3; it must import pytest. A pytest guard that skips a test checks nothing: the
# mutation is reported as not checked and the exit status is non-zero. A filter or node id that
# selects no test stops the check (exit 1), as a patch that does not build does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly root=$PWD
readonly patches_dir=tests/mutations

applies_only=0
if [[ "${1:-}" == "--applies" ]]; then
  applies_only=1
  shift
fi
mutations=("$@")
if ((${#mutations[@]} == 0)); then
  mutations=()
  for patch in "$patches_dir"/[0-9][0-9]-*.patch; do
    name=$(basename "$patch")
    mutations+=("$((10#${name%%-*}))")
  done
fi

# The patch of mutation $1.
patch_of() {
  local matches=()
  if [[ "$1" =~ ^[0-9]+$ ]]; then
    shopt -s nullglob
    matches=("$patches_dir"/"$(printf '%02d' "$((10#$1))")"-*.patch)
    shopt -u nullglob
  fi
  if ((${#matches[@]} != 1)); then
    echo "unknown mutation '$1' (known: $(cd "$patches_dir" && ls -- *.patch | tr '\n' ' '))" >&2
    exit 2
  fi
  echo "${matches[0]}"
}

# The value of header line "$2: ..." of patch $1; empty if it has none.
optional_field() {
  sed -n "/^--- /q; s/^$2: *//p" "$1" | head -n 1
}

# The value of header line "$2: ..." of patch $1, which must have one.
header_field() {
  local value
  value=$(optional_field "$1" "$2")
  if [[ -z "$value" ]]; then
    echo "$1: no '$2:' line in its header" >&2
    exit 2
  fi
  echo "$value"
}

# The python that runs pytest guards.
guard_python() {
  if [[ -n "${SHADOWSYNC_MUTATION_PYTHON:-}" ]]; then
    echo "$SHADOWSYNC_MUTATION_PYTHON"
  elif [[ -x "$root/build-vllm/venv/bin/python" ]]; then
    echo "$root/build-vllm/venv/bin/python"
  else
    echo python3
  fi
}

command -v patch >/dev/null || { echo "mutation_check.sh needs patch (apt-get install patch)" >&2; exit 2; }

# Every patch must apply, and every header name its guard, before anything is built: a stale
# patch fails the run at once. Checked against the checkout, which the copy below reproduces.
python=""
for m in "${mutations[@]}"; do
  patch=$(patch_of "$m")
  if [[ -n "$(optional_field "$patch" Pytest)" ]]; then
    python=$(guard_python)
  else
    header_field "$patch" Test >/dev/null
    header_field "$patch" Filter >/dev/null
  fi
  if ! out=$(patch -p1 --fuzz=0 --dry-run --batch --forward -d "$root" <"$patch" 2>&1); then
    echo "$out" >&2
    echo "FAILED: mutation $m ($patch) no longer applies to the tree; update the patch" >&2
    exit 1
  fi
done
if ((applies_only)); then
  echo "all ${#mutations[@]} mutation patches apply to the tree"
  exit 0
fi
if [[ -n "$python" ]]; then
  if ! "$python" -c "import pytest" 2>/dev/null; then
    echo "FAILED: the pytest guards need pytest in $python (set SHADOWSYNC_MUTATION_PYTHON to" \
      "a python that has it, or run scripts/python_deps.sh)" >&2
    exit 1
  fi
  echo "==> pytest guards run with $python"
fi

./scripts/deps.sh

readonly work=${SHADOWSYNC_MUTATION_DIR:-$root/build-mutation}
readonly src=$work/src
readonly build=$work/build
mkdir -p "$work"

# A fresh copy of the tree. File times are set to now (tar -m), so that the kept build directory
# rebuilds whatever a previous run left built with a mutation in it.
rm -rf "$src"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' file; do
    if [[ -e "$file" ]]; then printf '%s\0' "$file"; fi  # skip files deleted in the checkout
  done |
  tar --null -T - -cf - | tar -xmf - -C "$src"

echo "==> configuring $build"
launcher=()  # ccache where there is one: a machine without it still runs the check
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src" -B "$build" -G Ninja -DSHADOWSYNC_WITH_CUDA=OFF \
  -DSHADOWSYNC_BUILD_BENCH=OFF -DSHADOWSYNC_BUILD_EXAMPLES=OFF \
  "${launcher[@]}" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }

# run_catch TEST FILTER TIMEOUT LOG: builds and runs the C++ guard; sets built and rc.
run_catch() {
  # The guarding test lives in tests/integration or tests/unit (its CMake target is prefixed so).
  local kind=integration
  [[ -f "tests/integration/$1.cpp" ]] || kind=unit
  cmake --build "$build" -j 2 --target "${kind}_$1" >"$work/build.log" 2>&1 || built=$?
  if ((built == 0)); then
    timeout "$3" "$build/tests/$kind/$1" "$2" >"$4" 2>&1 || rc=$?
  fi
}

# run_pytest ARGS TIMEOUT LOG: builds the C library and runs the pytest guard in the copy; sets
# built and rc.
run_pytest() {
  cmake --build "$build" -j 2 --target shadowsync_c_testing >"$work/build.log" 2>&1 || built=$?
  if ((built == 0)); then
    local args
    read -r -a args <<<"$1"
    # -rfEs: each failed test and a skipped test's reason goes into the log (a skip checks nothing).
    (cd "$src" && env -u SHADOWSYNC_TEST_INSTALLED SHADOWSYNC_LIBRARY="$build/libshadowsync_c_testing.so" \
      PYTHONDONTWRITEBYTECODE=1 timeout "$2" "$python" -m pytest "${args[@]}" -q -rfEs \
      -p no:cacheprovider) >"$3" 2>&1 || rc=$?
  fi
}

missed=0
for m in "${mutations[@]}"; do
  patch=$(patch_of "$m")
  pytest_args=$(optional_field "$patch" Pytest)
  if [[ -n "$pytest_args" ]]; then
    guard=$pytest_args
    limit=$(optional_field "$patch" Timeout)
    limit=${limit:-600}
    echo "==> mutation $m ($(basename "$patch")): building libshadowsync_c_testing.so for pytest"
  else
    test=$(header_field "$patch" Test)
    guard=$(header_field "$patch" Filter)
    limit=$(optional_field "$patch" Timeout)
    limit=${limit:-180}
    echo "==> mutation $m ($(basename "$patch")): building $test"
  fi
  log="$work/mutation-$m.log"
  patch -p1 --fuzz=0 --batch --forward --silent --no-backup-if-mismatch -d "$src" <"$patch"
  built=0
  rc=0
  if [[ -n "$pytest_args" ]]; then
    run_pytest "$pytest_args" "$limit" "$log"
  else
    run_catch "$test" "$guard" "$limit" "$log"
  fi
  patch -p1 -R --batch --silent --no-backup-if-mismatch -d "$src" <"$patch"
  if ((built != 0)); then
    tail -n 30 "$work/build.log"
    echo "FAILED: mutation $m does not build (see $work/build.log)" >&2
    exit 1
  fi
  # A guard that selects nothing guards nothing, whatever its exit status says.
  if [[ -z "$pytest_args" ]] && grep -q "^No test cases matched" "$log"; then
    echo "FAILED: mutation $m: filter '$guard' selects no test in $test" >&2
    exit 1
  fi
  if [[ -n "$pytest_args" ]] && ((rc == 4 || rc == 5)); then
    tail -n 5 "$log" >&2
    echo "FAILED: mutation $m: pytest '$guard' selects no test (pytest exit $rc; see $log)" >&2
    exit 1
  fi
  if ((rc == 0)); then
    if [[ -n "$pytest_args" ]] && grep -qE "^SKIPPED|[0-9]+ skipped" "$log"; then
      reason=$(grep -m1 "^SKIPPED" "$log" || true)
      echo "NOT CHECKED mutation $m: '$guard' skipped tests with $python: ${reason:-see $log}"
    else
      echo "MISSED mutation $m: '$guard' passed with the invariant broken"
    fi
    missed=1
  elif ((rc == 124)); then
    echo "caught mutation $m: '$guard' hung and was stopped after $limit s (see $log)"
  else
    first=$(grep -m1 -E "FAILED|timed out|^ERROR" "$log" | sed 's/^ *//' || true)
    echo "caught mutation $m: '$guard' failed (exit $rc): $first"
  fi
done
exit "$missed"
