// One model's run in bench_same_host_one_gpu, on the engine's side (the phases: the top of
// bench_same_host_one_gpu.cu): whether it fits, the connection, the raw copy and the transport
// alone, updates end to end with their swaps, decode alone and beside each kind of copy, and the
// memory each piece took. CUDA builds only.
#pragma once

#include "bench_models.h"
#include "same_host_engine.h"
#include "same_host_results.h"

namespace shadowsync::bench::same_host {

// Runs `model` (the `index`-th of the run: its socket's name) with `e`'s trainer process; a
// phase that does not fit the budget or the device is listed in ModelRun::skipped. Throws
// BenchError when a phase fails (the trainer's state is then unknown).
ModelRun run_model(const ModelConfig& model, Engine& e, int index);

}  // namespace shadowsync::bench::same_host
