#!/usr/bin/env bash
# The one entry to the GPU-machine scripts (see docs/testing.md). Run from anywhere; each command
# runs from the repository root.
#
#   bash scripts/gpu/run.sh COMMAND [ARGS...]      (COMMAND --help: its own usage)
#
#   tests          build build-gpu/ with CUDA on and run the GPU tests, the two-GPU examples and
#                  the fault runs (tests.sh)
#   bench          the update benchmark on two GPUs, then its plot (bench.sh)
#   bench-one-gpu  the one-GPU benchmarks: integrity checks and swap strategies (bench_one_gpu.sh)
#   bench-same-host  the same-host transport (device memory) on one GPU, trainer and engine
#                  processes: transfer, swap stall, decode interference, memory; then its plot
#                  (bench_same_host.sh)
#   two-gpu        the runs on two GPUs of one host: TP=2 with graph pairs, a colocated sharded
#                  trainer, NCCL over its network path (two_gpu.sh)
#   examples       the two-process example and the mini worker against a CUDA build (examples.sh)
#   python         the wheel built with CUDA on, installed, python/tests against it: NCCL taken at
#                  run time (import orders with torch), one-rank communicator (python.sh)
#   faults         trainer processes killed and stopped mid-update (faults.sh; --cpu-dry-run runs
#                  it on the CPU, as ctest integration.gpu_faults_cpu does)
#   collect-debs   optional, for a GPU machine without a package registry: run it on a Debian or
#                  Ubuntu machine that has one, to download the build dependencies' .deb files
#                  into .deps/; copy .deps/ along with the tree (collect_debs.sh)
#
# Exit status: the command's; 2 for an unknown command.
set -uo pipefail
readonly HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() { sed -n '2,24p' "${BASH_SOURCE[0]}"; }

command="${1:-}"
case "$command" in
  tests) script=tests.sh ;;
  bench) script=bench.sh ;;
  bench-one-gpu) script=bench_one_gpu.sh ;;
  bench-same-host) script=bench_same_host.sh ;;
  two-gpu) script=two_gpu.sh ;;
  examples) script=examples.sh ;;
  faults) script=faults.sh ;;
  python) script=python.sh ;;
  collect-debs) script=collect_debs.sh ;;
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  *) echo "scripts/gpu/run.sh: unknown command '$command'" >&2; usage >&2; exit 2 ;;
esac
shift
exec bash "$HERE/$script" "$@"
