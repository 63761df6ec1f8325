#!/usr/bin/env bash
# The GPU runs of the two examples, from the repository root of a GPU machine, against a
# CUDA build (scripts/gpu/run.sh tests calls it with build-gpu/ after building control_channel and
# shadowsync_c; see docs/testing.md):
#
#   bash scripts/gpu/run.sh examples BUILD_DIR [--rounds N] [--deadline SECONDS] [--cpu-dry-run]
#
# 1. two-process: examples/control_channel as two processes, the engine on GPU 1 and the trainer
#    on GPU 0 (--backend cuda): NCCL rendezvous, headers and acks over the control channel, N
#    rounds (default 50). Checks: trainer exit 0 with "N rounds acked", engine exit 0 with
#    applied=N failed=0 torn=0 and one "update version=" line per round.
# 2. mini worker: python/tests/test_mini_worker.py (pytest), the CPU cases and the cuda cases
#    (cuda: trainer cuda:0, engine cuda:1, one process, NCCL; cuda_same_host: trainer and engine
#    in two processes on cuda:0, the same-host transport's device flavour);
#    SHADOWSYNC_REQUIRE_GPU_TESTS=1 turns a cuda skip into a failure.
#
# --cpu-dry-run checks this script's own logic where there is no GPU: the same steps and checks
# with --backend host and the mini worker's cpu cases only. It proves nothing about GPUs.
#
# Each part runs under `timeout` (--deadline, default 120 s each). Prints every log, then one
# result line per part ("two_process: ... result=PASS|FAIL", "mini_worker: ... result=...").
# Exit status: 0 if both passed, 77 if this machine has fewer than 2 GPUs, else 1.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly ROOT=$PWD

BUILD="${1:?usage: scripts/gpu/run.sh examples BUILD_DIR [--rounds N] [--deadline SECONDS] [--cpu-dry-run]}"
shift
ROUNDS=50
DEADLINE=120
BACKEND=cuda
while (($#)); do
  case "$1" in
    --cpu-dry-run) BACKEND=host ;;
    --rounds) ROUNDS="${2:?--rounds needs a number}"; shift ;;
    --deadline) DEADLINE="${2:?--deadline needs seconds}"; shift ;;
    *) echo "gpu/run.sh examples: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
for n in "$ROUNDS" "$DEADLINE"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "gpu/run.sh examples: expected a positive number, got '$n'" >&2; exit 2; }
done
BUILD=$(cd "$BUILD" && pwd) || exit 2
readonly BIN="$BUILD/examples/control_channel"
readonly LIB="$BUILD/libshadowsync_c.so"

# NVLink multicast off (scripts/gpu/common.sh says why) also when this script runs on its own.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [[ $BACKEND == cuda ]] && ((gpus < 2)); then
  echo "SKIP: the two-GPU examples need 2 GPUs, nvidia-smi lists $gpus"
  exit 77
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
FAILED=0

# --- 1. two processes, two GPUs ---------------------------------------------------------------
two_process() {
  [[ -x "$BIN" ]] || { echo "two_process: $BIN missing (build the control_channel target) result=FAIL"; return 1; }
  SHADOWSYNC_CONTROL_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  export SHADOWSYNC_CONTROL_TOKEN
  local engine_log="$WORK/engine.log" trainer_log="$WORK/trainer.log"
  timeout -k 10 "$DEADLINE" "$BIN" engine --backend "$BACKEND" --device 1 >"$engine_log" 2>&1 &
  local engine_pid=$! port="" start=$SECONDS
  # The engine prints "listening <port>" once it accepts connections (CUDA init first).
  while [[ -z "$port" ]] && ((SECONDS - start < 60)) && kill -0 "$engine_pid" 2>/dev/null; do
    port=$(sed -n 's/^listening \([0-9][0-9]*\)$/\1/p' "$engine_log" | head -1)
    [[ -n "$port" ]] || sleep 0.2
  done
  local trainer_rc=255 engine_rc
  if [[ -n "$port" ]]; then
    timeout -k 10 "$DEADLINE" "$BIN" trainer --backend "$BACKEND" --device 0 --port "$port" \
      --rounds "$ROUNDS" >"$trainer_log" 2>&1
    trainer_rc=$?
  else
    echo "two_process: the engine printed no 'listening <port>' line within 60 s" >"$trainer_log"
  fi
  kill -TERM "$engine_pid" 2>/dev/null  # the engine serves until told to stop (timeout passes it on)
  wait "$engine_pid"
  engine_rc=$?
  echo "== trainer (--backend $BACKEND --device 0), rc $trainer_rc"; cat "$trainer_log"
  echo "== engine (--backend $BACKEND --device 1), rc $engine_rc"; cat "$engine_log"

  local summary
  summary=$(grep -m1 '^engine summary:' "$engine_log")
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$summary"; }
  local applied torn failed lines why=()
  applied=$(field applied); torn=$(field torn); failed=$(field failed)
  lines=$(grep -c '^update version=[0-9]* stall_us=' "$engine_log")
  ((trainer_rc == 0)) || why+=("trainer rc $trainer_rc")
  grep -q "^trainer: $ROUNDS rounds acked" "$trainer_log" || why+=("trainer did not ack $ROUNDS rounds")
  ((engine_rc == 0)) || why+=("engine rc $engine_rc")
  [[ "$applied" == "$ROUNDS" ]] || why+=("applied=${applied:-?}, expected $ROUNDS")
  [[ "$torn" == "0" ]] || why+=("torn=${torn:-?}, expected 0")
  [[ "$failed" == "0" ]] || why+=("failed=${failed:-?}, expected 0")
  ((lines == ROUNDS)) || why+=("$lines update lines, expected $ROUNDS")
  local result=PASS
  ((${#why[@]} == 0)) || result=FAIL
  echo "two_process: backend=$BACKEND rounds=$ROUNDS applied=${applied:-?} torn=${torn:-?} failed=${failed:-?}" \
    "max_stall_us=$(field max_stall_us) steps=$(field steps) result=$result${why[*]:+ (${why[*]})}"
  [[ $result == PASS ]]
}

# --- 2. the mini vLLM-like worker, CPU and cuda ---------------------------------------------------
mini_worker() {
  [[ -f "$LIB" ]] || { echo "mini_worker: $LIB missing (build the shadowsync_c target) result=FAIL"; return 1; }
  local log="$WORK/pytest.log" rc cases=(cpu cuda cpu_same_host cuda_same_host) select=() require=1
  if [[ $BACKEND == host ]]; then cases=(cpu cpu_same_host); select=(-k cpu); require=0; fi
  SHADOWSYNC_LIBRARY="$LIB" SHADOWSYNC_REQUIRE_GPU_TESTS=$require PYTHONUNBUFFERED=1 \
    timeout -k 10 "$DEADLINE" python3 -m pytest -v -rs -p no:cacheprovider "${select[@]}" \
    "$ROOT/python/tests/test_mini_worker.py" >"$log" 2>&1
  rc=$?
  cat "$log"
  local passed
  passed=$(grep -cE 'test_mini_worker.py::.*\[(cpu|cuda)(_same_host)?\] PASSED' "$log")
  if ((rc == 0 && passed == ${#cases[@]})); then
    echo "mini_worker: cases=$(IFS=,; echo "${cases[*]}") passed=$passed result=PASS"
  else
    echo "mini_worker: passed=$passed of ${#cases[@]} (pytest rc $rc) result=FAIL"
    return 1
  fi
}

two_process || FAILED=1
mini_worker || FAILED=1
exit "$FAILED"
