#!/usr/bin/env bash
# On a one-GPU machine, in one device call (carry [".whl", ".deps"], as for run.sh python): settles
# why the mini worker's cuda_same_host case stalls at a bucket the trainer withholds until the
# engine has stepped (see the diagnosis notes of the same-host stall).
#
#   bash scripts/gpu/diagnose_same_host_stall.sh
#
# 1. scripts/gpu/probe_stream_wait.py: does a stream waiting on a host counter (cuStreamWaitValue32,
#    then a copy-engine memcpy, a kernel, a host function, a memset...) hold back torch work on
#    other streams of the process? -> $OUT/probe.log
# 2. scripts/gpu/run.sh python -k cuda_same_host with SHADOWSYNC_DEBUG_SAME_HOST=1: builds and
#    installs the wheel, runs the case with both processes tracing every chunk, every engine step
#    and every supply, and dumping Python stacks of a step or supply stalled over 4 s
#    -> $OUT/pytest-default.log
# Summary lines on stdout and in $OUT/summary-stall.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly ROOT=$PWD
readonly OUT_DIR="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT_DIR"
readonly SUMMARY="$OUT_DIR/summary-stall.txt"
: >"$SUMMARY"
note() { echo "[stall] $*"; echo "$*" >>"$SUMMARY"; }

note "probe: $(timeout 120 python3 scripts/gpu/probe_stream_wait.py >"$OUT_DIR/probe.log" 2>&1;
               echo "exit $?")"
grep -E "^probe: [A-Z]|HELD|probe summary" "$OUT_DIR/probe.log" | head -n 40 >>"$SUMMARY"

OUT="$OUT_DIR" SHADOWSYNC_DEBUG_SAME_HOST=1 SHADOWSYNC_REQUIRE_GPU_TESTS=1 \
  timeout 330 bash scripts/gpu/run.sh python -k cuda_same_host >"$OUT_DIR/run-python.log" 2>&1
note "default copy: exit $? $(grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/pytest-wheel.log" | tail -n 1)"
mv "$OUT_DIR/pytest-wheel.log" "$OUT_DIR/pytest-default.log" 2>/dev/null

cat "$SUMMARY"
