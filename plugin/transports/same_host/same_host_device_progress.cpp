// The same-host transport's device flavour (CUDA builds): the progress threads, one per end of a
// DeviceLink, which own its sockets. The sender's rings the receivers once a chunk's slot is
// filled and counts their acks; a receiver's checks each doorbell, opens the gate its caller
// waits on and acks each chunk once its copy is done. See same_host_device.h.
#include <poll.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "transports/same_host/same_host_device_impl.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_socket.h"
#include "transports/same_host/same_host_state.h"
#include "transports/same_host/same_host_timeline.h"

namespace shadowsync::same_host {

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

}  // namespace shadowsync::same_host
