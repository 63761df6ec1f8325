// The update benchmark's CPU smoke mode: every scenario of bench_gpu (engine stall, transfer
// bandwidth, decode interference, the per-parameter baseline, copy-at-boundary, memory, the knob
// sweep, the copy_in swap strategy (remap needs CUDA), integrity cost, sender fault) on
// HostBackend + the loopback transport, with miniature models (dimensions / 32). It runs
// in seconds and in CI (ctest label `bench`); its figures are labelled "CPU smoke, not GPU
// figures" everywhere they appear. The GPU program is bench_gpu.cu (CUDA builds only).
//
//   bench_updates [--cpu] [--out DIR] [--commit SHA] [--models ...] [--no-sweep] ...
//
// Exit: 0 every phase ran, 1 a phase failed (results are still written), 2 bad arguments.
#include "support/bench_runner.h"

int main(int argc, char** argv) {
  return shadowsync::bench::bench_main(argc, argv, shadowsync::bench::PlatformFactory());
}
