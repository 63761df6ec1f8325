#!/usr/bin/env bash
# The GPU fault runs: a trainer process that dies or hangs mid-update never takes the engine
# down, and the next trainer's updates apply. From the repository root of a GPU machine, against
# a CUDA build (scripts/gpu/run.sh tests calls it with build-gpu/ unless --no-faults; docs/testing.md):
#
#   bash scripts/gpu/run.sh faults BUILD_DIR [--cycles N] [--bucket-deadline-ms MS]
#                              [--growth-mib MIB] [--deadline SECONDS] [--network] [--cpu-dry-run]
#
# One engine process (examples/control_channel engine --backend cuda --device 1) decodes all the
# while; trainer processes (--device 0) come and go:
# 1. kill: a trainer acks 2 rounds, stops halfway through a third update (--hang-mid-update:
#    its first tensor's buckets sent), and is SIGKILLed. The engine must report the update failed
#    within bucket deadline + poll interval + ABORT_MS + SLACK_MS of the kill (measured from the
#    kill to the engine's "failed version=V ... unix_ms=T" line, printed as detect_ms). ABORT_MS:
#    the receiver aborts its transport before it reports the failure (the report means "discarded,
#    and ready for a new trainer"), and ncclCommAbort with the peer gone takes about half a second
#    (it joins NCCL's proxy threads, which wake from 500 ms polls): 0.46-0.51 s over the deadline
#    on 4 H100, 0.56 s median and 0.88 s max in bench_gpu's sender-fault figures on 2 H200. A restarted trainer
#    reconnects (new NCCL rendezvous) and its 3 rounds must be acked.
# 2. stop: the same with SIGSTOP instead (a hung trainer: its sockets stay open, only the deadline
#    can tell); then the stopped trainer is SIGKILLed and a new one's rounds must be acked.
# 3. cycles: N times (default 20) one round, kill mid-update, restart with one round. After each cycle the
#    engine's memory in use is printed: on GPUs its device memory (nvidia-smi, the engine's pid);
#    with --cpu-dry-run its resident memory (VmRSS) and thread count. The check: the last cycle's
#    value exceeds the first cycle's by at most --growth-mib (default 128 MiB on GPUs: the NCCL
#    communicator rebuilt each cycle holds tens of MiB, so leaking one per cycle would exceed it
#    after a few cycles; 32 MiB for VmRSS), and the thread count does not grow.
# At the end the engine (SIGTERM) must exit 0 with torn=0, failed = the faults injected, and
# applied = the rounds acked.
#
# --network: as between two hosts. NCCL's peer-to-peer and shared-memory paths (and InfiniBand)
# are off, so NCCL moves the bytes over its socket transport; the control channel and NCCL's
# sockets use the machine's first IPv4 address that is not a loopback one (its interface is
# NCCL_SOCKET_IFNAME). Fails at once if the machine has no such address.
#
# --cpu-dry-run runs the same logic with --backend host (the same-host transport instead of NCCL):
# it checks this script, the example's fault options and the receiver's behaviour on the CPU, not
# the GPUs. ctest runs it as integration.gpu_faults_cpu with --cycles 5.
#
# Prints every log, one line per fault ("fault kill|stop|cycle I: version=V detect_ms=D limit_ms=L
# ... ok|FAIL") and a final "faults: ... result=PASS|FAIL". Exit status: 0 if it passed, 77 if this
# machine has fewer than 2 GPUs (not with --cpu-dry-run), else 1.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1

usage="usage: scripts/gpu/run.sh faults BUILD_DIR [--cycles N] [--bucket-deadline-ms MS] [--growth-mib MIB] [--deadline SECONDS] [--network] [--cpu-dry-run]"
BUILD="${1:?$usage}"
shift
CYCLES=20
BUCKET_MS=2000   # the engine's ReceiverConfig::bucket_deadline for these runs
GROWTH_MIB=""
DEADLINE=60      # each trainer process, and each wait for a line
BACKEND=cuda
NETWORK=0
ADDRESS=127.0.0.1  # the control channel's; --network: the machine's own
readonly POLL_MS=1     # ReceiverConfig::poll_interval (200 us), rounded up
readonly SLACK_MS=250  # process scheduling and log writing between the engine and this script
ABORT_MS=1000          # ncclCommAbort before the report (see above); 0 with --cpu-dry-run
while (($#)); do
  case "$1" in
    --cpu-dry-run) BACKEND=host ;;
    --network) NETWORK=1 ;;
    --cycles) CYCLES="${2:?--cycles needs a number}"; shift ;;
    --bucket-deadline-ms) BUCKET_MS="${2:?--bucket-deadline-ms needs a number}"; shift ;;
    --growth-mib) GROWTH_MIB="${2:?--growth-mib needs a number}"; shift ;;
    --deadline) DEADLINE="${2:?--deadline needs seconds}"; shift ;;
    *) echo "gpu/run.sh faults: unknown argument '$1'" >&2; echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
