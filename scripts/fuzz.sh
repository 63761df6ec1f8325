#!/usr/bin/env bash
# Builds the libFuzzer target of the control channel's frame parser (tests/fuzz/) with clang,
# AddressSanitizer and UBSan, into build-fuzz/, and runs it for a bounded time from the seed corpus
# in tests/fuzz/corpus/ (new inputs go to build-fuzz/corpus/, the repository's seeds stay as they
# are). Any crash, sanitizer report or property failure exits non-zero and leaves the input in
# build-fuzz/crash-*. scripts/test.sh runs it on every run.
#
#   scripts/fuzz.sh [SECONDS]     default 30 (or SHADOWSYNC_FUZZ_SECONDS)
#
# Needs clang++ and its libFuzzer runtime (Debian 12: clang and libclang-rt-14-dev; deps.sh
# installs them) and libfmt-dev. Prints libFuzzer's final stats, then one line:
#   fuzz: <executions> executions in <seconds> s, no crash
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

readonly SECONDS_TO_RUN="${1:-${SHADOWSYNC_FUZZ_SECONDS:-30}}"
readonly OUT=build-fuzz
readonly TARGET="$OUT/fuzz_control_frame"
# Everything the target compiles: the frame codec and the update header's byte form (with the
# layout code it links against) are pure: no sockets, no crypto, no threads.
readonly SOURCES=(tests/fuzz/fuzz_control_frame.cpp plugin/control/control_frame.cpp
  plugin/control/frame_assembler.cpp plugin/core/update_header.cpp plugin/core/layout.cpp
  plugin/core/dtype.cpp plugin/core/error.cpp)

log() { echo "[fuzz] $*" >&2; }

cxx="${SHADOWSYNC_FUZZ_CXX:-}"
if [[ -z "$cxx" ]]; then
  for candidate in clang++ clang++-14 clang++-15 clang++-16; do
    if command -v "$candidate" >/dev/null; then cxx="$candidate"; break; fi
  done
fi
[[ -n "$cxx" ]] || { log "error: clang++ not found (scripts/deps.sh installs clang)"; exit 1; }

fmt_args=()
if [[ -d .deps/prefix/usr/include/fmt ]]; then  # libraries unpacked by deps.sh on an offline machine
  fmt_args+=(-isystem .deps/prefix/usr/include -L.deps/prefix/usr/lib/x86_64-linux-gnu)
fi

mkdir -p "$OUT/corpus"
# Rebuild only when a source or header changed (the codec's headers are private, in plugin/).
readonly HEADERS=(include/shadowsync plugin/control/*.h plugin/core/*.h)
if [[ ! -x "$TARGET" ]] || [[ -n "$(find "${SOURCES[@]}" "${HEADERS[@]}" -newer "$TARGET" -print -quit)" ]]; then
  log "building $TARGET with $cxx"
  "$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Iinclude -Iplugin "${fmt_args[@]}" "${SOURCES[@]}" -lfmt -o "$TARGET"
fi

log "running $TARGET for ${SECONDS_TO_RUN} s"
status=0
# -rss_limit_mb: a parser that allocates from an attacker's length field shows up as an OOM.
# -timeout: a parser that loops on an input shows up as a hang.
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$TARGET" -max_total_time="$SECONDS_TO_RUN" -timeout=5 -rss_limit_mb=1024 -max_len=70000 \
  -print_final_stats=1 -artifact_prefix="$OUT/" "$OUT/corpus" tests/fuzz/corpus \
  2>"$OUT/fuzz.log" || status=$?
grep -E "^stat::|^#[0-9]+ +DONE" "$OUT/fuzz.log" >&2 || true
if ((status != 0)); then
  tail -n 40 "$OUT/fuzz.log" >&2
  log "FAILED (exit $status); the input is in $OUT/crash-* (or oom-*, timeout-*)"
  exit 1
fi
runs=$(grep -oE "^stat::number_of_executed_units: *[0-9]+" "$OUT/fuzz.log" | grep -oE "[0-9]+$" || echo "?")
echo "fuzz: $runs executions in ${SECONDS_TO_RUN} s, no crash"
