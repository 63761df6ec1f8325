// CudaBackend: the Backend interface on one CUDA device. Streams and events are CUDA streams and
// events; memory is cudaMalloc'ed device memory (never managed memory: page migration in the
// middle of a decode step would cost far more than the transfer it hides).
//
// Every call first makes the backend's device current on the calling thread (cudaSetDevice) and
// leaves it current: the receiver thread, the engine thread and test threads all call in, and
// each must be on the right device for the runtime calls that follow.
//
// Every CUDA failure throws Error(kBackend) naming the call, its arguments and CUDA's message.
// This header does not include cuda_runtime.h: native handles are spelled through CUDA's own
// opaque struct names, so `cudaStream_t` and `cudaEvent_t` convert to and from them as they are.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string_view>

#include "shadowsync/backend.h"

// CUDA's opaque handle types: cudaStream_t is CUstream_st*, cudaEvent_t is CUevent_st*.
struct CUstream_st;
struct CUevent_st;

namespace shadowsync {

using CudaStreamHandle = ::CUstream_st*;  // == cudaStream_t
using CudaEventHandle = ::CUevent_st*;    // == cudaEvent_t

class CudaBackend final : public Backend {
 public:
  // The backend of device ordinal `device`. Throws Error(kInvalidArgument) when no such device
  // exists and Error(kBackend) when CUDA fails to initialize it. Sets `device` current on the
  // calling thread.
  explicit CudaBackend(int device);
  // Frees allocations callers leaked (cudaFree waits for the device's in-flight work). Streams
  // and events made by this backend may outlive it: each owns its own handle.
  ~CudaBackend() override;

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string_view name() const override { return "cuda"; }
  int device() const noexcept { return device_; }

  // cudaMalloc, then zero-filled on a private stream and waited for before returning, so the
  // zeros are visible to every stream (a cudaMemset on the legacy stream is not ordered before
  // work on non-blocking streams). Zero bytes is Error(kInvalidArgument). Thread-safe.
  void* allocate(std::size_t bytes) override;
  // cudaFree. Note that cudaFree waits for the device's in-flight work, including a posted NCCL
  // receive: do not free while a receive may be spinning. Unknown pointers are ignored (a
  // one-time warning on stderr). Thread-safe.
  void deallocate(void* ptr) noexcept override;
  std::size_t bytes_allocated() const override;  // Thread-safe.

  // A non-blocking stream (no implicit ordering with the legacy default stream). kLow gets the
  // device's lowest priority (the numerically greatest value of cudaDeviceGetStreamPriorityRange),
  // kNormal the default priority. On current GPUs the default priority *is* the lowest one, so a
  // kLow stream yields only to streams created with a raised priority. Thread-safe.
  std::unique_ptr<Stream> create_stream(StreamPriority priority) override;
  // cudaEventDisableTiming: cheaper to record and to wait on; we never time with them.
  // Thread-safe.
  std::unique_ptr<Event> create_event() override;

  // Wraps a stream someone else owns (the engine's stream) without taking ownership: the wrapper
  // never destroys it, and the caller keeps it alive while the wrapper is in use. The stream must
  // belong to this backend's device (Error(kInvalidArgument) otherwise); nullptr names the
  // legacy default stream. Thread-safe.
  std::unique_ptr<Stream> wrap_stream(CudaStreamHandle stream);

  // cudaMemcpyAsync with cudaMemcpyDefault (unified addressing works out the direction).
  void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override;
  void memcpy_batch_async(const std::vector<CopyRegion>& copies, Stream& stream) override;
  void memcpy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                       std::size_t row_bytes, std::size_t rows, Stream& stream) override;
  // The event and the stream must belong to the same device (a CUDA rule).
  void event_record(Event& event, Stream& stream) override;
  void stream_wait_event(Stream& stream, Event& event) override;

  // cudaEventQuery: cudaErrorNotReady is false, any other failure throws Error(kBackend).
  bool event_query(Event& event) override;
  // Polls cudaEventQuery with a short back-off until done or `timeout` passes (never
  // cudaEventSynchronize, which cannot time out). Blocks the calling thread.
  bool event_wait_for(Event& event, std::chrono::nanoseconds timeout) override;
  // cudaStreamSynchronize: cannot time out; use an event and event_wait_for where a deadline
  // matters.
  void stream_synchronize(Stream& stream) override;

  // Integrity checks as kernels on `stream` (plugin/backends/cuda/integrity_kernels.cu): a memset of the
  // result, then one grid-stride reduction. `data` must be 8-byte aligned (arenas, staging
  // buffers, buckets and tensors are). Compiled and checked against the host's results only where
  // a GPU is present (tests/gpu); the receiver and sender call them only when configured to.
  bool supports_integrity() const override { return true; }
  void checksum_async(const void* data, std::size_t bytes, std::uint64_t* result,
                      Stream& stream) override;
  void count_nonfinite_async(const void* data, std::size_t elements, DType dtype,
                             std::uint64_t* result, Stream& stream) override;
  // Per-tensor FP8 quantization (Backend::quantize_fp8_async), as kernels on the stream (plugin/backends/cuda/fp8_kernels.cu).
  void quantize_fp8_async(const void* src, DType dtype, std::size_t elements, std::size_t parts,
                          void* dst, float* scales, Stream& stream) override;

  // The remap swap strategy's memory (plugin/backends/cuda/cuda_remap.cpp over VmmSlots): the reason is
  // empty where the device and driver support CUDA virtual memory management. The arena's slots
  // are rounded up to the VMM granularity and zero-filled; remap_live synchronizes the engine
  // stream (unless the caller vouches it need not), then unmaps and maps the live range. Thread-safe.
  std::string remap_unsupported_reason() const override;
  std::unique_ptr<RemappableArena> create_remappable_arena(std::size_t bytes) override;
  // A wait on a word in pinned host memory (cuStreamWaitValue32) that open() writes
  // (plugin/backends/cuda/cuda_stream_gate.cpp). Thread-safe.
  std::unique_ptr<StreamGate> create_stream_gate() override;

  // The CUDA handle behind a Stream or Event that a CudaBackend made or wrapped. Anything else is
  // Error(kInvalidArgument) naming its type. Thread-safe.
  static CudaStreamHandle native(Stream& stream);
  static CudaEventHandle native(Event& event);
  // The device ordinal a CudaBackend stream belongs to; Error(kInvalidArgument) as native().
  static int device_of(Stream& stream);

 private:
  void make_current() const;

  struct State;
  int device_;
  std::unique_ptr<State> state_;
};

}  // namespace shadowsync
