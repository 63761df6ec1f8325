// The same-host transport's device flavour (CUDA builds): the progress threads and the stream
// operations over the staging of same_host_device_staging.h. See same_host_device.h.
#include "transports/same_host/same_host_device.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/scoped_device.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "transports/same_host/same_host_device_staging.h"
#include "transports/same_host/same_host_gate.h"
#include "transports/same_host/same_host_state.h"
#include "transports/same_host/same_host_timeline.h"

namespace shadowsync::same_host {

using cuda_detail::check_driver;
using cuda_detail::driver_api;

namespace {

// How long teardown waits for streams to pass the operations that touch a link's memory.
constexpr auto kDrainDeadline = std::chrono::seconds(10);

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
// 4.2-4.6 % of a core per process (scripts/gpu/probe_idle_link_cpu.py, docs/gpu.md): a price
// paid all the time between updates for tens of microseconds per update (0.11 % blocked), so
// idle means blocked, and the sender's caller, which spins for acks anyway, rings a filled slot
// itself (wait_acked). A receiver's caller spins on the gate for kGateSpin before it sleeps
// (same_host_gate.h).
constexpr auto kSpinWindow = std::chrono::milliseconds(2);
constexpr long kBusyPollNs = 50'000;
constexpr auto kGateSpin = std::chrono::microseconds(1000);

CudaBackend& cuda_backend_of(Backend& backend, const char* side) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host {}: device memory needs a CudaBackend, got the '{}' "
                            "backend",
                            side, backend.name()));
  }
  return *cuda;
}

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// SHADOWSYNC_DEBUG_SAME_HOST=1: one line on stderr per step of each chunk (enqueued, host
// function ran, doorbell rung or received, gate opened, ack sent or counted), stamped with
// CLOCK_MONOTONIC seconds, the clock of Python's time.monotonic(): the lines of the sender's
// process, the receivers' and a test's own merge by time. One write(2) per line: no stdio lock,
// so that CUDA's callback thread may trace too. A diagnostic; off, it costs one branch.
bool tracing() noexcept {
  static const bool on = env_flag("SHADOWSYNC_DEBUG_SAME_HOST");
  return on;
}

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

const char* record_name(RecordType type) noexcept {
  return type == RecordType::kDoorbell ? "doorbell" : "ack";
}

// `counter` reaches at least `value` in wrap-around order (as wait_acked reads it); never moves
// it back.
void advance(std::atomic_ref<std::uint32_t> counter, std::uint32_t value) noexcept {
  std::uint32_t current = counter.load();
  while (static_cast<std::int32_t>(value - current) > 0 &&
         !counter.compare_exchange_weak(current, value)) {
  }
}

}  // namespace

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

