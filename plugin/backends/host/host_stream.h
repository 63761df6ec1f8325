// Internal to the host backend and the loopback transport: the stream type behind every Stream
// that HostBackend creates. Not installed; the public surface is shadowsync/host_backend.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <typeinfo>

#include "shadowsync/backend.h"

namespace shadowsync::host {

// An in-order executor: one thread runs the queued tasks one after another. A task that throws
// does not stop the stream; the first such error is kept and every one is printed to stderr
// (a CUDA stream does not die of one failed kernel either).
class HostStream final : public Stream {
 public:
  // Each task first sleeps a uniform random time in [0, max_jitter] drawn from an RNG seeded
  // with `jitter_seed`; zero jitter draws nothing and never sleeps.
  HostStream(std::chrono::microseconds max_jitter, std::uint64_t jitter_seed);
  // Runs every task still queued, then joins the thread. A task blocked forever (waiting for an
  // event that nobody completes, a collective nobody aborts) blocks this too, as a CUDA stream
  // destroy would wait for its work.
  ~HostStream() override;

  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Appends `task`; returns at once. Thread-safe.
  void enqueue(std::function<void()> task);

  // True when called from this stream's own thread (where a host-side wait would deadlock).
  // Thread-safe.
  bool on_stream_thread() const noexcept;

  // The first exception message a task of this stream threw, if any. Thread-safe.
  std::optional<std::string> first_error() const;

 private:
  void run();

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::optional<std::string> first_error_;

  std::chrono::microseconds max_jitter_;
  std::mt19937_64 rng_;  // stream thread only

  std::thread thread_;  // last: starts after every other member is ready
};

// `stream` as a HostStream, or nullptr when it came from another backend.
inline HostStream* as_host_stream(Stream& stream) noexcept {
  return dynamic_cast<HostStream*>(&stream);
}

}  // namespace shadowsync::host
