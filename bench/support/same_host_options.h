// bench_same_host_one_gpu's command line, for both of its roles: the engine (what a user runs)
// and the trainer process the engine spawns (--role trainer, with the pipes' fds).
#pragma once

#include <string>

namespace shadowsync::bench::same_host {

struct Options {
  std::string role = "engine";
  std::string out_dir = "docs/bench";
  std::string commit;
  std::string machine;
  std::string models;
  int updates = 50;
  int reps = 10;
  double decode_gib = 4;
  int decode_steps = 100;
  double during_s = 1.5;
  std::string sources = "auto";
  bool checksums = false;
  int sm_copy_ctas = 0;  // 0: one per SM
  double budget_s = 200;
  int device = 0;
  int trainer_device = -1;  // -1: --device (both processes on one GPU)
  // --role trainer only (set by the engine when it spawns the trainer).
  int command_fd = -1;
  int reply_fd = -1;
  std::string token_file;
};

// Parses argv into `o`; on bad input prints what was wrong and the usage to stderr and returns
// false. --help prints the usage and exits 0.
bool parse_options(int argc, char** argv, Options& o);

}  // namespace shadowsync::bench::same_host
