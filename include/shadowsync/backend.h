// The device backend: memory, streams, events and asynchronous copies. The receiver, sender and
// step hook are written once against this interface. CudaBackend is the real one; HostBackend
// gives the same asynchronous semantics on the CPU so that ordering bugs show up in CPU tests.
//
// Semantics every backend honours (those of CUDA):
// * work enqueued on one stream runs in order; enqueueing returns at once;
// * event_record captures all work enqueued on the stream so far; an event never recorded counts
//   as complete; recording again replaces what the event captures;
// * stream_wait_event makes later work on the stream wait for what the event captured at the
//   time of the call (a later re-record does not change it).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shadowsync/dtype.h"

namespace shadowsync {

class Stream {
 public:
  virtual ~Stream() = default;
};

class Event {
 public:
  virtual ~Event() = default;
};

// The memory of one group under the remap swap strategy: a live address range that never moves
// and two physical slots, each also reachable at an address of its own. Made by
// Backend::create_remappable_arena.
class RemappableArena {
 public:
  virtual ~RemappableArena() = default;
  // What the engine (and its captured CUDA graphs) read: the same for the object's lifetime.
  virtual std::byte* live_address() const = 0;
  // The bytes asked for at creation (each slot holds at least these).
  virtual std::size_t bytes() const = 0;
  // The slot the live range shows now (0 at creation).
  virtual int live_slot() const = 0;
  // Slot `slot`'s own mapping (slot 0 or 1): always that slot's bytes, whatever is live. The
  // receiver writes the shadow through it.
  virtual std::byte* slot_address(int slot) const = 0;
  // Points the live range at `slot`'s memory. Waits first until `engine_stream` has no work in
  // flight (work still reading the live range must not see its pages go away): free when the
  // engine already synchronized at the step boundary. With `work_before_done` the caller vouches
  // that nothing enqueued on `engine_stream` reads the live range any more (the gated swap: the
  // work before the stream's gate has completed, the work after it waits at the gate), and it
  // waits for nothing: waiting for the stream would wait for the closed gate. Engine thread only.
  virtual void remap_live(int slot, Stream& engine_stream, bool work_before_done) = 0;
};

// A gate on a stream (Backend::create_stream_gate), for the gated remap swap (StepHook's
// after_launch): work enqueued on the stream after close() waits until open(). Host work that
// must run between two of the stream's kernels (a remap) can then run after the engine thread has
// enqueued the later kernel, without that thread waiting for the earlier one.
class StreamGate {
 public:
  virtual ~StreamGate() = default;
  // Marks the point of `stream`'s work before the gate and makes everything enqueued on `stream`
  // afterwards wait until open(). The gate must be open (as made, or after open()). One thread.
  virtual void close(Stream& stream) = 0;
  // Blocks until the work enqueued on the stream before close() has completed, or `timeout`
  // passed; true when it has. Thread-safe: the engine thread and a watchdog may wait at once.
  virtual bool wait_work_before(std::chrono::nanoseconds timeout) = 0;
  // Lets the stream go past the gate. Never blocks and calls into no driver, so that a watchdog
  // can open the gate whatever other threads are blocked in. Thread-safe; idempotent.
  virtual void open() noexcept = 0;
};

enum class StreamPriority {
  kNormal,
  kLow,  // the receiver's stream: weight transfers yield to the engine's decode kernels
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;  // "host", "cuda"

  // Device memory, zero-filled. Throws Error(kBackend) naming the size on failure. Thread-safe.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* ptr) noexcept = 0;  // Thread-safe.
  virtual std::size_t bytes_allocated() const = 0;  // Live bytes from allocate(). Thread-safe.

  virtual std::unique_ptr<Stream> create_stream(StreamPriority priority) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;

