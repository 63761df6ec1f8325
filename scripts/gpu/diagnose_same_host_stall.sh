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
# 3. The same case again from the installed wheel with SHADOWSYNC_SAME_HOST_KERNEL_COPY=1 (the
#    receiver copies each chunk with a kernel, not a copy engine) -> $OUT/pytest-kernel-copy.log
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

readonly PY="$ROOT/build-gpu-wheel/venv/bin/python"
if [[ -x "$PY" ]]; then
  (cd "$ROOT/build-gpu-wheel/run" && env -u SHADOWSYNC_LIBRARY -u PYTHONPATH \
    SHADOWSYNC_TEST_INSTALLED=1 SHADOWSYNC_DEBUG_SAME_HOST=1 SHADOWSYNC_SAME_HOST_KERNEL_COPY=1 \
    SHADOWSYNC_REQUIRE_GPU_TESTS=1 PYTHONDONTWRITEBYTECODE=1 timeout 110 "$PY" -m pytest \
    "$ROOT/python/tests/test_mini_worker.py" -q -rs -s -p no:cacheprovider --rootdir "$ROOT" \
    -k cuda_same_host) >"$OUT_DIR/pytest-kernel-copy.log" 2>&1
  note "kernel copy: exit $? $(grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/pytest-kernel-copy.log" | tail -n 1)"
else
  note "kernel copy: not run (no $PY: the wheel step failed, see run-python.log)"
fi
cat "$SUMMARY"
