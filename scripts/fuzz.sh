#!/usr/bin/env bash
# Builds the libFuzzer targets of the control channel's frame parser and of the same-host
# transport's record codec (tests/fuzz/) with clang,
# AddressSanitizer and UBSan, into build-fuzz/, and runs it for a bounded time from the seed corpus
# in tests/fuzz/corpus/ and tests/fuzz/corpus_same_host/ (new inputs go to build-fuzz/corpus-<target>/, the seeds stay as they
# are). Any crash, sanitizer report or property failure exits non-zero and leaves the input in
# build-fuzz/crash-*. scripts/test.sh runs it on every run.
#
#   scripts/fuzz.sh [SECONDS]     default 30 (or SHADOWSYNC_FUZZ_SECONDS)
#
# Needs clang++ and its libFuzzer runtime (Debian 12: clang and libclang-rt-14-dev; deps.sh
# installs them) and libfmt-dev. Prints libFuzzer's final stats, then one line:
#   fuzz <target>: <executions> executions in <seconds> s, no crash   (one per target)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

readonly SECONDS_TO_RUN="${1:-${SHADOWSYNC_FUZZ_SECONDS:-30}}"
readonly OUT=build-fuzz
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

mkdir -p "$OUT"
# fuzz_one NAME CORPUS SOURCES...: builds $OUT/NAME when a source or header is newer, runs it for
# SECONDS_TO_RUN from CORPUS (new inputs go to $OUT/corpus-NAME), exits non-zero on any failure.
fuzz_one() {
  local name="$1" seeds="$2"
  shift 2
  local target="$OUT/$name"
  mkdir -p "$OUT/corpus-$name"
  # Rebuild only when a source or header changed (the codecs' headers are private, in plugin/).
  local headers=(include/shadowsync plugin/control/*.h plugin/core/*.h plugin/transports/same_host/*.h)
  if [[ ! -x "$target" ]] || [[ -n "$(find "$@" "${headers[@]}" -newer "$target" -print -quit)" ]]; then
    log "building $target with $cxx"
    "$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer \
      -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -Iinclude -Iplugin "${fmt_args[@]}" "$@" -lfmt -o "$target"
  fi

  log "running $target for ${SECONDS_TO_RUN} s"
  local status=0
  # -rss_limit_mb: a parser that allocates from an attacker's length field shows up as an OOM.
  # -timeout: a parser that loops on an input shows up as a hang.
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$target" -max_total_time="$SECONDS_TO_RUN" -timeout=5 -rss_limit_mb=1024 -max_len=70000 \
    -print_final_stats=1 -artifact_prefix="$OUT/$name-" "$OUT/corpus-$name" "$seeds" \
    2>"$OUT/$name.log" || status=$?
  grep -E "^stat::|^#[0-9]+ +DONE" "$OUT/$name.log" >&2 || true
  if ((status != 0)); then
    tail -n 40 "$OUT/$name.log" >&2
    log "FAILED (exit $status); the input is in $OUT/$name-crash-* (or oom-*, timeout-*)"
    exit 1
  fi
  local runs
  runs=$(grep -oE "^stat::number_of_executed_units: *[0-9]+" "$OUT/$name.log" | grep -oE "[0-9]+$" || echo "?")
  echo "fuzz $name: $runs executions in ${SECONDS_TO_RUN} s, no crash"
}

# The two targets are independent and each runs on one core: side by side (CI has two cores).
fuzz_one fuzz_control_frame tests/fuzz/corpus "${SOURCES[@]}" &
control=$!
# The same-host transport's record codec: pure, no sockets.
fuzz_one fuzz_same_host_frame tests/fuzz/corpus_same_host tests/fuzz/fuzz_same_host_frame.cpp \
  plugin/transports/same_host/same_host_frame.cpp &
same_host=$!
status=0
wait "$control" || status=1
wait "$same_host" || status=1
exit "$status"