  // Enqueue on `stream`; return at once. An event or stream is used by one thread at a time.
  virtual void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) = 0;
  // `rows` rows of `row_bytes` each, row r from src + r * src_pitch to dst + r * dst_pitch (both
  // pitches at least row_bytes): a receive plan's piece (receive_plan.h). On CUDA one
  // cudaMemcpy2DAsync (copy engines, no SMs).
  virtual void memcpy_2d_async(void* dst, std::size_t dst_pitch, const void* src,
                               std::size_t src_pitch, std::size_t row_bytes, std::size_t rows,
                               Stream& stream) = 0;
  // Several independent copies, in stream order as a whole (the copies among themselves in any
  // order): a copy_in swap into the engine's own tensors. The default enqueues one memcpy_async
  // each; CUDA makes it one cudaMemcpyBatchAsync call (one host call for hundreds of tensors).
  struct CopyRegion {
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
  };
  virtual void memcpy_batch_async(const std::vector<CopyRegion>& copies, Stream& stream);
  virtual void event_record(Event& event, Stream& stream) = 0;
  virtual void stream_wait_event(Stream& stream, Event& event) = 0;

  // Host side.
  virtual bool event_query(Event& event) = 0;  // true once the captured work completed
  // Blocks until the event completes or `timeout` passes; returns event_query().
  virtual bool event_wait_for(Event& event, std::chrono::nanoseconds timeout) = 0;
  virtual void stream_synchronize(Stream& stream) = 0;

  // Integrity checks of received bytes (optional; both backends of this project have them). The
  // defaults of the two calls below throw Error(kBackend) naming the backend and the call.
  virtual bool supports_integrity() const { return false; }
  // Enqueues on `stream`: writes to `*result` (8 bytes of this backend's memory) the checksum of
  // the `bytes` bytes at `data`, as plugin/core/integrity.h defines it. One thread at a time per
  // stream.
  virtual void checksum_async(const void* data, std::size_t bytes, std::uint64_t* result,
                              Stream& stream);
  // Enqueues on `stream`: writes to `*result` how many of the `elements` elements of `dtype` at
  // `data` are NaN or infinite. kFloat32, kFloat16 and kBFloat16 only (other dtypes throw
  // Error(kInvalidArgument) naming it). One thread at a time per stream.
  virtual void count_nonfinite_async(const void* data, std::size_t elements, DType dtype,
                                     std::uint64_t* result, Stream& stream);

  // FP8 quantization as vLLM computes it after loading (optional; both backends of this project
  // have it): enqueues on `stream` the per-part quantization of `elements` elements of `dtype`
  // (kBFloat16, kFloat16, kFloat32) at `src`, cut into `parts` equal consecutive parts (one for
  // a layer, one per expert of a MoE layer): per part, scales[part] = max|x| / 448 (float32) and
  // each element float8_e4m3fn(x / scale) into `dst` (`elements` bytes;
  // plugin/core/fp8_quantize.h has the arithmetic). `src` and `dst` must not overlap. The
  // default throws Error(kBackend) naming the backend. One thread at a time per stream.
  virtual void quantize_fp8_async(const void* src, DType dtype, std::size_t elements,
                                  std::size_t parts, void* dst, float* scales, Stream& stream);

  // Virtual memory remapping, for the remap swap strategy (optional). Why this backend cannot
  // remap (no VMM, no such device), or an empty string when it can. The default names the
  // backend. Never throws. Thread-safe.
  virtual std::string remap_unsupported_reason() const;
  // Reserves a live range and two zero-filled physical slots of at least `bytes` each, the live
  // range on slot 0. The default throws Error(kBackend) with remap_unsupported_reason().
  virtual std::unique_ptr<RemappableArena> create_remappable_arena(std::size_t bytes);

  // A gate for this backend's streams (optional: the gated remap swap). The default throws
  // Error(kBackend) naming the backend.
  virtual std::unique_ptr<StreamGate> create_stream_gate();
};

// True for the dtypes count_nonfinite_async checks (the non-finite guard's floating tensors).
inline bool dtype_has_nonfinite_check(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

// RAII owner of a backend allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend& backend, std::size_t bytes)
      : backend_(&backend), ptr_(backend.allocate(bytes)), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = other.backend_;
      ptr_ = other.ptr_;
      bytes_ = other.bytes_;
      other.ptr_ = nullptr;
      other.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void reset() noexcept {
    if (ptr_ != nullptr) backend_->deallocate(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  std::byte* data() const { return static_cast<std::byte*>(ptr_); }
  std::size_t size() const { return bytes_; }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace shadowsync