[[ $BACKEND == cuda ]] || ABORT_MS=0  # the same-host transport's abort closes sockets: at once
[[ -n "$GROWTH_MIB" ]] || { [[ $BACKEND == cuda ]] && GROWTH_MIB=128 || GROWTH_MIB=32; }
for n in "$CYCLES" "$BUCKET_MS" "$GROWTH_MIB" "$DEADLINE"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "gpu/run.sh faults: expected a positive number, got '$n'" >&2; exit 2; }
done
BUILD=$(cd "$BUILD" && pwd) || exit 2
readonly BIN="$BUILD/examples/control_channel"
[[ -x "$BIN" ]] || { echo "faults: $BIN missing (build the control_channel target) result=FAIL"; exit 1; }

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ((NETWORK)); then
  # "INTERFACE ADDRESS" of the first IPv4 address not on a loopback interface (ioctl SIOCGIFADDR:
  # the GPU machines' image may have no ip(8)).
  read -r IFACE ADDRESS < <(python3 - <<'PY'
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _, name in socket.if_nameindex():
    try:
        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    except OSError:
        continue  # no IPv4 address
    address = socket.inet_ntoa(raw[20:24])
    if not address.startswith("127."):
        print(name, address)
        break
PY
  )
  if [[ -z "${ADDRESS:-}" ]]; then
    echo "faults: --network needs an IPv4 address on an interface other than loopback; this" \
      "machine has none (interfaces: $(ls /sys/class/net 2>/dev/null | tr '\n' ' ')) result=FAIL"
    exit 1
  fi
  export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME="$IFACE"
  echo "faults: network path: control channel and NCCL on $IFACE ($ADDRESS)," \
    "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1"
