// Internal to the same-host transport's device flavour (same_host_device*.cpp, CUDA builds): the
// state of a DeviceLink that its callers' side (same_host_device.cpp: send_async, receive_async,
// teardown) and its progress thread (same_host_device_progress.cpp) share, the data path's latency
// tunables, and the SHADOWSYNC_DEBUG_SAME_HOST trace. The design is in same_host_device.h.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "transports/same_host/same_host_device.h"
#include "transports/same_host/same_host_device_staging.h"
#include "transports/same_host/same_host_gate.h"
#include "transports/same_host/same_host_state.h"
#include "transports/same_host/same_host_timeline.h"

namespace shadowsync::same_host {

// Latency of the data path. A chunk's completion (its slot filled on the sender, its copy done on
// a receiver) is an event the progress thread polls, not a host function: a host function holds
// its stream until CUDA's callback thread ran it (the next copy cannot start), wakes that thread
// (tens of microseconds) and, on the sender, is one more operation the GPU must switch to the
// trainer's context for. While a chunk is in flight the progress thread spins (sockets at once,
// the head event) for kSpinWindow after its last progress, then polls every kBusyPoll until the
// chunk completes; idle, it blocks. Blocked without a timer, its core sinks into a deep idle
// state: on the H100 machines the trainer's progress thread took 35-47 us to wake for an
// update's first chunk (the same-host bench's "enqueued -> filled"), 5-7 % of a 0.5B model's
// transfer. Sleeping in 200 us slices instead woke it in 13-16 us, but an idle link then cost
// 4.2-4.6 % of a core per process (measured with a one-off probe, kept in git history): a price
// paid all the time between updates for tens of microseconds per update (0.11 % blocked), so
// idle means blocked, and the sender's caller, which spins for acks anyway, rings a filled slot
// itself (wait_acked). A receiver's caller spins on the gate for kGateSpin before it sleeps
// (same_host_gate.h).
inline constexpr auto kSpinWindow = std::chrono::milliseconds(2);
inline constexpr long kBusyPollNs = 50'000;
inline constexpr auto kGateSpin = std::chrono::microseconds(1000);

// SHADOWSYNC_DEBUG_SAME_HOST=1: one line on stderr per step of each chunk (enqueued, host
// function ran, doorbell rung or received, gate opened, ack sent or counted), stamped with
// CLOCK_MONOTONIC seconds, the clock of Python's time.monotonic(): the lines of the sender's
// process, the receivers' and a test's own merge by time. One write(2) per line: no stdio lock,
// so that CUDA's callback thread may trace too. A diagnostic; off, it costs one branch.
// Defined in same_host_device.cpp.
bool tracing() noexcept;

template <typename... Args>
void trace(fmt::format_string<Args...> format, Args&&... args) noexcept {
  if (!tracing()) return;
  try {
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    std::string line = fmt::format("[same-host pid {} t={}.{:06}] ", ::getpid(), now.tv_sec,
                                   now.tv_nsec / 1000);
    line += fmt::format(format, std::forward<Args>(args)...);
    line += '\n';
    [[maybe_unused]] auto written = ::write(2, line.data(), line.size());
  } catch (...) {  // a diagnostic never fails the data path
  }
}

// `counter` reaches at least `value` in wrap-around order (as wait_acked reads it); never moves
// it back.
inline void advance(std::atomic_ref<std::uint32_t> counter, std::uint32_t value) noexcept {
  std::uint32_t current = counter.load();
  while (static_cast<std::int32_t>(value - current) > 0 &&
         !counter.compare_exchange_weak(current, value)) {
  }
}

struct DeviceLink::Impl {
  // A chunk a receiver's caller is waiting for: what its doorbell must say.
  struct Receive {
    std::uint64_t chunk = 0;
    std::size_t bytes = 0;
  };
  // A chunk enqueued on a stream whose completion the progress thread waits for: sender, its
  // slot filled (then it rings `record`, the doorbell); receiver, its copy done (then it sends
  // `record`, the ack). `event` was recorded right after the chunk's operations.
  struct Pending {
    cudaEvent_t event = nullptr;
    DataRecord record;
  };
  // A doorbell read off the socket, not yet matched with a receive; `ns`: when it was read.
  struct Doorbell {
    DataRecord record;
    std::int64_t ns = 0;
  };

