#!/usr/bin/env bash
# One device call: builds the C library with CUDA, probes whether a stream waiting on a host
# counter holds other streams' work, and runs the mini worker's two-process CUDA case (host-gated
# receive). Outputs under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/common.sh
gpu_unpack_deps "$PWD" >/dev/null
gpu_configure "$PWD" build-gpu "$OUT/cfg.log" 300
cmake --build build-gpu -j16 --target shadowsync_c >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
timeout 100 python3 scripts/gpu/probe_stream_wait.py >"$OUT/probe.log" 2>&1; echo "probe exit $?"
grep -E "HELD|free|summary" "$OUT/probe.log" | head -40
for mode in engine; do
  env SHADOWSYNC_LIBRARY=$PWD/build-gpu/libshadowsync_c.so SHADOWSYNC_REQUIRE_GPU_TESTS=1 \
    SHADOWSYNC_DEBUG_SAME_HOST=1 timeout 120 python3 -m pytest python/tests/test_mini_worker.py -q -rs -s \
    -p no:cacheprovider -k cuda_same_host >"$OUT/pytest-$mode.log" 2>&1
  echo "mini worker cuda_same_host ($mode copy): exit $? $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest-$mode.log" | tail -1)"
done