// True once every stream passed this link's operations.
bool DeviceLink::Impl::drain(std::chrono::steady_clock::time_point deadline) noexcept {
  cuda_detail::ScopedDeviceNoThrow on_device(device);
  std::vector<cudaEvent_t> tail_events;
  for (auto& [stream, event] : tails) tail_events.push_back(event);
  bool done = false;
  for (;;) {
    done = true;
    for (cudaEvent_t event : tail_events) done = done && cudaEventQuery(event) != cudaErrorNotReady;
    if (done || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  cuda_detail::clear_last_error();
  if (!done) return false;
  for (auto& [stream, event] : tails) (void)cudaEventDestroy(event);
  tails.clear();
  for (cudaEvent_t event : events) (void)cudaEventDestroy(event);
  events.clear();
  spare_events.clear();
  pending.clear();
  return true;
}

void DeviceLink::Impl::free_memory() noexcept {
  cuda_detail::ScopedDeviceNoThrow on_device(device);
  staging.reset();
  cuda_detail::clear_last_error();
}

void DeviceLink::Impl::release() noexcept {
  if (released.exchange(true)) return;
  trace("{}: released; every wait of every stream goes on ({} chunks reserved)",
        sender ? "sender" : "receiver", reserved.load());
  // Past every chunk ever enqueued: the caller reserves chunks under the state's mutex after
  // checking that the transport is alive, and the transport is marked dead before this runs.
  if (sender) {
    advance(std::atomic_ref<std::uint32_t>(*counter),
            static_cast<std::uint32_t>(reserved.load() + (std::uint64_t{1} << 30)));
  }
  gate.release();  // a receiver's caller waiting for a doorbell returns, enqueueing nothing
  notify();
}

cudaEvent_t DeviceLink::Impl::take_event() {
  {
    std::lock_guard lock(mutex);
    if (!spare_events.empty()) {
      cudaEvent_t event = spare_events.back();
      spare_events.pop_back();
      return event;
    }
  }
  cudaEvent_t event = nullptr;
  SHADOWSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                        "same-host chunk event");
  std::lock_guard lock(mutex);
  events.push_back(event);
  return event;
}

// Records the event of a chunk after what `stream` holds so far and hands it to the progress
// thread, which sends `record` once the event completed. The caller's thread only.
void DeviceLink::Impl::enqueue_pending(cudaStream_t stream, const DataRecord& record) {
  cudaEvent_t event = take_event();
  if (const cudaError_t status = cudaEventRecord(event, stream); status != cudaSuccess) {
    {
      std::lock_guard lock(mutex);
      spare_events.push_back(event);
    }
    // The chunk's other operations may be enqueued already: the peer would wait for a doorbell
    // or an ack that never comes. Out of step: the transport fails, naming the chunk.
    state->fail(fmt::format("same-host {}: cudaEventRecord for chunk {}: {}",
                            sender ? "sender" : fmt::format("rank {}", state->rank),
                            record.sequence, cudaGetErrorString(status)));
    SHADOWSYNC_CUDA_CHECK(status, "same-host {} of chunk {}", record_name(record.type),
                          record.sequence);
  }
  {
    std::lock_guard lock(mutex);
    pending.push_back({event, record});
  }
  notify();
}

// Waits until one of `fds` is ready: not at all while `spin` and within kSpinWindow of the last
// progress (the caller spins: a record due on a socket or an event due soon is seen within
// microseconds), at most kBusyPollNs while an event is pending (an event cannot wake poll()),
// else without a timeout (only a socket or the eventfd can bring news). poll()'s result; errno
// as poll() left it.
int DeviceLink::Impl::wait_for_fds(pollfd* fds, nfds_t count, bool events_pending, bool spin,
                                   std::chrono::steady_clock::time_point last_progress) noexcept {
  const bool spinning =
      spin && std::chrono::steady_clock::now() - last_progress < kSpinWindow;
  if (!spinning && !events_pending) return ::ppoll(fds, count, nullptr, nullptr);
  const timespec timeout{0, spinning ? 0 : kBusyPollNs};
  const int ready = ::ppoll(fds, count, &timeout, nullptr);
  if (ready == 0 && spinning) std::this_thread::yield();
  return ready;
}

bool DeviceLink::Impl::wait_acked(std::uint64_t value) {
  const std::atomic_ref<std::uint32_t> acked(*counter);
  const auto reached = [&] {
    return static_cast<std::int32_t>(acked.load() - static_cast<std::uint32_t>(value)) >= 0;
  };
  auto last = acked.load();
  auto progress_at = std::chrono::steady_clock::now();
  for (;;) {
    if (released.load()) return false;
    if (reached()) return true;
    const auto now = std::chrono::steady_clock::now();
    if (const auto seen = acked.load(); seen != last) {
      last = seen;
      progress_at = now;
    } else if (now - progress_at > doorbell_timeout) {
      state->fail(fmt::format("same-host sender: no receiver ack moved on within {} ms "
                              "(SameHostConfig::doorbell_timeout) while chunk {} waited for it; "
                              "{} chunks acked",
                              doorbell_timeout.count(), value, last));
      return false;
    }
    // A slot this caller filled may be due its doorbell: ring it rather than wait for the
    // progress thread to wake. Never blocks on the progress thread: it may be ringing already.
    if (std::unique_lock ringing(ring_mutex, std::try_to_lock); ringing.owns_lock()) {
      if (!ring_filled()) return false;
    }
    // An ack comes within a copy's time (hundreds of microseconds): spin first, then nap.
    if (now - progress_at < kGateSpin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

void DeviceLink::Impl::record_tail(cudaStream_t stream) {
  for (auto& [known, event] : tails) {
    if (known == stream) {
      SHADOWSYNC_CUDA_CHECK(cudaEventRecord(event, stream), "same-host stream tail");
      return;
    }
  }
  cudaEvent_t event = nullptr;
  SHADOWSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                        "same-host stream tail");
  tails.emplace_back(stream, event);
  SHADOWSYNC_CUDA_CHECK(cudaEventRecord(event, stream), "same-host stream tail");
}

// The progress threads poll CUDA events: the device must be current, and sleeps must be short.
namespace {
std::optional<std::string> prepare_progress_thread(int device) noexcept {
  // poll()'s timeouts while a chunk is in flight are tens of microseconds; the default timer
  // slack (50 us) would double them.
  (void)::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
  if (const cudaError_t status = cudaSetDevice(device); status != cudaSuccess) {
    return fmt::format("cudaSetDevice({}) on the progress thread: {}", device,
                       cudaGetErrorString(status));
  }
  return std::nullopt;
}
}  // namespace

bool DeviceLink::Impl::ring_filled() noexcept {
  SameHostTransport::State& s = *state;
  for (;;) {
    Pending head;
    {
      std::lock_guard lock(mutex);
      if (pending.empty()) return true;
      head = pending.front();
    }
    const cudaError_t filled = cudaEventQuery(head.event);
    if (filled == cudaErrorNotReady) return true;
    if (filled != cudaSuccess) {
      s.fail(fmt::format("same-host sender: waiting for chunk {} to be in slot {}: "
                         "cudaEventQuery: {}",
                         head.record.sequence, head.record.slot, cudaGetErrorString(filled)));
      return false;
    }
    {
      std::lock_guard lock(mutex);
      pending.pop_front();
      spare_events.push_back(head.event);
    }
    const DataRecord& doorbell = head.record;
    timeline.stamp(doorbell.sequence, ChunkTimeline::SenderStep::kFilled);
    const auto frame = encode(doorbell);
    for (std::size_t p = 0; p < s.peers.size(); ++p) {
      const Io io = gone[p] ? Io::kClosed
                            : write_all(s.peers[p].get(), frame, s.wake.get(), std::nullopt);
      if (io == Io::kWoken) return false;
      if (io != Io::kOk) {
        s.fail(fmt::format("same-host sender: doorbell {} to rank {}: {}", doorbell.sequence,
                           p + 1, describe(io, errno)));
        return false;
      }
    }
    timeline.stamp(doorbell.sequence, ChunkTimeline::SenderStep::kRung);
    trace("sender: rang doorbell of chunk {} (slot {}, {} bytes) to {} receiver(s)",
          doorbell.sequence, doorbell.slot, doorbell.bytes, s.peers.size());
    outstanding.push_back(doorbell);
  }
}

// Sender: rings every receiver for each filled slot (its event completed, in chunk order) unless
// its caller rang first (wait_acked), counts acks, moves the counter.
void DeviceLink::Impl::run_sender() noexcept {
  SameHostTransport::State& s = *state;
  if (auto problem = prepare_progress_thread(device)) {
    s.fail(fmt::format("same-host sender: {}", *problem));
    return;
  }
  const SlotGeometry geometry{kSlotCount, slot_bytes};
  const std::size_t peers = s.peers.size();
  std::vector<std::uint64_t> acked(peers, 0);  // per receiver: chunks it acked
  std::uint64_t counted = 0;                 // chunks acked by every receiver
  std::vector<pollfd> fds;
  auto last_progress = std::chrono::steady_clock::now();
  for (;;) {
    bool awaiting_acks = false;
    fds.assign({{s.wake.get(), POLLIN, 0}, {notes_ready.get(), POLLIN, 0}});
    {
      std::lock_guard ringing(ring_mutex);
      for (std::size_t p = 0; p < peers; ++p) {
        fds.push_back({gone[p] ? -1 : s.peers[p].get(), POLLIN, 0});
      }
      awaiting_acks = !outstanding.empty();
    }
    const bool filling = in_flight().first;  // a doorbell waits for its slot's event
    if (wait_for_fds(fds.data(), fds.size(), filling, filling || awaiting_acks,
                     last_progress) < 0) {
      if (errno == EINTR) continue;
      s.fail(fmt::format("same-host sender: poll: {}", std::strerror(errno)));
      return;
    }
    if (fds[0].revents != 0 || released.load()) return;
    if (fds[1].revents != 0) {
      std::uint64_t count = 0;
      [[maybe_unused]] auto got = ::read(notes_ready.get(), &count, sizeof(count));
      last_progress = std::chrono::steady_clock::now();  // a chunk was enqueued: spin for it
    }
    {
      std::unique_lock ringing(ring_mutex);
      const std::size_t before = outstanding.size();
      if (!ring_filled()) return;
      if (outstanding.size() != before) last_progress = std::chrono::steady_clock::now();
    }
    for (std::size_t p = 0; p < peers; ++p) {
      if (fds[2 + p].revents == 0) continue;
      std::array<std::byte, kDataRecordBytes> record{};
      const Io io = read_exact(s.peers[p].get(), record, s.wake.get(), std::nullopt);
      if (io == Io::kWoken) return;
      std::lock_guard ringing(ring_mutex);
      if (io == Io::kClosed && acked[p] == counted + outstanding.size()) {
        trace("sender: rank {} closed its socket between chunks (after {} acks)", p + 1,
              acked[p]);
        gone[p] = true;  // between chunks: a failure only if another chunk is rung
        continue;
      }
      if (io != Io::kOk) {
        s.fail(fmt::format("same-host sender: waiting for rank {} to ack chunk {}: {}", p + 1,
                           acked[p], describe(io, errno)));
        return;
      }
      DataRecord ack;
      std::string problem;
      if (!decode(record, RecordType::kAck, geometry, ack, problem)) {
        s.fail(fmt::format("same-host sender: rank {} broke the protocol: {}", p + 1, problem));
        return;
      }
      const std::uint64_t due = acked[p];
      if (due < counted || due - counted >= outstanding.size()) {
        s.fail(fmt::format("same-host sender: rank {} acked chunk {}, which was never rung",
                           p + 1, ack.sequence));
        return;
      }
      const DataRecord& rung = outstanding[due - counted];
      if (ack.sequence != rung.sequence || ack.slot != rung.slot || ack.bytes != rung.bytes ||
          ack.offset != rung.offset) {
        s.fail(fmt::format("same-host sender: rank {} acked chunk {} (slot {}, {} bytes) where "
                           "chunk {} (slot {}, {} bytes) was due",
                           p + 1, ack.sequence, ack.slot, ack.bytes, rung.sequence, rung.slot,
                           rung.bytes));
        return;
      }
      ++acked[p];
      trace("sender: rank {} acked chunk {}", p + 1, ack.sequence);
    }
    std::lock_guard ringing(ring_mutex);
    std::uint64_t everyone = counted + outstanding.size();
    for (std::uint64_t a : acked) everyone = std::min(everyone, a);
    if (everyone > counted) {
      advance(std::atomic_ref<std::uint32_t>(*counter), static_cast<std::uint32_t>(everyone));
      const std::int64_t now = ChunkTimeline::now_ns();
      for (std::uint64_t k = 0; k < everyone - counted; ++k) {
        timeline.stamp(outstanding[k].sequence, ChunkTimeline::SenderStep::kAcked, now);
      }
      outstanding.erase(outstanding.begin(),
                        outstanding.begin() + static_cast<std::ptrdiff_t>(everyone - counted));
      counted = everyone;
      last_progress = std::chrono::steady_clock::now();
      trace("sender: every receiver acked chunks below {}: the counter opens their waits",
            counted);
    }
  }
}

// Receiver: matches doorbells with the chunks its caller waits for, checks them, opens the gate
// of each chunk whose doorbell passed (its caller then enqueues the copy and its event), and
// acks each chunk whose copy's event completed, in chunk order.
void DeviceLink::Impl::run_receiver() noexcept {
  SameHostTransport::State& s = *state;
  if (auto problem = prepare_progress_thread(device)) {
    s.fail(fmt::format("same-host rank {}: {}", s.rank, *problem));
    return;
  }
  const SlotGeometry geometry{kSlotCount, slot_bytes};
  const int socket = s.peers[0].get();
  std::deque<Doorbell> doorbells;  // received, not yet matched with a receive
  bool sender_gone = false;
  auto last_progress = std::chrono::steady_clock::now();
  for (;;) {
    std::array<pollfd, 3> fds{{{s.wake.get(), POLLIN, 0},
                               {notes_ready.get(), POLLIN, 0},
                               {sender_gone ? -1 : socket, POLLIN, 0}}};
    const auto [copying, waiting] = in_flight();  // an ack waits for a copy; a receive waits
    if (wait_for_fds(fds.data(), fds.size(), copying, copying || waiting, last_progress) < 0) {
      if (errno == EINTR) continue;
      s.fail(fmt::format("same-host rank {}: poll: {}", s.rank, std::strerror(errno)));
      return;
    }
    if (fds[0].revents != 0 || released.load()) return;
    if (fds[1].revents != 0) {
      std::uint64_t count = 0;
      [[maybe_unused]] auto got = ::read(notes_ready.get(), &count, sizeof(count));
      last_progress = std::chrono::steady_clock::now();  // a receive or a copy: spin for it
    }
    if (fds[2].revents != 0) {
      std::array<std::byte, kDataRecordBytes> record{};
      const Io io = read_exact(socket, record, s.wake.get(), std::nullopt);
      if (io == Io::kWoken) return;
      if (io == Io::kClosed) {
        sender_gone = true;  // a failure only if a receive is still waiting (below)
      } else if (io != Io::kOk) {
        s.fail(fmt::format("same-host rank {}: reading a doorbell: {}", s.rank,
                           describe(io, errno)));
        return;
      } else {
        DataRecord doorbell;
        std::string problem;
        if (!decode(record, RecordType::kDoorbell, geometry, doorbell, problem)) {
          s.fail(fmt::format("same-host rank {}: the sender broke the protocol: {}", s.rank,
                             problem));
          return;
        }
        trace("rank {}: doorbell of chunk {} received (slot {}, {} bytes)", s.rank,
              doorbell.sequence, doorbell.slot, doorbell.bytes);
        doorbells.push_back({doorbell, ChunkTimeline::now_ns()});
        last_progress = std::chrono::steady_clock::now();
      }
    }
    std::deque<Receive> ready;
    std::optional<std::uint64_t> orphaned;  // a receive waiting for a sender that is gone
    {
      std::lock_guard lock(mutex);
      while (!receives.empty() && ready.size() < doorbells.size()) {
        ready.push_back(receives.front());
        receives.pop_front();
      }
      if (sender_gone && !receives.empty()) orphaned = receives.front().chunk;
    }
    if (orphaned) {
      s.fail(fmt::format("same-host rank {}: waiting for the doorbell of chunk {}: {}", s.rank,
                         *orphaned, describe(Io::kClosed, 0)));
      return;
    }
    // Gates first: the sooner the next copy is enqueued, the less the copy engine idles.
    for (const Receive& receive : ready) {
      const Doorbell arrived = doorbells.front();
      const DataRecord& doorbell = arrived.record;
      doorbells.pop_front();
      std::string problem = check_doorbell(doorbell, receive.chunk, receive.bytes);
      const auto expected_slot = static_cast<std::uint32_t>(receive.chunk % kSlotCount);
      if (problem.empty() && (doorbell.slot != expected_slot || doorbell.offset != 0)) {
        problem = fmt::format("chunk {} rung in slot {} at offset {}; this flavour takes chunk {} "
                              "from slot {} at offset 0",
                              doorbell.sequence, doorbell.slot, doorbell.offset, receive.chunk,
                              expected_slot);
      }
      if (!problem.empty()) {
        s.fail(fmt::format("same-host rank {}: the sender broke the protocol: {}", s.rank,
                           problem));
        return;
      }
      timeline.stamp(receive.chunk, ChunkTimeline::ReceiverStep::kDoorbell, arrived.ns);
      // The caller waiting for this chunk may enqueue its copy.
      gate.open(receive.chunk + 1);
      timeline.stamp(receive.chunk, ChunkTimeline::ReceiverStep::kOpened);
      trace("rank {}: gate of chunk {} opened", s.rank, receive.chunk);
      last_progress = std::chrono::steady_clock::now();
    }
    // Ack every chunk whose copy is done, in chunk order.
    for (;;) {
      Pending head;
      {
        std::lock_guard lock(mutex);
        if (pending.empty()) break;
        head = pending.front();
      }
      const cudaError_t copied = cudaEventQuery(head.event);
      if (copied == cudaErrorNotReady) break;
      if (copied != cudaSuccess) {
        s.fail(fmt::format("same-host rank {}: waiting for the copy of chunk {}: "
                           "cudaEventQuery: {}",
                           s.rank, head.record.sequence, cudaGetErrorString(copied)));
        return;
      }
      {
        std::lock_guard lock(mutex);
        pending.pop_front();
        spare_events.push_back(head.event);
      }
      const DataRecord& ack = head.record;
      timeline.stamp(ack.sequence, ChunkTimeline::ReceiverStep::kCopied);
      const Io io = write_all(socket, encode(ack), s.wake.get(), std::nullopt);
      if (io == Io::kWoken) return;
      if (io != Io::kOk) {
        s.fail(fmt::format("same-host rank {}: ack of chunk {}: {}", s.rank, ack.sequence,
                           describe(io, errno)));
        return;
      }
      timeline.stamp(ack.sequence, ChunkTimeline::ReceiverStep::kAckSent);
      trace("rank {}: ack of chunk {} sent", s.rank, ack.sequence);
      last_progress = std::chrono::steady_clock::now();
    }
  }
}

DeviceLink::DeviceLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DeviceLink::~DeviceLink() {
  impl_->release();
  if (impl_->progress.joinable()) impl_->progress.join();
  if (tracing()) trace("{}", impl_->timeline.summarize_and_reset());
  if (impl_->drain(std::chrono::steady_clock::now() + kDrainDeadline)) {
    impl_->free_memory();
    return;
  }
  // A stream may still read or write the link's memory: the whole link is leaked rather than
  // freed under it.
  std::fprintf(stderr,
               "shadowsync: same-host device link: a stream did not pass this link's operations "
               "within %lld s; leaking its staging mapping and counter rather than freeing "
               "memory a stream may still touch\n",
               static_cast<long long>(kDrainDeadline.count()));
  (void)impl_.release();
}

std::unique_ptr<DeviceLink> DeviceLink::create(Backend& backend, std::size_t slot_bytes,
                                               std::chrono::milliseconds ack_timeout) {
  auto impl = std::make_unique<Impl>(true);
  impl->doorbell_timeout = ack_timeout;
  impl->staging = DeviceStaging::create(cuda_backend_of(backend, "serve"), slot_bytes);
  impl->device = impl->staging->device();
  impl->slot_bytes = slot_bytes;
  return std::unique_ptr<DeviceLink>(new DeviceLink(std::move(impl)));
}

std::unique_ptr<DeviceLink> DeviceLink::open(Backend& backend, Fd exported, const Setup& setup,
                                             const std::string& path,
                                             std::chrono::milliseconds doorbell_timeout) {
  auto impl = std::make_unique<Impl>(false);
  impl->staging =
      DeviceStaging::open(cuda_backend_of(backend, "connect"), std::move(exported), setup, path);
  impl->device = impl->staging->device();
  impl->slot_bytes = impl->staging->slot_bytes();
  impl->doorbell_timeout = doorbell_timeout;
  trace("receiver: device link opened on device {}; each chunk's copy is enqueued once its "
        "doorbell passed (waiting at most {} ms)",
        impl->device, doorbell_timeout.count());
  return std::unique_ptr<DeviceLink>(new DeviceLink(std::move(impl)));
}

int DeviceLink::exported_fd() const { return impl_->staging->exported_fd(); }

std::array<std::byte, kHandleBytes> DeviceLink::handle() const {
  return impl_->staging->handle();
}

std::byte* DeviceLink::slot(std::uint32_t s) const { return impl_->slot(s); }

std::string DeviceLink::timeline() { return impl_->timeline.summarize_and_reset(); }

void DeviceLink::start(SameHostTransport::State& state) {
  Impl& impl = *impl_;
  impl.state = &state;
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(impl.device), "device={}", impl.device);
  impl.notes_ready = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!impl.notes_ready) {
    throw Error(ErrorCode::kTransport, fmt::format("eventfd: {}", std::strerror(errno)));
  }
  if (impl.sender) {
    impl.gone.assign(state.peers.size(), false);  // before anyone may ring
    impl.progress = std::thread([&impl] { impl.run_sender(); });
  } else {
    impl.progress = std::thread([&impl] { impl.run_receiver(); });
  }
}

namespace {
cudaStream_t stream_of(Stream& stream, int device, int rank) {
  const cudaStream_t native = CudaBackend::native(stream);  // throws for a foreign stream
  if (const int on = CudaBackend::device_of(stream); on != device) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host broadcast on rank {}: the stream is on device {}, the "
                            "transport on device {}",
                            rank, on, device));
  }
  return native;
}
}  // namespace

