// LoopbackTransport: in-process ranks that broadcast through shared memory on HostBackend
// streams, with NCCL's blocking collective semantics and injectable faults. See
// loopback_transport.h.
#include "shadowsync/loopback_transport.h"

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "backends/host/host_stream.h"
#include "core/type_name.h"
#include "shadowsync/error.h"

namespace shadowsync {

namespace {

// One broadcast in flight, keyed by its call index (the same on every rank).
struct Collective {
  // What the first rank to arrive passed; every later rank must agree.
  int first_rank = -1;
  int root = -1;
  std::size_t bytes = 0;

  const std::byte* root_buffer = nullptr;  // set when the root arrives
  bool root_arrived = false;
  int arrived = 0;  // ranks that joined
  int copying = 0;  // non-roots reading the root's buffer now (outside the lock)
  int copied = 0;   // non-roots whose copy finished
  int present = 0;  // ranks inside the collective now

  // Every rank joined and every non-root holds the bytes.
  bool complete(int world_size) const {
    return arrived == world_size && copied == world_size - 1;
  }
};

struct RankFaults {
  std::map<std::uint64_t, std::chrono::microseconds> delays;
  std::multimap<std::uint64_t, std::size_t> flips;
  std::optional<std::uint64_t> drop_from;
  std::optional<std::string> own_error;  // set when the drop takes effect
  bool claimed = false;                  // transport(rank) was handed out
};

}  // namespace

// Shared by the communicator, every transport and every enqueued broadcast task, so that any of
// them may be destroyed first.
struct LoopbackCommunicator::State {
  explicit State(int size) : world_size(size), ranks(static_cast<std::size_t>(size)) {}

  const int world_size;

  mutable std::mutex mutex;
  std::condition_variable changed;  // any field below changed
  std::vector<RankFaults> ranks;
  std::map<std::uint64_t, Collective> collectives;
  bool aborted = false;
  std::optional<std::string> error;  // communicator-wide: the first mismatch or abort
  std::uint64_t completed = 0;

  void check_rank(int rank, const char* operation) const {
    if (rank < 0 || rank >= world_size) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("LoopbackCommunicator::{}: rank {} is out of range for world size {}",
                              operation, rank, world_size));
    }
  }

  // Marks the communicator dead and wakes every waiter. Caller holds `mutex`.
  void abort_locked(std::string reason) {
    if (!aborted) {
      aborted = true;
      if (!error) error = std::move(reason);
    }
    changed.notify_all();
  }

  // Runs on `rank`'s stream: its part of broadcast number `call`.
  void run_broadcast(int rank, std::uint64_t call, std::byte* buffer, std::size_t bytes,
                     int root) {
    std::unique_lock lock(mutex);
    RankFaults& faults = ranks[rank];
    if (faults.drop_from && call >= *faults.drop_from) {
      if (!faults.own_error) {
        faults.own_error =
            fmt::format("rank {} dropped at broadcast {} (fault injection)", rank, call);
      }
      return;  // a dead process joins nothing
    }
    if (aborted) return;
    if (auto it = faults.delays.find(call); it != faults.delays.end()) {
      // A slow link, cut short by an abort (which also keeps teardown from waiting it out).
      const auto delay = it->second;
      changed.wait_for(lock, delay, [this] { return aborted; });
      if (aborted) return;
    }

    Collective& c = collectives[call];
    if (c.first_rank < 0) {
      c.first_rank = rank;
      c.root = root;
      c.bytes = bytes;
    } else if (c.root != root || c.bytes != bytes) {
      abort_locked(fmt::format(
          "loopback broadcast {}: rank {} passed root {} and {} bytes, but rank {} passed root {} "
          "and {} bytes",
          call, rank, root, bytes, c.first_rank, c.root, c.bytes));
      return;  // never joined; the ranks inside leave on the abort and erase the entry
    }
    ++c.arrived;
    ++c.present;
    if (rank == root) {
      c.root_buffer = buffer;
      c.root_arrived = true;
      changed.notify_all();
      // Even after an abort, a non-root may still be reading this buffer: wait for it, since the
      // caller may reuse the buffer as soon as the stream moves on.
      changed.wait(lock, [&] { return c.complete(world_size) || (aborted && c.copying == 0); });
      if (c.complete(world_size)) apply_flips_locked(rank, call, buffer, bytes);
    } else {
      changed.wait(lock, [&] { return aborted || c.root_arrived; });
      if (!aborted) {
        const std::byte* source = c.root_buffer;
        ++c.copying;
        lock.unlock();
        if (bytes > 0 && buffer != source) std::memcpy(buffer, source, bytes);
        lock.lock();
        --c.copying;
        ++c.copied;
        apply_flips_locked(rank, call, buffer, bytes);
        changed.notify_all();
        // Every rank's stream stays in the collective until every rank joined, as with NCCL.
        changed.wait(lock, [&] { return aborted || c.complete(world_size); });
      }
    }
    leave_locked(call, c);
  }

  // Caller holds `mutex`.
  void apply_flips_locked(int rank, std::uint64_t call, std::byte* buffer, std::size_t bytes) {
    auto [first, last] = ranks[rank].flips.equal_range(call);
    for (auto it = first; it != last; ++it) {
      if (it->second < bytes) buffer[it->second] ^= std::byte{0xFF};
    }
  }

  // The rank leaves collective `call`; the last one out counts and erases it. Caller holds
  // `mutex`.
  void leave_locked(std::uint64_t call, Collective& c) {
    if (--c.present > 0) return;
    // Ranks that have not arrived yet can only come after an abort, which they check first.
    if (c.complete(world_size)) ++completed;
    collectives.erase(call);
  }
};

