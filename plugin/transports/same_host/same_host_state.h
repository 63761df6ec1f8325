// Internal to the same-host transport: the state a SameHostTransport shares with the tasks it
// enqueues on host streams. The handshake (same_host_handshake.cpp) fills it in; the data path
// (same_host_transport.cpp) runs on it. Not installed.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_conversation.h"
#include "transports/same_host/same_host_device.h"

namespace shadowsync {

// Shared by the transport and every enqueued stream task, so that either may go first. Its
// peers: on the sender, ranks 1..n at index rank-1; on a receiver, the sender.
struct SameHostTransport::State : same_host::Conversation {
  int rank = 0;
  int world_size = 0;
  SameHostMemory memory = SameHostMemory::kHost;
  std::size_t slot_bytes = 0;
  std::byte* staging = nullptr;  // host flavour: kSlotCount slots; the sender maps it writable
  std::size_t mapped_bytes = 0;
  std::uint64_t next_sequence = 0;  // the task whose turn it is

  // Device flavour: the staging and the data path. Declared last, so destroyed first: its
  // progress thread uses the sockets above.
  std::unique_ptr<same_host::DeviceLink> device;

  ~State() override {
    if (staging != nullptr) ::munmap(staging, mapped_bytes);
  }

  std::byte* slot(std::uint32_t s) const {
    return device ? device->slot(s) : staging + std::size_t{s} * slot_bytes;
  }

  void run_send(const std::byte* buffer, std::size_t bytes, std::uint64_t call);
  void run_receive(std::byte* buffer, std::size_t bytes, std::uint64_t call);

 protected:
  void stopped() noexcept override {
    if (device) device->release();  // streams waiting on the device flavour go on
  }
};

}  // namespace shadowsync
