// Internal to the same-host transports: what a transport's stream tasks share to talk to its peers
// one call at a time. Calls run in the order they were enqueued, whatever streams they went to,
// since each is one step of the same conversation with the peers; the first failure is kept, and
// an abort wakes every wait and shows the peers EOF, as if this process had died. The broadcast
// transport's state (same_host_state.h) and the pull transport's (same_host_pull_state.h) build
// on it. Not installed.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transports/same_host/same_host_socket.h"

namespace shadowsync::same_host {

struct Conversation {
  Fd wake;                // eventfd: readable once aborted
  std::vector<Fd> peers;  // which peer is at which index: the transport says

  std::mutex mutex;
  std::condition_variable turn_changed;
  std::uint64_t calls_enqueued = 0;  // the caller's thread only
  std::uint64_t calls_done = 0;      // under mutex
  bool aborted = false;              // under mutex
  bool broken = false;               // under mutex: a failure put the ranks out of step
  std::optional<std::string> error;  // under mutex: the first failure

  virtual ~Conversation() = default;

  // Records a failure: the first one is async_error(), and no later call runs. Thread-safe.
  void fail(std::string reason) {
    {
      std::lock_guard lock(mutex);
      if (!error) error = std::move(reason);
      broken = true;
      turn_changed.notify_all();
    }
    stopped();
  }

  // Stops the conversation: waits end, and the peers see EOF at once and fail their update, as if
  // this process had died. Only the first call acts. Thread-safe.
  void do_abort(std::string reason) noexcept {
    {
      std::lock_guard lock(mutex);
      if (aborted) return;
      aborted = true;
      if (!error) error = std::move(reason);
      turn_changed.notify_all();
    }
    stopped();
    const std::uint64_t one = 1;
    if (wake) [[maybe_unused]] auto written = ::write(wake.get(), &one, sizeof(one));
    for (Fd& peer : peers) ::shutdown(peer.get(), SHUT_RDWR);
  }

  // Waits until call `call` may run. False when the transport is dead (the call then does
  // nothing: as an aborted NCCL collective, it completes with async_error() set).
  bool wait_turn(std::uint64_t call) {
    std::unique_lock lock(mutex);
    turn_changed.wait(lock, [&] { return aborted || broken || calls_done == call; });
    return !aborted && !broken;
  }
  // False once the transport failed or was aborted. Thread-safe.
  bool alive() {
    std::lock_guard lock(mutex);
    return !aborted && !broken;
  }
  void end_turn() {
    std::lock_guard lock(mutex);
    ++calls_done;
    turn_changed.notify_all();
  }

 protected:
  // After fail() recorded a failure or do_abort() an abort, outside the lock: for waits of the
  // transport's own beyond turn_changed and the sockets (the device flavour's streams).
  virtual void stopped() noexcept {}
};

}  // namespace shadowsync::same_host
