// The transport moves bucket bytes from the sender's rank to every receiver rank. NcclTransport
// is the real one; LoopbackTransport runs ranks as threads in one process.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "shadowsync/backend.h"

namespace shadowsync {

// The opaque bytes by which the ranks of one transport find each other (NCCL: its ncclUniqueId).
// One side makes it, the control plane carries it to the others as plain bytes.
struct RendezvousId {
  static constexpr std::size_t kSize = 128;
  std::array<std::byte, kSize> bytes{};

  friend bool operator==(const RendezvousId&, const RendezvousId&) = default;
};

class RouteMover;  // plugin/core/route_mover.h: routes of a sharded trainer (DESIGN §14)

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string_view name() const = 0;  // "loopback", "nccl"
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Enqueues one collective broadcast of `bytes` bytes on `stream`: rank `root` sends from
  // `buffer`, every other rank receives into `buffer`. Collective: every rank must make the same
  // calls in the same order, and each rank's stream blocks in it until all ranks have joined.
  // Returns once enqueued. One thread at a time.
  virtual void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) = 0;

  // Optional: memory this transport sends from without a copy. Rank `root`'s caller may pack the
  // bytes of its next broadcast into staging buffer `index` (0 or 1, each at least `bytes` long)
  // and pass that pointer to broadcast_async. The caller writes buffer `index` only after the
  // previous broadcast from it completed on its stream, with work enqueued after the
  // broadcast_async call that followed that broadcast returned (a transport whose receivers
  // copy out of the buffer later may hold that call until they did), and only while no
  // broadcast of another buffer is in flight that could bounce through it. nullptr (the default): the transport has
  // none, the caller uses memory of its own. The memory lives as long as the transport, and
  // streams that write it must be synchronized before the transport is destroyed.
  virtual void* staging_buffer(int index, std::size_t bytes) {
    (void)index;
    (void)bytes;
    return nullptr;
  }

  // Root rank: blocks until every broadcast enqueued so far reached every receiver, for a
  // transport whose broadcasts complete on the root's stream before that (the same-host device
  // flavour: its receivers copy the last chunk out of a staging slot after its doorbell). The
  // default does nothing: completion on the stream says as much as the transport knows (NCCL:
  // the root's part is done, which NCCL may report before every receiver has consumed the
  // bytes). One thread at a time.
  virtual void flush() {}

  // Optional: the transport moves routes of a routing plan (M trainer ranks, N engine ranks)
  // instead of broadcasting whole buckets. nullptr (the default): it broadcasts only. The mover
  // lives as long as the transport.
  virtual RouteMover* route_mover() { return nullptr; }

  // Brackets several broadcasts that are launched as one (ncclGroupStart/End). Optional.
  virtual void group_begin() {}
  virtual void group_end() {}

  // An asynchronous failure (peer lost, aborted, mismatched collective), if any. Thread-safe.
  virtual std::optional<std::string> async_error() = 0;

  // What the transport's current exchange waits on its peers for, if it waits on some (a
  // deadline's message then names the late peer: "the doorbell of bucket 0 of update 2 (group 0,
  // bucket 0) from trainer rank 1, for 10004 ms (trainer rank 0 sent its)"). The default: nothing
  // to say. Thread-safe.
  virtual std::optional<std::string> waiting_for() { return std::nullopt; }

  // Tears the communicator down: every enqueued or blocked collective returns, the transport is
  // unusable afterwards (a new one is needed, as with ncclCommAbort). Thread-safe, idempotent.
  virtual void abort() noexcept = 0;
};

}  // namespace shadowsync
