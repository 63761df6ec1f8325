#!/usr/bin/env bash
# One device call after .vllm-gpu's two install calls (PYTHONPATH=/tmp/site holds vLLM 0.25.0):
# builds the C library with CUDA and the GPU tests, runs the receive-plan and copy-in GPU tests,
# then scripts/vllm_e2e.py on the GPU (CUDA graphs on). Outputs under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/gpu/common.sh
gpu_unpack_deps "$PWD" >/dev/null
gpu_configure "$PWD" build-gpu "$OUT/cfg.log" 300
cmake --build build-gpu -j16 --target shadowsync_c ${EXTRA_TARGETS:-} >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built $(git rev-parse --short HEAD 2>/dev/null)"
export SHADOWSYNC_LIBRARY=$PWD/build-gpu/libshadowsync_c.so VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout ${E2E_TIMEOUT:-420} python3 scripts/vllm_e2e.py --device cuda >"$OUT/vllm-e2e.log" 2>&1
echo "vllm_e2e exit $?"
grep -E "\[vllm-e2e\]|Error|error:" "$OUT/vllm-e2e.log" | grep -v "^INFO" | head -40
