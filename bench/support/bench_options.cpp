// The update benchmark's options (see bench_options.h).
#include "bench_options.h"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

#include "bench_models.h"
#include "bench_stamp.h"

namespace shadowsync::bench {

void apply_cpu_defaults(Options& o) {
  o.scale = 32;
  const std::size_t shrink = 1024;
  o.bucket_bytes /= shrink;
  for (std::size_t& b : o.sweep_buckets) b /= shrink;
  o.decode_bytes /= shrink;
  o.raw_chunk /= shrink;
  o.sweep_raw_bytes /= shrink;
  o.swaps = 20;
  o.alone_steps = 40;
  o.during_seconds = 0.25;
  o.sweep_updates = 3;
  o.sweep_alone_steps = 20;
  o.sweep_during_seconds = 0.1;
  o.raw_reps = 2;
  o.baseline_reps = 2;
  o.copy_reps = 3;
  o.strategy_swaps = 5;
  o.integrity_updates = 5;
  o.raw_copy_reps = 3;
  o.fault_reps = 2;
  o.fault_deadline_ms = 200;
  o.fast_path_calls = 200'000;
  o.budget_s = 100;
}

void usage(std::FILE* out, const char* argv0, bool has_gpu) {
  std::fprintf(out,
               "usage: %s [--cpu] [--out DIR] [--commit SHA] [--machine NAME]\n"
               "          [--models a,b,c] [--no-sweep] [--swaps N] [--bucket-mib N]\n"
               "          [--decode-gib G] [--during-seconds S] [--fault-deadline-ms N] [--budget S]\n"
               "  --cpu             CPU smoke mode: HostBackend + loopback transport, models / 32%s\n"
               "  --out DIR         where the JSON and Markdown go (default docs/bench)\n"
               "  --commit SHA      git commit to stamp (default: $SHADOWSYNC_COMMIT, $GIT_COMMIT)\n"
               "  --machine NAME    machine to stamp (default: the GPU's name)\n"
               "  --models LIST     of qwen2.5-0.5b, llama3-8b, qwen2.5-14b (default: all three)\n"
               "  --no-sweep        skip the knob sweep (bucket size, NCCL max CTAs, priority)\n"
               "  --swaps N         measured swaps per model (default 40, CPU 20; at least 20)\n"
               "  --bucket-mib N    bucket size of the main phases (default 512)\n"
               "  --decode-gib G    bytes one decode step reads (default 4)\n"
               "  --during-seconds  length of the decode-while-updating window (default 1.5)\n"
               "  --fault-deadline-ms N  bucket deadline of the sender-fault session (default 1000, CPU 200)\n"
               "  --budget S        start no phase that would end past S seconds (default 210)\n",
               argv0, has_gpu ? "" : " (this build has only this mode)");
}

std::optional<Options> parse_options(int argc, char** argv, bool has_gpu) {
  Options o;
  bool cpu = !has_gpu;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--cpu") cpu = true;
  }
  if (cpu) apply_cpu_defaults(o);
  o.cpu = cpu;
  const std::size_t byte_scale = cpu ? 1024 : 1;
  auto fail = [&](const std::string& why) -> std::optional<Options> {
    std::fprintf(stderr, "bench: %s\n", why.c_str());
    usage(stderr, argv[0], has_gpu);
    return std::nullopt;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::optional<std::string> {
      if (i + 1 >= argc) return std::nullopt;
      return std::string(argv[++i]);
    };
    auto number = [&]() -> std::optional<double> {
      const auto text = value();
      if (!text || text->empty()) return std::nullopt;
      char* end = nullptr;
      const double n = std::strtod(text->c_str(), &end);
      if (*end != '\0' || !(n > 0)) return std::nullopt;
      return n;
    };
    if (arg == "--cpu") {
      continue;
    } else if (arg == "-h" || arg == "--help") {
      usage(stdout, argv[0], has_gpu);
      std::exit(0);
    } else if (arg == "--out") {
      const auto v = value();
      if (!v) return fail("--out needs a directory");
      o.out_dir = *v;
    } else if (arg == "--commit") {
      const auto v = value();
      if (!v) return fail("--commit needs a value");
      o.commit = *v;
    } else if (arg == "--machine") {
      const auto v = value();
      if (!v) return fail("--machine needs a value");
      o.machine = *v;
    } else if (arg == "--models") {
      const auto v = value();
      if (!v) return fail("--models needs a list");
      if (v->empty()) return fail("--models: empty list");
      o.models.clear();
      try {
        for (const ModelConfig& m : models_named(*v)) o.models.push_back(m.name);
      } catch (const std::invalid_argument& e) {
        return fail(cat("--models: ", e.what()));
      }
    } else if (arg == "--no-sweep") {
      o.sweep = false;
    } else if (arg == "--swaps") {
      const auto n = number();
      if (!n || *n < 20) return fail("--swaps needs a number >= 20");
      o.swaps = static_cast<int>(*n);
    } else if (arg == "--bucket-mib") {
      const auto n = number();
      if (!n) return fail("--bucket-mib needs a positive number");
      o.bucket_bytes = static_cast<std::size_t>(*n * kMiB) / byte_scale / 256 * 256;
      if (o.bucket_bytes == 0) return fail("--bucket-mib: too small");
    } else if (arg == "--decode-gib") {
      const auto n = number();
      if (!n) return fail("--decode-gib needs a positive number");
      o.decode_bytes = static_cast<std::size_t>(*n * static_cast<double>(kGiB)) / byte_scale;
    } else if (arg == "--during-seconds") {
      const auto n = number();
      if (!n) return fail("--during-seconds needs a positive number");
      o.during_seconds = *n;
    } else if (arg == "--fault-deadline-ms") {
      const auto n = number();
      if (!n) return fail("--fault-deadline-ms needs a positive number");
      o.fault_deadline_ms = static_cast<int>(*n);
    } else if (arg == "--budget") {
      const auto n = number();
      if (!n) return fail("--budget needs seconds");
      o.budget_s = *n;
    } else {
      return fail(cat("unknown argument '", arg, "'"));
    }
  }
  o.commit = commit_or_environment(o.commit);
  if (o.watchdog_s <= 0) o.watchdog_s = o.budget_s + 25;
  o.command = command_line(argc, argv);
  return o;
}

}  // namespace shadowsync::bench