namespace {

using State = LoopbackCommunicator::State;

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<State> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  std::string_view name() const override { return "loopback"; }
  int rank() const override { return rank_; }
  int world_size() const override { return state_->world_size; }

  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override {
    host::HostStream* host_stream = host::as_host_stream(stream);
    if (host_stream == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("loopback transport needs a stream from HostBackend, got a {}",
                              type_name(typeid(stream))));
    }
    if (root < 0 || root >= state_->world_size) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("loopback broadcast on rank {}: root {} is out of range for world "
                              "size {}",
                              rank_, root, state_->world_size));
    }
    if (buffer == nullptr && bytes > 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("loopback broadcast on rank {}: null buffer for {} bytes", rank_,
                              bytes));
    }
    // Numbered now, in call order, so that a rank's n-th call meets every other rank's n-th.
    const std::uint64_t call = next_call_++;
    host_stream->enqueue([state = state_, rank = rank_, call, buffer, bytes, root] {
      state->run_broadcast(rank, call, static_cast<std::byte*>(buffer), bytes, root);
    });
  }

  std::optional<std::string> async_error() override {
    std::lock_guard lock(state_->mutex);
    if (state_->ranks[rank_].own_error) return state_->ranks[rank_].own_error;
    return state_->error;
  }

  void abort() noexcept override {
    std::lock_guard lock(state_->mutex);
    // Formatting may throw (allocation); an abort must still happen.
    std::string reason;
    try {
      reason = fmt::format("loopback communicator aborted by rank {}", rank_);
    } catch (...) {
    }
    state_->abort_locked(std::move(reason));
  }

 private:
  std::shared_ptr<State> state_;
  const int rank_;
  std::uint64_t next_call_ = 0;  // the caller's thread only ("one thread at a time")
};

}  // namespace

LoopbackCommunicator::LoopbackCommunicator(int world_size) {
  if (world_size < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("LoopbackCommunicator: world size must be >= 1, got {}", world_size));
  }
  state_ = std::make_shared<State>(world_size);
}

// Transports and enqueued broadcasts keep the state alive; nothing to wait for here.
LoopbackCommunicator::~LoopbackCommunicator() = default;

std::unique_ptr<Transport> LoopbackCommunicator::transport(int rank) {
  std::lock_guard lock(state_->mutex);
  state_->check_rank(rank, "transport");
  if (state_->ranks[rank].claimed) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("LoopbackCommunicator::transport: rank {} of {} was already taken",
                            rank, state_->world_size));
  }
  state_->ranks[rank].claimed = true;
  return std::make_unique<LoopbackTransport>(state_, rank);
}

void LoopbackCommunicator::inject_delay(int rank, std::uint64_t call,
                                        std::chrono::microseconds delay) {
  std::lock_guard lock(state_->mutex);
  state_->check_rank(rank, "inject_delay");
  state_->ranks[rank].delays[call] = delay;
}

void LoopbackCommunicator::inject_drop(int rank, std::uint64_t call) {
  std::lock_guard lock(state_->mutex);
  state_->check_rank(rank, "inject_drop");
  auto& drop_from = state_->ranks[rank].drop_from;
  if (!drop_from || call < *drop_from) drop_from = call;
}

void LoopbackCommunicator::inject_flip(int rank, std::uint64_t call, std::size_t offset) {
  std::lock_guard lock(state_->mutex);
  state_->check_rank(rank, "inject_flip");
  state_->ranks[rank].flips.emplace(call, offset);
}

std::uint64_t LoopbackCommunicator::broadcasts_completed() const {
  std::lock_guard lock(state_->mutex);
  return state_->completed;
}

}  // namespace shadowsync
