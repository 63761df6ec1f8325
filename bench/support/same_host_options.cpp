// bench_same_host_one_gpu's command line (see same_host_options.h).
#include "same_host_options.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench_common.h"
#include "bench_stamp.h"

namespace shadowsync::bench::same_host {

namespace {

constexpr const char* kUsage =
    "usage: bench_same_host_one_gpu [--out DIR] [--commit SHA] [--machine NAME] [--models a,b]\n"
    "         [--updates N] [--reps N] [--decode-gib G] [--decode-steps N] [--during-seconds S]\n"
    "         [--sources auto|full|shared] [--checksums] [--sm-copy-ctas N] [--budget S]\n"
    "         [--device D] [--trainer-device T]\n";

}  // namespace

bool parse_options(int argc, char** argv, Options& o) {
  const auto fail = [](const std::string& why) {
    std::fprintf(stderr, "bench_same_host_one_gpu: %s\n%s", why.c_str(), kUsage);
    return false;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    if (arg == "--checksums") {
      o.checksums = true;
      continue;
    }
    if (i + 1 >= argc) return fail(cat(arg, " needs a value"));
    const std::string value = argv[++i];
    const auto number = [&](double low, double& out) {
      char* end = nullptr;
      out = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(out >= low)) {
        return fail(cat(arg, " needs a number >= ", low, ", got '", value, "'"));
      }
      return true;
    };
    double x = 0;
    if (arg == "--role") {
      if (value != "engine" && value != "trainer") {
        return fail(cat("--role is engine or trainer, got '", value, "'"));
      }
      o.role = value;
    } else if (arg == "--out") {
      o.out_dir = value;
    } else if (arg == "--commit") {
      o.commit = value;
    } else if (arg == "--machine") {
      o.machine = value;
    } else if (arg == "--models") {
      o.models = value;
    } else if (arg == "--sources") {
      if (value != "auto" && value != "full" && value != "shared") {
        return fail(cat("--sources is auto, full or shared, got '", value, "'"));
      }
      o.sources = value;
    } else if (arg == "--token-file") {
      o.token_file = value;
    } else if (arg == "--updates") {
      if (!number(5, x)) return false;
      o.updates = static_cast<int>(x);
    } else if (arg == "--reps") {
      if (!number(3, x)) return false;
      o.reps = static_cast<int>(x);
    } else if (arg == "--decode-gib") {
      if (!number(0.0625, x)) return false;
      o.decode_gib = x;
    } else if (arg == "--decode-steps") {
      if (!number(10, x)) return false;
      o.decode_steps = static_cast<int>(x);
    } else if (arg == "--during-seconds") {
      if (!number(0.1, x)) return false;
      o.during_s = x;
    } else if (arg == "--sm-copy-ctas") {
      if (!number(1, x)) return false;
      o.sm_copy_ctas = static_cast<int>(x);
    } else if (arg == "--budget") {
      if (!number(10, x)) return false;
      o.budget_s = x;
    } else if (arg == "--device") {
      if (!number(0, x)) return false;
      o.device = static_cast<int>(x);
    } else if (arg == "--trainer-device") {
      if (!number(0, x)) return false;
      o.trainer_device = static_cast<int>(x);
    } else if (arg == "--command-fd") {
      if (!number(0, x)) return false;
      o.command_fd = static_cast<int>(x);
    } else if (arg == "--reply-fd") {
      if (!number(0, x)) return false;
      o.reply_fd = static_cast<int>(x);
    } else {
      return fail(cat("unknown argument '", arg, "'"));
    }
  }
  if (o.role == "trainer" && (o.command_fd < 0 || o.reply_fd < 0)) {
    return fail("--role trainer needs --command-fd and --reply-fd (the engine passes them)");
  }
  if (o.trainer_device < 0) o.trainer_device = o.device;
  o.commit = commit_or_environment(o.commit);
  return true;
}

}  // namespace shadowsync::bench::same_host
