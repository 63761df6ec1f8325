#!/usr/bin/env bash
# Why the two-process example's engine (examples/control_channel, CUDA, NCCL: trainer GPU 0,
# engine GPU 1) may not exit after SIGTERM: runs the pair as scripts/gpu/examples.sh does, sends
# SIGTERM once the trainer is done, and if the engine is still alive WAIT seconds later prints
# every thread's backtrace (cuda-gdb attached to it) and kills it. A diagnostic, not a test.
#
#   bash scripts/gpu/diagnose_engine_exit.sh BUILD_DIR [WAIT_SECONDS]   (default 20)
set -uo pipefail
readonly BIN="${1:?usage: diagnose_engine_exit.sh BUILD_DIR [WAIT_SECONDS]}/examples/control_channel"
readonly WAIT="${2:-20}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SHADOWSYNC_CONTROL_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
export SHADOWSYNC_CONTROL_TOKEN
work=$(mktemp -d)
"$BIN" engine --backend cuda --device 1 >"$work/engine.log" 2>&1 &
pid=$!
port=""
for _ in $(seq 300); do
  port=$(sed -n 's/^listening \([0-9][0-9]*\)$/\1/p' "$work/engine.log" | head -1)
  [[ -n "$port" ]] && break
  sleep 0.2
done
[[ -n "$port" ]] || { echo "the engine printed no port"; cat "$work/engine.log"; kill -KILL "$pid"; exit 1; }
timeout 120 "$BIN" trainer --backend cuda --device 0 --port "$port" --rounds 50 >"$work/trainer.log" 2>&1
echo "trainer rc $?: $(tail -1 "$work/trainer.log")"
start=$SECONDS
kill -TERM "$pid"
while kill -0 "$pid" 2>/dev/null && ((SECONDS - start < WAIT)); do sleep 0.5; done
if kill -0 "$pid" 2>/dev/null; then
  echo "the engine is still alive $((SECONDS - start)) s after SIGTERM; its threads:"
  timeout 90 cuda-gdb -p "$pid" -batch -ex "info threads" -ex "thread apply all bt 16" 2>&1 |
    grep -vE "^\[New Thread|^Reading symbols|^warning:" | head -250
  kill -KILL "$pid"
else
  wait "$pid"
  echo "the engine exited (rc $?) $((SECONDS - start)) s after SIGTERM"
fi
echo "== engine log tail"; tail -4 "$work/engine.log"
rm -rf "$work"
