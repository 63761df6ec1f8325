#!/usr/bin/env bash
# The runs that need two GPUs of one host (docs/benchmarks.md, "Two GPUs of one host"): real vLLM
# with TP=2 and graph pairs, a sharded trainer colocated with it, and NCCL over its network path.
# From the repository root of such a machine, vLLM on the Python path (VLLM_SITE as for
# vllm_runs.sh); logs and benchmark files under $OUT (default ./gpu-out):
#
#   bash scripts/gpu/run.sh two-gpu build      build-gpu/: the library and examples/control_channel
#   bash scripts/gpu/run.sh two-gpu check-tp2      correctness run 1 (below), against fresh vLLM
#   bash scripts/gpu/run.sh two-gpu check-network  correctness run 2 (below), against fresh vLLM
#   bash scripts/gpu/run.sh two-gpu check-routes   correctness run 3 (below), against fresh vLLM
#   bash scripts/gpu/run.sh two-gpu bench-tp2  Llama-3-8B shapes, TP=2, graph pairs, paced to a
#                                              decode slowdown of 1.08; then a sharded trainer of
#                                              2 ranks takes the same engine over, then one of 2
#                                              ranks that all-gathers to rank 0 and sends from it
#   bash scripts/gpu/run.sh two-gpu bench-tp2-auto  the same engine and shapes, commit_mode "auto":
#                                              the ranks' step hooks make each update live
#   bash scripts/gpu/run.sh two-gpu bench-network  Llama-3-8B shapes, TP=1 on GPU 0, the trainer on
#                                              GPU 1 over NCCL's network path (--nvlink: then
#                                              over NVLink too, for comparison)
#   bash scripts/gpu/run.sh two-gpu bench-routes   Llama-3-8B shapes, TP=1 on GPU 0, graph pairs: the
#                                              trainer on GPU 1 over NCCL broadcasts, then a
#                                              sharded trainer's rank there over NCCL routes
#   bash scripts/gpu/run.sh two-gpu check-fsdp2    correctness run 4 (below), against fresh vLLM
#   bash scripts/gpu/run.sh two-gpu bench-gather   Llama-3-8B shapes, a real FSDP2 model on both
#                                              GPUs: full_tensor() gathers to rank 0 (all, and
#                                              bucket by bucket) against a ShardedPublisher's
#                                              set-up (bench/bench_fsdp2_gather.py; no vLLM)
#
# The correctness runs (greedy output token for token against fresh vLLM engines):
#   1. vllm_e2e.py --tp 2 --graph-pairs --reinit --trainer-ranks 2: updates from one trainer
#      process into a TP=2 engine with graph pairs and CUDA graphs (the second group's with
#      commit_mode "auto": the step hooks agree on the step); then a sharded trainer of 2 ranks (rank r's
#      shards in GPU r's memory, beside engine rank r) takes it over over the same-host pull
#      transport (routes within a GPU and across the two by peer copies): each engine rank's
#      routed bytes equal its own parameters' bytes.
#   2. the network path (below): faults.sh --network (a trainer killed and stopped
#      mid-update over NCCL's socket transport, the control channel on a non-loopback address),
#      then vllm_e2e.py --transport nccl --trainer-gpu 1 (TP=1 engine on GPU 0).
#   3. NCCL routes: vllm_e2e.py --transport nccl --trainer-gpu 1 --trainer-ranks 1: after the
#      updates of one trainer over NCCL broadcasts, a sharded trainer's rank on GPU 1 sends its
#      routes over NCCL point-to-point into the TP=1 engine on GPU 0 (with two GPUs one trainer
#      rank is all NCCL allows beside the engine's GPU).
#   4. examples/fsdp2_trainer.py --device cuda --check under torchrun (two FSDP2 ranks, NCCL, one
#      per GPU) with vLLM started from rank 0 on the same GPUs, --engine-tp 2 and then 1: every
#      optimizer step streamed in, then greedy tokens equal to a fresh vLLM of the trained
#      checkpoint (assembled from the ranks' saved shards).
#
# The network path: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1, NCCL's sockets on the
# machine's first non-loopback interface (NCCL_SOCKET_IFNAME), as between two hosts.
#
# Exit status: the number of failed steps (0: every step passed); 2 for a bad argument; 77 with
# fewer than 2 GPUs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export OUT

usage() { sed -n '2,52p' "${BASH_SOURCE[0]}"; }
step="${1:-}"
case "$step" in
  build|check-tp2|check-network|check-routes|bench-tp2|bench-tp2-auto|bench-network|bench-routes|check-fsdp2|bench-gather) ;;
  -h|--help) usage; exit 0 ;;
  *) echo "two_gpu.sh: unknown step '$step'" >&2; usage >&2; exit 2 ;;
esac
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if ((gpus < 2)); then
  echo "SKIP: two_gpu.sh needs 2 GPUs, nvidia-smi lists $gpus"
  exit 77
fi

