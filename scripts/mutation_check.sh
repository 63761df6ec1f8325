#!/usr/bin/env bash
# Breaks each invariant on purpose and checks that the test guarding it fails. A test that still
# passes with its invariant broken guards nothing.
#   ./scripts/mutation_check.sh            all mutations
#   ./scripts/mutation_check.sh 2 5        only these
# Prints one line per mutation and exits non-zero if any mutation went unnoticed, and at once,
# before building anything, if a mutation's patch no longer applies to the tree.
#
# Each mutation is a patch, tests/mutations/NN-name.patch (a unified diff against the tree, applied
# with patch -p1 --fuzz=0: its context must match exactly). Its header names the invariant, and two
# lines tell this script what to run:
#   Test: test_invariants          the executable, tests/integration/<name> (or tests/unit/)
#   Filter: invariant 1*           the Catch2 test filter that selects the guarding test
# The shipped code holds no trace of the mutations.
#
# The tree under test is a copy of this checkout as it is (HEAD plus uncommitted changes and new
# files that git does not ignore), made in $SHADOWSYNC_MUTATION_DIR (default build-mutation/,
# ignored by git; its path stays the same from run to run so that ccache can reuse the objects).
# Each mutation is applied to that copy, only its test is built (CUDA off), the test is run, and
# the patch is reversed again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly root=$PWD
readonly patches_dir=tests/mutations

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

# The value of header line "$2: ..." of patch $1.
header_field() {
  local value
  value=$(sed -n "/^--- /q; s/^$2: *//p" "$1" | head -n 1)
  if [[ -z "$value" ]]; then
    echo "$1: no '$2:' line in its header" >&2
    exit 2
  fi
  echo "$value"
}

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

# Every patch must apply before anything is built: a stale one fails the run at once.
for m in "${mutations[@]}"; do
  patch=$(patch_of "$m")
  header_field "$patch" Test >/dev/null
  header_field "$patch" Filter >/dev/null
  if ! out=$(patch -p1 --fuzz=0 --dry-run --batch --forward -d "$src" <"$patch" 2>&1); then
    echo "$out" >&2
    echo "FAILED: mutation $m ($patch) no longer applies to the tree; update the patch" >&2
    exit 1
  fi
done

echo "==> configuring $build"
launcher=()  # ccache where there is one: a machine without it still runs the check
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src" -B "$build" -G Ninja -DSHADOWSYNC_WITH_CUDA=OFF \
  -DSHADOWSYNC_BUILD_BENCH=OFF -DSHADOWSYNC_BUILD_EXAMPLES=OFF \
  "${launcher[@]}" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }

missed=0
for m in "${mutations[@]}"; do
  patch=$(patch_of "$m")
  test=$(header_field "$patch" Test)
  filter=$(header_field "$patch" Filter)
  log="$work/mutation-$m.log"
  echo "==> mutation $m ($(basename "$patch")): building $test"
  patch -p1 --fuzz=0 --batch --forward --silent --no-backup-if-mismatch -d "$src" <"$patch"
  # The guarding test lives in tests/integration or tests/unit (its CMake target is prefixed so).
  kind=integration
  [[ -f "tests/integration/$test.cpp" ]] || kind=unit
  built=0
  cmake --build "$build" -j 2 --target "${kind}_$test" >"$work/build.log" 2>&1 || built=$?
  rc=0
  if ((built == 0)); then
    timeout 180 "$build/tests/$kind/$test" "$filter" >"$log" 2>&1 || rc=$?
  fi
  patch -p1 -R --batch --silent --no-backup-if-mismatch -d "$src" <"$patch"
  if ((built != 0)); then
    tail -n 30 "$work/build.log"
    echo "FAILED: mutation $m does not build (see $work/build.log)" >&2
    exit 1
  fi
  if ((rc == 0)); then
    echo "MISSED mutation $m: '$filter' passed with the invariant broken"
    missed=1
  elif ((rc == 124)); then
    echo "caught mutation $m: '$filter' hung and was stopped after 180 s (see $log)"
  else
    first=$(grep -m1 -E "FAILED|timed out" "$log" | sed 's/^ *//' || true)
    echo "caught mutation $m: '$filter' failed (exit $rc): $first"
  fi
done
exit "$missed"