std::uint64_t DeviceLink::reserve(std::size_t bytes) {
  const std::uint64_t chunks = (bytes + impl_->slot_bytes - 1) / impl_->slot_bytes;
  const std::uint64_t first = impl_->reserved.fetch_add(chunks);
  trace("{}: reserved chunks {}..{} for a broadcast of {} bytes",
        impl_->sender ? "sender" : "receiver", first, first + chunks - 1, bytes);
  return first;
}

void DeviceLink::send_async(const std::byte* buffer, std::size_t bytes, std::uint64_t first_chunk,
                            Stream& stream) {
  Impl& impl = *impl_;
  const cudaStream_t native = stream_of(stream, impl.device, 0);
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(impl.device), "device={}", impl.device);
  // Packed straight into a slot by the caller (staging_buffer()): no copy. The caller wrote it
  // after our previous return, which waited for the ack of that slot's last chunk.
  std::optional<std::uint32_t> own_slot;
  for (std::uint32_t s = 0; s < kSlotCount; ++s) {
    if (buffer == impl.slot(s) && bytes <= impl.slot_bytes) own_slot = s;
  }
  std::optional<std::uint64_t> last;  // the last chunk enqueued
  for (std::size_t offset = 0; offset < bytes; offset += impl.slot_bytes) {
    const std::size_t n = std::min(impl.slot_bytes, bytes - offset);
    const std::uint64_t chunk = first_chunk + offset / impl.slot_bytes;
    // Chunk c travels in slot c % 2. The slot is free once every receiver acked chunk c - 2
    // (copied it out): the counter says so. Waited for here, on the host (see the header).
    const auto s = static_cast<std::uint32_t>(chunk % kSlotCount);
    if (chunk >= kSlotCount && !impl.wait_acked(chunk - kSlotCount + 1)) {
      trace("sender: chunk {} not enqueued: {}", chunk,
            impl.released.load() ? "released" : "ack deadline");
      break;
    }
    if (own_slot != s) {
      SHADOWSYNC_CUDA_CHECK(cudaMemcpyAsync(impl.slot(s), buffer + offset, n,
                                            cudaMemcpyDefault, native),
                            "same-host staging, chunk {} of {} bytes", chunk, n);
    }
    // The slot's event: once it completed, the doorbell is rung (ring_filled). No host
    // function: it would hold this stream, and the GPU, until CUDA's callback thread ran it.
    impl.timeline.stamp(chunk, ChunkTimeline::SenderStep::kEnqueued);
    impl.enqueue_pending(native, DataRecord{RecordType::kDoorbell, chunk, s, 0, n});
    last = chunk;
    trace("sender: chunk {} enqueued on stream {}: {}doorbell", chunk,
          static_cast<void*>(native), own_slot == s ? "packed in slot, " : "copy into slot, ");
  }
  impl.record_tail(native);
  // The caller may pack the other slot once we return: its last chunk (the one before our last)
  // must be acked. The last chunk itself is still being copied out: its slot's next user waits
  // for it in the next call, or flush() does.
  if (last && *last >= 1) (void)impl.wait_acked(*last);
}

