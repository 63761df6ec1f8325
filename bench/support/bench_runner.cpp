// The update benchmark's main() and its watchdog (see bench_runner.h).
#include "bench_runner.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "bench_host_platform.h"
#include "bench_phases.h"
#include "bench_watchdog.h"

namespace shadowsync::bench {

double elapsed_since_start() {
  static const Clock::time_point start = Clock::now();
  return to_s(Clock::now() - start);
}

void progress(const std::string& line) {
  std::printf("[bench %6.1fs] %s\n", elapsed_since_start(), line.c_str());
  std::fflush(stdout);
}

// Runs the bench under a watchdog, writes the artefacts, prints the Markdown; returns the exit code.
int run_bench(Platform& platform, const Options& o) {
  Bench bench(platform, o);
  bool ok = false;
  std::string end = "finished";
  {
    // The hard stop: if anything (NCCL included) hangs past the watchdog, write what there is and
    // end the process.
    const Watchdog watchdog(o.watchdog_s, [&] {
      std::fprintf(stderr, "bench: watchdog: still running after %.0f s; writing partial results and exiting\n",
                   o.watchdog_s);
      try {
        const std::string base = bench.write("watchdog: a phase hung", false);
        std::fprintf(stderr, "bench: wrote %s.json and %s.md (incomplete)\n", base.c_str(), base.c_str());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench: watchdog could not write results: %s\n", e.what());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(3);
    });
    try {
      ok = bench.run();
      if (!ok) end = "finished with errors";
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench: %s\n", e.what());
      end = cat("stopped: ", e.what());
    }
  }

  int rc = ok ? 0 : 1;
  try {
    const std::string base = bench.write(end, ok);
    std::printf("\n%s\n", bench.markdown().c_str());
    progress(cat("wrote ", base, ".json and ", base, ".md"));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: %s\n", e.what());
    rc = 1;
  }
  return rc;
}

// main() of both programs. gpu_factory is empty in a build without CUDA; it returns null (having
// said why) when the machine cannot run the GPU mode.
int bench_main(int argc, char** argv, const PlatformFactory& gpu_factory) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  elapsed_since_start();
  const std::optional<Options> parsed = parse_options(argc, argv, static_cast<bool>(gpu_factory));
  if (!parsed) return 2;

  std::unique_ptr<Platform> platform;
  try {
    platform = parsed->cpu ? make_host_platform() : gpu_factory();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: %s\n", e.what());
    return 1;
  }
  if (!platform) return 77;
  const int rc = run_bench(*platform, *parsed);
  platform.reset();
  return rc;
}

}  // namespace shadowsync::bench
