#include "core/receiver_abort.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

#include "core/abort_watchdog.h"

namespace shadowsync {

namespace {

// Runs `teardown` (`what` it is, for the message) under the second-level watchdog.
void run_teardown_watched(const std::string& what, const ReceiverConfig& config,
                          const std::function<void()>& teardown,
                          const std::function<void(const std::string& message)>& on_stuck) {
  run_watched_abort(config.abort_deadline, teardown, [&] {
    // Watcher thread. No observer call: observers run on the receiver thread, which is the one
    // stuck.
    const std::string message = fmt::format(
        "{} has not returned after {} ms (ReceiverConfig::abort_deadline); the receiver thread is "
        "stuck in it and takes no update until it returns",
        what, config.abort_deadline.count());
    on_stuck(message);
    if (config.exit_on_stuck_abort) {
      std::fprintf(stderr,
                   "shadowsync: %s; exiting the process with status %d "
                   "(ReceiverConfig::exit_on_stuck_abort)\n",
                   message.c_str(), kStuckAbortExitStatus);
      std::fflush(stderr);
      // _Exit, not exit: static destructors would wait for the stuck thread.
      std::_Exit(kStuckAbortExitStatus);
    }
    std::fprintf(stderr, "shadowsync: %s\n", message.c_str());
  });
}

}  // namespace

void abort_transport_watched(std::unique_ptr<Transport>& transport, std::uint64_t version,
                             const ReceiverConfig& config,
                             const std::function<void(const std::string& message)>& on_stuck) {
  const std::string what =
      fmt::format("aborting transport '{}' (rank {} of {}) after update {} failed",
                  transport->name(), transport->rank(), transport->world_size(), version);
  run_teardown_watched(
      what, config,
      [&] {
        transport->abort();
        transport.reset();
      },
      on_stuck);
}

void release_transport_watched(std::unique_ptr<Transport>& transport, const std::string& why,
                               const ReceiverConfig& config,
                               const std::function<void(const std::string& message)>& on_stuck) {
  const std::string what = fmt::format("releasing transport '{}' (rank {} of {}): {}",
                                       transport->name(), transport->rank(),
                                       transport->world_size(), why);
  run_teardown_watched(what, config, [&] { transport.reset(); }, on_stuck);
}

}  // namespace shadowsync
