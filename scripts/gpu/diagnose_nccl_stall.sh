#!/usr/bin/env bash
# On a two-GPU machine, in one device call (carry [".deps"]): traces the mini worker's in-process
# NCCL case (trainer cuda:0, engine cuda:1, one process). It used to hang at the first engine step
# of a sequence length not run before, while the NCCL receives of the buckets its trainer holds
# back until the engine has stepped waited on the engine's GPU ("bucket 11 of 15 did not complete
# within its deadline"; traced with this script at ad2a566, docs/gpu.md, the twentieth session);
# the test now runs every length before its first update. Kept to trace the case again.
#
#   bash scripts/gpu/diagnose_nccl_stall.sh [RUNS]     (default 2 runs per setting)
#
# Builds the C library with CUDA, then runs the case RUNS times with NCCL_P2P_DIRECT_DISABLE=0
# and RUNS times with =1, each with the test's own trace (SHADOWSYNC_DEBUG_SAME_HOST=1: every
# engine step, the release, every supply, and Python stacks of every thread after an engine
# step of 4 s)
# and NCCL's COLL/P2P log with timestamps. How to read a failure (the logs come back in
# $OUT/nccl-stall-logs.tgz): a step that never ends, its
# stack in a launching torch op -> the engine waited for its whole context (the parked receive);
# in .cpu()/argmax -> a stream dependency; steps end but a supply never does -> the trainer's side;
# everything sent within ms and still the timeout -> NCCL's side. Logs under $OUT, a summary on
# stdout and in $OUT/summary-nccl-stall.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly RUNS=${1:-2}
readonly OUT_DIR="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT_DIR"
readonly SUMMARY="$OUT_DIR/summary-nccl-stall.txt"
: >"$SUMMARY"
note() { echo "[nccl-stall] $*"; echo "$*" >>"$SUMMARY"; }

source scripts/gpu/common.sh
gpu_unpack_deps "$PWD" >/dev/null || { note "unpacking .deps failed (was .deps carried?)"; exit 1; }
gpu_configure "$PWD" build-gpu "$OUT_DIR/cfg.log" 300 ||
  { tail -30 "$OUT_DIR/cfg.log"; note "configure failed (cfg.log)"; exit 1; }
cmake --build build-gpu -j16 --target shadowsync_c >"$OUT_DIR/build.log" 2>&1 ||
  { tail -30 "$OUT_DIR/build.log"; note "build failed (build.log)"; exit 1; }
failures=0
readonly CASE='python/tests/test_mini_worker.py::test_generation_continues_and_logits_match_the_reference_bit_for_bit[cuda]'
for direct_disable in 0 1; do
  for run in $(seq 1 "$RUNS"); do
    log="$OUT_DIR/run-d$direct_disable-$run.log"
    # The environment's value beats the conftest's setdefault.
    env SHADOWSYNC_LIBRARY="$PWD/build-gpu/libshadowsync_c.so" SHADOWSYNC_REQUIRE_GPU_TESTS=1 \
      SHADOWSYNC_DEBUG_SAME_HOST=1 PYTHONUNBUFFERED=1 NCCL_P2P_DIRECT_DISABLE="$direct_disable" \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,COLL NCCL_DEBUG_TIMESTAMP_LEVELS=INFO \
      NCCL_DEBUG_FILE="$OUT_DIR/nccl-d$direct_disable-$run.%p.log" \
      timeout -k 5 90 python3 -m pytest -x -s -q -p no:cacheprovider "$CASE" >"$log" 2>&1
    status=$?
    ((status == 0)) || failures=$((failures + 1))
    note "NCCL_P2P_DIRECT_DISABLE=$direct_disable run $run: exit $status $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)"
    grep -E "did not complete|not live within" "$log" | head -n 2 >>"$SUMMARY"
  done
  # Which P2P path NCCL took under this setting (its INFO lines name it).
  note "NCCL_P2P_DIRECT_DISABLE=$direct_disable P2P channels: $(cat "$OUT_DIR"/nccl-d"$direct_disable"-*.log 2>/dev/null |
    grep -oE 'via P2P/[A-Za-z ]+' | sort | uniq -c | tr '\n' ' ')"
done
# The device tool brings back a few files only: the logs go back as one archive.
(cd "$OUT_DIR" && tar czf nccl-stall-logs.tgz run-d*.log nccl-d*.log cfg.log build.log 2>/dev/null;
  rm -f run-d*.log nccl-d*.log cfg.log build.log)
cat "$SUMMARY"
# Exit status: the number of runs that failed (0: the case passed every time).
exit "$failures"
