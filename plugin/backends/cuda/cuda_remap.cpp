// CudaBackend's remappable arenas: the remap swap strategy's memory, VmmSlots behind the
// backend-neutral RemappableArena interface.
#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/vmm_slots.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

class VmmRemappableArena final : public RemappableArena {
 public:
  VmmRemappableArena(int device, std::size_t bytes) : slots_(device, bytes) {
    zero_fill(device);
  }

  std::byte* live_address() const override {
    return static_cast<std::byte*>(slots_.live_address());
  }
  std::size_t bytes() const override { return slots_.requested_bytes(); }
  int live_slot() const override { return slots_.live_slot(); }
  std::byte* slot_address(int slot) const override {
    return static_cast<std::byte*>(slots_.slot_address(slot));
  }
  void remap_live(int slot, Stream& engine_stream, bool work_before_done) override {
    if (CudaBackend::device_of(engine_stream) != slots_.device()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("remap: the engine stream belongs to device {}, the arena to {}",
                              CudaBackend::device_of(engine_stream), slots_.device()));
    }
    // The driver calls act on the current context: the engine thread may be on another device.
    SHADOWSYNC_CUDA_CHECK(cudaSetDevice(slots_.device()), "device={}", slots_.device());
    slots_.remap_live(slot, CudaBackend::native(engine_stream), !work_before_done);
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
};

}  // namespace

std::string CudaBackend::remap_unsupported_reason() const {
  return cuda_detail::VmmSlots::unsupported_reason(device());
}

std::unique_ptr<RemappableArena> CudaBackend::create_remappable_arena(std::size_t bytes) {
  return std::make_unique<VmmRemappableArena>(device(), bytes);
}

}  // namespace shadowsync