# network_env: the variables of NCCL's network path, printed.
network_env() {
  local iface
  iface=$(python3 -c '
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _, name in socket.if_nameindex():
    try:
        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    except OSError:
        continue
    if not socket.inet_ntoa(raw[20:24]).startswith("127."):
        print(name)
        break')
  [[ -n "$iface" ]] || { echo "two_gpu.sh: no non-loopback IPv4 interface" >&2; return 1; }
  export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME="$iface"
  echo "network path: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=$iface"
}

failed=0
# runs LOG PATTERN [VAR=VALUE...]: vllm_runs.sh with these variables, its summary lines in LOG
# (and here); a step failed unless every line matching PATTERN ends in "exit 0".
runs() {
  local log=$1 pattern=$2
  shift 2
  env SKIP_BUILD=1 "$@" bash scripts/gpu/vllm_runs.sh 2>&1 | tee "$log"
  if ! grep -qE "$pattern" "$log" || grep -E "$pattern" "$log" | grep -vqE ": exit 0$"; then
    failed=$((failed + 1))
  fi
}
# torchrun_step LOG LIMIT SCRIPT ARGS...: SCRIPT under torchrun, two ranks (one per GPU), with
# vLLM (VLLM_SITE) and the CUDA build on the path; its bracketed lines here. Counts a failure.
torchrun_step() {
  local log=$1 limit=$2
  shift 2
  (source scripts/gpu/common.sh && gpu_unpack_deps "$PWD" >/dev/null &&
   PYTHONPATH="${VLLM_SITE:+$VLLM_SITE:}${PYTHONPATH:-}" SHADOWSYNC_LIBRARY=$PWD/build-gpu/libshadowsync_c.so \
   VLLM_USE_FLASHINFER_SAMPLER=0 timeout "$limit" \
   python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$@") >"$log" 2>&1
  local status=$?
  echo "$* : exit $status"
  grep -E '^\[' "$log" | head -30
  ((status == 0)) || { tail -15 "$log"; failed=$((failed + 1)); }
}
readonly BENCH="--config llama-3-8b --dummy-load --paths shadowsync --updates 5 --path-timeout-s 270"

case "$step" in
  build)
    source scripts/gpu/common.sh
    gpu_machine_report >"$OUT/env.log" 2>&1
    grep -A4 "topo -m" "$OUT/env.log"
    gpu_unpack_deps "$PWD" || { echo "$DEPS_MESSAGE"; exit 1; }
    gpu_configure "$PWD" build-gpu "$OUT/cfg.log" 300 || { tail -20 "$OUT/cfg.log"; exit 1; }
    cmake --build build-gpu -j32 --target shadowsync_c control_channel >"$OUT/build.log" 2>&1 ||
      { tail -30 "$OUT/build.log"; exit 1; }
    echo "built build-gpu: $(ls build-gpu/libshadowsync_c.so build-gpu/examples/control_channel)"
    ;;
  check-tp2)
    runs "$OUT/check-tp2.txt" "^vllm_e2e " E2E_TIMEOUT=400 \
      E2E_RUNS="--arch llama --tp 2 --graph-pairs --reinit --trainer-ranks 2"
    ;;
  check-network)
    (network_env && bash scripts/gpu/faults.sh build-gpu --network --cycles 3) \
      >"$OUT/faults-network.log" 2>&1 || failed=$((failed + 1))
    grep -E "^fault|^faults:|^network" "$OUT/faults-network.log"
    mkdir -p "$OUT/network"
    network_env || exit $((failed + 1))
    runs "$OUT/check-network.txt" "^vllm_e2e " OUT="$OUT/network" E2E_TIMEOUT=240 \
      E2E_RUNS="--arch llama --transport nccl --trainer-gpu 1"
    ;;
  check-routes)
    runs "$OUT/check-routes.txt" "^vllm_e2e " E2E_TIMEOUT=400 \
      E2E_RUNS="--arch llama --transport nccl --trainer-gpu 1 --trainer-ranks 1"
    ;;
  bench-tp2)
    runs "$OUT/bench-tp2.txt" "^bench_vllm_update.py " BENCH_TIMEOUT=560 BENCH_TAIL=60 \
      BENCH_VLLM="$BENCH --tp 2 --graph-pairs --decode-slowdown-budget 1.08 --trainer-ranks 2 --gather-ranks 2 --budget-s 550"
    ;;
  bench-tp2-auto)
    runs "$OUT/bench-tp2-auto.txt" "^bench_vllm_update.py " BENCH_TIMEOUT=300 BENCH_TAIL=60 \
      BENCH_VLLM="$BENCH --tp 2 --graph-pairs --decode-slowdown-budget 1.08 --commit-mode auto --budget-s 290"
    ;;
  bench-network)
    mkdir -p "$OUT/network" "$OUT/nvlink"
    (network_env && runs "$OUT/bench-network.txt" "^bench_vllm_update.py " OUT="$OUT/network" \
      BENCH_TIMEOUT=280 BENCH_VLLM="$BENCH --transport nccl --trainer-gpu 1 --graph-pairs --budget-s 270"
     exit "$failed") || failed=$((failed + 1))
    [[ "${2:-}" == --nvlink ]] && runs "$OUT/bench-nvlink.txt" "^bench_vllm_update.py " OUT="$OUT/nvlink" BENCH_TIMEOUT=280 \
      BENCH_VLLM="$BENCH --transport nccl --trainer-gpu 1 --graph-pairs --budget-s 270"
    ;;
  bench-routes)
    runs "$OUT/bench-routes.txt" "^bench_vllm_update.py " BENCH_TIMEOUT=560 BENCH_TAIL=60 \
      BENCH_VLLM="$BENCH --transport nccl --trainer-gpu 1 --graph-pairs --trainer-ranks 1 --budget-s 550"
    ;;
  check-fsdp2)
    torchrun_step "$OUT/fsdp2-tp2.log" 300 examples/fsdp2_trainer.py --device cuda --engine-tp 2 \
      --check --steps 3
    torchrun_step "$OUT/fsdp2-tp1.log" 240 examples/fsdp2_trainer.py --device cuda --engine-tp 1 \
      --check --steps 3
    ;;
  bench-gather)
    torchrun_step "$OUT/bench-gather.log" 300 bench/bench_fsdp2_gather.py --config llama-3-8b \
      --device cuda --out "$OUT/fsdp2-gather"
    ;;
esac
echo "two_gpu.sh $step: $failed step(s) failed"
exit "$failed"
