// SameHostTransport's data path: broadcasts through the two staging slots, one doorbell and one
// ack per chunk, in the order the calls were enqueued. The handshake that sets a transport up is
// in same_host_handshake.cpp; see same_host_transport.h for the protocol and its failure
// semantics.
#include "shadowsync/same_host_transport.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "backends/host/host_stream.h"
#include "core/type_name.h"
#include "shadowsync/error.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_socket.h"
#include "transports/same_host/same_host_state.h"

namespace shadowsync {

using same_host::DataRecord;
using same_host::Io;
using same_host::RecordType;

void SameHostTransport::State::run_send(const std::byte* buffer, std::size_t bytes,
                                        std::uint64_t call) {
  if (!wait_turn(call)) return;
  const same_host::SlotGeometry geometry{same_host::kSlotCount, slot_bytes};
  // Packed straight into a slot by the caller (staging_buffer()): no copy.
  std::optional<std::uint32_t> own_slot;
  for (std::uint32_t s = 0; s < same_host::kSlotCount; ++s) {
    if (buffer == slot(s) && bytes <= slot_bytes) own_slot = s;
  }
  for (std::size_t offset = 0; offset < bytes; offset += slot_bytes) {
    const std::size_t n = std::min(slot_bytes, bytes - offset);
    const std::uint64_t sequence = next_sequence++;
    std::uint32_t s = own_slot.value_or(static_cast<std::uint32_t>(sequence % 2));
    if (!own_slot) std::memcpy(slot(s), buffer + offset, n);
    const DataRecord doorbell{RecordType::kDoorbell, sequence, s, 0, n};
    const auto frame = same_host::encode(doorbell);
    for (std::size_t p = 0; p < peers.size(); ++p) {
      const Io io = same_host::write_all(peers[p].get(), frame, wake.get(), std::nullopt);
      if (io != Io::kOk) {
        if (io != Io::kWoken) {
          fail(fmt::format("same-host sender: doorbell {} to rank {}: {}", sequence, p + 1,
                           same_host::describe(io, errno)));
        }
        return;
      }
    }
    // Every receiver must have copied the slot out before it is written again.
    for (std::size_t p = 0; p < peers.size(); ++p) {
      std::array<std::byte, same_host::kDataRecordBytes> record{};
      const Io io = same_host::read_exact(peers[p].get(), record, wake.get(), std::nullopt);
      if (io != Io::kOk) {
        if (io != Io::kWoken) {
          fail(fmt::format("same-host sender: waiting for rank {} to ack chunk {}: {}", p + 1,
                           sequence, same_host::describe(io, errno)));
        }
        return;
      }
      DataRecord ack;
      std::string problem;
      if (!same_host::decode(record, RecordType::kAck, geometry, ack, problem)) {
        fail(fmt::format("same-host sender: rank {} broke the protocol: {}", p + 1, problem));
        return;
      }
      if (ack.sequence != sequence || ack.slot != s || ack.bytes != n) {
        fail(fmt::format("same-host sender: rank {} acked chunk {} (slot {}, {} bytes) where "
                         "chunk {} (slot {}, {} bytes) was due",
                         p + 1, ack.sequence, ack.slot, ack.bytes, sequence, s, n));
        return;
      }
    }
  }
  end_turn();
}

void SameHostTransport::State::run_receive(std::byte* buffer, std::size_t bytes,
                                           std::uint64_t call) {
  if (!wait_turn(call)) return;
  const same_host::SlotGeometry geometry{same_host::kSlotCount, slot_bytes};
  for (std::size_t offset = 0; offset < bytes; offset += slot_bytes) {
    const std::size_t n = std::min(slot_bytes, bytes - offset);
    const std::uint64_t sequence = next_sequence++;
    std::array<std::byte, same_host::kDataRecordBytes> record{};
    const Io io = same_host::read_exact(peers[0].get(), record, wake.get(), std::nullopt);
    if (io != Io::kOk) {
      if (io != Io::kWoken) {
        fail(fmt::format("same-host rank {}: waiting for the doorbell of chunk {}: {}", rank,
                         sequence, same_host::describe(io, errno)));
      }
      return;
    }
    DataRecord doorbell;
    std::string problem;
    if (!same_host::decode(record, RecordType::kDoorbell, geometry, doorbell, problem) ||
        !(problem = same_host::check_doorbell(doorbell, sequence, n)).empty()) {
      // Nothing of this chunk is copied: the sender broke the protocol.
      fail(fmt::format("same-host rank {}: the sender broke the protocol: {}", rank, problem));
      return;
    }
    std::memcpy(buffer + offset, slot(doorbell.slot) + doorbell.offset, n);
    doorbell.type = RecordType::kAck;
    const Io sent =
        same_host::write_all(peers[0].get(), same_host::encode(doorbell), wake.get(), std::nullopt);
    if (sent != Io::kOk) {
      if (sent != Io::kWoken) {
        fail(fmt::format("same-host rank {}: ack of chunk {}: {}", rank, sequence,
                         same_host::describe(sent, errno)));
      }
      return;
    }
  }
  end_turn();
}

void SameHostTransport::check_broadcast(const void* buffer, std::size_t bytes, int root) const {
  if (root != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host broadcast on rank {}: root {}, but the sender is always "
                            "rank 0",
                            state_->rank, root));
  }
  if (buffer == nullptr && bytes > 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host broadcast on rank {}: null buffer for {} bytes",
                            state_->rank, bytes));
  }
}

