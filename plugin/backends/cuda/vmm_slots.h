// Internal to the CUDA backend: the building block of the `remap` swap strategy (SwapStrategy in
// step_hook.h). Not installed; the receiver reaches it through the SlotTable, which gets it from
// CudaBackend::create_remappable_arena.
//
// A group's live weights sit at one virtual range that never moves (what a captured CUDA graph
// baked in). Each slot is a physical allocation that is also mapped at an address of its own, for
// the receiver to write through while the engine reads the live range. A swap unmaps the live range
// and maps it onto the other slot's physical memory: no byte is copied, the live address stays.
//
//   VmmSlots slots(device, bytes);          // live range mapped onto slot 0
//   write(slots.slot_address(1));           // the receiver fills the shadow through its mapping
//   slots.remap_live(1, engine_stream);     // waits for the engine stream, then remaps
//   read(slots.live_address());             // the same address now reads slot 1's bytes
//
// The driver's VMM calls are reached through cudaGetDriverEntryPointByVersion, so nothing links
// libcuda directly (CPU-only machines load the library and skip GPU work).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shadowsync::cuda_detail {

class VmmSlots {
 public:
  // Why VMM cannot be used on `device` (no device, driver without VMM, the entry points missing),
  // or an empty string when it can. Never throws.
  static std::string unsupported_reason(int device);

  // Reserves the live range and `slot_count` (>= 2) physical slots of `bytes` each, rounded up to
  // the device's recommended granularity; maps the live range onto slot 0. Throws Error
  // (kInvalidArgument for bytes == 0 or slot_count < 2; kBackend naming the failing driver call
  // and its arguments, with what was created so far released).
  VmmSlots(int device, std::size_t bytes, int slot_count = 2);
  ~VmmSlots();
  VmmSlots(const VmmSlots&) = delete;
  VmmSlots& operator=(const VmmSlots&) = delete;

  int device() const noexcept { return device_; }
  std::size_t requested_bytes() const noexcept { return requested_bytes_; }
  std::size_t mapped_bytes() const noexcept { return mapped_bytes_; }  // after rounding
  std::size_t granularity() const noexcept { return granularity_; }
  int slot_count() const noexcept { return static_cast<int>(slots_.size()); }

  // The address the engine (and its graphs) read: the same for the object's lifetime.
  void* live_address() const noexcept { return reinterpret_cast<void*>(live_); }
  // Slot i's own mapping, for the receiver: always slot i's bytes, whatever is live.
  void* slot_address(int slot) const;
  int live_slot() const noexcept { return live_slot_; }

  // Points the live range at `slot`'s physical memory. Synchronizes `engine_stream` first: work
  // still in flight on the live range must not see the unmap (the contract of the remap strategy;
  // free when the engine already synchronized at the step boundary); without `synchronize_first`
  // the caller vouches that nothing on the stream reads the range any more (a gated swap). Throws
  // Error (kInvalidArgument naming the slot and the count, before anything changes; kBackend for
  // a failing driver call, after which the live range is left unmapped and the object unusable).
  void remap_live(int slot, cudaStream_t engine_stream, bool synchronize_first = true);

 private:
  void release() noexcept;

  int device_ = 0;
  std::size_t requested_bytes_ = 0;
  std::size_t mapped_bytes_ = 0;
  std::size_t granularity_ = 0;
  std::uintptr_t live_ = 0;                 // reserved range the engine reads
  bool live_mapped_ = false;
  int live_slot_ = -1;
  std::vector<unsigned long long> slots_;   // CUmemGenericAllocationHandle per slot
  std::vector<std::uintptr_t> slot_ranges_;  // each slot's own reserved + mapped range
};

}  // namespace shadowsync::cuda_detail