  explicit Impl(bool is_sender) : sender(is_sender), timeline(is_sender) {}

  std::unique_ptr<DeviceStaging> staging;
  int device = 0;  // the staging's, copied for the hot path
  bool sender = false;
  std::size_t slot_bytes = 0;
  // How long its caller waits for the other side without progress (SameHostConfig::
  // doorbell_timeout): receiver, each chunk's doorbell; sender, the next ack.
  std::chrono::milliseconds doorbell_timeout{0};

  // Sender: "chunks acked by every receiver", which its caller waits on. Written by the progress
  // thread (and release()), read by the caller; through std::atomic_ref.
  alignas(std::atomic_ref<std::uint32_t>::required_alignment) std::uint32_t acked_chunks = 0;
  std::uint32_t* const counter = &acked_chunks;

  SameHostTransport::State* state = nullptr;
  Fd notes_ready;  // eventfd: the caller queued a receive or a chunk's event
  std::thread progress;

  std::mutex mutex;             // guards the queues below
  std::deque<Receive> receives;  // receiver: waited for, not yet matched with a doorbell
  std::deque<Pending> pending;   // in chunk order: enqueued, their doorbell / ack not yet sent
  std::vector<cudaEvent_t> spare_events;  // events the progress thread saw complete
  std::vector<cudaEvent_t> events;        // every event made, destroyed once drained
  std::atomic<std::uint64_t> reserved{0};  // chunks reserved so far (under the state's mutex)
  std::atomic<bool> released{false};
  ChunkTimeline timeline;  // per-chunk stamps of this side (same_host_timeline.h)
  // Receiver: opened by the progress thread per checked doorbell; its caller waits on it.
  ChunkGate gate;
  // Sender: who rings. The progress thread does, and so does the caller's thread while it spins
  // for acks (wait_acked): a caller that waits anyway rings the moment its slot is filled, where
  // an idle progress thread first has to wake (35-60 us on the H100 machines, most of what a
  // 0.5B model's transfer added to a raw copy). Guards the two below and the ringing itself.
  std::mutex ring_mutex;
  std::deque<DataRecord> outstanding;  // rung, not yet acked by everyone
  std::vector<bool> gone;              // per receiver: closed its socket (the progress thread)
  // The streams this link enqueued work on, each with an event recorded after its last wait.
  std::vector<std::pair<cudaStream_t, cudaEvent_t>> tails;

  void free_memory() noexcept;
  void release() noexcept;
  void notify() noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto written = ::write(notes_ready.get(), &one, sizeof(one));
  }
  cudaEvent_t take_event();
  void enqueue_pending(cudaStream_t stream, const DataRecord& record);
  // Sender's caller: waits until `counter` reaches `value` (wrap-around order). True then;
  // false once the link was released, or when the counter did not move for doorbell_timeout
  // (the transport fails, naming the chunk it waited for).
  bool wait_acked(std::uint64_t value);
  void record_tail(cudaStream_t stream);
  std::byte* slot(std::uint32_t s) const {
    return staging->slot(s);
  }
  // Sender, ring_mutex held: rings every chunk whose slot is filled, in chunk order, and moves
  // it to `outstanding`. False once the transport failed (recorded) or the link was released.
  bool ring_filled() noexcept;
  void run_sender() noexcept;
  void run_receiver() noexcept;
  // Whether a chunk's event is pending (it must be polled), and whether a receive waits.
  std::pair<bool, bool> in_flight() {
    std::lock_guard lock(mutex);
    return {!pending.empty(), !receives.empty()};
  }
  int wait_for_fds(pollfd* fds, nfds_t count, bool events_pending, bool spin,
                   std::chrono::steady_clock::time_point last_progress) noexcept;
  bool drain(std::chrono::steady_clock::time_point deadline) noexcept;
};

}  // namespace shadowsync::same_host
