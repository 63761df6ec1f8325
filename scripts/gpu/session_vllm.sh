#!/usr/bin/env bash
# One device call after .vllm-gpu's two install calls (PYTHONPATH=/tmp/site holds vLLM 0.25.0):
# builds the C library with CUDA (and EXTRA_TARGETS), runs scripts/vllm_e2e.py on the GPU (CUDA
# graphs on), then the same-host GPU tests when built. Outputs under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/common.sh
gpu_unpack_deps "$PWD" >/dev/null
gpu_configure "$PWD" build-gpu "$OUT/cfg.log" 300
cmake --build build-gpu -j16 --target shadowsync_c ${EXTRA_TARGETS:-} >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SHADOWSYNC_LIBRARY=$PWD/build-gpu/libshadowsync_c.so VLLM_USE_FLASHINFER_SAMPLER=0
export CUDA_DEVICE_MAX_CONNECTIONS=32
if [[ -x build-gpu/tests/gpu/test_same_host_gpu ]]; then
  timeout 150 ./build-gpu/tests/gpu/test_same_host_gpu >"$OUT/same-host-gpu.log" 2>&1
  echo "test_same_host_gpu exit $?: $(tail -3 "$OUT/same-host-gpu.log" | tr '\n' ' ')"
  grep -E "processes updates=|detected|synchron" "$OUT/same-host-gpu.log" | head -5
  SHADOWSYNC_REQUIRE_GPU_TESTS=1 timeout 120 python3 -m pytest python/tests/test_mini_worker.py -q -rs \
    -p no:cacheprovider -k same_host >"$OUT/mini-worker.log" 2>&1
  echo "mini worker same_host: exit $? $(grep -E '[0-9]+ (passed|failed)' "$OUT/mini-worker.log" | tail -1)"
fi
if [[ "${E2E_TIMEOUT:-0}" != 0 ]]; then
  PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "$E2E_TIMEOUT" python3 scripts/vllm_e2e.py --device cuda >"$OUT/vllm-e2e.log" 2>&1
  echo "vllm_e2e exit $?"
  grep -E "\[vllm-e2e\]|Error:|error:" "$OUT/vllm-e2e.log" | head -40
fi
