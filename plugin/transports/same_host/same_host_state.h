// Internal to the same-host transport: the state a SameHostTransport shares with the tasks it
// enqueues on host streams. The handshake (same_host_handshake.cpp) fills it in; the data path
// (same_host_transport.cpp) runs on it. Not installed.
#pragma once

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <memory>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_device.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync {

// Shared by the transport and every enqueued stream task, so that either may go first.
struct SameHostTransport::State {
  int rank = 0;
  int world_size = 0;
  SameHostMemory memory = SameHostMemory::kHost;
  std::size_t slot_bytes = 0;
  std::byte* staging = nullptr;  // host flavour: kSlotCount slots; the sender maps it writable
  std::size_t mapped_bytes = 0;
  same_host::Fd wake;                // eventfd: readable once aborted
  std::vector<same_host::Fd> peers;  // sender: ranks 1..n at index rank-1; receiver: the sender

  std::mutex mutex;
  std::condition_variable turn_changed;
  std::uint64_t calls_enqueued = 0;  // the caller's thread only
  std::uint64_t calls_done = 0;      // under mutex
  bool aborted = false;              // under mutex
  bool broken = false;               // under mutex: a failure put the ranks out of step
  std::optional<std::string> error;  // under mutex: the first failure
  std::uint64_t next_sequence = 0;   // the task whose turn it is

  // Device flavour: the staging and the data path. Declared last, so destroyed first: its
  // progress thread uses the sockets above.
  std::unique_ptr<same_host::DeviceLink> device;

  ~State() {
    if (staging != nullptr) ::munmap(staging, mapped_bytes);
  }

  void fail(std::string reason) {
    {
      std::lock_guard lock(mutex);
      if (!error) error = std::move(reason);
      broken = true;
      turn_changed.notify_all();
    }
    if (device) device->release();  // streams waiting on the device flavour go on
  }

  void do_abort(std::string reason) noexcept {
    {
      std::lock_guard lock(mutex);
      if (aborted) return;
      aborted = true;
      if (!error) error = std::move(reason);
      turn_changed.notify_all();
    }
    if (device) device->release();
    const std::uint64_t one = 1;
    if (wake) [[maybe_unused]] auto written = ::write(wake.get(), &one, sizeof(one));
    // The peers see EOF at once and fail their update, as if this process had died.
    for (same_host::Fd& peer : peers) ::shutdown(peer.get(), SHUT_RDWR);
  }

  // Waits until call `call` may run; false when the transport is dead (then the call does
  // nothing: as an aborted NCCL collective, it completes with async_error() set).
  bool wait_turn(std::uint64_t call) {
    std::unique_lock lock(mutex);
    turn_changed.wait(lock, [&] { return aborted || broken || calls_done == call; });
    return !aborted && !broken;
  }
  void end_turn() {
    std::lock_guard lock(mutex);
    ++calls_done;
    turn_changed.notify_all();
  }

  std::byte* slot(std::uint32_t s) const {
    return device ? device->slot(s) : staging + std::size_t{s} * slot_bytes;
  }

  void run_send(const std::byte* buffer, std::size_t bytes, std::uint64_t call);
  void run_receive(std::byte* buffer, std::size_t bytes, std::uint64_t call);
};

}  // namespace shadowsync