SameHostTransport::SameHostTransport(std::shared_ptr<State> state) : state_(std::move(state)) {}

SameHostTransport::~SameHostTransport() {
  // A transport that goes away is, to its peers, a peer that died: they see EOF.
  state_->do_abort(fmt::format("same-host transport of rank {} was destroyed", state_->rank));
}
int SameHostTransport::rank() const { return state_->rank; }
int SameHostTransport::world_size() const { return state_->world_size; }
SameHostMemory SameHostTransport::memory() const { return state_->memory; }
std::size_t SameHostTransport::slot_bytes() const { return state_->slot_bytes; }
std::string SameHostTransport::timeline_summary() {
  return state_->device ? state_->device->timeline() : std::string();
}

void SameHostTransport::broadcast_async(void* buffer, std::size_t bytes, int root,
                                        Stream& stream) {
  if (state_->device) {
    broadcast_on_device(buffer, bytes, root, stream);
    return;
  }
  host::HostStream* host_stream = host::as_host_stream(stream);
  if (host_stream == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host transport (host memory) needs a stream from HostBackend, "
                            "got a {}",
                            type_name(typeid(stream))));
  }
  check_broadcast(buffer, bytes, root);
  const std::uint64_t call = state_->calls_enqueued++;
  if (state_->rank == 0) {
    host_stream->enqueue([state = state_, buffer, bytes, call] {
      state->run_send(static_cast<const std::byte*>(buffer), bytes, call);
    });
  } else {
    host_stream->enqueue([state = state_, buffer, bytes, call] {
      state->run_receive(static_cast<std::byte*>(buffer), bytes, call);
    });
  }
}

void SameHostTransport::broadcast_on_device(void* buffer, std::size_t bytes, int root,
                                            Stream& stream) {
  check_broadcast(buffer, bytes, root);
  if (bytes == 0) return;
  std::uint64_t first_chunk = 0;
  {
    std::lock_guard lock(state_->mutex);
    // A dead transport enqueues nothing: the broadcast completes at once, async_error() says why.
    if (state_->aborted || state_->broken) return;
    first_chunk = state_->device->reserve(bytes);
  }
  if (state_->rank == 0) {
    state_->device->send_async(static_cast<const std::byte*>(buffer), bytes, first_chunk, stream);
  } else {
    state_->device->receive_async(static_cast<std::byte*>(buffer), bytes, first_chunk, stream);
  }
}

void* SameHostTransport::staging_buffer(int index, std::size_t bytes) {
  if (state_->rank != 0 || index < 0 || index >= static_cast<int>(same_host::kSlotCount) ||
      bytes > state_->slot_bytes) {
    return nullptr;
  }
  return state_->slot(static_cast<std::uint32_t>(index));
}

void SameHostTransport::flush() {
  if (state_->rank == 0 && state_->device) state_->device->flush();
}

std::optional<std::string> SameHostTransport::async_error() {
  std::lock_guard lock(state_->mutex);
  return state_->error;
}

void SameHostTransport::abort() noexcept {
  std::string reason;
  try {
    reason = fmt::format("same-host transport aborted by rank {}", state_->rank);
  } catch (...) {
  }
  state_->do_abort(std::move(reason));
}

}  // namespace shadowsync
