// CudaBackend's remappable arenas: the remap swap strategy's memory, VmmSlots behind the
// backend-neutral RemappableArena interface, remapped in the engine stream's order (StreamGate).
#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/stream_gate.h"
#include "backends/cuda/vmm_slots.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

class VmmRemappableArena final : public RemappableArena {
 public:
  VmmRemappableArena(int device, std::size_t bytes) : slots_(device, bytes), gate_(device) {
    zero_fill(device);
  }

  std::byte* live_address() const override {
    return static_cast<std::byte*>(slots_.live_address());
  }
  std::size_t bytes() const override { return slots_.requested_bytes(); }
  int live_slot() const override { return live_slot_.load(std::memory_order_acquire); }
  std::byte* slot_address(int slot) const override {
    return static_cast<std::byte*>(slots_.slot_address(slot));
  }
  // Returns at once: the remap itself runs on the gate's thread once the engine stream's work so
  // far has finished, and the stream's later work waits for it. Nothing is mapped twice: a slot
  // already live (as this thread last asked) is left as it is.
  void remap_live(int slot, Stream& engine_stream) override {
    if (slot < 0 || slot >= slots_.slot_count()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("VMM slots: cannot make slot {} live (there are {})", slot,
                              slots_.slot_count()));
    }
    if (CudaBackend::device_of(engine_stream) != slots_.device()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("remap: the engine stream belongs to device {}, the arena to {}",
                              CudaBackend::device_of(engine_stream), slots_.device()));
    }
    if (std::string failed = gate_.take_error(); !failed.empty()) failed_ = std::move(failed);
    if (!failed_.empty()) {
      throw Error(ErrorCode::kBackend,
                  "remap: an earlier remap failed, the live range is gone: " + failed_);
    }
    if (slot == live_slot()) return;
    gate_.enqueue(CudaBackend::native(engine_stream), [this, slot] { slots_.map_live_onto(slot); });
    live_slot_.store(slot, std::memory_order_release);
  }

 private:
  // Both slots start zero-filled, as Backend::allocate's arenas do (cuMemCreate's are not). On a
  // private stream, waited for here: the slots are new, nothing else can be using them.
  void zero_fill(int device) {
    cudaStream_t stream = nullptr;
    SHADOWSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "device={}",
                          device);
    try {
      for (int s = 0; s < slots_.slot_count(); ++s) {
        SHADOWSYNC_CUDA_CHECK(cudaMemsetAsync(slots_.slot_address(s), 0, slots_.mapped_bytes(),
                                              stream),
                              "VMM slot={} bytes={} device={}", s, slots_.mapped_bytes(), device);
      }
      SHADOWSYNC_CUDA_CHECK(cudaStreamSynchronize(stream), "device={}", device);
    } catch (...) {
      (void)cudaStreamDestroy(stream);
      throw;
    }
    (void)cudaStreamDestroy(stream);
  }

  cuda_detail::VmmSlots slots_;
  // Declared after slots_: destroyed first, so that every queued remap has run before the
  // slots go.
  cuda_detail::StreamGate gate_;
  std::atomic<int> live_slot_{0};  // as the engine thread last asked; the GPU follows in order
  std::string failed_;             // the first remap that failed (engine thread)
};

}  // namespace

std::string CudaBackend::remap_unsupported_reason() const {
  return cuda_detail::VmmSlots::unsupported_reason(device());
}

std::unique_ptr<RemappableArena> CudaBackend::create_remappable_arena(std::size_t bytes) {
  return std::make_unique<VmmRemappableArena>(device(), bytes);
}

}  // namespace shadowsync
