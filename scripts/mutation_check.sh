#!/usr/bin/env bash
# Breaks each invariant of DESIGN.md §4 on purpose (plugin/core/mutation.h) and checks that the
# test guarding it fails. A test that still passes with its invariant broken guards nothing.
#   ./scripts/mutation_check.sh            all mutations
#   ./scripts/mutation_check.sh 2 5        only these
# Prints one line per mutation and exits non-zero if any mutation went unnoticed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

declare -A guard=(
  [1]="invariant 1*"
  [2]="invariant 2*"
  [3]="invariant 3*"
  [4]="invariant 4*"
  [5]="invariant 5*"
  [6]="invariant 6*"
  [7]="invariant 7*"
  [8]="faults: flipped bytes*"
  [9]="faults: a NaN*"
  [10]="rollback: refused*"
  [11]="shutdown: 100*"
  [12]="shutdown: 100*"
  [13]="copy_in stress*"
)
# The test executable of each mutation (tests/integration/<name>); test_invariants if not listed.
declare -A program=(
  [8]=test_faults
  [9]=test_faults
  [10]=test_rollback
  [11]=test_shutdown
  [12]=test_shutdown
  [13]=test_copy_in
)
mutations=("$@")
if ((${#mutations[@]} == 0)); then mutations=(1 2 3 4 5 6 7 8 9 10 11 12 13); fi

./scripts/deps.sh
readonly dir=build-mutation
missed=0
for m in "${mutations[@]}"; do
  if [[ -z "${guard[$m]:-}" ]]; then
    echo "unknown mutation '$m' (known: ${!guard[*]})" >&2
    exit 2
  fi
  echo "==> mutation $m: building"
  cmake -S . -B "$dir" -DSHADOWSYNC_MUTATION="$m" -DSHADOWSYNC_WITH_CUDA=OFF \
    -DSHADOWSYNC_BUILD_BENCH=OFF -DSHADOWSYNC_BUILD_EXAMPLES=OFF >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
  test="${program[$m]:-test_invariants}"
  cmake --build "$dir" -j 2 --target "integration_$test" >"$dir.build.log" 2>&1 ||
    { tail -n 30 "$dir.build.log"; exit 1; }
  rc=0
  timeout 180 "$dir/tests/integration/$test" "${guard[$m]}" >"$dir.$m.log" 2>&1 || rc=$?
  if ((rc == 0)); then
    echo "MISSED mutation $m: '${guard[$m]}' passed with the invariant broken"
    missed=1
  elif ((rc == 124)); then
    echo "caught mutation $m: '${guard[$m]}' hung and was stopped after 180 s (see $dir.$m.log)"
  else
    first=$(grep -m1 -E "FAILED|timed out" "$dir.$m.log" | sed 's/^ *//' || true)
    echo "caught mutation $m: '${guard[$m]}' failed (exit $rc): $first"
  fi
done
exit "$missed"
