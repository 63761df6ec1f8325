// A remap arena in host memory, and a backend that makes them: the remap swap strategy on the CPU.
// Tests only.
//
// The host backend cannot remap (no virtual memory to point anywhere). HostArena keeps a live
// range and two slots as plain vectors; remap_live waits for the engine stream, as a CUDA VMM
// remap does, then copies the slot into the live range. RemapHostBackend is a CountingBackend
// that claims it can remap and makes HostArenas; every other call goes to the HostBackend it
// wraps, so an engine may enqueue on that backend's streams.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "counting_backend.h"
#include "shadowsync/backend.h"
#include "shadowsync/host_backend.h"

namespace shadowsync::testing {

class HostArena final : public RemappableArena {
 public:
  // `engine`: the backend whose streams remap_live waits for; null: it waits for none (tests
  // that never swap).
  explicit HostArena(std::size_t bytes, int live_slot = 0, HostBackend* engine = nullptr)
      : bytes_(bytes), live_(bytes), slots_{std::vector<std::byte>(bytes),
                                            std::vector<std::byte>(bytes)},
        live_slot_(live_slot), engine_(engine) {}

  // The backend whose streams remap_live waits for, when it is made after the arena; before the
  // first swap.
  void wait_for(HostBackend& engine) { engine_ = &engine; }

  std::byte* live_address() const override { return live_.data(); }
  std::size_t bytes() const override { return bytes_; }
  int live_slot() const override { return live_slot_.load(); }
  std::byte* slot_address(int slot) const override { return slots_[slot].data(); }
  void remap_live(int slot, Stream& engine_stream, bool work_before_done) override {
    if (engine_ != nullptr && !work_before_done) engine_->stream_synchronize(engine_stream);
    ++remaps;
    std::memcpy(live_.data(), slots_[slot].data(), bytes_);
    live_slot_.store(slot);
  }

  std::atomic<int> remaps{0};

 private:
  std::size_t bytes_;
  mutable std::vector<std::byte> live_;
  mutable std::vector<std::byte> slots_[2];
  std::atomic<int> live_slot_;
  HostBackend* engine_;
};

class RemapHostBackend final : public CountingBackend {
 public:
  RemapHostBackend() = default;
  explicit RemapHostBackend(HostBackend& inner) : CountingBackend(inner) {}

  std::atomic<int> arenas_made{0};

  std::string_view name() const override { return "host-remap"; }
  std::string remap_unsupported_reason() const override { return ""; }
  std::unique_ptr<RemappableArena> create_remappable_arena(std::size_t bytes) override {
    ++calls;
    ++arenas_made;
    return std::make_unique<HostArena>(bytes, 0, &inner());
  }
};

}  // namespace shadowsync::testing
