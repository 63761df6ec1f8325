// The same-host transport's device flavour (CUDA builds): a DeviceLink's public side, what its
// callers' threads do (send_async and receive_async enqueue the stream operations over the
// staging of same_host_device_staging.h, host-gated), and its teardown. Its progress threads are
// in same_host_device_progress.cpp. See same_host_device.h.
#include "transports/same_host/same_host_device.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/scoped_device.h"
#include "core/thread_affinity.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "transports/same_host/same_host_device_impl.h"
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

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

const char* record_name(RecordType type) noexcept {
  return type == RecordType::kDoorbell ? "doorbell" : "ack";
}

}  // namespace

bool tracing() noexcept {
  static const bool on = env_flag("SHADOWSYNC_DEBUG_SAME_HOST");
  return on;
}

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
  impl->staging = DeviceStaging::create(backend, slot_bytes);
  impl->device = impl->staging->device();
  impl->slot_bytes = slot_bytes;
  return std::unique_ptr<DeviceLink>(new DeviceLink(std::move(impl)));
}

std::unique_ptr<DeviceLink> DeviceLink::open(Backend& backend, Fd exported, const Setup& setup,
                                             const std::string& path,
                                             std::chrono::milliseconds doorbell_timeout) {
  auto impl = std::make_unique<Impl>(false);
  impl->staging =
      DeviceStaging::open(backend, std::move(exported), setup, path);
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
    impl.progress = start_library_thread([&impl] { impl.run_sender(); });
  } else {
    impl.progress = start_library_thread([&impl] { impl.run_receiver(); });
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