fi
if [[ $BACKEND == cuda ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if ((gpus < 2)); then
    echo "SKIP: the fault runs need 2 GPUs, nvidia-smi lists $gpus"
    exit 77
  fi
fi

WORK=$(mktemp -d)
ENGINE_PID=""
TRAINER_PID=""
# The trainer process itself: TRAINER_PID is the `timeout` that runs it, and a SIGKILL or SIGSTOP
# of `timeout` (which it cannot pass on) would leave the trainer running, unseen by the engine.
trainer_process() { pgrep -P "$TRAINER_PID" 2>/dev/null | head -1; }
kill_trainer() {
  local child
  child=$(trainer_process)
  [[ -n "$child" ]] && kill -KILL "$child" 2>/dev/null
  kill -KILL "$TRAINER_PID" 2>/dev/null
}
cleanup() {
  [[ -n "$TRAINER_PID" ]] && kill_trainer
  [[ -n "$ENGINE_PID" ]] && kill -KILL "$ENGINE_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
SHADOWSYNC_CONTROL_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
export SHADOWSYNC_CONTROL_TOKEN
readonly ENGINE_LOG="$WORK/engine.log"
FAULTS=0      # faults injected: each must show as one failed update
ACKED=0       # rounds acked by trainers
WHY=()        # what failed
TRAINERS=0

now_ms() { date +%s%3N; }

# wait_for FILE EXTENDED_REGEX SECONDS: the first matching line, or nothing at the deadline.
wait_for() {
  local file="$1" regex="$2" limit=$(($(now_ms) + $3 * 1000)) line
  while (($(now_ms) < limit)); do
    line=$(grep -m1 -E "$regex" "$file" 2>/dev/null) && { echo "$line"; return 0; }
    sleep 0.05
  done
  return 1
}

# start_trainer LOG ARGS...: a trainer process in the background (TRAINER_PID).
start_trainer() {
  local log="$1"
  shift
  TRAINERS=$((TRAINERS + 1))
  timeout -k 5 "$DEADLINE" "$BIN" trainer --backend "$BACKEND" --device 0 --address "$ADDRESS" \
    --port "$PORT" "$@" \
    >"$log" 2>&1 &
  TRAINER_PID=$!
}

# run_trainer ROUNDS: a trainer that must ack ROUNDS rounds and exit 0.
run_trainer() {
  local rounds="$1" log="$WORK/trainer.$((TRAINERS + 1)).log" rc
  start_trainer "$log" --rounds "$rounds"
  wait "$TRAINER_PID"
  rc=$?
  TRAINER_PID=""
  if ((rc == 0)) && grep -q "^trainer: $rounds rounds acked" "$log"; then
    ACKED=$((ACKED + rounds))
    return 0
  fi
  echo "== trainer ($log), rc $rc"; cat "$log"
  WHY+=("a restarted trainer did not ack $rounds rounds (rc $rc)")
  return 1
}

# fault NAME SIGNAL ROUNDS_BEFORE: a trainer acks ROUNDS_BEFORE rounds, stops mid-update, gets
# SIGNAL; the engine must report that update failed within the limit. Prints one line.
fault() {
  local name="$1" signal="$2" rounds="$3" log="$WORK/trainer.$((TRAINERS + 1)).log" line version
  start_trainer "$log" --rounds "$rounds" --hang-mid-update
  if ! line=$(wait_for "$log" '^trainer: mid-update version=[0-9]+$' "$DEADLINE"); then
    echo "== trainer ($log)"; cat "$log"
    WHY+=("$name: the trainer never reached the middle of an update")
    kill_trainer; wait "$TRAINER_PID" 2>/dev/null; TRAINER_PID=""
    return 1
  fi
  version=${line##*=}
  local signalled_ms target
  target=$(trainer_process)
  [[ -n "$target" ]] || WHY+=("$name: no trainer process under timeout pid $TRAINER_PID")
  signalled_ms=$(now_ms)
  kill "-$signal" "${target:-$TRAINER_PID}"
  FAULTS=$((FAULTS + 1))
  ACKED=$((ACKED + rounds))
  local limit_ms=$((BUCKET_MS + POLL_MS + ABORT_MS + SLACK_MS)) failed detect_ms verdict=ok
  if failed=$(wait_for "$ENGINE_LOG" "^failed version=$version " $((BUCKET_MS / 1000 + DEADLINE))); then
    local reported_ms
    reported_ms=$(sed -n 's/.* unix_ms=\([0-9]*\) .*/\1/p' <<<"$failed")
    detect_ms=$((reported_ms - signalled_ms))
    ((detect_ms <= limit_ms)) || { verdict=FAIL; WHY+=("$name: reported after $detect_ms ms > $limit_ms ms"); }
  else
    detect_ms="none"
    verdict=FAIL
    WHY+=("$name: the engine never reported update $version failed")
  fi
  # A stopped process dies of SIGKILL too; the next trainer replaces it either way.
  kill_trainer
  wait "$TRAINER_PID" 2>/dev/null
  TRAINER_PID=""
  local code
  code=$(sed -n 's/.* code=\([a-z_]*\) .*/\1/p' <<<"${failed:-}")
  local over="?"
  [[ $detect_ms == none ]] || over=$((detect_ms - BUCKET_MS))
  echo "fault $name: version=$version signal=SIG$signal code=${code:-?} detect_ms=$detect_ms" \
    "over_deadline_ms=$over limit_ms=$limit_ms (bucket deadline $BUCKET_MS + poll $POLL_MS" \
    "+ abort $ABORT_MS + slack $SLACK_MS) $verdict"
  [[ $verdict == ok ]]
}

# The engine's memory in use, in MiB: device memory on GPUs, resident memory on the CPU.
memory_mib() {
  if [[ $BACKEND == cuda ]]; then
    local used
    used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      awk -F', *' -v pid="$ENGINE_PID" '$1 == pid { used += $2 } END { print used + 0 }')
    # In a container nvidia-smi may not list processes (another pid namespace): then all of GPU 1,
    # which only the engine uses here.
    if [[ "${used:-0}" == 0 ]]; then
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 1 2>/dev/null | head -1)
    fi
    echo "${used:-0}"
  else
    awk '/^VmRSS:/ { printf "%d\n", $2 / 1024 }' "/proc/$ENGINE_PID/status" 2>/dev/null
  fi
}
threads() { ls "/proc/$ENGINE_PID/task" 2>/dev/null | wc -l; }

# --- the engine --------------------------------------------------------------------------------
ENGINE_PID=""
# Not under `timeout`: SIGSTOP/SIGKILL go to the trainer only, and the engine's pid must be its own
# (nvidia-smi lists the process that holds the GPU memory).
"$BIN" engine --backend "$BACKEND" --device 1 --address "$ADDRESS" --bucket-deadline-ms "$BUCKET_MS" \
  >"$ENGINE_LOG" 2>&1 &
ENGINE_PID=$!
PORT=""
if line=$(wait_for "$ENGINE_LOG" '^listening [0-9]+$' 60); then PORT=${line#listening }; fi
if [[ -z "$PORT" ]]; then
  cat "$ENGINE_LOG"
  echo "faults: backend=$BACKEND the engine printed no 'listening <port>' line within 60 s result=FAIL"
  exit 1
fi
echo "faults: backend=$BACKEND engine pid $ENGINE_PID port $PORT bucket_deadline_ms=$BUCKET_MS cycles=$CYCLES growth_mib=$GROWTH_MIB"

# --- 1. SIGKILL, 2. SIGSTOP ---------------------------------------------------------------------
fault kill KILL 2 && run_trainer 3
fault stop STOP 2 && run_trainer 3

# --- 3. kill/restart cycles ---------------------------------------------------------------------
first_mib="" last_mib="" first_threads="" last_threads=""
for ((i = 1; i <= CYCLES; ++i)); do
  fault "cycle $i" KILL 1 && run_trainer 1 || break
  last_mib=$(memory_mib)
  last_threads=$(threads)
  [[ -n "$first_mib" ]] || { first_mib=$last_mib; first_threads=$last_threads; }
  echo "cycle $i: engine memory_mib=$last_mib threads=$last_threads ($([[ $BACKEND == cuda ]] && echo device || echo VmRSS))"
done
if [[ -n "$first_mib" ]]; then
  growth=$((last_mib - first_mib))
  ((growth <= GROWTH_MIB)) || WHY+=("engine memory grew $growth MiB over the cycles (> $GROWTH_MIB)")
  ((last_threads <= first_threads)) || WHY+=("engine threads grew from $first_threads to $last_threads")
else
  growth="?"
  WHY+=("no kill/restart cycle completed")
fi

# --- the engine's verdict -------------------------------------------------------------------------
kill -TERM "$ENGINE_PID"
engine_rc=124
if wait_for "$ENGINE_LOG" '^engine summary:' "$DEADLINE" >/dev/null; then
  wait "$ENGINE_PID"
  engine_rc=$?
else
  kill -KILL "$ENGINE_PID" 2>/dev/null
  wait "$ENGINE_PID" 2>/dev/null
fi
ENGINE_PID=""
echo "== engine (--backend $BACKEND --device 1), rc $engine_rc"; cat "$ENGINE_LOG"
summary=$(grep -m1 '^engine summary:' "$ENGINE_LOG")
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$summary"; }
applied=$(field applied); torn=$(field torn); failed=$(field failed)
((engine_rc == 0)) || WHY+=("engine rc $engine_rc")
[[ "$torn" == "0" ]] || WHY+=("torn=${torn:-?}, expected 0")
[[ "$failed" == "$FAULTS" ]] || WHY+=("failed=${failed:-?}, expected $FAULTS (one per fault)")
[[ "$applied" == "$ACKED" ]] || WHY+=("applied=${applied:-?}, expected $ACKED (the rounds acked)")
result=PASS
((${#WHY[@]} == 0)) || result=FAIL
echo "faults: backend=$BACKEND faults=$FAULTS failed=${failed:-?} applied=${applied:-?} torn=${torn:-?}" \
  "memory_growth_mib=$growth threads=${first_threads:-?}->${last_threads:-?} steps=$(field steps)" \
  "result=$result${WHY[*]:+ (${WHY[*]})}"
[[ $result == PASS ]]