void DeviceLink::flush() {
  Impl& impl = *impl_;
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(impl.device), "device={}", impl.device);  // it may ring
  (void)impl.wait_acked(impl.reserved.load());
}

void DeviceLink::receive_async(std::byte* buffer, std::size_t bytes, std::uint64_t first_chunk,
                               Stream& stream) {
  Impl& impl = *impl_;
  const cudaStream_t native = stream_of(stream, impl.device, impl.state->rank);
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(impl.device), "device={}", impl.device);
  bool enqueued = false;
  for (std::size_t offset = 0; offset < bytes; offset += impl.slot_bytes) {
    const std::size_t n = std::min(impl.slot_bytes, bytes - offset);
    const std::uint64_t chunk = first_chunk + offset / impl.slot_bytes;
    const auto s = static_cast<std::uint32_t>(chunk % kSlotCount);
    {
      std::lock_guard lock(impl.mutex);
      impl.receives.push_back({chunk, n});
    }
    impl.notify();
    // Host-gated (same_host_gate.h): this thread, not the stream, waits for the doorbell.
    trace("rank {}: waiting on the host for the doorbell of chunk {}", impl.state->rank, chunk);
    const auto deadline = ChunkGate::Clock::now() + impl.doorbell_timeout;
    const ChunkGate::Outcome outcome = impl.gate.wait(chunk, deadline, kGateSpin);
    if (outcome == ChunkGate::Outcome::kDeadline) {
      // The ranks are out of step now: the transport is broken (async_error() says why) and
      // releases every wait; this chunk and the rest of the broadcast are never enqueued.
      impl.state->fail(fmt::format(
          "same-host rank {}: the doorbell of chunk {} did not come within {} ms "
          "(SameHostConfig::doorbell_timeout); nothing of it was copied",
          impl.state->rank, chunk, impl.doorbell_timeout.count()));
    }
    if (outcome != ChunkGate::Outcome::kOpen) {
      trace("rank {}: chunk {} not enqueued: {}", impl.state->rank, chunk,
            outcome == ChunkGate::Outcome::kDeadline ? "deadline" : "released");
      break;
    }
    // The doorbell passed its checks: the slot holds this chunk, and the sender reuses it only
    // after this copy's ack. Nothing here waits for the other process.
    SHADOWSYNC_CUDA_CHECK(cudaMemcpyAsync(buffer + offset, impl.slot(s), n, cudaMemcpyDefault,
                                          native),
                          "same-host receive, chunk {} of {} bytes from slot {}", chunk, n, s);
    // The copy's event: once it completed, the progress thread acks at once. Not a host
    // function, which would hold this stream (the next chunk's copy) until it ran.
    impl.enqueue_pending(native, DataRecord{RecordType::kAck, chunk, s, 0, n});
    impl.timeline.stamp(chunk, ChunkTimeline::ReceiverStep::kEnqueued);
    enqueued = true;
    trace("rank {}: chunk {} enqueued on stream {}: copy, ack", impl.state->rank, chunk,
          static_cast<void*>(native));
  }
  if (enqueued) impl.record_tail(native);
}

void DeviceLink::release() noexcept { impl_->release(); }

}  // namespace shadowsync::same_host
