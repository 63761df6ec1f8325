// The engine's handle on bench_same_host_one_gpu's trainer process: this binary spawned again
// with --role trainer, its command and reply pipes (same_host_protocol.h), and its end.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "same_host_protocol.h"

namespace shadowsync::bench::same_host {

// The running trainer's pid, or -1: for a watchdog that must kill it from another thread.
// Thread-safe.
pid_t running_trainer_pid();

class TrainerProcess {
 public:
  // Spawns this binary as the trainer with `args` and waits for its "ready".
  explicit TrainerProcess(const std::vector<std::string>& args);
  // Asks the trainer to quit, then makes sure it has ended.
  ~TrainerProcess();
  TrainerProcess(const TrainerProcess&) = delete;
  TrainerProcess& operator=(const TrainerProcess&) = delete;

  void send(const std::string& command);

  // The reply to `command`; throws BenchError with the trainer's error, or if it ended.
  Reply read_reply(const std::string& command,
                   std::chrono::milliseconds timeout = bench::kWaitLimit);

  Reply call(const std::string& command, std::chrono::milliseconds timeout = bench::kWaitLimit);

  // Whether the reply to the last command can be read now, waiting at most `wait`.
  bool reply_ready(std::chrono::milliseconds wait) { return reader_->readable(wait); }

  // Waits a moment for the trainer to end by itself, then kills it: it may be stuck in the
  // driver.
  void kill() noexcept;

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::unique_ptr<LineReader> reader_;
};

}  // namespace shadowsync::bench::same_host
