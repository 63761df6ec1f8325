// The update benchmark's main(): options, the platform, the run under a watchdog, the artefacts.
// Used by bench_updates.cpp (CPU smoke mode only) and bench_gpu.cu (two GPUs; --cpu also works
// there). See bench/README.md.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "bench_options.h"
#include "bench_platform.h"

namespace shadowsync::bench {

// Makes the GPU platform; returns null (having said why) when the machine cannot run it.
using PlatformFactory = std::function<std::unique_ptr<Platform>()>;

// Seconds since the program's first call of this function (bench_main makes that call first).
double elapsed_since_start();

// Prints "[bench <elapsed>s] <line>" to stdout and flushes it. Any thread.
void progress(const std::string& line);

// Runs the bench under a watchdog, writes the artefacts, prints the Markdown; returns the exit code.
int run_bench(Platform& platform, const Options& o);

// main() of both programs. gpu_factory is empty in a build without CUDA; it returns null (having
// said why) when the machine cannot run the GPU mode. Exit: 0 every phase ran, 1 a phase failed
// (results still written), 2 bad arguments, 3 watchdog, 77 no GPU platform.
int bench_main(int argc, char** argv, const PlatformFactory& gpu_factory);

}  // namespace shadowsync::bench
